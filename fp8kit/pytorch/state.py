"""Delayed-scaling state (amax history, scale and update counter per state) and the batched update rule (SPEC
sections 4, 5).

The update of any number of states runs a constant number of tensor operations: the histories, scales and
counters of all states under one registry key are concatenated, updated as one `[L, N]` problem, and copied back
with `torch._foreach_copy_`. Everything the update reads and writes lives in tensors on the state's device, so a
replayed CUDA graph or a compiled step updates the state exactly as an eager step does.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..recipe import DelayedScaling
from . import host, kernels
from .cast import scale_from_amax, scale_quotient


class ScalingState:
    """The delayed-scaling state of one module for one pass (forward or backward).

    Attributes:
      amax_history: float32 `[L, n]`; row 0 is the staging row, rows 1..L-1 past amaxes, oldest first.
      scale: float32 `[n]`, the scale the next cast of each slot uses.
      count: int64 0-d tensor, the number of updates this state has taken part in (drives `interval`): an update
        takes part when one of the state's slots was used (staging value != 0), or always with callables.
      update_count: `count` as a Python int (reading it synchronises with the device).
      key: the registry key the state is registered under (None until registered; a copy is unregistered).
      compiled: a call compiled by torch.compile used the state, and eager code has an update to run for it
        (fp8kit.pytorch.compiled).
    """

    __slots__ = ("_buffer", "_len", "_scale", "_count", "_views", "_slot_views", "_block", "_start", "key", "compiled",
                 "__weakref__")

    def __init__(self, num_slots: int, length: int, device=None, capacity: int = 0):
        self._block = None  # the SlotBlock (fp8kit.pytorch.state_block) whose columns the tensors view, or None
        with torch.inference_mode(False):  # state made under inference_mode must stay writable outside it
            self._own(torch.zeros(max(length, capacity), num_slots, dtype=torch.float32, device=device), length)
            self.scale = torch.ones(num_slots, dtype=torch.float32, device=device)
            self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.key = None
        self.compiled = False

    # ---- tensors (assigning one drops the cached NumPy views) ----

    def _own(self, buffer: torch.Tensor, length: int) -> None:
        """Hold `buffer` `[capacity, n]`, of which the first `length` rows are the history."""
        if self._block is not None and buffer is not self._buffer:
            self._block.detach(self)
        self._buffer, self._len = buffer, length
        self._views = self._slot_views = None

    @property
    def amax_history(self) -> torch.Tensor:
        """float32 `[L, n]`: the first L rows of a buffer allocated once (`capacity` rows). A view made at each
        access: no tensor but the buffer is held, so a compiled graph never stores a view it made."""
        buffer = self._buffer
        return buffer if self._len == buffer.shape[0] else buffer[:self._len]

    @amax_history.setter
    def amax_history(self, value: torch.Tensor) -> None:
        """Copy `value` `[L, n]` into the buffer when it fits (same slots, device and dtype, L <= capacity): the
        tensors a compiled graph took as inputs stay the state's tensors. Otherwise the state takes `value`."""
        buffer, length = self._buffer, value.shape[0] if value.dim() == 2 else -1
        if 0 < length <= buffer.shape[0] and value.shape[1:] == buffer.shape[1:] and value.device == buffer.device \
                and value.dtype == buffer.dtype:
            target = buffer if length == buffer.shape[0] else buffer[:length]
            if value is not target:
                if not torch.compiler.is_compiling() and \
                        value.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    value = value.clone()  # a view of the buffer itself
                with torch.no_grad():
                    target.copy_(value)
            self._own(buffer, length)
        else:
            self._own(value, value.shape[0])

    @property
    def capacity(self) -> int:
        """Rows the history can grow to without a new tensor."""
        return self._buffer.shape[0]

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        if self._block is not None:
            if _fits(value, self._scale):  # keep the block's view: copy the values in
                self._block.freeze_snapshot()
                with torch.no_grad():
                    self._scale.copy_(value)
                return
            self._block.detach(self)
        self._scale, self._views, self._slot_views = value, None, None

    @property
    def count(self) -> torch.Tensor:
        return self._count

    @count.setter
    def count(self, value: torch.Tensor) -> None:
        if self._block is not None:
            if _fits(value, self._count):
                with torch.no_grad():
                    self._count.copy_(value)
                return
            self._block.detach(self)
        self._count, self._views = value, None

    @property
    def update_count(self) -> int:
        return int(self._count)

    @update_count.setter
    def update_count(self, value: int) -> None:
        with torch.no_grad():
            self._count.fill_(int(value))

    def slot_views(self, slot: int):
        """(scale `[1]`, staging value 0-d) of `slot` as views made once (eager tensor path; a compiled graph makes
        its own, see `amax_history`)."""
        views = self._slot_views
        if views is None:
            views = self._slot_views = {}
        found = views.get(slot)
        if found is None:
            found = views[slot] = (self._scale[slot:slot + 1], self._buffer[0, slot])
        return found

    def slot_bits(self, slot: int) -> torch.Tensor:
        """The staging value of `slot` seen as int32 (the Triton kernels' atomic max operand), a view made once, of
        the same memory as `slot_views(slot)[1]`."""
        views = self._slot_views
        if views is None:
            views = self._slot_views = {}
        key = ("bits", slot)
        found = views.get(key)
        if found is None:
            found = views[key] = self.slot_views(slot)[1].view(torch.int32)
        return found

    def host_views(self):
        """(amax_history, scale, count) as NumPy arrays sharing memory with the tensors (CPU states only; the host
        fast path), made once per tensor."""
        views = self._views
        if views is None:
            views = self._views = (self.amax_history.numpy(), self._scale.numpy(), self._count.numpy())
        return views

    # ---- copies: an independent, unregistered state with the same numbers ----

    def __getstate__(self):
        if self._block is not None:  # views of a flat buffer: copy this state's part only
            return {"amax_history": self.amax_history.clone(), "scale": self._scale.clone(),
                    "count": self._count.clone()}
        return {"amax_history": self.amax_history, "scale": self._scale, "count": self._count}

    def __setstate__(self, state) -> None:
        self._block = self._buffer = None
        self._own(state["amax_history"], state["amax_history"].shape[0])
        self.scale = state["scale"]
        self.count = state.get("count", torch.zeros((), dtype=torch.int64, device=self._buffer.device))
        self.key = None  # registers again at its first FP8 forward
        self.compiled = False

    def __deepcopy__(self, memo):
        copy = ScalingState.__new__(ScalingState)
        copy._block = copy._buffer = None
        copy.__setstate__({"amax_history": self._buffer.clone(), "scale": self._scale.clone(),
                           "count": self._count.clone()})
        copy._own(copy._buffer, self.history_len)
        memo[id(self)] = copy
        return copy

    # ---- reading and recording ----

    @property
    def scale_inv(self) -> torch.Tensor:
        """`float32(1 / scale)`, what a cast made now would store with its FP8 data."""
        return torch.reciprocal(self.scale)

    @property
    def num_slots(self) -> int:
        return self.scale.numel()

    @property
    def history_len(self) -> int:
        return self._len

    def to_(self, device: torch.device) -> None:
        """Move the tensors to `device` (a state on the meta device starts fresh there: zeros, scale 1)."""
        length = self.history_len
        if self._block is not None:
            self._block.detach(self)
        if self._buffer.is_meta:
            with torch.inference_mode(False):
                self._own(torch.zeros(self._buffer.shape, dtype=torch.float32, device=device), length)
                self.scale = torch.ones(self._scale.shape, dtype=torch.float32, device=device)
                self.count = torch.zeros((), dtype=torch.int64, device=device)
            return
        self._own(self._buffer.to(device), length)
        self.scale = self.scale.to(device)
        self.count = self.count.to(device)

    def record(self, slot: int, amax) -> None:
        """Max-accumulate a cast's amax (a 0-d tensor, or a float for a CPU state) into the staging row,
        NaN-ignoring."""
        if isinstance(amax, float):
            row = self.host_views()[0][0]
            if amax == amax and not amax <= row[slot]:  # also replaces a NaN staging value
                row[slot] = amax
            return
        stage = self.staging(slot)
        stage.copy_(torch.fmax(stage, amax))

    def staging(self, slot) -> torch.Tensor:
        """The staging value of `slot` (an int: 0-d; a slice: 1-d) as a view of the allocated buffer, which stays the
        same tensor when the history is resized (a compiled backward may write into it)."""
        return self._buffer[0, slot]

    def resize_(self, length: int) -> None:
        """Change the history length, keeping the staging row and the newest past amaxes (zeros pad the oldest)."""
        self.amax_history = resized_history(self.amax_history, length)

    def __repr__(self) -> str:
        return f"ScalingState(slots={self.num_slots}, history_len={self.history_len})"


