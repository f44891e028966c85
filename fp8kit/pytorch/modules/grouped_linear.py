"""GroupedLinear: `num_gemms` linear layers applied to consecutive row blocks of one input (the experts of a
mixture-of-experts layer), with Transformer Engine's signature, parameter names (`weight0`, `bias0`, `weight1`, ...)
and FP8 state layout: GEMM i owns forward slots `3i + [input, weight, output]` and backward slots
`2i + [grad_output, grad_input]` of the module's one `fp8_meta`. Each GEMM is fp8kit's `fp8_linear` on its rows, so
the module computes exactly what `num_gemms` separate `Linear`s compute on the same rows."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from ...recipe import DelayedScaling, Recipe
from ..fp8_weights import is_quantized_weight, quantize_weight_parameter, quantized_init_settings
from .base import FP8StateMixin
from .linear_base import linear_call, track_gemm_backwards
from .linear_function import WeightGradStore
from .setup import (
    default_init_method,
    divide,
    gemm_plan,
    high_precision_gemm_plan,
    init_parameter,
    keep_cached_weight,
    returned_bias,
)
from .splits import check_splits

__all__ = ["GroupedLinear", "is_module_grouped_tensor_path_supported"]


def is_module_grouped_tensor_path_supported(recipe: Optional[Recipe], dtype: torch.dtype) -> bool:
    """Whether GroupedLinear can run Transformer Engine's packed grouped-tensor path (`use_grouped_tensor=True`,
    single grouped parameters) for `recipe` and `dtype`. Always False in fp8kit, which has no such path (the
    constructor refuses those options); GroupedLinear always runs one GEMM per split."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe or None, got {type(recipe).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return False

_KIND = "GroupedLinear"


