"""DotProductAttention (high precision) against float64 NumPy attention and flax's dot_product_attention; rotary
embeddings against complex rotation; T5 relative position buckets against the formula written out."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax.flax as te_flax  # noqa: E402
from fp8kit.jax.flax.mha import rotary_pos_emb  # noqa: E402
from fp8kit.jax.flax.transformer import relative_position_buckets  # noqa: E402

B, SQ, H, D = 2, 7, 4, 8


def _qkv(hkv=H, skv=SQ, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, SQ, H, D)).astype(np.float32)
    k = rng.standard_normal((B, skv, hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, skv, hkv, D)).astype(np.float32)
    return q, k, v


def ref_attention(q, k, v, keep=None, bias=None, bias_type="no_bias", scale=None, extra_logit=None):
    """float64 softmax attention; GQA by repeating key/value heads; `extra_logit` [h] joins each denominator."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if bias_type == "pre_scale_bias":
        logits = (logits + bias) * scale
    elif bias_type == "post_scale_bias":
        logits = logits * scale + bias
    else:
        logits = logits * scale
    if keep is not None:
        logits = np.where(keep, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    e = np.exp(logits - top)
    denom = e.sum(-1, keepdims=True)
    if extra_logit is not None:
        denom = denom + np.exp(np.asarray(extra_logit, np.float64)[None, :, None, None] - top)
    return np.einsum("bhqk,bkhd->bqhd", e / denom, v)


def _run(q, k, v, mask=None, bias=None, **kw):
    dpa = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, **kw)
    args = [jnp.asarray(q), None if k is None else jnp.asarray(k), None if v is None else jnp.asarray(v)]
    return jax.jit(lambda *a: dpa.apply({}, *a, mask, bias, deterministic=True))(*args)


def _tril(sq, skv, offset=0):
    return np.arange(skv)[None, :] <= np.arange(sq)[:, None] + offset


def test_matches_flax_dot_product_attention_bit_for_bit():
    q, k, v = _qkv()
    lengths = np.array([7, 4])
    pad = (np.arange(SQ)[None, :] < lengths[:, None])
    keep = pad[:, None, :, None] & pad[:, None, None, :] & _tril(SQ, SQ)[None, None]
    want = nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(keep))
    got = _run(q, k, v, mask=jnp.asarray(~keep), attn_mask_type="padding_causal")
    np.testing.assert_array_equal(got, want)
    causal = nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      mask=jnp.asarray(_tril(SQ, SQ)[None, None]))
    np.testing.assert_array_equal(_run(q, k, v, attn_mask_type="causal"), causal)


CASES = {
    "causal-gqa": dict(hkv=2, kw=dict(attn_mask_type="causal", num_gqa_groups=2), keep=lambda: _tril(SQ, SQ)),
    "mqa-no-mask": dict(hkv=1, kw=dict(attn_mask_type="no_mask", num_gqa_groups=1), keep=lambda: None),
    "sliding-window": dict(hkv=H, kw=dict(attn_mask_type="causal", window_size=(2, 0)),
                           keep=lambda: _tril(SQ, SQ) & (np.arange(SQ)[None, :] >= np.arange(SQ)[:, None] - 2)),
    "bottom-right": dict(hkv=H, skv=10, kw=dict(attn_mask_type="causal_bottom_right"),
                         keep=lambda: _tril(SQ, 10, 3)),
    "scale": dict(hkv=H, kw=dict(attn_mask_type="no_mask", scale_factor=0.9), keep=lambda: None, scale=0.9),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_masks_gqa_and_scales_against_float64(case):
    spec = CASES[case]
    q, k, v = _qkv(spec["hkv"], spec.get("skv", SQ))
    got = _run(q, k, v, **spec["kw"])
    want = ref_attention(q, k, v, keep=spec["keep"](), scale=spec.get("scale"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
def test_bias_types_and_padding_mask(bias_type):
    q, k, v = _qkv(seed=1)
    bias = np.random.default_rng(5).standard_normal((1, H, SQ, SQ)).astype(np.float32)
    lengths = np.array([5, 7])
    pad = (np.arange(SQ)[None, :] < lengths[:, None])[:, None, None, :]  # mask keys past each length
    got = _run(q, k, v, mask=jnp.asarray(~pad), bias=jnp.asarray(bias), attn_mask_type="padding",
               attn_bias_type=bias_type)
    want = ref_attention(q, k, v, keep=pad, bias=bias, bias_type=bias_type)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="needs a mask"):
        _run(q, k, v, attn_mask_type="padding")


def test_softmax_variants_and_layouts():
    q, k, v = _qkv(seed=2)
    np.testing.assert_allclose(_run(q, k, v, attn_mask_type="no_mask", softmax_type="off-by-one"),
                               ref_attention(q, k, v, extra_logit=np.zeros(H)), rtol=2e-5, atol=2e-5)
    dpa = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, attn_mask_type="no_mask",
                                      softmax_type="learnable")
    variables = dpa.init(jax.random.PRNGKey(0), q, k, v, deterministic=True)
    offset = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    variables = {"params": {"_UnfusedDotProductAttention_0": {"softmax_offset": jnp.asarray(offset)[None, :, None,
                                                                                                      None]}}}
    np.testing.assert_allclose(dpa.apply(variables, q, k, v, deterministic=True),
                               ref_attention(q, k, v, extra_logit=offset), rtol=2e-5, atol=2e-5)
    separate = _run(q, k, v, attn_mask_type="causal")
    packed = _run(np.stack([q, k, v], axis=2), None, None, attn_mask_type="causal", qkv_layout="bs3hd")
    kv_packed = _run(q, np.stack([k, v], axis=2), None, attn_mask_type="causal", qkv_layout="bshd_bs2hd")
    seq_first = _run(*(np.swapaxes(t, 0, 1) for t in (q, k, v)), attn_mask_type="causal",
                     transpose_batch_sequence=True)
    np.testing.assert_array_equal(packed, separate)
    np.testing.assert_array_equal(kv_packed, separate)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(seq_first), 0, 1), separate)
    with pytest.raises(NotImplementedError, match="THD"):
        _run(q, k, v, qkv_layout="thd_thd_thd")
    with pytest.raises(NotImplementedError, match="score_mod"):
        _run(q, k, v, score_mod=lambda s: s)


