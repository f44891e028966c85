"""Block-scaled casts as pure functions on tensors: MXFP8 (E8M0 scale per 32 elements) and Float8 block scaling
(float32 scale per 1x128 or 128x128 block), bit for bit as Transformer Engine's CUDA kernels compute them.

All functions take a 2-D high-precision tensor `x` of shape (M, K) (callers flatten leading dims), run on any device
with torch operations only (no host synchronisation) and return FP8 bytes as `torch.uint8`. The rules, with the TE
source they come from, are written down in docs/numerics.md.
"""

from __future__ import annotations

import math
import struct
from typing import Tuple

import torch

MXFP8_BLOCK = 32
FLOAT8_BLOCK = 128
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

__all__ = ["MXFP8_BLOCK", "FLOAT8_BLOCK", "f32", "round_up", "ceil_div", "nan_free_abs", "e8m0_from_amax",
           "e8m0_cast_scale", "e8m0_decode", "mxfp8_cast", "float8_block_scale", "float8_block_cast_1d",
           "float8_block_cast_2d", "saturating_cast", "positive_nan_"]


def f32(value: float) -> float:
    """`value` rounded to float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def ceil_div(n: int, d: int) -> int:
    return (n + d - 1) // d


def nan_free_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0: the block amax kernels take `fmaxf`/`max.abs` from 0, which skip NaN."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a)


def positive_nan_(y: torch.Tensor) -> torch.Tensor:
    """On a CPU, `y`'s NaNs made the positive NaN, in place; elsewhere `y` untouched. A GPU's float arithmetic returns
    the canonical NaN 0x7FFFFFFF whatever the operands' signs, so the `x * scale` of every GPU cast (Transformer
    Engine's, torch's, the Triton kernels') is a positive NaN and converts to the byte 0x7F; a CPU multiply keeps
    the sign of a NaN operand, which would convert to 0xFF. Measured on an H100 (docs/numerics.md). Every FP8 cast
    of fp8kit's torch side goes through it."""
    if y.device.type == "cpu":
        torch.nan_to_num_(y, nan=math.nan, posinf=math.inf, neginf=-math.inf)
    return y


