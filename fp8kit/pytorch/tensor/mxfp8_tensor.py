"""MXFP8: FP8 values with one E8M0 (power-of-two) scale per 32 consecutive elements, Transformer Engine's
`MXFP8Quantizer`, `MXFP8Tensor` and `MXFP8TensorStorage` (`transformer_engine.pytorch.tensor.mxfp8_tensor`).

Layout (TE's): both data layouts have the tensor's shape, uint8 bytes. `_rowwise_scale_inv` holds one E8M0 byte per
1x32 block along the last dim, shape (round_up(M, 128), round_up(K / 32, 4)) for the flattened (M, K);
`_columnwise_scale_inv` one per 32x1 block along the flattened first dim, shape (round_up(M / 32, 4),
round_up(K, 128)). Padding bytes are 0 (TE leaves them unset in this compact layout). Both layouts are quantized
from the high-precision input. M and K must be multiples of 32, as in TE.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

from .. import block_cast as bc
from ..quantized_tensor import QuantizedTensor
from .block_storage import FIELDS, BlockQuantizer, BlockScaledStorage, BlockScaledTensorMixin

__all__ = ["MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage", "mxfp8_scale_shape"]


def _flat2d(shape) -> Tuple[int, int]:
    shape = tuple(shape)
    k = shape[-1] if shape else 1
    return math.prod(shape[:-1]), k


def mxfp8_scale_shape(shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
    """TE's padded E8M0 scale shape for a tensor of `shape` (see the module docstring)."""
    m, k = _flat2d(shape)
    if columnwise:
        return bc.round_up(m // bc.MXFP8_BLOCK, 4), bc.round_up(k, 128)
    return bc.round_up(m, 128), bc.round_up(k // bc.MXFP8_BLOCK, 4)


def _zero_padded(scales: torch.Tensor, shape: Tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.uint8, device=scales.device)
    out[: scales.shape[0], : scales.shape[1]] = scales
    return out


class MXFP8TensorStorage(BlockScaledStorage):
    """MXFP8 data as a plain object (what the GEMMs take). TE's positional signature:
    MXFP8TensorStorage(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer,
    with_gemm_swizzled_scales=False, *, fake_dtype=None). Swizzled scales are not supported (fp8kit keeps the compact
    layout)."""

    def __init__(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                 quantizer=None, with_gemm_swizzled_scales: bool = False, *, fake_dtype=None):
        _check_compact(with_gemm_swizzled_scales)
        self._set_fields(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                         quantizer, fake_dtype)
        self._with_gemm_swizzled_scales = False

    @property
    def _flag(self) -> bool:
        return self._with_gemm_swizzled_scales

    @staticmethod
    def _columnwise_shape_of(shape) -> tuple:
        return tuple(shape)

    def _logical_shape(self) -> torch.Size:
        data = self._rowwise_data if self._rowwise_data is not None else self._columnwise_data
        return data.shape

    def block_scales(self, columnwise: bool) -> torch.Tensor:
        """The E8M0 bytes without padding: (M, K / 32) rowwise, (M / 32, K) columnwise."""
        m, k = _flat2d(self._logical_shape())
        if columnwise:
            return self._columnwise_scale_inv[: m // bc.MXFP8_BLOCK, :k]
        return self._rowwise_scale_inv[:m, : k // bc.MXFP8_BLOCK]

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        """`float32(fp8) * 2^(scale - 127)` from the rowwise data (else the columnwise), converted to `dtype`."""
        columnwise = self._rowwise_data is None
        data = self._columnwise_data if columnwise else self._rowwise_data
        m, k = _flat2d(data.shape)
        values = data.reshape(m, k).view(self.fp8_dtype).float()
        scale = bc.e8m0_decode(self.block_scales(columnwise))
        if columnwise:
            values = values.reshape(m // bc.MXFP8_BLOCK, bc.MXFP8_BLOCK, k) * scale[:, None, :]
        else:
            values = values.reshape(m, k // bc.MXFP8_BLOCK, bc.MXFP8_BLOCK) * scale[:, :, None]
        return values.reshape(data.shape).to(dtype)

    def as_tensor(self) -> "MXFP8Tensor":
        if isinstance(self, MXFP8Tensor):
            return self
        return MXFP8Tensor._make(self._fields(), self._fp8_dtype, self._dtype, self._flag, self._quantizer)

    def _metadata(self) -> dict:
        return dict(fp8_dtype=self._fp8_dtype, quantizer=self._quantizer, fake_dtype=self._dtype)

    # ---- Transformer Engine's FSDP2 buffer protocol (what a dim-0 all-gather sends and how it is put back) ----

    def fsdp_buffer_fields(self) -> Tuple[str, ...]:
        """The fields an FSDP2 all-gather sends: each layout present, its data and its scales."""
        return tuple(f"_{n}_{f}" for n in ("rowwise", "columnwise") if getattr(self, f"_{n}_data") is not None
                     for f in ("data", "scale_inv"))

    def fsdp_extract_buffers(self) -> Tuple[Tuple[torch.Tensor, ...], dict]:
        """Those fields with the scales' dim-0 padding stripped (M rows rowwise, M / 32 columnwise), so that shards
        concatenate along dim 0, and the metadata `fsdp_assign_gathered` reads."""
        names = self.fsdp_buffer_fields()
        m, _ = _flat2d(self._logical_shape())
        rows = {"_rowwise_scale_inv": m, "_columnwise_scale_inv": m // bc.MXFP8_BLOCK}
        buffers = tuple(getattr(self, n)[:rows[n]] if n in rows else getattr(self, n) for n in names)
        return buffers, {"field_names": names}

    def fsdp_assign_gathered(self, gathered, meta: dict) -> None:
        """Put gathered buffers into the fields `meta` names, the scales' dim 0 padded again (to a multiple of 128
        rowwise, of 4 columnwise)."""
        names = meta["field_names"]
        if len(names) != len(gathered):
            raise RuntimeError(f"MXFP8TensorStorage.fsdp_assign_gathered: {len(gathered)} buffers for {len(names)} "
                               f"fields {names}")
        pad_to = {"_rowwise_scale_inv": 128, "_columnwise_scale_inv": 4}
        for name, buf in zip(names, gathered):
            if name not in FIELDS:
                raise RuntimeError(f"MXFP8TensorStorage.fsdp_assign_gathered: {name!r} is not an MXFP8 field")
            if buf is not None and name in pad_to:
                rows = bc.round_up(buf.shape[0], pad_to[name])
                buf = torch.cat([buf, buf.new_zeros((rows - buf.shape[0],) + tuple(buf.shape[1:]))])
            setattr(self, name, buf)

    def __repr__(self) -> str:
        return (f"MXFP8TensorStorage(shape={tuple(self._logical_shape())}, fp8_dtype={self._fp8_dtype.name}, "
                f"usages={self.get_usages()}, dtype={self._dtype})")


def _check_compact(swizzled: bool) -> None:
    if swizzled:
        raise NotImplementedError("MXFP8: GEMM-swizzled scales are not supported; fp8kit keeps the compact layout")


class MXFP8Tensor(BlockScaledTensorMixin, MXFP8TensorStorage, QuantizedTensor):
    """An MXFP8 tensor (a torch.Tensor with the nominal dtype and shape). TE's keyword signature:
    MXFP8Tensor(shape, dtype, *, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
    quantizer, with_gemm_swizzled_scales=False, requires_grad=False, device=None)."""

    def __new__(cls, shape=None, dtype: Optional[torch.dtype] = None, *, rowwise_data, rowwise_scale_inv,
                columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer=None,
                with_gemm_swizzled_scales: bool = False, requires_grad: bool = False, device=None, fake_dtype=None,
                **kwargs):
        _check_compact(with_gemm_swizzled_scales)
        dtype = dtype or fake_dtype or torch.float32
        data = rowwise_data if rowwise_data is not None else columnwise_data
        shape = tuple(data.shape) if shape is None else tuple(shape)
        instance = QuantizedTensor.__new__(cls, shape, dtype, requires_grad=requires_grad, device=data.device)
        instance._set_fields(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                             quantizer, dtype)
        instance._with_gemm_swizzled_scales = False
        return instance

    @classmethod
    def _make(cls, fields, fp8_dtype, dtype, flag, quantizer):
        return cls(dtype=dtype, fp8_dtype=fp8_dtype, quantizer=quantizer, **fields)

    _DATA_STATE = BlockScaledTensorMixin._DATA_STATE + ("_with_gemm_swizzled_scales",)

    def _default_quantizer(self):
        return MXFP8Quantizer(self._fp8_dtype, rowwise=self._rowwise_data is not None,
                              columnwise=self._columnwise_data is not None)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"MXFP8Tensor(fp8_dtype={self._fp8_dtype.name}, data={self.dequantize_impl(self.dtype)})"


class MXFP8Quantizer(BlockQuantizer):
    """Quantizes to MXFP8: one E8M0 scale per 1x32 block (rowwise usage) and per 32x1 block (columnwise usage),
    both from the high-precision input; `with_2d_quantization=True` uses one scale per 32x32 block for both (TE
    uses it for forward weights).

    MXFP8Quantizer(fp8_dtype, *, rowwise=True, columnwise=True, with_2d_quantization=False): `fp8_dtype` a DType
    (kFloat8E4M3 / kFloat8E5M2) or torch float8 dtype. Input: float32 / bfloat16 / float16 with at least 2 dims whose
    flattened (M, K) are multiples of 32 (else ValueError, as TE refuses them)."""

    def __init__(self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True,
                 with_2d_quantization: bool = False) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        self.with_2d_quantization = bool(with_2d_quantization)

    _storage_class = MXFP8TensorStorage

    def copy(self) -> "MXFP8Quantizer":
        out = MXFP8Quantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                             with_2d_quantization=self.with_2d_quantization)
        out.internal = self.internal
        return out

    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
        """TE's padded scale shape (see the module docstring)."""
        return mxfp8_scale_shape(shape, columnwise)

    def get_columnwise_shape(self, shape: Iterable[int]) -> Tuple[int, ...]:
        return tuple(shape)

    _dims_multiple_of = ("MXFP8", bc.MXFP8_BLOCK)

    def _fields(self, x: torch.Tensor) -> dict:
        """The four TE fields for the high-precision `x`."""
        shape = tuple(x.shape)
        x2 = x.reshape(_flat2d(shape))
        fp8 = self.fp8_torch_dtype
        out = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
        b = bc.MXFP8_BLOCK
        if self.with_2d_quantization:
            data, code = bc.mxfp8_cast(x2, fp8, b, b)
            row = (data, code.repeat_interleave(b, dim=0))
            col = (data.clone(), code.repeat_interleave(b, dim=1))  # the same bytes, held twice as in TE
        else:
            row = bc.mxfp8_cast(x2, fp8, 1, b) if self.rowwise_usage else None
            col = bc.mxfp8_cast(x2, fp8, b, 1) if self.columnwise_usage else None
        if self.rowwise_usage:
            out["rowwise_data"] = row[0].reshape(shape)
            out["rowwise_scale_inv"] = _zero_padded(row[1], mxfp8_scale_shape(shape, False))
        if self.columnwise_usage:
            out["columnwise_data"] = col[0].reshape(shape)
            out["columnwise_scale_inv"] = _zero_padded(col[1], mxfp8_scale_shape(shape, True))
        return out

    def quantize_impl(self, tensor: torch.Tensor):
        x = self._check(tensor)
        fields = self._fields(x)
        if self.internal:
            return MXFP8TensorStorage(fp8_dtype=self.dtype, quantizer=self, fake_dtype=x.dtype, **fields)
        return MXFP8Tensor(dtype=x.dtype, fp8_dtype=self.dtype, quantizer=self, **fields)

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False, pin_memory: bool = False):
        shape = tuple(shape)
        m, k = _flat2d(shape)
        if len(shape) < 2 or m % bc.MXFP8_BLOCK or k % bc.MXFP8_BLOCK:
            raise ValueError(f"MXFP8 requires tensor dims that are divisible by {bc.MXFP8_BLOCK}, got {shape}")
        fields = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
        for usage, name in ((self.rowwise_usage, "rowwise"), (self.columnwise_usage, "columnwise")):
            if usage:
                fields[f"{name}_data"] = torch.empty(shape, dtype=torch.uint8, device=device, pin_memory=pin_memory)
                fields[f"{name}_scale_inv"] = torch.zeros(mxfp8_scale_shape(shape, name == "columnwise"),
                                                          dtype=torch.uint8, device=device)
        if self.internal:
            return MXFP8TensorStorage(fp8_dtype=self.dtype, quantizer=self, fake_dtype=dtype, **fields)
        return MXFP8Tensor(dtype=dtype, fp8_dtype=self.dtype, quantizer=self, requires_grad=requires_grad, **fields)

    def __repr__(self) -> str:
        return (f"MXFP8Quantizer(fp8_dtype={self.dtype.name}, rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage}, with_2d_quantization={self.with_2d_quantization}, "
                f"internal={self.internal})")
