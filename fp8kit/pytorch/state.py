"""Delayed-scaling state (amax history and scale per slot) and the batched update rule (SPEC sections 4, 5).

The update of any number of states runs a constant number of tensor operations: the histories and scales of all
states under one registry key are concatenated, updated as one `[L, N]` problem, and copied back with
`torch._foreach_copy_`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from ..recipe import DelayedScaling
from . import host, kernels
from .cast import scale_from_amax


class ScalingState:
    """The delayed-scaling state of one module for one pass (forward or backward).

    Attributes:
      amax_history: float32 `[L, n]`; row 0 is the staging row, rows 1..L-1 past amaxes, oldest first.
      scale: float32 `[n]`, the scale the next cast of each slot uses.
      update_count: how many updates this state has taken part in (drives `interval`).
    """

    __slots__ = ("_history", "_scale", "_views", "update_count", "key", "__weakref__")

    def __init__(self, num_slots: int, length: int, device=None):
        self.amax_history = torch.zeros(length, num_slots, dtype=torch.float32, device=device)
        self.scale = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.update_count = 0
        self.key = None  # the registry key this state is registered under

    @property
    def amax_history(self) -> torch.Tensor:
        return self._history

    @amax_history.setter
    def amax_history(self, value: torch.Tensor) -> None:
        self._history, self._views = value, None

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        self._scale, self._views = value, None

    def host_views(self):
        """(amax_history, scale) as NumPy arrays sharing memory with the tensors (CPU states only; the host fast
        path), made once per tensor."""
        views = self._views
        if views is None:
            views = self._views = (self._history.numpy(), self._scale.numpy())
        return views

    @property
    def scale_inv(self) -> torch.Tensor:
        """`float32(1 / scale)`, what a cast made now would store with its FP8 data."""
        return torch.reciprocal(self.scale)

    @property
    def num_slots(self) -> int:
        return self.scale.numel()

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[0]

    def to_(self, device: torch.device) -> None:
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)

    def record(self, slot: int, amax) -> None:
        """Max-accumulate a cast's amax (a 0-d tensor, or a float for a CPU state) into the staging row,
        NaN-ignoring."""
        if isinstance(amax, float):
            row = self.host_views()[0][0]
            if amax == amax and not amax <= row[slot]:  # also replaces a NaN staging value
                row[slot] = amax
            return
        stage = self.amax_history[0, slot]
        stage.copy_(torch.fmax(stage, amax))

    def resize_(self, length: int) -> None:
        """Change the history length, keeping the staging row and the newest past amaxes (zeros pad the oldest)."""
        self.amax_history = resized_history(self.amax_history, length)

    def __repr__(self) -> str:
        return f"ScalingState(slots={self.num_slots}, history_len={self.history_len}, updates={self.update_count})"


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
    scaled_max = fp8_max * 2.0 ** (-recipe.margin)
    if recipe.uses_callables:
        algo = recipe.amax_compute_algo
        if callable(algo):
            amax = algo(history.clone())
        elif algo == "most_recent":
            amax = last
        else:
            amax = _nan_ignoring_max(history)
        new_history = _rolled(history)
        if recipe.scaling_factor_compute_algo is not None:
            new_scale = recipe.scaling_factor_compute_algo(amax, scale.clone(), fp8_max, recipe)
            new_scale = torch.as_tensor(new_scale, dtype=torch.float32, device=scale.device).expand_as(scale)
        else:
            new_scale = scale_from_amax(amax, scaled_max, scale, recipe.power_2_scale)
        if recompute is not None:
            new_scale = torch.where(recompute, new_scale, scale)
        return new_history, new_scale
    used = last != 0
    amax = last if recipe.amax_compute_algo == "most_recent" else _nan_ignoring_max(history)
    new_scale = scale_from_amax(amax, scaled_max, scale, recipe.power_2_scale)
    keep_scale = ~used if recompute is None else ~(used & recompute)
    new_scale = torch.where(keep_scale, scale, new_scale)
    new_history = torch.where(used, _rolled(history), history)
    return new_history, new_scale


def _recompute_flags(states: Sequence[ScalingState], interval: int) -> Optional[List[bool]]:
    """Per column: may its scale change in this update (`interval`)? None when all may."""
    if interval == 1:
        return None
    flags = [s.update_count % interval == 0 for s in states]
    if all(flags):
        return None
    return [f for s, f in zip(states, flags) for _ in range(s.num_slots)]


def update_states(states: List[ScalingState], recipe: DelayedScaling, fp8_max: float) -> None:
    """Run one batched update over `states` (all with the same history length), in place.

    The staging rows are used as they are: with amax reduction, `distributed.reduced_update` all-reduces them first.
    """
    if not states:
        return
    device = states[0].scale.device
    flags = _recompute_flags(states, recipe.interval)
    if host.active(device) and not recipe.uses_callables:
        host.update_states(states, recipe, fp8_max, flags)
    elif not recipe.uses_callables and kernels.enabled() and kernels.available(device):  # one launch
        per_state = None if flags is None else [s.update_count % recipe.interval == 0 for s in states]
        kernels.update_tensors([s.amax_history for s in states], [s.scale for s in states], recipe, fp8_max,
                               per_state)
    else:
        _update_with_tensors(states, recipe, fp8_max, flags, device)
    for s in states:
        s.update_count += 1


def _update_with_tensors(states, recipe, fp8_max, flags, device) -> None:
    history = torch.cat([s.amax_history for s in states], dim=1)
    scale = torch.cat([s.scale for s in states])
    recompute = None if flags is None else torch.tensor(flags, dtype=torch.bool, device=device)
    new_history, new_scale = compute_update(history, scale, recipe, fp8_max, recompute)
    sizes = [s.num_slots for s in states]
    torch._foreach_copy_([s.amax_history for s in states], list(new_history.split(sizes, dim=1)))
    torch._foreach_copy_([s.scale for s in states], list(new_scale.split(sizes)))
