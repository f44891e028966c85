"""Failure behaviour (docs/failures.md): copies keep working, double backward is refused, every scale stays finite
and positive with bad values refused where they enter, inference_mode first, empty layers, aborted steps, idle
modules. Each case runs on the CPU fast path and on the tensor path accelerators take."""

import contextlib
import copy
import io
import math
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import host
from fp8kit.recipe import FLT_MAX, SCALE_MIN, DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32

RECIPE = DelayedScaling(amax_history_len=3, interval=2)


@pytest.fixture(params=["host", "tensor"])
def path(request):
    with contextlib.nullcontext() if request.param == "host" else host.tensor_path():
        yield request.param


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(te.Linear(16, 32), torch.nn.GELU(), te.Linear(32, 16))


def step(model, x, recipe=RECIPE):
    with te.autocast(recipe=recipe):
        y = model(x)
    y.square().mean().backward()
    return y.detach()


def states(model):
    out = []
    for m in model.modules():
        if isinstance(m, te.Linear):
            for name in ("scaling_fwd", "scaling_bwd"):
                s = m.fp8_meta[name]
                out += [s.amax_history.clone(), s.scale.clone(), s.count.clone()]
    return out


def inputs(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) * 2.0 ** (k % 5 - 2) for k in range(n)]


# ---- copies ------------------------------------------------------------------------------------------------------

def _torch_save_load(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
          "torch.save": _torch_save_load}


@pytest.mark.parametrize("how", list(COPIES))
def test_copy_continues_exactly_as_the_original(how, path):
    model = make_model()
    for x in inputs(3):
        step(model, x)
    twin = COPIES[how](model)
    for a, b in zip(states(model), states(twin)):
        assert torch.equal(a, b)
    for x in inputs(4, seed=5):
        ya, yb = step(model, x), step(twin, x)
        assert torch.equal(ya, yb)
        for a, b in zip(states(model), states(twin)):
            assert torch.equal(a, b)
    # independent: the copy's tensors are its own, and stepping one leaves the other alone
    for a, b in zip(states(model), states(twin)):
        pass
    sa = model[0].fp8_meta["scaling_fwd"]
    sb = twin[0].fp8_meta["scaling_fwd"]
    assert sa.amax_history.data_ptr() != sb.amax_history.data_ptr()
    before = [t.clone() for t in states(twin)]
    step(model, inputs(1, seed=9)[0] * 100)
    assert all(torch.equal(a, b) for a, b in zip(before, states(twin)))
    assert sb.update_count > 0 and sb.key is not None  # the copy registered itself


def test_copy_loaded_from_a_state_dict_continues(path):
    model = make_model()
    for x in inputs(3):
        step(model, x)
    twin = copy.deepcopy(model)
    twin.load_state_dict(model.state_dict())
    for x in inputs(3, seed=6):
        assert torch.equal(step(model, x), step(twin, x))
    assert all(torch.equal(a, b) for a, b in zip(states(model), states(twin)))


def test_torch_save_model_continues_in_a_new_process(tmp_path):
    model = make_model()
    for x in inputs(3):
        step(model, x)
    torch.save(model, tmp_path / "model.pt")
    for x in inputs(3, seed=7):
        step(model, x)
    script = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
import fp8kit.pytorch as te
from test_failures import inputs, step, states
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
for x in inputs(3, seed=7):
    step(model, x)
