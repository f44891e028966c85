"""convert_model(fuse_layernorm=...): norm + Linear pairs become LayerNormLinear. Under FP8 the fused model equals the
Linear-only conversion bit for bit; outside autocast it equals the original model; the default is unchanged."""

import copy

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling


class Block(torch.nn.Module):
    """Attribute pairs (as in Transformer Engine's quickstart layer): ln1 -> proj, mlp.ln -> mlp.fc1."""

    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(32)
        self.proj = torch.nn.Linear(32, 32)
        self.mlp = torch.nn.Module()
        self.mlp.ln = torch.nn.RMSNorm(32, eps=1e-6)
        self.mlp.fc1 = torch.nn.Linear(32, 64)
        self.mlp.fc2 = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        x = x + self.proj(self.ln1(x))
        return x + self.mlp.fc2(torch.relu(self.mlp.fc1(self.mlp.ln(x))))


def sequential_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.GELU(),
        torch.nn.Sequential(torch.nn.RMSNorm(64, eps=1e-5), torch.nn.Linear(64, 32, bias=False)),
        te.LayerNorm(32, zero_centered_gamma=True), torch.nn.Linear(32, 48),
        torch.nn.LayerNorm(48), torch.nn.Linear(48, 10),  # 10: not an FP8 shape, neither fused nor converted
    )
    with torch.no_grad():  # norms that do something
        for m in model.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm, te.LayerNorm)):
                m.weight.uniform_(-0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)
    return model


def block_model():
    torch.manual_seed(1)
    model = Block()
    with torch.no_grad():
        model.ln1.weight.uniform_(0.5, 1.5)
        model.mlp.ln.weight.uniform_(0.5, 1.5)
    return model


def steps(model, recipe, n=3, width=32, seed=3):
    """Outputs and all parameter gradients of n FP8 training steps (SGD between them)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(n):
        x = torch.randn(6, width, generator=gen) * 2
        with te.autocast(recipe=recipe):
            y = model(x)
        opt.zero_grad()
        y.square().mean().backward()
        results.append(y.detach())
        results += [p.grad.clone() for p in model.parameters()]
        opt.step()
    return results


def assert_all_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


@pytest.mark.filterwarnings("ignore:convert_model left these layers")
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()])
@pytest.mark.parametrize("make, fuse, width", [
    (sequential_model, True, 32),
    (block_model, {"ln1": "proj", "mlp.ln": "mlp.fc1"}, 32),
])
def test_fused_equals_linear_only_conversion_and_the_original(recipe, make, fuse, width):
    original = make()
    linear_only = te.convert_model(copy.deepcopy(original))
    fused = copy.deepcopy(original)
    params = list(fused.parameters())
    te.convert_model(fused, fuse_layernorm=fuse)
    assert {id(p) for p in fused.parameters()} == {id(p) for p in params}  # the same Parameter objects
    n_fused = sum(type(m) is te.LayerNormLinear for m in fused.modules())
    assert n_fused == len(fused.fp8kit_fused) == (3 if make is sequential_model else 2)
    assert sum(type(m) is torch.nn.Identity for m in fused.modules()) == n_fused
    x = torch.randn(5, width)
    assert torch.equal(fused(x), original(x))  # outside autocast: the original model's numbers
    assert_all_equal(steps(fused, recipe), steps(linear_only, recipe))


def test_what_is_and_is_not_fused():
    model = sequential_model()
    with pytest.warns(UserWarning, match=r"7 \(out_features=10"):  # the Linear convert_model leaves alone
        te.convert_model(model, fuse_layernorm=True)
    assert sorted(model.fp8kit_fused) == [("0", "1"), ("3.0", "3.1"), ("4", "5")]
    assert type(model[6]) is torch.nn.LayerNorm and type(model[7]) is torch.nn.Linear  # 48 -> 10 left alone
    assert model[5].zero_centered_gamma and model[3][1].normalization == "RMSNorm" and model[3][1].eps == 1e-5
    keys = list(model.state_dict())
    assert "1.layer_norm_weight" in keys and "1.layer_norm_bias" in keys and "3.1.layer_norm_bias" not in keys
    assert not any(k.startswith("0.") for k in keys)
    # attribute pairs are not guessed: only Sequential neighbours
    block = block_model()
    te.convert_model(block, fuse_layernorm=True)
    assert block.fp8kit_fused == [] and type(block.ln1) is torch.nn.LayerNorm and type(block.proj) is te.Linear


def test_default_and_filter_leave_norms_alone():
    model = sequential_model()
    with pytest.warns(UserWarning, match="10"):
        te.convert_model(model)
    assert type(model[0]) is torch.nn.LayerNorm and type(model[1]) is te.Linear
    assert not hasattr(model, "fp8kit_fused")
    model = sequential_model()
    with pytest.warns(UserWarning):
        te.convert_model(model, module_filter=lambda m, name: name != "1", fuse_layernorm=True)
    assert type(model[0]) is torch.nn.LayerNorm and type(model[1]) is torch.nn.Linear  # filtered out: untouched
    assert type(model[5]) is te.LayerNormLinear


def test_named_pairs_are_checked():
    cases = [
        ({"ln9": "proj"}, ValueError, "'ln9', which Block does not have"),
        ({"proj": "mlp.fc1"}, TypeError, "'proj' cannot be fused: Linear is not a LayerNorm or RMSNorm"),
        ({"ln1": "mlp"}, TypeError, "'mlp' is a Module, not a torch.nn.Linear"),
        ({"ln1": "mlp.fc2"}, ValueError, "'ln1' normalises 32 features but 'mlp.fc2' takes in_features=64"),
        ({"ln1": "proj", "mlp.ln": "proj"}, ValueError, "'proj' is named for two norms"),
        ({"ln1": 3}, TypeError, "got the Linear 3"),
        ("yes", TypeError, "fuse_layernorm must be a bool or a dict"),
    ]
    for fuse, error, message in cases:
        model = block_model()
        with pytest.raises(error, match=message):
            te.convert_model(model, fuse_layernorm=fuse)
        assert type(model.ln1) is torch.nn.LayerNorm and type(model.proj) is torch.nn.Linear  # nothing changed
    model = torch.nn.Sequential(torch.nn.RMSNorm(32), torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match="eps=None"):
        te.convert_model(model, fuse_layernorm={"0": "1"})
    te.convert_model(model, fuse_layernorm=True)  # not fused automatically either
    assert type(model[0]) is torch.nn.RMSNorm and type(model[1]) is te.Linear
