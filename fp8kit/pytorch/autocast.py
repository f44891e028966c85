"""The autocast context: a context-local stack of frames, and when the batched updates run (SPEC section 6).

- A module registers its forward and backward states on its first FP8 (or calibrating) forward, under the key
  `(recipe, amax_reduction_group)` (fp8kit.pytorch.registry).
- Forward states of every key used in a step are updated when the outermost autocast exits, if grad is enabled (or
  inside a reentrant activation checkpoint's forward).
- Backward states are updated once the backward of every FP8 module call of that step has run.
- With amax reduction active (`reduce_amax=True` and torch.distributed initialised) every update is collective
  (`amax_reduction.reduced_update`): at the outermost exit, every delayed-scaling key entered in the step is updated on
  every rank, whether or not this rank ran a module of it; backward updates are deferred to the next outermost entry
  with grad enabled, a point every rank reaches in the same order. See docs/distributed.md.
- An outermost autocast left by an exception updates nothing and discards its step's forward amaxes.
- A context entered while a backward runs (activation recompute) updates nothing (fp8kit.pytorch.recompute).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional

import torch

from ..recipe import DelayedScaling, Recipe
from . import kernels, registry
from .amax_reduction import check_local_key, reduced_update
from .compiled import PENDING, TracedCalls, compiling, flagged_forward, flush_backward
from .frames import STACK, current_frame
from .recipe_families import registered_recipes
from .recompute import in_backward, in_reentrant_checkpoint, release_step
from .registry import register as register_states
from .registry import registry_states
from .state import ScalingState

__all__ = ["autocast", "fp8_autocast", "current_frame", "registry_states", "register", "has_pending_backward",
           "run_pending_backward", "Frame", "entry_recipe"]

# Keys whose reduced backward update waits for the next outermost autocast entry, with the number of the step they
# belong to (insertion order = update order, the same on every rank).
_PENDING_BACKWARD: Dict[tuple, int] = {}


class _Step:
    """One outermost autocast scope: the keys it touched and the FP8 backwards still to run."""

    def __init__(self):
        # the keys under which modules ran (or will run a backward) in this step, in order (dicts as ordered sets):
        # each one's update covers every state registered under it, as in Transformer Engine
        self.forward_keys: Dict[tuple, None] = {}
        self.backward_keys: Dict[tuple, None] = {}
        self.entered: Dict[tuple, int] = {}  # delayed-scaling keys entered, in order -> the key's step number
        self.pending_backward = 0
        self.backward_finished = False  # the step's backward update has run
        # the calls of a step traced by torch.compile (no per-step Python state at run time); None when eager
        self.traced: Optional[TracedCalls] = TracedCalls() if compiling() else None
        self.graph_calls: list = []  # (module, needs_backward) of the calls made under a graph-capture frame

    def forward_called(self, key, needs_backward: bool) -> None:
        """A module call recording amaxes under `key`; `needs_backward`: a backward will report to this step."""
        self.forward_keys[key] = None
        if needs_backward:
            self.pending_backward += 1
            self.backward_keys[key] = None

    def backward_done(self) -> None:
        # One backward runs at a time per step (autograd runs a CPU graph and a single-device graph on one thread);
        # no lock, so that torch.compile traces this too.
        if self.pending_backward <= 0:
            return
        self.pending_backward -= 1
        if self.pending_backward == 0:
            keys, self.backward_keys = self.backward_keys, {}
            self.backward_finished = True
            release_step(self)  # no recompute of this step is left to come
            for key in keys:
                if registry.reduces(key):  # collective: deferred to the next outermost entry
                    registry.entry(key).backward_ran = True
                else:
                    registry.update_key(key, "backward")

    def abort(self) -> None:
        """An exception left the outermost autocast: clear the forward staging amaxes of the keys this step used
        (they are not merged into the next update) and note the aborted step for distributed error messages."""
        for key in self.forward_keys:
            found = registry.entry(key)
            if found is not None:
                for state in found.live("forward", key):
                    with torch.no_grad():
                        state.amax_history[0].zero_()
        for key, seq in self.entered.items():
            registry.entry(key).abort_step(seq)


@dataclass(frozen=True)
class Frame:
    """One entry of the autocast stack."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
    group: object
    step: _Step = field(compare=False)
    replay: bool = field(default=False, compare=False)  # entered by a recompute during backward: updates nothing
    # inside a graph being captured (make_graphed_callables): calls keep no per-step Python state and nothing is
    # updated; the graphed callable does that bookkeeping at each replay (fp8kit.pytorch.graph)
    graph: bool = field(default=False, compare=False)

    @property
    def key(self) -> tuple:
        return (self.recipe, self.group)

    @property
    def records_amax(self) -> bool:
        """True when modules must record amaxes into delayed-scaling state (FP8 or calibration)."""
        return isinstance(self.recipe, DelayedScaling) and (self.enabled or self.calibrating)