torch.save(states(model), {str(tmp_path / "states.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    theirs = torch.load(tmp_path / "states.pt")
    for a, b in zip(states(model), theirs):
        assert torch.equal(a, b)


# ---- double backward ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()])
def test_double_backward_through_fp8_is_refused(recipe):
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = layer(x)
    with pytest.raises(RuntimeError, match="fp8kit: a backward with create_graph=True"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_double_backward_outside_autocast_equals_nn_linear():
    layer = te.Linear(16, 16)
    ref_layer = torch.nn.Linear(16, 16)
    ref_layer.load_state_dict({k: v for k, v in layer.state_dict().items() if "fp8_meta" not in k})
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for m in (layer, ref_layer):
        (gx,) = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
        (gw,) = torch.autograd.grad(gx.square().sum(), m.weight)
        grads.append(gw)
    assert torch.equal(*grads)


# ---- scales are finite and positive; bad values refused where they enter ------------------------------------------

def test_huge_margin_keeps_scales_in_range_and_outputs_finite(path):
    recipe = DelayedScaling(amax_history_len=2, margin=100)
    layer = te.Linear(16, 16)
    refs = ref.DelayedState(2, 3, 448.0, margin=100)
    for k in range(3):
        x = torch.randn(8, 16) * 1e12  # 448 * 2**-100 / 1e12 is below the float32 normal range
        with te.autocast(recipe=recipe):
            y = layer(x)
        assert torch.isfinite(y).all()
        refs.record(0, ref.amax(np32(x)))
        refs.record(1, ref.amax(np32(layer.weight)))
        refs.update()
        scale = layer.fp8_meta["scaling_fwd"].scale
        np.testing.assert_array_equal(scale.numpy(), refs.scale)
        assert ((scale >= SCALE_MIN) & (scale <= FLT_MAX)).all()
    assert scale[0] == SCALE_MIN  # the clamp engaged


def test_margin_that_underflows_is_refused():
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=200)


def _bad(value):
    return lambda amax, scale, fp8_max, recipe: value


@pytest.mark.parametrize("result,match", [
    (torch.full((3,), float("nan")), r"not finite and > 0 .*nan"),
    (torch.full((3,), float("inf")), r"not finite and > 0 .*inf"),
    (torch.zeros(3), r"not finite and > 0 .*0\.0"),
    (torch.tensor([1.0, -2.0, 1.0]), r"not finite and > 0 .*-2\.0"),
    (torch.ones(2), r"shape \[3\].*\(2,\)"),
    ([1.0, 1.0, 1.0], r"got list"),
    (None, r"got NoneType"),
])
def test_bad_scaling_factor_callable_is_refused_and_state_kept(result, match):
    recipe = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=_bad(result))
    layer = te.Linear(16, 16)
    with pytest.raises(ValueError, match=f"scaling_factor_compute_algo .*{match}"):
        with te.autocast(recipe=recipe):
            layer(torch.randn(4, 16))
    assert torch.equal(layer.fp8_meta["scaling_fwd"].scale, torch.ones(3))  # never stored


@pytest.mark.parametrize("result,match", [(torch.ones(5), r"shape \[3\]"), ("x", "got str"), (None, "NoneType")])
def test_bad_amax_callable_is_named(result, match):
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: result)
    layer = te.Linear(16, 16)
    with pytest.raises(ValueError, match=f"amax_compute_algo .*{match}"):
        with te.autocast(recipe=recipe):
            layer(torch.randn(4, 16))


def _trained_state_dict():
    layer = te.Linear(16, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(4, 16)).sum().backward()
    return layer.state_dict()


_COUNT = r"must be an integer in \[0, 2\*\*63 - 1\]"


@pytest.mark.parametrize("key,value,match", [
    ("fp8_meta.scaling_fwd.scale", torch.tensor([1e39, 1.0, 1.0], dtype=torch.float64), "not finite and within"),
    ("fp8_meta.scaling_fwd.scale", torch.tensor([1e-46, 1.0, 1.0], dtype=torch.float64), "not finite and within"),
    ("fp8_meta.scaling_fwd.scale", torch.ones(3, dtype=torch.int32), "must be floating"),
    ("fp8_meta.scaling_fwd.scale", torch.ones(4), r"must have shape \[3\]"),
    ("fp8_meta.scaling_fwd.amax_history", -torch.ones(4, 3), "negative"),
    ("fp8_meta.scaling_fwd.amax_history", torch.tensor([[0.5, float("nan"), 1.0]] * 4), "holds NaN"),
    ("fp8_meta.scaling_fwd.amax_history", torch.full((4, 3), 1e39, dtype=torch.float64), "beyond float32's range"),
    ("fp8_meta.scaling_fwd.amax_history", torch.ones(4, 2), r"must have shape \[L >= 1, 3\]"),
    ("fp8_meta.scaling_fwd.amax_history", torch.ones(4, 3, dtype=torch.bool), "real number tensor"),
    ("fp8_meta.scaling_bwd.amax_history", torch.ones(4, 2, dtype=torch.int64), "must be floating"),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor([1, 2]), r"shape \[\] or \[1\]"),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(float("nan")), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(float("inf")), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(-1), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(1.5), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(1e30, dtype=torch.float64), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(2.0 ** 63, dtype=torch.float64), _COUNT),
    ("fp8_meta.scaling_bwd.update_count", torch.tensor(True), "real number tensor"),
    ("fp8_meta.scaling_bwd.update_count", 3, "must be a tensor"),
])
def test_bad_checkpoint_entries_name_the_key_and_load_nothing(key, value, match):
    """Every bad FP8 entry raises a ValueError naming its key, before anything of the module (its weights
    included) is loaded: the module's whole state_dict is the same afterwards."""
    sd = dict(_trained_state_dict(), **{key: value})
    sd["weight"] = sd["weight"] + 1.0  # a good entry that must not load either
    layer = te.Linear(16, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(4, 16)).sum().backward()  # some FP8 state of its own
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{re.escape(key)}: .*{match}"):
        layer.load_state_dict(sd)
    after = layer.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    fresh = te.Linear(16, 16)
    with pytest.raises(RuntimeError, match=re.escape(key)):  # also what torch's load_state_dict errors are
        fresh.load_state_dict(sd, strict=False)
    assert fresh.fp8_meta["scaling_fwd"] is None  # nothing half-loaded


