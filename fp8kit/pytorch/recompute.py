"""Activation recompute: how a forward run again during backward repeats the FP8 forward it stands for.

Activation checkpointing (`fp8kit.pytorch.checkpoint`, `torch.utils.checkpoint` in either mode, Hugging Face's
`gradient_checkpointing_enable`) drops a region's saved tensors in the forward pass and runs the region again when
backward needs them. By then autocast has exited and updated the delayed-scaling scales, and with autocast outside
the region no autocast is active at all. fp8kit makes the recompute repeat the original forward exactly:

- Every FP8 module call that a backward may follow leaves a `ForwardRecord` in its module's `RecordQueue`: the
  autocast settings (recipe, enabled, calibrating, group), the forward scales it used, the FP8 weight it reused
  (`is_first_microbatch=False`) and the step it belongs to.
- A forward that runs while the autograd engine executes a backward (`in_backward()`) is a recompute. The module
  takes the oldest record not yet used by this backward, casts with the recorded scales and settings, records no
  amax, registers nothing and adds no pending backward; autocast contexts entered inside it update nothing.
- Which records stay alive: a call with grad enabled ties its record to its autograd node (dead once the node is
  freed); a call under no_grad inside a reentrant checkpoint's forward (`in_reentrant_checkpoint()`) ties it to its
  step, which is kept until the step's backward update has run (at most `MAX_RETAINED_STEPS` such steps).
Within one step every record of a module holds the same scales, so the matching is exact whatever the order in
which regions are recomputed.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import sys
import weakref
from typing import Deque, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from .frames import fp8_enabled

__all__ = ["in_backward", "in_reentrant_checkpoint", "ForwardRecord", "RecordQueue", "retain_step",
           "release_step", "reentrant_forward", "checkpoint_region", "is_fp8_activation_recompute_enabled",
           "in_fp8_activation_recompute_phase"]

MAX_RECORDS = 64  # per module: records beyond this belong to steps whose backward never ran
MAX_RETAINED_STEPS = 16


def in_backward() -> bool:
    """True while the autograd engine executes a backward on this thread (a forward now is a recompute). A compiled
    graph is never a recompute of fp8kit's (torch.compile recomputes inside its own graphs)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


# ---- reentrant checkpoints ---------------------------------------------------------------------------------------

_REENTRANT = contextvars.ContextVar("fp8kit_reentrant_checkpoint", default=False)
_TORCH_REENTRANT_FORWARD = torch_checkpoint.CheckpointFunction.forward.__code__


@contextlib.contextmanager
def _set_in_scope(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def reentrant_forward():
    """Mark the original forward of a reentrant checkpoint (fp8kit.pytorch.checkpoint's own)."""
    return _set_in_scope(_REENTRANT, True)


def in_reentrant_checkpoint() -> bool:
    """True in the original forward of a reentrant activation checkpoint: fp8kit's, or torch.utils.checkpoint's
    `use_reentrant=True` (found on the call stack; that forward runs under no_grad, but its region will run again
    with grad during backward)."""
    if _REENTRANT.get():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _TORCH_REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False


# ---- Transformer Engine's recompute queries (te.checkpoint's regions) ---------------------------------------------

_REGION: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("fp8kit_checkpoint_region", default=None)


def checkpoint_region(phase: str):
    """Mark a region of `fp8kit.pytorch.checkpoint`: its first forward ("forward") or its recompute during backward
    ("recompute")."""
    return _set_in_scope(_REGION, phase)


def is_fp8_activation_recompute_enabled() -> bool:
    """True inside a region of `fp8kit.pytorch.checkpoint` (its forward or its recompute) while an autocast with
    enabled=True is in force, as in Transformer Engine. (fp8kit's modules do not need it: they tell a recompute by
    the running backward, also under torch.utils.checkpoint.)"""
    return _REGION.get() is not None and fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """True while `fp8kit.pytorch.checkpoint` runs its region again during backward (the recompute), as in
    Transformer Engine."""
    return _REGION.get() == "recompute"


# ---- records -----------------------------------------------------------------------------------------------------

class ForwardRecord:
    """What one FP8 module call did, for its recompute.

    frame: the autocast Frame of the call (recipe, enabled, calibrating, group), with its step held weakly: the
      record lives as long as the step (`step`), which autograd nodes of the step or `retain_step` keep alive.
    scales: the forward scales of the module's delayed-scaling state at the call (a float32 tensor clone, or a list
      of floats on the CPU fast path), None under current scaling.
    weights: the FP8 weights the call reused from its cache, by GEMM index (None: cast as usual).
    counted: the call added a pending backward to its step (a recompute then adds none).
    """

    __slots__ = ("settings", "scales", "weights", "counted", "_step", "used_by", "__weakref__")

    def __init__(self, frame, scales, counted: bool):
        self.settings = (frame.enabled, frame.calibrating, frame.recipe, frame.group)
        self.scales, self.counted = scales, counted
        self.weights = None
        self._step = weakref.ref(frame.step)
        self.used_by = -1  # the graph task that took it last

    @property
    def step(self):
        return self._step()

    def alive(self) -> bool:
        return self._step() is not None


class RecordQueue:
    """A module's records, oldest first. Not copied with the module (a copy starts empty)."""

    __slots__ = ("_records",)

    def __init__(self):
        self._records: Deque[ForwardRecord] = collections.deque()

    def add(self, record: ForwardRecord) -> None:
        records = self._records
        while records and not records[0].alive():
            records.popleft()
        if len(records) >= MAX_RECORDS:
            records.popleft()
        records.append(record)

    def take(self) -> Optional[ForwardRecord]:
        """The oldest live record not yet taken by the running backward, preferring steps whose backward update has
        not run yet (a second backward through a retained graph repeats a finished step). None if there is none."""
        task = torch._C._current_graph_task_id()
        fallback = None
        for record in self._records:
            step = record.step
            if step is None or record.used_by == task:
                continue
            if not step.backward_finished:
                record.used_by = task
                return record
            fallback = fallback or record
        if fallback is not None:
            fallback.used_by = task
        return fallback

    def __len__(self) -> int:
        return sum(1 for r in self._records if r.alive())

    def __deepcopy__(self, memo):
        return RecordQueue()

    def __getstate__(self):
        return {}

    def __setstate__(self, state) -> None:
        self._records = collections.deque()


# Steps whose records belong to no autograd node (reentrant checkpoints): kept until their backward update ran.
_RETAINED: "collections.OrderedDict[int, object]" = collections.OrderedDict()


def retain_step(step) -> None:
    """Keep `step` (and so the records it owns) alive until `release_step(step)`."""
    if id(step) not in _RETAINED:
        _RETAINED[id(step)] = step
        while len(_RETAINED) > MAX_RETAINED_STEPS:
            _RETAINED.popitem(last=False)


def release_step(step) -> None:
    _RETAINED.pop(id(step), None)