class GroupedLinear(FP8StateMixin, torch.nn.Module):
    """`y_i = x_i @ weight{i}.T + bias{i}` for the row blocks `x_i` of the input given by `m_splits`.

    Args (Transformer Engine's, in its order): num_gemms, in_features, out_features, sequence_parallel,
    fuse_wgrad_accumulation, tp_group, tp_size, get_rng_state_tracker, rng_tracker_name, init_method, bias,
    return_bias, params_dtype (or `dtype`), parallel_mode, device, ub_overlap_rs, ub_overlap_ag, ub_name,
    delay_wgrad_compute, save_original_input, single_grouped_weight, single_grouped_bias, name, use_grouped_tensor.

    As in Transformer Engine, the module runs no tensor-parallel collective (the MoE dispatch and combine do):
    `parallel_mode` ("column" / "row") with `tp_size` (or `tp_group`'s size) only sets the local weight shapes, a
    bias is refused with more than one rank, and current scaling is refused with more than one rank (its amaxes
    would not be reduced). `single_grouped_weight` / `single_grouped_bias` (Transformer Engine's experimental packed
    parameters) and Userbuffers overlap are refused. `use_grouped_tensor=True` asks for Transformer Engine's native
    grouped-tensor GEMM path, which fp8kit does not have: as Transformer Engine does where that path is unsupported,
    the module falls back to one GEMM per split (`is_module_grouped_tensor_path_supported` answers False), and with
    `delay_wgrad_compute=True` and a bias `backward_dw` refuses that implicit fallback (RuntimeError).

    forward(inp, m_splits, is_first_microbatch=None): `inp` `[..., in_features]` seen as `[rows, in_features]`;
    `m_splits` (`num_gemms` ints >= 0 summing to the rows) gives each GEMM its consecutive rows. Returns
    `[..., out_features]`, and with `return_bias` the list of biases (not added).
    """

    def __init__(
        self,
        num_gemms: int,
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
        device=None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        torch.nn.Module.__init__(self)
        for arg, value, low in (("num_gemms", num_gemms, 1), ("in_features", in_features, 0),
                                ("out_features", out_features, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{_KIND}: {arg} must be an int >= {low}, got {value!r}")
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError(f"{_KIND}: Userbuffers overlap (ub_overlap_rs / ub_overlap_ag) is not supported, as in "
                             "Transformer Engine")
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(f"{_KIND}: use_grouped_tensor must be a bool or None, got {use_grouped_tensor!r}")
        self.use_grouped_tensor = bool(use_grouped_tensor)
        for arg, value in (("single_grouped_weight", single_grouped_weight),
                           ("single_grouped_bias", single_grouped_bias)):
            if value:
                raise NotImplementedError(f"{_KIND}({arg}=True): Transformer Engine's experimental packed grouped "
                                          "parameters are not implemented in fp8kit; use one parameter per GEMM")
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"{_KIND}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"{_KIND}: params_dtype={params_dtype} and dtype={dtype} disagree")
        params_dtype = params_dtype or dtype or torch.get_default_dtype()
        if tp_group is not None:
            import torch.distributed as dist

            tp_size = dist.get_world_size(tp_group)
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"{_KIND}: tp_size must be an int >= 1, got {tp_size!r}")
        if tp_size > 1 and bias:
            raise ValueError(f"{_KIND}: bias=True with tp_size={tp_size}: the tensor-parallel communication happens "
                             "outside the module, so it cannot add a bias once (as in Transformer Engine)")
        self.num_gemms, self.parallel_mode, self.tp_size, self._tp_group = num_gemms, parallel_mode, tp_size, tp_group
        self.sequence_parallel = bool(sequence_parallel) and tp_size > 1
        self.in_features = divide(in_features, tp_size, "in_features") if parallel_mode == "row" else in_features
        self.out_features = divide(out_features, tp_size, "out_features") if parallel_mode == "column" \
            else out_features
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.wgrad_store = None  # gemm_plan's single store; one per GEMM instead, see backward_dw
        self.wgrad_stores = tuple(WeightGradStore() for _ in range(num_gemms)) if delay_wgrad_compute else None
        self.save_original_input = bool(save_original_input)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.init_method = init_method
        self.name, self.ub_name = name, ub_name
        for i in range(num_gemms):  # Transformer Engine's order: weight0, bias0, weight1, ...
            self.register_parameter(f"weight{i}", torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, device=device, dtype=params_dtype)))
            self.register_parameter(f"bias{i}", torch.nn.Parameter(
                torch.empty(self.out_features, device=device, dtype=params_dtype)) if self.use_bias else None)
        self.fp8_gemm_names = tuple(f"gemm{i}" for i in range(num_gemms))
        self._fp8_label = (f"{_KIND}(num_gemms={num_gemms}, in_features={in_features}, out_features={out_features}, "
                           f"bias={bias}" + (f", name={name!r}" if name else "") + ")")
        self._init_fp8_meta(num_gemms=num_gemms)
        self.fp8_weight_cache: Dict[int, object] = {}
        self.fp8_stats = None  # a fp8kit.pytorch.stats.ModuleStats while fp8kit.pytorch.enable_stats is on
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Transformer Engine's initialisation: `init_method(weight{i})` for i = 0, 1, ... (default normal, std
        0.023), under `get_rng_state_tracker`'s state if given; zero biases. Under `quantized_model_init` the
        weights become Float8Tensor parameters, as `Linear`'s."""
        init_fn = self.init_method or default_init_method()
        for i in range(self.num_gemms):
            init_parameter(getattr(self, f"weight{i}"), init_fn, self.get_rng_state_tracker, self.rng_tracker_name)
            if self.use_bias:
                with torch.no_grad():
                    getattr(self, f"bias{i}").zero_()
        settings = quantized_init_settings()  # under quantized_model_init: FP8 weight parameters
        for i in range(self.num_gemms):
            if settings is not None and not is_quantized_weight(getattr(self, f"weight{i}")):
                quantize_weight_parameter(self, f"weight{i}", i, settings)

    @property
    def tp_group(self):
        """The tensor-parallel process group given at construction or by `set_tensor_parallel_group`, or None."""
        return self._tp_group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Record the tensor-parallel group (the module runs no collective with it)."""
        self._tp_group = tp_group

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None):
        """`inp` `[..., in_features]` -> `[..., out_features]`, GEMM i on the i-th block of `m_splits[i]` rows (and
        the list of biases with `return_bias`).

        is_first_microbatch: None casts every weight at every call; True casts them and caches the FP8 weights;
          False reuses the cache (with `fuse_wgrad_accumulation`, True makes the weight gradients overwrite
          `main_grad`).
        """
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1 or inp.shape[-1] != self.in_features:
            raise ValueError(f"{_KIND}: input of shape {tuple(getattr(inp, 'shape', ()))} does not end with "
                             f"in_features={self.in_features}")
        x = inp.reshape(math.prod(inp.shape[:-1]), self.in_features)  # in_features may be 0
        splits = check_splits(_KIND, m_splits, self.num_gemms, x.shape[0])
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        applied = [None] * self.num_gemms if self.return_bias else biases
        call = self.begin_fp8_call([inp] + weights + biases, weights[0].device)
        if call is None:
            stores = self.wgrad_stores or (None,) * self.num_gemms
            plans = [high_precision_gemm_plan(self, None, is_first_microbatch, w, store)
                     for w, store in zip(weights, stores)]
        else:
            if self.tp_size > 1 and not isinstance(call.frame.recipe, DelayedScaling):
                raise ValueError(f"{_KIND}: current scaling with tp_size={self.tp_size} is not supported (the module "
                                 "runs no collective to reduce the split weights' amaxes), as in Transformer Engine")
            plans = [gemm_plan(self, call, i, None, is_first_microbatch, w) for i, w in enumerate(weights)]
            # the GEMMs' backwards run in no fixed order: each reports, the step updates after the last
            track_gemm_backwards(call, plans, [(inp, w, b) for w, b in zip(weights, biases)])
            if self.wgrad_stores is not None:
                for plan, store in zip(plans, self.wgrad_stores):
                    plan.wgrad_store = store
        outs = [linear_call(_KIND, part, w, b, plan, self.in_features)
                for part, w, b, plan in zip(x.split(splits), weights, applied, plans)]
        if call is not None:
            for i, plan in enumerate(plans):
                keep_cached_weight(self, i, plan, is_first_microbatch, call)
        out = torch.cat(outs).reshape(*inp.shape[:-1], self.out_features)
        return (out, returned_bias(biases, inp)) if self.return_bias else out

    # ---- delayed weight gradients ----

    def need_backward_dw(self) -> bool:
        """Whether `backward_dw()` has weight gradients to compute (`delay_wgrad_compute=True`)."""
        return self.wgrad_stores is not None and any(len(s) for s in self.wgrad_stores)

    def backward_dw(self) -> None:
        """Compute the weight gradients a backward left for later (`delay_wgrad_compute=True`), the oldest of each
        GEMM, into `.grad` (accumulated) or `main_grad` with `fuse_wgrad_accumulation`."""
        if self.wgrad_stores is None:
            return
        if self.use_grouped_tensor and self.use_bias and any(len(store) for store in self.wgrad_stores):
            raise RuntimeError(f"{_KIND}(use_grouped_tensor=True) ran the per-split GEMM path (fp8kit has no native "
                               "grouped-tensor path), whose bias gradients come with the delayed weight gradients: "
                               "this implicit fallback is unsupported with delay_wgrad_compute=True. Set "
                               "use_grouped_tensor=False to select the per-split path explicitly")
        for store in self.wgrad_stores:
            compute = store.pop()
            if compute is not None:
                compute()

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}" + (f", parallel_mode={self.parallel_mode}, tp_size={self.tp_size}"
                                           if self.parallel_mode else ""))