def _fits(value: torch.Tensor, current: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == current.shape and value.dtype == current.dtype \
        and value.device == current.device and not torch.compiler.is_compiling()


def resized_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """History `[L, n]` -> `[length, n]`: row 0 kept, the newest `length - 1` past rows kept, zeros for the oldest."""
    old = history.shape[0]
    if old == length:
        return history.clone()
    out = torch.zeros(length, history.shape[1], dtype=history.dtype, device=history.device)
    out[0] = history[0]
    keep = min(old, length) - 1
    if keep > 0:
        out[length - keep:] = history[old - keep:]
    return out


def _rolled(history: torch.Tensor) -> torch.Tensor:
    """`[0, history[2..L-1], history[0]]` for every column (`[0]` when L == 1): roll up by one, clear row 0."""
    rolled = history.roll(-1, dims=0)
    rolled[0] = 0
    return rolled


def _nan_ignoring_max(history: torch.Tensor) -> torch.Tensor:
    # NaN -> 0 keeps the scale rule's outcome: an all-NaN column gives 0, which keeps the old scale like NaN would.
    return torch.nan_to_num(history, nan=0.0, posinf=math.inf, neginf=-math.inf).amax(dim=0)


def _callable_result(value, like: torch.Tensor, what: str, func) -> torch.Tensor:
    """A user callable's result as a float32 `[N]` tensor, or a ValueError naming the callable and the value."""
    name = getattr(func, "__qualname__", None) or repr(func)
    n = like.numel()
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"fp8kit: {what} {name} must return a float tensor of shape [{n}] (or one element), got "
                         f"{type(value).__name__} {value!r}")
    if not value.is_floating_point() or value.numel() not in (1, n) or value.dim() > 1:
        raise ValueError(f"fp8kit: {what} {name} must return a float tensor of shape [{n}] (or one element), got "
                         f"dtype {value.dtype} and shape {tuple(value.shape)}")
    return value.detach().to(device=like.device, dtype=torch.float32).reshape(-1).expand(n)


