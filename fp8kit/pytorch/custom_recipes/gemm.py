"""The GEMM vocabulary of the reference quantizers (TE's `custom_recipes.gemm`): which GEMM of a Linear a
`qgemm` call is, and its matmul parameters."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

__all__ = ["GEMMType", "MMParams"]


@enum.unique
class GEMMType(enum.Enum):
    """fprop (y = x w^T), dgrad (dx = dy w), wgrad (dw = dy^T x)."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


@dataclasses.dataclass(frozen=True)
class MMParams:
    """Output dtype (None: the operands') and whether FP8 GEMMs split the accumulator."""

    out_dtype: Optional[torch.dtype] = None
    use_split_accumulator: bool = True
