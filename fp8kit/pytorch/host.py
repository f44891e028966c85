"""The CPU fast path for FP8 bookkeeping: scale math on Python floats and history updates in NumPy.

On a CPU every torch operation costs a few microseconds of dispatch, which dominates the cost of a small layer.
The scale rules and the delayed-scaling update work on a handful of numbers, so on CPU tensors they run here, on
Python floats rounded to float32 and on NumPy views of the state tensors, with results bit-identical to the
tensor path (`cast.scale_from_amax`, `state.compute_update`), which accelerators and user callables keep using.

Exactness: every value is a float32; a quotient of two float32 values computed in float64 and rounded once to
float32 equals the float32 quotient (53 >= 2 * 24 + 2 bits, so the double rounding is innocuous), NumPy float32
arithmetic is IEEE float32, and a power of two times a float32 is exact unless it under- or overflows (handled).

`tensor_path()` turns the fast path off in a scope (tests compare both paths).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from ..recipe import FLT_MAX, SCALE_MIN, f32
from . import cpu_kernels

_ENABLED = True


def active(device: torch.device) -> bool:
    """True when bookkeeping for tensors on `device` runs on the host fast path (CPU tensors, path enabled, not
    inside torch.compile, which traces the tensor path)."""
    return _ENABLED and device.type == "cpu" and not torch.compiler.is_compiling()


@contextlib.contextmanager
def _enabled_as(flag: bool) -> Iterator[None]:
    global _ENABLED
    old, _ENABLED = _ENABLED, flag
    try:
        yield
    finally:
        _ENABLED = old


def tensor_path() -> contextlib.AbstractContextManager:
    """Run every scale rule and state update through torch operations in this scope (as on accelerators)."""
    return _enabled_as(False)


def host_path() -> contextlib.AbstractContextManager:
    """The host fast path for CPU tensors in this scope (the default; undoes an enclosing `tensor_path`)."""
    return _enabled_as(True)


def amax(x: torch.Tensor) -> float:
    """`max |x|` over the non-NaN elements of a CPU tensor, as a Python float (0 for empty or all-NaN)."""
    return amax_nan(x)[0]


def amax_nan(x: torch.Tensor) -> Tuple[float, bool]:
    """(`amax(x)`, whether x holds no NaN), from one `aminmax` pass (NaN propagates through it) unless x holds a NaN,
    which takes a second, NaN-ignoring pass."""
    if x.numel() == 0:
        return 0.0, True
    if cpu_kernels.takes(x):
        return cpu_kernels.absmax(x)  # one pass, NaN-ignoring, exact (on the bits)
    lo, hi = torch.aminmax(x)
    a = max(float(hi), -float(lo))
    nan_free = a == a
    if not nan_free:  # a NaN somewhere: take the slow, NaN-ignoring path
        a = float(torch.where(torch.isnan(x), 0, x.abs()).amax())
    return (a if x.dtype != torch.float64 else f32(a)), nan_free


def scale_from_amax(amax_value: float, scaled_max: float, fallback: float, power_2: bool = False) -> float:
    """`cast.scale_from_amax` for one float32 amax: `float32(scaled_max) / amax` where amax is finite and > 0,
    clamped to [SCALE_MIN, FLT_MAX], optionally rounded down to a power of two; `fallback` otherwise."""
    if not (0 < amax_value < math.inf):
        return fallback
    q = f32(f32(scaled_max) / amax_value)
    if q > FLT_MAX:
        q = FLT_MAX
    elif q < SCALE_MIN:
        q = SCALE_MIN
    if power_2:
        q = math.ldexp(0.5, math.frexp(q)[1])  # clears the mantissa
    return q


def current_scale(amax_value: float, fp8_max: float, amax_epsilon: float, power_2: bool) -> float:
    """`cast.current_scale` from an amax already taken: epsilon floor (in float32), then the scale rule."""
    if amax_epsilon > 0:
        amax_value = max(amax_value, f32(amax_epsilon))
    return scale_from_amax(amax_value, fp8_max, 1.0, power_2)


def reciprocal(scale: float) -> float:
    """`float32(1 / scale)` for a float32 scale."""
    return f32(1.0 / scale)


# ---- the delayed-scaling update on NumPy views ----------------------------------------------------------------

def compute_update(history: np.ndarray, scale: np.ndarray, recipe, fp8_max: float,
                   recompute: Optional[np.ndarray] = None):
    """`state.compute_update` for built-in algorithms, on float32 NumPy arrays. Returns (history, scale)."""
    last = history[0]
    used = last != 0
    if recipe.amax_compute_algo == "most_recent":
        amax_v = last
    else:
        # NaN-ignoring max; a column whose max is NaN (all NaN) or <= 0 keeps its scale either way
        amax_v = np.fmax.reduce(history, axis=0)
    change = used & (amax_v > 0) & (amax_v < math.inf)
    if recompute is not None:
        change &= recompute
    new_scale = scale.copy()
    if change.any():
        # float64 quotients of float32 values, clamped to [SCALE_MIN, FLT_MAX], then rounded once: the clamped
        # float32 quotient
        q = np.divide(recipe.scaled_max(fp8_max), amax_v, out=np.ones(amax_v.shape), where=change, dtype=np.float64)
        q = np.clip(q, SCALE_MIN, FLT_MAX).astype(np.float32)
        if recipe.power_2_scale:
            q = (q.view(np.int32) & np.int32(0x7F800000)).view(np.float32)
        np.copyto(new_scale, q, where=change)
    rolled = np.empty_like(history)  # [0, history[2:], history[0]]
    rolled[1:-1] = history[2:]
    rolled[-1] = last
    rolled[0] = 0
    if not used.all():
        rolled = np.where(used, rolled, history)
    return rolled, new_scale


def update_states(states: Sequence, recipe, fp8_max: float) -> None:
    """`state.update_states` on CPU states (recipes without callables), counters included.

    A few small states are updated one by one on Python lists (fewest calls); otherwise the states are
    concatenated and updated as one NumPy problem (`compute_update`)."""
    views = [s.host_views() for s in states]
    interval = recipe.interval
    if sum(sc.shape[0] for _, sc, _ in views) <= _SMALL_UPDATE and all(h.size <= _PYTHON_UPDATE for h, _, _ in views):
        for history, scale, count in views:
            c = int(count)
            if _update_lists(history, scale, recipe, fp8_max, c % interval == 0):
                count[()] = c + 1
        return
    hists, scales, counts = zip(*views)
    history, scale = np.concatenate(hists, axis=1), np.concatenate(scales)
    sizes = [s.shape[0] for s in scales]
    mask = None
    if interval > 1:
        mask = np.repeat([int(c) % interval == 0 for c in counts], sizes)
    takes_part = [bool((h[0] != 0).any()) for h in hists]
    new_history, new_scale = compute_update(history, scale, recipe, fp8_max, mask)
    offset = 0
    for h, s, c, part, n in zip(hists, scales, counts, takes_part, sizes):
        h[...] = new_history[:, offset:offset + n]
        s[...] = new_scale[offset:offset + n]
        if part:
            c[()] += 1
        offset += n


_SMALL_UPDATE = 24  # columns
_PYTHON_UPDATE = 256  # history elements up to which one state's update runs on Python lists (fewest NumPy calls)


def _update_lists(history: np.ndarray, scale: np.ndarray, recipe, fp8_max: float, recompute: bool) -> bool:
    """One state's update on Python lists: one read and one write of each array. `recompute`: may the scales
    change (`interval`). Returns whether the state took part (a slot was used)."""
    rows = history.tolist()
    lasts = rows[0]
    used = [v != 0 for v in lasts]  # NaN counts as used
    if not any(used):
        return False
    if recipe.amax_compute_algo == "most_recent":
        amaxes = lasts
    else:  # comparisons with NaN are false, so starting from 0 ignores NaN; a max <= 0 keeps the scale either way
        amaxes = [max(0.0, *col) for col in zip(*rows)]
    scaled_max = recipe.scaled_max(fp8_max)
    old = scale.tolist()
    if recompute:
        new = [scale_from_amax(a, scaled_max, o, recipe.power_2_scale) if u else o
               for a, o, u in zip(amaxes, old, used)]
        if new != old:
            scale[:] = new
    rolled = [[0.0] * len(lasts)] + [list(r) for r in rows[2:]] + [list(lasts)]
    if len(rows) == 1:
        rolled = rolled[:1]
    for j, u in enumerate(used):
        if not u:
            for row, old_row in zip(rolled, rows):
                row[j] = old_row[j]
    history[...] = rolled
    return True
