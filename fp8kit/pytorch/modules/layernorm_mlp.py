"""LayerNormMLP: norm -> fc1 -> activation -> fc2 with Transformer Engine's signature, parameter names and FP8 state
layout. The norm and the activation run in high precision; fc1 and fc2 are FP8 GEMMs (fp8kit's `fp8_linear`, as in
`Linear`), so the fused module computes exactly what `LayerNorm`, `Linear`, the activation and `Linear` compute
one after the other.

State layout (Transformer Engine's, two GEMMs in one module): `fp8_meta["scaling_fwd"]` slots `[fc1 input (the
norm's output), fc1 weight, fc1 output (unused), fc2 input (the activation's output), fc2 weight, fc2 output
(unused)]`; `fp8_meta["scaling_bwd"]` slots `[fc1 grad_output, fc1 grad_input (unused), fc2 grad_output, fc2
grad_input (unused)]`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from ...recipe import DelayedScaling
from ..distributed import check_shared_scales, gather_with_grad, tensor_parallel
from ..fp8_weights import is_quantized_weight, quantize_weight_parameter, quantized_init_settings
from ..recompute import in_backward
from .activation import activation, activation_saving_input, check_activation, is_gated
from .base import FP8StateMixin
from .linear_base import linear_call, track_gemm_backwards
from .linear_function import WeightGradStore
from .norm import check_eps, check_normalization, normalize
from .setup import (
    accept_userbuffer_options,
    default_init_method,
    divide,
    gemm_plan,
    high_precision_gemm_plan,
    init_parameter,
    keep_cached_weight,
    resolve_tensor_parallel,
    returned_bias,
)

__all__ = ["LayerNormMLP"]

_KIND = "LayerNormMLP"


def _size(name: str, value) -> int:
    """A feature size: an int >= 0 (0 is a layer with nothing to multiply, as Transformer Engine allows)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{_KIND}: {name} must be an int >= 0, got {value!r}")
    return value


