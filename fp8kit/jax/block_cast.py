"""Block-scaled FP8 casts for JAX, as pure jit-able functions: MXFP8 (one E8M0 scale per 32 elements; Transformer
Engine's `ScalingMode.MXFP8_1D_SCALING`) and Float8 block scaling (one float32 scale per 1x128 or 128x128 block).

The rules are those of the PyTorch side (fp8kit/pytorch/block_cast.py, written down in docs/numerics.md), and the
bytes and scales are the same bit for bit. XLA:CPU reads and writes float32 subnormals as zero (see
fp8kit/jax/cast.py), so nothing here lets a subnormal reach float32 arithmetic where it would change a result:

- the E8M0 exponent is a step function of the block amax. Its 254 steps are found once on the host (NumPy, IEEE
  arithmetic) as float32 bit patterns, and a block's exponent is the number of steps its amax's bit pattern reaches
  (an integer search, exact for subnormal amaxes too);
- the cast multiplies a subnormal element through its integer mantissa (`cast.scaled_float32`), and the factor
  2^-127 of exponent 254 as 2^-126 * 2^-1;
- Float8 block scales come from `fp8_max / amax` (an amax below float32's normal range gives an infinite quotient
  in IEEE arithmetic as well as under flushing), and `scale_inv` from the exact `cast.reciprocal`.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .cast import F32, FP8_MAX, max_nonneg, reciprocal, round_down_pow2, scaled_float32

__all__ = ["MXFP8_BLOCK", "FLOAT8_BLOCK", "block_amax", "e8m0_from_amax", "e8m0_decode", "fp8_bytes",
           "saturating_cast", "mxfp8_cast", "float8_block_scale", "float8_block_cast"]

MXFP8_BLOCK = 32
FLOAT8_BLOCK = 128
_ABS_MASK = 0x7FFFFFFF
_EXP_MASK = 0x7F800000


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(F32), jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), F32)


def block_amax(tiles: jax.Array, axes) -> jax.Array:
    """max |x| per block over `axes` as float32, NaN ignored (an all-NaN block has amax 0); on bit patterns, so a
    subnormal amax is kept."""
    b = _bits(tiles) & jnp.uint32(_ABS_MASK)
    b = jnp.where(b > _EXP_MASK, jnp.uint32(0), b)
    return _float(jnp.max(b, axis=axes))


# ---- MXFP8: E8M0 scales --------------------------------------------------------------------------------------

def _e8m0_rule(amax_bits: np.ndarray, fp8_max: float) -> np.ndarray:
    """The E8M0 byte of float32 amaxes (given by bit pattern), in NumPy: v = float32(amax * float32(1 / fp8_max));
    v's biased exponent, plus one where its mantissa is non-zero, except that a subnormal v <= 2^-127 stays 0 and
    exponent 254 does not grow; inf -> 254."""
    amax = amax_bits.astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        v = amax * np.float32(1.0 / fp8_max)
    bits = v.view(np.uint32).astype(np.int64)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + up
    return np.where(np.isinf(v), 0xFE, code)


@functools.lru_cache(maxsize=None)
def _e8m0_steps(fp8_max: float) -> np.ndarray:
    """uint32 bit patterns: entry c - 1 is the smallest non-negative float32 amax whose byte is >= c (c = 1..254).
    Found by bisection over the bit patterns [0, inf], on which the byte is non-decreasing."""
    lo = np.zeros(254, np.int64)
    hi = np.full(254, _EXP_MASK, np.int64)  # inf gives 254
    target = np.arange(1, 255)
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        reach = _e8m0_rule(mid, fp8_max) >= target
        hi = np.where(reach, mid, hi)
        lo = np.where(reach, lo, mid + 1)
    return lo.astype(np.uint32)


def e8m0_from_amax(amax: jax.Array, fp8_dtype) -> jax.Array:
    """The E8M0 scale byte (uint8) of blocks with non-negative float32 `amax` (NaN -> 255), exact on every
    backend: the number of the rule's steps that the amax reaches (see the module docstring)."""
    steps = jnp.asarray(_e8m0_steps(FP8_MAX[jnp.dtype(fp8_dtype)]))
    b = _bits(amax)
    code = jnp.searchsorted(steps, b, side="right", method="compare_all")
    return jnp.where(b > _EXP_MASK, 255, code).astype(jnp.uint8)


def e8m0_decode(code: jax.Array) -> jax.Array:
    """The float32 value of E8M0 bytes, 2^(code - 127) (0 -> the subnormal 2^-127, 255 -> NaN), built from bits."""
    c = code.astype(jnp.uint32)
    bits = jnp.where(c == 0, jnp.uint32(0x00400000), c << 23)
    return _float(jnp.where(c == 255, jnp.uint32(0x7FC00000), bits))


def _e8m0_multiply(x: jax.Array, code: jax.Array) -> jax.Array:
    """float32(x) * 2^(127 - code): exact where the result is normal, also for subnormal x; 255 -> NaN."""
    c = code.astype(jnp.int32)
    exponent = jnp.clip(127 - c, -126, 127)  # 2^-127 (code 254) as 2^-126 * 2^-1
    factor = _float((exponent + 127).astype(jnp.uint32) << 23)
    y = scaled_float32(x, factor)
    y = jnp.where(c == 254, y * jnp.float32(0.5), y)
    return jnp.where(c == 255, jnp.float32(jnp.nan), y)