_STACK = STACK  # the thread's autocast stack (fp8kit.pytorch.frames)


def register(frame: Frame, forward: ScalingState, backward: ScalingState) -> None:
    """Register a module's states under the frame's key (moving them from another key if needed)."""
    register_states(frame.recipe, frame.group, forward, backward, flat=not (compiling() or frame.graph))


def _update_step(step: _Step) -> None:
    """The forward updates at the outermost exit; collective for the keys with amax reduction."""
    reduced = [key for key in step.entered if registry.reduces(key)]
    for key in step.forward_keys:
        if key not in reduced:
            if PENDING.any:
                flagged_forward(key)  # clear the compiled calls' flags: the update covers their states too
            registry.update_key(key, "forward")
    if PENDING.any:  # keys only compiled calls used
        for key in step.entered:
            if key not in reduced and key not in step.forward_keys and flagged_forward(key):
                registry.update_key(key, "forward")
    if registry.dist_initialized():
        for key in step.entered:
            if key not in reduced:
                check_local_key(key)
        for key in reduced:
            reduced_update(key, "forward", key in step.forward_keys, step.entered[key])
            _PENDING_BACKWARD[key] = step.entered[key]


def has_pending_backward(state: ScalingState) -> bool:
    """True when `state` (a backward state) waits for a deferred, collective backward update."""
    return state.key in _PENDING_BACKWARD


def run_pending_backward() -> None:
    """The deferred backward updates: those compiled steps left (fp8kit.pytorch.compiled), then those of reduced
    keys, in the order their steps exited (the same on every rank)."""
    flush_backward()
    if not _PENDING_BACKWARD:
        return
    while _PENDING_BACKWARD:
        key = next(iter(_PENDING_BACKWARD))
        seq = _PENDING_BACKWARD.pop(key)
        found = registry.entry(key)
        used = found is not None and found.backward_ran
        if found is not None:
            found.backward_ran = False
        if registry.reduces(key):
            reduced_update(key, "backward", used, seq)
        elif used:  # torch.distributed was shut down meanwhile: a local update
            registry.update_key(key, "backward")


_DEFAULT_RECIPE = DelayedScaling().snapshot()


