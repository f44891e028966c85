"""What the block-scaled storages and tensors share (MXFP8 and Float8 block scaling): Transformer Engine's four
fields `_rowwise_data`, `_rowwise_scale_inv`, `_columnwise_data`, `_columnwise_scale_inv` (FP8 bytes as `torch.uint8`,
the format in `_fp8_dtype`), saving for backward, usages, and the torch.Tensor plumbing that keeps a block tensor
quantized through detach / clone / device moves (every other operation runs on dequantized values)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..constants import DType, fp8_torch_dtype
from ..quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    dispatch_through,
    set_wrapper_metadata,
)
from .float8_tensor import _check as high_precision_input

__all__ = ["BlockScaledStorage", "BlockScaledTensorMixin", "BlockQuantizer", "TransposedBlockOperand", "FIELDS"]

FIELDS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")
aten = torch.ops.aten


class BlockScaledStorage(QuantizedTensorStorage):
    """The four tensors of a block-scaled quantized tensor, its format (`_fp8_dtype`, a DType), nominal dtype
    (`_dtype`) and quantizer. Subclasses say how the layouts map to the logical shape and how to dequantize."""

    def _set_fields(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
                    quantizer, fake_dtype) -> None:
        if rowwise_data is None and columnwise_data is None:
            raise ValueError(f"{type(self).__name__}: needs rowwise_data or columnwise_data")
        for name, data, scale in (("rowwise", rowwise_data, rowwise_scale_inv),
                                  ("columnwise", columnwise_data, columnwise_scale_inv)):
            if data is not None and (not isinstance(data, torch.Tensor) or data.dtype != torch.uint8):
                raise TypeError(f"{type(self).__name__}: {name}_data must be a torch.uint8 tensor (FP8 bytes), got "
                                f"{getattr(data, 'dtype', type(data))}")
            if data is not None and not isinstance(scale, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: {name}_scale_inv must be a tensor when {name}_data is given")
        self._rowwise_data = rowwise_data
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_data = columnwise_data
        self._columnwise_scale_inv = columnwise_scale_inv
        fp8_torch_dtype(fp8_dtype, f"{type(self).__name__} fp8_dtype")  # validates
        self._fp8_dtype = DType.cast(fp8_dtype)
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._dtype = fake_dtype if fake_dtype is not None else torch.float32

    # ---- reading ----

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The torch float8 dtype the bytes are in."""
        return fp8_torch_dtype(self._fp8_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        data = self._rowwise_data if self._rowwise_data is not None else self._columnwise_data
        return data.device

    @property
    def shape(self) -> torch.Size:
        return self.size()

    def size(self, *args, **kwargs):
        shape = self._logical_shape()
        dim = args[0] if args else kwargs.get("dim")
        return shape if dim is None else shape[dim]

    def _logical_shape(self) -> torch.Size:
        raise NotImplementedError

    @staticmethod
    def _rowwise_shape_of(shape) -> tuple:
        """The rowwise data's shape for a tensor of `shape` (the shape itself unless values are packed)."""
        return tuple(shape)

    @staticmethod
    def _columnwise_shape_of(shape) -> tuple:
        """The columnwise data's shape for a tensor of `shape`."""
        raise NotImplementedError

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a plain tensor of `dtype` (default: the nominal dtype)."""
        return self.dequantize_impl(self._dtype if dtype is None else dtype)

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """The data tensors asked for (one, or a tuple of two)."""
        if rowwise_data and columnwise_data:
            return self._rowwise_data, self._columnwise_data
        return self._rowwise_data if rowwise_data else self._columnwise_data

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self._rowwise_data is not None, "columnwise": self._columnwise_data is not None}

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop a layout that is no longer needed. A missing layout cannot be made from the other (both are
        quantized from the high-precision input): asking for one is an error."""
        for usage, name in ((rowwise_usage, "rowwise"), (columnwise_usage, "columnwise")):
            if usage is False:
                if getattr(self, f"_{'columnwise' if name == 'rowwise' else 'rowwise'}_data") is None:
                    raise RuntimeError(f"{type(self).__name__}: cannot drop the {name} data, the only layout left")
                setattr(self, f"_{name}_data", None)
                setattr(self, f"_{name}_scale_inv", None)
            elif usage and getattr(self, f"_{name}_data") is None:
                raise RuntimeError(f"{type(self).__name__}: {name} data was not quantized; quantize with "
                                   f"{name}=True (it cannot be derived from the other layout)")

    def clear(self) -> None:
        """Release the data (empty tensors), as Transformer Engine's `clear`."""
        for name in FIELDS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.empty(0, dtype=t.dtype, device=t.device))

    # ---- saving for backward ----

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "BlockScaledStorage"]:
        tensors = [getattr(self, name) for name in FIELDS]
        for name in FIELDS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        for name, t in zip(FIELDS, tensors):
            setattr(self, name, t)
        return tensors[len(FIELDS):]

    def _fields(self) -> Dict[str, Optional[torch.Tensor]]:
        return {name.lstrip("_"): getattr(self, name) for name in FIELDS}

    # ---- a GEMM operand (fp8kit's module GEMMs: fp8kit.pytorch.block_recipes) ----

    scale_inv_value = None  # per-tensor FP8's host-side scale; block scales live in tensors only

    def transposed(self) -> "TransposedBlockOperand":
        """This tensor (flattened to 2-D) as the transpose in a GEMM, `gemm(a, b)` computing `a @ b`: the GEMM then
        reads the columnwise layout (blocks along the other dim), no bytes move."""
        return TransposedBlockOperand(self)

    def as_tensor(self):
        """The same fields as the torch.Tensor subclass (what `ctx.save_for_backward` can hold)."""
        raise NotImplementedError

    _SAVED_FIELDS = FIELDS  # what `saved_form` hands to a traced graph, in this order

    def saved_form(self) -> Tuple[Optional[torch.Tensor], ...]:
        """The tensors to hand to `ctx.save_for_backward`; `from_saved(*tensors, scale_inv_value)` gives the operand
        back. Eager: (the tensor subclass holding every field, None), so that saved-tensor hooks (CPU offload) see
        one quantized tensor. Traced by torch.compile, where no tensor subclass can be built: the fields."""
        if torch.compiler.is_compiling():
            return tuple(getattr(self, name) for name in self._SAVED_FIELDS)
        return self.as_tensor(), None

    @property
    def from_saved(self):
        """The function that rebuilds the operand from the tensors `saved_form` gave (then `scale_inv_value`,
        unused). It holds no tensor of this storage: kept by an autograd context, it must not keep the forward's
        bytes alive past saved-tensor hooks (nor, traced, reach the backward graph other than as saved tensors)."""
        if torch.compiler.is_compiling():
            return _FieldsRebuild(type(self), tuple(n.lstrip("_") for n in self._SAVED_FIELDS), self._metadata())
        return _saved_tensor

    def _metadata(self) -> dict:
        """The storage constructor's keywords other than the fields (format, quantizer, nominal dtype, ...)."""
        raise NotImplementedError


