"""Layers with a zero feature size, as Transformer Engine allows them (it checks no size at construction).

A product over an empty dimension is 0: `Linear(0, n)` gives its bias (zeros without one) and zero weight
gradients; `Linear(n, 0)` gives an empty output and zero input gradients. The same for LayerNormLinear,
LayerNormMLP (hidden or FFN size 0) and GroupedLinear, under both recipes. The oracle is float64 math on the same
parameters (torch.nn.functional in float64), which for these shapes is exact.
"""

import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}
ROWS = 6


def _randomize(module):
    """Random values in every parameter (biases included), so that "the bias" is a real check."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _run(module, x, dy, recipe, **kwargs):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _oracle(fn, params, x, dy):
    """float64 forward and gradients of `fn(x, *params)`."""
    x64 = x.double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in params]
    y = fn(x64, *p64)
    y.backward(dy.double())
    return y.detach(), x64.grad, [p.grad for p in p64]


def _check(got, want):
    """Zeros and copied values exactly; sums (bias gradients, norms) to float32 rounding."""
    y, dx, dparams = got
    wy, wdx, wparams = want
    assert y.shape == wy.shape and not torch.isnan(y).any()
    torch.testing.assert_close(y.double(), wy, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), wdx, rtol=1e-6, atol=1e-6)
    for (name, g), w in zip(dparams.items(), wparams):
        assert g is not None and g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6, msg=name)
        if not w.any():
            assert not g.any(), name


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", [(0, 16), (16, 0), (0, 0)])
def test_linear(recipe, sizes):
    n_in, n_out = sizes
    layer = te.Linear(n_in, n_out)
    _randomize(layer)
    x, dy = torch.randn(ROWS, n_in), torch.randn(ROWS, n_out)
    got = _run(layer, x, dy, RECIPES[recipe])
    _check(got, _oracle(F.linear, [layer.weight, layer.bias], x, dy))
    if n_in == 0:  # the bias, and zero weight gradients
        assert torch.equal(got[0], layer.bias.detach().expand(ROWS, n_out))
    if recipe == "delayed":  # an empty amax is 0: the scales stay finite and positive
        for name in ("scaling_fwd", "scaling_bwd"):
            scale = layer.fp8_meta[name].scale
            assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", [(0, 16), (16, 0)])
def test_layernorm_linear(recipe, sizes):
    n_in, n_out = sizes
    layer = te.LayerNormLinear(n_in, n_out)
    _randomize(layer)
    x, dy = torch.randn(ROWS, n_in), torch.randn(ROWS, n_out)

    def oracle(x, gamma, beta, w, b):
        return F.linear(F.layer_norm(x, (n_in,), gamma, beta, layer.eps), w, b)

    params = [layer.layer_norm_weight, layer.layer_norm_bias, layer.weight, layer.bias]
    _check(_run(layer, x, dy, RECIPES[recipe]), _oracle(oracle, params, x, dy))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", [(0, 16), (16, 0)])
def test_layernorm_mlp(recipe, sizes):
    hidden, ffn = sizes
    mlp = te.LayerNormMLP(hidden, ffn, activation="relu")
    _randomize(mlp)
    x, dy = torch.randn(ROWS, hidden), torch.randn(ROWS, hidden)

    def oracle(x, gamma, beta, w1, b1, w2, b2):
        return F.linear(F.relu(F.linear(F.layer_norm(x, (hidden,), gamma, beta, mlp.eps), w1, b1)), w2, b2)

    params = [mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight, mlp.fc2_bias]
    _check(_run(mlp, x, dy, RECIPES[recipe]), _oracle(oracle, params, x, dy))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", [(0, 16), (16, 0)])
def test_grouped_linear(recipe, sizes):
    n_in, n_out = sizes
    layer = te.GroupedLinear(2, n_in, n_out)
    _randomize(layer)
    splits = [2, ROWS - 2]
    x, dy = torch.randn(ROWS, n_in), torch.randn(ROWS, n_out)

    def oracle(x, w0, b0, w1, b1):
        first, second = x.split(splits)
        return torch.cat([F.linear(first, w0, b0), F.linear(second, w1, b1)])

    params = [layer.weight0, layer.bias0, layer.weight1, layer.bias1]
    _check(_run(layer, x, dy, RECIPES[recipe], m_splits=splits), _oracle(oracle, params, x, dy))


def test_negative_sizes_are_refused():
    for build, match in ((lambda: te.Linear(-1, 4), "in_features must be an int >= 0, got -1"),
                         (lambda: te.LayerNormMLP(4, -2), "ffn_hidden_size must be an int >= 0, got -2"),
                         (lambda: te.GroupedLinear(2, 4, -1), "out_features must be an int >= 0, got -1")):
        with pytest.raises(ValueError, match=match):
            build()


def test_a_transpose_of_zero_columns_on_an_accelerator():
    """Off the CPU a cast also writes the transposed bytes; with no columns that is an empty [0, M] tensor."""
    from fp8kit.pytorch.tensor.storage import Float8TensorStorage

    q = Float8TensorStorage(data=torch.empty(5, 0, dtype=torch.float8_e4m3fn, device="meta"),
                            fp8_scale_inv=torch.ones(1, device="meta")).with_transpose()
    assert q._transpose.shape == (0, 5)
