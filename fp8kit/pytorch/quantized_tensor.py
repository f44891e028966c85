"""Quantized tensors and quantizers, with Transformer Engine's names (`fp8kit.pytorch.quantized_tensor` is
`transformer_engine.pytorch.quantized_tensor`).

- `QuantizedTensorStorage`: the plain-object base of quantized data (fp8kit's GEMMs pass storages around).
- `QuantizedTensor`: a `torch.Tensor` wrapper subclass with a nominal dtype and shape. Operations it does not keep
  quantized run on `dequantize()`d values; in-place operations on it quantize the result back into it.
- `Quantizer`: builds quantized tensors from high-precision ones (`quantizer(x)`, `quantize(x, out=...)`,
  `update_quantized`, `make_empty`, `set_usage`, `calibrate`). With grad enabled the cast is differentiable as the
  identity (straight-through), as are `dequantize()`.
- `prepare_for_saving` / `restore_from_saved` / `restore_from_func_ctx`: hand storages to `ctx.save_for_backward`.
"""

from __future__ import annotations

import abc
from typing import Iterable, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_map

__all__ = ["QuantizedTensorStorage", "QuantizedTensor", "Quantizer", "prepare_for_saving", "restore_from_saved",
           "restore_from_func_ctx"]


class QuantizedTensorStorage:
    """Base of the plain-object quantized storages (fp8kit.pytorch.tensor.Float8TensorStorage)."""

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def prepare_for_saving(self):
        raise NotImplementedError

    def restore_from_saved(self, tensors):
        raise NotImplementedError

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make (or drop) the layouts the GEMMs will read; per-tensor FP8 keeps its row-wise bytes always and makes
        the transposed bytes for column-wise use on accelerators."""
        if columnwise_usage:
            self.with_transpose()
        elif columnwise_usage is False:
            self._transpose = None
            self._transpose_invalid = True


def prepare_for_saving(*tensors) -> Tuple[list, list]:
    """(tensors for `ctx.save_for_backward`, objects for `restore_from_saved`): plain tensors and None pass through,
    quantized storages are split into their tensors."""
    tensor_list, objects = [], []
    for t in tensors:
        if t is None or (isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensorStorage)):
            tensor_list.append(t)
            objects.append(None)
        else:
            parts, obj = t.prepare_for_saving()
            tensor_list.extend(parts)
            objects.append(obj)
    return tensor_list, objects


def restore_from_saved(objects: list, saved_tensors: list, return_saved_tensors: bool = False):
    """The inverse of `prepare_for_saving`: the original tensors and storages, in order."""
    out = []
    saved = list(saved_tensors)
    for obj in objects:
        if obj is None:
            out.append(saved.pop(0))
        else:
            saved = obj.restore_from_saved(saved)
            out.append(obj)
    return (out, saved) if return_saved_tensors else out


def restore_from_func_ctx(ctx, return_saved_tensors: bool = False):
    """`restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)`, then forget `ctx.tensor_objects`."""
    if getattr(ctx, "tensor_objects", None) is None:
        raise AttributeError("restore_from_func_ctx: ctx has no tensor_objects (set by prepare_for_saving)")
    out = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors, return_saved_tensors)
    ctx.tensor_objects = None
    return out


class _Quantize(torch.autograd.Function):
    """The cast with a straight-through gradient."""

    @staticmethod
    def forward(ctx, tensor, quantizer):
        return quantizer.quantize_impl(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dtype):
        return tensor.dequantize_impl(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Quantizer(abc.ABC):
    """Builds quantized tensors. `rowwise_usage` / `columnwise_usage`: which layouts the GEMMs will read (the
    column-wise one, the transposed bytes, matters on accelerators); `internal=True` makes storages, not tensors."""

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False

    def __call__(self, tensor: torch.Tensor):
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor, *, out=None, dtype: Optional[torch.dtype] = None):
        """A quantized copy of `tensor` (a QuantizedTensor, or a storage when `internal`); with `out`, quantize into
        that tensor instead. Differentiable (straight-through) when grad is enabled."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if not self.internal and torch.is_grad_enabled() and tensor.requires_grad:
            return _Quantize.apply(tensor, self)
        return self.quantize_impl(tensor)

    @abc.abstractmethod
    def quantize_impl(self, tensor: torch.Tensor):
        """The cast itself."""

    @abc.abstractmethod
    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None):
        """Quantize `src` into the existing quantized tensor `dst` (its data and scale_inv), in place."""

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32,
                   device: Optional[Union[str, torch.device]] = None, requires_grad: bool = False,
                   pin_memory: bool = False):
        """A quantized tensor of `shape` (nominal `dtype`) with uninitialised data."""
        raise NotImplementedError(f"{type(self).__name__} does not implement make_empty")

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Update the quantizer's state as a cast of `tensor` would, without casting."""

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def copy(self) -> "Quantizer":
        raise NotImplementedError(f"{type(self).__name__} does not implement copy")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage}, internal={self.internal})")


