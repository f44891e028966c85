"""Float8 block scaling (DeepSeek-V3's recipe): FP8 values with a float32 scale per 1x128 block (activations and
gradients) or per 128x128 block (weights); Transformer Engine's `Float8BlockQuantizer`, `Float8BlockwiseQTensor` and
`Float8BlockwiseQTensorStorage` (`transformer_engine.pytorch.tensor.float8_blockwise_tensor`).

Layout (TE's), for the flattened (M, K): `_rowwise_data` has the tensor's shape; `_columnwise_data` is the transpose,
shape (K, *leading dims), quantized from the input along the other dim. Scales are float32 scale_inv:
- 1x128 (`block_scaling_dim=1`): rowwise stored transposed, (ceil(K / 128), round_up(M, 4)), entry [kb, m];
  columnwise (ceil(M / 128), round_up(K, 4)), entry [mb, k].
- 128x128 (`block_scaling_dim=2`): rowwise (ceil(M / 128), round_up(ceil(K / 128), 4)), entry [mb, kb];
  columnwise its transpose, (ceil(K / 128), round_up(ceil(M / 128), 4)).
Padding entries are 0 (TE leaves them unset). Any M and K are accepted (the last blocks are shorter), as in TE.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

from .. import block_cast as bc
from ..quantized_tensor import QuantizedTensor
from .block_storage import BlockQuantizer, BlockScaledStorage, BlockScaledTensorMixin

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "block_scale_shape"]

B = bc.FLOAT8_BLOCK


def _flat2d(shape) -> Tuple[int, int]:
    shape = tuple(shape)
    k = shape[-1] if shape else 1
    return math.prod(shape[:-1]), k


def block_scale_shape(shape: Iterable[int], columnwise: bool, block_scaling_dim: int) -> Tuple[int, int]:
    """TE's padded scale_inv shape for a tensor of `shape` (see the module docstring)."""
    m, k = _flat2d(shape)
    if block_scaling_dim == 2:
        mb, kb = bc.ceil_div(m, B), bc.ceil_div(k, B)
        return (kb, bc.round_up(mb, 4)) if columnwise else (mb, bc.round_up(kb, 4))
    if block_scaling_dim == 1:
        return (bc.ceil_div(m, B), bc.round_up(k, 4)) if columnwise else (bc.ceil_div(k, B), bc.round_up(m, 4))
    raise ValueError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")


def _zero_padded(s: torch.Tensor, shape: Tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32, device=s.device)
    out[: s.shape[0], : s.shape[1]] = s
    return out


def _columnwise_2d(shape) -> Tuple[int, int]:
    """(K, M) of columnwise data of `shape` (K, *M dims); a 0-d tensor's is (1, 1)."""
    shape = tuple(shape)
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def _columnwise_shape(shape) -> Tuple[int, ...]:
    shape = tuple(shape)
    return (shape[-1],) + shape[:-1] if shape else ()


