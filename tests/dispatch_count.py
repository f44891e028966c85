"""Count the aten operations a piece of code dispatches (a TorchDispatchMode), with the per-op list.

Used by tests/test_dispatch_counts.py (ceilings that fail on a regression without timing anything) and by hand:

    python -m tests.dispatch_count            # per-op lists of one Linear forward + backward, both recipes

What is counted: every call that reaches the dispatcher below autograd (views, copies and in-place ops included),
which is what costs a launch on a GPU. Python work that dispatches nothing is not seen here (`fp8kit bench
--overhead` times it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch

from fp8kit.bench_ops import DispatchCounter as _Counter


def DispatchCounter(where: bool = False) -> _Counter:
    """`with DispatchCounter() as c: ...`; then `c.total` and `c.ops` (a Counter of op names); with `where`,
    `c.where` counts (op, fp8kit file:line) pairs."""
    return _Counter(_caller if where else None)


def _caller() -> str:
    """The innermost fp8kit (or test) source line on the Python stack."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("/fp8kit/" in name or "/tests/" in name) and "dispatch_count" not in name and "bench_ops" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def counting() -> Iterator[_Counter]:
    with DispatchCounter() as counter:
        yield counter


def count(fn: Callable[[], object], where: bool = False) -> _Counter:
    """Run `fn()` once under a counter and return it (autograd's backward included when fn calls it)."""
    with DispatchCounter(where) as counter:
        fn()
    return counter


def _demo() -> None:  # pragma: no cover - a tool for people
    import fp8kit.pytorch as te
    from fp8kit.pytorch import host
    from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

    torch.manual_seed(0)
    x = torch.randn(16, 64, requires_grad=True)
    ref = torch.nn.Linear(64, 64)

    def torch_step():
        ref(x).sum().backward()

    torch_step()
    print(f"torch.nn.Linear fwd+bwd: {count(torch_step).total} ops")
    with host.tensor_path():
        for recipe in (Float8CurrentScaling(), DelayedScaling()):
            layer = te.Linear(64, 64)

            def step():
                with te.autocast(recipe=recipe):
                    y = layer(x)
                y.sum().backward()

            for _ in range(3):
                step()
            c = count(step, where=True)
            print(f"te.Linear fwd+bwd+exit, {type(recipe).__name__}: {c.total} ops\n{c.table()}")
            for (name, at), n in sorted(c.where.items(), key=lambda kv: kv[0][1]):
                print(f"    {at:40s} {name} x{n}")


if __name__ == "__main__":  # pragma: no cover
    _demo()
