"""DotProductAttention against a float64 reference built from Transformer Engine's documented mask rules with loops
(tests/attention_reference.py): every mask type, sliding windows, GQA/MQA, sbhd/bshd/thd, packed inputs, biases;
activation recompute bit-identical; bad inputs raise errors naming the argument."""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling

import attention_reference as ref

B, SQ, SKV, H, D = 2, 5, 7, 4, 8


def _qkv(sq=SQ, skv=SKV, h=H, g=H, d=D, fmt="bshd", seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, sq, h, d), (B, skv, g, d), (B, skv, g, d)]
    ts = [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    if fmt == "sbhd":
        ts = [t.transpose(0, 1).contiguous() for t in ts]
    return [t.requires_grad_() for t in ts]


def _batch_first(t, fmt):
    return t.transpose(0, 1) if fmt == "sbhd" else t


def _check(out, q, k, v, allowed, fmt, scale=None, bias=None, atol=2e-6):
    """Output and gradients (for a fixed random upstream gradient) against the float64 reference."""
    qb, kb, vb = (_batch_first(t, fmt) for t in (q, k, v))
    want = ref.attention(qb, kb, vb, allowed, scale, bias)  # [b, sq, h, d]
    b, sq, h, d = want.shape
    want_out = want.reshape(b, sq, h * d)
    got = _batch_first(out, fmt)
    np.testing.assert_allclose(got.detach().numpy(), want_out.detach().numpy(), atol=atol, rtol=1e-5)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    mine = torch.autograd.grad(got, (q, k, v), grad.to(got.dtype))
    theirs = torch.autograd.grad(want_out, (q, k, v), grad)
    for name, a, w in zip("qkv", mine, theirs):
        np.testing.assert_allclose(a.numpy(), w.numpy(), atol=5 * atol, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                                       "padding_causal_bottom_right", "arbitrary"])
@pytest.mark.parametrize("groups", [H, 2, 1])
def test_mask_types_and_gqa_match_the_reference(fmt, mask_type, groups):
    cross = mask_type in ("padding", "padding_causal", "padding_causal_bottom_right")
    sq, skv = (SQ, SKV)
    q, k, v = _qkv(sq, skv, g=groups, fmt=fmt)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask_type,
                                 attention_type="cross" if cross else "self")
    kwargs, pad_q, pad_kv, user = {}, None, None, None
    if "padding" in mask_type:
        pad_q, pad_kv = ref.right_padding([3, 5], sq), ref.right_padding([6, 2], skv)
        kwargs["attention_mask"] = (torch.from_numpy(pad_q).view(B, 1, 1, sq),
                                    torch.from_numpy(pad_kv).view(B, 1, 1, skv))
    if mask_type == "arbitrary":
        user = np.random.default_rng(1).random((B, 1, sq, skv)) < 0.4
        user[0, 0, 2] = True  # a row with nothing to attend
        kwargs["attention_mask"] = torch.from_numpy(user)
    out = dpa(q, k, v, **kwargs)
    assert out.shape == ((sq, B, H * D) if fmt == "sbhd" else (B, sq, H * D))
    allowed = ref.allowed_pairs(B, H, sq, skv, mask_type, pad_q=pad_q, pad_kv=pad_kv, user_mask=user)
    _check(out, q, k, v, allowed, fmt)


@pytest.mark.parametrize("mask_type,window,bottom_right", [
    ("causal", (2, 0), None), ("causal_bottom_right", (1, 0), None), ("no_mask", (1, 2), None),
    ("no_mask", (1, 2), False), ("padding", (0, 1), None), ("padding_causal_bottom_right", (2, 0), None),
    ("arbitrary", (3, 3), True)])
