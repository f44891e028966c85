"""Our port of Transformer Engine's tests/pytorch/test_numerics.py: the modules' outputs and gradients against
float64 formulas (Linear, norms, LayerNormLinear, LayerNormMLP), the FP8 forward against the NumPy reference casts,
delayed wgrad and main_grad accumulation, activation checkpointing and FP8 weights, over a spread of TE's parameters."""

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

import reference as ref

TOL = {torch.float32: (1.3e-6, 5e-5), torch.float16: (1e-2, 5e-3), torch.bfloat16: (2e-2, 5e-2)}  # rtol, atol


def _grads(module, x, dy, **kw):
    x = x.detach().clone().requires_grad_()
    out = module(x, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return [out, x.grad] + [p.grad for p in module.parameters() if p.requires_grad]


def _assert_close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double().to(g.dtype).double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype,bias,return_bias", [(torch.float32, True, False), (torch.bfloat16, True, True),
                                                    (torch.float16, False, False)])
def test_linear_accuracy(dtype, bias, return_bias):
    torch.manual_seed(0)
    layer = te.Linear(64, 256, bias=bias, return_bias=return_bias, params_dtype=dtype)
    x, dy = torch.randn(32, 64, dtype=dtype), torch.randn(32, 256, dtype=dtype)
    if return_bias:
        out, b = layer(x.requires_grad_())
        assert b is layer.bias or torch.equal(b, layer.bias)
        out = out + b
        out.backward(dy)
        got = [out, x.grad, layer.weight.grad, layer.bias.grad]
    else:
        got = _grads(layer, x, dy)
    w = layer.weight.detach().double()
    x64, dy64 = x.detach().double(), dy.double()
    want = [x64 @ w.T + (layer.bias.detach().double() if bias else 0), dy64 @ w, dy64.T @ x64]
    if bias:
        want.append(dy64.sum(0))
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("norm,dtype,eps,zero_centered", [("RMSNorm", torch.float32, 1e-5, False),
                                                          ("RMSNorm", torch.bfloat16, 1e-3, True),
                                                          ("LayerNorm", torch.float32, 1e-7, True),
                                                          ("LayerNorm", torch.float16, 1e-1, False)])
def test_norm_accuracy(norm, dtype, eps, zero_centered):
    torch.manual_seed(1)
    layer = getattr(te, norm)(48, eps=eps, zero_centered_gamma=zero_centered, params_dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.3)
    x = torch.randn(20, 48, dtype=dtype)
    dy = torch.randn(20, 48, dtype=dtype)
    got = _grads(layer, x, dy)
    x64 = x.double().requires_grad_()
    gamma = layer.weight.detach().double().requires_grad_()
    params = [gamma]
    scale = gamma + 1 if zero_centered else gamma
    if norm == "RMSNorm":
        y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * scale
    else:
        beta = layer.bias.detach().double().requires_grad_()
        params.append(beta)
        y = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + eps)
        y = y * scale + beta
    y.backward(dy.double())
    _assert_close(got, [y, x64.grad] + [p.grad for p in params], dtype)


@pytest.mark.parametrize("module", ["LayerNorm", "LayerNormLinear"])
def test_bf16_norm_parameter_grads_are_rounded_once(module):
    # TE's test_gpt_accuracy in bfloat16 (256 tokens): the norm's gamma / beta gradients are sums over every token,
    # accumulated in float32 and rounded to bfloat16 once (TE's kernels), so within one bfloat16 ulp of float64;
    # a bfloat16 running sum over the tokens is hundreds of ulps off (torch's CPU layer_norm, TE's oracle there)
    torch.manual_seed(4)
    dtype, hidden, tokens = torch.bfloat16, 128, 256
    norm = te.LayerNorm(hidden, params_dtype=dtype) if module == "LayerNorm" else \
        te.LayerNormLinear(hidden, 64, params_dtype=dtype)
    gamma = norm.weight if module == "LayerNorm" else norm.layer_norm_weight
    beta = norm.bias if module == "LayerNorm" else norm.layer_norm_bias
    with torch.no_grad():
        gamma.normal_(1, 0.1)
    x = torch.randn(tokens, hidden, dtype=dtype)
    out = norm(x)
    dy = torch.randn(out.shape, dtype=dtype)
    out.backward(dy)
    x64 = x.double()
    xhat = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    # LayerNormLinear: the norm's output gradient is the GEMM's dgrad, in bfloat16
    dh = (dy if module == "LayerNorm" else dy @ norm.weight.detach()).double()
    for got, want in ((gamma.grad, (dh * xhat).sum(0)), (beta.grad, dh.sum(0))):
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -100))) - 7)
        assert ((got.double() - want).abs() <= ulp).all()


