"""The FP8 cast and the scale rules for JAX, as pure functions on arrays.

One convention everywhere: `q = saturate(float32(x) * scale)` rounded to nearest even, `x ~= q * scale_inv`,
`scale_inv = float32(1 / scale)` (SPEC sections 1 and 3).

XLA:CPU runs with denormals-are-zero and flush-to-zero: float32 arithmetic reads a subnormal operand as 0 and
writes a subnormal result as 0 (conversions, selects and integer ops are unaffected). To give the same bytes as
the NumPy reference on every backend, the functions below never let a subnormal float32 reach arithmetic where it
matters: amaxes, comparisons and maxima work on the IEEE bit patterns (for non-negative floats the integer order
is the float order), a subnormal input is multiplied through its integer mantissa, and a subnormal `scale_inv` is
built with integer division. On GPU (no flushing) these paths give the same values as the plain ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..recipe import FLT_MAX, SCALE_MIN

__all__ = [
    "FP8_MAX",
    "Float8Array",
    "amax",
    "cast",
    "cast_to_fp8",
    "current_scale",
    "dequantize",
    "fp8_dtype_of",
    "quantize",
    "reciprocal",
    "round_down_pow2",
    "scale_from_amax",
]

F32 = jnp.float32
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}
_DTYPE_OF_NAME = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}

_EXP_MASK = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_MANT_MASK = 0x007FFFFF


def fp8_dtype_of(name: str) -> jnp.dtype:
    """The jnp dtype for a recipe format name ("e4m3" or "e5m2")."""
    return _DTYPE_OF_NAME[name]


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(F32), jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), F32)


def _f32(value: float) -> jax.Array:
    return jnp.asarray(np.float32(value), dtype=F32)


# ---- non-negative floats through their bit patterns --------------------------------------------------------

def is_positive_finite(a: jax.Array) -> jax.Array:
    """`isfinite(a) & (a > 0)` for float32 `a`, exact for subnormals."""
    b = _bits(a)
    return (b > 0) & (b < _EXP_MASK)


def is_nonzero(a: jax.Array) -> jax.Array:
    """`a != 0` for float32 `a` (NaN counts as nonzero), exact for subnormals."""
    return (_bits(a) & _ABS_MASK) != 0


def max_nonneg(a: jax.Array, b: jax.Array) -> jax.Array:
    """Elementwise max of two arrays of non-negative float32 values (amaxes), exact for subnormals.

    A NaN loses against any number (like `fmax`)."""
    ia = lax.bitcast_convert_type(a.astype(F32), jnp.int32)
    ib = lax.bitcast_convert_type(b.astype(F32), jnp.int32)
    ia = jnp.where(jnp.isnan(a), -1, ia)
    ib = jnp.where(jnp.isnan(b), -1, ib)
    m = jnp.maximum(ia, ib)
    return jnp.where(m < 0, jnp.float32(jnp.nan), lax.bitcast_convert_type(jnp.maximum(m, 0), F32))


def fmax_nonneg(a: jax.Array, axis: int = 0) -> jax.Array:
    """`fmax`-reduce non-negative float32 values along `axis` (NaN ignored; NaN if every value is NaN)."""
    ia = lax.bitcast_convert_type(a.astype(F32), jnp.int32)
    ia = jnp.where(jnp.isnan(a), -1, ia)
    m = jnp.max(ia, axis=axis)
    return jnp.where(m < 0, jnp.float32(jnp.nan), lax.bitcast_convert_type(jnp.maximum(m, 0), F32))


def amax(x: jax.Array, axis_names: tuple = ()) -> jax.Array:
    """`max |x|` over the non-NaN elements as a float32 scalar (0 for an empty or all-NaN array).

    `axis_names`: mesh axes bound by an enclosing `shard_map` to all-reduce (MAX) over; under `jit` with global
    arrays the max is already global and no name is needed."""
    b = _bits(x) & _ABS_MASK
    b = jnp.where(b > _EXP_MASK, jnp.uint32(0), b)  # NaN -> 0
    m = jnp.max(b, initial=jnp.uint32(0)) if b.size else jnp.uint32(0)
    for name in axis_names:
        m = lax.pmax(m, name)
    return _float(m)


# ---- scale rules -------------------------------------------------------------------------------------------

def round_down_pow2(scale: jax.Array) -> jax.Array:
    """Clear the 23 mantissa bits of float32 scales (normal and positive, as `scale_from_amax` makes them)."""
    return _float(_bits(scale) & jnp.uint32(0xFF800000))


def _divide_by_amax(numerator: float, a: jax.Array) -> jax.Array:
    """float32(numerator / a) for a positive finite `a`, correctly rounded also for a subnormal `a`."""
    n = _f32(numerator)
    plain = n / a
    # a = m * 2**-149: divide by the integer mantissa, then scale by 2**149 in two exact steps (may overflow to inf)
    mant = (_bits(a) & _MANT_MASK).astype(F32)
    sub = (n / jnp.maximum(mant, 1.0)) * _f32(2.0**100) * _f32(2.0**49)
    return jnp.where((_bits(a) & _EXP_MASK) == 0, sub, plain)


def scale_from_amax(a: jax.Array, scaled_max: float, fallback: jax.Array, power_2: bool = False) -> jax.Array:
    """`scaled_max / a` in float32 where `a` is finite and > 0, else `fallback`; the quotient is clamped to
    [SCALE_MIN, FLT_MAX] (an infinite one becomes FLT_MAX); optionally rounded down to a power of two. Elementwise
    on any shape."""
    a = a.astype(F32)
    scale = _divide_by_amax(scaled_max, a)
    scale = jnp.clip(scale, _f32(SCALE_MIN), _f32(FLT_MAX))
    if power_2:
        scale = round_down_pow2(scale)
    return jnp.where(is_positive_finite(a), scale, fallback.astype(F32))


def current_scale(
    x: jax.Array, fp8_max: float, amax_epsilon: float = 0.0, power_2: bool = False, axis_names: tuple = ()
) -> jax.Array:
    """The current-scaling scale of `x` (SPEC section 3) as a float32 scalar."""
    a = amax(x, axis_names)
    if amax_epsilon > 0:
        a = max_nonneg(a, _f32(amax_epsilon))
    return scale_from_amax(a, fp8_max, jnp.ones((), F32), power_2)


# ---- the cast ----------------------------------------------------------------------------------------------

def reciprocal(scale: jax.Array) -> jax.Array:
    """`float32(1 / scale)` correctly rounded for a positive finite normal float32 `scale`, including scales above
    2**126 whose reciprocal is subnormal (built from an integer long division, so no flush to zero)."""
    s = scale.astype(F32)
    plain = _f32(1.0) / s
    b = _bits(s)
    exponent = (b >> 23) & 0xFF
    mant = (b & _MANT_MASK) | 0x00800000  # s = mant * 2**(exponent - 150)
    # 1/s = k * 2**-149 with k = round(2**n / mant), n = 299 - exponent in {45, 46} when exponent >= 253
    q = jnp.uint32(1 << 24) // mant
    r = jnp.uint32(1 << 24) % mant
    last_bits = (299 - 24 - 16 - exponent.astype(jnp.int32)).astype(jnp.uint32)
    for shift in (jnp.uint32(8), jnp.uint32(8), last_bits):
        r = r << shift
        q = (q << shift) + r // mant
        r = r % mant
    twice = r << 1
    k = q + ((twice > mant) | ((twice == mant) & ((q & 1) == 1))).astype(jnp.uint32)
    return jnp.where(exponent >= 253, _float(k), plain)


def mul_scale_inv(x: jax.Array, scale_inv: jax.Array) -> jax.Array:
    """float32(x) * scale_inv with a single rounding also when `scale_inv` is subnormal (a normal result is then
    exact; a result below 2**-126 may still flush to zero on XLA:CPU)."""
    x = x.astype(F32)
    inv = scale_inv.astype(F32)
    plain = x * inv
    b = _bits(inv)
    mant = (b & _MANT_MASK).astype(F32)
    # The barrier keeps XLA from folding the two power-of-two steps into one subnormal constant (2**-149), which
    # XLA:CPU flushes to zero under jit.
    sub = jax.lax.optimization_barrier((x * mant) * _f32(2.0**-100)) * _f32(2.0**-49)
    return jnp.where((b & _EXP_MASK) == 0, sub, plain)


def scaled_float32(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`float32(x) * scale` (one float32 multiply), exact also for subnormal elements of `x`."""
    x32 = x.astype(F32)
    s = scale.astype(F32)
    y = x32 * s
    b = _bits(x32)
    # x = +-m * 2**-149: multiply the integer mantissa, then scale by 2**-149 in exact power-of-two steps
    mant = (b & _MANT_MASK).astype(F32)
    sub = (mant * (s * _f32(2.0**-64))) * _f32(2.0**-85)
    sub = jnp.where((b >> 31) == 1, -sub, sub)
    return jnp.where((b & _EXP_MASK) == 0, sub, y)


