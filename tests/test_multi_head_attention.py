"""MultiheadAttention: equal to a block of torch ops with the same weights (bit for bit where the same ops run), TE's
QKV layouts (split parameters, fused, interleaved), cross-attention, RoPE; under FP8 its projections are FP8 GEMMs
with Transformer Engine's state slots (checked against tests/reference.py casts); recompute and copies."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.pytorch.attention import apply_rotary_pos_emb
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import attention_reference as ref
from linear_helpers import assert_gemm_close, deq, np32

S, B, HID, H = 6, 2, 32, 4
D = HID // H


def _randomize(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.3
            p.copy_(noise + (1.0 if name.endswith("layer_norm_weight") else 0.0))


def _sdpa(q, k, v, causal=True, mask=None):
    """q [b, s, h, d] (batch-first) through torch's SDPA."""
    groups = k.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, enable_gqa=groups != q.shape[2])
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("groups", [H, 2])
def test_self_attention_equals_torch_ops_bit_for_bit(fmt, groups):
    mha = te.MultiheadAttention(HID, H, num_gqa_groups=groups, input_layernorm=True, attention_dropout=0.0,
                                qkv_format=fmt, return_layernorm_output=True)
    _randomize(mha)
    names = [n for n, _ in mha.named_parameters()]
    assert names == ["layernorm_qkv.layer_norm_weight", "layernorm_qkv.layer_norm_bias",
                     "layernorm_qkv.query_weight", "layernorm_qkv.key_weight", "layernorm_qkv.value_weight",
                     "layernorm_qkv.query_bias", "layernorm_qkv.key_bias", "layernorm_qkv.value_bias",
                     "proj.weight", "proj.bias"]
    x = torch.randn(S, B, HID) if fmt == "sbhd" else torch.randn(B, S, HID)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ln_out = mha(xa)
    p = dict(mha.named_parameters())
    ln = F.layer_norm(xb, (HID,), p["layernorm_qkv.layer_norm_weight"], p["layernorm_qkv.layer_norm_bias"], 1e-5)
    w = torch.cat([p[f"layernorm_qkv.{n}_weight"] for n in ("query", "key", "value")])
    bias = torch.cat([p[f"layernorm_qkv.{n}_bias"] for n in ("query", "key", "value")])
    qkv = F.linear(ln, w, bias)
    q, k, v = qkv.split([H * D, groups * D, groups * D], dim=-1)
    lead = qkv.shape[:-1]
    q, k, v = q.reshape(*lead, H, D), k.reshape(*lead, groups, D), v.reshape(*lead, groups, D)
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    ctx = _sdpa(q, k, v)
    if fmt == "sbhd":
        ctx = ctx.transpose(0, 1)
    want = F.linear(ctx, p["proj.weight"], p["proj.bias"])
    assert torch.equal(out, want) and torch.equal(ln_out, ln)
    grads_a = torch.autograd.grad(out, [xa] + list(mha.parameters()), torch.ones_like(out))
    grads_b = torch.autograd.grad(want, [xb] + list(mha.parameters()), torch.ones_like(want))
    for n, a, b in zip(["x"] + names, grads_a, grads_b):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_qkv_weight_layouts(interleaved):
    """fuse_qkv_params=True: one `weight`; interleaved puts each group's query heads, key and value together."""
    groups, per = 2, H // 2
    mha = te.MultiheadAttention(HID, H, num_gqa_groups=groups, fuse_qkv_params=True, attention_dropout=0.0,
                                qkv_weight_interleaved=interleaved, attn_mask_type="no_mask")
    _randomize(mha, 1)
    assert [n for n, _ in mha.named_parameters()] == ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
    w, b = mha.qkv.weight.detach().double(), mha.qkv.bias.detach().double()
    rows = lambda blocks: torch.cat([torch.arange(i * D, (i + 1) * D) for i in blocks])  # noqa: E731
    if interleaved:  # block order: g0 q0 q1 k v, g1 q2 q3 k v
        q_blocks = [g * (per + 2) + j for g in range(groups) for j in range(per)]
        k_blocks = [g * (per + 2) + per for g in range(groups)]
        v_blocks = [g * (per + 2) + per + 1 for g in range(groups)]
    else:
        q_blocks, k_blocks, v_blocks = range(H), range(H, H + groups), range(H + groups, H + 2 * groups)
    x = torch.randn(S, B, HID, dtype=torch.float64)
    q, k, v = ((x @ w[rows(bl)].T + b[rows(bl)]).view(S, B, -1, D).transpose(0, 1)
               for bl in (q_blocks, k_blocks, v_blocks))
    allowed = ref.allowed_pairs(B, H, S, S, "no_mask")
    ctx = ref.attention(q, k, v, allowed).reshape(B, S, H * D).transpose(0, 1)
    want = ctx @ mha.proj.weight.detach().double().T + mha.proj.bias.detach().double()
    np.testing.assert_allclose(np32(mha(x.float())), want.numpy(), rtol=1e-5, atol=1e-5)


