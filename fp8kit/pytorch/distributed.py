"""fp8kit on torch.distributed: the errors of amax reduction's rules, `apply_pending_updates`, and the
collectives of tensor-parallel layers (SPEC section 9; docs/distributed.md explains the choices). The collective
update itself lives in fp8kit.pytorch.amax_reduction, the errors and group ranks the rule checks share in
fp8kit.pytorch.dist_rules (below the autocast stack, which calls the checks; this module sits above it).

Tensor parallelism. `gather_along_first_dim`, `reduce_scatter_along_first_dim`, `all_reduce_sum` and
`all_gather_fp8` (FP8 bytes moved as uint8) are what `Linear(parallel_mode=...)` calls; the sequence dimension is the
first dimension of the input, as in Transformer Engine (`[s, b, h]`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from .autocast import current_frame, run_pending_backward
from .dist_rules import (
    DistributedRuleError,
    RegistrationMismatchError,
    _dist,
    group_ranks,
    label_states,
    state_label,
)
from .recompute import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled
from .registry import reduce_group
from .tensor.storage import Float8TensorStorage

__all__ = ["DistributedRuleError", "RegistrationMismatchError", "apply_pending_updates", "label_states",
           "state_label", "group_ranks", "TensorParallel", "gather_with_grad",
           "all_gather_fp8", "gather_along_first_dim", "reduce_scatter_along_first_dim", "all_reduce_sum",
           "shard_linear_parameters", "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase"]


def apply_pending_updates() -> None:
    """Run now the backward-state updates that amax reduction defers to the next outermost autocast entry.

    Call it on every rank of the reduction group, outside autocast, before saving a checkpoint or reading
    `fp8_meta["scaling_bwd"]` after the last step. See docs/distributed.md."""
    if current_frame() is not None:
        raise RuntimeError("apply_pending_updates: call it outside fp8kit.pytorch.autocast")
    run_pending_backward()


# ---- tensor parallelism -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How a module is split: `mode` "column" (weight `[out/tp, in]`) or "row" (`[out, in/tp]`) over `group`
    (`size` ranks, this one at `rank`); `sequence_parallel`: the activations outside the module are split along
    their first (sequence) dimension."""

    mode: str
    group: object
    size: int
    rank: int
    sequence_parallel: bool

    def __deepcopy__(self, memo):
        return self  # a process group is a process-wide handle (and cannot be copied): copies of a module share it

    @property
    def gathers_input(self) -> bool:
        return self.mode == "column" and self.sequence_parallel

    @property
    def gathers_grad_output(self) -> bool:
        return self.mode == "row" and self.sequence_parallel


def tensor_parallel(parallel_mode: Optional[str], tp_group, sequence_parallel: bool) -> Optional[TensorParallel]:
    """Validate a module's tensor-parallel arguments; None when the module is not split (no mode or no group)."""
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and parallel_mode is None:
        raise ValueError("sequence_parallel=True needs parallel_mode='column' or 'row'")
    if parallel_mode is None or tp_group is None:
        return None  # as in Transformer Engine: no tp_group means a tensor-parallel size of 1
    dist = _dist()
    if not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialised")
    return TensorParallel(parallel_mode, tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group),
                          sequence_parallel)


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def gather_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0 (rank order)."""
    size = len(group_ranks(group))
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(out, x, group)
    return out


def all_gather_fp8(q: Float8TensorStorage, group) -> Float8TensorStorage:
    """All-gather a Float8Tensor along dim 0 as FP8 bytes (uint8 on the wire). Every rank must have cast with the
    same scale; the result carries this rank's `scale_inv`."""
    data = gather_along_first_dim(q._data.contiguous(), group)
    return Float8TensorStorage(data=data, fp8_scale_inv=q._scale_inv, fp8_dtype=q._fp8_dtype, fake_dtype=q.dtype,
                               scale_inv_value=q.scale_inv_value)


class _GatherAlongFirstDim(torch.autograd.Function):
    """All-gather along dim 0 whose backward reduce-scatters: every rank's use of the gathered tensor contributes a
    partial gradient (the tensor-parallel convention)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_first_dim(grad, ctx.group), None


def gather_with_grad(x: torch.Tensor, group) -> torch.Tensor:
    """`gather_along_first_dim` with autograd: the gradient of the local block is the sum over ranks of their
    gradients of it (a reduce-scatter)."""
    return _GatherAlongFirstDim.apply(x, group)


def reduce_scatter_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's block of rows (dim 0 split in rank order)."""
    dist = _dist()
    size = len(group_ranks(group))
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter: the first dimension ({x.shape[0]}) is not divisible by {size} ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns `x`."""
    dist = _dist()
    dist.all_reduce(x, group=group)
    return x


_SHARED_SCALES: Dict[Tuple[bool, object, object], bool] = {}


def check_shared_scales(frame, tp: TensorParallel) -> None:
    """A quantized all-gather under delayed scaling needs every rank of the tensor-parallel group to hold the same
    scale, which amax reduction over a group that contains the tensor-parallel group guarantees."""
    cache_key = (frame.recipe.reduce_amax, frame.group, tp.group)
    ok = _SHARED_SCALES.get(cache_key)
    if ok is None:
        ok = reduce_group(frame.recipe, frame.group) is not None and \
            set(group_ranks(tp.group)) <= set(group_ranks(frame.group))
        _SHARED_SCALES[cache_key] = ok
    if not ok:
        raise ValueError(
            "Linear(sequence_parallel=True) under DelayedScaling casts before an FP8 all-gather, which needs the same "
            "scale on every tensor-parallel rank: use reduce_amax=True (the default) and an amax_reduction_group "
            "that contains the tensor-parallel group (None: the default group)")


def shard_linear_parameters(layer, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    """Copy this rank's shard of a full `weight` `[out, in]` (and `bias` `[out]`) into a tensor-parallel fp8kit
    Linear (or the whole tensors into one that is not split)."""
    tp = getattr(layer, "tensor_parallel", None)
    w, b = weight, bias
    if tp is not None and tp.mode == "column":
        w = weight.chunk(tp.size, dim=0)[tp.rank]
        b = None if bias is None else bias.chunk(tp.size)[tp.rank]
    elif tp is not None:
        w = weight.chunk(tp.size, dim=1)[tp.rank]
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
