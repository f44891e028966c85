"""The batched delayed-scaling update against tests/reference.py, and its cost in dispatched operations."""

import contextlib
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.pytorch import host
from fp8kit.pytorch.state import ScalingState, resized_history, update_states
from fp8kit.recipe import DelayedScaling, Format

import reference as ref


@pytest.fixture(autouse=True, params=["host", "tensor"])
def path(request):
    """Every test runs on the CPU fast path (NumPy, fp8kit.pytorch.host) and on the torch-operation path that
    accelerators use."""
    if request.param == "host":
        yield request.param
    else:
        with host.tensor_path():
            yield request.param


def run_both(recipe, fp8_max, stagings, sizes=(3, 2)):
    """Feed the same staging values per step to fp8kit states and the reference; compare after every update."""
    length = recipe.amax_history_len
    states = [ScalingState(n, length) for n in sizes]
    refs = [ref.DelayedState(length, n, fp8_max, recipe.margin, recipe.amax_compute_algo,
                             _np_scale_algo(recipe), recipe.interval, recipe.power_2_scale, recipe) for n in sizes]
    for step, row in enumerate(stagings):
        offset = 0
        for s, r in zip(states, refs):
            for j in range(s.num_slots):
                value = np.float32(row[offset + j])
                s.record(j, torch.tensor(value))
                r.record(j, value)
            offset += s.num_slots
        update_states(states, recipe, fp8_max)
        for s, r in zip(states, refs):
            r.update()
            np.testing.assert_array_equal(s.amax_history.numpy(), r.history, err_msg=f"history, step {step}")
            np.testing.assert_array_equal(s.scale.numpy(), r.scale, err_msg=f"scale, step {step}")
    return states


def _np_scale_algo(recipe):
    f = recipe.scaling_factor_compute_algo
    if f is None:
        return None
    return lambda a, s, m, r: f(torch.from_numpy(np.asarray(a)), torch.from_numpy(s), m, r).numpy()


def magnitudes(steps, n, seed, specials=True):
    rng = np.random.default_rng(seed)
    vals = np.abs(rng.standard_normal((steps, n))) * np.exp2(rng.integers(-20, 20, (steps, n)))
    vals[rng.random((steps, n)) < 0.25] = 0.0  # slots not used this step
    if specials:
        vals[rng.random((steps, n)) < 0.05] = np.inf
        vals[3, 0] = np.inf
        vals[5, 1] = 1e-42  # subnormal amax: scale overflows to FLT_MAX
        vals[6, 2] = 3e38
    return vals.astype(np.float32)


def test_worked_example_from_the_spec():
    recipe = DelayedScaling(margin=1, amax_history_len=3, fp8_format=Format.E4M3)
    state = ScalingState(1, 3)
    want_hist = [[0, 0, 2], [0, 0, 2], [0, 2, 5], [0, 5, 1], [0, 1, 1], [0, 1, 1]]
    want_scale = [112, 112, 44.8, 44.8, 44.8, 224]
    for a, h, s in zip([2, 0, 5, 1, 1, 1], want_hist, want_scale):
        state.record(0, torch.tensor(float(a)))
        update_states([state], recipe, 448.0)
        assert state.amax_history[:, 0].tolist() == h
        assert state.scale.item() == np.float32(s)


@pytest.mark.parametrize("length", [1, 2, 5, 16, 100])  # 100 x 3 slots: past the host path's list size
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_builtin_algorithms_match_reference(length, algo, margin, fp8_max):
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    run_both(recipe, fp8_max, magnitudes(40, 5, seed=length + margin))


@pytest.mark.parametrize("interval", [2, 3])
@pytest.mark.parametrize("power_2", [False, True])
def test_interval_and_power_2_match_reference(interval, power_2):
    recipe = DelayedScaling(amax_history_len=4, interval=interval, power_2_scale=power_2)
    run_both(recipe, 448.0, magnitudes(30, 5, seed=interval))


