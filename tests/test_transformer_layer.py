"""TransformerLayer against a block written from torch ops with the same weights (bit for bit where the same ops run:
LayerNorm, QKV projection, scaled_dot_product_attention, output projection, residuals, MLP), for each mask type, GQA,
the formats and TE's structural options; under FP8 its projections are FP8 GEMMs in TE's slot layout and a small
stack trains within 2% of bf16; recompute and copies."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import attention_reference as ref

pytestmark = pytest.mark.skipif(not hasattr(te, "LayerNormMLP"), reason="TransformerLayer needs te.LayerNormMLP")

S, B, HID, FFN, H = 6, 2, 32, 64, 4
D = HID // H


def _randomize(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.2
            p.copy_(noise + (1.0 if name.endswith("layer_norm_weight") or name == "layernorm.weight" else 0.0))


def _norm(x, p, prefix, kind):
    """TE's norms compute bf16/fp16 in float32 and round once."""
    w, b = p[f"{prefix}weight"], p.get(f"{prefix}bias")
    if x.dtype in (torch.bfloat16, torch.float16):
        wide = (lambda t: None if t is None else t.float())  # noqa: E731
        return _norm(x.float(), {f"{prefix}weight": wide(w), f"{prefix}bias": wide(b)}, prefix, kind).to(x.dtype)
    return F.layer_norm(x, (HID,), w, b, 1e-5) if kind == "LayerNorm" else F.rms_norm(x, (HID,), w, 1e-5)


def _attend(q, k, v, fmt, mask, causal):
    """q [*, *, h, d] in fmt -> context [*, *, h*d] in fmt, through torch's SDPA."""
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
    out = out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
    return out.transpose(0, 1) if fmt == "sbhd" else out


def torch_block(layer, x, fmt="sbhd", groups=H, mask=None, causal=True, kind="LayerNorm", post_ln=False,
                output_ln=False, parallel=False, enc=None, enc_mask=None, zero_rows=None):
    """The layer's computation from torch ops, with its parameters looked up by Transformer Engine's names."""
    p = dict(layer.named_parameters())
    # TE's activations run in float32 for 16-bit inputs, in the input's dtype otherwise
    wide = lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t  # noqa: E731
    gelu = lambda t: F.gelu(wide(t), approximate="tanh").to(t.dtype)  # noqa: E731

    def attention(prefix, inp, kv_inp, attn_mask, is_causal, self_attn):
        ln_prefix = f"{prefix}.layernorm_qkv." if self_attn else f"{prefix}.layernorm_query."
        has_ln = f"{ln_prefix}layer_norm_weight" in p
        h = _norm(inp, p, f"{ln_prefix}layer_norm_", kind) if has_ln else inp
        lin = f"{prefix}.layernorm_qkv" if has_ln else f"{prefix}.qkv"
        if self_attn:
            w = torch.cat([p[f"{lin}.{n}_weight"] for n in ("query", "key", "value")])
            b = torch.cat([p[f"{lin}.{n}_bias"] for n in ("query", "key", "value")])
            q, k, v = F.linear(h, w, b).split([HID, groups * D, groups * D], dim=-1)
        else:
            q = F.linear(h, p[f"{ln_prefix}query_weight"], p[f"{ln_prefix}query_bias"])
            w = torch.cat([p[f"{prefix}.key_value.key_weight"], p[f"{prefix}.key_value.value_weight"]])
            b = torch.cat([p[f"{prefix}.key_value.key_bias"], p[f"{prefix}.key_value.value_bias"]])
            k, v = F.linear(kv_inp, w, b).split(groups * D, dim=-1)
        q, k, v = (t.reshape(*t.shape[:-1], -1, D) for t in (q, k, v))
        ctx = _attend(q, k, v, fmt, attn_mask, is_causal)
        if zero_rows is not None and self_attn:
            ctx = ctx * zero_rows
        return F.linear(ctx, p[f"{prefix}.proj.weight"]), p[f"{prefix}.proj.bias"], h

    out, bias, ln1 = attention("self_attention", x, None, mask, causal, True)
    if parallel:
        mlp_in = x
    else:
        x = (ln1 if post_ln and not output_ln else x) + (out + bias)
        mlp_in = x
    if enc is not None:
        out, bias, ln_q = attention("inter_attention", x, enc, enc_mask, False, False)
        x = (ln_q if post_ln else x) + (out + bias)
        mlp_in = x
    ln2 = _norm(mlp_in, p, "layernorm_mlp.layer_norm_", kind)
    fc1 = gelu(F.linear(ln2, p["layernorm_mlp.fc1_weight"], p["layernorm_mlp.fc1_bias"]))
    fc2 = F.linear(fc1, p["layernorm_mlp.fc2_weight"])
    if parallel:
        y = x + ((out + bias) + (fc2 + p["layernorm_mlp.fc2_bias"]))
    else:
        y = (ln2 if post_ln else x) + (fc2 + p["layernorm_mlp.fc2_bias"])
    return _norm(y, p, "layernorm.", kind) if output_ln else y