def check_scales(scale: torch.Tensor, func) -> None:
    """Refuse scales a user callable returned that are not finite and > 0 as float32 (never used, never stored)."""
    ok = torch.isfinite(scale) & (scale > 0)
    if not bool(ok.all()):
        name = getattr(func, "__qualname__", None) or repr(func)
        bad = scale[~ok][:4].tolist()
        raise ValueError(f"fp8kit: scaling_factor_compute_algo {name} returned scales that are not finite and > 0 "
                         f"as float32: {bad}; every scale must be in (0, inf)")


def compute_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    recipe: DelayedScaling,
    fp8_max: float,
    recompute: Optional[torch.Tensor] = None,
):
    """One update of an `[L, N]` history and `[N]` scale (staging values in row 0). Returns (history, scale).

    `recompute` (bool `[N]` or None for all True) marks the columns whose scale may change (`interval`).
    """
    last = history[0]
    scaled_max = recipe.scaled_max(fp8_max)
    if recipe.uses_callables:
        algo = recipe.amax_compute_algo
        if callable(algo):
            amax = _callable_result(algo(history.clone()), scale, "amax_compute_algo", algo)
        elif algo == "most_recent":
            amax = last
        else:
            amax = _nan_ignoring_max(history)
        new_history = _rolled(history)
        sf_algo = recipe.scaling_factor_compute_algo
        if sf_algo is not None:
            new_scale = _callable_result(sf_algo(amax, scale.clone(), fp8_max, recipe), scale,
                                         "scaling_factor_compute_algo", sf_algo)
            if recompute is not None:
                new_scale = torch.where(recompute, new_scale, scale)
            check_scales(new_scale, sf_algo)
        else:
            new_scale = scale_from_amax(amax, scaled_max, scale, recipe.power_2_scale)
            if recompute is not None:
                new_scale = torch.where(recompute, new_scale, scale)
        return new_history, new_scale
    work = UpdateBuffers(history.clone(), scale.clone())
    work.mark_used()
    update_in_place(work, recipe, fp8_max, recompute)
    return work.history, work.scale


