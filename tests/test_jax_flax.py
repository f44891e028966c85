"""The Flax layers of fp8kit.jax.flax: the seed's usage, parameter and fp8_metas layout, and the LayerNorm layers
against float64 NumPy math."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as te  # noqa: E402
from fp8kit.jax.flax import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

import reference as ref  # noqa: E402


def _shapes(tree):
    return jax.tree.map(lambda a: tuple(a.shape), nn.unbox(tree))


def test_seed_current_scaling_example():
    # SPEC seeds 002: the JAX example, with smaller sizes
    recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)
    with te.autocast(enabled=True, recipe=recipe):
        layer = DenseGeneral(features=64)
        key = jax.random.PRNGKey(0)
        x = jax.random.normal(key, (4, 16, 32), dtype=jnp.bfloat16)
        var_collect = layer.init(key, x)

        def loss_fn(var_collect):
            output = layer.apply(var_collect, x)
            return output.sum()

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(var_collect)
    assert set(var_collect) == {"params"}  # current scaling adds no variables
    assert _shapes(grads) == {"params": {"kernel": (32, 64), "bias": (64,)}}
    assert loss.dtype == jnp.bfloat16 and np.isfinite(float(loss))
    # the bias gradient is the number of rows (dy = 1)
    np.testing.assert_array_equal(grads["params"]["bias"], np.full(64, 64.0, np.float32))


def test_fp8_metas_layout_of_every_layer():
    recipe = DelayedScaling(amax_history_len=5)
    x = jnp.ones((2, 3, 8))
    key = jax.random.PRNGKey(0)
    with te.autocast(enabled=True, recipe=recipe):
        dense = jax.jit(DenseGeneral(features=(4, 2), kernel_init=nn.initializers.ones).init)(key, x)
        ln_dense = jax.eval_shape(LayerNormDenseGeneral(features=4).init, key, x)
        mlp_layer = LayerNormMLP(intermediate_dim=6, activations=("linear", "gelu"), use_bias=True)
        mlp = jax.eval_shape(lambda: mlp_layer.init(key, x, deterministic=True))

    def metas(postfix):
        out = {}
        for t in ("x", "kernel", "grad"):
            out[f"{t}{postfix}_scale"] = (1,)
            out[f"{t}{postfix}_amax_history"] = (5,)
        return out

    assert _shapes(dense) == {"params": {"kernel": (8, 4, 2), "bias": (4, 2)}, "fp8_metas": metas("")}
    assert _shapes(ln_dense) == {"params": {"scale": (8,), "ln_bias": (8,), "kernel": (8, 4)}, "fp8_metas": metas("")}
    assert _shapes(mlp) == {
        "params": {"scale": (8,), "ln_bias": (8,), "wi_kernel": (8, 2, 6), "wi_bias": (2, 6), "wo_kernel": (6, 8),
                   "wo_bias": (8,)},
        "fp8_metas": {**metas("_0"), **metas("_1")},
    }
    for leaf_name, leaf in dense["fp8_metas"].items():
        want = 1.0 if leaf_name.endswith("_scale") else 0.0
        assert leaf.dtype == jnp.float32 and np.all(np.asarray(leaf) == want)
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=2, interval=4)):
        v = jax.eval_shape(DenseGeneral(features=3).init, key, x)
    assert _shapes(v["fp8_metas"])["update_count"] == (1,)  # the forward state's count
    assert _shapes(v["fp8_metas"])["grad_update_count"] == (1,)  # the backward state's count


def test_dense_general_matches_flax_outside_autocast_and_in_fp8():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 4, 6)), jnp.float32)
    layer = DenseGeneral(features=(7, 2), axis=(1, -1))
    theirs = nn.DenseGeneral(features=(7, 2), axis=(1, -1))
    v = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
    assert v["params"]["kernel"].shape == (5, 6, 7, 2)
    std = float(jnp.std(v["params"]["kernel"]))  # fan-in counts both contracted axes: 1 / sqrt(30)
    assert abs(std * np.sqrt(30.0) - 1.0) < 0.2
    want = jax.jit(theirs.apply)(v, x)
    np.testing.assert_allclose(jax.jit(layer.apply)(v, x), want, rtol=1e-5, atol=1e-5)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y = jax.jit(layer.apply)(v, x)
    err = np.linalg.norm(np.asarray(y) - np.asarray(want)) / np.linalg.norm(np.asarray(want))
    assert 1e-4 < err < 0.06  # FP8, but close


def _layernorm64(x, gamma, beta, kind, eps, zero_centered):
    x = np.asarray(x, np.float64)
    g = np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0)
    if kind == "layernorm":
        mu = x.mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + np.asarray(beta, np.float64)
    else:
        y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g
    return y


@pytest.mark.parametrize("kind,zero_centered", [("layernorm", False),
                                                pytest.param("rmsnorm", True, marks=pytest.mark.slow)])
def test_layernorm_dense_general(kind, zero_centered):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 6, 16)) * 3 + 1, jnp.float32)
    layer = LayerNormDenseGeneral(features=8, layernorm_type=kind, zero_centered_gamma=zero_centered, use_bias=True,
                                  scale_init=nn.initializers.normal(0.5), ln_bias_init=nn.initializers.normal(0.5),
                                  return_layernorm_output=True)
    recipe = DelayedScaling(amax_history_len=4)
    c = jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32)
    with te.autocast(enabled=True, recipe=recipe):
        v = nn.unbox(jax.jit(layer.init)(jax.random.PRNGKey(2), x))
        assert ("ln_bias" in v["params"]) == (kind == "layernorm")
        p = v["params"]

        def loss(v):
            out, ln_out = layer.apply(v, x)
            return jnp.sum(out * c), (out, ln_out)

        (_, (out, ln_out)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(v)
    ln64 = _layernorm64(x, p["scale"], p.get("ln_bias", 0.0), kind, 1e-6, zero_centered)
    np.testing.assert_allclose(ln_out, ln64, rtol=1e-4, atol=1e-4)
    # FP8 GEMM on the layer's own normalized input, with the first step's scales (1)
    qx = ref.dequantize(ref.cast(np.asarray(ln_out), "e4m3", 1.0)[0], "e4m3", 1.0).astype(np.float64)
    qk = ref.dequantize(ref.cast(np.asarray(p["kernel"]), "e4m3", 1.0)[0], "e4m3", 1.0).astype(np.float64)
    np.testing.assert_allclose(out, qx @ qk + np.asarray(p["bias"]), rtol=1e-5, atol=1e-5)
    metas = grads["fp8_metas"]
    assert float(metas["x_amax_history"][-1]) == ref.amax(np.asarray(ln_out))
    assert float(metas["kernel_amax_history"][-1]) == ref.amax(np.asarray(p["kernel"]))
    assert float(metas["grad_amax_history"][-1]) == ref.amax(np.asarray(c))
    assert set(grads["params"]) == set(p)
    no_ln_out = LayerNormDenseGeneral(features=8, layernorm_type=kind)  # Transformer Engine's default: no ln_output
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        out, none = jax.eval_shape(lambda: no_ln_out.apply(no_ln_out.init(jax.random.PRNGKey(2), x), x))
    assert none is None and out.shape == (4, 6, 8)


def _mlp64(x, p, acts):
    ln = _layernorm64(x, p["scale"], p["ln_bias"], "layernorm", 1e-6, False)
    h = np.einsum("...d,dai->...ai", ln, np.asarray(p["wi_kernel"], np.float64)) + np.asarray(p["wi_bias"])
    fns = {"gelu": lambda v: np.asarray(jax.nn.gelu(jnp.asarray(v, jnp.float32)), np.float64),
           "linear": lambda v: v, "relu": lambda v: np.maximum(v, 0)}
    z = np.prod([fns[a](h[..., i, :]) for i, a in enumerate(acts)], axis=0)
    return z @ np.asarray(p["wo_kernel"], np.float64) + np.asarray(p["wo_bias"])


@pytest.mark.parametrize("acts", [("gelu", "linear"), pytest.param(("relu",), marks=pytest.mark.slow)])
def test_layernorm_mlp(acts):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    layer = LayerNormMLP(intermediate_dim=32, activations=acts, use_bias=True, bias_init=nn.initializers.normal(0.1),
                         return_layernorm_output=True, intermediate_dropout_rate=0.1)
    c = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    recipe = DelayedScaling(amax_history_len=4)  # long enough that the history holds every step's amax
    with te.autocast(enabled=True, recipe=recipe):
        v = nn.unbox(jax.jit(layer.init, static_argnames="deterministic")(jax.random.PRNGKey(3), x,
                                                                          deterministic=True))

        @jax.jit
        def step(v):
            def loss(v):
                out, ln_out = layer.apply(v, x, deterministic=True)
                return jnp.sum(out * c), (out, ln_out)

            (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(v)
            return aux, te.split_grads(grads, v["fp8_metas"])

        for _ in range(3):  # from the second step the scales come from the history
            (out, ln_out), (pgrads, metas) = step(v)
            v = {"params": v["params"], "fp8_metas": metas}
        with pytest.raises(Exception, match="dropout"):
            jax.eval_shape(layer.apply, v, x)  # dropout (rate 0.1 here; 0 by default) needs an rng
        jax.eval_shape(lambda: layer.apply(v, x, rngs={"dropout": jax.random.PRNGKey(5)}))
    want = _mlp64(x, v["params"], acts)
    err = np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want)
    assert err < 0.08
    assert float(metas["x_0_amax_history"][-1]) == ref.amax(np.asarray(ln_out))
    assert float(metas["kernel_0_amax_history"][-1]) == ref.amax(np.asarray(v["params"]["wi_kernel"]))
    assert float(metas["kernel_1_amax_history"][-1]) == ref.amax(np.asarray(v["params"]["wo_kernel"]))
    assert float(metas["grad_1_amax_history"][-1]) == ref.amax(np.asarray(c))
    for name in ("x_1", "grad_0"):
        assert float(metas[f"{name}_amax_history"][-1]) > 0
        assert np.float32(metas[f"{name}_scale"][0]) == np.float32(
            (448.0 if name == "x_1" else 57344.0) / np.max(np.asarray(metas[f"{name}_amax_history"])))
    assert set(pgrads) == set(v["params"])