def _compare(layer, want_fn, x, bitwise=True, **forward):
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = layer(xa, **forward), want_fn(xb)
    params = list(layer.parameters())
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(got.dtype)
    mine = torch.autograd.grad(got, [xa] + params, g, allow_unused=True)
    theirs = torch.autograd.grad(want, [xb] + params, g, allow_unused=True)
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(["output"] + names, [got] + list(mine), [want] + list(theirs)):
        if bitwise:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("groups", [H, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_block_bit_for_bit(fmt, groups, dtype):
    layer = te.TransformerLayer(HID, FFN, H, num_gqa_groups=groups, hidden_dropout=0.0, attention_dropout=0.0,
                                attn_input_format=fmt, params_dtype=dtype)
    _randomize(layer)
    x = torch.randn(S, B, HID).to(dtype)
    x = x if fmt == "sbhd" else x.transpose(0, 1).contiguous()
    _compare(layer, lambda t: torch_block(layer, t, fmt, groups), x)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right", "padding", "padding_causal", "arbitrary"])
def test_mask_types_bit_for_bit(mask_type):
    layer = te.TransformerLayer(HID, FFN, H, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type=mask_type, attn_input_format="bshd")
    _randomize(layer, 1)
    x = torch.randn(B, S, HID)
    forward, pad, user, zero_rows = {}, None, None, None
    if "padding" in mask_type:
        pad = ref.right_padding([4, 6], S)
        forward["attention_mask"] = torch.from_numpy(pad).view(B, 1, 1, S)
        zero_rows = torch.from_numpy(~pad).view(B, S, 1).float()
    if mask_type == "arbitrary":
        user = np.random.default_rng(2).random((B, 1, S, S)) < 0.5
        user[..., 0] = False  # every row attends somewhere
        forward["attention_mask"] = torch.from_numpy(user)
    allowed = ref.allowed_pairs(B, 1, S, S, mask_type, pad_q=pad, pad_kv=pad, user_mask=user)
    if "padding" in mask_type:
        allowed[~allowed.any(-1)] = True  # padded queries: any row works, zeroed after (as fp8kit does)
    mask = None if mask_type == "no_mask" else torch.from_numpy(allowed)
    _compare(layer, lambda t: torch_block(layer, t, "bshd", 2, mask=mask, causal=False, zero_rows=zero_rows), x,
             **forward)


@pytest.mark.parametrize("option", ["post_ln", "output_ln", "parallel", "decoder", "rmsnorm"])
def test_structural_options_match_torch_block(option):
    kwargs = dict(post_ln=dict(apply_residual_connection_post_layernorm=True), output_ln=dict(output_layernorm=True),
                  parallel=dict(parallel_attention_mlp=True), decoder=dict(layer_type="decoder"),
                  rmsnorm=dict(normalization="RMSNorm"))[option]
    layer = te.TransformerLayer(HID, FFN, H, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
                                **kwargs)
    _randomize(layer, 2)
    x = torch.randn(S, B, HID, dtype=torch.float64)
    forward, ref_kwargs = {}, {option: True} if option in ("post_ln", "output_ln", "parallel") else {}
    if option == "decoder":
        enc = torch.randn(S + 2, B, HID, dtype=torch.float64)
        forward["encoder_output"] = ref_kwargs["enc"] = enc
    if option == "rmsnorm":
        ref_kwargs["kind"] = "RMSNorm"
    if option == "output_ln":
        assert not hasattr(layer.self_attention, "layernorm_qkv") and hasattr(layer, "layernorm")
    _compare(layer, lambda t: torch_block(layer, t, **ref_kwargs), x, bitwise=False, **forward)


def test_thd_packed_sequences_equal_padded_bshd():
    lengths = [4, 6, 2]
    kwargs = dict(hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="padding_causal")
    torch.manual_seed(0)
    thd = te.TransformerLayer(HID, FFN, H, attn_input_format="thd", **kwargs)
    bshd = te.TransformerLayer(HID, FFN, H, attn_input_format="bshd", **kwargs)
    bshd.load_state_dict(thd.state_dict())
    x = torch.randn(sum(lengths), HID)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    out = thd(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    dense = torch.zeros(len(lengths), max(lengths), HID)
    for i, n in enumerate(lengths):
        dense[i, :n] = x[cu[i]:cu[i + 1]]
    mask = torch.from_numpy(ref.right_padding(lengths, max(lengths))).view(len(lengths), 1, 1, -1)
    want = bshd(dense, attention_mask=mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], want[i, :n], rtol=1e-6, atol=1e-6)


def test_state_dict_uses_transformer_engine_names():
    layer = te.TransformerLayer(HID, FFN, H, fuse_qkv_params=True, hidden_dropout=0.0, attention_dropout=0.0)
    assert [n for n, _ in layer.named_parameters()] == [
        "self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias", "self_attention.proj.weight",
        "self_attention.proj.bias", "layernorm_mlp.layer_norm_weight", "layernorm_mlp.layer_norm_bias",
        "layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias"]
    with te.autocast(recipe=DelayedScaling(amax_history_len=3)):
        layer(torch.randn(S, B, HID)).sum().backward()
    keys = [k for k in layer.state_dict() if "fp8_meta" in k]
    assert "self_attention.layernorm_qkv.fp8_meta.scaling_fwd.amax_history" in keys
    assert tuple(layer.state_dict()["layernorm_mlp.fp8_meta.scaling_fwd.amax_history"].shape) == (3, 6)
    clone = te.TransformerLayer(HID, FFN, H, fuse_qkv_params=True, hidden_dropout=0.0, attention_dropout=0.0)
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(S, B, HID)
    with te.autocast(recipe=DelayedScaling(amax_history_len=3)):
        assert torch.equal(clone(x), layer(x))


def _train(layers, recipe, steps=6):
    """Adam steps of a stack on a fixed regression target under torch.autocast(bf16) (+ fp8kit's autocast)."""
    opt = torch.optim.Adam([p for m in layers for p in m.parameters()], lr=3e-3)
    gen = torch.Generator().manual_seed(11)
    x, target = torch.randn(8, 2, HID, generator=gen), torch.randn(8, 2, HID, generator=gen)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            h = x
            for layer in layers:
                h = layer(h)
            loss = F.mse_loss(h.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _stack():
    torch.manual_seed(0)
    return [te.TransformerLayer(HID, FFN, H, num_gqa_groups=2, layer_number=i + 1, hidden_dropout=0.0,
                                attention_dropout=0.0) for i in range(2)]


@pytest.fixture(scope="module")
def bf16_losses():
    return _train(_stack(), None)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()])
def test_fp8_stack_trains_within_two_percent_of_bf16(recipe, bf16_losses):
    stack = _stack()
    fp8 = _train(stack, recipe)
    assert bf16_losses[-1] < 0.9 * bf16_losses[0] and fp8[-1] < 0.9 * fp8[0], "the stack did not learn"
    worst = max(abs(a / b - 1) for a, b in zip(fp8, bf16_losses))
    assert worst < 0.02, (fp8, bf16_losses)
    fp8_modules = [m for layer in stack for m in layer.modules() if getattr(m, "fp8_meta", None) is not None]
    assert len(fp8_modules) == 6  # QKV, proj, LayerNormMLP per layer: every projection is an FP8 GEMM
    if isinstance(recipe, DelayedScaling):
        for m in fp8_modules:
            assert tuple(m.fp8_meta["scaling_fwd"].amax_history.shape) == (4, 3 * m.num_gemms)
            assert tuple(m.fp8_meta["scaling_bwd"].amax_history.shape) == (4, 2 * m.num_gemms)
            assert bool((m.fp8_meta["scaling_fwd"].amax_history[-1, 0::3] > 0).all())  # every input cast ran


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_is_bit_identical_under_fp8(use_reentrant):
    """te.checkpoint of each layer (and checkpoint_core_attention) gives the losses and gradients of no recompute,
    with attention and hidden dropout on (the RNG states are replayed)."""
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    torch.manual_seed(3)
    layer = te.TransformerLayer(HID, FFN, H, hidden_dropout=0.2, attention_dropout=0.2,
                                get_rng_state_tracker=lambda: tracker)
    x = torch.randn(S, B, HID)
    recipe = DelayedScaling(amax_history_len=2)
    runs = []
    for mode in ("plain", "checkpoint", "core"):
        clone = copy.deepcopy(layer)
        tracker.set_states({"model-parallel-rng": torch.manual_seed(99).get_state()})
        torch.manual_seed(5)
        run = []
        for _ in range(2):
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                if mode == "checkpoint":
                    y = te.checkpoint(clone, xi, use_reentrant=use_reentrant, get_rng_state_tracker=lambda: tracker)
                else:
                    y = clone(xi, checkpoint_core_attention=mode == "core")
            y.square().sum().backward()
            run += [y.detach(), xi.grad] + [p.grad.clone() for p in clone.parameters()]
            clone.zero_grad()
        runs.append(run)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_deepcopy_continues_identically():
    layer = te.TransformerLayer(HID, FFN, H, hidden_dropout=0.0, attention_dropout=0.0)
    recipe = DelayedScaling(amax_history_len=2)
    with te.autocast(recipe=recipe):
        layer(torch.randn(S, B, HID)).sum().backward()
    clone = copy.deepcopy(layer)
    x = torch.randn(S, B, HID)
    with te.autocast(recipe=recipe):
        a, b = layer(x), clone(x)
    assert torch.equal(a, b)


def test_generation_with_kv_cache_equals_whole_sequence():
    torch.manual_seed(0)
    layers = [te.TransformerLayer(HID, FFN, H, num_gqa_groups=2, layer_number=i + 1, hidden_dropout=0.0,
                                  attention_dropout=0.0, attn_input_format="bshd", params_dtype=torch.float64).eval()
              for i in range(2)]
    x = torch.randn(1, 7, HID, dtype=torch.float64)
    want = x
    for layer in layers:
        want = layer(want)
    params = te.InferenceParams(1, 8, num_heads_kv=2, head_dim_k=D, dtype=torch.float64)
    from collections import OrderedDict
    got, pos = [], 0
    for n in (4, 1, 1, 1):
        params.pre_step(OrderedDict({0: n}))
        h = x[:, pos:pos + n]
        for layer in layers:
            h = layer(h, self_attn_mask_type="padding_causal", inference_params=params)
        got.append(h)
        pos += n
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-10, atol=1e-10)