# ---- FP8 bytes ---------------------------------------------------------------------------------------------------

def saturating_cast(y: jax.Array, fp8_dtype) -> jax.Array:
    """FP8 values of float32 `y`: clamped to +-fp8_max (inf included), rounded to nearest even, NaN kept."""
    fp8_dtype = jnp.dtype(fp8_dtype)
    m = jnp.float32(FP8_MAX[fp8_dtype])
    return jnp.where(jnp.isnan(y), y, jnp.clip(y, -m, m)).astype(fp8_dtype)


def fp8_bytes(q: jax.Array, y: jax.Array) -> jax.Array:
    """The uint8 bytes of FP8 values `q` cast from float32 `y`, a NaN written as 0x7F whatever its sign (a GPU's
    product is the positive canonical NaN: the byte the torch side and the kernels write; XLA's CPU conversion keeps
    the sign and writes 0x7E for E5M2)."""
    b = lax.bitcast_convert_type(q, jnp.uint8)
    return jnp.where(jnp.isnan(y), jnp.uint8(0x7F), b)


def _fp8(y: jax.Array, fp8_dtype) -> jax.Array:
    """FP8 values (dtype fp8_dtype) of float32 `y`, with fp8_bytes' NaN byte."""
    return lax.bitcast_convert_type(fp8_bytes(saturating_cast(y, fp8_dtype), y), jnp.dtype(fp8_dtype))


def _tiles(x: jax.Array, rows: int, cols: int) -> Tuple[jax.Array, Tuple[int, int]]:
    """x (M, K) zero-padded to whole blocks and viewed as (M / rows, rows, K / cols, cols)."""
    m, k = x.shape
    mb, kb = -(-m // rows), -(-k // cols)
    if (mb * rows, kb * cols) != (m, k):
        x = jnp.pad(x, ((0, mb * rows - m), (0, kb * cols - k)))  # zeros do not change a block's amax
    return x.reshape(mb, rows, kb, cols), (mb, kb)


def mxfp8_cast(x: jax.Array, fp8_dtype, block_rows: int, block_cols: int) -> Tuple[jax.Array, jax.Array]:
    """MXFP8 of the 2-D `x` (M, K) with one E8M0 scale per `block_rows x block_cols` block (1x32, 32x1 or 32x32):
    (FP8 values (M, K), uint8 E8M0 bytes (M / block_rows, K / block_cols)). M and K must divide by the block."""
    m, k = x.shape
    if m % block_rows or k % block_cols:
        raise ValueError(f"MXFP8 needs dims divisible by {MXFP8_BLOCK}: got shape ({m}, {k}) for "
                         f"{block_rows}x{block_cols} blocks")
    tiles, _ = _tiles(x, block_rows, block_cols)
    code = e8m0_from_amax(block_amax(tiles, (1, 3)), fp8_dtype)
    y = _e8m0_multiply(tiles, code[:, None, :, None])
    return _fp8(y, fp8_dtype).reshape(m, k), code


# ---- Float8 block scaling: float32 scales -------------------------------------------------------------------------

def float8_block_scale(amax: jax.Array, fp8_dtype, power_2: bool, epsilon: float, value_for_inf: float
                       ) -> Tuple[jax.Array, jax.Array]:
    """(scale, scale_inv), float32, of blocks with float32 `amax`: amax floored at float32(epsilon); scale =
    float32(fp8_max / amax), an infinite quotient replaced by `value_for_inf`; with `power_2` its mantissa bits
    cleared; amax 0, inf or NaN -> 1. scale_inv = float32(1 / scale), exact also when it is subnormal."""
    a = max_nonneg(amax, jnp.float32(np.float32(epsilon))) if epsilon > 0 else amax
    ab = _bits(a) & jnp.uint32(_ABS_MASK)
    bad = (ab == 0) | (ab >= _EXP_MASK)
    scale = jnp.float32(FP8_MAX[jnp.dtype(fp8_dtype)]) / jnp.where(bad, jnp.float32(1), a)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(value_for_inf), scale)
    if power_2:
        scale = round_down_pow2(scale)
    scale = jnp.where(bad, jnp.float32(1), scale)
    return scale, reciprocal(scale)


def float8_block_cast(x: jax.Array, fp8_dtype, two_d: bool, power_2: bool, epsilon: float
                      ) -> Tuple[jax.Array, jax.Array]:
    """Float8 block scaling of the 2-D `x` (M, K): 1x128 blocks along K, or 128x128 with `two_d` (edge blocks
    shorter). Returns (FP8 values (M, K), float32 scale_inv (M or ceil(M / 128), ceil(K / 128))). An infinite
    quotient becomes the largest finite value of x's dtype, as Transformer Engine's kernels do."""
    m, k = x.shape
    tiles, _ = _tiles(x, FLOAT8_BLOCK if two_d else 1, FLOAT8_BLOCK)
    value_for_inf = float(jnp.finfo(x.dtype).max)
    scale, scale_inv = float8_block_scale(block_amax(tiles, (1, 3)), fp8_dtype, power_2, epsilon, value_for_inf)
    y = scaled_float32(tiles, scale[:, None, :, None])
    q = _fp8(y, fp8_dtype)
    return q.reshape(tiles.shape[0] * tiles.shape[1], -1)[:m, :k], scale_inv
