"""The operations one module call dispatches (`fp8kit bench --overhead` reports them; tests guard them).

On a GPU each torch operation a module issues costs the host about a kernel launch, so the count of operations one
Linear forward + backward dispatches is the host cost a GPU run pays, whatever the CPU it is measured on.
`DispatchCounter` counts every call that reaches the dispatcher below autograd (views, copies and in-place
operations included). `linear_op_counts` counts one steady-state `te.Linear(64, 64)` step on 16 tokens:

- on the accelerator path, with `meta` tensors (the code a GPU runs: `torch._scaled_mm`, the quantizers' device
  branches; nothing computes), with fp8kit's Triton kernels on (their launches counted as operations) and off;
- on the CPU tensor path (`host.tensor_path()`), the emulated GEMMs included, which `fp8kit bench --overhead` times;
- for `torch.nn.Linear` on the same tensors.
"""

from __future__ import annotations

import collections
import contextlib
import gc
from typing import Counter, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.pytorch as te
from fp8kit.pytorch import host, kernels
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

__all__ = ["DispatchCounter", "linear_op_counts", "meta_autocast_off"]


class DispatchCounter(TorchDispatchMode):
    """`with DispatchCounter() as c: ...`; then `c.total` and `c.ops` (a Counter of op names). With a `where`
    callable, `c.where` counts (op, where()) pairs too."""

    def __init__(self, where=None):
        super().__init__()
        self.ops: Counter[str] = collections.Counter()
        self._where = where
        self.where = collections.Counter() if where is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if self._where is not None:
            self.where[(name, self._where())] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def table(self) -> str:
        """The ops, most frequent first, one `name xN` per line."""
        return "\n".join(f"  {name} x{n}" for name, n in self.ops.most_common())


@contextlib.contextmanager
def meta_autocast_off() -> Iterator[None]:
    """torch keeps no autocast state for `meta` (`torch.is_autocast_enabled("meta")` raises): answer False there."""
    # torch._dynamo records torch's functions when it is imported: import it first, so that it records the real one
    # and not the stand-in (else a later torch.compile in the process breaks on the real function)
    import torch._dynamo  # noqa: F401

    real = torch.is_autocast_enabled

    def is_autocast_enabled(*args):
        return False if args and args[0] == "meta" else real(*args)

    torch.is_autocast_enabled = is_autocast_enabled
    try:
        yield
    finally:
        torch.is_autocast_enabled = real


def _count_step(layer, x, dy, recipe) -> tuple:
    """(aten operations, kernel launches) of one steady-state forward + backward of `layer` (3 calls first)."""
    def step():
        if recipe is None:
            y = layer(x)
        else:
            with te.autocast(recipe=recipe):
                y = layer(x)
        y.backward(dy)

    gc.collect()  # modules of earlier counts leave the autocast registry (their states would be updated too)
    for _ in range(3):
        step()
    with kernels.observe_launches() as launches, DispatchCounter() as counter:
        step()
    return counter.total, len(launches)


def linear_op_counts(hidden: int = 64, tokens: int = 16) -> List[dict]:
    """Rows {path, variant, ops, launches} for one Linear(hidden, hidden) forward + backward on `tokens` tokens
    (bf16 on the accelerator path, float32 on the CPU tensor path; the delayed backward includes its update)."""
    rows = []
    meta = torch.device("meta")
    recipes = {"fp8kit current": Float8CurrentScaling, "fp8kit delayed": DelayedScaling}
    with meta_autocast_off():
        x = torch.empty(tokens, hidden, device=meta, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.empty(tokens, hidden, device=meta, dtype=torch.bfloat16)
        ops, _ = _count_step(torch.nn.Linear(hidden, hidden, device=meta, dtype=torch.bfloat16), x, dy, None)
        rows.append({"path": "accelerator", "variant": "torch", "ops": ops, "launches": 0})
        for use in (True, False):
            with kernels.enabled_as(use):
                for name, recipe in recipes.items():
                    ops, launches = _count_step(te.Linear(hidden, hidden, device=meta, params_dtype=torch.bfloat16),
                                                x, dy, recipe())  # no name keeps the module alive after its count
                    rows.append({"path": "accelerator", "variant": f"{name}, kernels {'on' if use else 'off'}",
                                 "ops": ops, "launches": launches})
    x = torch.randn(tokens, hidden, requires_grad=True)
    dy = torch.randn(tokens, hidden)
    ops, _ = _count_step(torch.nn.Linear(hidden, hidden), x, dy, None)
    rows.append({"path": "cpu tensor path", "variant": "torch", "ops": ops, "launches": 0})
    with host.tensor_path(), kernels.enabled_as(False):
        for name, recipe in recipes.items():
            ops, launches = _count_step(te.Linear(hidden, hidden), x, dy, recipe())
            rows.append({"path": "cpu tensor path", "variant": name, "ops": ops, "launches": launches})
    gc.collect()  # the meta modules' states leave the autocast registry now
    return rows
