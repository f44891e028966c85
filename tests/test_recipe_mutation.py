"""A recipe assigned to between steps acts from the next autocast entry on, as a new recipe with those fields would,
and never changes a state or a step built for its old values (the snapshot autocast keys on). Checked against
tests/reference.py's delayed-scaling rule, against a second module run under a freshly built recipe, and under
torch.compile."""

import numpy as np
import pytest
import torch
from test_linear import make_refs, step_inputs

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32

MUTATE_AT = 5


def resized(history: np.ndarray, length: int) -> np.ndarray:
    """fp8kit's documented resize rule (docs/pytorch.md, "Checkpoints"): row 0 kept, the newest past rows kept,
    zeros for the oldest."""
    out = np.zeros((length, history.shape[1]), dtype=np.float32)
    out[0] = history[0]
    keep = min(len(history), length) - 1
    if keep > 0:
        out[length - keep:] = history[len(history) - keep:]
    return out


def follow(r: ref.DelayedState, recipe) -> None:
    """Make a reference state follow a recipe's new fields."""
    if r.history.shape[0] != recipe.amax_history_len:
        r.history = resized(r.history, recipe.amax_history_len)
    r.margin, r.algo, r.interval, r.power_2 = recipe.margin, recipe.amax_compute_algo, recipe.interval, \
        recipe.power_2_scale


@pytest.mark.parametrize("change", [
    dict(amax_history_len=7), dict(amax_history_len=2), dict(amax_history_len=1), dict(margin=2),
    dict(amax_compute_algo="most_recent"), dict(margin=1.5, amax_history_len=6, power_2_scale=True),
])
def test_assignment_between_steps_acts_like_a_new_recipe(change):
    rng = np.random.default_rng(1)
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=4)
    fresh_recipe = DelayedScaling(amax_history_len=4)
    mutated, fresh = te.Linear(16, 24), te.Linear(16, 24)
    fresh.load_state_dict(mutated.state_dict())
    refs = make_refs(recipe)
    old = recipe.snapshot()
    for step in range(12):
        if step == MUTATE_AT:
            for name, value in change.items():
                setattr(recipe, name, value)
            fresh_recipe = DelayedScaling(**{**{n: getattr(old, n) for n in ("amax_history_len", "margin")},
                                             **change})
            for r in refs:
                follow(r, recipe)
        x, g = step_inputs(step, rng, (6, 16))
        outs = []
        for layer, r in ((mutated, recipe), (fresh, fresh_recipe)):
            with te.autocast(recipe=r):
                out = layer(torch.from_numpy(x))
            (out * torch.from_numpy(g)).sum().backward()
            outs.append(out)
        fwd, bwd = refs
        fwd.record(0, ref.amax(x))
        fwd.record(1, ref.amax(np32(mutated.weight)))
        bwd.record(0, ref.amax(g))
        fwd.update()
        bwd.update()
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
        for name, r in (("scaling_fwd", fwd), ("scaling_bwd", bwd)):
            state, twin = mutated.fp8_meta[name], fresh.fp8_meta[name]
            np.testing.assert_array_equal(state.amax_history.numpy(), r.history, err_msg=f"step {step} {name}")
            np.testing.assert_array_equal(state.scale.numpy(), r.scale, err_msg=f"step {step} {name}")
            assert torch.equal(state.amax_history, twin.amax_history) and torch.equal(state.scale, twin.scale)
        torch.testing.assert_close(mutated.weight.grad, fresh.weight.grad, rtol=0, atol=0, equal_nan=True)
    assert mutated.fp8_meta["recipe"] == recipe and old.amax_history_len == 4 and old.margin == 0
    from fp8kit.pytorch.registry import registry_states  # the old key holds none of the moved states

    assert mutated.fp8_meta["scaling_fwd"] not in registry_states(old)[0]


def test_assignment_inside_a_step_acts_from_the_next_entry():
    """The step already entered keeps the fields it entered with (its update included)."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=3, margin=0)
    layer = te.Linear(16, 16)
    fwd, bwd = make_refs(recipe)
    x = torch.randn(4, 16) * 3
    for step in range(3):
        with te.autocast(recipe=recipe):
            out = layer(x)
            if step == 1:
                recipe.margin = 3  # mid-step: this step's update still uses margin 0
        out.sum().backward()
        fwd.record(0, ref.amax(np32(x)))
        fwd.record(1, ref.amax(np32(layer.weight)))
        bwd.record(0, 1.0)
        fwd.update()
        bwd.update()
        np.testing.assert_array_equal(layer.fp8_meta["scaling_fwd"].scale.numpy(), fwd.scale, err_msg=f"{step}")
        np.testing.assert_array_equal(layer.fp8_meta["scaling_bwd"].scale.numpy(), bwd.scale, err_msg=f"{step}")
        if step == 1:
            fwd.margin = bwd.margin = 3


def test_current_scaling_assignment_acts_at_next_entry():
    """Float8CurrentScaling: use_power_2_scales assigned between steps changes the casts of the next step only."""
    torch.manual_seed(0)
    recipe = Float8CurrentScaling()
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16) * 3
    with te.autocast(recipe=recipe):
        plain = layer(x)
    recipe.use_power_2_scales = True
    with te.autocast(recipe=recipe):
        pow2 = layer(x)
    with te.autocast(recipe=Float8CurrentScaling(use_power_2_scales=True)):
        fresh = layer(x)
    assert torch.equal(pow2, fresh) and not torch.equal(plain, pow2)


def test_compiled_function_recompiles_for_an_assigned_recipe():
    """torch.compile guards on the recipe's snapshot: assigning a field retraces, and the compiled steps follow the
    eager ones bit for bit before and after."""
    import torch._dynamo
    import torch._dynamo.testing

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, compiled = te.Linear(32, 16), te.Linear(32, 16)
    compiled.load_state_dict(eager.state_dict())
    recipe = DelayedScaling(amax_history_len=4)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(x, r):
        with te.autocast(recipe=r):
            return compiled(x)

    fn = torch.compile(step, fullgraph=True, backend=counter, dynamic=False)
    frames = []
    try:
        for i in range(6):
            if i == 3:
                recipe.margin = 2
                recipe.amax_compute_algo = "most_recent"
            x = torch.randn(8, 32) * 10.0 ** (i % 3 - 1)
            with te.autocast(recipe=recipe):
                y_e = eager(x)
            y_e.sum().backward()
            y_c = fn(x, recipe)
            y_c.sum().backward()
            te.apply_pending_updates()
            frames.append(counter.frame_count)
            assert torch.equal(y_e, y_c), f"step {i}"
            for name in ("scaling_fwd", "scaling_bwd"):
                assert torch.equal(eager.fp8_meta[name].scale, compiled.fp8_meta[name].scale), f"step {i} {name}"
                assert torch.equal(eager.fp8_meta[name].amax_history, compiled.fp8_meta[name].amax_history)
    finally:
        torch._dynamo.reset()
    assert frames[2] == frames[1] and frames[3] > frames[2] and frames[5] == frames[4], frames
