"""`m_splits`: how many rows of a 2-D input belong to each GEMM of a grouped layer (GroupedLinear, Fp8Padding,
Fp8Unpadding), validated once, in one place."""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["check_splits", "padded_splits", "check_align_size"]


def check_splits(where: str, m_splits, num_gemms: int, rows: Optional[int]) -> List[int]:
    """`m_splits` (a sequence of ints or a 1-D integer tensor) as a list of `num_gemms` ints >= 0 summing to
    `rows` (not checked when None); a clear error naming `m_splits` otherwise."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.is_floating_point() or m_splits.is_complex() \
                or m_splits.dtype == torch.bool:
            raise TypeError(f"{where}: m_splits must be a 1-D integer tensor or a list of ints, got a tensor of "
                            f"shape {tuple(m_splits.shape)} and dtype {m_splits.dtype}")
        m_splits = m_splits.tolist()
    elif not isinstance(m_splits, (list, tuple)) or \
            not all(isinstance(m, int) and not isinstance(m, bool) for m in m_splits):
        raise TypeError(f"{where}: m_splits must be a list of ints (or a 1-D integer tensor), got {m_splits!r}")
    splits = list(m_splits)
    if len(splits) != num_gemms:
        raise ValueError(f"{where}: m_splits has {len(splits)} entries, expected num_gemms={num_gemms}: {splits}")
    negative = [m for m in splits if m < 0]
    if negative:
        raise ValueError(f"{where}: m_splits must be >= 0, got {splits}")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{where}: m_splits {splits} sum to {sum(splits)}, but the input has {rows} rows")
    return splits


def padded_splits(splits: List[int], align_size: int) -> List[int]:
    """Each split rounded up to a multiple of `align_size`."""
    return [-(-m // align_size) * align_size for m in splits]


def check_align_size(where: str, align_size) -> int:
    """Transformer Engine's alignment for per-tensor FP8 recipes is 16 rows (the default)."""
    if align_size is None:
        return 16
    if not isinstance(align_size, int) or isinstance(align_size, bool) or align_size < 1:
        raise ValueError(f"{where}: align_size must be an int >= 1 (or None for 16), got {align_size!r}")
    return align_size
