"""LayerNormMLP under activation recompute and copies (SPEC section 8b): `te.checkpoint`, torch's checkpoint and the
module's own `checkpoint=True` give gradients, histories and scales bit-identical to no recompute; a deepcopy
continues exactly as the original."""

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

from test_recompute import assert_identical

RECIPES = {"delayed": DelayedScaling(amax_history_len=3, margin=1), "current": Float8CurrentScaling()}
CHECKPOINTS = {
    "none": lambda mlp, h: mlp(h),
    "te-reentrant": lambda mlp, h: te.checkpoint(mlp, h, use_reentrant=True),
    "te-nonreentrant": lambda mlp, h: te.checkpoint(mlp, h, use_reentrant=False),
    "torch-nonreentrant": lambda mlp, h: torch_checkpoint.checkpoint(mlp, h, use_reentrant=False),
}


class Model(torch.nn.Module):
    def __init__(self, activation, module_checkpoint=False):
        super().__init__()
        self.inp = te.Linear(16, 32)
        self.mlp = te.LayerNormMLP(32, 48, activation=activation, checkpoint=module_checkpoint)
        self.head = te.Linear(32, 16)


def _states(model):
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        for name in ("scaling_fwd", "scaling_bwd"):
            if meta is not None and meta[name] is not None:
                out += [meta[name].amax_history.clone(), meta[name].scale.clone(), meta[name].count.clone()]
    return out


def train(recipe, how, activation="swiglu", steps=3, model=None):
    torch.manual_seed(0)
    model = model or Model(activation, module_checkpoint=how == "module")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CHECKPOINTS.get(how, CHECKPOINTS["none"])
    g = torch.Generator().manual_seed(1)
    seen = []
    for s in range(steps):
        # magnitudes change every step, so the delayed scales move between a forward and its recompute
        x = (torch.randn(6, 16, generator=g) * 2.0 ** ((3 * s) % 5 - 2)).requires_grad_()
        with te.autocast(recipe=recipe):
            y = model.head(ckpt(model.mlp, model.inp(x)))
        loss = (y ** 2).mean()
        opt.zero_grad()
        loss.backward()
        seen.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()] + _states(model))
        opt.step()
    return seen


@functools.lru_cache(maxsize=None)
def _baseline(recipe):
    return train(RECIPES[recipe], "none")


@pytest.mark.parametrize("how", ["te-reentrant", "te-nonreentrant", "torch-nonreentrant", "module"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recompute_is_bit_identical_to_no_recompute(recipe, how):
    want = _baseline(recipe)
    got = train(RECIPES[recipe], how)
    assert_identical(got, want)


def test_the_mlp_scales_move_between_steps():
    """Otherwise a recompute with stale scales could not be told from a right one."""
    seen = _baseline("delayed")
    n_params = len(list(Model("swiglu").parameters()))
    # per module: fwd history, scale, count, bwd history, scale, count; inp comes first, then the MLP
    mlp_fwd_scale = [step[1 + n_params + 6 + 1] for step in seen]
    assert mlp_fwd_scale[0].shape == (6,)
    assert all(not torch.equal(a, b) for a, b in zip(mlp_fwd_scale, mlp_fwd_scale[1:]))


def test_deepcopy_continues_exactly_as_the_original():
    recipe = RECIPES["delayed"]
    torch.manual_seed(2)
    mlp = te.LayerNormMLP(32, 48, activation="gelu")
    xs = [torch.randn(5, 32) * (1 + k) for k in range(5)]

    def step(module, x):
        with te.autocast(recipe=recipe):
            y = module(x.clone().requires_grad_())
        y.square().mean().backward()
        return y.detach()

    for x in xs[:2]:
        step(mlp, x)
    mlp.zero_grad()
    twin = copy.deepcopy(mlp)
    for x in xs[2:]:
        assert torch.equal(step(mlp, x), step(twin, x))
        for name in ("scaling_fwd", "scaling_bwd"):
            a, b = mlp.fp8_meta[name], twin.fp8_meta[name]
            assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
            assert a.amax_history.data_ptr() != b.amax_history.data_ptr()
        for p, q in zip(mlp.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None


def test_module_checkpoint_saves_no_activation():
    """checkpoint=True keeps no FP8 operand or activation for backward: the forward runs again."""
    def saved_dtypes(module):
        dtypes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.append(t.dtype) or t, lambda t: t):
            with te.autocast(recipe=RECIPES["delayed"]):
                module(torch.randn(4, 32, requires_grad=True))
        return dtypes

    torch.manual_seed(3)
    assert torch.float8_e4m3fn in saved_dtypes(te.LayerNormMLP(32, 48))
    assert torch.float8_e4m3fn not in saved_dtypes(te.LayerNormMLP(32, 48, checkpoint=True))
