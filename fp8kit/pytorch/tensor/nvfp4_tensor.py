"""NVFP4: E2M1 values packed two per byte, an E4M3 scale per 16 values and a float32 per-tensor amax, Transformer
Engine's `NVFP4Quantizer`, `NVFP4Tensor` and `NVFP4TensorStorage` (`transformer_engine.pytorch.tensor.nvfp4_tensor`).

Layout (TE's), for the tensor flattened to (M, K):
- `_rowwise_data` (..., K / 2) uint8 (the tensor's shape with the last dim halved), `_rowwise_scale_inv` E4M3 bytes
  (uint8) (round_up(M, 128), round_up(K / 16, 4)), zero-padded; `_amax_rowwise` float32 (1,).
- `_columnwise_data` (K, M / 2): the transpose, quantized from the high-precision input (after the random Hadamard
  transform when the quantizer has `with_rht`); `_columnwise_scale_inv` (round_up(K, 128), round_up(M / 16, 4));
  `_amax_columnwise` float32 (1,), the amax of what was quantized (after the transform).
Row-scaled NVFP4 (`row_scaled_nvfp4`): `_amax_rowwise` holds one float32 per row (M,) and `_amax_columnwise` one per
row of the transpose (K,), each row quantized with its own global scale.
M and K must be multiples of 16, as in TE. The cast rules are in `fp8kit.pytorch.nvfp4_cast` and docs/numerics.md.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

from .. import nvfp4_cast as nc
from ..block_cast import round_up
from ..constants import DType
from ..hadamard import rht
from ..quantized_tensor import QuantizedTensor
from .block_storage import (
    FIELDS,
    BlockQuantizer,
    BlockScaledStorage,
    BlockScaledTensorMixin,
    TransposedBlockOperand,
    rebuild_pickled_block_tensor,
)
from .mxfp8_tensor import _flat2d, _zero_padded  # the flattened (M, K) and zero-padded scales, as MXFP8's

__all__ = ["NVFP4Quantizer", "NVFP4Tensor", "NVFP4TensorStorage", "TransposedNVFP4Operand", "nvfp4_scale_shape"]

NVFP4_FIELDS = FIELDS + ("_amax_rowwise", "_amax_columnwise")


def _check_standard_nvfp4(use_4over6: bool, e4m3_max: int) -> None:
    if use_4over6:
        raise NotImplementedError("NVFP4: nvfp4_use_4over6=True (4over6 block scaling) is not supported by fp8kit")
    if int(e4m3_max) != 448:
        raise ValueError(f"NVFP4: nvfp4_e4m3_max must be 448 without 4over6, got {e4m3_max}")


def nvfp4_scale_shape(shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
    """TE's padded E4M3 scale shape for a tensor of `shape` (see the module docstring)."""
    m, k = _flat2d(shape)
    if columnwise:
        return round_up(k, 128), round_up(math.ceil(m / nc.NVFP4_BLOCK), 4)
    return round_up(m, 128), round_up(math.ceil(k / nc.NVFP4_BLOCK), 4)