def test_sliding_windows_match_the_reference(mask_type, window, bottom_right):
    q, k, v = _qkv()
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, window_size=window, qkv_format="bshd",
                                 bottom_right_diagonal=bottom_right, attention_type="cross")
    kwargs, pad_q, pad_kv, user = {}, None, None, None
    if "padding" in mask_type:
        pad_q, pad_kv = ref.right_padding([4, 2], SQ), ref.right_padding([7, 3], SKV)
        kwargs["cu_seqlens_q"] = torch.tensor([0, 4, 6], dtype=torch.int32)  # padding given as lengths
        kwargs["cu_seqlens_kv"] = torch.tensor([0, 7, 10], dtype=torch.int32)
    if mask_type == "arbitrary":
        user = np.zeros((SQ, SKV), dtype=bool)
        user[:, 0] = True
        kwargs["attention_mask"] = torch.from_numpy(user)
    out = dpa(q, k, v, **kwargs)
    allowed = ref.allowed_pairs(B, H, SQ, SKV, mask_type, window, bottom_right, pad_q, pad_kv, user)
    _check(out, q, k, v, allowed, "bshd")


def test_unmasked_and_causal_are_torch_sdpa_bit_for_bit():
    """No mask and plain causal go straight to scaled_dot_product_attention (is_causal for causal)."""
    for fmt in ("sbhd", "bshd"):
        q, k, v = _qkv(SQ, SQ, fmt=fmt, dtype=torch.bfloat16)
        qh, kh, vh = (_batch_first(t, fmt).transpose(1, 2) for t in (q, k, v))
        for mask_type, causal in (("no_mask", False), ("causal", True)):
            out = te.DotProductAttention(H, D, qkv_format=fmt, attn_mask_type=mask_type)(q, k, v)
            want = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal).transpose(1, 2).reshape(B, SQ, H * D)
            assert torch.equal(_batch_first(out, fmt), want), (fmt, mask_type)


