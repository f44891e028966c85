"""Float8TensorStorage: FP8 bytes plus the float32 scale_inv that maps them back to real values, as a plain object.

This is what fp8kit's GEMMs and autograd Functions pass around (cheap to create: no torch.Tensor subclass), as
Transformer Engine's internal storages are; `fp8kit.pytorch.tensor.Float8Tensor` is the same data as a torch.Tensor
subclass for users. Field names and layout follow Transformer Engine: `_data` (and `_transpose`) hold the raw bytes
as `torch.uint8`, `_fp8_dtype` names the format (a `DType`), `_scale_inv`, `_transpose_invalid`, `_quantizer`.
Computations take FP8-typed views (`fp8_view()`: `_data.view(fp8_dtype)`, no copy).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .. import cpu_kernels, host
from ..constants import DType, fp8_torch_dtype, te_dtype
from ..quantized_tensor import QuantizedTensorStorage

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_TORCH_OF = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}
_TE_DTYPE = {dtype: te_dtype(dtype) for dtype in FP8_DTYPES}

__all__ = ["Float8TensorStorage", "FP8_DTYPES", "widen"]


class Float8TensorStorage(QuantizedTensorStorage):
    """A quantized tensor: `real ~= float32(_data) * _scale_inv`.

    Fields:
      _data: the FP8 bytes as `torch.uint8`, any shape (the nominal shape); `fp8_view()` reads them as the format.
      _scale_inv: float32 tensor of shape `[1]`, `float32(1 / scale)` taken at cast time (made lazily from
        `_scale_inv_value` on the CPU fast path).
      _fp8_dtype: the format as a `DType` (kFloat8E4M3 or kFloat8E5M2).
      _dtype: the nominal high-precision dtype the tensor stands for (what `dequantize()` returns by default).
      _transpose: None, or the FP8 bytes (uint8) of the transpose, contiguous: `_data.reshape(-1, n).t()` laid out
        row-major, as the fused cast+transpose kernels write it. The GEMM takes a column-major operand from it.
      _transpose_invalid: True when `_transpose` is absent or stale (Transformer Engine's flag).
      _quantizer: the quantizer that made it (in-place updates and `copy_` use it), or None.

    Constructor (Transformer Engine's keywords): `data` the bytes as uint8 with `fp8_dtype` a `DType`
    (kFloat8E4M3 / kFloat8E5M2) or a torch float8 dtype; a float8-typed `data` is also taken (its bytes are kept as
    uint8 and its dtype names the format). `data_transpose` likewise.
    """

    def __init__(self, *, data: torch.Tensor, fp8_scale_inv: Optional[torch.Tensor] = None, fp8_dtype=None,
                 fake_dtype: Optional[torch.dtype] = None, data_transpose: Optional[torch.Tensor] = None,
                 quantizer=None, scale_inv_value: Optional[float] = None):
        self._set_fields(data, fp8_scale_inv, fp8_dtype, fake_dtype, data_transpose, quantizer, scale_inv_value)

    def _set_fields(self, data, fp8_scale_inv, fp8_dtype, fake_dtype, data_transpose, quantizer,
                    scale_inv_value) -> None:
        data, fmt = _bytes_and_format(data, fp8_dtype, "data")
        if data_transpose is not None:
            data_transpose, fmt_t = _bytes_and_format(
                data_transpose, fmt if getattr(data_transpose, "dtype", None) == torch.uint8 else None,
                "data_transpose")
            n = data.shape[-1] if data.dim() else 1
            want = (n, data.numel() // n if n else 0)
            if fmt_t != fmt or tuple(data_transpose.shape) != want \
                    or not data_transpose.is_contiguous() or data_transpose.device != data.device:
                raise ValueError(
                    f"Float8Tensor data_transpose must be a contiguous tensor of {fmt.name} bytes of shape {want} on "
                    f"{data.device} (the transpose of data {tuple(data.shape)}), got {fmt_t.name} "
                    f"{tuple(data_transpose.shape)} contiguous={data_transpose.is_contiguous()} on "
                    f"{data_transpose.device}")
        if fp8_scale_inv is None:
            if scale_inv_value is None:
                raise TypeError("Float8Tensor needs fp8_scale_inv (a float32 tensor) or scale_inv_value (a float)")
        elif not isinstance(fp8_scale_inv, torch.Tensor) or fp8_scale_inv.dtype != torch.float32 \
                or fp8_scale_inv.numel() != 1:
            raise TypeError(
                f"Float8Tensor fp8_scale_inv must be one float32 element, got {getattr(fp8_scale_inv, 'dtype', None)} "
                f"of shape {tuple(getattr(fp8_scale_inv, 'shape', ()))}")
        self._assign(data, fmt, fp8_scale_inv if fp8_scale_inv is None or fp8_scale_inv.dim() == 1
                     else fp8_scale_inv.reshape(1), fake_dtype if fake_dtype is not None else torch.float32,
                     data_transpose, quantizer, scale_inv_value)

    def _assign(self, data, fmt, scale_inv, fake_dtype, data_transpose, quantizer, scale_inv_value) -> None:
        """Set every field: `data` (and `data_transpose`) uint8 bytes of the format `fmt` (a DType)."""
        self._data = data
        self._scale_inv = scale_inv
        self._fp8_dtype = fmt
        self._dtype = fake_dtype
        self._transpose = data_transpose
        self._transpose_invalid = data_transpose is None
        self._quantizer = quantizer
        self._values = None  # the unscaled FP8 values in a wider dtype, made once by the CPU GEMM (see `values`)
        # True when the cast that wrote `_data` knows it holds no NaN/inf code (a saturating cast of a NaN-free
        # input, cast.cast_host), so the widening skips its check. Only that cast sets it, on storages it makes;
        # tensors whose bytes are written in place later (Float8Tensor) are built without it.
        self._codes_finite = False
        self._transposed_of = None  # the storage this one is the transpose of (shares its `values`), or None
        # `scale_inv` as a Python float when the CPU fast path made it (fp8kit.pytorch.host), else None
        self._scale_inv_value = scale_inv_value

    @classmethod
    def trusted(cls, data: torch.Tensor, scale_inv: Optional[torch.Tensor], fake_dtype: torch.dtype,
                scale_inv_value: Optional[float] = None) -> "Float8TensorStorage":
        """A storage of FP8-typed `data` (kept as its uint8 bytes) and float32 `[1]` `scale_inv` (or the float
        `scale_inv_value`) made by fp8kit's own casts (no checks)."""
        self = cls.__new__(cls)
        raw, fmt = data.view(torch.uint8), _TE_DTYPE[data.dtype]
        self._assign(raw, fmt, scale_inv, fake_dtype, None, None, scale_inv_value)
        self._fp8_view_memo = (raw, fmt, data)  # the cast's FP8-typed tensor is the view (no second view op)
        return self

    @classmethod
    def from_bytes(cls, data: torch.Tensor, fp8_dtype: torch.dtype, scale_inv: Optional[torch.Tensor],
                   fake_dtype: torch.dtype, data_transpose: Optional[torch.Tensor] = None,
                   scale_inv_value: Optional[float] = None) -> "Float8TensorStorage":
        """A storage of uint8 `data` (and contiguous uint8 `data_transpose`) in the torch float8 format `fp8_dtype`,
        with float32 `[1]` `scale_inv` (or the float `scale_inv_value`), made by fp8kit's own kernels (no checks, no
        view operations)."""
        self = cls.__new__(cls)
        self._assign(data, _TE_DTYPE[fp8_dtype], scale_inv, fake_dtype, data_transpose, None, scale_inv_value)
        return self

    # ---- reading ----

    @property
    def scale_inv(self) -> torch.Tensor:
        """float32 `[1]`, `float32(1 / scale)`."""
        if self._scale_inv is None:  # made by the CPU fast path from the float
            self._scale_inv = torch.full((1,), self._scale_inv_value, dtype=torch.float32, device=self.device)
        return self._scale_inv

    @property
    def scale_inv_value(self) -> Optional[float]:
        """`scale_inv` as a Python float when the CPU fast path made it (no device read), else None."""
        return self._scale_inv_value

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The torch float8 dtype the bytes hold (`torch.float8_e4m3fn` or `torch.float8_e5m2`)."""
        return _TORCH_OF[self._fp8_dtype]

    def fp8_view(self) -> torch.Tensor:
        """`_data` read as its FP8 format (a view, no copy; the same view object while `_data` and the format stay,
        so that a saved operand can be recognised by identity). Traced by torch.compile the view is not kept: a
        storage made outside an autograd Function (an FP8 weight's) must not hold a view made inside it."""
        data, fmt = self._data, self._fp8_dtype
        return None if data is None else self._kept("_fp8_view_memo", data, fmt)

    def _kept(self, name: str, source: torch.Tensor, fmt, transpose: bool = False) -> torch.Tensor:
        """`source` read as the format `fmt` (or, with `transpose`, `source.t()`), kept in attribute `name` as
        `(source, fmt, view)` while `source` and the format stay the same objects (the storage's kept views; `holds`
        reads them). Traced by torch.compile nothing is kept."""
        traced = torch.compiler.is_compiling()
        memo = None if traced else getattr(self, name, None)
        if memo is not None and memo[0] is source and memo[1] is fmt:
            return memo[2]
        view = source.t() if transpose else source.view(_TORCH_OF[fmt])
        if not traced:
            setattr(self, name, (source, fmt, view))
        return view

    def column_major_view(self) -> Optional[torch.Tensor]:
        """The bytes as a column-major FP8 view of the nominal 2-D shape, without a copy, kept as `fp8_view()` is:
        the transpose of `transpose_view()` when there is a valid `_transpose`, `fp8_view()` when `_data` itself is
        laid out column-major (an operand rebuilt from what `saved_form` gave), else None."""
        t = self.transpose_view()
        if t is not None:
            return self._kept("_column_major_memo", t, self._fp8_dtype, transpose=True)
        data = self._data
        if data is not None and data.dim() == 2 and data.stride(0) == 1 and data.stride(1) == data.shape[0] > 1:
            return self.fp8_view()
        return None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is this storage's own bytes as `saved_form` handed them out: `_data`, the kept `fp8_view()`,
        or the kept `transpose_view()` or its transpose (what accelerators save), so that a backward can take the
        forward's storage back (a saved-tensor hook that replaced the tensor gives another one). Makes no view."""
        data, fmt = self._data, self._fp8_dtype
        if t is data:
            return True
        memo = getattr(self, "_fp8_view_memo", None)
        if memo is not None and memo[2] is t and memo[0] is data and memo[1] is fmt:
            return True
        memo = getattr(self, "_transpose_view_memo", None)
        return memo is not None and memo[0] is self._transpose and memo[1] is fmt and not self._transpose_invalid \
            and (t is memo[2] or t._base is memo[2])

    def transpose_view(self) -> Optional[torch.Tensor]:
        """`_transpose` read as its FP8 format (a view, kept as `fp8_view` keeps its own: the weight's forward
        storage serves the forward's saving and the backward's dgrad GEMM with one view), or None when there is no
        valid one."""
        t, fmt = self._transpose, self._fp8_dtype
        if t is None or self._transpose_invalid:
            return None
        return self._kept("_transpose_view_memo", t, fmt)

    @property
    def dtype(self) -> torch.dtype:
        """The nominal high-precision dtype."""
        return self._dtype

    @property
    def shape(self) -> torch.Size:
        return self._data.shape

    @property
    def device(self) -> torch.device:
        return self._data.device

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """`float32(data) * scale_inv`, converted to `dtype` (default: the nominal dtype)."""
        return self.dequantize_impl(self._dtype if dtype is None else dtype)

    def dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        return (widen(self.fp8_view(), torch.float32) * self.scale_inv.reshape(())).to(dtype)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The unscaled FP8 values as `dtype` (exact for bf16, fp16 and fp32), converted once and kept, so that a
        tensor used by two GEMMs (grad_output in dgrad and wgrad) is converted once."""
        cached = self._values
        if cached is None or cached.dtype != dtype:
            source = self._transposed_of
            data = self._data
            if source is not None and source._data is not None:  # kept on the untransposed tensor, for its next use
                cached = self._values = source.values(dtype).t()
            elif data.numel() >= WIDEN_BY_TABLE_MIN_NUMEL:  # from the uint8 bytes (no FP8-typed view)
                cached = self._values = widen(data, dtype, self._codes_finite, _TORCH_OF[self._fp8_dtype])
            else:
                cached = self._values = widen(self.fp8_view(), dtype, self._codes_finite)
        return cached

    def transposed(self) -> "Float8TensorStorage":
        """The transpose of a 2-D tensor; the bytes are moved exactly, the scale (and converted values) shared.
        With `_transpose` the two layouts swap roles (no copy)."""
        data = self._data
        out = Float8TensorStorage.__new__(Float8TensorStorage)  # this one's fields, already checked
        if self._transpose is not None and not self._transpose_invalid and data.dim() == 2:
            keep = data if data.is_contiguous() else None
            out._assign(self._transpose, self._fp8_dtype, self._scale_inv, self._dtype, keep, None,
                        self._scale_inv_value)
        else:
            out._assign(data.t(), self._fp8_dtype, self._scale_inv, self._dtype, None, None, self._scale_inv_value)
        if self._values is not None:
            out._values = self._values.t()
        elif self._transpose is None and self._data.device.type == "cpu":
            out._transposed_of = self  # the CPU GEMM widens `self` (kept there for the weight's reuse), not the view
        out._codes_finite = self._codes_finite
        return out

    def with_transpose(self) -> "Float8TensorStorage":
        """Self with `_transpose` made (a copy of the transposed bytes) when it lives off the CPU, where the GEMMs
        read it; CPU tensors are returned as they are (the emulated GEMM reads any layout)."""
        if (self._transpose is None or self._transpose_invalid) and self._data.device.type != "cpu":
            self._create_transpose()
        return self

    def _create_transpose(self) -> None:
        """Make `_transpose` from `_data` (a copy of the transposed bytes) and mark it valid."""
        n = self._data.shape[-1] if self._data.dim() else 1
        self._transpose = self._data.reshape(math.prod(self._data.shape[:-1]), n).t().contiguous()  # n may be 0
        self._transpose_invalid = False

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """`(_data, _transpose)`, or one of them (Transformer Engine's accessor)."""
        if rowwise_data and columnwise_data:
            return self._data, self._transpose
        if rowwise_data:
            return self._data
        if columnwise_data:
            return self._transpose
        raise ValueError("get_data_tensors: rowwise_data and columnwise_data are both False")

    def get_metadata(self) -> dict:
        """The constructor's keywords that rebuild this tensor over the same buffers."""
        return {"data": self._data, "fp8_scale_inv": self.scale_inv, "fp8_dtype": self._fp8_dtype,
                "data_transpose": None if self._transpose_invalid else self._transpose,
                "quantizer": self._quantizer, "fake_dtype": self._dtype}

    # ---- an FP8 operand saved for the backward GEMMs (fp8kit's Linear function) ----

    def saved_form(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(bytes, scale tensor) to hand to `ctx.save_for_backward`: the transpose seen as a column-major view when
        the cast wrote one (what the dgrad / wgrad GEMM reads without a copy), else the row-major bytes, both as
        FP8-typed views (they carry the format); the scale tensor may be None on the host path, where
        `scale_inv_value` holds it. `from_saved` rebuilds the operand."""
        column_major = self.column_major_view()  # (with no valid `_transpose`: the FP8 view, or None)
        return (column_major if column_major is not None else self.fp8_view()), self._scale_inv

    @staticmethod
    def from_saved(data: torch.Tensor, scale_inv: Optional[torch.Tensor],
                   scale_inv_value: Optional[float]) -> "Float8TensorStorage":
        """An operand `saved_form` gave, back as a storage (its nominal dtype does not matter to the GEMMs). The
        saved FP8-typed view is kept as the storage's `fp8_view()` (one view operation, for the uint8 bytes)."""
        if data.dtype not in _TE_DTYPE or (scale_inv is None and scale_inv_value is None):  # not saved_form's: checked
            return Float8TensorStorage(data=data, fp8_scale_inv=scale_inv, scale_inv_value=scale_inv_value)
        return Float8TensorStorage.trusted(data, scale_inv, torch.float32, scale_inv_value)

    # ---- pickling ----

    _VIEW_MEMOS = ("_fp8_view_memo", "_transpose_view_memo", "_column_major_memo")

    def __getstate__(self) -> dict:
        """The fields without the kept views (`fp8_view`, `transpose_view`, `column_major_view`): caches, remade on
        use, and FP8-typed tensors, which torch's pickling does not take."""
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEW_MEMOS}

    # ---- autograd saving (Transformer Engine's protocol) ----

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "Float8TensorStorage"]:
        """(the tensors to hand to `ctx.save_for_backward`, the object that `restore_from_saved` fills)."""
        tensors = [self._data, self._transpose, self.scale_inv]
        self._data = self._transpose = None
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Take back the tensors `prepare_for_saving` gave; returns the rest of the list."""
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        self._transpose_invalid = self._transpose is None
        return tensors[3:]

    def __repr__(self) -> str:
        inv = self._scale_inv_value if self._scale_inv is None else float(self._scale_inv.reshape(()))
        return (f"Float8TensorStorage(shape={tuple(self._data.shape)}, fp8_dtype={self._fp8_dtype.name}, "
                f"scale_inv={inv:.6g}, dtype={self._dtype})")


def _bytes_and_format(data, fp8_dtype, name: str):
    """(`data` as uint8 bytes, its format as a DType): uint8 `data` with `fp8_dtype` naming the format, or
    float8-typed `data` (whose dtype names it; `fp8_dtype`, if given, must agree)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Float8Tensor {name} must be a tensor, got {type(data).__name__}")
    if data.dtype == torch.uint8:
        if fp8_dtype is None:
            raise TypeError(f"Float8Tensor: uint8 {name} needs fp8_dtype (DType.kFloat8E4M3 or kFloat8E5M2) to name "
                            "the format")
        return data, te_dtype(fp8_torch_dtype(fp8_dtype, "Float8Tensor fp8_dtype"))
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"Float8Tensor {name} must hold uint8 bytes (with fp8_dtype) or a float8_e4m3fn / "
                        f"float8_e5m2 tensor, got {data.dtype}")
    fmt = te_dtype(data.dtype)
    if fp8_dtype is not None and DType.cast(fp8_dtype) != fmt:
        raise TypeError(f"Float8Tensor fp8_dtype {fp8_dtype!r} does not match the {name}'s {data.dtype}")
    return data.view(torch.uint8), fmt


# Large CPU tensors widen by bit manipulation: torch's FP8 conversion is a per-element loop, several times slower
# than these four vectorised passes. The FP8 byte, read as an int8, is sign-extended into an int16 and shifted left
# so that its exponent and mantissa fields land on bf16's; the mask keeps them and the sign bit (clearing the copies
# of the sign the extension made), and a multiplication by 2**(127 - bias) fixes the exponent bias (exact, FP8
# subnormals included). NaN/inf codes would come out as finite numbers, so tensors holding any take the table below.
_BY_BITS = {  # fp8 dtype: (left shift, int16 mask, multiplier, smallest |code| that is NaN or inf)
    torch.float8_e4m3fn: (4, 0x87F0 - 0x10000, 2.0 ** 120, 0x7F),
    torch.float8_e5m2: (5, 0x8FE0 - 0x10000, 2.0 ** 112, 0x7C),
}
WIDEN_BY_BITS_MIN_NUMEL = 1 << 16
_SUBNORMAL = torch.tensor(2.0 ** -140, dtype=torch.float32)


# Mid-sized CPU tensors widen by table: torch's conversion costs about 7 ns per element here, a gather from the 256
# codes' values (made by that same conversion, so bit-identical, NaN codes included) about 2 ns plus the uint8 ->
# int64 index pass (docs/performance.md, "Host overhead").
WIDEN_BY_TABLE_MIN_NUMEL = 1 << 10
_CODE_VALUES: dict = {}  # (fp8 dtype, dtype) -> the 256 codes' values as dtype (CPU)


def _code_values(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    key = (fp8_dtype, dtype)
    found = _CODE_VALUES.get(key)
    if found is None:
        with torch.inference_mode(False):
            found = _CODE_VALUES[key] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(dtype)
    return found


def widen(data: torch.Tensor, dtype: torch.dtype, codes_finite: bool = False,
          fp8_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`data.to(dtype)` for FP8-typed `data` (or uint8 bytes `data` of the torch float8 format `fp8_dtype`), faster
    for CPU tensors of at least WIDEN_BY_TABLE_MIN_NUMEL elements: by bits (large, bf16 or float32, no NaN/inf
    code), else by a gather from the 256 codes' values. `codes_finite`: the caller knows `data` holds no NaN or inf
    code (skips a check that reads the bytes twice)."""
    numel, device = data.numel(), data.device
    if numel < WIDEN_BY_TABLE_MIN_NUMEL or device.type != "cpu" or not dtype.is_floating_point \
            or torch.compiler.is_compiling():  # traced: no module-level table made inside a graph
        return (data if fp8_dtype is None else data.view(fp8_dtype)).to(dtype)
    raw = data if fp8_dtype is not None else data.view(torch.uint8)
    fp8_dtype = fp8_dtype or data.dtype
    common = dtype is torch.bfloat16 or dtype is torch.float32
    if common and host.active(device) and raw.is_contiguous() and cpu_kernels.available():
        wide = cpu_kernels.widen(raw, fp8_dtype, dtype)  # one vectorised pass; None for NaN/inf codes
        if wide is not None:
            return wide
    if numel >= WIDEN_BY_BITS_MIN_NUMEL and common:
        shift, mask, multiplier, special = _BY_BITS[fp8_dtype]
        # the multiplication needs subnormal arithmetic: not under torch.set_flush_denormal(True)
        if (codes_finite or int((raw & 0x7F).max()) < special) and float(_SUBNORMAL * 1.0) != 0:
            # float32 has bf16's exponent field: the same in an int32, 16 bits further up
            wide = dtype == torch.float32
            bits = raw.view(torch.int8).to(torch.int32 if wide else torch.int16)
            bits.bitwise_left_shift_(shift + 16 if wide else shift).bitwise_and_(mask * 0x10000 if wide else mask)
            return bits.view(dtype).mul_(multiplier)
    index, table = raw.to(torch.int64), _code_values(fp8_dtype, dtype)
    if index.is_contiguous():
        return torch.take(table, index)
    # keep the input's layout, as the conversion does: the CPU GEMM's rounding depends on its operands' strides
    return torch.take(table, index, out=torch.empty_like(index, dtype=dtype))