@pytest.mark.slow
def test_dropout_is_unbiased_and_needs_an_rng():
    q, k, v = _qkv(seed=3)
    dpa = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, attention_dropout=0.3)
    plain = dpa.apply({}, q, k, v, deterministic=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 128)
    runs = jax.jit(jax.vmap(lambda key: dpa.apply({}, q, k, v, deterministic=False, rngs={"dropout": key})))(keys)
    assert float(jnp.max(jnp.abs(runs[0] - plain))) > 1e-2  # dropout happened
    err = np.abs(np.asarray(runs.mean(0)) - np.asarray(plain)).mean() / np.abs(np.asarray(plain)).mean()
    assert err < 0.12, err  # without the 1/keep_prob rescaling it would be about 0.3
    with pytest.raises(Exception, match="dropout"):
        dpa.apply({}, q, k, v, deterministic=False)


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
def test_rotary_embedding_is_a_complex_rotation(method):
    x = np.random.default_rng(4).standard_normal((2, 5, 3, 8)).astype(np.float32)  # [b, s, h, d]
    got = np.asarray(rotary_pos_emb(jnp.asarray(x), (1, 10000), False, method))
    if method == "consecutive":
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., :4] + 1j * x[..., 4:]
    angle = np.arange(5)[None, :, None, None] / (10000.0 ** (2 * np.arange(4) / 8))
    r = z.astype(np.complex128) * np.exp(1j * angle)
    want = np.stack([r.real, r.imag], -1).reshape(x.shape) if method == "consecutive" else \
        np.concatenate([r.real, r.imag], -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    seq_first = rotary_pos_emb(jnp.asarray(np.swapaxes(x, 0, 1)), (1, 10000), True, method)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(seq_first), 0, 1), got)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets(bidirectional):
    num_buckets, max_distance = 32, 128

    def bucket(q, k):  # the T5 rule, one pair at a time
        n, out, buckets = q - k, 0, num_buckets
        if bidirectional:
            buckets //= 2
            out += buckets if n < 0 else 0
            n = abs(n)
        else:
            n = max(n, 0)
        exact = buckets // 2
        if n < exact:
            return out + n
        large = exact + int(math.log(n / exact + np.finfo(np.float32).eps) / math.log(max_distance / exact)
                            * (buckets - exact))
        return out + min(large, buckets - 1)

    got = relative_position_buckets(40, 300, num_buckets, max_distance, bidirectional)
    want = np.array([[bucket(q, k) for k in range(300)] for q in range(40)])
    np.testing.assert_array_equal(got, want)
    rpb = te_flax.RelativePositionBiases(num_buckets=num_buckets, max_distance=max_distance, num_attention_heads=3)
    variables = rpb.init(jax.random.PRNGKey(0), 5, 6, bidirectional)
    table = np.asarray(nn.unbox(variables)["params"]["rel_embedding"])
    out = rpb.apply(variables, 5, 6, bidirectional)
    assert out.shape == (1, 3, 5, 6)
    np.testing.assert_array_equal(out[0], table[:, relative_position_buckets(5, 6, 32, 128, bidirectional)])