def test_counts_up_to_int64_load_exactly():
    sd = _trained_state_dict()
    for count in (torch.tensor(2 ** 63 - 1), torch.tensor([7], dtype=torch.int32), torch.tensor(5.0)):
        layer = te.Linear(16, 16)
        layer.load_state_dict(dict(sd, **{"fp8_meta.scaling_bwd.update_count": count}))
        assert layer.fp8_meta["scaling_bwd"].update_count == int(count.reshape(()).item())


def test_misspelt_fp8_meta_keys_are_unexpected_under_strict():
    sd = _trained_state_dict()
    sd["fp8_meta.scaling_fwd.amax_histroy"] = sd["fp8_meta.scaling_fwd.amax_history"]
    with pytest.raises(RuntimeError, match="amax_histroy"):
        te.Linear(16, 16).load_state_dict(sd)
    result = te.Linear(16, 16).load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["fp8_meta.scaling_fwd.amax_histroy"]


# ---- valid input that used to crash ------------------------------------------------------------------------------

def test_inference_mode_first_then_training(path):
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.inference_mode(), te.autocast(recipe=RECIPE):
        layer(x)
    with te.autocast(recipe=RECIPE):
        y = layer(x)
    y.sum().backward()
    assert layer.fp8_meta["scaling_bwd"].update_count == 1
    assert not layer.fp8_meta["scaling_fwd"].amax_history.is_inference()


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()])
def test_zero_in_features_returns_the_bias_like_nn_linear(recipe, path):
    layer = te.Linear(0, 16)
    with torch.no_grad():
        layer.bias.uniform_()
    x = torch.randn(4, 0, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = layer(x)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((16,), 4.0))


# ---- aborted steps and idle modules ------------------------------------------------------------------------------

def test_aborted_step_amaxes_are_discarded(path):
    recipe = DelayedScaling(amax_history_len=3)
    layer, clean = te.Linear(16, 16), te.Linear(16, 16)
    clean.load_state_dict(layer.state_dict())
    x = torch.randn(4, 16)
    with pytest.raises(KeyError):
        with te.autocast(recipe=recipe):
            layer(x * 1e6)
            raise KeyError("a bad batch")
    assert layer.fp8_meta["scaling_fwd"].amax_history.abs().sum() == 0
    for m in (layer, clean):
        with te.autocast(recipe=recipe):
            m(x)
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, clean.fp8_meta["scaling_fwd"].amax_history)
    assert torch.equal(layer.fp8_meta["scaling_fwd"].scale, clean.fp8_meta["scaling_fwd"].scale)


def test_idle_modules_keep_their_own_interval_schedule(path):
    """With interval > 1 a module's schedule counts only the updates it takes part in, so other models sharing the
    recipe do not shift it."""
    recipe = DelayedScaling(amax_history_len=4, interval=2)
    busy, idle, alone = te.Linear(16, 16), te.Linear(16, 16), te.Linear(16, 16)
    alone.load_state_dict(idle.state_dict())
    for x in inputs(3):  # only `busy` runs: three updates of the shared key
        with te.autocast(recipe=recipe):
            busy(x)
    for m in (idle, alone):  # `idle` registers now, behind `busy`; `alone` has the key to itself
        with te.autocast(recipe=recipe):
            m(inputs(1)[0])
    assert idle.fp8_meta["scaling_fwd"].update_count == 1
    for x in inputs(4, seed=11):
        for m in (idle, alone):
            with te.autocast(recipe=recipe):
                m(x)
    # `alone` ran the same sequence without a busy neighbour: same counter, same scales, same history
    fi, fa = idle.fp8_meta["scaling_fwd"], alone.fp8_meta["scaling_fwd"]
    assert fi.update_count == fa.update_count == 5
    assert torch.equal(fi.scale, fa.scale) and torch.equal(fi.amax_history, fa.amax_history)
    assert not math.isnan(float(fi.scale[0]))