class Float8BlockwiseQTensorStorage(BlockScaledStorage):
    """Float8 block-scaled data as a plain object. TE's positional signature: Float8BlockwiseQTensorStorage(
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer, is_2D_scaled, *,
    fake_dtype=None)."""

    def __init__(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                 quantizer=None, is_2D_scaled: bool = False, *, fake_dtype=None):
        self._set_fields(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                         quantizer, fake_dtype)
        self._is_2D_scaled = bool(is_2D_scaled)

    @property
    def _flag(self) -> bool:
        return self._is_2D_scaled

    @staticmethod
    def _columnwise_shape_of(shape) -> tuple:
        return _columnwise_shape(shape)

    def _logical_shape(self) -> torch.Size:
        if self._rowwise_data is not None:
            return self._rowwise_data.shape
        dims = tuple(self._columnwise_data.shape)
        return torch.Size(dims[1:] + dims[:1])

    def block_scale_inv(self, columnwise: bool) -> torch.Tensor:
        """float32 scale_inv per (row, 128-wide block along the row) of the layout's 2-D data, without padding:
        rowwise (M, ceil(K / 128)) for data (M, K); columnwise (K, ceil(M / 128)) for data (K, M). 2-D scales are
        repeated over the 128 rows of their block."""
        m, k = _flat2d(self._logical_shape())
        rows, cols = (k, m) if columnwise else (m, k)
        s = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        nb = bc.ceil_div(cols, B)
        if self._is_2D_scaled:
            return s[: bc.ceil_div(rows, B), :nb].repeat_interleave(B, dim=0)[:rows]
        return s[:nb, :rows].t()

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        """`float32(fp8) * scale_inv` per block from the rowwise data (else the columnwise, transposed back)."""
        columnwise = self._rowwise_data is None
        data = self._columnwise_data if columnwise else self._rowwise_data
        rows, cols = _flat2d(data.shape) if not columnwise else _columnwise_2d(data.shape)
        values = data.reshape(rows, cols).view(self.fp8_dtype).float()
        scale = self.block_scale_inv(columnwise).repeat_interleave(B, dim=1)[:, :cols]
        values = values * scale
        if columnwise:
            return values.t().reshape(self._logical_shape()).to(dtype)
        return values.reshape(data.shape).to(dtype)

    def as_tensor(self) -> "Float8BlockwiseQTensor":
        if isinstance(self, Float8BlockwiseQTensor):
            return self
        return Float8BlockwiseQTensor._make(self._fields(), self._fp8_dtype, self._dtype, self._flag, self._quantizer)

    def _metadata(self) -> dict:
        return dict(fp8_dtype=self._fp8_dtype, quantizer=self._quantizer, is_2D_scaled=self._is_2D_scaled,
                    fake_dtype=self._dtype)

    # ---- Transformer Engine's FSDP2 buffer protocol (what a dim-0 all-gather sends and how it is put back) ----

    def fsdp_buffer_fields(self) -> Tuple[str, ...]:
        """The fields an FSDP2 all-gather sends (128x128 blocks only: 1x128 scales hold M along dim 1)."""
        if not self._is_2D_scaled:
            raise NotImplementedError("Float8BlockwiseQTensor: FSDP2 all-gather needs 2D block scaling "
                                      "(block_scaling_dim=2); 1D scales hold M along dim 1, not dim 0")
        return tuple(f"_{n}_{f}" for n in ("rowwise", "columnwise") if getattr(self, f"_{n}_data") is not None
                     for f in ("data", "scale_inv"))

    def fsdp_extract_buffers(self) -> Tuple[Tuple[torch.Tensor, torch.Tensor], dict]:
        """(data, scale_inv) with M along dim 0 and no scale padding, from the rowwise layout (else the columnwise
        one, transposed back), and the metadata `fsdp_assign_gathered` reads."""
        names = self.fsdp_buffer_fields()
        shape = tuple(self._logical_shape())
        m, k = _flat2d(shape)
        if m % B:
            raise RuntimeError(f"Float8BlockwiseQTensor: FSDP2 cannot all-gather a shard whose flattened M ({m}) is "
                               f"not a multiple of {B}: the shard boundary would split a 128x128 block")
        mb, kb = bc.ceil_div(m, B), bc.ceil_div(k, B)
        if self._rowwise_data is not None:
            return (self._rowwise_data, self._rowwise_scale_inv[:, :kb].contiguous()), \
                dict(direction="rowwise", field_names=names)
        data = self._columnwise_data.reshape(k, m).t().contiguous().reshape(shape)
        scale = self._columnwise_scale_inv.t()[:mb].contiguous()
        return (data, scale), dict(direction="columnwise", field_names=names)

    def fsdp_assign_gathered(self, gathered, meta: dict) -> None:
        """Put gathered (data, scale_inv) (M along dim 0, scales unpadded) back into the layout `meta` names,
        re-padding the scales; a scale whose shape does not tile the data is refused (RuntimeError), the fields
        unchanged."""
        direction = meta.get("direction")
        if direction not in ("rowwise", "columnwise"):
            raise RuntimeError(f"Float8BlockwiseQTensor.fsdp_assign_gathered: direction must be 'rowwise' or "
                               f"'columnwise', got {direction!r}")
        data, scale = gathered
        if data is None or scale is None:
            raise RuntimeError("Float8BlockwiseQTensor.fsdp_assign_gathered: needs both the data and the scale")
        shape = tuple(data.shape)
        m, k = _flat2d(shape)
        mb, kb = bc.ceil_div(m, B), bc.ceil_div(k, B)
        if tuple(scale.shape) != (mb, kb):
            raise RuntimeError(f"Float8BlockwiseQTensor.fsdp_assign_gathered: the gathered scale geometry does not "
                               f"match the gathered data: scale shape {tuple(scale.shape)}, expected {(mb, kb)} "
                               f"for data of shape {shape}")
        if direction == "rowwise":
            self._rowwise_data = data
            self._rowwise_scale_inv = _zero_padded(scale, block_scale_shape(shape, False, 2))
            return
        self._columnwise_data = data.reshape(m, k).t().contiguous().reshape(_columnwise_shape(shape))
        self._columnwise_scale_inv = _zero_padded(scale.t(), block_scale_shape(shape, True, 2))

    def _create_columnwise(self) -> None:
        """The columnwise layout from the rowwise one (128x128 blocks: the transpose's blocks and scales are the
        same, so the bytes are those of quantizing the high-precision value), as Transformer Engine does."""
        if not self._is_2D_scaled or self._rowwise_data is None:
            raise RuntimeError("Float8BlockwiseQTensor: the columnwise layout can be made from the rowwise one only "
                               "with 2D block scaling (1x128 blocks differ between the layouts)")
        shape = tuple(self._logical_shape())
        m, k = _flat2d(shape)
        mb, kb = bc.ceil_div(m, B), bc.ceil_div(k, B)
        self._columnwise_data = self._rowwise_data.reshape(m, k).t().contiguous().reshape(_columnwise_shape(shape))
        self._columnwise_scale_inv = _zero_padded(self._rowwise_scale_inv[:mb, :kb].t(),
                                                  block_scale_shape(shape, True, 2))

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """As the other block layouts; with 128x128 blocks a missing columnwise layout asked for is made from the
        rowwise one (`_create_columnwise`)."""
        if columnwise_usage and self._columnwise_data is None and self._is_2D_scaled \
                and self._rowwise_data is not None:
            self._create_columnwise()
        super().update_usage(rowwise_usage, columnwise_usage)

    def __repr__(self) -> str:
        return (f"Float8BlockwiseQTensorStorage(shape={tuple(self._logical_shape())}, "
                f"fp8_dtype={self._fp8_dtype.name}, is_2D_scaled={self._is_2D_scaled}, usages={self.get_usages()}, "
                f"dtype={self._dtype})")