class UpdateBuffers:
    """What `update_in_place` works on, made once (a flat buffer keeps them between updates, so that the update
    dispatches no view operations and allocates nothing): the history `[L, N]` with its staging row and rows 1..,
    the scale `[N]`, a work buffer `[L, N]` (the rolled history, then the amax operand) with its views, and `[N]`
    buffers for the used mask, the counters per column, the amax, the mask of changing scales and the new scales."""

    __slots__ = ("history", "scale", "last", "tail", "parts", "work", "work_tail", "work_last", "used", "used_int",
                 "bumped",
                 "amax", "ok", "quotient", "zero", "_numerator")

    def __init__(self, history: torch.Tensor, scale: torch.Tensor):
        self.history, self.scale = history, scale
        self.last, self.tail = history[0], history[1:]
        self.parts = (self.tail, history[:1])
        self.work = self.work_tail = self.work_last = None  # made at the first `update_in_place` (not by kernels)
        self.used = torch.empty_like(scale, dtype=torch.bool)
        # `used` as counter increments, on CPU tensors (see `advance_counters`)
        self.used_int = torch.empty_like(scale, dtype=torch.int64) if scale.device.type == "cpu" else None
        self.bumped = torch.empty_like(scale, dtype=torch.int64)
        self.amax, self.ok = torch.empty_like(scale), torch.empty_like(scale, dtype=torch.bool)
        quotient = torch.empty_like(scale)
        self.quotient = (quotient, quotient.view(torch.int32))  # the new scales before the choice
        self.zero = torch.zeros((), dtype=torch.float32, device=scale.device)  # compared with: no scalar to wrap
        self._numerator = (None, None)

    def make_work(self) -> None:
        self.work = torch.empty_like(self.history)
        self.work_tail, self.work_last = self.work[1:], self.work[-1]

    def mark_used(self) -> torch.Tensor:
        """`used`: the staging row != 0 (NaN counts as used), before the update."""
        return torch.ne(self.last, self.zero, out=self.used)

    def numerator(self, scaled_max: float) -> torch.Tensor:
        """A 0-d float32 tensor holding `scaled_max` (kept while the value stays the same)."""
        value, tensor = self._numerator
        if value != scaled_max:
            tensor = torch.tensor(scaled_max, dtype=torch.float32, device=self.scale.device)
            self._numerator = (scaled_max, tensor)
        return tensor


def advance_counters(counts: torch.Tensor, owners: torch.Tensor, work: UpdateBuffers,
                     interval: int) -> Optional[torch.Tensor]:
    """Add 1, in place, to the counter of each state with a used column (`owners[c]`: the state of column c;
    `work.used` marked), as the maximum over its columns of counter + used. Returns the `recompute` mask of
    `update_in_place` (bool per column: the state's counter, before, is a multiple of `interval`), None for
    interval 1."""
    bumped = torch.index_select(counts, 0, owners, out=work.bumped)
    recompute = bumped.remainder(interval) == 0 if interval > 1 else None
    used = work.used
    if used.device.type == "cpu":
        # a CPU tensor iterator converts mixed inputs into a temporary first (CUDA converts inside the kernel): into a
        # kept buffer instead, so that the update allocates nothing right after the forward pass (docs/performance.md)
        used = work.used_int.copy_(used)
    counts.scatter_reduce_(0, owners, bumped.add_(used), "amax")
    return recompute


def update_in_place(work: UpdateBuffers, recipe: DelayedScaling, fp8_max: float,
                    recompute: Optional[torch.Tensor] = None) -> None:
    """The update of recipes without callables, written into `work.history` and `work.scale`: the values
    `compute_update` returns. `work.used` is marked before the call (`mark_used`).

    Passes over the `[L, N]` history: the rolled copy (one read, one write), the choice between it and the old rows
    for rows 1.. (two reads, one write), and with `amax_compute_algo="max"` NaN -> 0 on the copy in place (a read and
    a write) and its column maximum (a read). A column that was not used keeps its history and its scale."""
    used = work.used
    if work.work is None:
        work.make_work()
    # every old row, rolled up by one: work[i] = history[i + 1], work[L - 1] = the staging row
    rolled = torch.cat(work.parts, out=work.work)
    torch.where(used, work.work_tail, work.tail, out=work.tail)  # same-index aliasing only: exact
    work.last.masked_fill_(used, 0)
    if recipe.amax_compute_algo == "most_recent":
        amax = work.work_last  # the staging row
        ok = torch.gt(amax, work.zero, out=work.ok)
        ok &= amax < math.inf  # finite and > 0 (false for NaN): implies used
    else:
        # the NaN-ignoring max over every old row: NaN -> 0, +inf -> NaN, so that a column holding +inf gives NaN,
        # which `> 0` refuses as it refuses inf (an all-NaN column gives 0: refused too)
        rolled.nan_to_num_(nan=0.0, posinf=math.nan, neginf=-math.inf)
        amax = torch.amax(rolled, dim=0, out=work.amax)
        ok = torch.gt(amax, work.zero, out=work.ok)
        ok &= used
    if recompute is not None:
        ok &= recompute
    quotient = scale_quotient(amax, work.numerator(recipe.scaled_max(fp8_max)), recipe.power_2_scale,
                              work.quotient)
    torch.where(ok, quotient, work.scale, out=work.scale)