@pytest.mark.parametrize("normalization,activation", [("LayerNorm", "gelu"), ("RMSNorm", "swiglu"),
                                                      ("RMSNorm", "relu")])
def test_layernorm_mlp_accuracy(normalization, activation):
    torch.manual_seed(2)
    layer = te.LayerNormMLP(32, 64, normalization=normalization, activation=activation)
    x, dy = torch.randn(16, 32), torch.randn(16, 32)
    got = _grads(layer, x, dy)
    x64 = x.double().requires_grad_()
    p = {n: t.detach().double().requires_grad_() for n, t in layer.named_parameters()}
    if normalization == "LayerNorm":
        h = torch.nn.functional.layer_norm(x64, (32,), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5)
    else:
        h = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * p["layer_norm_weight"]
    h = h @ p["fc1_weight"].T + p["fc1_bias"]
    if activation == "swiglu":
        a, b = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(a) * b
    else:
        h = torch.nn.functional.gelu(h, approximate="tanh") if activation == "gelu" else torch.relu(h)
    y = h @ p["fc2_weight"].T + p["fc2_bias"]
    y.backward(dy.double())
    names = [n for n, _ in layer.named_parameters()]
    _assert_close(got, [y, x64.grad] + [p[n].grad for n in names], torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_linear_forward_against_reference_casts(fmt):
    # current scaling: x and w cast with their own amax (NumPy reference), multiplied in float64
    torch.manual_seed(3)
    layer = te.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3 if fmt == "e4m3" else Format.HYBRID)
    with te.autocast(recipe=recipe):
        y = layer(x)
    fwd_fmt = "e4m3"  # HYBRID: forward tensors are E4M3 as well
    xq, xs = ref.current_cast(x.numpy(), fwd_fmt)
    wq, ws = ref.current_cast(layer.weight.detach().numpy(), fwd_fmt)
    want = ref.dequantize(xq, fwd_fmt, xs).astype(np.float64) @ ref.dequantize(wq, fwd_fmt, ws).astype(np.float64).T
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias,fuse", [(True, False), (False, True)])
def test_linear_delay_wgrad_compute(bias, fuse):
    torch.manual_seed(4)
    plain = te.Linear(32, 48, bias=bias, fuse_wgrad_accumulation=fuse)
    delayed = te.Linear(32, 48, bias=bias, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=True)
    delayed.load_state_dict(plain.state_dict())
    if fuse:
        plain.weight.main_grad = torch.rand(48, 32)
        delayed.weight.main_grad = plain.weight.main_grad.clone()
    x, dy = torch.randn(8, 32), torch.randn(8, 48)
    with te.autocast(recipe=DelayedScaling()):
        a = plain(x)
        b = delayed(x)
    a.backward(dy)
    b.backward(dy)
    w_grad = (lambda m: m.weight.main_grad) if fuse else (lambda m: m.weight.grad)
    if not fuse:
        assert delayed.weight.grad is None  # not yet: backward_dw computes it
    delayed.backward_dw()
    torch.testing.assert_close(w_grad(delayed), w_grad(plain), rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(delayed.bias.grad, plain.bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_checkpointed_layer_matches_plain_bits(recipe):
    torch.manual_seed(5)
    layer = te.LayerNormMLP(32, 64)
    x, dy = torch.randn(16, 32), torch.randn(16, 32)
    with te.autocast(recipe=recipe):
        plain = _grads(layer, x, dy)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    layer2 = te.LayerNormMLP(32, 64)
    xc = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        out = te.checkpoint(layer2, xc, use_reentrant=False)
    out.backward(dy)
    got = [out, xc.grad] + [p.grad for p in layer2.parameters()]
    for g, w in zip(got, plain):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_parameters_give_the_same_bits(recipe):
    # TE's test_gpt_fp8_parameters: FP8 weights made at init equal weights cast at each forward
    torch.manual_seed(6)
    plain = te.Linear(32, 32)
    with te.quantized_model_init(recipe=recipe):
        fp8 = te.Linear(32, 32)
    with torch.no_grad():
        fp8.weight.copy_(plain.weight)
        fp8.bias.copy_(plain.bias)
    x = torch.randn(16, 32)
    with te.autocast(recipe=recipe):
        a, b = plain(x), fp8(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
