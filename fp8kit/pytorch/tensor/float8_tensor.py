"""Float8Tensor (a torch.Tensor) and Transformer Engine's per-tensor quantizers, `Float8Quantizer` (a given scale, amax
recorded: delayed scaling) and `Float8CurrentScalingQuantizer` (the scale from the tensor's own amax).

A Float8Tensor has the nominal dtype, shape and device of the values it stands for; `_data` holds the FP8 bytes as
`torch.uint8` (Transformer Engine's layout) with `_fp8_dtype` naming the format, `_scale_inv` (float32 `[1]`) maps
them back. Views, reshapes, transposes, `contiguous`, `clone`, `detach`, device moves
(`to`, `cpu`, `cuda`), `chunk` / `split` and `cat` (of tensors with one scale) stay FP8, since moving bytes is exact;
`copy_` into a Float8Tensor quantizes with its quantizer; every other operation dequantizes to the nominal dtype and
runs in high precision, and an in-place one quantizes its result back. A Float8Tensor made without a quantizer (and
one read back by `torch.load`, which keeps none, as in Transformer Engine) cannot be written from high-precision values:
`quantize_`, `copy_` and in-place operations raise Transformer Engine's ValueError. `torch.save` /
`torch.load(weights_only=True)`, deepcopy, `torch.testing.assert_close` (on dequantized values) and autograd work.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import cast as casts
from .. import host
from ..constants import DType, fp8_torch_dtype
from ..quantized_tensor import QuantizedTensor, Quantizer, dispatch_through, set_wrapper_metadata
from .storage import Float8TensorStorage

__all__ = ["Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer", "make_float8_tensor", "wrap"]

class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """An FP8 tensor with one float32 scale: `values ~= float32(_data) * _scale_inv` (see the module docstring).

    Float8Tensor(shape=None, dtype=None, *, data, fp8_scale_inv, fp8_dtype=None, data_transpose=None, quantizer=None,
    requires_grad=False): `data` the bytes as uint8 with `fp8_dtype` a `DType` (kFloat8E4M3 / kFloat8E5M2), or a
    float8_e4m3fn / float8_e5m2 tensor (its dtype names the format); `fp8_scale_inv` float32 with one element, `dtype`
    the nominal dtype (default float32), `shape` the data's.
    """

    shape = torch.Tensor.shape
    device = torch.Tensor.device
    dequantize = QuantizedTensor.dequantize

    def __new__(cls, shape=None, dtype: Optional[torch.dtype] = None, *, data: torch.Tensor,
                fp8_scale_inv: torch.Tensor, fp8_dtype=None, data_transpose: Optional[torch.Tensor] = None,
                quantizer: Optional[Quantizer] = None, requires_grad: bool = False, fake_dtype=None, device=None):
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"Float8Tensor: data must be a tensor, got {type(data).__name__}")
        dtype = dtype or fake_dtype or torch.float32
        shape = tuple(data.shape) if shape is None else tuple(shape)
        if shape != tuple(data.shape):
            raise ValueError(f"Float8Tensor: shape {shape} differs from the data's {tuple(data.shape)}")
        instance = QuantizedTensor.__new__(cls, shape, dtype, requires_grad=requires_grad, device=data.device,
                                           stride=data.stride())
        instance._set_fields(data, fp8_scale_inv, fp8_dtype, dtype, data_transpose, quantizer, None)
        return instance

    @classmethod
    def make_like(cls, tensor: "Float8Tensor", *, shape=None, dtype: Optional[torch.dtype] = None,
                  requires_grad: bool = False, data: Optional[torch.Tensor] = None,
                  data_transpose: Optional[torch.Tensor] = None) -> "Float8Tensor":
        """A new tensor of `tensor`'s class over its buffers (or `data` / `data_transpose`), with its scale,
        format and quantizer (Transformer Engine's `make_like`)."""
        kwargs = tensor.get_metadata()
        if data is not None:
            kwargs["data"] = data
            kwargs["data_transpose"] = data_transpose
        elif data_transpose is not None:
            kwargs["data_transpose"] = data_transpose
        kwargs["fake_dtype"] = None
        return cls(shape=shape, dtype=dtype or tensor.dtype, requires_grad=requires_grad, **kwargs)

    def __init__(self, *args, **kwargs):  # everything happened in __new__
        pass

    # ---- values ----

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        return Float8TensorStorage.dequantize_impl(self, dtype)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> "Float8Tensor":
        """Quantize `tensor` into this tensor (its bytes and scale_inv) with its quantizer (a tensor made without one
        raises ValueError, as in Transformer Engine: there is no default quantizer). `noop_flag` (float32, one
        element): when it holds a nonzero value nothing changes (neither the bytes, the scale nor the quantizer's
        amax), as in Transformer Engine."""
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize_impl(tensor.dtype)
        self._get_quantizer().update_quantized(tensor.detach(), self, noop_flag=noop_flag)
        return self

    def update_quantizer(self, quantizer: Quantizer) -> None:
        """Use `quantizer` for later in-place updates; replacing a different quantizer warns, as in Transformer
        Engine (the tensor's bytes were made by the old one)."""
        if self._quantizer is None:
            raise RuntimeError("Float8Tensor.update_quantizer: the tensor has no quantizer to update")
        if self._quantizer is not quantizer:
            warnings.warn("Quantizer is being updated, this may affect model behavior", stacklevel=2)
            self._quantizer = quantizer

    def storage_view(self) -> Float8TensorStorage:
        """The same bytes as a plain storage (what the GEMMs take)."""
        return as_storage(self)

    def __repr__(self, *, tensor_contents=None) -> str:
        head = f"Float8Tensor(fp8_dtype={self._fp8_dtype.name}, shape={tuple(self.shape)}, dtype={self.dtype}"
        if torch.compiler.is_compiling() or is_fake(self._data):
            return head + ")"  # traced: no values to show
        return head + f", scale_inv={float(self.scale_inv.reshape(())):.6g}, data={self.dequantize_impl(self.dtype)})"

    # ---- `x.data`: reading gives a detached alias; assigning a Float8Tensor takes its buffers, assigning a plain
    # tensor quantizes it with this tensor's quantizer (shape, dtype and device follow the new value) ----

    def _get_data(self) -> "Float8Tensor":
        return super().data

    @torch.no_grad()
    def _set_data(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Float8Tensor.data must be set to a tensor, got {type(tensor).__name__}")
        src = tensor
        if not isinstance(tensor, Float8Tensor):
            quantizer = self._get_quantizer()
            src = wrap(quantizer._cast(_check(tensor, "Float8Tensor.data")), quantizer)
        set_wrapper_metadata(self, src.size(), src.stride(), src.dtype, src.device)
        self._data, self._scale_inv, self._fp8_dtype = src._data, src._scale_inv, src._fp8_dtype
        self._transpose, self._transpose_invalid = src._transpose, src._transpose_invalid
        self._quantizer = src._quantizer.copy() if src._quantizer is not None and src is tensor else src._quantizer
        self._dtype, self._scale_inv_value, self._values = src._dtype, src._scale_inv_value, None
        self._codes_finite = False

    data = property(_get_data, _set_data)

    # ---- serialisation and torch.compile ----

    def __reduce_ex__(self, protocol):
        return make_float8_tensor, (self._data, self.scale_inv, self.dtype, self.requires_grad,
                                    int(self._fp8_dtype))

    def __tensor_flatten__(self):
        if self._scale_inv is None:
            self.scale_inv  # noqa: B018 (made from the host float, so that it can be an inner tensor)
        valid_t = self._transpose is not None and not self._transpose_invalid
        names = ["_data", "_scale_inv"] + (["_transpose"] if valid_t else [])
        return names, (self.dtype, int(self._fp8_dtype))

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        dtype, fmt = meta
        return Float8Tensor(dtype=dtype, data=inner["_data"], fp8_scale_inv=inner["_scale_inv"], fp8_dtype=fmt,
                            data_transpose=inner.get("_transpose"))

    # ---- FSDP2 all-gather extension (fully_shard gathers the FP8 bytes) ----
    # What the hooks do lives in fp8kit/pytorch/fsdp.py, a layer above this module (it builds on the tensor and its
    # quantizers); it fills _ALL_GATHER when imported, which `import fp8kit.pytorch` does.

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """FSDP2 hook before a parameter's all-gather: this shard's FP8 bytes and the metadata to rebuild it."""
        return _all_gather_hooks()[0](self, mesh, orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook after a parameter's all-gather: the gathered Float8Tensor (or `out` updated in place)."""
        return _all_gather_hooks()[1](self, all_gather_outputs, metadata, param_dtype, out=out)

    # ---- operations ----

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch_through(_HANDLERS, func, args, kwargs)


_ALL_GATHER: list = []  # [(pre_all_gather, post_all_gather)], from fp8kit.pytorch.fsdp


def register_all_gather(pre_all_gather, post_all_gather) -> None:
    """Set what Float8Tensor's FSDP2 hooks run (fp8kit.pytorch.fsdp calls this when imported)."""
    _ALL_GATHER[:] = [(pre_all_gather, post_all_gather)]


def _all_gather_hooks():
    if not _ALL_GATHER:
        raise RuntimeError("Float8Tensor's FSDP2 all-gather is defined in fp8kit.pytorch.fsdp, which is not imported: "
                           "import fp8kit.pytorch")
    return _ALL_GATHER[0]


def make_float8_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                       requires_grad: bool = False, fp8_dtype: Optional[int] = None) -> Float8Tensor:
    """Rebuild a pickled Float8Tensor (allowed by `torch.load(weights_only=True)`): uint8 `data` with `fp8_dtype`
    (a DType's value), or float8-typed `data` as older fp8kit versions saved it."""
    return Float8Tensor(dtype=dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=fp8_dtype,
                        requires_grad=requires_grad)


def wrap(q: Float8TensorStorage, quantizer: Optional[Quantizer] = None) -> Float8Tensor:
    """A storage as a Float8Tensor (the same bytes)."""
    return Float8Tensor(dtype=q.dtype, data=q._data, fp8_scale_inv=q.scale_inv, fp8_dtype=q._fp8_dtype,
                        data_transpose=None if q._transpose_invalid else q._transpose, quantizer=quantizer)

_HANDLERS: dict = {}  # aten op -> handler keeping the data FP8; filled by fp8kit/pytorch/tensor/float8_ops.py


# ---- quantizers -------------------------------------------------------------------------------------------------

def _check(tensor: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() \
            or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{where}: expected a float32/bfloat16/float16 tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor))}")
    if isinstance(tensor, QuantizedTensor):
        tensor = tensor.dequantize_impl(tensor.dtype)
    return tensor.detach()


