"""Float8Tensor: FP8 bytes plus the float32 scale_inv that maps them back to real values."""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Float8Tensor:
    """A quantized tensor: `real ~= data.float() * scale_inv`.

    Attributes:
      data: the FP8 values, dtype `torch.float8_e4m3fn` or `torch.float8_e5m2`, any shape.
      scale_inv: float32 tensor with one element (0-d), `float32(1 / scale)` taken at cast time.
      dtype: the nominal high-precision dtype the tensor stands for (what `dequantize()` returns by default
        in modules; `dequantize()` itself defaults to float32).
      data_t: None, or the FP8 bytes of the transpose, contiguous: `data.reshape(-1, data.shape[-1]).t()` laid out
        row-major, as the fused cast+transpose kernels write it. The GEMM (`fp8kit.pytorch.gemm`) takes a
        column-major operand from it instead of copying `data`; `t()` swaps `data` and `data_t`.
    """

    __slots__ = ("data", "_scale_inv", "dtype", "_values", "scale_inv_value", "data_t")

    def __init__(self, data: torch.Tensor, scale_inv: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None,
                 scale_inv_value: Optional[float] = None, data_t: Optional[torch.Tensor] = None):
        if data.dtype not in FP8_DTYPES:
            raise TypeError(f"Float8Tensor data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        if data_t is not None:
            n = data.shape[-1] if data.dim() else 1
            want = (n, data.numel() // n if n else 0)
            if data_t.dtype != data.dtype or tuple(data_t.shape) != want or not data_t.is_contiguous() \
                    or data_t.device != data.device:
                raise ValueError(
                    f"Float8Tensor data_t must be a contiguous {data.dtype} tensor of shape {want} on {data.device} "
                    f"(the transpose of data {tuple(data.shape)}), got {data_t.dtype} {tuple(data_t.shape)} "
                    f"contiguous={data_t.is_contiguous()} on {data_t.device}")
        if scale_inv is None:
            if scale_inv_value is None:
                raise TypeError("Float8Tensor needs scale_inv (a tensor) or scale_inv_value (a float)")
        elif scale_inv.dtype != torch.float32 or scale_inv.numel() != 1:
            raise TypeError(
                f"Float8Tensor scale_inv must be one float32 element, got {scale_inv.dtype} of shape "
                f"{tuple(scale_inv.shape)}"
            )
        self.data = data
        self._scale_inv = scale_inv
        self.dtype = dtype if dtype is not None else torch.float32
        self._values = None  # the unscaled FP8 values in a wider dtype, made once by the CPU GEMM (see `values`)
        # `scale_inv` as a Python float when the CPU fast path made it (fp8kit.pytorch.host), else None
        self.scale_inv_value = scale_inv_value
        self.data_t = data_t

    @property
    def scale_inv(self) -> torch.Tensor:
        """float32 0-d (or one-element) tensor, `float32(1 / scale)`."""
        if self._scale_inv is None:  # made by the CPU fast path from the float
            self._scale_inv = torch.scalar_tensor(self.scale_inv_value, dtype=torch.float32, device=self.data.device)
        return self._scale_inv

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`float32(data) * scale_inv`, then converted to `dtype`."""
        return (self.data.float() * self.scale_inv).to(dtype)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The unscaled FP8 values as `dtype` (exact for bf16, fp16 and fp32), converted once and kept, so that a
        tensor used by two GEMMs (grad_output in dgrad and wgrad) is converted once."""
        cached = self._values
        if cached is None or cached.dtype != dtype:
            cached = self._values = _widen(self.data, dtype)
        return cached

    def t(self) -> "Float8Tensor":
        """The transpose of a 2-D tensor; the bytes are moved exactly, the scale (and converted values) shared.
        With `data_t` the two layouts swap roles (no copy): the result's `data` is `data_t`, and its `data_t` is
        `data` when that is contiguous."""
        if self.data_t is not None and self.data.dim() == 2:
            keep = self.data if self.data.is_contiguous() else None
            out = Float8Tensor(self.data_t, self._scale_inv, self.dtype, self.scale_inv_value, keep)
        else:
            out = Float8Tensor(self.data.t(), self._scale_inv, self.dtype, self.scale_inv_value)
        if self._values is not None:
            out._values = self._values.t()
        return out

    def __repr__(self) -> str:
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self.fp8_dtype}, "
            f"scale_inv={self.scale_inv.item():.6g}, dtype={self.dtype})"
        )


# Large CPU tensors widen by bit manipulation: torch's FP8 conversion is a per-element loop, about ten times slower
# than these four vectorised passes. The FP8 byte goes into the high half of an int16 and is shifted right
# (arithmetically) so that its exponent and mantissa fields land on bf16's, the sign is kept by the mask, and a
# multiplication by 2**(127 - bias) fixes the exponent bias (exact, FP8 subnormals included). NaN/inf codes would
# come out as finite numbers, so tensors holding any take torch's conversion.
_BY_BITS = {  # fp8 dtype: (right shift, int16 mask, multiplier, smallest |code| that is NaN or inf)
    torch.float8_e4m3fn: (4, 0x87F0 - 0x10000, 2.0 ** 120, 0x7F),
    torch.float8_e5m2: (3, 0x8FE0 - 0x10000, 2.0 ** 112, 0x7C),
}
_BY_BITS_MIN_NUMEL = 1 << 16
_SUBNORMAL = torch.tensor(2.0 ** -140, dtype=torch.float32)


def _widen(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data.to(dtype)`, faster for large CPU tensors and bf16 or float32 results."""
    if data.device.type == "cpu" and data.numel() >= _BY_BITS_MIN_NUMEL and dtype in (torch.bfloat16, torch.float32):
        shift, mask, multiplier, special = _BY_BITS[data.dtype]
        codes = data.view(torch.uint8)
        # the multiplication needs subnormal arithmetic: not under torch.set_flush_denormal(True)
        if int((codes & 0x7F).max()) < special and float(_SUBNORMAL * 1.0) != 0:
            # float32 has bf16's exponent field: the same in an int32, 16 bits further up
            wide = dtype == torch.float32
            bits = codes.to(torch.int32 if wide else torch.int16)
            bits.bitwise_left_shift_(24 if wide else 8).bitwise_right_shift_(shift)
            bits.bitwise_and_(mask * 0x10000 if wide else mask)
            return bits.view(dtype).mul_(multiplier)
    return data.to(dtype)
