"""Transformer Engine's data-type enum (`te.DType`), with its values, and the mapping to torch dtypes."""

from __future__ import annotations

import enum
from typing import Union

import torch

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "torch_dtype", "te_dtype", "fp8_torch_dtype"]


class DType(enum.IntEnum):
    """Data types as Transformer Engine numbers them (its `NVTEDType`): kByte 0, kInt16 1, kInt32 2, kInt64 3,
    kFloat32 4, kFloat16 5, kBFloat16 6, kFloat8E4M3 7, kFloat8E5M2 8, kFloat8E8M0 9, kFloat4E2M1 10. fp8kit takes
    them wherever Transformer Engine does (quantizers, Float8Tensor) alongside torch's float8 dtypes."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10

    @classmethod
    def cast(cls, dtype: Union["DType", int, torch.dtype]) -> "DType":
        """A DType from a DType, its integer value, or a torch dtype."""
        if isinstance(dtype, cls):
            return dtype
        if isinstance(dtype, torch.dtype):
            return te_dtype(dtype)
        return cls(int(dtype))


_TORCH = {
    DType.kByte: torch.uint8, DType.kInt16: torch.int16, DType.kInt32: torch.int32, DType.kInt64: torch.int64,
    DType.kFloat32: torch.float32, DType.kFloat16: torch.float16, DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2,
}
_TE = {v: k for k, v in _TORCH.items()}

# Transformer Engine's public mappings (`TE_DType[torch_dtype]`), over the seven torch dtypes it passes to its kernels
TE_DType = {d: _TE[d] for d in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.float32,
                                torch.half, torch.bfloat16)}
TE_DType_To_Torch = {v: k for k, v in TE_DType.items()}


def torch_dtype(dtype: Union[DType, int]) -> torch.dtype:
    """The torch dtype of a DType (kFloat8E8M0 and kFloat4E2M1 have none fp8kit uses)."""
    d = DType.cast(dtype)
    if d not in _TORCH:
        raise TypeError(f"{d.name} has no torch dtype in fp8kit (block-scaling / FP4 formats are not implemented)")
    return _TORCH[d]


def te_dtype(dtype: torch.dtype) -> DType:
    """The DType of a torch dtype."""
    if dtype not in _TE:
        raise TypeError(f"no Transformer Engine DType for {dtype}")
    return _TE[dtype]


def fp8_torch_dtype(fp8_dtype: Union[DType, int, torch.dtype], where: str = "fp8_dtype") -> torch.dtype:
    """`torch.float8_e4m3fn` or `torch.float8_e5m2` from a DType (kFloat8E4M3, kFloat8E5M2) or the torch dtype;
    anything else is a TypeError naming `where`."""
    if isinstance(fp8_dtype, torch.dtype):
        d = fp8_dtype
    else:
        try:
            d = _TORCH.get(DType.cast(fp8_dtype))
        except (ValueError, TypeError):
            d = None
    if d not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{where} must be DType.kFloat8E4M3 / kFloat8E5M2 or torch.float8_e4m3fn / float8_e5m2, "
                        f"got {fp8_dtype!r}")
    return d
