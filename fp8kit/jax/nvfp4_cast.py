"""NVFP4 casts for JAX, as pure jit-able functions: E2M1 values packed two per byte, one E4M3 scale per 1x16 (or
16x16) block and one float32 scale per tensor (Transformer Engine JAX's `ScalingMode.NVFP4_1D_SCALING` and
`NVFP4_2D_SCALING`).

The rules are those of the PyTorch side (fp8kit/pytorch/nvfp4_cast.py, written down in docs/numerics.md, "NVFP4"),
and the bytes and scales are the same bit for bit. XLA:CPU reads and writes float32 subnormals as zero (see
fp8kit/jax/cast.py); the steps where an IEEE subnormal changes a result are computed without one:

- the amaxes are taken on bit patterns (`block_cast.block_amax`), and "amax is 0" is a bit test;
- `x * f` and `block_amax * (S / 6)` multiply a subnormal operand through its integer mantissa
  (`cast.scaled_float32`);
- the global decode scale `D = 1 / S` is subnormal for a tensor amax below about 2^-114: `cast.reciprocal` builds
  it from an integer division, and `s * D` (E4M3 scale times D) is rounded to float32 with integer arithmetic,
  subnormal results included, before its reciprocal is taken (`_encode_factor`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .block_cast import block_amax
from .cast import F32, reciprocal, scaled_float32

__all__ = ["NVFP4_BLOCK", "E2M1_VALUES", "global_encode_scale", "block_scales", "e2m1_codes", "pack_e2m1",
           "unpack_e2m1", "e2m1_decode", "e4m3_decode", "nvfp4_cast"]

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative
_FLT_MAX = float(np.finfo(np.float32).max)
_MANT = 0x007FFFFF
_ABS = 0x7FFFFFFF
# the code of an E2M1 magnitude m, indexed by 2 * m (0, 1, 2, 3, 4, 6, 8, 12; other entries unused)
_CODE_OF_TWICE = np.array([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=np.uint8)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(F32), jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), F32)


def _pow2(e: jax.Array) -> jax.Array:
    """2^e as float32 for integer e in [-126, 127], from bits."""
    return _float((e + 127).astype(jnp.uint32) << 23)


def global_encode_scale(amax: jax.Array) -> jax.Array:
    """`2688 / amax` in float32, float32 max where that overflows (a subnormal amax always does), 1 where amax is 0
    or the quotient is 0 (amax infinite)."""
    a = amax.astype(F32)
    zero = (_bits(a) & _ABS) == 0
    s = jnp.float32(E2M1_MAX * E4M3_MAX) / jnp.where(zero, jnp.float32(1), a)  # a subnormal a reads as 0: inf
    s = jnp.where(jnp.isnan(s) | (s > jnp.float32(_FLT_MAX)), jnp.float32(_FLT_MAX), s)
    return jnp.where(zero | (s == 0), jnp.float32(1), s)


def _encode_factor(s: jax.Array, decode: jax.Array) -> jax.Array:
    """`min(1 / float32(s * decode), float32 max)` with IEEE rounding also where `decode` or the product is
    subnormal: s is an E4M3 value (0 or a*2^b with a in [8, 15]), decode = md * 2^ed; the exact product a * md *
    2^E (a * md < 2^28) is rounded to float32 once, from integers where it is below 2^-126."""
    sb, db = _bits(s), _bits(decode)
    se, de = (sb >> 23).astype(jnp.int32), (db >> 23).astype(jnp.int32)
    a = ((sb & _MANT) >> 20) | 8
    md = jnp.where(de == 0, db & _MANT, (db & _MANT) | 0x00800000)
    prod = a * md  # uint32, exact
    e = (se - 130) + (jnp.maximum(de, 1) - 150)  # s * decode = prod * 2^e
    # normal result: the integer rounded to float32 (once), then exact power-of-two scaling
    e1 = jnp.clip(e, -100, 100)
    normal_value = prod.astype(F32) * _pow2(e1) * _pow2(jnp.clip(e - e1, -126, 127))
    f_normal = jnp.float32(1) / normal_value
    # subnormal result: k = round_half_even(prod * 2^(e + 149)) is the float32's bit pattern
    sh = -(e + 149)
    shr = jnp.clip(sh, 1, 31).astype(jnp.uint32)
    q = prod >> shr
    rem = prod & ((jnp.uint32(1) << shr) - 1)
    half = jnp.uint32(1) << (shr - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.uint32)
    k = jnp.where(sh <= 0, prod << jnp.clip(-sh, 0, 31).astype(jnp.uint32), jnp.where(sh >= 29, 0, q))
    # 2^149 / k: 1 / k (normal, in [2^-23, 1]) with 149 added to its exponent field (integers: XLA folds a chain
    # of constant float multiplies into one, 2^149, which overflows); an exponent past 254 is infinite
    rb = _bits(jnp.float32(1) / jnp.maximum(k, 1).astype(F32))
    exp_sub = (rb >> 23) + 149
    f_sub = jnp.where((k == 0) | (exp_sub >= 255), jnp.float32(jnp.inf), _float(rb + jnp.uint32(149 << 23)))
    t = -(e + 126)  # the product is >= 2^-126 iff prod >= 2^t
    is_normal = (t <= 0) | ((t < 28) & (prod >= (jnp.uint32(1) << jnp.clip(t, 0, 31).astype(jnp.uint32))))
    f = jnp.where(is_normal, f_normal, f_sub)
    f = jnp.where(se == 0, jnp.float32(jnp.inf), f)  # s = 0 (E4M3 has no subnormal below 2^-9 here: its
    # subnormals are float32 normals; only 0 has biased exponent 0)
    return jnp.where(f > jnp.float32(_FLT_MAX), jnp.float32(_FLT_MAX), f)


def e4m3_decode(code: jax.Array) -> jax.Array:
    """float32 values of E4M3 bytes (uint8)."""
    return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn).astype(F32)


def block_scales(amax_blocks: jax.Array, encode: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """(E4M3 scale bytes uint8, float32 encode factor f) of blocks with float32 `amax_blocks` (NaN-free) and the
    float32 scalar global encode scale: `e4m3(a * (S * float32(1/6)))` saturating at 448, `f = min(1 / (s * D),
    float32 max)` with D = 1 / S."""
    mult = encode * jnp.float32(np.float32(1.0 / 6.0))
    dec = scaled_float32(amax_blocks, mult)
    dec = jnp.where(jnp.isnan(dec), jnp.float32(_FLT_MAX), dec)
    dec = jnp.clip(dec, -E4M3_MAX, E4M3_MAX)
    code = lax.bitcast_convert_type(dec.astype(jnp.float8_e4m3fn), jnp.uint8)
    return code, _encode_factor(e4m3_decode(code), reciprocal(encode))


def e2m1_codes(v: jax.Array, rand: Optional[jax.Array] = None) -> jax.Array:
    """E2M1 codes (uint8, 0..15) of float32 `v` (clamped to [-6, 6]), with `sign` from v's sign bit: round to
    nearest even, or stochastically with `rand` (uniform [0, 1) float32 of v's shape): up when rand < (|v| - lo) /
    (hi - lo). The magnitudes are spaced h = 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so rounding is `h *
    round(|v| / h)` (ties to even, on an exact quotient) and the fraction `(|v| - lo) / h` is exact. NaN: code 0."""
    nan = jnp.isnan(v)
    a = jnp.where(nan, jnp.float32(0), jnp.abs(v))
    h = jnp.where(a < 2, jnp.float32(0.5), jnp.where(a < 4, jnp.float32(1), jnp.float32(2)))
    if rand is None:
        mag = jnp.round(a / h) * h
    else:
        lo = jnp.floor(a / h) * h
        mag = lo + jnp.where(rand < (a - lo) / h, h, jnp.float32(0))
    code = jnp.asarray(_CODE_OF_TWICE)[(mag * 2).astype(jnp.int32)]
    code = code | ((_bits(v) >> 31).astype(jnp.uint8) << 3)
    return jnp.where(nan, jnp.uint8(0), code)


def pack_e2m1(codes: jax.Array) -> jax.Array:
    """(..., K) codes -> (..., K / 2) bytes, the even element in the low nibble (Transformer Engine's order)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """(..., K / 2) bytes -> (..., K) codes."""
    return jnp.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes (code 8, -0, gives -0.0)."""
    table = jnp.asarray(np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32))
    return table[codes.astype(jnp.int32)]


def nvfp4_cast(x: jax.Array, two_d: bool = False, rand: Optional[jax.Array] = None, axis_names: Tuple[str, ...] = ()
               ) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4 of the 2-D `x` (M, K), M and K multiples of 16: 1x16 blocks along K, or 16x16 blocks (`two_d`), with
    x's own amax (NaN ignored). Returns (packed uint8 (M, K / 2), E4M3 scale bytes uint8 (M, K / 16), a 16x16
    block's scale repeated on its 16 rows; float32 amax scalar). `rand`: uniform [0, 1) draws of x's shape for
    stochastic rounding (None: round to nearest even). `axis_names`: mesh axes bound by an enclosing `shard_map`
    over which the tensor amax is all-reduced (MAX), so that a shard of x gets the whole tensor's global scale."""
    m, k = x.shape
    if m % NVFP4_BLOCK or k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs dims divisible by {NVFP4_BLOCK}: got shape ({m}, {k})")
    if two_d:
        amax_blocks = block_amax(x.reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK), (1, 3))
    else:
        amax_blocks = block_amax(x.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK), (2,))
    amax_bits = jnp.max(_bits(amax_blocks)) if amax_blocks.size else jnp.uint32(0)
    for name in axis_names:  # on the bit patterns: non-negative floats order as their bits, subnormals included
        amax_bits = lax.pmax(amax_bits, name)
    amax = _float(amax_bits)
    if two_d:
        amax_blocks = jnp.repeat(amax_blocks, NVFP4_BLOCK, axis=0)
    scale_bytes, factor = block_scales(amax_blocks, global_encode_scale(amax))
    v = scaled_float32(x.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK), factor[:, :, None])
    v = jnp.where(jnp.isnan(v), v, jnp.clip(v, -E2M1_MAX, E2M1_MAX)).reshape(m, k)
    # the sign is x's (x * f keeps it; a flushed subnormal product would not)
    v = jnp.where(jnp.isnan(v), v, jnp.where((_bits(x) >> 31) == 1, -jnp.abs(v), jnp.abs(v)))
    return pack_e2m1(e2m1_codes(v, rand)), scale_bytes, amax