def test_power_2_scale_is_the_older_formula():
    recipe = DelayedScaling(amax_history_len=2, power_2_scale=True, margin=2)
    state = ScalingState(1, 2)
    for a in [3.0, 0.01, 700.0, 1e-20]:
        amax = max(state.amax_history[1:, 0].max().item(), a)
        state.record(0, torch.tensor(a))
        update_states([state], recipe, 448.0)
        assert state.scale.item() == 2.0 ** (math.floor(math.log2(448.0 / amax)) - 2)


def test_callables_match_reference():
    def amax_algo(history):  # second-largest-ish: mean of max and most recent
        return (history.amax(dim=0) + history[0]) / 2

    def scale_algo(amax, scale, fp8_max, recipe):
        # uses the recipe it is handed: the library must pass its own recipe object
        return torch.where(amax > 0, fp8_max / (recipe.amax_history_len * amax.clamp_min(1e-30)), scale)

    for kwargs in (dict(amax_compute_algo=amax_algo), dict(scaling_factor_compute_algo=scale_algo),
                   dict(amax_compute_algo=amax_algo, scaling_factor_compute_algo=scale_algo)):
        recipe = DelayedScaling(amax_history_len=4, **kwargs)
        # the reference calls the same callables on NumPy arrays through torch
        length = recipe.amax_history_len
        states = [ScalingState(3, length)]
        r = ref.DelayedState(length, 3, 448.0, 0,
                             (lambda h: amax_algo(torch.from_numpy(h)).numpy()) if "amax_compute_algo" in kwargs
                             else "max", _np_scale_algo(recipe), recipe=recipe)
        for step, row in enumerate(magnitudes(20, 3, seed=7, specials=False)):
            for j in range(3):
                states[0].record(j, torch.tensor(row[j]))
                r.record(j, row[j])
            update_states(states, recipe, 448.0)
            r.update()
            np.testing.assert_array_equal(states[0].amax_history.numpy(), r.history)
            np.testing.assert_array_equal(states[0].scale.numpy(), r.scale)


def test_callables_always_roll():
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.amax(dim=0))
    state = ScalingState(1, 3)
    state.record(0, torch.tensor(4.0))
    update_states([state], recipe, 448.0)
    update_states([state], recipe, 448.0)  # unused slot: rolls anyway on the callable path
    assert state.amax_history[:, 0].tolist() == [0.0, 4.0, 0.0]


def test_nan_staging_is_ignored_by_max_and_keeps_scale():
    recipe = DelayedScaling(amax_history_len=3)
    state = ScalingState(2, 3)
    state.record(0, torch.tensor(2.0))
    update_states([state], recipe, 448.0)
    state.amax_history[0, 0] = math.nan  # e.g. from a corrupted reduction
    state.amax_history[0, 1] = math.nan
    update_states([state], recipe, 448.0)
    assert state.scale.tolist() == [224.0, 1.0]
    assert torch.isfinite(state.scale).all() and (state.scale > 0).all()


def test_infinite_amax_never_breaks_the_scale():
    recipe = DelayedScaling(amax_history_len=2)
    state = ScalingState(1, 2)
    for a in [2.0, math.inf, 4.0, 1.0]:
        state.record(0, torch.tensor(a))
        update_states([state], recipe, 448.0)
        assert math.isfinite(state.scale.item()) and state.scale.item() > 0
    assert state.scale.item() == 448.0 / 4.0


def test_resized_history_keeps_newest():
    h = torch.arange(15, dtype=torch.float32).reshape(5, 3)  # row 0 staging, rows 1..4 oldest->newest
    short = resized_history(h, 3)
    assert torch.equal(short, torch.stack([h[0], h[3], h[4]]))
    long = resized_history(h, 7)
    assert torch.equal(long, torch.cat([h[:1], torch.zeros(2, 3), h[1:]]))
    assert torch.equal(resized_history(h, 1), h[:1])


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=8, interval=3),
                                    DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent")])