def test_bad_arguments_raise_errors_naming_them():
    with pytest.raises(ValueError, match="num_attention_heads=5 does not divide hidden_size=32"):
        te.TransformerLayer(32, 64, 5)
    with pytest.raises(ValueError, match="num_gqa_groups=3 must divide num_attention_heads=4"):
        te.TransformerLayer(32, 64, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="attn_input_format must be one of 'sbhd', 'bshd', 'thd'; got 'sbd'"):
        te.TransformerLayer(32, 64, 4, attn_input_format="sbd")
    with pytest.raises(ValueError, match="self_attn_mask_type must be one of"):
        te.TransformerLayer(32, 64, 4, self_attn_mask_type="triangular")
    with pytest.raises(ValueError, match="layer_type"):
        te.TransformerLayer(32, 64, 4, layer_type="encoder-decoder")
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        te.TransformerLayer(32, 64, 4, parallel_attention_mlp=True, output_layernorm=True)
    layer = te.TransformerLayer(32, 64, 4, self_attn_mask_type="padding")
    x = torch.randn(S, B, 32)
    with pytest.raises(TypeError, match="attention_mask must be boolean"):
        layer(x, attention_mask=torch.zeros(B, 1, 1, S))
    with pytest.raises(ValueError, match=r"attention_mask: a padding mask has shape \[batch, 1, 1, seqlen\]"):
        layer(x, attention_mask=torch.zeros(B, 1, S, S, dtype=torch.bool))