def _after_update(quantizer, dst, q) -> None:
    """What an in-place update resets besides the bytes and scale: the format (a quantizer may write another one,
    as in Transformer Engine), cached values, the transpose (remade for column-wise use)."""
    dst._fp8_dtype = q._fp8_dtype
    dst._scale_inv_value = None
    dst._values = None
    dst._codes_finite = False
    dst._transpose = None
    dst._transpose_invalid = True
    if quantizer.columnwise_usage:
        dst.with_transpose()


def _update_unless(quantizer, src, dst, skip: torch.Tensor):
    """`update_quantized` where `skip` (a 0-d bool device tensor) decides on the device: the cast runs and each
    buffer (bytes, scale_inv, the quantizer's amax) keeps its old value where `skip` holds."""
    amax = getattr(quantizer, "amax", None)
    old_amax = None if amax is None else amax.detach().clone()
    if dst._fp8_dtype != quantizer.dtype:
        raise TypeError(f"{type(quantizer).__name__}.update_quantized with a noop_flag on the device cannot change "
                        f"the format ({dst._fp8_dtype.name} -> {quantizer.dtype.name})")
    q = quantizer._cast(src)
    with torch.no_grad():
        dst._data.copy_(torch.where(skip, dst._data, q._data))
        inv = dst.scale_inv
        inv.copy_(torch.where(skip, inv, q.scale_inv.to(inv.device)))
        if old_amax is not None:
            amax.copy_(torch.where(skip.to(amax.device), old_amax, amax))
    _after_update(quantizer, dst, q)
    return dst


