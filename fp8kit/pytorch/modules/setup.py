"""What the layers of the family share around their GEMMs: tensor-parallel arguments, Transformer Engine's parameter
creation and initialisation (including `parameters_split`), operand checks, and the `LinearPlan` of one GEMM of a
forward call (quantizers, cached FP8 weight, fast accumulation, weight-gradient options)."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..compiled import compiling
from ..distributed import TensorParallel, tensor_parallel
from ..fp8_weights import check_quantized_weight, is_quantized_weight
from ..recipe_families import FAMILIES
from ..tensor.float8_tensor import as_storage
from ..tensor.storage import Float8TensorStorage
from .base import FP8Call
from .linear_function import LinearPlan

__all__ = ["resolve_tensor_parallel", "default_init_method", "init_parameter", "weight_splits", "check_operands",
           "gemm_plan", "high_precision_gemm_plan", "accept_userbuffer_options", "divide"]

_UB_OPTIONS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
               "ub_overlap_rs_fprop", "ub_overlap_ag_fprop", "ub_overlap_rs_dgrad")


def accept_userbuffer_options(where: str, symmetric_ar_type=None, **options) -> None:
    """Transformer Engine's userbuffers (communication/GEMM overlap) and symmetric all-reduce options change how
    collectives overlap, not what they compute: fp8kit accepts them and runs the plain collectives (said once)."""
    used = [k for k, v in options.items() if v and k != "ub_name"]
    if symmetric_ar_type is not None:
        used.append(f"symmetric_ar_type={symmetric_ar_type!r}")
    if used and where not in _WARNED:
        _WARNED.add(where)
        warnings.warn(f"fp8kit {where}: {', '.join(used)} only overlap communication with GEMMs in Transformer "
                      "Engine (userbuffers); fp8kit runs the same computation with plain torch.distributed "
                      "collectives", stacklevel=3)


_WARNED: set = set()


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def resolve_tensor_parallel(parallel_mode: Optional[str], tp_group, tp_size: int,
                            sequence_parallel: bool) -> Tuple[Optional[TensorParallel], int]:
    """(TensorParallel or None, tp size) from Transformer Engine's arguments: `tp_group` sets the size; without a
    group, `tp_size` partitions the parameters and `set_tensor_parallel_group` must supply the group before the
    first forward. Sequence parallelism takes effect with a parallel mode and more than one rank."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_group is None:
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        return None, tp_size
    tp = tensor_parallel(parallel_mode, tp_group, sequence_parallel and parallel_mode is not None)
    return tp, (tp.size if tp is not None else 1)


def returned_bias(bias, inp: torch.Tensor):
    """A bias that a module returns instead of adding (`return_bias=True`), in the activation dtype as Transformer
    Engine returns it: torch.autocast's dtype inside torch.autocast, else the input's dtype (a list: each)."""
    if bias is None:
        return None
    device_type = inp.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else inp.dtype
    if isinstance(bias, (list, tuple)):
        return [None if b is None else b.to(dtype) for b in bias]
    return bias.to(dtype)


def default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """Transformer Engine's default weight initialisation: normal, mean 0, std 0.023."""
    return lambda t: torch.nn.init.normal_(t, mean=0.0, std=0.023)


def init_parameter(param: torch.Tensor, init_fn: Callable, get_rng_state_tracker: Optional[Callable],
                   rng_tracker_name: Optional[str]) -> None:
    """Run `init_fn(param)` (without autograd), under the tracker's named RNG state when one is given."""
    with torch.no_grad():
        if get_rng_state_tracker is None:
            init_fn(param)
            return
        tracker = get_rng_state_tracker()
        with (tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()):
            init_fn(param)


def weight_splits(parameters_split: Union[None, Sequence[str], Dict[str, int]], out_features: int,
                  tp_size: int, column: bool) -> Tuple[List[str], List[str], List[int]]:
    """(weight names, bias names, local sizes) of Transformer Engine's `parameters_split`: None is one `weight` and
    `bias`; a sequence of names splits the output rows evenly; a dict gives each name its size. Trailing
    underscores are stripped (`"query_"` -> `query_weight`). Column-parallel layers split each part over the ranks."""
    if parameters_split is None:
        names, sizes = [""], [out_features]
    elif isinstance(parameters_split, dict):
        if not parameters_split:
            raise ValueError("parameters_split: cannot split the weight into 0 parameters")
        names, sizes = list(parameters_split), list(parameters_split.values())
    elif isinstance(parameters_split, (list, tuple)) and parameters_split \
            and all(isinstance(n, str) for n in parameters_split):
        if out_features % len(parameters_split):
            raise ValueError(f"parameters_split: out_features={out_features} does not split evenly into "
                             f"{len(parameters_split)} parameters")
        names, sizes = list(parameters_split), [out_features // len(parameters_split)] * len(parameters_split)
    else:
        raise TypeError(f"parameters_split must be None, a tuple of names or a dict of name -> size, got "
                        f"{parameters_split!r}")
    if sum(sizes) != out_features:
        raise ValueError(f"parameters_split: sizes {sizes} do not add up to out_features={out_features}")
    if column:
        sizes = [divide(s, tp_size, "a parameters_split size") for s in sizes]
    stems = [n.rstrip("_") for n in names]
    weights = [f"{s}_weight" if s else "weight" for s in stems]
    biases = [f"{s}_bias" if s else "bias" for s in stems]
    return weights, biases, sizes


def check_operands(where: str, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   in_features: int, autocast_on: bool):
    """Validate the input of a layer and apply torch.autocast's dtype to the operands; returns (inp, weight, bias)."""
    if not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
        raise TypeError(f"{where}: input must be a floating tensor, got {getattr(inp, 'dtype', type(inp))}")
    if inp.shape[-1:] != (in_features,):
        raise ValueError(f"{where}: input of shape {tuple(inp.shape)} does not end with in_features={in_features}")
    if autocast_on:
        dtype = torch.get_autocast_dtype(inp.device.type)
        inp = inp.to(dtype)
        if not is_quantized_weight(weight):  # a quantized weight keeps its bytes (and its nominal dtype)
            weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        if is_quantized_weight(weight):
            return inp, weight, bias
    if inp.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"{where}: input dtype {inp.dtype} does not match weight dtype {weight.dtype}"
            + (f" and bias dtype {bias.dtype}" if bias is not None else "")
            + "; cast the input or the module, or run under torch.autocast")
    if inp.device != weight.device:
        raise ValueError(f"{where}: input is on {inp.device} but the weight is on {weight.device}")
    return inp, weight, bias