@pytest.mark.parametrize("padded", [False, True])
def test_thd_packed_sequences_equal_padded_bshd(padded):
    lengths = [3, 6, 1]
    dpa_thd = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    dpa_bshd = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding_causal")
    gen = torch.Generator().manual_seed(3)
    gap = 2 if padded else 0  # unused tokens after each sequence (cu_seqlens_padded)
    starts = np.cumsum([0] + [n + gap for n in lengths])
    tokens = int(starts[-1])
    q = torch.randn(tokens, H, D, generator=gen, requires_grad=True)
    k = torch.randn(tokens, 2, D, generator=gen, requires_grad=True)
    v = torch.randn(tokens, 2, D, generator=gen, requires_grad=True)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    if padded:
        cu_pad = torch.tensor(starts, dtype=torch.int32)
        kwargs.update(cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    out = dpa_thd(q, k, v, **kwargs)
    assert out.shape == (tokens, H * D)
    s = max(lengths)
    dense = [torch.zeros(len(lengths), s, *t.shape[1:], dtype=t.dtype) for t in (q, k, v)]
    for i, (n, st) in enumerate(zip(lengths, starts)):
        for dst, src in zip(dense, (q, k, v)):
            dst[i, :n] = src.detach()[st:st + n]
    mask = torch.from_numpy(ref.right_padding(lengths, s)).view(len(lengths), 1, 1, s)
    want = dpa_bshd(*dense, attention_mask=mask)
    for i, (n, st) in enumerate(zip(lengths, starts)):
        torch.testing.assert_close(out[st:st + n], want[i, :n], rtol=1e-6, atol=1e-6)
        if padded:
            assert torch.equal(out[st + n:st + n + gap], torch.zeros(gap, H * D)), "unused tokens must be zero"
    # against the reference with gradients: gather the sequences out of the packed tensors
    index = torch.tensor([[st + min(p, n - 1) for p in range(s)] for n, st in zip(lengths, starts)])
    qb, kb, vb = q[index], k[index], v[index]
    pad = ref.right_padding(lengths, s)
    allowed = ref.allowed_pairs(len(lengths), H, s, s, "padding_causal", pad_q=pad, pad_kv=pad)
    want_ref = ref.attention(qb, kb, vb, allowed)
    got = out[index].view(len(lengths), s, H, D)
    valid = torch.from_numpy(~pad)
    torch.testing.assert_close(got[valid].double(), want_ref[valid], rtol=1e-5, atol=2e-6)
    g = torch.randn(got.shape, generator=gen, dtype=torch.float64) * valid.view(len(lengths), s, 1, 1)
    mine = torch.autograd.grad(got, (q, k, v), g.float())
    theirs = torch.autograd.grad(want_ref, (q, k, v), g)
    for a, w in zip(mine, theirs):
        torch.testing.assert_close(a.double(), w.double(), rtol=1e-4, atol=1e-5)


def test_packed_qkv_and_kv_inputs_equal_separate_tensors():
    q, k, v = _qkv(SQ, SQ, fmt="sbhd")
    dpa = te.DotProductAttention(H, D)
    want = dpa(q, k, v)
    for dim in (-3, -2):
        packed = torch.stack((q, k, v), dim=dim)
        assert torch.equal(dpa(qkv_layer=packed, qkv_interleave_dim=dim), want)
        assert torch.equal(dpa(q, kv_layer=torch.stack((k, v), dim=dim), qkv_interleave_dim=dim), want)


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias", "alibi"])
def test_attention_biases_match_the_reference(bias_type):
    q, k, v = _qkv()
    scale = 0.3
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal_bottom_right", softmax_scale=scale)
    kwargs, bias = {}, None
    if bias_type != "alibi":
        given = torch.randn(1, H, SQ, SKV, generator=torch.Generator().manual_seed(4))
        kwargs["core_attention_bias"] = given
        bias = given * scale if bias_type == "pre_scale_bias" else given
    else:
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        kwargs["alibi_slopes"] = slopes
        rel = torch.tensor([[abs(i - j + SKV - SQ) for j in range(SKV)] for i in range(SQ)], dtype=torch.float64)
        bias = -slopes.double().view(1, H, 1, 1) * rel
    out = dpa(q, k, v, core_attention_bias_type=bias_type, **kwargs)
    allowed = ref.allowed_pairs(B, H, SQ, SKV, "causal_bottom_right")
    _check(out, q, k, v, allowed, "bshd", scale=scale, bias=bias)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_core_attention_and_te_checkpoint_are_bit_identical(use_reentrant):
    """Gradients with the core recomputed (checkpoint_core_attention) or the whole module under te.checkpoint equal
    those without recompute bit for bit, dropout included (the RNG states are replayed)."""
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=2, attention_dropout=0.3, attn_mask_type="padding_causal",
                                 get_rng_state_tracker=lambda: tracker, qkv_format="bshd", attention_type="cross")
    mask = (torch.from_numpy(ref.right_padding([5, 3], SQ)).view(B, 1, 1, SQ),
            torch.from_numpy(ref.right_padding([7, 4], SKV)).view(B, 1, 1, SKV))
    results = []
    for mode in ("plain", "core", "module"):
        torch.manual_seed(7)
        tracker.set_states({"model-parallel-rng": _fresh_state(1234)})
        q, k, v = _qkv(g=2)
        if mode == "module":
            out = te.checkpoint(dpa, q, k, v, attention_mask=mask, use_reentrant=use_reentrant,
                                get_rng_state_tracker=lambda: tracker)
        else:
            out = dpa(q, k, v, attention_mask=mask, checkpoint_core_attention=mode == "core")
        out.backward(torch.ones_like(out))
        results.append([out.detach(), q.grad, k.grad, v.grad])
    dpa.eval()
    q, k, v = _qkv(g=2)
    assert not torch.equal(dpa(q, k, v, attention_mask=mask), results[0][0]), "the dropout had no effect"
    for mode, got in zip(("core", "module"), results[1:]):
        for a, b in zip(results[0], got):
            assert torch.equal(a, b), mode


def _fresh_state(seed):
    current = torch.get_rng_state()
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    torch.set_rng_state(current)
    return state


def test_dropout_applies_in_training_only_and_deepcopy_keeps_behaviour():
    q, k, v = _qkv(SQ, SQ)
    dpa = te.DotProductAttention(H, D, attention_dropout=0.5, qkv_format="bshd")
    dpa.eval()
    eval_out = dpa(q, k, v)
    clone = copy.deepcopy(dpa)
    assert torch.equal(clone(q, k, v), eval_out)
    dpa.train()
    torch.manual_seed(0)
    train_out = dpa(q, k, v)
    assert not torch.allclose(train_out, eval_out)
    torch.manual_seed(0)
    assert torch.equal(copy.deepcopy(dpa)(q, k, v), train_out)


