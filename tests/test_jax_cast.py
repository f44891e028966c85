"""fp8kit.jax.quantize / dequantize against tests/reference.py, byte for byte."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from fp8kit.jax import Float8Array, dequantize, quantize  # noqa: E402
from fp8kit.jax.cast import amax, reciprocal  # noqa: E402

import reference as ref  # noqa: E402

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SCALES = [1.0, 0.5, 3.7, 2.0**-10, 1e-30, 1234.5678, 2.0**40, 2.0**127 * 1.5, float(ref.FLT_MAX)]


@jax.jit
def _bytes_of(data):
    return jax.lax.bitcast_convert_type(data, jnp.uint8)


def _bytes(q: Float8Array) -> np.ndarray:
    return np.asarray(_bytes_of(q.data))


def assert_same_as_reference(x_np32, q, fmt, scale):
    want, want_inv = ref.cast(x_np32, fmt, scale)
    got = _bytes(q)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN included: 0x7F whatever its sign, as the torch side and a GPU
    assert q.scale_inv.dtype == jnp.float32 and q.scale_inv.shape == ()
    assert np.float32(q.scale_inv).view(np.uint32) == want_inv.view(np.uint32)


_quantize_jit = jax.jit(quantize, static_argnums=(1,), static_argnames=("amax_epsilon", "power_2_scale"))


def all_16bit(dtype) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bf16_and_fp16_pattern(fmt):
    for dtype in (ml_dtypes.bfloat16, np.float16):
        x = all_16bit(dtype)
        for scale in SCALES:
            q = _quantize_jit(jnp.asarray(x), FORMATS[fmt], jnp.float32(scale))
            assert q.data.dtype == FORMATS[fmt] and q.dtype == jnp.dtype(dtype)
            assert_same_as_reference(x.astype(np.float32), q, fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_fp32_bit_patterns(fmt):
    # uniform over all float32 bit patterns: every exponent, subnormals, +-inf and NaNs
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for scale in SCALES:
        assert_same_as_reference(x, _quantize_jit(jnp.asarray(x), FORMATS[fmt], jnp.float32(scale)), fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_subnormal_inputs_with_huge_scales(fmt):
    # XLA:CPU flushes subnormal float32 operands; fp8kit must still multiply them exactly
    rng = np.random.default_rng(4)
    x = rng.integers(1, 2**23, size=50_000, dtype=np.uint32).view(np.float32)
    x = np.where(rng.random(x.size) < 0.5, -x, x).astype(np.float32)
    for scale in (2.0**120, 2.0**126 * 1.25, 2.0**127 * 1.9, float(ref.FLT_MAX)):
        assert_same_as_reference(x, _quantize_jit(jnp.asarray(x), FORMATS[fmt], jnp.float32(scale)), fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(fmt):
    dtype = ref.FP8[fmt][0]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.sort(np.unique(values[np.isfinite(values) & (values >= 0)]))
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    x = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), -mids])
    q = quantize(jnp.asarray(x), FORMATS[fmt], 1.0)
    assert_same_as_reference(x, q, fmt, 1.0)
    got = _bytes(q)[: len(mids)]
    lower = finite[:-1].astype(dtype).view(np.uint8)
    upper = finite[1:].astype(dtype).view(np.uint8)
    np.testing.assert_array_equal(got, np.where(lower % 2 == 0, lower, upper))


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_inf_nan(fmt):
    fp8_max = ref.FP8[fmt][1]
    x = np.array([fp8_max * 1.01, -fp8_max * 5, math.inf, -math.inf, math.nan, 2.0**-9, -(2.0**-17)], np.float32)
    q = quantize(jnp.asarray(x), FORMATS[fmt], 1.0)
    out = np.asarray(q.dequantize())
    assert out[0] == fp8_max and out[1] == -fp8_max and out[2] == fp8_max and out[3] == -fp8_max
    assert np.isnan(out[4])
    assert_same_as_reference(x, q, fmt, 1.0)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_shapes_and_dtypes(shape, dtype):
    x = (np.random.default_rng(1).standard_normal(shape) * 10).astype(np.float32)
    xj = jnp.asarray(x).astype(dtype)
    x32 = np.asarray(xj.astype(jnp.float32))
    for fmt, fp8 in FORMATS.items():
        q = quantize(xj, fp8, 2.0)
        assert q.shape == x.shape and q.fp8_dtype == fp8 and q.dtype == jnp.dtype(dtype)
        assert_same_as_reference(x32, q, fmt, 2.0)
        d = dequantize(q, jnp.bfloat16)
        assert d.dtype == jnp.bfloat16 and d.shape == x.shape
        q = quantize(xj, fp8)  # current scaling
        assert_same_as_reference(x32, q, fmt, ref.current_scale(ref.amax(x32), ref.FP8[fmt][1]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_reference(fmt):
    x = (np.random.default_rng(2).standard_normal(4096) * 30).astype(np.float32)
    for scale in (3.3, 2.0**-20, 2.0**100):
        q = quantize(jnp.asarray(x * np.float32(1 / scale)), FORMATS[fmt], scale)
        want_bytes, inv = ref.cast(x * np.float32(1 / scale), fmt, scale)
        np.testing.assert_array_equal(np.asarray(q.dequantize()), ref.dequantize(want_bytes, fmt, inv))


def test_dequantize_with_subnormal_scale_inv():
    # scale > 2**126: scale_inv is subnormal; normal results must still be exact on every backend
    x = (np.random.default_rng(5).standard_normal(2048) * 1e-37).astype(np.float32)
    for fmt in FORMATS:
        for scale in (2.0**127 * 1.3, 2.0**126 * 1.7):
            q = quantize(jnp.asarray(x), FORMATS[fmt], scale)
            want_bytes, inv = ref.cast(x, fmt, scale)
            want = ref.dequantize(want_bytes, fmt, inv)
            got = np.asarray(q.dequantize())
            normal = np.abs(want) >= np.finfo(np.float32).tiny
            assert normal.sum() > 1000
            np.testing.assert_array_equal(got[normal], want[normal])


def test_reciprocal_is_correctly_rounded():
    rng = np.random.default_rng(6)
    s = np.concatenate([
        rng.integers(0x00800000, 0x7F800000, size=100_000, dtype=np.uint32).view(np.float32),
        rng.integers(0x7E800000, 0x7F800000, size=100_000, dtype=np.uint32).view(np.float32),  # > 2**126
        np.array([2.0**126, 2.0**127, ref.FLT_MAX, 1.0, 3.0], np.float32),
    ])
    want = (np.float32(1.0) / s).view(np.uint32)
    got = np.asarray(jax.jit(jax.vmap(reciprocal))(jnp.asarray(s))).view(np.uint32)
    np.testing.assert_array_equal(got, want)


# ---- current scaling -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_matches_reference(fmt, pow2):
    rng = np.random.default_rng(3)
    base = rng.standard_normal(5000).astype(np.float32)
    for eps in (0.0, 1e-3, 10.0):
        for magnitude in (1e-38, 1e-12, 1e-3, 1.0, 1e5, 1e30):
            x = (base * np.float32(magnitude)).astype(np.float32)
            q = _quantize_jit(jnp.asarray(x), FORMATS[fmt], amax_epsilon=eps, power_2_scale=pow2)
            scale = ref.current_scale(ref.amax(x), ref.FP8[fmt][1], eps, pow2)
            assert_same_as_reference(x, q, fmt, scale)
            if pow2:
                m, _ = math.frexp(1.0 / float(np.float32(q.scale_inv)))
                assert m == 0.5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("values", [[0.0, 0.0], [], [math.nan, math.nan], [1.0, math.inf], [-math.inf],
                                    [1e-44, -1e-45], [math.nan, 3.0, -5.0], [-0.0], [1e-39, 3e-39, -2e-39]])
def test_current_scaling_special_amax(fmt, values):
    x = np.array(values, dtype=np.float32)
    q = quantize(jnp.asarray(x), FORMATS[fmt])
    a = ref.amax(x)
    assert np.asarray(amax(jnp.asarray(x))).view(np.uint32) == np.float32(a).view(np.uint32)
    assert_same_as_reference(x, q, fmt, ref.current_scale(a, ref.FP8[fmt][1]))
    s = 1.0 / float(np.float32(q.scale_inv))
    assert math.isfinite(s) and s > 0


def test_current_scaling_edge_scales():
    e4m3 = jnp.float8_e4m3fn
    assert float(quantize(jnp.zeros(4), e4m3).scale_inv) == 1.0
    assert float(quantize(jnp.array([math.inf]), e4m3).scale_inv) == 1.0
    assert float(quantize(jnp.array([math.nan]), e4m3).scale_inv) == 1.0
    q = quantize(jnp.array([1e-44]), e4m3)  # 448 / 1e-44 overflows float32: the scale becomes FLT_MAX
    assert np.float32(q.scale_inv) == np.float32(1.0) / ref.FLT_MAX
    q = quantize(jnp.array([1e-6]), e4m3, amax_epsilon=1.0)
    assert np.float32(q.scale_inv) == np.float32(1.0) / np.float32(448.0)


def test_bf16_input_is_multiplied_in_float32():
    # 1.00390625 * 1.5 = 1.505859375 is exact in float32; in bfloat16 it would round to 1.5078125
    x = jnp.array([1.00390625], dtype=jnp.bfloat16)
    for scale in (1.5 * 128, jnp.float32(1.5 * 128)):
        q = quantize(x, jnp.float8_e4m3fn, scale)
        assert_same_as_reference(np.array([1.00390625], np.float32), q, "e4m3", 1.5 * 128)


def test_under_jit_and_as_pytree():
    x = jnp.linspace(-3, 3, 100)

    @jax.jit
    def f(x, s):
        return quantize(x, jnp.float8_e5m2, s)

    q = f(x, jnp.float32(7.0))
    assert isinstance(q, Float8Array)
    assert_same_as_reference(np.asarray(x), q, "e5m2", 7.0)
    leaves = jax.tree.leaves(q)
    assert len(leaves) == 2


def test_bad_inputs_have_clear_errors():
    x = jnp.ones(4)
    with pytest.raises(TypeError, match="int32"):
        quantize(jnp.arange(4), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize(x.astype(jnp.float8_e4m3fn), jnp.float8_e5m2)
    with pytest.raises(TypeError, match="fp8_dtype"):
        quantize(x, jnp.bfloat16)
    with pytest.raises(TypeError, match="jax.Array"):
        quantize([1.0, 2.0], jnp.float8_e4m3fn)
    for bad in (0.0, -1.0, math.inf, math.nan, 1e39, jnp.float32(0.0), jnp.array([-2.0])):
        with pytest.raises(ValueError, match="scale"):
            quantize(x, jnp.float8_e4m3fn, bad)
    with pytest.raises(TypeError, match="one element"):
        quantize(x, jnp.float8_e4m3fn, jnp.ones(2))
    with pytest.raises(TypeError, match="scale"):
        quantize(x, jnp.float8_e4m3fn, "1.0")
    with pytest.raises(ValueError, match="amax_epsilon"):
        quantize(x, jnp.float8_e4m3fn, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="Float8Array"):
        dequantize(x)


def test_mul_scale_inv_with_a_subnormal_scale_inv_under_jit():
    """A subnormal scale_inv times a value whose product is normal: exact (float64 reference), jitted or not (XLA
    folding the two power-of-two steps into one subnormal constant flushed the product to 0 under jit)."""
    from fp8kit.jax.cast import mul_scale_inv

    rng = np.random.default_rng(3)
    xs = np.float32(2.0) ** rng.integers(30, 60, 64).astype(np.float32) * rng.uniform(1, 2, 64).astype(np.float32)
    inv = (rng.integers(1 << 10, 1 << 23, 64) * 2.0 ** -149).astype(np.float32)  # subnormal, any mantissa
    assert np.all(inv < np.finfo(np.float32).tiny)
    want = (xs.astype(np.float64) * inv.astype(np.float64)).astype(np.float32)
    assert np.all(want >= np.finfo(np.float32).tiny)  # normal products: exact in float32
    for f in (mul_scale_inv, jax.jit(mul_scale_inv)):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(xs), jnp.asarray(inv))), want)