class LayerNormMLP(FP8StateMixin, torch.nn.Module):
    """`fc2(act(fc1(norm(x))))`, fc1 and fc2 in FP8 inside `fp8kit.pytorch.autocast`.

    Args (Transformer Engine's, in its order):
      hidden_size, ffn_hidden_size: the input/output size and the intermediate size (the full sizes).
      eps, normalization ("LayerNorm" or "RMSNorm"), zero_centered_gamma: the norm, as in `LayerNormLinear`.
      sequence_parallel, tp_group, tp_size, set_parallel_mode: with `set_parallel_mode=True` and more than one
        rank, fc1 is column-parallel (`fc1_weight` `[ffn/tp (x2 gated), hidden]`) and fc2 row-parallel
        (`fc2_weight` `[hidden, ffn/tp]`); with `sequence_parallel` the input and output are split along their first
        dimension. Without `set_parallel_mode` nothing is split (as fp8kit's `Linear` without `parallel_mode`).
      return_bias: do not add fc2's bias, return it: `forward` gives `(out, fc2_bias)`.
      get_rng_state_tracker: initialise the weights under this tracker's RNG state.
      init_method, output_layer_init_method: `f(weight)` for fc1_weight and fc2_weight (default normal, std 0.023).
      bias: fc1 and fc2 have biases (zeros at first).
      activation: one of fp8kit.pytorch.modules.activation.ACTIVATIONS (Transformer Engine's formulas; gated ones
        give fc1 `2 * ffn_hidden_size` outputs, the first half gated). activation_params: for "clamped_swiglu".
      fuse_wgrad_accumulation: fc1's and fc2's weight gradients are added, in float32, into `weight.main_grad`.
      params_dtype (or `dtype`), device: the parameters'.
      return_layernorm_output, return_layernorm_output_gathered: also return the norm's output (gathered along
        the sequence with sequence parallelism and the second option).
      seq_length, micro_batch_size: Transformer Engine's JIT warm-up sizes: accepted, no effect.
      ub_*, symmetric_ar_type: communication overlap in Transformer Engine: accepted, no effect on results.
      delay_wgrad_compute: leave both weight-gradient GEMMs for `backward_dw()`.
      checkpoint: recompute the module's forward in the backward pass instead of saving its activations (fp8kit
        recomputes the whole module, with the FP8 scales of the original forward: the same numbers).
      name: the module's name (used in messages).

    Parameters, in Transformer Engine's order: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `fc1_weight`,
    `fc1_bias`, `fc2_weight`, `fc2_bias` (the biases are None with `bias=False`).

    forward(inp, is_first_microbatch=None) returns `out`, then fc2's bias if `return_bias`, then the norm's output if
    `return_layernorm_output`.
    """

    fp8_gemm_names = ("fc1", "fc2")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device=None,
        ub_overlap_ag: bool = False,
        name: Optional[str] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        checkpoint: bool = False,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        torch.nn.Module.__init__(self)
        self.hidden_size = _size("hidden_size", hidden_size)
        self.ffn_hidden_size = _size("ffn_hidden_size", ffn_hidden_size)
        self.normalization = check_normalization(_KIND, normalization)
        self.eps = check_eps(_KIND, eps)
        self.activation = activation
        self.activation_params = check_activation(_KIND, activation, activation_params)
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"{_KIND}: params_dtype={params_dtype} and dtype={dtype} disagree")
        params_dtype = params_dtype or dtype or torch.get_default_dtype()
        for arg, value in (("zero_centered_gamma", zero_centered_gamma), ("set_parallel_mode", set_parallel_mode),
                           ("checkpoint", checkpoint)):
            if not isinstance(value, bool):
                raise TypeError(f"{_KIND}: {arg} must be a bool, got {value!r}")
        accept_userbuffer_options(_KIND, symmetric_ar_type, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                                  ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                                  ub_bulk_wgrad=ub_bulk_wgrad)
        self.zero_centered_gamma, self.set_parallel_mode, self.checkpoint = (zero_centered_gamma, set_parallel_mode,
                                                                             checkpoint)
        self.tensor_parallel, self.tp_size = resolve_tensor_parallel(
            "column" if set_parallel_mode else None, tp_group, tp_size, sequence_parallel)
        split = set_parallel_mode and self.tp_size > 1
        self.sequence_parallel = bool(sequence_parallel) and split
        self.size_per_partition = divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size") if split \
            else ffn_hidden_size
        fc1_out = 2 * self.size_per_partition if is_gated(activation) else self.size_per_partition
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered) and self.return_layernorm_output
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        # one store per GEMM (the plans get them): backward_dw runs fc2's then fc1's, as Transformer Engine
        self.wgrad_store = None
        self.wgrad_stores = (WeightGradStore(), WeightGradStore()) if delay_wgrad_compute else None
        self.save_original_input = False
        self.get_rng_state_tracker = get_rng_state_tracker
        self.init_method, self.output_layer_init_method = init_method, output_layer_init_method
        self.name, self.symmetric_ar_type = name, symmetric_ar_type
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size

        shapes = (("layer_norm_weight", (hidden_size,), True),
                  ("layer_norm_bias", (hidden_size,), normalization == "LayerNorm"),
                  ("fc1_weight", (fc1_out, hidden_size), True), ("fc1_bias", (fc1_out,), self.use_bias),
                  ("fc2_weight", (hidden_size, self.size_per_partition), True),
                  ("fc2_bias", (hidden_size,), self.use_bias))
        for pname, shape, present in shapes:  # Transformer Engine's registration order
            self.register_parameter(pname, torch.nn.Parameter(torch.empty(shape, device=device, dtype=params_dtype))
                                    if present else None)
        self._fp8_label = (f"{_KIND}(hidden_size={hidden_size}, ffn_hidden_size={ffn_hidden_size}, "
                           f"activation={activation}, bias={bias}"
                           + (f", tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}" if split else "")
                           + (f", name={name!r}" if name else "") + ")")
        self._init_fp8_meta(num_gemms=2)
        self.fp8_weight_cache: Dict[int, object] = {}
        self.fp8_stats = None  # a fp8kit.pytorch.stats.ModuleStats while fp8kit.pytorch.enable_stats is on
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Transformer Engine's initialisation: the norm's gamma = 1 (0 with `zero_centered_gamma`), beta = 0;
        `init_method(fc1_weight)`, `output_layer_init_method(fc2_weight)` (default normal, std 0.023, in this
        order, under `get_rng_state_tracker`'s state if given); zero biases. Under `quantized_model_init` the two
        weights become Float8Tensor parameters, as `Linear`'s."""
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            for p in (self.layer_norm_bias, self.fc1_bias, self.fc2_bias):
                if p is not None:
                    p.zero_()
        init_parameter(self.fc1_weight, self.init_method or default_init_method(), self.get_rng_state_tracker, None)
        init_parameter(self.fc2_weight, self.output_layer_init_method or default_init_method(),
                       self.get_rng_state_tracker, None)
        if self.sequence_parallel:  # Megatron all-reduces the gradients of parameters marked so
            for p in (self.layer_norm_weight, self.layer_norm_bias, self.fc2_bias):
                if p is not None:
                    p.sequence_parallel = True
        settings = quantized_init_settings()  # under quantized_model_init: FP8 weight parameters
        for gemm, name in enumerate(("fc1_weight", "fc2_weight")):
            if settings is not None and not is_quantized_weight(getattr(self, name)):
                quantize_weight_parameter(self, name, gemm, settings)

    # ---- tensor parallelism ----

    @property
    def tp_group(self):
        """The tensor-parallel process group, or None."""
        return None if self.tensor_parallel is None else self.tensor_parallel.group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supply the group (of size `tp_size`) of a module built with `set_parallel_mode=True`, `tp_size` and no
        group."""
        tp = tensor_parallel("column" if self.set_parallel_mode else None, tp_group, self.sequence_parallel)
        if tp is not None and tp.size != self.tp_size:
            raise ValueError(f"{_KIND}.set_tensor_parallel_group: the group has {tp.size} ranks, the module was built "
                             f"for tp_size={self.tp_size}")
        self.tensor_parallel = tp

    def _parallel(self):
        """(fc1's TensorParallel, fc2's), or (None, None)."""
        tp = self.tensor_parallel
        if tp is None:
            if self.set_parallel_mode and self.tp_size > 1:
                raise RuntimeError(f"{_KIND}(tp_size={self.tp_size}) has no tensor-parallel group: call "
                                   "set_tensor_parallel_group(group) before the first forward")
            return None, None
        return tp, dataclasses.replace(tp, mode="row")

    def current_scaling_groups(self, gemm: int = 0):
        """fc1 is column-parallel, fc2 row-parallel: each cast of a tensor split over the group (gathered ones
        included) reduces its amax over the group, so the FP8 bytes equal a single-process run's."""
        tp = self.tensor_parallel
        if tp is None:
            return None, None, None
        group, sp = tp.group, tp.sequence_parallel
        if gemm == 0:  # column: the input is whole unless sequence-parallel; the output gradient is split
            return group if sp else None, group, group
        return group, group, group if sp else None  # row: the input is split; dy is whole unless sequence-parallel

    # ---- forward ----

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """`inp` `[..., hidden_size]` -> `[..., hidden_size]` (and fc2's bias / the norm's output, see the class).

        is_first_microbatch: None casts both weights at every call; True casts them and caches the FP8 weights;
          False reuses the cache (and with `fuse_wgrad_accumulation`, True makes the weight gradients overwrite
          `main_grad`).
        """
        if self.checkpoint and torch.is_grad_enabled() and not in_backward():
            return torch_checkpoint.checkpoint(self._forward, inp, is_first_microbatch, use_reentrant=False)
        return self._forward(inp, is_first_microbatch)

    def _forward(self, inp, is_first_microbatch):
        if not isinstance(inp, torch.Tensor) or inp.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"{_KIND}: input of shape {tuple(getattr(inp, 'shape', ()))} does not end with "
                             f"hidden_size={self.hidden_size}")
        tp1, tp2 = self._parallel()
        ln_w, ln_b, w1, b1, w2, b2 = (self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight, self.fc1_bias,
                                      self.fc2_weight, self.fc2_bias)
        call = self.begin_fp8_call((inp, ln_w, ln_b, w1, b1, w2, b2), w1.device)
        ln_out = normalize(self.normalization, inp, ln_w, ln_b, self.eps, self.zero_centered_gamma)
        if call is not None:
            plans = self._fp8_plans(call, tp1, tp2, is_first_microbatch, (inp, ln_w, ln_b, w1, b1), (w2, b2))
        else:
            stores = self.wgrad_stores or (None, None)
            plans = (high_precision_gemm_plan(self, tp1, is_first_microbatch, w1, stores[0]),
                     high_precision_gemm_plan(self, tp2, is_first_microbatch, w2, stores[1]))
        fc1_out = linear_call(_KIND, ln_out, w1, b1, plans[0], self.hidden_size)
        act = activation_saving_input if call is not None else activation
        act_out = act(self.activation, fc1_out, self.activation_params)
        out = linear_call(_KIND, act_out, w2, None if self.return_bias else b2, plans[1], self.size_per_partition)
        if call is not None:
            for gemm, plan in enumerate(plans):
                keep_cached_weight(self, gemm, plan, is_first_microbatch, call)
        results = [out]
        if self.return_bias:
            results.append(returned_bias(b2, inp))
        if self.return_layernorm_output:
            if self.return_layernorm_output_gathered and tp1 is not None and tp1.sequence_parallel:
                ln_out = gather_with_grad(ln_out, tp1.group)
            results.append(ln_out)
        return results[0] if len(results) == 1 else tuple(results)

    def _fp8_plans(self, call, tp1, tp2, is_first_microbatch, fc1_leaves, fc2_leaves):
        if tp1 is not None and tp1.sequence_parallel and any(call.fp8) \
                and isinstance(call.frame.recipe, DelayedScaling):
            check_shared_scales(call.frame, tp1)  # fc1 gathers its FP8 input, fc2 its FP8 output gradient
        plans = (gemm_plan(self, call, 0, tp1, is_first_microbatch, self.fc1_weight),
                 gemm_plan(self, call, 1, tp2, is_first_microbatch, self.fc2_weight))
        # fc1's backward follows fc2's: both report to the step, which updates after the last
        track_gemm_backwards(call, plans, [fc1_leaves, fc1_leaves + fc2_leaves])
        if self.wgrad_stores is not None:
            for plan, store in zip(plans, self.wgrad_stores):
                plan.wgrad_store = store
        return plans

    # ---- delayed weight gradients ----

    def need_backward_dw(self) -> bool:
        """Whether `backward_dw()` has weight gradients to compute (`delay_wgrad_compute=True`)."""
        return self.wgrad_stores is not None and any(len(s) for s in self.wgrad_stores)

    def backward_dw(self) -> None:
        """Compute the weight gradients a backward left for later (`delay_wgrad_compute=True`): fc2's, then fc1's
        (the oldest of each), into `.grad` (accumulated) or `main_grad` with `fuse_wgrad_accumulation`."""
        if self.wgrad_stores is None:
            return
        for store in reversed(self.wgrad_stores):
            compute = store.pop()
            if compute is not None:
                compute()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}, eps={self.eps}, "
                f"bias={self.use_bias}, set_parallel_mode={self.set_parallel_mode}, tp_size={self.tp_size}")