def _saved_tensor(data, scale_inv=None, scale_inv_value=None):
    """The operand an eager `saved_form` gave: the saved tensor subclass, itself a storage."""
    return data


class _FieldsRebuild:
    """A block storage of `cls` over the saved fields (the traced `saved_form`), with `metadata`."""

    __slots__ = ("cls", "names", "metadata")

    def __init__(self, cls, names: Tuple[str, ...], metadata: dict):
        self.cls, self.names, self.metadata = cls, names, metadata

    def __call__(self, *saved):
        return self.cls(**dict(zip(self.names, saved)), **self.metadata)


class TransposedBlockOperand:
    """The transpose of a block-scaled tensor as a GEMM operand (see `BlockScaledStorage.transposed`)."""

    __slots__ = ("storage",)

    def __init__(self, storage: BlockScaledStorage):
        self.storage = storage

    scale_inv_value = None

    def transposed(self) -> BlockScaledStorage:
        return self.storage

    @property
    def shape(self) -> torch.Size:
        shape = self.storage.shape
        k = shape[-1] if len(shape) else 1
        return torch.Size((k, math.prod(shape) // k if k else 0) if len(shape) else ())

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.storage.fp8_dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values of the transpose (the flattened 2-D tensor, transposed)."""
        values = self.storage.dequantize(dtype)
        return values.reshape(-1, values.shape[-1]).t()


def _mapped(t: "BlockScaledTensorMixin", fn) -> "BlockScaledTensorMixin":
    fields = {k: (None if v is None else fn(v)) for k, v in t._fields().items()}
    return t._rebuild(fields)


def _to_copy(t, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if dtype is not None and dtype != t.dtype:
        return NotImplemented
    return _mapped(t, lambda v: v.to(device=device or v.device, non_blocking=non_blocking))


def _copy_(dst, src, non_blocking=False):
    """Into a block tensor: a tensor of the same class, shape and layouts gives its bytes and scales as they are
    (load_state_dict: re-quantizing dequantized values need not give the same bytes); anything else is quantized
    with `dst`'s quantizer."""
    if not isinstance(dst, BlockScaledTensorMixin):
        return NotImplemented
    mine, theirs = dst._fields(), getattr(src, "_fields", lambda: None)()
    if type(src) is type(dst) and src.shape == dst.shape and src.get_usages() == dst.get_usages() \
            and getattr(src, "_fp8_dtype", None) == getattr(dst, "_fp8_dtype", None) and src._flag == dst._flag \
            and all((a is None) == (b is None) and (a is None or a.shape == b.shape)
                    for a, b in zip(mine.values(), theirs.values())):
        for a, b in zip(mine.values(), theirs.values()):
            if a is not None:
                a.copy_(b, non_blocking=non_blocking)
        return dst
    values = src.dequantize_impl(src.dtype) if isinstance(src, QuantizedTensor) else src
    dst.quantize_(values.to(device=dst.device))
    return dst


def _resolved(shape, numel: int) -> tuple:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for n in shape:
            known *= n if n != -1 else 1
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def _view(t, size):
    """A view keeping the last dim stays quantized (the flattened (M, K) and so every block are unchanged): the data
    tensors are viewed, the scales shared; any other view runs on the values."""
    shape = _resolved(size, t.numel())
    old = tuple(t.shape)
    if not shape or not old or shape[-1] != old[-1]:
        return NotImplemented
    fields = t._fields()
    if fields["rowwise_data"] is not None:
        fields["rowwise_data"] = fields["rowwise_data"].view(t._rowwise_shape_of(shape))
    if fields["columnwise_data"] is not None:
        fields["columnwise_data"] = fields["columnwise_data"].view(t._columnwise_shape_of(shape))
    return t._rebuild(fields)


_HANDLERS = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.detach.default: lambda t: _mapped(t, lambda v: v),
    aten.clone.default: lambda t, memory_format=None: _mapped(t, torch.clone),
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
}


class BlockScaledTensorMixin:
    """torch.Tensor plumbing of MXFP8Tensor and Float8BlockwiseQTensor (mixed in before the storage class and
    QuantizedTensor): the wrapper's own shape, device and dtype, differentiable `dequantize`."""

    shape = torch.Tensor.shape
    device = torch.Tensor.device
    dtype = torch.Tensor.dtype
    size = torch.Tensor.size
    dequantize = QuantizedTensor.dequantize

    def __init__(self, *args, **kwargs):  # everything happened in __new__
        pass

    def _logical_shape(self) -> torch.Size:
        return torch.Tensor.shape.__get__(self)

    _flag: bool  # with_gemm_swizzled_scales (MXFP8) or _is_2D_scaled (Float8 block)

    @classmethod
    def _make(cls, fields: Dict[str, Optional[torch.Tensor]], fp8_dtype, dtype: torch.dtype, flag: bool, quantizer):
        raise NotImplementedError

    def _default_quantizer(self):
        raise NotImplementedError

    def _build_default_quantizer(self):
        return self._default_quantizer()

    def _rebuild(self, fields: Dict[str, Optional[torch.Tensor]]):
        return self._make(fields, self._fp8_dtype, self.dtype, self._flag, self._quantizer)

    # ---- `x.data`: reading gives a detached alias; assigning a tensor of the same class takes its fields,
    # assigning any other tensor quantizes it with this tensor's quantizer (Transformer Engine's rule) ----

    # the attributes `x.data = y` takes from the quantized `y`: the fields, the format, the quantizer, the flags
    _DATA_STATE: Tuple[str, ...] = FIELDS + ("_fp8_dtype", "_quantizer")
    # Float8BlockwiseQTensor keeps its shape and nominal dtype (TE refuses another shape, quantizes in place); the
    # others take the new value's (TE re-wraps them)
    _data_keeps_shape = False

    def _get_data(self):
        return super().data

    @torch.no_grad()
    def _set_data(self, tensor: torch.Tensor) -> None:
        name = type(self).__name__
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}.data must be set to a tensor, got {type(tensor).__name__}")
        if self._data_keeps_shape and tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"{name}.data: cannot set a tensor of shape {tuple(tensor.shape)} into one of shape "
                             f"{tuple(self.shape)} (the shape is fixed, as in Transformer Engine)")
        src = tensor
        if not isinstance(tensor, type(self)):
            quantizer = self._get_quantizer().copy()
            quantizer.internal = False
            src = quantizer.quantize(tensor)
        dtype = self.dtype if self._data_keeps_shape else src.dtype
        set_wrapper_metadata(self, src.size(), src.stride(), dtype, src.device)
        for attr in self._DATA_STATE:
            value = getattr(src, attr)
            setattr(self, attr, value.copy() if attr == "_quantizer" and value is not None else value)
        self._dtype = dtype

    data = property(_get_data, _set_data)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None):
        """Quantize `tensor` into this tensor's fields, in place, with its quantizer."""
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize_impl(tensor.dtype)
        self._get_quantizer().update_quantized(tensor.detach(), self, noop_flag=noop_flag)
        return self

    def __reduce_ex__(self, protocol):
        state = (self._fields(), int(self._fp8_dtype), self.dtype, self._flag)
        return rebuild_pickled_block_tensor, (type(self), state, self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch_through(_HANDLERS, func, args, kwargs)


def rebuild_pickled_block_tensor(cls, state, requires_grad):
    """Rebuild a pickled MXFP8Tensor / Float8BlockwiseQTensor (allowed by `torch.load(weights_only=True)`)."""
    fields, fp8_dtype, dtype, flag = state
    out = cls._make(fields, fp8_dtype, dtype, flag, None)
    if requires_grad:
        out.requires_grad_(True)
    return out


class BlockQuantizer(Quantizer):
    """What MXFP8Quantizer and Float8BlockQuantizer share: the format, input checks and in-place updates.
    Subclasses give `_fields(x)` (the four TE fields for a checked high-precision `x`), `_shape_error(x)` and
    `_storage_class`."""

    _storage_class = BlockScaledStorage

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(fp8_torch_dtype(fp8_dtype, f"{type(self).__name__} fp8_dtype"))
        self.optimize_for_gemm = False  # fp8kit keeps compact scales

    @property
    def fp8_torch_dtype(self) -> torch.dtype:
        return fp8_torch_dtype(self.dtype)

    def _fields(self, x: torch.Tensor) -> dict:
        raise NotImplementedError

    # formats whose flattened dims must be multiples of a block: (format name, block), else None (any shape)
    _dims_multiple_of: Optional[Tuple[str, int]] = None

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether `inp` has the dims the format needs (>= 2 dims, flattened dims multiples of its block)."""
        if self._dims_multiple_of is None:
            return True
        block = self._dims_multiple_of[1]
        if inp.dim() < 2:
            return False
        k = inp.shape[-1]
        return (inp.numel() // k if k else 0) % block == 0 and k % block == 0

    def _shape_error(self, x: torch.Tensor) -> Optional[str]:
        if self.is_quantizable(x):
            return None
        name, block = self._dims_multiple_of
        return (f"{name} requires tensor dims that are divisible by {block} (at least 2 dims; the flattened first "
                f"dims and the last dim), got shape {tuple(x.shape)}")

    def _check(self, tensor: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        tensor = high_precision_input(tensor, name)
        problem = self._shape_error(tensor)
        if problem:
            raise ValueError(f"{name}: {problem}")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{name}: neither rowwise nor columnwise usage is set")
        return tensor

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None):
        """Quantize `src` into `dst`'s fields; with `noop_flag` (float32, 1 means skip) the old bytes are kept
        where the flag is 1, without reading the flag on the host."""
        name = type(self).__name__
        if not isinstance(dst, self._storage_class):
            raise TypeError(f"{name}.update_quantized: dst must be a {self._storage_class.__name__}, got "
                            f"{type(dst).__name__}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name}.update_quantized: shapes differ, src {tuple(src.shape)} vs dst "
                             f"{tuple(dst.shape)}")
        fields = self._fields(self._check(src).to(dst.device))
        keep = None if noop_flag is None else (noop_flag.reshape(()) == 1)
        for field, new in fields.items():
            old = getattr(dst, "_" + field)
            if new is None or old is None or keep is None or old.shape != new.shape:
                setattr(dst, "_" + field, new)
            else:
                old.copy_(torch.where(keep, old, new))
        dst._fp8_dtype = self.dtype
        return dst
