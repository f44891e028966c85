"""The one GEMM call path of every module (`linear_call`), and what the layers with one (possibly split) weight
share: Transformer Engine's parameter layout and initialisation, tensor parallelism, the forward of the weight's
GEMM (FP8 or high precision), delayed weight gradients. `Linear` and `LayerNormLinear` derive from `LinearBase`;
LayerNormMLP and GroupedLinear call `linear_call` per GEMM, so a fused module gives the numbers of the same
`Linear`s called one after the other."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ...recipe import DelayedScaling
from ..distributed import check_shared_scales, tensor_parallel
from ..fp8_weights import is_quantized_weight, quantize_weight_parameter, quantized_init_settings
from ..gemm import check_cuda_shape
from .base import FP8Call, FP8StateMixin
from .linear_function import LinearPlan, WeightGradStore, fp8_linear
from .setup import (
    accept_userbuffer_options,
    check_operands,
    default_init_method,
    divide,
    gemm_plan,
    high_precision_gemm_plan,
    init_parameter,
    keep_cached_weight,
    resolve_tensor_parallel,
    weight_splits,
)

__all__ = ["LinearBase", "linear_call", "track_gemm_backwards"]


def _parameter(module: torch.nn.Module, name: str):
    """`getattr(module, name)` for a registered parameter, without torch.nn.Module's `__getattr__` (every call
    reads the weight and bias); names that are not in `_parameters` now (a parametrization, a plain attribute) are
    looked up as usual."""
    found = module._parameters.get(name)
    return found if found is not None else getattr(module, name)


def linear_call(where: str, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                plan: Optional[LinearPlan], in_features: int) -> torch.Tensor:
    """`inp @ weight.T + bias` for `inp` `[..., in_features]`: the one GEMM call path of every module (Linear,
    LayerNormLinear, LayerNormMLP's fc1 and fc2, GroupedLinear's GEMMs, attention's projections). `plan` None:
    torch.nn.functional.linear; else `fp8_linear` on the 2-D view of the input (torch.autocast's dtype applied to
    the operands first) with the plan's tensor-parallel collectives. `where` names the module in errors."""
    if plan is None:
        return F.linear(inp, weight, bias)
    autocast_on = torch.is_autocast_enabled(inp.device.type)
    inp, weight, bias = check_operands(where, inp, weight, bias, in_features, autocast_on)
    tp = plan.tp
    if tp is not None and tp.sequence_parallel:
        if inp.dim() < 2:
            raise ValueError(f"{where}(sequence_parallel=True): the input needs a sequence dimension first, got "
                             f"shape {tuple(inp.shape)}")
        if tp.mode == "row" and inp.shape[0] % tp.size:
            raise ValueError(f"{where}(sequence_parallel=True): the sequence dimension ({inp.shape[0]}) of the "
                             f"row-parallel GEMM's input must be divisible by the tensor-parallel size {tp.size}")
    leading = inp.shape[:-1]
    x = inp if inp.dim() == 2 else inp.reshape(math.prod(leading), in_features)
    if autocast_on:  # the operands are cast already; the GEMMs pick their dtypes
        with torch.autocast(x.device.type, enabled=False):
            y = fp8_linear(x, weight, bias, plan)
    else:
        y = fp8_linear(x, weight, bias, plan)
    if tp is not None and tp.sequence_parallel:
        first = leading[0] * tp.size if tp.mode == "column" else leading[0] // tp.size
        leading = (first,) + tuple(leading[1:])
    return y if inp.dim() == 2 and y.shape[0] == leading[0] else y.reshape(*leading, y.shape[-1])


def track_gemm_backwards(call: FP8Call, plans: Sequence[LinearPlan], operands: List[Sequence]) -> None:
    """Make every GEMM whose backward will run report to the step's backward update (`operands[g]`: the leaf tensors
    GEMM g's backward depends on; its autograd node runs when one of them requires grad)."""
    runs = [any(t is not None and t.requires_grad for t in group) for group in operands]
    for plan, run in zip(plans, runs):
        plan.track_backward = call.track_backward and run
    if call.track_backward:
        call.count_gemm_backwards(sum(runs))


class LinearBase(FP8StateMixin):
    """Mixed into a torch.nn.Module holding one weight `[out_features, in_features]` (possibly split into named
    parameters) and its bias; see `Linear` for the arguments."""

    def _setup_linear(self, kind: str, in_features: int, out_features: int, *, sequence_parallel: bool,
                      fuse_wgrad_accumulation: bool, tp_group, tp_size: int, get_rng_state_tracker: Optional[Callable],
                      rng_tracker_name: Optional[str], init_method: Optional[Callable], bias: bool,
                      return_bias: bool, params_dtype: torch.dtype, parallel_mode: Optional[str],
                      parameters_split, device, delay_wgrad_compute: bool, save_original_input: bool,
                      name: Optional[str], ub_name: Optional[str], symmetric_ar_type, ub_options: dict) -> None:
        """Set the attributes and create the weight and bias parameters (not initialised: `reset_parameters`)."""
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{kind}: {arg} must be an int >= 0, got {value!r}")
        accept_userbuffer_options(kind, symmetric_ar_type, **ub_options)
        self.tensor_parallel, self.tp_size = resolve_tensor_parallel(parallel_mode, tp_group, tp_size,
                                                                     sequence_parallel)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1 and parallel_mode is not None
        column, row = parallel_mode == "column", parallel_mode == "row"
        self.in_features = divide(in_features, self.tp_size, "in_features") if row else in_features
        self.out_features = divide(out_features, self.tp_size, "out_features") if column else out_features
        self.weight_names, self.bias_names, self.parameter_split_sizes = weight_splits(
            parameters_split, out_features, self.tp_size, column)
        if parameters_split is not None and (fuse_wgrad_accumulation or delay_wgrad_compute):
            raise ValueError(f"{kind}: fuse_wgrad_accumulation and delay_wgrad_compute need one weight parameter, "
                             "not parameters_split")
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.wgrad_store = WeightGradStore() if delay_wgrad_compute else None
        self.save_original_input = bool(save_original_input)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.init_method = init_method
        self.name, self.ub_name, self.symmetric_ar_type = name, ub_name, symmetric_ar_type
        self._kind = kind
        weight = torch.empty(self.out_features, self.in_features, device=device, dtype=params_dtype)
        offsets = [0]
        for size in self.parameter_split_sizes:
            offsets.append(offsets[-1] + size)
        for wname, start, end in zip(self.weight_names, offsets, offsets[1:]):
            self.register_parameter(wname, torch.nn.Parameter(weight[start:end]))
        if self.use_bias:
            full_bias = torch.empty(self.out_features, device=device, dtype=params_dtype)
            for bname, start, end in zip(self.bias_names, offsets, offsets[1:]):
                self.register_parameter(bname, torch.nn.Parameter(full_bias[start:end]))
        elif self.weight_names == ["weight"]:
            self.register_parameter("bias", None)
        self._fp8_label = (f"{kind}(in_features={in_features}, out_features={out_features}, bias={bias}"
                           + (f", parallel_mode={parallel_mode}, tp_size={self.tp_size}, "
                              f"sequence_parallel={self.sequence_parallel}" if parallel_mode else "")
                           + (f", name={name!r}" if name else "") + ")")
        self._init_fp8_meta(num_gemms=1)
        self.fp8_weight_cache: Dict[int, object] = {}
        self.fp8_stats = None  # a fp8kit.pytorch.stats.ModuleStats while fp8kit.pytorch.enable_stats is on

    # ---- parameters ----

    def reset_linear_parameters(self) -> None:
        """Transformer Engine's initialisation: `init_method` (default normal, std 0.023) on each weight, under
        `get_rng_state_tracker`'s state if given; zeros for the bias."""
        init_fn = self.init_method or default_init_method()
        for wname in self.weight_names:
            init_parameter(getattr(self, wname), init_fn, self.get_rng_state_tracker, self.rng_tracker_name)
        if self.use_bias:
            with torch.no_grad():
                for bname in self.bias_names:
                    getattr(self, bname).zero_()
        settings = quantized_init_settings()
        if settings is not None and not is_quantized_weight(getattr(self, self.weight_names[0])):
            if len(self.weight_names) > 1:
                raise ValueError(f"{self._kind}: FP8 weights (quantized_model_init) cannot be split into several "
                                 "parameters (parameters_split), as in Transformer Engine")
            quantize_weight_parameter(self, self.weight_names[0], 0, settings)

    def full_weight(self) -> torch.Tensor:
        """The weight `[out_features, in_features]` (the split parameters concatenated, with autograd)."""
        names = self.weight_names
        if len(names) == 1:
            return _parameter(self, names[0])
        return torch.cat([getattr(self, n) for n in names])

    def full_bias(self) -> Optional[torch.Tensor]:
        if not self.use_bias:
            return None
        names = self.bias_names
        if len(names) == 1:
            return _parameter(self, names[0])
        return torch.cat([getattr(self, n) for n in names])

    # ---- tensor parallelism ----

    @property
    def tp_group(self):
        """The tensor-parallel process group, or None."""
        return None if self.tensor_parallel is None else self.tensor_parallel.group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supply the tensor-parallel group (of size `tp_size`) of a layer built with `tp_size` and no group."""
        tp = tensor_parallel(self.parallel_mode, tp_group, self.sequence_parallel)
        if tp is not None and tp.size != self.tp_size:
            raise ValueError(f"{self._kind}.set_tensor_parallel_group: the group has {tp.size} ranks, the layer was "
                             f"built for tp_size={self.tp_size}")
        self.tensor_parallel = tp

    def current_scaling_groups(self, gemm: int = 0):
        """Every tensor split over the tensor-parallel group (gathered ones included) is cast with the amax of the
        whole tensor, so the FP8 bytes equal a single-process run's; replicated tensors need no reduction."""
        tp = self.tensor_parallel
        if tp is None:
            return None, None, None
        column, sp, group = tp.mode == "column", tp.sequence_parallel, tp.group
        return group if (sp or not column) else None, group, group if (sp or column) else None

    # ---- forward ----

    def linear_forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool], fp8_output: bool = False,
                       fp8_grad: bool = False) -> torch.Tensor:
        """The weight's GEMM on `inp` `[..., in_features]` (bias added unless `return_bias`)."""
        if fp8_output or fp8_grad:
            raise NotImplementedError(f"{self._kind}(fp8_output=True / fp8_grad=True) returns FP8 tensors for FP8 "
                                      "attention in Transformer Engine, which fp8kit does not implement")
        weight, bias = self.full_weight(), self.full_bias()
        tp = self.tensor_parallel
        if self.tp_size > 1 and tp is None and self.parallel_mode is not None:
            raise RuntimeError(f"{self._kind}(tp_size={self.tp_size}) has no tensor-parallel group: call "
                               "set_tensor_parallel_group(group) before the first forward")
        applied_bias = None if self.return_bias else bias
        # the parameters too: under a reentrant checkpoint's no_grad forward, a split weight (torch.cat) and a
        # LayerNormLinear's norm output do not require grad, yet a recompute with a backward follows
        call = self.begin_fp8_call((inp, weight, bias), weight.device, self._parameters.values())
        if call is None:
            plan = None
            if tp is not None or self.fuse_wgrad_accumulation or self.wgrad_store is not None:
                param = weight if len(self.weight_names) == 1 else None
                plan = high_precision_gemm_plan(self, tp, is_first_microbatch, param, self.wgrad_store)
            if plan is None:
                return F.linear(inp, weight, applied_bias)
            return linear_call(self._kind, inp, weight, applied_bias, plan, self.in_features)
        return self._forward_fp8(inp, weight, applied_bias, call, is_first_microbatch)

    def _forward_fp8(self, inp, weight, bias, call, is_first_microbatch):
        tp = self.tensor_parallel
        if inp.is_cuda and any(call.fp8):
            rows = math.prod(inp.shape[:-1]) * (tp.size if tp is not None and tp.gathers_input else 1)
            check_cuda_shape(rows, weight.shape[1], weight.shape[0])
        if tp is not None and isinstance(call.frame.recipe, DelayedScaling) and (
                (tp.gathers_input and (call.fp8[0] or call.fp8[2]))
                or (tp.gathers_grad_output and (call.fp8[1] or call.fp8[2]))):
            check_shared_scales(call.frame, tp)
        param = weight if len(self.weight_names) == 1 else None  # the parameter itself (`full_weight`)
        plan = gemm_plan(self, call, 0, tp, is_first_microbatch, param)
        y = linear_call(self._kind, inp, weight, bias, plan, self.in_features)
        keep_cached_weight(self, 0, plan, is_first_microbatch, call)
        return y

    # ---- delayed weight gradients ----

    def need_backward_dw(self) -> bool:
        """Whether `backward_dw()` has weight gradients to compute (`delay_wgrad_compute=True`)."""
        return self.wgrad_store is not None and len(self.wgrad_store) > 0

    def backward_dw(self) -> None:
        """Compute the weight gradient a backward left for later (`delay_wgrad_compute=True`), oldest first: into
        `weight.grad` (accumulated), or into `weight.main_grad` with `fuse_wgrad_accumulation`."""
        if self.wgrad_store is None:
            return
        compute = self.wgrad_store.pop()
        if compute is not None:
            compute()
