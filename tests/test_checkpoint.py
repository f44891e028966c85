"""Checkpoints: FP8 state as plain tensors; save, load and continue equals never stopping."""

import copy
import io

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=5, interval=2)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(te.Linear(16, 32), torch.nn.GELU(), te.Linear(32, 16))


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen) * 4
        with te.autocast(recipe=RECIPE):
            loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # no pickle of arbitrary objects


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_state_dict_holds_plain_tensors():
    model = make_model()
    train(model, torch.optim.SGD(model.parameters(), lr=0.01), 2, seed=1)
    sd = model.state_dict()
    assert "0.fp8_meta.scaling_fwd.amax_history" in sd and "2.fp8_meta.scaling_bwd.scale" in sd
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert sd["0.fp8_meta.scaling_fwd.amax_history"].shape == (5, 3)
    assert sd["0.fp8_meta.scaling_bwd.scale"].shape == (2,)
    assert sd["0.fp8_meta.scaling_fwd.update_count"].item() == 2


def test_save_load_continue_is_bit_identical_to_never_stopping():
    straight = make_model()
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    losses_straight = train(straight, opt, 4, seed=2) + train(straight, opt, 5, seed=3)
    # snapshot now: modules registered under one recipe all take part in its updates (as in Transformer Engine),
    # so `straight` would keep counting updates while the other models train
    straight_state = copy.deepcopy(straight.state_dict())
    del straight, opt

    first = make_model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    losses = train(first, opt1, 4, seed=2)
    ckpt = roundtrip({"model": first.state_dict(), "opt": opt1.state_dict()})
    del first, opt1

    resumed = make_model(seed=99)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])  # before any forward
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    losses += train(resumed, opt2, 5, seed=3)
    assert losses == losses_straight
    got = resumed.state_dict()
    assert list(got) == list(straight_state)
    for k in got:
        assert torch.equal(got[k], straight_state[k]), k


def test_load_into_used_module_replaces_state():
    a, b = make_model(1), make_model(2)
    train(a, torch.optim.SGD(a.parameters(), lr=0.01), 3, seed=4)
    train(b, torch.optim.SGD(b.parameters(), lr=0.01), 1, seed=5)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert_same_state(a, b)


def test_nn_linear_checkpoint_loads_strictly_and_fp8_checkpoint_loads_into_nn_linear_non_strictly():
    plain = torch.nn.Linear(16, 32)
    ours = te.Linear(16, 32)
    ours.load_state_dict(plain.state_dict())  # strict: no fp8 keys required
    assert torch.equal(ours.weight, plain.weight)
    with te.autocast(recipe=RECIPE):
        ours(torch.randn(2, 16))
    result = plain.load_state_dict(ours.state_dict(), strict=False)
    assert all("fp8_meta" in k for k in result.unexpected_keys) and not result.missing_keys


@pytest.mark.parametrize("new_len", [2, 5, 9])
def test_history_length_rule_on_load(new_len):
    src = te.Linear(16, 16)
    for step in range(6):
        with te.autocast(recipe=RECIPE):
            src(torch.randn(4, 16) * (step + 1))
    sd = src.state_dict()
    old = sd["fp8_meta.scaling_fwd.amax_history"]
    dst = te.Linear(16, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=new_len)):
        dst(torch.zeros(4, 16))  # registered with the new length
    dst.load_state_dict(sd)
    got = dst.fp8_meta["scaling_fwd"].amax_history
    assert got.shape == (new_len, 3)
    keep = min(5, new_len) - 1
    assert torch.equal(got[new_len - keep:], old[5 - keep:])  # newest past amaxes kept
    assert torch.equal(got[0], old[0])
    assert got[1:new_len - keep].abs().sum() == 0  # padding is zeros (oldest positions)
    # a fresh module keeps the checkpoint's length until it registers under a recipe
    fresh = te.Linear(16, 16)
    fresh.load_state_dict(sd)
    assert fresh.fp8_meta["scaling_fwd"].amax_history.shape == (5, 3)
    with te.autocast(recipe=DelayedScaling(amax_history_len=new_len)):
        fresh(torch.zeros(4, 16))
    assert fresh.fp8_meta["scaling_fwd"].amax_history.shape == (new_len, 3)


def test_bad_fp8_entries_get_clear_errors():
    src = te.Linear(16, 16)
    with te.autocast(recipe=RECIPE):
        src(torch.randn(4, 16))
    sd = src.state_dict()
    bad_shape = dict(sd, **{"fp8_meta.scaling_fwd.scale": torch.ones(4)})
    with pytest.raises(ValueError, match=r"fp8_meta.scaling_fwd.scale: must have shape \[3\]"):
        te.Linear(16, 16).load_state_dict(bad_shape)
    missing = {k: v for k, v in sd.items() if k != "fp8_meta.scaling_bwd.update_count"}
    with pytest.raises(ValueError, match="fp8_meta.scaling_bwd: missing update_count"):
        te.Linear(16, 16).load_state_dict(missing)
    zero_scale = dict(sd, **{"fp8_meta.scaling_fwd.scale": torch.zeros(3)})
    with pytest.raises(ValueError, match="fp8_meta.scaling_fwd.scale: holds values that are not finite and within"):
        te.Linear(16, 16).load_state_dict(zero_scale)


def test_saving_with_a_deferred_backward_update_warns(monkeypatch):
    import importlib

    ac = importlib.import_module("fp8kit.pytorch.autocast")  # the module, not the function of that name

    layer = te.Linear(16, 16)
    with te.autocast(recipe=RECIPE):
        layer(torch.randn(4, 16)).sum().backward()
    monkeypatch.setitem(ac._PENDING_BACKWARD, layer.fp8_meta["scaling_bwd"].key, None)  # as amax reduction does
    with pytest.warns(UserWarning, match="apply_pending_updates"):
        layer.state_dict()
    monkeypatch.delitem(ac._PENDING_BACKWARD, layer.fp8_meta["scaling_bwd"].key)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.state_dict()
