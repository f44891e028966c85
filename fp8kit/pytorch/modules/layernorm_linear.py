"""LayerNormLinear: a LayerNorm or RMSNorm followed by an FP8 Linear, with Transformer Engine's signature and parameter
names (`layer_norm_weight`, `layer_norm_bias`, `weight`, `bias`). The norm runs in high precision and its output is
cast to FP8 for the GEMM, which is exactly what `LayerNorm` then `Linear` compute: the fused module changes no
number."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Union

import torch

from ..distributed import gather_with_grad
from .linear_base import LinearBase
from .norm import check_eps, check_normalization, normalize
from .setup import returned_bias

__all__ = ["LayerNormLinear"]


class LayerNormLinear(LinearBase, torch.nn.Module):
    """`norm(x) @ weight.T + bias`, the GEMMs in FP8 inside `fp8kit.pytorch.autocast`.

    Args (Transformer Engine's, in its order): in_features, out_features, eps, sequence_parallel,
    fuse_wgrad_accumulation, tp_group, tp_size, get_rng_state_tracker, init_method, bias, normalization
    ("LayerNorm" or "RMSNorm"), return_bias, params_dtype, parallel_mode (None or "column": the norm needs the
    whole input row), return_layernorm_output (also return the norm's output), return_layernorm_output_gathered
    (with sequence parallelism, return it gathered along the sequence; its gradient is reduce-scattered back),
    parameters_split, zero_centered_gamma, device, ub_* (accepted, no effect), delay_wgrad_compute,
    symmetric_ar_type (accepted, no effect), name. See `Linear` for the shared ones.

    forward(inp, is_first_microbatch=None) returns `out`, then the bias if `return_bias`, then the norm's output if
    `return_layernorm_output`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Union[Sequence[str], Dict[str, int]]] = None,
        zero_centered_gamma: bool = False,
        device=None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        name: Optional[str] = None,
        *,
        rng_tracker_name: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        torch.nn.Module.__init__(self)
        kind = "LayerNormLinear"
        self.normalization = check_normalization(kind, normalization)
        self.eps = check_eps(kind, eps)
        if parallel_mode == "row":
            raise ValueError("LayerNormLinear: parallel_mode='row' would normalise a slice of each row; use "
                             "parallel_mode='column' or None (Transformer Engine's placement)")
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"{kind}: params_dtype={params_dtype} and dtype={dtype} disagree")
        params_dtype = params_dtype or dtype or torch.get_default_dtype()
        if not isinstance(zero_centered_gamma, bool):
            raise TypeError(f"{kind}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered) and self.return_layernorm_output
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(in_features, device=device, dtype=params_dtype))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.empty(in_features, device=device, dtype=params_dtype))
        else:
            self.register_parameter("layer_norm_bias", None)
        self._setup_linear(
            kind, in_features, out_features, sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name, init_method=init_method,
            bias=bias, return_bias=return_bias, params_dtype=params_dtype, parallel_mode=parallel_mode,
            parameters_split=parameters_split, device=device, delay_wgrad_compute=delay_wgrad_compute,
            save_original_input=False, name=name, ub_name=ub_name, symmetric_ar_type=symmetric_ar_type,
            ub_options=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                            ub_bulk_wgrad=ub_bulk_wgrad))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The norm's gamma = 1 (0 with `zero_centered_gamma`) and beta = 0; then `Linear`'s initialisation."""
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()
        if self.sequence_parallel:  # Megatron all-reduces the gradients of parameters marked so
            self.layer_norm_weight.sequence_parallel = True
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.sequence_parallel = True
        self.reset_linear_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        if not isinstance(inp, torch.Tensor) or inp.shape[-1:] != (self.in_features,):
            raise ValueError(f"LayerNormLinear: input of shape {tuple(getattr(inp, 'shape', ()))} does not end with "
                             f"in_features={self.in_features}")
        ln_out = normalize(self.normalization, inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                           self.zero_centered_gamma)
        out = self.linear_forward(ln_out, is_first_microbatch, fp8_output, fp8_grad)
        results = [out]
        if self.return_bias:
            results.append(returned_bias(self.full_bias(), inp))
        if self.return_layernorm_output:
            tp = self.tensor_parallel
            if self.return_layernorm_output_gathered and tp is not None and tp.gathers_input:
                ln_out = gather_with_grad(ln_out, tp.group)
            results.append(ln_out)
        return results[0] if len(results) == 1 else tuple(results)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"normalization={self.normalization}, eps={self.eps}, parallel_mode={self.parallel_mode}")