class Float8BlockwiseQTensor(BlockScaledTensorMixin, Float8BlockwiseQTensorStorage, QuantizedTensor):
    """A Float8 block-scaled tensor (a torch.Tensor with the nominal dtype and shape). TE's keyword signature:
    Float8BlockwiseQTensor(shape, dtype, *, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
    fp8_dtype, quantizer, is_2D_scaled, requires_grad=False, device=None)."""

    def __new__(cls, shape=None, dtype: Optional[torch.dtype] = None, *, rowwise_data, rowwise_scale_inv,
                columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer=None, is_2D_scaled: bool = False,
                requires_grad: bool = False, device=None, fake_dtype=None, **kwargs):
        dtype = dtype or fake_dtype or torch.float32
        if shape is None:
            if rowwise_data is not None:
                shape = tuple(rowwise_data.shape)
            else:
                dims = tuple(columnwise_data.shape)
                shape = dims[1:] + dims[:1]
        data = rowwise_data if rowwise_data is not None else columnwise_data
        instance = QuantizedTensor.__new__(cls, tuple(shape), dtype, requires_grad=requires_grad, device=data.device)
        instance._set_fields(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                             quantizer, dtype)
        instance._is_2D_scaled = bool(is_2D_scaled)
        return instance

    @classmethod
    def _make(cls, fields, fp8_dtype, dtype, flag, quantizer):
        return cls(dtype=dtype, fp8_dtype=fp8_dtype, quantizer=quantizer, is_2D_scaled=flag, **fields)

    _DATA_STATE = BlockScaledTensorMixin._DATA_STATE + ("_is_2D_scaled",)
    _data_keeps_shape = True

    def _default_quantizer(self):
        return Float8BlockQuantizer(self._fp8_dtype, rowwise=self._rowwise_data is not None,
                                    columnwise=self._columnwise_data is not None,
                                    block_scaling_dim=2 if self._is_2D_scaled else 1)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8BlockwiseQTensor(fp8_dtype={self._fp8_dtype.name}, is_2D_scaled={self._is_2D_scaled}, "
                f"data={self.dequantize_impl(self.dtype)})")