def saturating_cast(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of the float32 `y`: clamp to +-fp8_max (inf included, NaN kept, as the positive NaN: the
    byte 0x7F, as on a GPU, see `positive_nan_`), round to nearest even, as the kernels' `satfinite`
    conversions do."""
    m = FP8_MAX[fp8_dtype]
    return positive_nan_(y.clamp(-m, m)).to(fp8_dtype).view(torch.uint8)


# ---- MXFP8: E8M0 scales ----------------------------------------------------------------------------------------

def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The E8M0 scale byte (uint8) of blocks with float32 `amax`.

    `v = float32(amax * float32(1 / fp8_max))` (a float32 multiply, as the kernel does); the byte is v's biased
    exponent, plus one when v's mantissa is non-zero (round up to a power of two), except that a subnormal
    `v <= 2^-127` keeps 0 and exponent 254 does not grow (satfinite). v = 0 -> 0, inf -> 254, NaN -> 255."""
    rcp = torch.full((), f32(1.0 / FP8_MAX[fp8_dtype]), dtype=torch.float32, device=amax.device)
    v = amax.float() * rcp
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + up.to(torch.int32)
    code = torch.where(v == 0, 0, code)
    code = torch.where(torch.isinf(v), 0xFE, code)
    code = torch.where(torch.isnan(v), 0xFF, code)
    return code.to(torch.uint8)


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def e8m0_cast_scale(code: torch.Tensor) -> torch.Tensor:
    """The float32 factor the cast multiplies by, `2^(127 - code)`: 254 -> 2^-127 (subnormal), 255 -> NaN."""
    c = code.to(torch.int32)
    bits = torch.where(c == 254, 0x00400000, (254 - c).clamp_min(0) << 23)
    bits = torch.where(c == 255, 0x7FFFFFFF, bits)
    return _bits_to_f32(bits)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """The float32 value of an E8M0 byte, `2^(code - 127)`: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    c = code.to(torch.int32)
    bits = torch.where(c == 0, 0x00400000, c << 23)
    bits = torch.where(c == 255, 0x7FFFFFFF, bits)
    return _bits_to_f32(bits)


def mxfp8_cast(x: torch.Tensor, fp8_dtype: torch.dtype, block_rows: int, block_cols: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize the (M, K) tensor `x` with one E8M0 scale per `block_rows x block_cols` block (1x32 rowwise,
    32x1 columnwise, 32x32 for 2-D). Returns (uint8 data (M, K), uint8 scales (M / block_rows, K / block_cols))."""
    m, k = x.shape
    if m % block_rows or k % block_cols:
        raise ValueError(f"MXFP8 needs dims divisible by {MXFP8_BLOCK}: got shape ({m}, {k}) for "
                         f"{block_rows}x{block_cols} blocks")
    tiles = x.reshape(m // block_rows, block_rows, k // block_cols, block_cols)
    # amax in the input dtype (exact for bf16/fp16: max and abs do not round), then widened
    amax = nan_free_abs(tiles).amax(dim=(1, 3)).float()
    code = e8m0_from_amax(amax, fp8_dtype)
    scale = e8m0_cast_scale(code)[:, None, :, None]
    data = saturating_cast(tiles.float() * scale, fp8_dtype).reshape(m, k)
    return data, code


# ---- Float8 block scaling: float32 scales ------------------------------------------------------------------------

def float8_block_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool, epsilon: float,
                       value_for_inf: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv), float32, of blocks with float32 `amax`: amax floored at float32(epsilon);
    `scale = float32(fp8_max / amax)`, an infinite quotient replaced by `value_for_inf` (the input dtype's largest
    finite value), then with `power_2` the mantissa bits cleared; amax 0, inf or NaN -> 1. `scale_inv =
    float32(1 / scale)`."""
    eps = torch.full((), f32(float(epsilon)), dtype=torch.float32, device=amax.device)
    a = torch.where(amax < eps, eps, amax)
    scale = torch.div(torch.full_like(a, FP8_MAX[fp8_dtype]), a)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if power_2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # 0x7F800000: the sign bit is 0
    bad = torch.isinf(a) | (a == 0) | torch.isnan(a)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def _value_for_inf(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = x.shape
    if (m, k) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - k, 0, rows - m))


def float8_block_cast_1d(x: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool, epsilon: float
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """1x128 blocks along the last dim of the (M, K) tensor `x` (K need not divide by 128: the last block is
    shorter). Returns (uint8 data (M, K), float32 scale_inv (M, ceil(K / 128)))."""
    m, k = x.shape
    kb = ceil_div(k, FLOAT8_BLOCK)
    tiles = _padded(x, m, kb * FLOAT8_BLOCK).reshape(m, kb, FLOAT8_BLOCK)  # zeros do not change a block's amax
    amax = nan_free_abs(tiles).amax(dim=2).float()
    scale, scale_inv = float8_block_scale(amax, fp8_dtype, power_2, epsilon, _value_for_inf(x.dtype))
    data = saturating_cast(tiles.float() * scale[:, :, None], fp8_dtype).reshape(m, kb * FLOAT8_BLOCK)
    return data[:, :k], scale_inv


def float8_block_cast_2d(x: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool, epsilon: float
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of the (M, K) tensor `x` (edge blocks are smaller). Returns (uint8 data (M, K), float32
    scale_inv (ceil(M / 128), ceil(K / 128)))."""
    m, k = x.shape
    mb, kb = ceil_div(m, FLOAT8_BLOCK), ceil_div(k, FLOAT8_BLOCK)
    tiles = _padded(x, mb * FLOAT8_BLOCK, kb * FLOAT8_BLOCK).reshape(mb, FLOAT8_BLOCK, kb, FLOAT8_BLOCK)
    amax = nan_free_abs(tiles).amax(dim=(1, 3)).float()
    scale, scale_inv = float8_block_scale(amax, fp8_dtype, power_2, epsilon, _value_for_inf(x.dtype))
    data = saturating_cast(tiles.float() * scale[:, None, :, None], fp8_dtype)
    return data.reshape(mb * FLOAT8_BLOCK, kb * FLOAT8_BLOCK)[:m, :k], scale_inv