def test_fp8_weights_under_quantized_model_init():
    recipe = DelayedScaling(amax_history_len=2)
    kwargs = dict(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True)
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        layer = te.TransformerLayer(HID, FFN, H, **kwargs)
    assert isinstance(layer.self_attention.layernorm_qkv.weight, te.Float8Tensor)
    assert isinstance(layer.layernorm_mlp.fc1_weight, te.Float8Tensor)
    high = te.TransformerLayer(HID, FFN, H, **kwargs)
    high.load_state_dict({k: v.dequantize() if isinstance(v, te.Float8Tensor) else v
                          for k, v in layer.state_dict().items() if "fp8_meta" not in k}, strict=False)
    x = torch.randn(S, B, HID)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.sum().backward()
    want = high(x)
    assert 0 < ((y - want).norm() / want.norm()).item() < 0.05
    with pytest.raises(ValueError, match="parameters_split"), te.quantized_model_init(enabled=True, recipe=recipe):
        te.TransformerLayer(HID, FFN, H)  # split QKV parameters cannot be FP8 weights


def test_norm_outputs_under_torch_autocast_have_its_dtype():
    """Transformer Engine's norms return torch.autocast's dtype: the output LayerNorm (output_layernorm=True) and the
    fused modules' norms, whose bf16 outputs feed the GEMMs unchanged; gradients reach the float32 parameters."""
    layer = te.TransformerLayer(HID, FFN, H, hidden_dropout=0.0, attention_dropout=0.0, output_layernorm=True)
    _randomize(layer, 4)
    seen = []
    hook = layer.layernorm.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x = torch.randn(S, B, HID, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    hook.remove()
    assert y.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.layernorm.weight.grad.dtype == torch.float32
    assert all(p.grad is not None for p in layer.parameters())
