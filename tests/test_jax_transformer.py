"""MultiHeadAttention and TransformerLayer against float64 NumPy written from the same parameters (high precision),
their parameter layout, their FP8 state after a delayed-scaling step, and one compilation across training steps."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from test_jax_attention import ref_attention  # noqa: E402

import fp8kit.jax as te  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
from fp8kit.jax.flax.transformer import relative_position_buckets  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

import reference as ref  # noqa: E402

B, S, HIDDEN, HEADS, MLP = 2, 6, 32, 4, 48
D = HIDDEN // HEADS


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(tree))


def ref_layernorm(x, scale, bias, eps):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * scale + bias


def _gelu(v):
    return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))


def ref_mha(p, x, keep, heads, groups, fused, bias=None, eps=1e-6):
    """Self-attention from the parameters: LayerNorm, projections, attention (logits unscaled), output."""
    first = p["qkv"] if fused else p["query"]
    ln = ref_layernorm(x, first["scale"], first["ln_bias"], eps)
    b, s, _ = x.shape
    if fused:
        qkv = np.einsum("bsi,ijo->bsjo", ln, p["qkv"]["kernel"]).reshape(b, s, 3, heads, D)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = (ln @ p["query"]["kernel"]).reshape(b, s, heads, D)
        if "kv" in p:
            kv = np.einsum("bsi,ijo->bsjo", ln, p["kv"]["kernel"])
            k, v = kv[:, :, 0].reshape(b, s, groups, D), kv[:, :, 1].reshape(b, s, groups, D)
        else:
            k = (ln @ p["key"]["kernel"]).reshape(b, s, groups, D)
            v = (ln @ p["value"]["kernel"]).reshape(b, s, groups, D)
    ctx = ref_attention(q, k, v, keep=keep, bias=bias, bias_type="post_scale_bias" if bias is not None else "no_bias",
                        scale=1.0)
    return ctx.reshape(b, s, heads * D) @ p["out"]["kernel"]


def ref_transformer_layer(p, x):
    """TransformerLayer defaults: relative position biases, causal self-attention, residual, LayerNorm-GELU MLP."""
    table = p["relpos_bias"]["rel_embedding"]
    bias = table[:, relative_position_buckets(S, S, 32, 128, True)][None]
    keep = np.tril(np.ones((S, S), bool))[None, None]
    h = x + ref_mha(p["attention"], x, keep, HEADS, HEADS, True, bias)
    m = p["mlp"]
    y = ref_layernorm(h, m["scale"], m["ln_bias"], 1e-6)
    inner = _gelu(np.einsum("bsi,ijo->bsjo", y, m["wi_kernel"]))[:, :, 0]
    return h + inner @ m["wo_kernel"]


def _x(seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, S, HIDDEN)), jnp.float32)


LAYER = te_flax.TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS)


def test_transformer_layer_matches_float64_from_its_parameters():
    x = _x()
    variables = jax.jit(LAYER.init, static_argnames="deterministic")(jax.random.PRNGKey(0), x, deterministic=True)
    shapes = jax.tree.map(np.shape, nn.unbox(variables))["params"]
    assert shapes == {  # Transformer Engine's layout
        "relpos_bias": {"rel_embedding": (HEADS, 32)},
        "attention": {"qkv": {"scale": (HIDDEN,), "ln_bias": (HIDDEN,), "kernel": (HIDDEN, 3, HIDDEN)},
                      "out": {"kernel": (HIDDEN, HIDDEN)}},
        "mlp": {"scale": (HIDDEN,), "ln_bias": (HIDDEN,), "wi_kernel": (HIDDEN, 1, MLP), "wo_kernel": (MLP, HIDDEN)},
    }
    got = jax.jit(LAYER.apply, static_argnames="deterministic")(variables, x, deterministic=True)
    want = ref_transformer_layer(_np(variables)["params"], np.asarray(x, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    kernel = np.asarray(nn.unbox(variables)["params"]["attention"]["qkv"]["kernel"])
    # the query part is initialized divided by sqrt(head_dim) (scaled_query_init); fan-in normal otherwise
    assert abs(kernel[:, 1].std() * math.sqrt(HIDDEN) - 1) < 0.15
    assert abs(kernel[:, 0].std() * math.sqrt(HIDDEN) * math.sqrt(D) - 1) < 0.15


@pytest.mark.parametrize("groups,fuse", [(2, True), pytest.param(HEADS, False, marks=pytest.mark.slow)])
def test_mha_gqa_and_unfused_projections(groups, fuse):
    mha = te_flax.MultiHeadAttention(head_dim=D, num_attention_heads=HEADS, num_gqa_groups=groups,
                                     fuse_qkv_params=fuse, attn_mask_type="causal")
    x = _x(1)
    variables = jax.jit(lambda: mha.init(jax.random.PRNGKey(1), x, x, deterministic=True))()
    names = set(nn.unbox(variables)["params"])
    assert names == ({"query", "kv", "out"} if fuse else {"query", "key", "value", "out"})
    out, ln_out = jax.jit(lambda v: mha.apply(v, x, x, deterministic=True))(variables)
    keep = np.tril(np.ones((S, S), bool))[None, None]
    want = ref_mha(_np(variables)["params"], np.asarray(x, np.float64), keep, HEADS, groups, False)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    p = _np(variables)["params"]["query"]
    np.testing.assert_allclose(ln_out, ref_layernorm(np.asarray(x, np.float64), p["scale"], p["ln_bias"], 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_transformer_layer_fp8_steps_state_numbers_and_one_compilation():
    x = _x(2)
    traces = []
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        variables = jax.jit(LAYER.init, static_argnames="deterministic")(jax.random.PRNGKey(2), x,
                                                                          deterministic=True)
        names = jax.tree.map(np.shape, variables["fp8_metas"])
        assert set(names) == {"attention", "mlp"} and set(names["attention"]) == {"qkv", "out"}
        assert set(names["mlp"]) == {f"{t}_{i}_{k}" for t in ("x", "kernel", "grad") for i in (0, 1)
                                     for k in ("scale", "amax_history")}

        @jax.jit
        def step(v, x):
            traces.append(1)

            def loss(vv):
                y = LAYER.apply(vv, x, deterministic=True)
                return jnp.sum(y * y), y

            (_, y), grads = jax.value_and_grad(loss, has_aux=True)(v)
            params, metas = te.split_grads(grads, v["fp8_metas"])
            new = {"params": jax.tree.map(lambda a, g: a - 1e-4 * g, v["params"], params), "fp8_metas": metas}
            return y, metas, new

        y, metas, after = step(variables, x)
        for i in range(2):
            after = step(after, x * (i + 2))[2]
    assert len(traces) == 1 and step._cache_size() == 1  # one compilation for all steps
    assert float(after["fp8_metas"]["attention"]["qkv"]["x_scale"][0]) != 1.0
    hp = LAYER.apply(variables, x, deterministic=True)
    err = float(jnp.linalg.norm(y - hp) / jnp.linalg.norm(hp))
    assert 1e-4 < err < 0.05, err  # FP8 GEMMs, close to high precision
    p = _np(variables)["params"]
    # the first GEMM sees the LayerNorm output, the same in FP8 as in high precision; kernels are exact
    ln = ref_layernorm(np.asarray(x, np.float64), p["attention"]["qkv"]["scale"], p["attention"]["qkv"]["ln_bias"],
                       1e-6)
    assert abs(float(metas["attention"]["qkv"]["x_amax_history"][-1]) / ref.amax(ln) - 1) < 1e-5
    kernels = {("attention", "qkv", "kernel_amax_history"): p["attention"]["qkv"]["kernel"],
               ("attention", "out", "kernel_amax_history"): p["attention"]["out"]["kernel"],
               ("mlp", "kernel_0_amax_history"): p["mlp"]["wi_kernel"],
               ("mlp", "kernel_1_amax_history"): p["mlp"]["wo_kernel"]}
    for path, kernel in kernels.items():
        group = metas
        for key in path:
            group = group[key]
        assert float(group[-1]) == ref.amax(np.asarray(kernel, np.float32)), path
    histories = [g for g in jax.tree.leaves(metas) if g.shape == (4,)]
    assert len(histories) == 12 and all(float(h[-1]) > 0 for h in histories)  # every GEMM of the layer was updated