def gemm_plan(module, call: FP8Call, gemm: int, tp: Optional[TensorParallel], is_first_microbatch: Optional[bool],
              weight_param: Optional[torch.nn.Parameter]) -> LinearPlan:
    """The LinearPlan of GEMM `gemm` of `module` in this call. The module provides `fuse_wgrad_accumulation`,
    `wgrad_store`, `save_original_input`, `fp8_stats` and a `fp8_weight_cache` dict (gemm -> Float8Tensor)."""
    frame = call.frame
    recipe = frame.recipe
    if is_first_microbatch is not None and (frame.graph or compiling()):
        raise NotImplementedError(
            f"{type(module).__name__}(is_first_microbatch={is_first_microbatch}): caching the FP8 weight across "
            "microbatches keeps Python state between calls, which torch.compile and captured graphs cannot; pass "
            "is_first_microbatch=None inside them")
    input_q, weight_q, grad_q = call.quantizers(gemm)
    if module.fp8_stats is not None and not call.replay:
        module.fp8_stats.attach(input_q, weight_q, grad_q, gemm)
    if call.replay:
        cached = call.cached_weight(gemm)
    else:
        cached = _cached_weight(module, gemm, is_first_microbatch, frame.enabled, weight_q, weight_param)
        if cached is not None:
            call.reused_weight(gemm, cached)
    if is_quantized_weight(weight_param):  # a weight made by quantized_model_init: its bytes, no cast
        check_quantized_weight(module, weight_param, weight_q)
        cached = as_storage(weight_param)
    plan = LinearPlan(input_q, weight_q, grad_q, call.fp8, call.calibrate, cached, call.step, call.track_backward, tp)
    FAMILIES[type(recipe)].configure_plan(plan, recipe, module, call)
    plan.save_original_input = module.save_original_input
    return _weight_grad_options(plan, module, is_first_microbatch, weight_param, module.wgrad_store)


_NO_FP8 = (False, False, False)


def high_precision_gemm_plan(module, tp: Optional[TensorParallel], is_first_microbatch: Optional[bool],
                             weight_param: Optional[torch.nn.Parameter], store) -> Optional[LinearPlan]:
    """The plan of a GEMM outside FP8 (no autocast, or enabled=False): None (plain `torch.nn.functional.linear`)
    unless the GEMM is split over a tensor-parallel group or its weight gradient goes into `main_grad`
    (`fuse_wgrad_accumulation`) or to `backward_dw` (`store`, a WeightGradStore: `delay_wgrad_compute`), which
    Transformer Engine does in any precision."""
    wgrad = (module.fuse_wgrad_accumulation or store is not None) and weight_param is not None \
        and weight_param.requires_grad and torch.is_grad_enabled()
    if tp is None and not wgrad:
        return None
    plan = LinearPlan(None, None, None, _NO_FP8, tp=tp)
    return _weight_grad_options(plan, module, is_first_microbatch, weight_param, store) if wgrad else plan


def _weight_grad_options(plan: LinearPlan, module, is_first_microbatch, weight_param, store) -> LinearPlan:
    plan.weight_param = weight_param
    plan.fuse_wgrad = module.fuse_wgrad_accumulation
    plan.overwrite_main_grad = is_first_microbatch is True
    if store is not None:
        plan.wgrad_store = store
    return plan


def _cached_weight(module, gemm: int, is_first_microbatch, enabled: bool, weight_q, weight):
    """The weight cached by the last `is_first_microbatch=True` call, if the recipe's weight quantizer makes
    operands of its kind (class and format: the recipe may have changed in between)."""
    cache = module.fp8_weight_cache.get(gemm)
    if is_first_microbatch is False and enabled and cache is not None and _same_kind(cache, weight_q) \
            and weight is not None and cache.device == weight.device:
        return cache
    return None


def _same_kind(operand, weight_q) -> bool:
    block = getattr(weight_q, "quantizer", None)  # the block families' RoleQuantizer
    if block is None:
        return isinstance(operand, Float8TensorStorage) and operand.fp8_dtype == weight_q.fp8_dtype
    return isinstance(operand, block._storage_class) and operand._fp8_dtype == block.dtype


def keep_cached_weight(module, gemm: int, plan: LinearPlan, is_first_microbatch, call: FP8Call) -> None:
    """After the GEMM ran: cache its FP8 weight when `is_first_microbatch` asks for it."""
    if is_first_microbatch is not None and call.frame.enabled and not call.replay:
        module.fp8_weight_cache[gemm] = plan.weight_fp8