def cast_to_fp8(x: jax.Array, scale: jax.Array, fp8_dtype) -> jax.Array:
    """The FP8 values of `saturate(float32(x) * scale)`, rounded to nearest even; `scale` a float32 scalar. A NaN is
    the byte 0x7F whatever its sign, as on a GPU (docs/numerics.md; XLA's CPU conversion keeps the sign and writes
    0x7E for E5M2)."""
    fp8_dtype = jnp.dtype(fp8_dtype)
    fp8_max = _f32(FP8_MAX[fp8_dtype])
    y = scaled_float32(x, scale)
    nan = jnp.isnan(y)
    q = jnp.where(nan, 0, jnp.clip(y, -fp8_max, fp8_max)).astype(fp8_dtype)  # JAX's conversion does not saturate
    return lax.bitcast_convert_type(jnp.where(nan, jnp.uint8(0x7F), lax.bitcast_convert_type(q, jnp.uint8)),
                                    fp8_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8Array:
    """A quantized array: `real ~= float32(data) * scale_inv`.

    Attributes:
      data: the FP8 values, dtype `jnp.float8_e4m3fn` or `jnp.float8_e5m2`, any shape.
      scale_inv: float32 scalar, `float32(1 / scale)` taken at cast time.
      dtype: the nominal high-precision dtype the array stands for (static, not a leaf).
    """

    data: jax.Array
    scale_inv: jax.Array
    dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))

    @property
    def fp8_dtype(self):
        return self.data.dtype

    @property
    def shape(self):
        return self.data.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """`float32(data) * scale_inv`, then converted to `dtype`."""
        return dequantize(self, dtype)


