"""The in-place delayed-scaling update of the tensor path (`state.update_in_place`, run by a flat block's update at
autocast exit, by the general path of `state.update_states` and by `state.compute_update`) against
tests/reference.py's `DelayedState` (NumPy, one column at a time), bit for bit: histories, scales and counters, on
random histories holding NaN, +-inf, +-0, negative, subnormal and huge values, columns not used in the step, several
interval phases, both amax algorithms, margins and power-of-two scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8kit.pytorch import cpu_kernels, host
from fp8kit.pytorch.state import ScalingState, compute_update
from fp8kit.pytorch.state import update_states as update_each
from fp8kit.pytorch.state_block import SlotBlock
from fp8kit.recipe import DelayedScaling
from tests.reference import DelayedState

RECIPES = [
    DelayedScaling(amax_history_len=16),
    DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent"),
    DelayedScaling(amax_history_len=5, interval=3),
    DelayedScaling(amax_history_len=5, interval=2, amax_compute_algo="most_recent", margin=2),
    DelayedScaling(amax_history_len=2, margin=1.5, power_2_scale=True),
    DelayedScaling(amax_history_len=1),
    DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent", interval=2, power_2_scale=True),
]


def _name(recipe) -> str:
    return f"L{recipe.amax_history_len}-{recipe.amax_compute_algo}-i{recipe.interval}-m{recipe.margin}" + \
        ("-pow2" if recipe.power_2_scale else "")


SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, -3.0, 1e-45, 1.2e-38, 3.4e38, 448.0],
                   dtype=np.float32)


def _column(rng, length: int) -> np.ndarray:
    """One random history column of a kind chosen at random."""
    col = (np.abs(rng.standard_normal(length)) * np.exp2(rng.integers(-140, 127, length))).astype(np.float32)
    kind = rng.integers(8)
    if kind == 0:
        col[0] = rng.choice([0.0, -0.0])  # not used this step: must keep its history and scale
    elif kind == 1:
        col[:] = np.nan  # all NaN (used: NaN != 0)
    elif kind == 2:
        col[rng.random(length) < 0.3] = np.inf
    elif kind == 3:
        col[:] = 0.0
    elif kind == 4:
        col[0] = rng.choice(SPECIAL)
    elif kind == 5:
        col[:] = -np.abs(col)  # only non-positive amaxes
    picks = rng.random(length) < 0.25
    col[picks] = rng.choice(SPECIAL, picks.sum())
    return col


def _states(rng, length: int, count: int):
    """(slot counts, histories, scales, counters) of `count` random states."""
    slots = rng.integers(1, 5, count)
    histories = [np.stack([_column(rng, length) for _ in range(n)], axis=1) for n in slots]
    scales = [(np.abs(rng.standard_normal(n)) * 10 + 0.5).astype(np.float32) for n in slots]
    counters = rng.integers(0, 7, count)
    return slots, histories, scales, counters


def _reference(recipe, fp8_max, histories, scales, counters):
    out = []
    for h, s, c in zip(histories, scales, counters):
        ref = DelayedState(h.shape[0], h.shape[1], fp8_max, recipe.margin, recipe.amax_compute_algo,
                           interval=recipe.interval, power_2=recipe.power_2_scale)
        ref.history, ref.scale, ref.updates = h.copy(), s.copy(), int(c)
        ref.update()
        out.append((ref.history, ref.scale, ref.updates))
    return out


def _make(slots, histories, scales, counters, length):
    states = []
    for n, h, s, c in zip(slots, histories, scales, counters):
        state = ScalingState(int(n), length)
        state.amax_history = torch.from_numpy(h.copy())
        state.scale = torch.from_numpy(s.copy())
        state.update_count = int(c)
        states.append(state)
    return states


def _check(states, want):
    for state, (h, s, c) in zip(states, want):
        np.testing.assert_array_equal(state.amax_history.numpy().view(np.uint32), h.view(np.uint32))
        np.testing.assert_array_equal(state.scale.numpy().view(np.uint32), s.view(np.uint32))
        assert state.update_count == c


@pytest.mark.parametrize("path", ["tensor", "host", "host, NumPy"])  # host: fp8kit's CPU update kernel if built
@pytest.mark.parametrize("recipe", RECIPES, ids=_name)
def test_block_update_matches_the_reference(recipe, path):
    rng = np.random.default_rng(recipe.amax_history_len * 7 + recipe.interval)
    fp8_max = 448.0
    length = recipe.amax_history_len
    slots, histories, scales, counters = _states(rng, length, 40)
    states = _make(slots, histories, scales, counters, length)
    block = SlotBlock(length, torch.device("cpu"))
    for state in states:
        assert block.place(state)
    with host.tensor_path() if path == "tensor" else host.host_path(), cpu_kernels.switched(path != "host, NumPy"):
        for step in range(4):  # the first update makes the block's views; later ones reuse them
            want = _reference(recipe, fp8_max, histories, scales, counters)
            block.update(recipe, fp8_max)
            _check(states, want)
            histories = [h.copy() for h, _, _ in want]
            for h in histories:  # new staging values, some columns left unused (except before the last update)
                h[0] = np.stack([_column(rng, length)[0] for _ in range(h.shape[1])])
                if step == 2:
                    h[0][h[0] == 0] = 2.5
            scales, counters = [s for _, s, _ in want], [c for _, _, c in want]
            for state, h in zip(states, histories):
                state.amax_history = torch.from_numpy(h.copy())


@pytest.mark.parametrize("recipe", RECIPES, ids=_name)
def test_general_path_and_compute_update_match_the_reference(recipe):
    rng = np.random.default_rng(recipe.amax_history_len * 5 + recipe.interval + 1)
    fp8_max = 57344.0
    length = recipe.amax_history_len
    slots, histories, scales, counters = _states(rng, length, 12)
    want = _reference(recipe, fp8_max, histories, scales, counters)
    states = _make(slots, histories, scales, counters, length)  # not in a block: concatenated, updated, copied back
    with host.tensor_path():
        update_each(states, recipe, fp8_max)
    _check(states, want)
    for h, s, c, (want_h, want_s, _) in zip(histories, scales, counters, want):
        recompute = None if recipe.interval == 1 else torch.full((h.shape[1],), bool(c % recipe.interval == 0))
        history, scale = torch.from_numpy(h.copy()), torch.from_numpy(s.copy())
        got_h, got_s = compute_update(history, scale, recipe, fp8_max, recompute)
        np.testing.assert_array_equal(got_h.numpy().view(np.uint32), want_h.view(np.uint32))
        np.testing.assert_array_equal(got_s.numpy().view(np.uint32), want_s.view(np.uint32))
        np.testing.assert_array_equal(history.numpy().view(np.uint32), h.view(np.uint32))  # inputs untouched
        np.testing.assert_array_equal(scale.numpy().view(np.uint32), s.view(np.uint32))


@pytest.mark.parametrize("recipe", RECIPES, ids=_name)
def test_states_on_several_devices_match_the_reference(recipe):
    """One registry key can hold modules on several devices (a CPU copy of a GPU model under the same recipe); the
    update takes each device's states on their own (it concatenated them, which failed on the first GPU run), and the
    CPU states, interleaved with `meta` ones, come out as tests/reference.py's `DelayedState` says."""
    rng = np.random.default_rng(recipe.amax_history_len * 3 + recipe.interval + 11)
    fp8_max = 448.0
    length = recipe.amax_history_len
    slots, histories, scales, counters = _states(rng, length, 6)
    want = _reference(recipe, fp8_max, histories, scales, counters)
    cpu = _make(slots, histories, scales, counters, length)
    meta = [ScalingState(int(n), length, device="meta") for n in slots]
    mixed = [s for pair in zip(cpu, meta) for s in pair]
    with host.tensor_path():
        update_each(mixed, recipe, fp8_max)
    _check(cpu, want)
    update_each(mixed, recipe, fp8_max)  # the host path for the CPU ones
    want = _reference(recipe, fp8_max, [h for h, _, _ in want], [s for _, s, _ in want], [c for _, _, c in want])
    _check(cpu, want)