def test_update_cost_does_not_grow_with_module_count(recipe, path):
    if path == "host":
        pytest.skip("the tensor path's cost; the host path runs no torch operation (next test)")
    counts = {}
    for n in (10, 200):
        states = [ScalingState(3, 8) for _ in range(n)]
        for s in states:
            s.record(0, torch.tensor(1.0))
        for step in range(4):  # several steps so interval masks of every kind appear
            if step == 1:
                states[7].update_count += 1  # mixed interval phases across states
            with CountOps() as mode:
                update_states(states, recipe, 448.0)
            counts.setdefault(n, []).append(len(mode.ops))
    assert counts[10] == counts[200], counts
    assert max(counts[200]) < 50  # the first update also builds the cached column -> state map


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=8, interval=3),
                                    DelayedScaling(amax_history_len=8, power_2_scale=True, margin=2)])
def test_host_path_records_and_updates_without_torch_operations(recipe, path):
    if path == "tensor":
        pytest.skip("host path only")
    states = [ScalingState(3, 8) for _ in range(5)]
    with CountOps() as mode:
        for step in range(4):
            for s in states:
                s.record(step % 3, float(step + 1))
            update_states(states, recipe, 448.0)
    # `.numpy()` shows up as a detach under a dispatch mode; nothing computes
    assert [op for op in mode.ops if op != "aten.detach.default"] == []
    assert [s.update_count for s in states] == [4] * 5


def test_host_and_tensor_paths_agree_bit_for_bit():
    rng = np.random.default_rng(11)
    for recipe in (DelayedScaling(amax_history_len=5), DelayedScaling(amax_history_len=1, margin=3),
                   DelayedScaling(amax_history_len=6, amax_compute_algo="most_recent", power_2_scale=True)):
        history = (np.abs(rng.standard_normal((recipe.amax_history_len, 64)))
                   * np.exp2(rng.integers(-140, 128, (recipe.amax_history_len, 64)))).astype(np.float32)
        history[rng.random(history.shape) < 0.2] = 0.0
        history[rng.random(history.shape) < 0.05] = np.nan
        history[rng.random(history.shape) < 0.05] = np.inf
        history[0, :3] = [1e-45, 3.4e38, 1.2e-38]  # subnormal, huge, smallest normal
        scale = (np.abs(rng.standard_normal(64)) * 10).astype(np.float32)
        recompute = rng.random(64) < 0.7
        for mask in (None, recompute):
            h_np, s_np = host.compute_update(history.copy(), scale.copy(), recipe, 448.0, mask)
            from fp8kit.pytorch.state import compute_update
            h_t, s_t = compute_update(torch.from_numpy(history.copy()), torch.from_numpy(scale.copy()), recipe, 448.0,
                                      None if mask is None else torch.from_numpy(mask))
            np.testing.assert_array_equal(h_np.view(np.int32), h_t.numpy().view(np.int32))
            np.testing.assert_array_equal(s_np.view(np.int32), s_t.numpy().view(np.int32))


@pytest.mark.parametrize("count", [2, 40])  # few columns: state by state; many: one batched NumPy update
def test_host_update_of_many_states_equals_tensor_path(count, path):
    if path == "tensor":
        pytest.skip("compares the two paths itself")
    recipe = DelayedScaling(amax_history_len=4, interval=2)
    runs = {}
    for name in ("host", "tensor"):
        states = [ScalingState(3, 4) for _ in range(count)]
        states[1].update_count = 1  # mixed interval phases
        with contextlib.nullcontext() if name == "host" else host.tensor_path():
            for values in magnitudes(8, 3 * count, seed=count):
                for i, s in enumerate(states):
                    for j in range(3):
                        s.record(j, torch.tensor(values[3 * i + j]))
                update_states(states, recipe, 57344.0)
        runs[name] = [(s.amax_history.clone(), s.scale.clone()) for s in states]
    for (h1, s1), (h2, s2) in zip(runs["host"], runs["tensor"]):
        assert torch.equal(h1.view(torch.int32), h2.view(torch.int32)) and torch.equal(s1, s2)