def entry_recipe(recipe, where: str = "autocast") -> Recipe:
    """The snapshot of `recipe` (None: `DelayedScaling()`) that a scope entered now keys everything on: the recipe's
    fields as they are at entry (fp8kit.recipe.base). Refuses what is not a recipe, and the recipes fp8kit.pytorch
    cannot run yet."""
    if recipe is None:
        return _DEFAULT_RECIPE
    families = registered_recipes()  # the registered families (recipe_families.py)
    if not isinstance(recipe, families):
        names = " or ".join(c.__name__ for c in families)
        if isinstance(recipe, Recipe) and recipe._kind:  # one of fp8kit.recipe's classes, without quantizers yet
            raise NotImplementedError(f"{where}: {type(recipe).__name__} is not implemented in fp8kit.pytorch yet "
                                      f"(no quantizers are registered for it); use {names}")
        raise TypeError(f"{where}: recipe must be a fp8kit.recipe {names}, got {recipe!r}")
    return recipe.snapshot()


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Optional[Recipe] = None,
    amax_reduction_group=None,
) -> Iterator[None]:
    """Run fp8kit modules in FP8 inside this context.

    enabled: False runs modules in high precision.
    calibrating: with enabled=False, compute in high precision but record amaxes and update delayed-scaling
      histories and scales as an FP8 run would.
    recipe: DelayedScaling (the default when None) or Float8CurrentScaling. Its fields are read at entry
      (`recipe.snapshot()`): assigning to the recipe inside the context acts from the next entry on.
    amax_reduction_group: torch.distributed group over which amaxes are all-reduced (MAX) when the recipe has
      reduce_amax=True; None means the default group once torch.distributed is initialised. Every rank of the group
      must enter and exit the same autocast contexts in the same order (docs/distributed.md).

    Contexts nest; an inner one may change `enabled` or the recipe for its scope. Forward updates run when the
    outermost context exits (if grad is enabled then, or inside a reentrant activation checkpoint's forward);
    backward updates run after the step's FP8 backwards, or, with amax reduction, at the next outermost entry with
    grad enabled (`distributed.apply_pending_updates()` runs them now). An outermost context left by an exception
    updates nothing and discards the forward amaxes its step recorded. A context entered while a backward runs
    (activation recompute) updates nothing: its modules repeat their original forward (fp8kit.pytorch.recompute).
    """
    if not isinstance(enabled, bool) or not isinstance(calibrating, bool):
        raise TypeError(f"autocast: enabled and calibrating must be bools, got {enabled!r} and {calibrating!r}")
    recipe = entry_recipe(recipe)
    stack = _STACK.frames
    if in_backward() or (stack and stack[-1].replay):
        _STACK.frames = stack + (Frame(enabled, calibrating, recipe, amax_reduction_group, _Step(), True),)
        try:
            yield
        finally:
            _STACK.frames = stack
        return
    if stack and stack[0].graph:
        _STACK.frames = stack + (Frame(enabled, calibrating, recipe, amax_reduction_group, stack[0].step, graph=True),)
        try:
            yield
        finally:
            _STACK.frames = stack
        return
    if compiling():
        yield from _traced_autocast(stack, Frame(enabled, calibrating, recipe, amax_reduction_group,
                                                 stack[0].step if stack else _Step()))
        return
    if not stack:
        kernels.refresh()  # whether the casts of this step use the Triton kernels (FP8KIT_TRITON read here)
    if not stack and (_PENDING_BACKWARD or PENDING.any) and torch.is_grad_enabled():
        run_pending_backward()
    step = stack[0].step if stack else _Step()
    frame = Frame(enabled, calibrating, recipe, amax_reduction_group, step)
    if frame.records_amax and frame.key not in step.entered:
        step.entered[frame.key] = registry.key_entry(recipe, amax_reduction_group).begin_step(torch.is_grad_enabled())
    _STACK.frames = stack + (frame,)
    try:
        yield
    except BaseException:
        if not stack:
            step.abort()
        raise
    finally:
        _STACK.frames = stack
    if not stack and (torch.is_grad_enabled() or in_reentrant_checkpoint()):
        _update_step(step)


def _traced_autocast(stack, frame: Frame) -> Iterator[None]:
    """autocast while torch.compile traces: the frame stack as in eager; an outermost exit with grad enabled runs
    the traced updates (fp8kit.pytorch.compiled)."""
    _STACK.frames = stack + (frame,)
    try:
        yield
    finally:
        _STACK.frames = stack
    if not stack and torch.is_grad_enabled() and frame.step.traced is not None:
        frame.step.traced.update()


@contextlib.contextmanager
def graph_capture_autocast(enabled: bool, calibrating: bool, recipe: Optional[Recipe],
                           amax_reduction_group=None) -> Iterator[None]:
    """The autocast a graph is captured under (make_graphed_callables): modules cast and record amaxes as usual,
    but keep no per-step Python state, and its exit updates nothing."""
    recipe = entry_recipe(recipe)
    stack = _STACK.frames
    step = _Step()
    _STACK.frames = stack + (Frame(enabled, calibrating, recipe, amax_reduction_group, step, graph=True),)
    try:
        yield step
    finally:
        _STACK.frames = stack


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None):
    """The older name of `autocast`, with Transformer Engine's older argument names."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)
