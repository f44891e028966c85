"""Fp8Unpadding: undo `Fp8Padding` (Transformer Engine's signature)."""

from __future__ import annotations

from typing import Optional

import torch

from .splits import check_align_size, check_splits, padded_splits

__all__ = ["Fp8Unpadding"]


class Fp8Unpadding(torch.nn.Module):
    """Drop the padding rows `Fp8Padding` added.

    Args: num_gemms, align_size (default None: 16), as for the `Fp8Padding` it undoes.

    forward(inp, m_splits) -> out: `m_splits` are the ORIGINAL (unpadded) splits; `inp` `[..., features]` is seen as
    `[sum of the padded splits, features]`, and `out` keeps the first `m_splits[i]` rows of each padded split. When
    no split was padded, `inp` comes back as it is. The padding rows get a zero gradient.
    """

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
            raise ValueError(f"Fp8Unpadding: num_gemms must be an int >= 1, got {num_gemms!r}")
        self.num_gemms = num_gemms
        self.align_size = check_align_size("Fp8Unpadding", align_size)

    def forward(self, inp: torch.Tensor, m_splits) -> torch.Tensor:
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
            raise TypeError(f"Fp8Unpadding: inp must be a tensor with a feature dimension, got {inp!r}")
        x = inp.reshape(-1, inp.shape[-1])
        splits = check_splits("Fp8Unpadding", m_splits, self.num_gemms, None)
        padded = padded_splits(splits, self.align_size)
        if sum(padded) != x.shape[0]:
            raise ValueError(f"Fp8Unpadding: m_splits {splits} padded to multiples of {self.align_size} sum to "
                             f"{sum(padded)}, but the input has {x.shape[0]} rows")
        if padded == splits:
            return inp
        return torch.cat([part[:m] for part, m in zip(x.split(padded), splits)])

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"
