"""Shared by the multi-process check files (tests/dist_workers.py, tests/dist_workers_tp.py): the rank and world
size, raw torch.distributed helpers that do not go through fp8kit, a recorder of collectives, and the reference
state of one Linear."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

import reference as ref
from linear_helpers import np32

RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
E4M3, E5M2 = 448.0, 57344.0


def all_rows(values) -> np.ndarray:
    """Every rank's float32 vector `values`, stacked `[world, n]` (raw torch.distributed, not fp8kit)."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float32))
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t)
    return torch.stack(parts).numpy()


def global_max(values) -> np.ndarray:
    return all_rows(values).max(axis=0)


def assert_same_on_all_ranks(tensors, what: str) -> None:
    for i, t in enumerate(tensors):
        rows = all_rows(np32(t).ravel())
        for r in range(1, WORLD):
            assert np.array_equal(rows[0], rows[r], equal_nan=True), f"{what}[{i}] differs between rank 0 and {r}"


class Recorder:
    """Wraps torch.distributed collectives and records (name, dtype, numel, tensor copy) while `active`."""

    NAMES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "broadcast")

    def __init__(self):
        self.events, self.active, self.saved = [], False, {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                result = _fn(*args, **kwargs)
                if self.active:
                    first = args[0]
                    t = first[0] if isinstance(first, list) else first
                    self.events.append((_name, t.dtype, t.numel(), t.detach().clone()))
                return result
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def take(self):
        events, self.events = self.events, []
        return events


def names(events):
    return [e[0] for e in events]


def state_np(layer, which):
    s = layer.fp8_meta[which]
    return np32(s.amax_history), np32(s.scale)


def assert_state_equals_ref(layer, which, ref_state, what):
    hist, scale = state_np(layer, which)
    assert np.array_equal(hist, ref_state.history), f"{what} {which} history\n{hist}\n!=\n{ref_state.history}"
    assert np.array_equal(scale, ref_state.scale), f"{what} {which} scale {scale} != {ref_state.scale}"


class RefModule:
    """The reference rule for one Linear: forward [input, weight, output] and backward [grad_output, grad_input]
    states, updated with the staging row max-reduced over the ranks."""

    def __init__(self, length, margin=0):
        self.fwd = ref.DelayedState(length, 3, E4M3, margin=margin)
        self.bwd = ref.DelayedState(length, 2, E5M2, margin=margin)


def reduce_over_ranks(row):
    return global_max(row)
