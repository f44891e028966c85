"""The torch operations a Float8Tensor keeps in FP8 (the bytes are moved, the scale shared): views, reshapes,
transposes, slices, `contiguous`, `clone`, `detach`, `chunk` / `split`, `cat` of tensors with one scale, device moves,
`copy_`, and what FSDP2 applies to a parameter it shards and gathers. Registered into Float8Tensor's dispatch table
when `fp8kit.pytorch.tensor` is imported. Every new tensor keeps its source's class (subclasses included), format,
scale and quantizer."""

from __future__ import annotations

from typing import Optional

import torch

from .float8_tensor import _HANDLERS, Float8Tensor

aten = torch.ops.aten


def _like(t: Float8Tensor, data: torch.Tensor, scale_inv=None, transpose=None) -> Float8Tensor:
    """A tensor of `t`'s class (subclasses kept) over `data` (uint8 bytes) with `t`'s format and quantizer."""
    return type(t)(dtype=t.dtype, data=data, fp8_scale_inv=t.scale_inv if scale_inv is None else scale_inv,
                   fp8_dtype=t._fp8_dtype, data_transpose=transpose, quantizer=t._quantizer)


def _valid_transpose(t) -> Optional[torch.Tensor]:
    return None if t._transpose_invalid else t._transpose


def _detach(t, *a, **k):
    return _like(t, t._data, transpose=_valid_transpose(t)) if not a and not k else NotImplemented


def _clone(t, *, memory_format=None):
    if memory_format in (None, torch.preserve_format, torch.contiguous_format):
        data = t._data.contiguous() if memory_format is torch.contiguous_format else t._data.clone()
        if data is t._data:
            data = data.clone()
        transpose = _valid_transpose(t)
        return _like(t, data, t.scale_inv.clone(), None if transpose is None else transpose.clone())
    return NotImplemented


def _view(t, size):
    return _like(t, t._data.view(size))


def _reshaped(op):
    return lambda t, *a, **k: _like(t, getattr(t._data, op)(*a, **k))


def _split(t, split_size, dim=0):
    return [_like(t, d) for d in t._data.split(split_size, dim)]


def _cat(tensors, dim=0):
    if not all(isinstance(x, Float8Tensor) for x in tensors):
        return NotImplemented
    first = tensors[0]
    same = all(x._fp8_dtype == first._fp8_dtype and x.dtype == first.dtype and x.device == first.device
               and torch.equal(x.scale_inv, first.scale_inv) for x in tensors)
    if not same:
        return NotImplemented  # different scales: concatenate the values in high precision
    return _like(first, torch.cat([x._data for x in tensors], dim))


def _to_copy(t, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if dtype is not None and dtype != t.dtype:
        return NotImplemented  # another dtype: the values, converted
    data = t._data.to(device=device or t.device, non_blocking=non_blocking)
    transpose = _valid_transpose(t)
    return _like(t, data, t.scale_inv.to(device=data.device, non_blocking=non_blocking),
                 None if transpose is None else transpose.to(device=data.device, non_blocking=non_blocking))


def _copy_(dst, src, non_blocking=False):
    if not isinstance(dst, Float8Tensor):
        return NotImplemented  # dst plain: it takes src's values
    if isinstance(src, Float8Tensor) and src._fp8_dtype == dst._fp8_dtype and src.shape == dst.shape:
        dst._data.copy_(src._data, non_blocking=non_blocking)  # the same format: bytes and scale move exactly
        dst.scale_inv.copy_(src.scale_inv, non_blocking=non_blocking)
        dst._scale_inv_value = None
        dst._values = None
        dst._codes_finite = False
        transpose = _valid_transpose(src)
        dst._transpose = None if transpose is None else transpose.clone()
        dst._transpose_invalid = transpose is None
        return dst
    values = src.dequantize_impl(src.dtype) if isinstance(src, Float8Tensor) else src
    return dst.quantize_(values.to(device=dst.device))


_HANDLERS.update({
    aten.detach.default: _detach,
    aten.clone.default: _clone,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.t.default: _reshaped("t"),
    aten.transpose.int: _reshaped("transpose"),
    aten.permute.default: _reshaped("permute"),
    aten.slice.Tensor: lambda t, dim=0, start=None, end=None, step=1: _like(t, aten.slice.Tensor(t._data, dim, start,
                                                                                                  end, step)),
    aten.select.int: lambda t, dim, index: _like(t, t._data.select(dim, index)),
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: lambda t, sizes, dim=0: [_like(t, d) for d in t._data.split(list(sizes), dim)],
    aten.cat.default: _cat,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
})


# ---- FSDP2 (fully_shard) support: the operations FSDP2 applies to a parameter it shards and gathers -----------------
# (the all-gather extension itself, `fsdp_pre_all_gather` / `fsdp_post_all_gather`, lives in fp8kit/pytorch/fsdp.py).
# Sharding takes `torch.chunk` (split, above), `new_zeros` for the padded shard, `narrow`
# (slice, above) + `copy_` into it, `view(-1)`; the gathered parameter is an `as_strided` view of the all-gather
# output. All stay FP8: new tensors share the source's scale value (a copy) and quantizer.

def _fresh(t, size, dtype, device, pin_memory, fill):
    """A new Float8Tensor of `size` like `t` (its format, scale value and quantizer), or NotImplemented when another
    nominal dtype is asked for (then the op runs on dequantized values and returns a plain tensor)."""
    if dtype is not None and dtype != t.dtype:
        return NotImplemented
    device = t.device if device is None else torch.device(device)
    data = (torch.zeros if fill else torch.empty)(tuple(size), dtype=torch.uint8, device=device,
                                                  pin_memory=bool(pin_memory))
    return _like(t, data, t.scale_inv.detach().clone().to(device))


def _as_strided(t, size, stride, storage_offset=None):
    # the wrapper's storage offset 0 is the data's first element (Float8Tensor wrappers start at offset 0)
    offset = t._data.storage_offset() + (0 if storage_offset is None else storage_offset - t.storage_offset())
    return _like(t, t._data.as_strided(size, stride, offset))


_HANDLERS.update({
    aten.new_zeros.default: lambda t, size, *, dtype=None, layout=None, device=None, pin_memory=None:
        _fresh(t, size, dtype, device, pin_memory, True),
    aten.new_empty.default: lambda t, size, *, dtype=None, layout=None, device=None, pin_memory=None:
        _fresh(t, size, dtype, device, pin_memory, False),
    aten.empty_like.default: lambda t, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None:
        _fresh(t, t.shape, dtype, device, pin_memory, False),
    aten.as_strided.default: _as_strided,
    aten._pin_memory.default: lambda t, device=None: _like(t, t._data.pin_memory(), t.scale_inv.pin_memory()),
})
