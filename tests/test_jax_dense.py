"""fp8kit.jax.dense: the FP8 fprop/dgrad/wgrad against float64 GEMMs of the reference casts (tests/reference.py)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as te  # noqa: E402
from fp8kit.jax.state import init_group  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

import reference as ref  # noqa: E402

M, K, N = 24, 32, 16


def _deq(x, fmt, scale):
    data, inv = ref.cast(np.asarray(x, np.float32), fmt, scale)
    return ref.dequantize(data, fmt, inv).astype(np.float64)


def assert_gemm(got, want, bound, what, rel=1e-5):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    err = np.abs(got - want)
    tol = rel * bound + 1e-30
    assert np.all(err <= tol), f"{what}: max excess {np.max(err - tol)}"


def _data(seed=0, x_scale=3.0, k_scale=0.2, c_scale=50.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, K)) * x_scale).astype(np.float32)
    k = (rng.standard_normal((K, N)) * k_scale).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    c = (rng.standard_normal((M, N)) * c_scale).astype(np.float32)
    return x, k, b, c


def _run(recipe, x, k, b, c, fp8_meta=None):
    """(y, dx, dk, db) of sum(dense(x, k, b) * c) under autocast, jitted."""

    def loss(x, k, b):
        y = te.dense(x, k, b, quantizer_set=fp8_meta)
        return jnp.sum(y.astype(jnp.float32) * c), y

    with te.autocast(enabled=True, recipe=recipe):
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, y), (dx, dk, db) = fn(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b))
    return y, dx, dk, db


CASES = [
    dict(fp8_format=Format.HYBRID),
    dict(fp8_format=Format.E4M3),
    dict(fp8_format=Format.E5M2),
    dict(fp8_format=Format.HYBRID, amax_epsilon=100.0, use_power_2_scales=True),
    dict(override_linear_precision=(True, False, False)),
    dict(override_linear_precision=(False, True, True)),
]


@pytest.mark.parametrize("kwargs", CASES, ids=["hybrid", "e4m3", "e5m2", "eps-pow2", "hp-fprop", "hp-dgrad-wgrad"])
def test_current_scaling_gemms(kwargs):
    recipe = Float8CurrentScaling(**kwargs)
    fmt = recipe.fp8_format.value
    x, k, b, c = _data()
    y, dx, dk, db = _run(recipe, x, k, b, c)

    def scale(t, fp8_max):
        return ref.current_scale(ref.amax(t), fp8_max, recipe.amax_epsilon, recipe.use_power_2_scales)

    qx, qk = _deq(x, fmt.fwd, scale(x, fmt.max_fwd)), _deq(k, fmt.fwd, scale(k, fmt.max_fwd))
    qg = _deq(c, fmt.bwd, scale(c, fmt.max_bwd))
    hp = recipe.override_linear_precision
    x64, k64, c64 = x.astype(np.float64), k.astype(np.float64), c.astype(np.float64)
    fx, fk, fg = (x64 if hp[0] else qx), (k64 if hp[0] else qk), None
    assert_gemm(y, fx @ fk + b, np.abs(fx) @ np.abs(fk) + np.abs(b), "y")
    fg, fk = (c64 if hp[1] else qg), (k64 if hp[1] else qk)
    assert_gemm(dx, fg @ fk.T, np.abs(fg) @ np.abs(fk).T, "dx")
    fx, fg = (x64 if hp[2] else qx), (c64 if hp[2] else qg)
    assert_gemm(dk, fx.T @ fg, np.abs(fx).T @ np.abs(fg), "dk")
    np.testing.assert_allclose(db, c64.sum(axis=0), rtol=1e-5)
    # and the FP8 GEMMs are really FP8: far from the float64 product of the unquantized operands
    if not hp[0]:
        assert np.max(np.abs(np.asarray(y) - (x64 @ k64 + b))) > 1e-4


def test_delayed_functional_dense_with_explicit_state():
    recipe = DelayedScaling(amax_history_len=2)
    x, k, b, c = _data(1)
    meta = init_group(recipe)
    meta = {**meta, "x_scale": jnp.array([30.0]), "kernel_scale": jnp.array([500.0]), "grad_scale": jnp.array([0.5])}

    def loss(meta, x, k, b):
        return jnp.sum(te.dense(x, k, b, quantizer_set=meta) * c)

    with te.autocast(enabled=True, recipe=recipe):
        gm, dx, dk, _ = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(meta, jnp.asarray(x), jnp.asarray(k),
                                                                       jnp.asarray(b))
        y = jax.jit(lambda *a: te.dense(*a[:3], quantizer_set=a[3]))(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b),
                                                                        meta)
    qx, qk, qg = _deq(x, "e4m3", 30.0), _deq(k, "e4m3", 500.0), _deq(c, "e5m2", 0.5)
    assert_gemm(y, qx @ qk + b, np.abs(qx) @ np.abs(qk) + np.abs(b), "y")
    assert_gemm(dx, qg @ qk.T, np.abs(qg) @ np.abs(qk).T, "dx")
    assert_gemm(dk, qx.T @ qg, np.abs(qx).T @ np.abs(qg), "dk")
    # the gradient of the state is the updated state
    assert float(gm["x_amax_history"][1]) == ref.amax(x) and float(gm["grad_amax_history"][1]) == ref.amax(c)
    assert np.float32(gm["kernel_scale"][0]) == np.float32(448.0) / ref.amax(k)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_keep_their_dtype(dtype):
    x, k, b, c = _data(2)
    xl = jnp.asarray(x).astype(dtype)
    x32 = np.asarray(xl.astype(jnp.float32))
    c32 = np.asarray(jnp.asarray(c).astype(dtype).astype(jnp.float32))

    def loss(x, k):
        y = te.dense(x, k)
        return jnp.sum((y * jnp.asarray(c).astype(dtype)).astype(jnp.float32)), y

    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        (_, y), (dx, dk) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(xl, jnp.asarray(k))
    assert y.dtype == dtype and dx.dtype == dtype and dk.dtype == jnp.float32
    qx, qk = _deq(x32, "e4m3", ref.current_scale(ref.amax(x32), 448.0)), _deq(k, "e4m3",
                                                                             ref.current_scale(ref.amax(k), 448.0))
    qg = _deq(c32, "e5m2", ref.current_scale(ref.amax(c32), 57344.0))
    rel = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-10  # one rounding to the output dtype
    assert_gemm(y, qx @ qk, np.abs(qx) @ np.abs(qk), "y", rel)
    assert_gemm(dx, qg @ qk.T, np.abs(qg) @ np.abs(qk).T, "dx", rel)
    assert_gemm(dk, qx.T @ qg, np.abs(qx).T @ np.abs(qg), "dk")


def test_contracting_several_axes_and_shapes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    k = rng.standard_normal((4, 5, 6, 2)).astype(np.float32)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y = te.dense(jnp.asarray(x), jnp.asarray(k), contracting_dims=((2, 3), (0, 1)))
        y2 = te.dense(jnp.asarray(x.reshape(6, 20)), jnp.asarray(k.reshape(20, 12)))
        empty = te.dense(jnp.zeros((0, 5)), jnp.ones((5, 3)))
    assert y.shape == (2, 3, 6, 2) and empty.shape == (0, 3)
    np.testing.assert_array_equal(np.asarray(y).reshape(6, 12), np.asarray(y2))
    with pytest.raises(ValueError, match="contract"):
        te.dense(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="bias"):
        te.dense(jnp.ones((2, 3)), jnp.ones((3, 5)), jnp.ones(4))
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="needs its state"):
            te.dense(jnp.ones((2, 3)), jnp.ones((3, 5)))


def test_outside_autocast_is_high_precision():
    x, k, b, _ = _data(4)
    y = te.dense(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b))
    want = x.astype(np.float64) @ k.astype(np.float64) + b
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    with te.autocast(enabled=False, recipe=Float8CurrentScaling()):
        assert not te.is_fp8_enabled() and te.get_recipe() is None
        np.testing.assert_array_equal(te.dense(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b)), y)
        with te.autocast(enabled=True):
            assert isinstance(te.get_recipe(), DelayedScaling)  # None means DelayedScaling()
        with te.fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
            assert isinstance(te.get_recipe(), Float8CurrentScaling)
    assert te.get_recipe() is None