class _PerTensorQuantizer(Quantizer):
    """What both per-tensor quantizers share: the format, the output (Float8Tensor, or storage when internal), the
    transposed bytes for column-wise use off the CPU, in-place updates and empty tensors."""

    def __init__(self, fp8_dtype, rowwise: bool, columnwise: bool):
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(fp8_torch_dtype(fp8_dtype))  # Transformer Engine keeps a DType

    @property
    def fp8_torch_dtype(self) -> torch.dtype:
        return fp8_torch_dtype(self.dtype)

    def _finish(self, q: Float8TensorStorage):
        if self.columnwise_usage:
            q.with_transpose()
        q._quantizer = self
        return q if self.internal else wrap(q, self)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None):
        if not isinstance(dst, Float8TensorStorage):
            raise TypeError(f"{type(self).__name__}.update_quantized: dst must be a Float8Tensor, got "
                            f"{type(dst).__name__}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{type(self).__name__}.update_quantized: src shape {tuple(src.shape)} differs from "
                             f"dst {tuple(dst.shape)}")
        src = _check(src, type(self).__name__).to(device=dst.device)
        if noop_flag is not None:
            if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1:
                raise TypeError(f"{type(self).__name__}.update_quantized: noop_flag must be a tensor with one "
                                f"element, got {getattr(noop_flag, 'shape', type(noop_flag))}")
            if noop_flag.device.type == "cpu" and not torch.compiler.is_compiling():
                if bool(noop_flag.reshape(()) != 0):
                    return dst
            else:  # on the device, without a host read (CUDA graphs replay it with either value)
                return _update_unless(self, src, dst, noop_flag.reshape(()) != 0)
        q = self._cast(src)
        with torch.no_grad():
            dst._data.copy_(q._data)
            if dst._scale_inv is None:
                dst._scale_inv = q.scale_inv.clone()
            else:
                dst._scale_inv.copy_(q.scale_inv)
        _after_update(self, dst, q)
        return dst

    def quantize_impl(self, tensor: torch.Tensor):
        return self._finish(self._cast(_check(tensor, type(self).__name__)))

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False, pin_memory: bool = False):
        data = torch.empty(tuple(shape), dtype=torch.uint8, device=device, pin_memory=pin_memory)
        q = Float8TensorStorage(data=data, fp8_scale_inv=torch.ones(1, device=data.device), fp8_dtype=self.dtype,
                                fake_dtype=dtype)
        out = self._finish(q)
        if requires_grad and not self.internal:
            out.requires_grad_(True)
        return out