def test_cross_attention_with_padding_equals_torch_ops():
    mha = te.MultiheadAttention(HID, H, attention_type="cross", input_layernorm=True, attention_dropout=0.0,
                                attn_mask_type="padding", qkv_format="bshd")
    _randomize(mha, 2)
    assert [n for n, _ in mha.named_parameters()] == [
        "layernorm_query.layer_norm_weight", "layernorm_query.layer_norm_bias", "layernorm_query.query_weight",
        "layernorm_query.query_bias", "key_value.key_weight", "key_value.value_weight", "key_value.key_bias",
        "key_value.value_bias", "proj.weight", "proj.bias"]
    x, enc = torch.randn(B, S, HID), torch.randn(B, S + 3, HID)
    pad_q, pad_kv = ref.right_padding([4, 6], S), ref.right_padding([9, 2], S + 3)
    mask = (torch.from_numpy(pad_q).view(B, 1, 1, S), torch.from_numpy(pad_kv).view(B, 1, 1, S + 3))
    out = mha(x, attention_mask=mask, encoder_output=enc)
    p = dict(mha.named_parameters())
    ln = F.layer_norm(x, (HID,), p["layernorm_query.layer_norm_weight"], p["layernorm_query.layer_norm_bias"])
    q = F.linear(ln, p["layernorm_query.query_weight"], p["layernorm_query.query_bias"]).view(B, S, H, D)
    kv = F.linear(enc, torch.cat([p["key_value.key_weight"], p["key_value.value_weight"]]),
                  torch.cat([p["key_value.key_bias"], p["key_value.value_bias"]]))
    k, v = (t.reshape(B, S + 3, H, D) for t in kv.split(HID, dim=-1))
    allowed = torch.from_numpy(ref.allowed_pairs(B, H, S, S + 3, "padding", pad_q=pad_q, pad_kv=pad_kv))
    ctx = _sdpa(q, k, v, causal=False, mask=allowed[:, :1]) * torch.from_numpy(~pad_q).view(B, S, 1)
    want = F.linear(ctx, p["proj.weight"], p["proj.bias"])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="encoder_output"):
        mha(x, attention_mask=mask)