def _stride(shape) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class QuantizedTensor(torch.Tensor):
    """A torch.Tensor with quantized data: shape, nominal dtype and device of the values it stands for.
    Subclasses implement `dequantize_impl(dtype)` and `quantize_(tensor)`, and may keep some operations quantized
    in `__torch_dispatch__`; everything else runs here on dequantized values."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, shape, dtype: torch.dtype, *, requires_grad: bool = False, device=None, stride=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), strides=_stride(shape) if stride is None else tuple(stride), dtype=dtype,
            layout=torch.strided, requires_grad=requires_grad, device=device)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a plain tensor of `dtype` (default: the nominal dtype); differentiable."""
        dtype = self.dtype if dtype is None else dtype
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)
        return self.dequantize_impl(dtype)

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize_(self, tensor: torch.Tensor) -> "QuantizedTensor":
        """Quantize `tensor` into this tensor, in place."""
        raise NotImplementedError

    def _get_quantizer(self):
        """The quantizer that in-place updates of this tensor use (Transformer Engine's name): its own, else the
        subclass's default (`_build_default_quantizer`)."""
        quantizer = getattr(self, "_quantizer", None)
        return quantizer if quantizer is not None else self._build_default_quantizer()

    def _build_default_quantizer(self):
        raise ValueError(f"{type(self).__name__} has no quantizer and no default quantizer is available defined in "
                         "the subclass.")  # Transformer Engine's words

    def float(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float32)

    def bfloat16(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.bfloat16)

    def half(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float16)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.view.default:  # as Transformer Engine's base class: views need a subclass's data
            raise NotImplementedError(f"{cls.__name__} class does not support tensor views")
        return run_dequantized(func, args, kwargs or {})


def set_wrapper_metadata(t: torch.Tensor, size, stride, dtype: torch.dtype, device) -> None:
    """Give the wrapper subclass `t` another size, strides, nominal dtype or device, in place (what `x.data = y`
    changes when `y` differs); `t` keeps its Python attributes and its `requires_grad`."""
    if (tuple(t.size()), tuple(t.stride()), t.dtype, t.device) == (tuple(size), tuple(stride), dtype, device):
        return
    shell = torch.Tensor._make_wrapper_subclass(type(t), tuple(size), strides=tuple(stride), dtype=dtype,
                                                layout=torch.strided, device=device)
    torch.Tensor.data.__set__(t, shell)


def dispatch_through(handlers: dict, func, args, kwargs):
    """A quantized tensor's `__torch_dispatch__`: the handler `handlers` has for `func` (one that keeps the data
    quantized; it may return NotImplemented), else `func` on the dequantized values."""
    kwargs = kwargs or {}
    handler = handlers.get(func)
    if handler is not None:
        out = handler(*args, **kwargs)
        if out is not NotImplemented:
            return out
    return run_dequantized(func, args, kwargs)


def run_dequantized(func, args, kwargs):
    """Run an aten operation on dequantized values; an in-place operation on a quantized tensor computes on its
    values and quantizes the result back into it."""

    def plain(t):
        return t.dequantize_impl(t.dtype) if isinstance(t, QuantizedTensor) else t

    schema = func._schema
    mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
               and i < len(args) and isinstance(args[i], QuantizedTensor)]
    if not mutated:
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))
    new_args = list(tree_map(plain, args))
    result = func(*new_args, **tree_map(plain, kwargs))
    for i in mutated:
        args[i].quantize_(new_args[i])
    return args[mutated[0]] if schema.returns and len(schema.returns) == 1 else result


def is_quantized(t) -> bool:
    """True for fp8kit's quantized tensors and storages."""
    return isinstance(t, (QuantizedTensor, QuantizedTensorStorage))

