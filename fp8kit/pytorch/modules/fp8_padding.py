"""Fp8Padding: pad each GEMM's rows of a grouped input with zero rows up to a multiple of the alignment
(Transformer Engine's signature; 16 rows, its alignment for per-tensor FP8 recipes)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .splits import check_align_size, check_splits, padded_splits

__all__ = ["Fp8Padding"]


class Fp8Padding(torch.nn.Module):
    """Zero-pad each split of a grouped input (`GroupedLinear`'s `m_splits`) to a multiple of `align_size` rows.

    Args: num_gemms (the number of splits), align_size (default None: 16, Transformer Engine's alignment for
    per-tensor FP8 recipes).

    forward(inp, m_splits) -> (out, padded_m_splits): `inp` `[..., features]` is seen as `[rows, features]`; `out`
    holds split i's rows followed by `padded_m_splits[i] - m_splits[i]` zero rows, for each i in order. When no
    split needs padding, `inp` and `m_splits` come back as they are. The gradient of the padding rows is dropped.
    """

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
            raise ValueError(f"Fp8Padding: num_gemms must be an int >= 1, got {num_gemms!r}")
        self.num_gemms = num_gemms
        self.align_size = check_align_size("Fp8Padding", align_size)

    def forward(self, inp: torch.Tensor, m_splits) -> Tuple[torch.Tensor, List[int]]:
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
            raise TypeError(f"Fp8Padding: inp must be a tensor with a feature dimension, got {inp!r}")
        x = inp.reshape(-1, inp.shape[-1])
        splits = check_splits("Fp8Padding", m_splits, self.num_gemms, x.shape[0])
        padded = padded_splits(splits, self.align_size)
        if padded == splits:
            return inp, splits
        parts = [F.pad(part, (0, 0, 0, p - m)) for part, m, p in zip(x.split(splits), splits, padded)]
        return torch.cat(parts), padded

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"
