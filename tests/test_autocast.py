"""autocast: registration, nesting, when the forward and backward updates run, calibration."""

import numpy as np
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.autocast import registry_states
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32


def hist(layer, which="scaling_fwd"):
    return layer.fp8_meta[which].amax_history


def test_forward_update_at_outermost_exit_backward_update_after_backward():
    recipe = DelayedScaling(amax_history_len=3)
    layer = te.Linear(8, 8)
    x = torch.randn(4, 8) * 3
    with te.autocast(recipe=recipe):
        with te.autocast(recipe=recipe):
            y = layer(x)
        assert hist(layer)[0, 0] == ref.amax(np32(x))  # inner exit: no update yet
        assert hist(layer)[-1, 0] == 0
    assert hist(layer)[0, 0] == 0 and hist(layer)[-1, 0] == ref.amax(np32(x))  # rolled at the outer exit
    assert layer.fp8_meta["scaling_fwd"].scale[0] == np.float32(448) / ref.amax(np32(x))
    assert hist(layer, "scaling_bwd").abs().sum() == 0
    g = torch.randn(4, 8)
    y.backward(g)
    assert hist(layer, "scaling_bwd")[-1, 0] == ref.amax(np32(g))  # rolled after the backward
    assert hist(layer, "scaling_bwd")[0, 0] == 0


def test_backward_update_waits_for_the_last_module():
    recipe = DelayedScaling(amax_history_len=2)
    a, b = te.Linear(8, 8), te.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with te.autocast(recipe=recipe):
        h = a(x)
        y = b(h)
    seen = {}

    def check(grad):  # runs between b's backward and a's backward
        seen["b_staging"] = hist(b, "scaling_bwd")[0, 0].item()
        seen["b_rolled"] = hist(b, "scaling_bwd")[-1, 0].item()
        return grad

    h.register_hook(check)
    y.sum().backward()
    assert seen["b_staging"] == 1.0 and seen["b_rolled"] == 0.0  # b staged, nothing updated yet
    assert hist(b, "scaling_bwd")[-1, 0] == 1.0 and hist(a, "scaling_bwd")[-1, 0] > 0


def test_module_called_twice_max_accumulates():
    recipe = DelayedScaling(amax_history_len=2)
    layer = te.Linear(8, 8)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8) * 10
    with te.autocast(recipe=recipe):
        layer(x1)
        layer(x2)
        layer(x1)
    assert hist(layer)[1, 0] == max(ref.amax(np32(x1)), ref.amax(np32(x2)))


def test_no_grad_skips_the_forward_update():
    recipe = DelayedScaling(amax_history_len=2)
    layer = te.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.no_grad(), te.autocast(recipe=recipe):
        layer(x)
    assert hist(layer)[0, 0] == ref.amax(np32(x)) and hist(layer)[1, 0] == 0  # staged, not rolled
    with te.autocast(recipe=recipe):
        layer(x * 2)
    assert hist(layer)[1, 0] == ref.amax(np32(x * 2))


def test_inner_autocast_changes_enabled_and_recipe():
    delayed = DelayedScaling(amax_history_len=2)
    a, b, c = te.Linear(8, 8), te.Linear(8, 8), te.Linear(8, 8)
    x = torch.randn(4, 8)
    with te.autocast(recipe=delayed):
        ya = a(x)
        with te.autocast(enabled=False):
            yb = b(x)
        with te.autocast(recipe=Float8CurrentScaling()):
            yc = c(x)
    assert torch.equal(yb, torch.nn.functional.linear(x, b.weight, b.bias))
    assert b.fp8_meta["scaling_fwd"] is None and c.fp8_meta["scaling_fwd"] is None
    assert a.fp8_meta["scaling_fwd"] is not None
    assert not torch.equal(yc, torch.nn.functional.linear(x, c.weight, c.bias))
    assert not torch.equal(ya, torch.nn.functional.linear(x, a.weight, a.bias))


def test_calibration_records_without_fp8():
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with te.autocast(enabled=False, calibrating=True, recipe=recipe):
        y = layer(x)
    g = torch.randn(4, 8)
    y.backward(g)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))  # high precision
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    assert fwd.scale[0] == np.float32(448) / ref.amax(np32(x))
    assert fwd.scale[1] == np.float32(448) / ref.amax(np32(layer.weight))
    assert bwd.scale[0] == np.float32(57344) / ref.amax(np32(g))
    # a later FP8 run starts from the calibrated scales
    with te.autocast(recipe=recipe):
        y8 = layer(x)
    assert (y8 - y).abs().max() < 0.1 * y.abs().max()


def test_registry_keys_distinguish_every_field_and_group_modules():
    r1 = DelayedScaling(amax_history_len=4, margin=13)  # recipes no other test uses: registries of their own
    r2 = DelayedScaling(amax_history_len=4, margin=1.5)
    a, b, c = te.Linear(8, 8), te.Linear(8, 8), te.Linear(8, 8)
    x = torch.randn(2, 8)
    with te.autocast(recipe=r1):
        a(x)
        b(x)
    with te.autocast(recipe=r2):
        c(x)
    fwd1, bwd1 = registry_states(r1)
    fwd2, _ = registry_states(r2)
    assert fwd1 == [a.fp8_meta["scaling_fwd"], b.fp8_meta["scaling_fwd"]]
    assert bwd1 == [a.fp8_meta["scaling_bwd"], b.fp8_meta["scaling_bwd"]]
    assert fwd2 == [c.fp8_meta["scaling_fwd"]]
    want = np.float32(np.float32(448) * np.float32(2 ** -1.5)) / ref.amax(np32(x))  # margin 1.5 applied
    assert c.fp8_meta["scaling_fwd"].scale[0] == want
    # moving a module to another recipe re-registers it there
    with te.autocast(recipe=r2):
        a(x)
    assert registry_states(r1)[0] == [b.fp8_meta["scaling_fwd"]]
    assert registry_states(r2)[0] == [c.fp8_meta["scaling_fwd"], a.fp8_meta["scaling_fwd"]]
    del b, fwd1, bwd1, fwd2
    import gc

    gc.collect()
    assert registry_states(r1)[0] == []  # dead modules leave the registry


def test_history_length_change_resizes_state():
    layer = te.Linear(8, 8)
    x = torch.randn(2, 8)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(x)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        layer(x * 3)
    h = hist(layer)
    assert h.shape == (2, 3) and h[1, 0] == ref.amax(np32(x * 3))


def test_fp8_autocast_alias_uses_older_names():
    recipe = DelayedScaling(amax_history_len=2, margin=2)
    layer = te.Linear(8, 8)
    x = torch.randn(2, 8)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        layer(x)
    assert layer.fp8_meta["recipe"] == recipe and layer.fp8_meta["recipe"] is recipe.snapshot()  # fields at entry
    assert layer.fp8_meta["scaling_fwd"].scale[0] == np.float32(112) / ref.amax(np32(x))


def test_exception_inside_autocast_skips_update_and_resets_stack():
    from fp8kit.pytorch.autocast import current_frame

    layer = te.Linear(8, 8)
    try:
        with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
            layer(torch.randn(2, 8))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert current_frame() is None
    assert hist(layer)[1, 0] == 0
