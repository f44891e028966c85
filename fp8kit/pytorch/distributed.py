"""fp8kit on torch.distributed: the amax all-reduce of delayed scaling with its registration check, and the
collectives of tensor-parallel Linear layers (SPEC section 9; docs/distributed.md explains the choices).

Amax reduction. With `DelayedScaling(reduce_amax=True)` and torch.distributed initialised, every update of a registry
key `(recipe, amax_reduction_group)` is collective: each rank all-reduces (MAX) ONE float32 tensor

    [changed, used, key_hash, -key_hash, staging row of every slot under the key, in registration order]

- `changed` (any rank's registered states differ from the last agreed set): the ranks exchange a fingerprint of their
  states (all-gather: lengths, then bytes), raise `RegistrationMismatchError` on every rank if they differ, and
  otherwise all-reduce the staging rows of the new set. This only happens when registration changes (first steps).
- `used` (any rank ran a module of the key this step): 0 everywhere means nothing rolls and no scale changes.
- `key_hash`: max(h) == -max(-h) only when every rank is updating the same recipe and group at this point.
The body always has the length agreed at the last check, so the collective's size matches on every rank.

Tensor parallelism. `gather_along_first_dim`, `reduce_scatter_along_first_dim`, `all_reduce_sum` and
`all_gather_fp8` (FP8 bytes moved as uint8) are what `Linear(parallel_mode=...)` calls; the sequence dimension is the
first dimension of the input, as in Transformer Engine (`[s, b, h]`).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .tensor import Float8Tensor

__all__ = ["RegistrationMismatchError", "apply_pending_updates", "label_states", "TensorParallel",
           "all_gather_fp8", "gather_along_first_dim", "reduce_scatter_along_first_dim", "all_reduce_sum",
           "shard_linear_parameters"]


class RegistrationMismatchError(RuntimeError):
    """Ranks registered different FP8 modules (or are updating different autocast keys) for one amax reduction."""


def _dist():
    import torch.distributed as dist

    return dist


# ---- process groups ---------------------------------------------------------------------------------------------

_RANKS: Dict[object, Tuple[int, ...]] = {}


def group_ranks(group) -> Tuple[int, ...]:
    """Global ranks of `group` (None: the default group; other groups are cached)."""
    dist = _dist()
    if group is None:
        return tuple(range(dist.get_world_size()))
    ranks = _RANKS.get(group)
    if ranks is None:
        ranks = _RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


def _collective_device(group, states) -> torch.device:
    if states:
        return states[0].scale.device
    if "nccl" in str(_dist().get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- registration fingerprints ----------------------------------------------------------------------------------

_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def label_states(label: str, *states) -> None:
    """Name the module that owns `states` in registration-mismatch messages (modules call this; cheap)."""
    for state in states:
        if _LABELS.get(state) != label:
            _LABELS[state] = label


def _recipe_desc(recipe) -> str:
    parts = []
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        if callable(value) and not isinstance(value, type):
            value = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
        else:
            value = repr(value)
        parts.append(f"{f.name}={value}")
    return f"{type(recipe).__name__}({', '.join(parts)})"


_KEY_DESC: Dict[tuple, Tuple[str, float]] = {}


def _key_desc(key) -> Tuple[str, float]:
    """(text, hash below 2**24 so that float32 holds it exactly) of a registry key, the same on every rank."""
    found = _KEY_DESC.get(key)
    if found is None:
        recipe, group = key
        text = f"recipe {_recipe_desc(recipe)}, group ranks {list(group_ranks(group))}"
        found = _KEY_DESC[key] = (text, float((zlib.crc32(text.encode()) & 0xFFFFFF) + 1))
    return found


def _fingerprint(states) -> List[list]:
    return [[_LABELS.get(s, "an unnamed FP8 module"), s.num_slots, s.history_len] for s in states]


def _all_gather_bytes(payload: bytes, group, device) -> List[bytes]:
    """Every rank's `payload`, in group order: lengths first, then the zero-padded bytes."""
    dist = _dist()
    n = len(group_ranks(group))
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(n)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t) for t in lengths]
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    buf[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[:size].cpu().tolist()) for b, size in zip(bufs, sizes)]


def _describe(item) -> str:
    label, slots, length = item
    return f"{label} [{slots} slots, history {length}]"