def test_runs_in_high_precision_inside_fp8_autocast():
    q, k, v = _qkv(SQ, SQ)
    dpa = te.DotProductAttention(H, D)
    with te.autocast(recipe=DelayedScaling()):
        inside = dpa(q, k, v)
    assert torch.equal(inside, dpa(q, k, v))
    with pytest.raises(NotImplementedError, match="FP8 attention"):
        dpa(q, k, v, fp8_output=True)
    with pytest.raises(NotImplementedError, match="fp8_dpa"):
        DelayedScaling(fp8_dpa=True)


def test_bad_inputs_raise_errors_naming_the_argument():
    q, k, v = _qkv(SQ, SQ)
    with pytest.raises(ValueError, match="num_gqa_groups=3 must divide num_attention_heads=4"):
        te.DotProductAttention(4, D, num_gqa_groups=3)
    with pytest.raises(ValueError, match="qkv_format must be one of 'sbhd', 'bshd', 'thd'; got 'bhsd'"):
        te.DotProductAttention(H, D, qkv_format="bhsd")
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        te.DotProductAttention(H, D, attn_mask_type="diagonal")
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"attention_mask: a padding mask has shape \[batch, 1, 1, seqlen\]"):
        dpa(q, k, v, attention_mask=torch.zeros(B, SQ, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask must be a boolean tensor"):
        dpa(q, k, v, attention_mask=torch.zeros(B, 1, 1, SQ))
    with pytest.raises(ValueError, match="needs attention_mask"):
        dpa(q, k, v)
    with pytest.raises(ValueError, match=r"attention_mask of shape \[3, 5\] is not broadcastable"):
        dpa(q, k, v, attn_mask_type="arbitrary", attention_mask=torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        dpa(q, k, v, qkv_format="sbdh")
    with pytest.raises(ValueError, match="query_layer has 4 heads, expected num_attention_heads = 2"):
        te.DotProductAttention(2, D, qkv_format="bshd")(q, k, v)
    with pytest.raises(ValueError, match="window_size must be"):
        te.DotProductAttention(H, D, attn_mask_type="causal", window_size=(-2, 0))
    with pytest.raises(ValueError, match="qkv_format='thd' needs a padding attn_mask_type"):
        te.DotProductAttention(H, D, qkv_format="thd")(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="max_seqlen=2 is shorter than the longest sequence"):
        te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), max_seqlen_q=2)
    with pytest.raises(ValueError, match="cu_seqlens_q / cu_seqlens_kv describe padding"):
        te.DotProductAttention(H, D, qkv_format="bshd")(q, k, v, cu_seqlens_q=torch.tensor([0, 5, 10]))
    with pytest.raises(NotImplementedError, match="softmax_type"):
        te.DotProductAttention(H, D, softmax_type="off-by-one")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert te.DotProductAttention(H, D, window_size=(-1, -1)).window_size == (-1, 0)
    assert any("becomes (-1, 0)" in str(w.message) for w in caught)


def test_bias_combines_with_padding_of_another_batch_shape():
    """A [1, h, sq, skv] bias with a [b, 1, sq, skv] padding mask: both broadcast."""
    q, k, v = _qkv()
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding", attention_type="cross")
    pad_q, pad_kv = ref.right_padding([5, 2], SQ), ref.right_padding([4, 7], SKV)
    bias = torch.randn(1, H, SQ, SKV, generator=torch.Generator().manual_seed(8))
    out = dpa(q, k, v, attention_mask=(torch.from_numpy(pad_q).view(B, 1, 1, SQ),
                                       torch.from_numpy(pad_kv).view(B, 1, 1, SKV)),
              core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    allowed = ref.allowed_pairs(B, H, SQ, SKV, "padding", pad_q=pad_q, pad_kv=pad_kv)
    _check(out, q, k, v, allowed, "bshd", bias=bias)
