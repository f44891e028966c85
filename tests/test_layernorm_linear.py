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
    """float32: torch's norm itself; bf16: torch's norm on the float32 operands, each result rounded once to bf16."""
    ours = getattr(te, kind)(24, eps=1e-6, params_dtype=dtype)
    theirs = getattr(torch.nn, kind)(24, eps=1e-6, dtype=torch.float32)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
        if kind == "LayerNorm":
            ours.bias.uniform_()
            theirs.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 24, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb.float()).to(dtype)
    assert ya.dtype == dtype and torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ours.weight.grad, theirs.weight.grad.to(dtype))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def _norm64(kind, x, gamma, beta, eps):
    """The norm and its gradients' graph in float64 (the reference TE's tests accumulate in float32)."""
    if kind == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], gamma, beta, eps)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * gamma


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("module", ["norm", "LayerNormLinear"])
def test_norm_forward_and_backward_round_once_from_float32(kind, dtype, zero_centered, module):
    """Each of y, dx, dgamma, dbeta is within one rounding (half an ulp, plus float32 sums) of the float64 values of
    the same bf16/fp16 operands; torch's reduced-precision CPU kernels put dbeta off by whole units."""
    torch.manual_seed(7)
    rows, hidden = 512, 64
    if module == "norm":
        m = getattr(te, kind)(hidden, params_dtype=dtype, zero_centered_gamma=zero_centered)
        w, b = m.weight, getattr(m, "bias", None)
        run = m
    else:
        m = te.LayerNormLinear(hidden, 16, normalization=kind, params_dtype=dtype, zero_centered_gamma=zero_centered,
                               return_layernorm_output=True)
        w, b = m.layer_norm_weight, m.layer_norm_bias
        run = lambda t: m(t)[1]  # noqa: E731  (the norm's output; the GEMM's gradient is not under test)
    with torch.no_grad():
        w.uniform_(-0.5, 0.5) if zero_centered else w.uniform_(0.5, 1.5)
        if b is not None:
            b.uniform_(-1, 1)
    x = (torch.randn(rows, hidden) * 3 + 1).to(dtype).requires_grad_()
    dy = torch.randn(rows, hidden).to(dtype)
    y = run(x)
    y.backward(dy)
    params64 = [p.detach().double().requires_grad_() for p in (w, b) if p is not None]
    x64 = x.detach().double().requires_grad_()
    gamma64 = params64[0] + 1 if zero_centered else params64[0]
    y64 = _norm64(kind, x64, gamma64, params64[1] if b is not None else None, 1e-5)
    y64.backward(dy.double())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    got = [y, x.grad] + [p.grad for p in (w, b) if p is not None]
    want = [y64, x64.grad] + [p.grad for p in params64]
    for name, g, r in zip(["y", "dx", "dgamma", "dbeta"], got, want):
        assert g.dtype == dtype, name
        r = r.detach()
        # half an ulp of the result's binade, and float32 sums over `rows` terms of the magnitudes
        bound = ulp * r.abs() + 1e-6 * r.abs().max()
        assert torch.all((g.double() - r).abs() <= bound), (name, ((g.double() - r).abs() - bound).max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_non_contiguous_input_gives_the_contiguous_result_exactly(kind, dtype):
    a = torch.randn(128, 256).to(dtype).requires_grad_()
    outs = []
    for x in (a.T, a.T.contiguous()):
        norm = getattr(te, kind)(128, params_dtype=dtype)
        y = norm(x)
        y.square().sum().backward()
        outs.append([y] + [p.grad for p in norm.parameters()])
    for u, v in zip(*outs):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_outputs_have_the_autocast_dtype(dtype):
    """Inside torch.autocast, Transformer Engine's norms return the autocast dtype (float32 parameters and input),
    computed from the operands cast to it."""
    torch.manual_seed(8)
    x = torch.randn(4, 6, 32)
    for kind in ("LayerNorm", "RMSNorm"):
        norm = getattr(te, kind)(32)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        with torch.autocast("cpu", dtype=dtype):
            y = norm(x)
        ops = [t.to(dtype).float() for t in (x, norm.weight, getattr(norm, "bias", None)) if t is not None]
        want = F.layer_norm(ops[0], (32,), *ops[1:]) if kind == "LayerNorm" else F.rms_norm(ops[0], (32,), ops[1], 1e-5)
        assert y.dtype == dtype and torch.equal(y, want.to(dtype))
        lnl = te.LayerNormLinear(32, 16, normalization=kind, return_layernorm_output=True)
        with torch.autocast("cpu", dtype=dtype):
            out, ln_out = lnl(x)
        assert out.dtype == dtype and ln_out.dtype == dtype
        mlp = te.LayerNormMLP(32, 64, normalization=kind, return_layernorm_output=True)
        with torch.autocast("cpu", dtype=dtype):
            out, ln_out = mlp(x)
        assert out.dtype == dtype and ln_out.dtype == dtype
    assert te.LayerNorm(32)(x.bfloat16()).dtype == torch.float32  # outside autocast: the weight's dtype, as TE


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
