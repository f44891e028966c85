"""The reuse of the CPU kernels' temporaries (fp8kit/pytorch/cpu_kernels/pool.py): a tensor is kept only when
nothing else refers to it, handed out again for its shape and dtype, and training with reuse gives the same bits as
without the kernels."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import cpu_kernels
from fp8kit.pytorch.cpu_kernels import pool
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

from kernel_steps import train_steps

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.reason()}")

SHAPE = (1024, 1024)  # 2 MiB as bf16: above pool.MIN_BYTES


class Owner:
    def __init__(self, t):
        self._values = t


@pytest.fixture(autouse=True)
def empty_pool():
    pool.clear()
    yield
    pool.clear()


def _kept() -> list:
    return [t for ts in pool._free.values() for t in ts]


def test_unreferenced_values_are_reused():
    t = torch.empty(SHAPE, dtype=torch.bfloat16)
    ptr = t.data_ptr()
    owner = Owner(t)
    del t
    pool.recycle(owner)
    assert owner._values is None and [k.data_ptr() for k in _kept()] == [ptr]
    again = pool.empty(SHAPE, torch.bfloat16)
    assert again.data_ptr() == ptr  # handed out again ...
    assert not _kept() and pool.empty(SHAPE, torch.bfloat16).data_ptr() != ptr  # ... once


class _Save(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


@pytest.mark.parametrize("holder", ["name", "view", "slice", "numpy", "saved", "base"])
def test_values_referred_to_elsewhere_are_not_kept(holder):
    """Another name, a view, a NumPy array, autograd's saved tensors, a view's base: never reused."""
    t = torch.zeros(SHAPE, dtype=torch.bfloat16 if holder != "numpy" else torch.float32)
    if holder == "name":
        keep = t
    elif holder == "view":
        keep = t.t()
    elif holder == "slice":
        keep = t[:3]
    elif holder == "numpy":
        keep = t.numpy()
    elif holder == "saved":
        keep = _Save.apply(torch.ones(2, requires_grad=True), t)
    else:
        keep = None
    owner = Owner(t.view(-1) if holder == "base" else t)
    del t
    pool.recycle(owner)
    assert owner._values is None and not _kept()
    del keep


def test_bounds():
    for _ in range(pool.MAX_PER_SHAPE + 2):
        pool.recycle(Owner(torch.empty(SHAPE, dtype=torch.bfloat16)))
    assert len(_kept()) == pool.MAX_PER_SHAPE
    pool.recycle(Owner(torch.empty(1 << 10, dtype=torch.bfloat16)))  # small: not kept
    assert len(_kept()) == pool.MAX_PER_SHAPE
    assert pool._held[0] == sum(t.nbytes for t in _kept()) <= pool.MAX_BYTES


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_training_with_reuse_equals_training_without_kernels(recipe, monkeypatch):
    """Two Linears of the same shapes (their temporaries reuse each other's buffers): outputs, gradients, histories
    and scales equal a run without the kernels, and buffers were reused."""
    reused = []
    empty = pool.empty

    def spy(shape, dtype):
        before = len(_kept())
        out = empty(shape, dtype)
        reused.append(len(_kept()) < before)
        return out

    monkeypatch.setattr(pool, "empty", spy)

    def make():
        return torch.nn.Sequential(te.Linear(512, 512, params_dtype=torch.bfloat16),
                                   te.Linear(512, 512, params_dtype=torch.bfloat16))

    got, want = train_steps(make, recipe, True, 1024, 512), train_steps(make, recipe, False, 1024, 512)
    assert sum(reused) >= 6  # each step after the first: x's values in the forward, dy's and x's in the backward
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_user_reference_to_values_survives_the_next_step(monkeypatch):
    """A widened operand the user took a reference to (here: the forward's x values, through the storage) is not
    recycled, so the next step cannot overwrite it."""
    lin = te.Linear(512, 512, params_dtype=torch.bfloat16)
    taken = []
    from fp8kit.pytorch import cast as cast_module

    native = cast_module._cast_native

    def grab(*args, **kwargs):
        done = native(*args, **kwargs)
        if done is not None and done[0]._values is not None and not taken:
            taken.append(done[0]._values)
        return done

    monkeypatch.setattr(cast_module, "_cast_native", grab)
    for _ in range(3):
        x = torch.randn(1024, 512).bfloat16().requires_grad_()
        with te.autocast(recipe=Float8CurrentScaling()):
            y = lin(x)
        if len(taken) == 1:
            snapshot = taken[0].clone()
        y.float().sum().backward()
    assert torch.equal(taken[0], snapshot)
    assert all(t.data_ptr() != taken[0].data_ptr() for t in _kept())