_COLUMN_OWNERS: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}


def _column_owners(sizes: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 `[sum(sizes)]`: the index of the state each concatenated column belongs to (cached per layout)."""
    if torch.compiler.is_compiling():  # a constant of the graph
        return torch.tensor([i for i, n in enumerate(sizes) for _ in range(n)], dtype=torch.int64, device=device)
    key = (str(device), sizes)
    owners = _COLUMN_OWNERS.get(key)
    if owners is None:
        with torch.inference_mode(False):
            owners = torch.tensor([i for i, n in enumerate(sizes) for _ in range(n)], dtype=torch.int64,
                                  device=device)
        if len(_COLUMN_OWNERS) > 256:
            _COLUMN_OWNERS.clear()
        _COLUMN_OWNERS[key] = owners
    return owners


def update_states(states: List[ScalingState], recipe: DelayedScaling, fp8_max: float) -> None:
    """Run one batched update over `states` (all with the same history length), in place.

    The staging rows are used as they are: with amax reduction, `distributed.reduced_update` all-reduces them first.
    A state's counter advances when it takes part (a used slot, or always with callables); with `interval > 1` its
    scale changes only in updates where its counter, before advancing, is a multiple of `interval`.
    """
    if not states:
        return
    device = states[0].scale.device
    if any(s.scale.device != device for s in states):  # one key, modules on several devices: each on its own
        by_device = {}
        for s in states:
            by_device.setdefault(s.scale.device, []).append(s)
        for group in by_device.values():
            update_states(group, recipe, fp8_max)
        return
    if host.active(device) and not recipe.uses_callables:
        host.update_states(states, recipe, fp8_max)
    elif not recipe.uses_callables and recipe.interval == 1 and kernels.on_for(device):
        used = torch.stack([(s.amax_history[0] != 0).any() for s in states])  # before the kernel rolls row 0
        # the kernel takes contiguous histories: views of a flat buffer (state_block) go through a copy
        histories = [s.amax_history for s in states]
        work = [h if h.is_contiguous() else h.contiguous() for h in histories]
        kernels.update_tensors(work, [s.scale for s in states], recipe, fp8_max)
        for h, w in zip(histories, work):
            if w is not h:
                h.copy_(w)
        torch._foreach_add_([s.count for s in states], list(used.long().unbind()))
    else:
        _update_with_tensors(states, recipe, fp8_max)


def _update_with_tensors(states: List[ScalingState], recipe: DelayedScaling, fp8_max: float) -> None:
    device = states[0].scale.device
    sizes = tuple(s.num_slots for s in states)
    history = torch.cat([s.amax_history for s in states], dim=1)
    scale = torch.cat([s.scale for s in states])
    counts = torch.stack([s.count for s in states])
    owners = _column_owners(sizes, device)
    if recipe.uses_callables:  # every state takes part
        recompute = (counts % recipe.interval == 0)[owners] if recipe.interval > 1 else None
        history, scale = compute_update(history, scale, recipe, fp8_max, recompute)
        counts = counts + 1
    else:
        work = UpdateBuffers(history, scale)
        work.mark_used()
        recompute = advance_counters(counts, owners, work, recipe.interval)
        update_in_place(work, recipe, fp8_max, recompute)
    torch._foreach_copy_([s.amax_history for s in states], list(history.split(sizes, dim=1)))
    torch._foreach_copy_([s.scale for s in states], list(scale.split(sizes)))
    torch._foreach_copy_([s.count for s in states], list(counts.unbind()))


def state_counts(states: Sequence[ScalingState]) -> List[int]:
    """The update counters of `states` as Python ints (one device read)."""
    if not states:
        return []
    return torch.stack([s.count for s in states]).tolist()
