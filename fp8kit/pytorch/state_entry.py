"""A checkpoint's `fp8_meta.<pass>` entry (amax_history, scale, update_count): its fields and what makes one
loadable. The FP8 modules (modules/base.py) and the reader of Transformer Engine's checkpoints (te_checkpoint.py)
both check entries here; it imports neither.

An entry is loadable when every field is a tensor of the right shape and dtype and every value is one fp8kit can
have written: amax_history `[L >= 1, slots]` floating, no NaN (an amax ignores NaN), no negative value, nothing
beyond float32's range but +inf; scale `[slots]` floating, finite and within `[SCALE_MIN, FLT_MAX]` as float32;
update_count one integer (an integer dtype, or a floating one holding an integer) in `[0, 2**63 - 1]` (int64).
"""

from __future__ import annotations

import math
from typing import Mapping, Tuple

import torch

from ..recipe import FLT_MAX, SCALE_MIN

FIELDS = ("amax_history", "scale", "update_count")
COUNT_MAX = 2 ** 63 - 1  # the counter is an int64


class CheckpointEntryError(ValueError, RuntimeError):
    """An FP8 entry of a checkpoint that cannot be loaded; the message names its key. A ValueError (a bad value),
    and the RuntimeError that torch's `load_state_dict` raises for its own problems, so either `except` catches it."""


def bad_fp8_entry(found: Mapping[str, object], slots: int) -> Tuple[str, str]:
    """(field, why) when a checkpoint's `fp8_meta.<pass>` entry cannot be loaded into a state of `slots` slots,
    ("", "") when it can. `field` is "" when the problem is the entry as a whole (fields missing)."""
    missing = [f for f in FIELDS if f not in found]
    if missing:
        return "", f"missing {', '.join(missing)}"
    for field in FIELDS:
        value = found[field]
        if not isinstance(value, torch.Tensor):
            return field, f"must be a tensor, got {type(value).__name__}"
        if value.dtype == torch.bool or value.is_complex():
            return field, f"must be a real number tensor, got dtype {value.dtype}"
    for check in (_history_problem, _scale_problem):
        field, problem = check(found, slots)
        if problem:
            return field, problem
    return _count_problem(found["update_count"])


def _history_problem(found, slots: int) -> Tuple[str, str]:
    history = found["amax_history"]
    if history.dim() != 2 or history.shape[1] != slots or history.shape[0] < 1:
        return "amax_history", f"must have shape [L >= 1, {slots}], got {tuple(history.shape)}"
    if not history.is_floating_point():
        return "amax_history", f"must be floating, got dtype {history.dtype}"
    h = history.detach().cpu()
    if bool(torch.isnan(h).any()):
        return "amax_history", "holds NaN (an amax ignores NaN, so no history fp8kit writes holds one)"
    if bool((h < 0).any()):
        return "amax_history", f"holds negative values (an amax is never negative): {h[h < 0][:4].tolist()}"
    beyond = torch.isfinite(h) & ~torch.isfinite(h.to(torch.float32))
    if bool(beyond.any()):
        return "amax_history", f"holds values beyond float32's range: {h[beyond][:4].tolist()}"
    return "", ""


def _scale_problem(found, slots: int) -> Tuple[str, str]:
    scale = found["scale"]
    if tuple(scale.shape) != (slots,):
        return "scale", f"must have shape [{slots}], got {tuple(scale.shape)}"
    if not scale.is_floating_point():
        return "scale", f"must be floating, got dtype {scale.dtype}"
    s32 = scale.detach().cpu().to(torch.float32)
    ok = torch.isfinite(s32) & (s32 >= SCALE_MIN) & (s32 <= FLT_MAX)
    if not bool(ok.all()):
        bad = scale.detach().cpu()[~ok][:4].tolist()
        return "scale", (f"holds values that are not finite and within [{SCALE_MIN:.4g}, {FLT_MAX:.4g}] as "
                         f"float32: {bad}")
    return "", ""


def _count_problem(count: torch.Tensor) -> Tuple[str, str]:
    if count.numel() != 1 or count.dim() > 1:
        return "update_count", f"must hold one number (shape [] or [1]), got shape {tuple(count.shape)}"
    value = count.detach().cpu().reshape(()).item()  # a Python int for integer dtypes: exact
    integral = math.isfinite(value) and value == math.floor(value) if isinstance(value, float) else True
    if not (integral and 0 <= value <= COUNT_MAX):
        return "update_count", f"must be an integer in [0, 2**63 - 1], got {value!r} ({count.dtype})"
    return "", ""
