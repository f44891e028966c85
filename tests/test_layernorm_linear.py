"""LayerNorm, RMSNorm and LayerNormLinear: torch's norms bit for bit, Transformer Engine's parameter names, and a fused
module whose numbers equal fp8kit's own norm followed by fp8kit's Linear exactly."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [DelayedScaling(amax_history_len=3), Float8CurrentScaling()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norms_equal_torch_bit_for_bit(kind, dtype):
    ours = getattr(te, kind)(24, eps=1e-6, params_dtype=dtype)
    theirs = getattr(torch.nn, kind)(24, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
        if kind == "LayerNorm":
            ours.bias.uniform_()
            theirs.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 24, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ours.weight.grad, theirs.weight.grad)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_zero_centered_gamma(kind):
    norm = getattr(te, kind)(16, zero_centered_gamma=True)
    assert torch.equal(norm.weight, torch.zeros(16))  # gamma = 1 + weight starts at 1
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    x = torch.randn(4, 16)
    gamma = norm.weight.detach() + 1
    want = F.layer_norm(x, (16,), gamma, norm.bias.detach(), 1e-5) if kind == "LayerNorm" \
        else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)


def test_norm_arguments():
    assert te.LayerNorm(normalized_shape=(2, 8)).weight.shape == (2, 8)
    with pytest.warns(DeprecationWarning, match="hidden_size"):
        assert te.RMSNorm(hidden_size=8).weight.shape == (8,)
    with pytest.raises(ValueError, match="eps"):
        te.LayerNorm(8, eps=-1.0)
    with pytest.raises(ValueError, match="normalized_shape"):
        te.LayerNorm(0)
    norm = te.LayerNorm(8, sequence_parallel=True)
    assert norm.weight.sequence_parallel is True and norm.bias.sequence_parallel is True
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        norm(torch.randn(2, 9))


def test_layernorm_linear_parameter_names_and_init():
    m = te.LayerNormLinear(32, 48, parameters_split=("q", "k", "v"))
    assert [n for n, _ in m.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "q_weight", "k_weight",
                                                    "v_weight", "q_bias", "k_bias", "v_bias"]
    assert torch.equal(m.layer_norm_weight, torch.ones(32)) and torch.equal(m.layer_norm_bias, torch.zeros(32))
    rms = te.LayerNormLinear(32, 16, normalization="RMSNorm", zero_centered_gamma=True)
    assert rms.layer_norm_bias is None and torch.equal(rms.layer_norm_weight, torch.zeros(32))
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        te.LayerNormLinear(32, 16, normalization="BatchNorm")
    with pytest.raises(ValueError, match="parallel_mode='row'"):
        te.LayerNormLinear(32, 16, parallel_mode="row")


def _composition(m: te.LayerNormLinear):
    norm = (te.LayerNorm if m.normalization == "LayerNorm" else te.RMSNorm)(
        m.in_features, eps=m.eps, zero_centered_gamma=m.zero_centered_gamma)
    linear = te.Linear(m.in_features, m.out_features, bias=m.use_bias)
    with torch.no_grad():
        norm.weight.copy_(m.layer_norm_weight)
        if m.layer_norm_bias is not None:
            norm.bias.copy_(m.layer_norm_bias)
        linear.weight.copy_(m.weight)
        if m.use_bias:
            linear.bias.copy_(m.bias)
    return norm, linear


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fused_equals_norm_then_linear_bit_for_bit(recipe, normalization):
    torch.manual_seed(0)
    fused = te.LayerNormLinear(32, 48, normalization=normalization, zero_centered_gamma=True,
                               params_dtype=torch.bfloat16)
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(-0.2, 0.2)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.uniform_(-0.2, 0.2)
    norm, linear = _composition(fused)
    norm.to(torch.bfloat16), linear.to(torch.bfloat16)
    for step in range(3):  # several steps: delayed scales move
        x = (torch.randn(6, 32) * (1 + 3 * step)).to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(6, 48).to(torch.bfloat16)
        with te.autocast(recipe=recipe):
            ya = fused(xa)
            yb = linear(norm(xb))
        assert torch.equal(ya, yb)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(xa.grad, xb.grad)
        pairs = [(fused.layer_norm_weight, norm.weight), (fused.weight, linear.weight), (fused.bias, linear.bias)]
        if fused.layer_norm_bias is not None:
            pairs.append((fused.layer_norm_bias, norm.bias))
        for p, q in pairs:
            assert torch.equal(p.grad, q.grad)
        if isinstance(recipe, DelayedScaling):
            for which in ("scaling_fwd", "scaling_bwd"):
                assert torch.equal(fused.fp8_meta[which].amax_history, linear.fp8_meta[which].amax_history)
                assert torch.equal(fused.fp8_meta[which].scale, linear.fp8_meta[which].scale)


def test_outside_autocast_equals_torch():
    m = te.LayerNormLinear(16, 8)
    x = torch.randn(3, 16)
    want = F.linear(F.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias, 1e-5), m.weight, m.bias)
    assert torch.equal(m(x), want)


@pytest.mark.parametrize("recipe", RECIPES)
def test_return_layernorm_output_and_bias(recipe):
    m = te.LayerNormLinear(16, 8, return_layernorm_output=True, return_bias=True)
    x = torch.randn(3, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        out, bias, ln = m(x)
    assert bias is m.bias
    assert torch.equal(ln, F.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias, 1e-5))
    (out.sum() + ln.sum()).backward()  # the norm output's own gradient reaches the input too
    twin = copy.deepcopy(m)
    x2 = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        out2, _, _ = twin(x2)
    out2.sum().backward()
    assert not torch.equal(x.grad, x2.grad)


def test_recompute_and_copy():
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    torch.manual_seed(4)
    a = te.LayerNormLinear(16, 32)
    b = copy.deepcopy(a)
    for step in range(3):
        x = torch.randn(4, 16) * (1 + 5 * step)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ya = te.checkpoint(a, xa, use_reentrant=False)
            yb = b(xb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(a.weight.grad, b.weight.grad)
        assert torch.equal(a.fp8_meta["scaling_bwd"].scale, b.fp8_meta["scaling_bwd"].scale)
