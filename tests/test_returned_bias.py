"""`return_bias=True`: the bias a module returns (instead of adding) comes in the activation dtype, as Transformer
Engine returns it: torch.autocast's dtype inside torch.autocast, else the input's; so a TransformerLayer under
torch.autocast returns the autocast dtype."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import Float8CurrentScaling

MODULES = {
    "Linear": lambda: te.Linear(16, 32, return_bias=True),
    "LayerNormLinear": lambda: te.LayerNormLinear(16, 32, return_bias=True),
    "LayerNormMLP": lambda: te.LayerNormMLP(16, 32, return_bias=True),
    "GroupedLinear": lambda: te.GroupedLinear(2, 16, 32, return_bias=True),
}


def _call(name, m, x):
    return m(x, [8, 8]) if name == "GroupedLinear" else m(x)


def _biases(name, m):
    if name == "GroupedLinear":
        return [m.bias0, m.bias1]
    return [m.fc2_bias] if name == "LayerNormMLP" else [m.bias]


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_returned_bias_has_the_autocast_dtype(name, dtype):
    torch.manual_seed(0)
    m = MODULES[name]()
    x = torch.randn(16, 16)
    with torch.autocast("cpu", dtype=dtype):
        out, bias = _call(name, m, x)
    got = bias if isinstance(bias, list) else [bias]
    params = _biases(name, m)
    for b, p in zip(got, params):
        assert b.dtype == dtype and out.dtype == dtype
        assert torch.equal(b.float(), p.detach().to(dtype).float())  # rounded once from the float32 parameter
    upstream = [torch.randn(p.shape) for p in params]
    torch.autograd.backward(got, [u.to(dtype) for u in upstream])
    for p, u in zip(params, upstream):  # the gradient reaches the float32 parameter through the cast
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, u.to(dtype).float())


@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_returned_bias_outside_autocast_keeps_the_parameter(name):
    m = MODULES[name]()
    _, bias = _call(name, m, torch.randn(16, 16))
    got = bias if isinstance(bias, list) else [bias]
    assert all(b is p for b, p in zip(got, _biases(name, m)))  # float32 input: no cast, the parameter itself


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()])
def test_transformer_layer_under_torch_autocast_returns_its_dtype(recipe):
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    x = torch.randn(16, 2, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