class NVFP4TensorStorage(BlockScaledStorage):
    """NVFP4 data as a plain object (what the GEMMs take). TE's positional signature: NVFP4TensorStorage(
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise, amax_columnwise, fp4_dtype,
    quantizer, with_gemm_swizzled_scales, *, row_scaled_nvfp4=False, nvfp4_use_4over6=False, nvfp4_e4m3_max=448,
    fake_dtype=None). Swizzled scales and 4over6 are refused (compact layout, standard NVFP4 only)."""

    def __init__(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise,
                 amax_columnwise, fp4_dtype=DType.kFloat4E2M1, quantizer=None, with_gemm_swizzled_scales=False, *,
                 row_scaled_nvfp4: bool = False, nvfp4_use_4over6: bool = False, nvfp4_e4m3_max: int = 448,
                 fake_dtype=None, shape=None):
        _check_standard_nvfp4(nvfp4_use_4over6, nvfp4_e4m3_max)
        self._init_nvfp4(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise,
                         amax_columnwise, fp4_dtype, quantizer, with_gemm_swizzled_scales, fake_dtype, shape,
                         row_scaled_nvfp4)

    def _init_nvfp4(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise,
                    amax_columnwise, fp4_dtype, quantizer, swizzled, fake_dtype, shape, row_scaled=False) -> None:
        if swizzled:
            raise NotImplementedError("NVFP4: GEMM-swizzled scales are not supported; fp8kit keeps the compact layout")
        if DType.cast(fp4_dtype) != DType.kFloat4E2M1:
            raise TypeError(f"NVFP4: fp4_dtype must be DType.kFloat4E2M1, got {fp4_dtype!r}")
        if rowwise_data is None and columnwise_data is None:
            raise ValueError("NVFP4TensorStorage: needs rowwise_data or columnwise_data")
        for name, data in (("rowwise_data", rowwise_data), ("columnwise_data", columnwise_data)):
            if data is not None and data.dtype != torch.uint8:
                raise TypeError(f"NVFP4TensorStorage: {name} must be torch.uint8 (packed E2M1), got {data.dtype}")
        self._rowwise_data, self._rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self._columnwise_data, self._columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self._amax_rowwise, self._amax_columnwise = amax_rowwise, amax_columnwise
        self._fp4_dtype = self._fp8_dtype = DType.kFloat4E2M1
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._dtype = fake_dtype if fake_dtype is not None else torch.float32
        self._with_gemm_swizzled_scales = False
        self._flag = bool(row_scaled)  # the format flag of block storages: here, row-scaled
        if shape is None:
            if rowwise_data is not None:
                shape = tuple(rowwise_data.shape[:-1]) + (rowwise_data.shape[-1] * 2,)
            else:
                k, m_half = columnwise_data.shape[0], math.prod(columnwise_data.shape[1:])
                shape = (m_half * 2, k)
        self._nvfp4_shape = torch.Size(shape)

    _flag = False

    @property
    def _row_scaled_nvfp4(self) -> bool:
        """Whether each row carries its own global scale (TE's attribute name)."""
        return self._flag

    @property
    def _nvfp4_use_4over6(self) -> bool:
        return False

    @property
    def _nvfp4_e4m3_max(self) -> int:
        return 448

    @property
    def fp8_dtype(self):
        raise TypeError("NVFP4 data is E2M1 (fp4_dtype), not an FP8 format")

    @staticmethod
    def _rowwise_shape_of(shape) -> tuple:
        shape = tuple(shape)
        return shape[:-1] + (shape[-1] // 2,)

    @staticmethod
    def _columnwise_shape_of(shape) -> tuple:
        m, k = _flat2d(shape)
        return (k, m // 2)

    def _logical_shape(self) -> torch.Size:
        return self._nvfp4_shape

    def _fields(self):
        return {name.lstrip("_"): getattr(self, name) for name in NVFP4_FIELDS}

    def prepare_for_saving(self):
        tensors = [getattr(self, name) for name in NVFP4_FIELDS]
        for name in NVFP4_FIELDS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors):
        for name, t in zip(NVFP4_FIELDS, tensors):
            setattr(self, name, t)
        return tensors[len(NVFP4_FIELDS):]

    def block_scales(self, columnwise: bool) -> torch.Tensor:
        """The E4M3 scale bytes without padding: (M, K / 16) rowwise, (K, M / 16) columnwise."""
        m, k = _flat2d(self._logical_shape())
        if columnwise:
            return self._columnwise_scale_inv[:k, : m // nc.NVFP4_BLOCK]
        return self._rowwise_scale_inv[:m, : k // nc.NVFP4_BLOCK]

    def layout(self, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(E2M1 values as float32 (rows, K'), float32 block scales (rows, K' / 16), float32 amax (1,)) of the
        rowwise layout (M, K) or the columnwise one (K, M)); the amax is (rows,) when row-scaled."""
        data = self._columnwise_data if columnwise else self._rowwise_data
        if data is None:
            raise ValueError(f"NVFP4: the tensor has no {'columnwise' if columnwise else 'rowwise'} data")
        m, k = _flat2d(self._logical_shape())
        rows, cols = (k, m) if columnwise else (m, k)
        values = nc.e2m1_decode(nc.unpack_e2m1(data.reshape(rows, cols // 2)))  # (explicit: rows may be 0)
        scales = self.block_scales(columnwise).view(torch.float8_e4m3fn).float()
        amax = self._amax_columnwise if columnwise else self._amax_rowwise
        return values, scales, amax.float().reshape(-1 if self._flag else 1)

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        """`e2m1 * e4m3_scale * (amax / 2688)` (the global decode scale 1 / S of the cast, per row when row-scaled)
        from the rowwise data (else the columnwise one, transposed back; with RHT that is the transformed tensor)."""
        columnwise = self._rowwise_data is None
        values, scales, amax = self.layout(columnwise)
        decode = torch.reciprocal(nc.global_encode_scale(amax)).reshape(-1, 1)
        rows, cols = values.shape
        out = (values.reshape(rows, cols // nc.NVFP4_BLOCK, nc.NVFP4_BLOCK) * (scales * decode)[:, :, None])
        out = out.reshape(rows, cols)
        if columnwise:
            out = out.t()
        return out.reshape(self._logical_shape()).to(dtype)

    def transposed(self) -> "TransposedNVFP4Operand":
        """This tensor (flattened to 2-D) as the transpose in a GEMM: the GEMM reads the columnwise layout."""
        return TransposedNVFP4Operand(self)

    def as_tensor(self) -> "NVFP4Tensor":
        if isinstance(self, NVFP4Tensor):
            return self
        return NVFP4Tensor._make(self._fields(), self._fp4_dtype, self._dtype, self._flag, self._quantizer,
                                 shape=self._logical_shape())

    _SAVED_FIELDS = NVFP4_FIELDS

    def _metadata(self) -> dict:
        return dict(quantizer=self._quantizer, fake_dtype=self._dtype, shape=self._logical_shape(),
                    row_scaled_nvfp4=self._flag)

    def __repr__(self) -> str:
        return (f"NVFP4TensorStorage(shape={tuple(self._logical_shape())}, usages={self.get_usages()}, "
                f"dtype={self._dtype}, row_scaled_nvfp4={self._flag})")


class TransposedNVFP4Operand(TransposedBlockOperand):
    """The transpose of an NVFP4 tensor as a GEMM operand (its own type, so that the GEMM rules tell it apart)."""

    __slots__ = ()


class NVFP4Tensor(BlockScaledTensorMixin, NVFP4TensorStorage, QuantizedTensor):
    """An NVFP4 tensor (a torch.Tensor with the nominal dtype and shape). TE's keyword signature: NVFP4Tensor(shape,
    dtype, *, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise, amax_columnwise,
    fp4_dtype, quantizer, with_gemm_swizzled_scales=False, row_scaled_nvfp4=False, nvfp4_use_4over6=False,
    nvfp4_e4m3_max=448, requires_grad=False)."""

    def __new__(cls, shape=None, dtype: Optional[torch.dtype] = None, *, rowwise_data, rowwise_scale_inv,
                columnwise_data, columnwise_scale_inv, amax_rowwise, amax_columnwise, fp4_dtype=DType.kFloat4E2M1,
                quantizer=None, with_gemm_swizzled_scales: bool = False, row_scaled_nvfp4: bool = False,
                nvfp4_use_4over6: bool = False, nvfp4_e4m3_max: int = 448, requires_grad: bool = False,
                device=None, fake_dtype=None, **kwargs):
        dtype = dtype or fake_dtype or torch.float32
        probe = NVFP4TensorStorage(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                                   amax_rowwise, amax_columnwise, fp4_dtype, None, with_gemm_swizzled_scales,
                                   row_scaled_nvfp4=row_scaled_nvfp4, nvfp4_use_4over6=nvfp4_use_4over6,
                                   nvfp4_e4m3_max=nvfp4_e4m3_max, shape=shape)
        data = rowwise_data if rowwise_data is not None else columnwise_data
        instance = QuantizedTensor.__new__(cls, tuple(probe._nvfp4_shape), dtype, requires_grad=requires_grad,
                                           device=data.device)
        instance._init_nvfp4(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise,
                             amax_columnwise, fp4_dtype, quantizer, with_gemm_swizzled_scales, dtype,
                             probe._nvfp4_shape, row_scaled_nvfp4)
        return instance

    @classmethod
    def _make(cls, fields, fp8_dtype, dtype, flag, quantizer, shape=None):
        """(`flag`: row-scaled.)"""
        return cls(shape, dtype=dtype, quantizer=quantizer, row_scaled_nvfp4=bool(flag), **fields)

    _DATA_STATE = NVFP4_FIELDS + ("_fp4_dtype", "_fp8_dtype", "_quantizer", "_with_gemm_swizzled_scales",
                                  "_nvfp4_shape")

    def _rebuild(self, fields):
        """The same tensor with new fields (a view's: the shape follows the rowwise data when there is some)."""
        shape = None if fields.get("rowwise_data") is not None else tuple(self.shape)
        return self._make(fields, None, self.dtype, self._flag, self._quantizer, shape=shape)

    def _logical_shape(self) -> torch.Size:
        return torch.Tensor.shape.__get__(self)

    def _default_quantizer(self):
        return NVFP4Quantizer(rowwise=self._rowwise_data is not None, columnwise=self._columnwise_data is not None,
                              row_scaled_nvfp4=self._flag)

    def __reduce_ex__(self, protocol):  # (torch.save of a model with NVFP4 weights)
        state = (self._fields(), int(DType.kFloat4E2M1), self.dtype, self._flag)
        return rebuild_pickled_block_tensor, (type(self), state, self.requires_grad)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"NVFP4Tensor(data={self.dequantize_impl(self.dtype)})"


class NVFP4Quantizer(BlockQuantizer):
    """Quantizes to NVFP4. TE's signature: NVFP4Quantizer(fp4_dtype=DType.kFloat4E2M1, rowwise=True, columnwise=True,
    with_amax_reduction=False, amax_reduction_group=None, with_rht=False, with_post_rht_amax=False,
    with_2d_quantization=False, stochastic_rounding=False, row_scaled_nvfp4=False, nvfp4_use_4over6=False,
    nvfp4_e4m3_max=448, nvfp4_4over6_err_mode="MAE", with_random_sign_mask=True).

    - `with_rht`: the columnwise usage is quantized from the random Hadamard transform of the transpose (its amax
      taken after the transform, so `with_post_rht_amax` must be True too); the rowwise usage never is.
    - `with_2d_quantization`: one scale per 16x16 block (both usages); else 1x16 (rowwise) and 16x1 (columnwise).
    - `stochastic_rounding`: E2M1 values rounded stochastically with uniform draws from torch's generator
      (`generator`, default: the device's default generator), fresh on every call.
    - `row_scaled_nvfp4`: one global scale per row (rowwise: per row of the tensor flattened to (M, K), amax (M,);
      columnwise: per row of the transpose, amax (K,)). Needs rowwise usage and 1x16 blocks without RHT or
      stochastic rounding (ValueError when quantizing otherwise, as Transformer Engine's kernels).
    Refused (NotImplementedError): amax reduction, 4over6."""

    _storage_class = NVFP4TensorStorage

    def __init__(self, fp4_dtype=DType.kFloat4E2M1, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None, with_rht: bool = False,
                 with_post_rht_amax: bool = False, with_2d_quantization: bool = False,
                 stochastic_rounding: bool = False, row_scaled_nvfp4: bool = False, nvfp4_use_4over6: bool = False,
                 nvfp4_e4m3_max: int = 448, nvfp4_4over6_err_mode: str = "MAE", with_random_sign_mask: bool = True,
                 generator: Optional[torch.Generator] = None) -> None:
        super(BlockQuantizer, self).__init__(rowwise=rowwise, columnwise=columnwise)
        if DType.cast(fp4_dtype) != DType.kFloat4E2M1:
            raise TypeError(f"NVFP4Quantizer: fp4_dtype must be DType.kFloat4E2M1, got {fp4_dtype!r}")
        for name, value in (("with_amax_reduction", with_amax_reduction), ("nvfp4_use_4over6", nvfp4_use_4over6)):
            if value:
                raise NotImplementedError(f"NVFP4Quantizer: {name}=True is not supported by fp8kit")
        if int(nvfp4_e4m3_max) not in (448, 256):
            raise ValueError(f"NVFP4Quantizer: nvfp4_e4m3_max must be 448 or 256, got {nvfp4_e4m3_max}")
        if str(nvfp4_4over6_err_mode).upper() not in ("MAE", "MSE"):
            raise ValueError(f"NVFP4Quantizer: nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got "
                             f"{nvfp4_4over6_err_mode!r}")
        if with_rht and not with_post_rht_amax:
            raise NotImplementedError("NVFP4Quantizer: with_rht=True needs with_post_rht_amax=True (fp8kit takes the "
                                      "columnwise amax after the transform, as NVFP4BlockScaling does)")
        self.dtype = DType.kFloat4E2M1
        self.with_rht, self.with_post_rht_amax = bool(with_rht), bool(with_post_rht_amax)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.with_random_sign_mask = bool(with_random_sign_mask)
        self.with_amax_reduction, self.amax_reduction_group = False, None
        self.row_scaled_nvfp4 = bool(row_scaled_nvfp4)
        self.nvfp4_use_4over6 = False
        self.nvfp4_e4m3_max, self.nvfp4_4over6_err_mode = 448, str(nvfp4_4over6_err_mode).upper()
        self.generator = generator
        self.optimize_for_gemm = False

    @property
    def fp8_torch_dtype(self) -> torch.dtype:
        return torch.uint8  # packed E2M1 (no torch float4 arithmetic dtype)

    def copy(self) -> "NVFP4Quantizer":
        out = NVFP4Quantizer(rowwise=self.rowwise_usage, columnwise=self.columnwise_usage, with_rht=self.with_rht,
                             with_post_rht_amax=self.with_post_rht_amax,
                             with_2d_quantization=self.with_2d_quantization,
                             stochastic_rounding=self.stochastic_rounding, row_scaled_nvfp4=self.row_scaled_nvfp4,
                             with_random_sign_mask=self.with_random_sign_mask, generator=self.generator)
        out.internal = self.internal
        return out

    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
        return nvfp4_scale_shape(shape, columnwise)

    @staticmethod
    def get_columnwise_shape(shape: Iterable[int]) -> Tuple[int, ...]:
        """TE's: (dn, d1, ..., dn-1) for a tensor of shape (d1, ..., dn) (the data then holds half the last)."""
        shape = tuple(shape)
        return (shape[-1],) + shape[:-1] if shape else ()

    _dims_multiple_of = ("NVFP4", nc.NVFP4_BLOCK)

    def _draws(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.stochastic_rounding:
            return None
        return torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=self.generator)

    def _check_row_scaled(self) -> None:
        """Row-scaled NVFP4's limits (Transformer Engine's kernels refuse the same when quantizing)."""
        if not self.row_scaled_nvfp4:
            return
        for name in ("with_rht", "with_2d_quantization", "stochastic_rounding"):
            if getattr(self, name):
                raise ValueError(f"NVFP4Quantizer: row-scaled NVFP4 quantization does not support {name}=True")
        if not self.rowwise_usage:
            raise ValueError("NVFP4Quantizer: row-scaled NVFP4 quantization requires rowwise usage")

    def _fields(self, x: torch.Tensor) -> dict:
        shape = tuple(x.shape)
        x2 = x.reshape(_flat2d(shape))
        out = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
                   amax_rowwise=None, amax_columnwise=None)
        two_d, row_scaled = self.with_2d_quantization, self.row_scaled_nvfp4
        self._check_row_scaled()
        if self.rowwise_usage:
            data, scales, amax = nc.nvfp4_cast(x2, None, two_d, self._draws(x2), row_scaled)
            out.update(rowwise_data=data.reshape(shape[:-1] + (shape[-1] // 2,)),
                       rowwise_scale_inv=_zero_padded(scales, nvfp4_scale_shape(shape, False)), amax_rowwise=amax)
        if self.columnwise_usage:
            xt = x2.t().contiguous()
            if self.with_rht:
                xt = rht(xt, self.with_random_sign_mask)
            data, scales, amax = nc.nvfp4_cast(xt, None, two_d, self._draws(xt), row_scaled)
            out.update(columnwise_data=data, columnwise_scale_inv=_zero_padded(scales, nvfp4_scale_shape(shape, True)),
                       amax_columnwise=amax)
        return out

    def quantize_impl(self, tensor: torch.Tensor):
        x = self._check(tensor)
        return self._storage(self._fields(x), tuple(x.shape), x.dtype)

    def _storage(self, fields: dict, shape: tuple, dtype: torch.dtype, requires_grad: bool = False):
        if self.internal:
            return NVFP4TensorStorage(quantizer=self, fake_dtype=dtype, shape=shape,
                                      row_scaled_nvfp4=self.row_scaled_nvfp4, **fields)
        return NVFP4Tensor(shape, dtype, quantizer=self, row_scaled_nvfp4=self.row_scaled_nvfp4,
                           requires_grad=requires_grad, **fields)

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False, pin_memory: bool = False):
        """An uninitialised NVFP4 tensor of `shape` (TE's layouts: data (..., K / 2) and (K, M / 2) uint8, scales
        zero-padded to (round_up(M, 128), round_up(K / 16, 4)) and the transpose's, amaxes (1,), or (M,) and (K,)
        when row-scaled), to fill with `update_quantized`."""
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or any(d % nc.NVFP4_BLOCK for d in _flat2d(shape)):
            raise ValueError(f"NVFP4 requires tensor dims that are divisible by {nc.NVFP4_BLOCK}, got {shape}")
        self._check_row_scaled()
        m, k = _flat2d(shape)
        fields = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
                      amax_rowwise=None, amax_columnwise=None)

        def empty(size, dt=torch.uint8):
            return torch.empty(size, dtype=dt, device=device, pin_memory=pin_memory)

        if self.rowwise_usage:
            fields.update(rowwise_data=empty(shape[:-1] + (k // 2,)),
                          rowwise_scale_inv=torch.zeros(nvfp4_scale_shape(shape, False), dtype=torch.uint8,
                                                        device=device),
                          amax_rowwise=empty((m if self.row_scaled_nvfp4 else 1,), torch.float32))
        if self.columnwise_usage:
            fields.update(columnwise_data=empty((k, m // 2)),
                          columnwise_scale_inv=torch.zeros(nvfp4_scale_shape(shape, True), dtype=torch.uint8,
                                                           device=device),
                          amax_columnwise=empty((k if self.row_scaled_nvfp4 else 1,), torch.float32))
        return self._storage(fields, shape, dtype, requires_grad)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None):
        """Quantize `src` into `dst` (see BlockQuantizer.update_quantized); dst becomes row-scaled or not as this
        quantizer is."""
        out = super().update_quantized(src, dst, noop_flag=noop_flag)
        out._flag = self.row_scaled_nvfp4
        return out

    def __repr__(self) -> str:
        return (f"NVFP4Quantizer(rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
                f"with_rht={self.with_rht}, with_2d_quantization={self.with_2d_quantization}, "
                f"stochastic_rounding={self.stochastic_rounding}, row_scaled_nvfp4={self.row_scaled_nvfp4}, "
                f"internal={self.internal})")