class Float8BlockQuantizer(BlockQuantizer):
    """Quantizes with a float32 scale per block computed from the block's own amax: `fp8_max / max(amax,
    amax_epsilon)`, by default rounded down to a power of two (`force_pow_2_scales`). `block_scaling_dim=1`: 1x128
    blocks (rowwise along the last dim; columnwise along the flattened first dim, stored transposed);
    `block_scaling_dim=2`: 128x128 blocks.

    Float8BlockQuantizer(fp8_dtype, *, rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True,
    block_scaling_dim=2): TE's signature and defaults."""

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = True, block_scaling_dim: int = 2) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        if block_scaling_dim not in (1, 2) or isinstance(block_scaling_dim, bool):
            raise ValueError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
        eps = float(amax_epsilon)
        if not (eps >= 0 and math.isfinite(eps)):
            raise ValueError(f"Float8BlockQuantizer: amax_epsilon must be finite and >= 0, got {amax_epsilon!r}")
        self.block_len = B
        self.amax_epsilon = amax_epsilon
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = int(block_scaling_dim)

    _storage_class = Float8BlockwiseQTensorStorage

    def _shape_error(self, x: torch.Tensor) -> Optional[str]:
        return None  # any shape, a 0-d tensor as (1, 1) (as Transformer Engine)

    def copy(self) -> "Float8BlockQuantizer":
        out = Float8BlockQuantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                   amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
                                   block_scaling_dim=self.block_scaling_dim)
        out.internal = self.internal
        return out

    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
        return block_scale_shape(shape, columnwise, self.block_scaling_dim)

    def get_columnwise_shape(self, shape: Iterable[int]) -> Tuple[int, ...]:
        return _columnwise_shape(shape)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's test for the shapes its GEMMs take without padding (>= 2 dims, multiples of 128); quantizing
        accepts any shape."""
        if inp.dim() < 2:
            return False
        m, k = _flat2d(inp.shape)
        return m % B == 0 and k % B == 0

    def _fields(self, x: torch.Tensor) -> dict:
        shape = tuple(x.shape)
        x2 = x.reshape(_flat2d(shape))
        fp8, pow2, eps = self.fp8_torch_dtype, self.force_pow_2_scales, self.amax_epsilon
        out = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
        if self.block_scaling_dim == 2:
            data, s = bc.float8_block_cast_2d(x2, fp8, pow2, eps)
            if self.rowwise_usage:
                out["rowwise_data"] = data.reshape(shape)
                out["rowwise_scale_inv"] = _zero_padded(s, block_scale_shape(shape, False, 2))
            if self.columnwise_usage:  # square blocks: the transpose's blocks and scales are the same
                out["columnwise_data"] = data.t().contiguous().reshape(_columnwise_shape(shape))
                out["columnwise_scale_inv"] = _zero_padded(s.t(), block_scale_shape(shape, True, 2))
            return out
        if self.rowwise_usage:
            data, s = bc.float8_block_cast_1d(x2, fp8, pow2, eps)
            out["rowwise_data"] = data.reshape(shape)
            out["rowwise_scale_inv"] = _zero_padded(s.t(), block_scale_shape(shape, False, 1))
        if self.columnwise_usage:
            data, s = bc.float8_block_cast_1d(x2.t(), fp8, pow2, eps)
            out["columnwise_data"] = data.reshape(_columnwise_shape(shape))
            out["columnwise_scale_inv"] = _zero_padded(s.t(), block_scale_shape(shape, True, 1))
        return out

    def _wrap(self, fields: dict, dtype: torch.dtype, requires_grad: bool = False):
        if self.internal:
            return Float8BlockwiseQTensorStorage(fp8_dtype=self.dtype, quantizer=self, fake_dtype=dtype,
                                                 is_2D_scaled=self.block_scaling_dim == 2, **fields)
        return Float8BlockwiseQTensor(dtype=dtype, fp8_dtype=self.dtype, quantizer=self, requires_grad=requires_grad,
                                      is_2D_scaled=self.block_scaling_dim == 2, **fields)

    def quantize_impl(self, tensor: torch.Tensor):
        x = self._check(tensor)
        return self._wrap(self._fields(x), x.dtype)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None):
        super().update_quantized(src, dst, noop_flag=noop_flag)
        dst._is_2D_scaled = self.block_scaling_dim == 2
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False, pin_memory: bool = False):
        shape = tuple(shape)
        fields = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
        for usage, name in ((self.rowwise_usage, "rowwise"), (self.columnwise_usage, "columnwise")):
            if usage:
                data_shape = _columnwise_shape(shape) if name == "columnwise" else shape
                fields[f"{name}_data"] = torch.empty(data_shape, dtype=torch.uint8, device=device,
                                                     pin_memory=pin_memory)
                fields[f"{name}_scale_inv"] = torch.zeros(
                    block_scale_shape(shape, name == "columnwise", self.block_scaling_dim), device=device)
        return self._wrap(fields, dtype, requires_grad)

    def __repr__(self) -> str:
        return (f"Float8BlockQuantizer(fp8_dtype={self.dtype.name}, block_scaling_dim={self.block_scaling_dim}, "
                f"force_pow_2_scales={self.force_pow_2_scales}, amax_epsilon={self.amax_epsilon}, "
                f"rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
                f"internal={self.internal})")