def _mismatch_message(which: str, key_text: str, ranks: Sequence[int], prints: List[dict]) -> Optional[str]:
    first = prints[0]
    for rank, other in zip(ranks[1:], prints[1:]):
        if other == first:
            continue
        head = f"fp8kit: ranks {ranks[0]} and {rank} "
        if other["key"] != first["key"]:
            return (head + f"are updating different autocast keys: rank {ranks[0]} has {first['key']}; rank {rank} "
                    f"has {other['key']}. Enter the same autocast contexts (recipe and amax_reduction_group) in the "
                    "same order on every rank.")
        a, b = first["states"], other["states"]
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        what_a = _describe(a[pos]) if pos < len(a) else "nothing"
        what_b = _describe(b[pos]) if pos < len(b) else "nothing"
        return (head + f"registered different FP8 modules for one amax reduction ({key_text}, {which} states): "
                f"rank {ranks[0]} has {len(a)} modules, rank {rank} has {len(b)}; first difference at position {pos}: "
                f"rank {ranks[0]} has {what_a}, rank {rank} has {what_b}. Every rank must run the first FP8 forward "
                "of every module under this autocast, in the same order (give idle modules, e.g. MoE experts "
                "without tokens, an empty input in the first step); otherwise the all-reduce would mix the slots of "
                "different modules.")
    return None


# ---- the collective update --------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Agreed:
    version: int  # the registry entry's version when the ranks last agreed
    sizes: List[int]  # slots per state, in registration order


_AGREED: Dict[Tuple[tuple, str], _Agreed] = {}


def reduced_update(key, which: str, used: bool) -> None:
    """The collective update of `which` ("forward" or "backward") states under registry `key`; every rank of the
    key's group must call it at the same point. `used`: this rank ran a module of the key since the last update."""
    from .autocast import _REGISTRY
    from .state import update_states

    dist = _dist()
    recipe, group = key
    entry = _REGISTRY.get(key)
    states = entry.live(which, key) if entry is not None else []
    version = entry.version if entry is not None else 0
    agreed = _AGREED.get((key, which))
    changed = agreed is None or agreed.version != version
    device = _collective_device(group, states)
    key_text, key_hash = _key_desc(key)
    head = torch.tensor([float(changed), float(used), key_hash, -key_hash], dtype=torch.float32, device=device)
    if changed or not states:
        body = torch.zeros(sum(agreed.sizes) if agreed is not None else 0, dtype=torch.float32, device=device)
    else:
        body = torch.cat([s.amax_history[0] for s in states])
    buf = torch.cat([head, body])
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    any_changed, any_used, hash_max, neg_hash_max = buf[:4].tolist()
    if hash_max != -neg_hash_max:
        raise RegistrationMismatchError(
            f"fp8kit: the ranks of group {list(group_ranks(group))} are updating different autocast keys at this "
            f"point (this rank, {dist.get_rank()}: {key_text}). Enter the same autocast contexts (recipe and "
            "amax_reduction_group) in the same order on every rank.")
    staging = buf[4:]
    if any_changed:
        mine = {"key": key_text, "states": _fingerprint(states)}
        prints = [json.loads(p) for p in _all_gather_bytes(json.dumps(mine).encode(), group, device)]
        problem = _mismatch_message(which, key_text, group_ranks(group), prints)
        if problem:
            raise RegistrationMismatchError(problem)
        _AGREED[(key, which)] = _Agreed(version, [s.num_slots for s in states])
        if not any_used or not states:
            return
        staging = torch.cat([s.amax_history[0] for s in states])
        dist.all_reduce(staging, op=dist.ReduceOp.MAX, group=group)
    if not any_used or not states:
        return
    sizes = [s.num_slots for s in states]
    torch._foreach_copy_([s.amax_history[0] for s in states], list(staging.split(sizes)))
    fmt = recipe.fp8_format.value
    update_states(states, recipe, fmt.max_fwd if which == "forward" else fmt.max_bwd)


def apply_pending_updates() -> None:
    """Run now the backward-state updates that amax reduction defers to the next outermost autocast entry.

    Call it on every rank of the reduction group, outside autocast, before saving a checkpoint or reading
    `fp8_meta["scaling_bwd"]` after the last step. See docs/distributed.md."""
    from .autocast import _run_pending_backward, current_frame

    if current_frame() is not None:
        raise RuntimeError("apply_pending_updates: call it outside fp8kit.pytorch.autocast")
    _run_pending_backward()


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


def all_gather_fp8(q: Float8Tensor, group) -> Float8Tensor:
    """All-gather a Float8Tensor along dim 0 as FP8 bytes (uint8 on the wire). Every rank must have cast with the
    same scale; the result carries this rank's `scale_inv`."""
    data = gather_along_first_dim(q.data.contiguous().view(torch.uint8), group)
    return Float8Tensor(data.view(q.fp8_dtype), q._scale_inv, q.dtype, q.scale_inv_value)


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
    from .autocast import _reduce_group

    cache_key = (frame.recipe.reduce_amax, frame.group, tp.group)
    ok = _SHARED_SCALES.get(cache_key)
    if ok is None:
        ok = _reduce_group(frame.recipe, frame.group) is not None and \
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
