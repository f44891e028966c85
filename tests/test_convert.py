import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import Float8CurrentScaling


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32, bias=False)
        self.head = torch.nn.Linear(32, 10)  # 10 is not a multiple of 16
        self.attn = torch.nn.MultiheadAttention(32, 4)  # holds a Linear subclass: left alone

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def test_convert_replaces_linears_with_same_parameters():
    torch.manual_seed(0)
    model = Block()
    up_w, down_w = model.up.weight, model.down.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 32)
    before = model(x)
    with pytest.warns(UserWarning, match="head"):
        out = te.convert_model(model)
    assert out is model
    assert type(model.up) is te.Linear and type(model.down) is te.Linear
    assert type(model.head) is torch.nn.Linear
    assert model.fp8kit_skipped == [("head", "out_features=10 is not a multiple of 16")]
    assert type(model.attn.out_proj) is not te.Linear
    assert model.up.weight is up_w and model.down.weight is down_w and model.down.bias is None
    assert torch.equal(model(x), before)  # outside autocast: unchanged numerics
    with te.autocast(recipe=Float8CurrentScaling()):
        loss = model(x).sum()
    loss.backward()
    opt.step()  # the optimizer still holds the same parameters
    assert not torch.equal(model.up.weight, before.new_zeros(1)) and up_w.grad is not None


def test_module_filter_and_bad_model():
    model = Block()
    with pytest.warns(UserWarning, match="head"):
        te.convert_model(model, module_filter=lambda mod, fqn: fqn != "up")
    assert type(model.up) is torch.nn.Linear and type(model.down) is te.Linear
    with pytest.raises(TypeError, match="Module"):
        te.convert_model("model")
    with pytest.raises(TypeError, match="contains the Linear"):
        te.convert_model(torch.nn.Linear(16, 16))


def test_converting_nothing_warns_and_says_why():
    with pytest.warns(UserWarning, match="converted no layer of Sequential: it holds no torch.nn.Linear"):
        te.convert_model(torch.nn.Sequential(torch.nn.ReLU()))
    model = Block()
    with pytest.warns(UserWarning, match=r"module_filter rejected 3 \(up, down, head\)"):
        te.convert_model(model, module_filter=lambda mod, fqn: False)
    assert type(model.up) is torch.nn.Linear
    with pytest.warns(UserWarning) as record:
        te.convert_model(torch.nn.Sequential(torch.nn.Linear(10, 20)))
    messages = [str(w.message) for w in record]
    assert any("0 (in_features=10 is not a multiple of 16; out_features=20 is not a multiple of 16)" in m
               for m in messages)
    assert any("converted no layer" in m and "1 have shapes FP8 GEMMs cannot take" in m for m in messages)
    model = Block()
    with pytest.warns(UserWarning, match="head"):
        te.convert_model(model)
    with pytest.warns(UserWarning) as record:
        te.convert_model(model)  # a second call finds nothing left to convert
    assert any("already holds 2 fp8kit layers" in str(w.message) and "NonDynamicallyQuantizableLinear"
               in str(w.message) for w in record)


def test_converting_something_does_not_warn():
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te.convert_model(model)
    assert [type(m) for m in model] == [te.Linear, torch.nn.ReLU, te.Linear] and model.fp8kit_skipped == []


def test_bad_module_filter():
    with pytest.raises(TypeError, match="module_filter must be callable"):
        te.convert_model(Block(), module_filter="up")


class _Doubler(torch.nn.Module):
    """A layer type of an imagined integration: y = 2 x W.T."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x):
        return 2 * torch.nn.functional.linear(x, self.weight)


def test_integrations_register_layer_types(monkeypatch):
    """convert_model's table of layer types: what an integration registers is converted, by exact type, with the
    shape check of the core; the core knows no integration."""
    from fp8kit.pytorch import convert

    monkeypatch.setattr(convert, "_CONVERTERS", dict(convert._CONVERTERS))

    def to_fp8(layer):
        new = te.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=False, device="meta")
        new.weight = layer.weight
        return new

    convert.register_converter(_Doubler, lambda layer: (layer.weight.shape[1], layer.weight.shape[0]), to_fp8,
                               "Doubler")
    model = torch.nn.Sequential(_Doubler(16, 32), _Doubler(16, 10))
    weight = model[0].weight
    with pytest.warns(UserWarning, match=r"1 \(out_features=10 is not a multiple of 16\)"):
        te.convert_model(model)
    assert type(model[0]) is te.Linear and model[0].weight is weight and type(model[1]) is _Doubler
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        convert.register_converter(int, len, len, "int")


def test_a_layer_type_an_unimported_integration_converts_warns_with_the_import(monkeypatch):
    """A layer known to an integration that is not imported is left alone, with a warning naming the import."""
    from fp8kit.pytorch import convert

    fake = type("Conv1D", (torch.nn.Module,), {"__module__": "transformers.pytorch_utils"})
    monkeypatch.setattr(convert, "_CONVERTERS", {k: v for k, v in convert._CONVERTERS.items()
                                                 if k.__name__ != "Conv1D"})
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), fake(), fake())
    with pytest.warns(UserWarning, match=r"left 2 layers alone that fp8kit.integrations.hf_conv1d converts \(1, 2\): "
                                         r"import fp8kit.integrations.hf_conv1d"):
        te.convert_model(model)
    assert type(model[0]) is te.Linear and type(model[1]) is fake