def test_rotary_embedding_is_applied_to_queries_and_keys():
    mha = te.MultiheadAttention(HID, H, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False)
    _randomize(mha, 3)
    freqs = te.RotaryPositionEmbedding(D)(S)
    x = torch.randn(S, B, HID)
    out = mha(x, rotary_pos_emb=freqs)
    q, k, v = F.linear(x, mha.qkv.weight, mha.qkv.bias).view(S, B, 3, H, D).unbind(2)
    q, k = apply_rotary_pos_emb(q, freqs, "sbhd"), apply_rotary_pos_emb(k, freqs, "sbhd")
    ctx = _sdpa(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    assert torch.equal(out, F.linear(ctx, mha.proj.weight, mha.proj.bias))
    assert not torch.equal(out, mha(x))


def test_projections_are_fp8_gemms_with_te_state_slots():
    """First step of DelayedScaling (scale 1): the QKV GEMM's output equals the float64 product of the reference-cast
    E4M3 operands; the states have TE's [L, 3] / [L, 2] layout and record the operands' amaxes."""
    mha = te.MultiheadAttention(HID, H, input_layernorm=True, attention_dropout=0.0, return_layernorm_output=True,
                                fuse_qkv_params=True)
    _randomize(mha, 4)
    seen = {}
    mha.layernorm_qkv.register_forward_hook(lambda m, i, o: seen.update(qkv=o[0]))
    mha.proj.register_forward_hook(lambda m, i, o: seen.update(ctx=i[0], proj=o))
    x = torch.randn(S, B, HID, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        out, ln_out = mha(x)
    out.sum().backward()
    for module, a, y in ((mha.layernorm_qkv, ln_out, seen["qkv"]), (mha.proj, seen["ctx"], seen["proj"])):
        w = np32(module.weight)
        a64, w64 = deq(np32(a).reshape(-1, a.shape[-1]), "e4m3", 1.0), deq(w, "e4m3", 1.0)
        want = a64 @ w64.T + np32(module.bias).astype(np.float64)
        assert_gemm_close(y.reshape(-1, y.shape[-1]), want, a64, w64.T, 2.0**-24)
        fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
        assert tuple(fwd.amax_history.shape) == (4, 3) and tuple(bwd.amax_history.shape) == (4, 2)
        np.testing.assert_array_equal(np32(fwd.amax_history[-1, :2]), [np.abs(np32(a)).max(), np.abs(w).max()])
    assert not torch.equal(out, mha(x)[0]), "the FP8 output equals the high-precision one"


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2), Float8CurrentScaling()])
def test_te_checkpoint_under_fp8_is_bit_identical(recipe):
    mha = te.MultiheadAttention(HID, H, input_layernorm=True, attention_dropout=0.0, num_gqa_groups=2)
    _randomize(mha, 5)
    runs = []
    for recompute in (False, True):  # two steps each, so the second step casts with updated scales
        clone, run = copy.deepcopy(mha), []
        for step in range(2):
            x = torch.randn(S, B, HID, generator=torch.Generator().manual_seed(step), requires_grad=True)
            with te.autocast(recipe=recipe):
                out = te.checkpoint(clone, x, checkpoint_core_attention=True) if recompute else clone(x)
            out.sum().backward()
            run += [out.detach(), x.grad] + [p.grad.clone() for p in clone.parameters()]
        runs.append(run)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_arguments_and_errors():
    with pytest.raises(ValueError, match="num_attention_heads=5 does not divide hidden_size=32"):
        te.MultiheadAttention(32, 5)
    assert te.MultiheadAttention(32, 5, kv_channels=8).proj.in_features == 40
    with pytest.raises(ValueError, match="num_gqa_groups=3 must divide num_attention_heads=4"):
        te.MultiheadAttention(32, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        te.MultiheadAttention(32, 4, qkv_format="sbh")
    with pytest.raises(ValueError, match="set_parallel_mode=True"):
        te.MultiheadAttention(32, 4, tp_size=2)
    with pytest.raises(ValueError, match="attention_type"):
        te.MultiheadAttention(32, 4, attention_type="global")
    mha = te.MultiheadAttention(32, 4, return_bias=True, bias=True, qk_norm_type="RMSNorm")
    out, bias = mha(torch.randn(S, B, 32))
    assert bias is mha.proj.bias and out.shape == (S, B, 32)
    assert isinstance(mha.q_norm, te.RMSNorm) and mha.q_norm.weight.shape == (8,)
