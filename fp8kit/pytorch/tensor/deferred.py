"""A Float8TensorStorage whose FP8 bytes are made when first read (CPU grad_output casts).

On the CPU the GEMMs multiply the FP8 values widened to bf16 (`Float8TensorStorage.values`), which the table cast
makes in the same gather as the bytes (cast.py). In a Linear's backward nothing else reads the grad_output's bytes
(unless a tensor-parallel all-gather, statistics or user code does), so they are made only when `_data` is first
read: from the same table and the same source codes, hence the same bytes. The source must not change in between:
its version counter is checked, and a tensor modified in place before its bytes were read is an error, not wrong
bytes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..constants import te_dtype
from .storage import Float8TensorStorage

__all__ = ["DeferredBytesStorage"]


class DeferredBytesStorage(Float8TensorStorage):
    """Float8TensorStorage with `_values` given and `_data` made by `make_bytes()` (uint8 bytes of `shape`) on first
    read. Shape, device and the widened values are there without the bytes; everything that reads `_data` (the
    FP8 view, saving, dequantizing, repr) makes them first."""

    @classmethod
    def make(cls, shape: torch.Size, fp8_dtype: torch.dtype, values: torch.Tensor,
             make_bytes: Callable[[], torch.Tensor], fake_dtype: torch.dtype, scale_inv_value: float,
             codes_finite: bool) -> "DeferredBytesStorage":
        self = cls.__new__(cls)
        self._bytes = None
        self._shape, self._device = torch.Size(shape), values.device
        self._assign(None, te_dtype(fp8_dtype), None, fake_dtype, None, None, scale_inv_value)
        self._values = values
        self._codes_finite = codes_finite
        self._pending: Optional[Callable[[], torch.Tensor]] = make_bytes  # after _assign (its setter clears it)
        return self

    @property
    def _data(self) -> Optional[torch.Tensor]:
        data = self._bytes
        if data is None and self._pending is not None:
            data = self._pending()  # may raise (a changed source): then every later read raises too
            self._bytes, self._pending = data, None
        return data

    @_data.setter
    def _data(self, value: Optional[torch.Tensor]) -> None:
        self._bytes = value
        self._pending = None

    def __getstate__(self) -> dict:
        """Pickled with its bytes (made now: the maker is a closure over the source, which does not pickle)."""
        self._data  # noqa: B018 - makes the bytes
        return {**super().__getstate__(), "_pending": None}

    @property
    def bytes_made(self) -> bool:
        """Whether the bytes exist yet (for tests and benchmarks)."""
        return self._bytes is not None

    @property
    def shape(self) -> torch.Size:
        return self._bytes.shape if self._bytes is not None else self._shape

    @property
    def device(self) -> torch.device:
        return self._bytes.device if self._bytes is not None else self._device

    def transposed(self) -> Float8TensorStorage:
        """The transpose of a 2-D tensor, its bytes deferred too (the transposed view of these, when read)."""
        if self._pending is None or len(self._shape) != 2:
            return super().transposed()
        return DeferredBytesStorage.make(self._shape[::-1], self.fp8_dtype, self._values.t(), lambda: self._data.t(),
                                         self._dtype, self._scale_inv_value, self._codes_finite)
