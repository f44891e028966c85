"""fp8kit's Linear: Transformer Engine's `Linear` (signature, defaults, parameter names), whose three GEMMs run in FP8
inside `autocast` (fp8kit.pytorch.modules.linear_function), and which is a `torch.nn.Linear` subclass behaving
exactly like one outside an enabled autocast."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Union

import torch

from .linear_base import LinearBase
from .setup import returned_bias

__all__ = ["Linear"]


class Linear(LinearBase, torch.nn.Linear):
    """`y = x @ weight.T + bias`, with FP8 GEMMs inside `fp8kit.pytorch.autocast`.

    Transformer Engine's signature, positional order included. Parameters `weight` `[out_features, in_features]`
    and `bias` `[out_features]` (local sizes under tensor parallelism, as in Transformer Engine), initialised as
    Transformer Engine does: `init_method(weight)` (default: normal, std 0.023) and a zero bias. Inputs have any
    leading dimensions: `[..., in_features] -> [..., out_features]`. Outside an enabled autocast it computes exactly
    `torch.nn.functional.linear`.

    Args (Transformer Engine's):
      in_features, out_features: the full (unsplit) sizes.
      sequence_parallel: the activations outside the layer are split along their FIRST dimension (`[s, b, h]`): a
        column layer all-gathers its input (as FP8 bytes under FP8), a row layer reduce-scatters its output.
      fuse_wgrad_accumulation: add the weight gradient, in float32, into `weight.main_grad` (which the caller
        allocates, as Megatron does) instead of returning it; the first microbatch (`is_first_microbatch=True`)
        overwrites it.
      tp_group, tp_size: the tensor-parallel group (its size wins), or a size whose group
        `set_tensor_parallel_group` supplies later.
      get_rng_state_tracker, rng_tracker_name: initialise the weight under this tracker's named RNG state.
      init_method: `f(weight)` initialising the weight in place.
      bias, return_bias: with `return_bias=True` the bias is not added but returned: `forward` gives `(y, bias)`.
      params_dtype: the parameters' dtype (default torch's default dtype); `dtype` is accepted as an alias.
      parallel_mode: None, "column" (weight `[out_features / tp, in_features]`) or "row" (`[out_features,
        in_features / tp]`).
      parameters_split: split the weight (and bias) along the output into named parameters: a tuple of names
        (equal parts) or a dict of name -> size; `("query_", "key_", "value_")` gives `query_weight`, ...
      device: where the parameters live (default: torch's default device, not CUDA as in Transformer Engine).
      ub_*, symmetric_ar_type: communication-overlap options of Transformer Engine: accepted, no effect on results.
      delay_wgrad_compute: leave the weight-gradient GEMM for `backward_dw()`.
      save_original_input: keep the high-precision input for wgrad instead of its FP8 cast (current scaling only).
      name: the module's name (used in messages).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Union[Sequence[str], Dict[str, int]]] = None,
        device=None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
        *,
        dtype: Optional[torch.dtype] = None,
    ):
        torch.nn.Module.__init__(self)
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"Linear: params_dtype={params_dtype} and dtype={dtype} disagree")
        self._setup_linear(
            "Linear", in_features, out_features, sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name, init_method=init_method,
            bias=bias, return_bias=return_bias, params_dtype=params_dtype or dtype or torch.get_default_dtype(),
            parallel_mode=parallel_mode, parameters_split=parameters_split, device=device,
            delay_wgrad_compute=delay_wgrad_compute, save_original_input=save_original_input, name=name,
            ub_name=ub_name, symmetric_ar_type=symmetric_ar_type,
            ub_options=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                            ub_bulk_wgrad=ub_bulk_wgrad))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Transformer Engine's initialisation (see `reset_linear_parameters`)."""
        self.reset_linear_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """`inp` `[..., in_features]` -> `[..., out_features]` (and the bias, with `return_bias=True`).

        is_first_microbatch: None casts the weight at every call; True casts it and caches the FP8 weight; False
          reuses that cache (gradient accumulation over microbatches). With `fuse_wgrad_accumulation`, True also
          makes the weight gradient overwrite `main_grad`.
        fp8_output, fp8_grad: Transformer Engine's FP8 outputs for FP8 attention, which fp8kit does not implement.
        """
        y = self.linear_forward(inp, is_first_microbatch, fp8_output, fp8_grad)
        return (y, returned_bias(self.full_bias(), inp)) if self.return_bias else y

    def extra_repr(self) -> str:
        extra = f", parallel_mode={self.parallel_mode}, tp_size={self.tp_size}, " \
            f"sequence_parallel={self.sequence_parallel}" if self.parallel_mode else ""
        dtype = getattr(self, self.weight_names[0]).dtype
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"dtype={dtype}" + extra)
