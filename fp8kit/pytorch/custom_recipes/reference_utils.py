"""Helpers of the reference quantizers (TE's `custom_recipes.reference_utils`)."""

from __future__ import annotations

import enum

import torch

__all__ = ["HIGH_PRECISION_FLOAT_DTYPES", "Fp4Formats", "roundup_div"]

HIGH_PRECISION_FLOAT_DTYPES = (torch.float, torch.float16, torch.bfloat16, torch.float32)


class Fp4Formats(enum.Enum):
    """FP4 element formats."""

    E2M1 = "e2m1"


def roundup_div(x: int, y: int) -> int:
    """ceil(x / y) for x >= 0, y > 0."""
    if x < 0 or y <= 0:
        raise ValueError(f"roundup_div: needs x >= 0 and y > 0, got {x}, {y}")
    return -(-x // y)