class Float8Quantizer(_PerTensorQuantizer):
    """Casts with a given scale and max-accumulates the tensor's amax into `amax` (delayed scaling).

    Float8Quantizer(scale, amax, fp8_dtype, *, rowwise=True, columnwise=True): `scale` a float32 tensor with one
    element (finite, > 0), `amax` a float32 tensor with one element (updated in place, NaN ignored), `fp8_dtype` a
    `DType` (kFloat8E4M3 / kFloat8E5M2) or a torch float8 dtype."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *, rowwise: bool = True,
                 columnwise: bool = True):
        super().__init__(fp8_dtype, rowwise, columnwise)
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"Float8Quantizer: {name} must be a float32 tensor with one element, got "
                                f"{getattr(t, 'dtype', type(t))} of shape {tuple(getattr(t, 'shape', ()))}")
        self._scale, self._amax = scale, amax

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def amax(self) -> torch.Tensor:
        return self._amax

    def _cast(self, x: torch.Tensor) -> Float8TensorStorage:
        fp8 = self.fp8_torch_dtype
        scale, stage = self.scale, self.amax
        if host.active(x.device) and scale.device.type == "cpu" and stage.device.type == "cpu":
            a = host.amax(x)
            s = float(scale.reshape(()))
            if a == a and not a <= float(stage.reshape(())):
                stage.fill_(a)
            return casts.cast_host(x, s, fp8, a)
        a = casts.amax(x)
        with torch.no_grad():
            stage.copy_(torch.fmax(stage.reshape(()), a).reshape(stage.shape))
        return casts.cast(x, scale.reshape(()).to(x.device), fp8)

    def calibrate(self, tensor: torch.Tensor) -> None:
        a = casts.amax(_check(tensor, "Float8Quantizer.calibrate"))
        with torch.no_grad():
            self.amax.copy_(torch.fmax(self.amax.reshape(()), a).reshape(self.amax.shape))

    def copy(self) -> "Float8Quantizer":
        out = Float8Quantizer(self.scale, self.amax, self.dtype, rowwise=self.rowwise_usage,
                              columnwise=self.columnwise_usage)
        out.internal = self.internal
        return out


class Float8CurrentScalingQuantizer(_PerTensorQuantizer):
    """Casts with `fp8_max / max(amax(x), amax_epsilon)` (current scaling), the amax all-reduced (MAX) over
    `amax_reduction_group` when `with_amax_reduction`.

    Float8CurrentScalingQuantizer(fp8_dtype, device=None, *, rowwise=True, columnwise=True, use_existing_amax=False,
    with_amax_reduction=False, amax_reduction_group=None, force_pow_2_scales=False, amax_epsilon=0.0, scale=None,
    amax=None): Transformer Engine's signature; `device`, `use_existing_amax`, `scale` and `amax` are accepted and
    unused, as in Transformer Engine."""

    def __init__(self, fp8_dtype, device=None, *, rowwise: bool = True, columnwise: bool = True,
                 use_existing_amax: bool = False, with_amax_reduction: bool = False, amax_reduction_group=None,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0, scale=None, amax=None):
        super().__init__(fp8_dtype, rowwise, columnwise)
        eps = float(amax_epsilon)
        if not (eps >= 0 and math.isfinite(eps)):
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon must be finite and >= 0, got "
                             f"{amax_epsilon!r}")
        if with_amax_reduction and amax_reduction_group is None:
            raise ValueError("Float8CurrentScalingQuantizer: with_amax_reduction=True needs an amax_reduction_group")
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = eps

    def _cast(self, x: torch.Tensor) -> Float8TensorStorage:
        fp8 = self.fp8_torch_dtype
        group = self.amax_reduction_group if self.with_amax_reduction else None
        if group is None and host.active(x.device):
            a = host.amax(x)
            return casts.cast_host(
                x, host.current_scale(a, casts.FP8_MAX[fp8], self.amax_epsilon, self.force_pow_2_scales), fp8, a)
        s = casts.current_scale(x, casts.fp8_max_of(fp8), self.amax_epsilon, self.force_pow_2_scales, group)
        return casts.cast(x, s, fp8)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["amax_reduction_group"] = None  # a process group is not picklable
        state["with_amax_reduction"] = False
        return state

    def copy(self) -> "Float8CurrentScalingQuantizer":
        out = Float8CurrentScalingQuantizer(
            self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            with_amax_reduction=self.with_amax_reduction, amax_reduction_group=self.amax_reduction_group,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        out.internal = self.internal
        return out


def as_storage(t: Union[Float8TensorStorage, torch.Tensor]) -> Float8TensorStorage:
    """A Float8Tensor's bytes as a plain storage for the GEMMs (storages pass through). A function, not a method:
    torch.compile traces a method call on a tensor subclass as a tensor operation, which must return a tensor."""
    if not isinstance(t, Float8Tensor):
        return t
    return Float8TensorStorage(data=t._data, fp8_scale_inv=t.scale_inv, fp8_dtype=t._fp8_dtype, fake_dtype=t.dtype,
                               data_transpose=None if t._transpose_invalid else t._transpose, quantizer=t._quantizer)