def cast(x: jax.Array, scale: jax.Array, fp8_dtype) -> Float8Array:
    """Quantize with a known float32 scalar scale (no validation; the hot path)."""
    scale = jnp.asarray(scale, F32).reshape(())
    return Float8Array(cast_to_fp8(x, scale, fp8_dtype), reciprocal(scale), jnp.dtype(x.dtype))


def dequantize(q: Float8Array, dtype=jnp.float32) -> jax.Array:
    """`float32(q.data) * q.scale_inv` (SPEC section 1), converted to `dtype` (float32 by default)."""
    if not isinstance(q, Float8Array):
        raise TypeError(f"dequantize: expected a fp8kit.jax.Float8Array, got {type(q).__name__}")
    return mul_scale_inv(q.data.astype(F32), q.scale_inv).astype(dtype)


def _check_input(x: Any, fp8_dtype: Any) -> jnp.dtype:
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"quantize: expected a jax.Array, got {type(x).__name__}")
    dt = jnp.dtype(x.dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"quantize: input must be a float32/bfloat16/float16 array, got dtype {dt}")
    try:
        fp8 = jnp.dtype(fp8_dtype)
    except TypeError:
        fp8 = None
    if fp8 not in FP8_DTYPES:
        raise TypeError(f"quantize: fp8_dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {fp8_dtype!r}")
    return fp8


def _checked_scale(scale: Union[jax.Array, float]) -> jax.Array:
    if isinstance(scale, (jax.Array, np.ndarray)):
        if scale.size != 1 or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(
                f"quantize: scale must be a float or a floating array with one element, got dtype {scale.dtype} "
                f"and shape {tuple(scale.shape)}"
            )
        s = jnp.asarray(scale).reshape(()).astype(F32)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        with np.errstate(over="ignore"):
            s = jnp.asarray(np.float32(scale), F32)
    else:
        raise TypeError(f"quantize: scale must be a float or an array, got {type(scale).__name__}")
    if not isinstance(s, jax.core.Tracer):
        value = float(s)
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"quantize: scale must be finite and > 0 as float32, got {value!r} (from {scale!r})")
    return s


def quantize(
    x: jax.Array,
    fp8_dtype,
    scale: Optional[Union[jax.Array, float]] = None,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
) -> Float8Array:
    """Quantize `x` (float32, bfloat16 or float16, any shape) to FP8.

    With `scale` (a float or a one-element floating array, finite and > 0 in float32) cast as SPEC section 1.
    Without it, apply current scaling (SPEC section 3): `scale = fp8_max / max(amax(x), amax_epsilon)`, 1 when
    that amax is 0, inf or NaN, an infinite result replaced by FLT_MAX, optionally rounded down to a power of two.
    Returns a Float8Array whose `.data` has x's shape and `.scale_inv` is a float32 scalar. Works under `jit`
    (a traced scale is not validated).
    """
    fp8 = _check_input(x, fp8_dtype)
    x = jnp.asarray(x)
    if scale is None:
        eps = float(amax_epsilon)
        if not (eps >= 0 and eps != float("inf")):
            raise ValueError(f"quantize: amax_epsilon must be finite and >= 0, got {amax_epsilon!r}")
        return _quantize_current(x, fp8, eps, bool(power_2_scale))
    return _cast_jit(x, _checked_scale(scale), fp8)


# one executable per shape when called eagerly, instead of one per primitive
_cast_jit = jax.jit(cast, static_argnums=2)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_current(x: jax.Array, fp8_dtype, amax_epsilon: float, power_2: bool) -> Float8Array:
    return cast(x, current_scale(x, FP8_MAX[fp8_dtype], amax_epsilon, power_2), fp8_dtype)
