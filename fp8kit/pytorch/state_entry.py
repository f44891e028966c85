"""A checkpoint's `fp8_meta.<pass>` entry (amax_history, scale, update_count): its fields and what makes one
loadable. The FP8 modules (modules/base.py) and the reader of Transformer Engine's checkpoints (te_checkpoint.py)
both check entries here; it imports neither.
"""

from __future__ import annotations

import math

import torch

from ..recipe import FLT_MAX, SCALE_MIN

FIELDS = ("amax_history", "scale", "update_count")


def bad_fp8_entry(found, slots: int) -> str:
    """Why a checkpoint's `fp8_meta.<pass>` entry cannot be loaded into a state of `slots` slots ("" if it can)."""
    missing = [f for f in FIELDS if f not in found]
    if missing:
        return f"missing {', '.join(missing)}"
    history, scale, count = found["amax_history"], found["scale"], found["update_count"]
    for field, value in (("amax_history", history), ("scale", scale), ("update_count", count)):
        if not isinstance(value, torch.Tensor):
            return f"{field} must be a tensor, got {type(value).__name__}"
    if history.dim() != 2 or history.shape[1] != slots or history.shape[0] < 1:
        return f"amax_history must have shape [L >= 1, {slots}], got {tuple(history.shape)}"
    if tuple(scale.shape) != (slots,):
        return f"scale must have shape [{slots}], got {tuple(scale.shape)}"
    if not (history.is_floating_point() and scale.is_floating_point()):
        return f"amax_history and scale must be floating, got {history.dtype} and {scale.dtype}"
    s32 = scale.detach().cpu().to(torch.float32)
    ok = torch.isfinite(s32) & (s32 >= SCALE_MIN) & (s32 <= FLT_MAX)
    if not bool(ok.all()):
        bad = scale.detach().cpu()[~ok][:4].tolist()
        return (f"scale holds values that are not finite and within [{SCALE_MIN:.4g}, {FLT_MAX:.4g}] as float32: "
                f"{bad}")
    h32 = history.detach().cpu().to(torch.float32)
    if bool((h32 < 0).any()):
        return f"amax_history holds negative values (an amax is never negative): {h32[h32 < 0][:4].tolist()}"
    if count.numel() != 1 or count.dim() > 1:
        return f"update_count must hold one number (shape [] or [1]), got shape {tuple(count.shape)}"
    value = count.detach().cpu().reshape(()).double().item()
    if not (math.isfinite(value) and value >= 0 and value == int(value)) or count.dtype == torch.bool:
        return f"update_count must be an integer >= 0, got {value!r} ({count.dtype})"
    return ""
