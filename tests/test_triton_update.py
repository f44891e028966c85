"""The delayed-scaling update kernels of fp8kit.pytorch.kernels against `state.compute_update` and
tests/reference.py (bit patterns of every history and scale). CPU cases run in Triton's interpreter, CUDA cases
(marker `cuda`) on a GPU; see tests/triton_helpers.py."""

import numpy as np
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton_helpers import E4M3, bits, dev_fixture  # noqa: E402,F401

from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.pytorch.state import compute_update  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

import reference  # noqa: E402


def random_history(length, n, seed):
    """A history with positive values, zeros (unused slots), NaN, inf and subnormals in every row, row 0 too."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(length, n, generator=g) * 10
    for value, p in [(0.0, 0.25), (float("nan"), 0.08), (float("inf"), 0.05), (1e-40, 0.05), (3e38, 0.03),
                     (1e35, 0.03)]:
        h[torch.rand(length, n, generator=g) < p] = value
    return h


@pytest.mark.parametrize("length", [1, 2, 5, 40])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin,power_2", [(0, False), (3, True), (20, True)])  # 20: subnormal scales
@pytest.mark.parametrize("with_mask", [False, True])
def test_update_matches_compute_update(dev, length, algo, margin, power_2, with_mask):
    n = 37
    recipe = DelayedScaling(amax_history_len=length, margin=margin, amax_compute_algo=algo, power_2_scale=power_2)
    g = torch.Generator().manual_seed(length * 7 + margin)
    history = random_history(length, n, seed=length + margin)
    scale = torch.rand(n, generator=g) * 4 + 0.25
    recompute = torch.rand(n, generator=g) < 0.6 if with_mask else None
    want_h, want_s = compute_update(history.clone(), scale.clone(), recipe, 448.0, recompute)
    h, s = history.to(dev), scale.to(dev)
    out_h, out_s = kernels.update(h, s, recipe, 448.0, recompute.to(dev) if with_mask else None)
    assert out_h is h and out_s is s  # in place
    assert torch.equal(bits(h), bits(want_h)) and torch.equal(bits(s), bits(want_s))


@pytest.mark.parametrize("algo,count", [("max", 5), ("most_recent", 5), ("max", 40)])  # 40: two launches of 32
def test_update_tensors_matches_compute_update(dev, algo, count):
    """The update of states of different widths, passed as kernel arguments, with per-state recompute flags."""
    recipe = DelayedScaling(amax_history_len=40, margin=1, amax_compute_algo=algo)
    widths = [[3, 2, 1, 70, 3][i % 5] for i in range(count)]  # 70: more than one block of columns
    flags = [i % 5 not in (1, 4) for i in range(count)]
    histories = [random_history(40, w, seed=i) for i, w in enumerate(widths)]
    scales = [torch.rand(w, generator=torch.Generator().manual_seed(i)) + 0.5 for i, w in enumerate(widths)]
    wants = [compute_update(h.clone(), s.clone(), recipe, 57344.0, torch.full((h.shape[1],), f))
             for h, s, f in zip(histories, scales, flags)]
    hs, ss = [h.to(dev) for h in histories], [s.to(dev) for s in scales]
    for _ in range(2):  # the second call sees the updated staging rows
        kernels.update_tensors(hs, ss, recipe, 57344.0, flags)
        for h, s, (want_h, want_s) in zip(hs, ss, wants):
            assert torch.equal(bits(h), bits(want_h)) and torch.equal(bits(s), bits(want_s))
        wants = [compute_update(w_h.clone(), w_s.clone(), recipe, 57344.0, torch.full((w_h.shape[1],), f))
                 for (w_h, w_s), f in zip(wants, flags)]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_update_tensors_makes_no_tensor_operation(dev):
    """The states travel as kernel arguments: no table is built or copied to the device (the old pointer table
    made a synchronous host-to-device copy on every new set of states)."""
    recipe = DelayedScaling(amax_history_len=4)
    hs = [random_history(4, 3, seed=i).to(dev) for i in range(3)]
    ss = [torch.ones(3, device=dev) for _ in range(3)]
    with kernels.observe_launches() as launches, _Ops() as ops:
        kernels.update_tensors(hs, ss, recipe, 448.0)
    assert ops.ops == []
    assert [launch.kernel for launch in launches] == ["update_states_kernel"]


def test_update_spec_worked_example(dev):
    """SPEC section 5: L=3, margin 1, E4M3, amaxes 2, 0, 5, 1, 1, 1."""
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    h, s = torch.zeros(3, 1, device=dev), torch.ones(1, device=dev)
    histories, scales = [], []
    for value in [2, 0, 5, 1, 1, 1]:
        h[0, 0] = value
        kernels.update(h, s, recipe, 448.0)
        histories.append(h[:, 0].tolist())
        scales.append(round(s.item(), 4))
    assert histories == [[0, 0, 2], [0, 0, 2], [0, 2, 5], [0, 5, 1], [0, 1, 1], [0, 1, 1]]
    assert scales == [112, 112, 44.8, 44.8, 44.8, 224]


@pytest.mark.parametrize("interval", [1, 3])
def test_update_steps_match_reference(dev, interval):
    """Several steps of casts and updates against tests/reference.py's DelayedState (interval via the mask)."""
    recipe = DelayedScaling(amax_history_len=4, margin=2, interval=interval)
    ref = reference.DelayedState(4, 3, 448.0, margin=2, interval=interval)
    h, s = torch.zeros(4, 3, device=dev), torch.ones(3, device=dev)
    g = torch.Generator().manual_seed(interval)
    for step in range(7):
        for slot in range(3):
            if (step + slot) % 3 == 2:
                continue  # slot unused this step
            x = (torch.randn(9, 21, generator=g) * (slot + 1) * 10 ** (step % 3)).to(dev)
            kernels.cast_amax(x, s[slot], E4M3, transpose=slot == 1, amax_out=h[0, slot])
            ref.record(slot, reference.amax(x.cpu().numpy()))
        mask = torch.full((3,), step % interval == 0, device=dev)
        kernels.update(h, s, recipe, 448.0, mask)
        ref.update()
        assert np.array_equal(h.cpu().numpy().view(np.int32), ref.history.view(np.int32))
        assert np.array_equal(s.cpu().numpy().view(np.int32), ref.scale.view(np.int32))
