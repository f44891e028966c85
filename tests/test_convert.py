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
