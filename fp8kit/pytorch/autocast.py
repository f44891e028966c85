"""The autocast context: a context-local stack of frames, the registry of delayed-scaling states it owns, and
when the batched updates run (SPEC section 6).

- A module registers its forward and backward states on its first FP8 (or calibrating) forward, under the key
  `(recipe, amax_reduction_group)`.
- Forward states of every key used in a step are updated when the outermost autocast exits, if grad is enabled.
- Backward states are updated once the backward of every FP8 module call of that step has run.
- With amax reduction active (`reduce_amax=True` and torch.distributed initialised) every update is collective
  (`distributed.reduced_update`): at the outermost exit, every delayed-scaling key entered in the step is updated on
  every rank, whether or not this rank ran a module of it; backward updates are deferred to the next outermost entry
  with grad enabled (`_PENDING_BACKWARD`), a point every rank reaches in the same order. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe
from .recompute import in_backward, in_reentrant_checkpoint, release_step
from .state import ScalingState, update_states

__all__ = ["autocast", "fp8_autocast", "current_frame", "registry_states"]


class _KeyStates:
    """The states registered under one registry key, in registration order (held weakly)."""

    def __init__(self, recipe: DelayedScaling, group):
        self.recipe = recipe
        self.group = group
        self.forward: List[weakref.ref] = []
        self.backward: List[weakref.ref] = []
        self.version = 0  # bumped whenever the registered set changes (the distributed registration check)
        self.backward_ran = False  # a step's backwards completed since the last reduced backward update

    def live(self, which: str, key) -> List[ScalingState]:
        refs = getattr(self, which)
        states = [r() for r in refs]
        states = [s for s in states if s is not None and s.key == key]
        if len(states) != len(refs):  # drop states of deleted or re-registered modules
            setattr(self, which, [weakref.ref(s) for s in states])
            self.version += 1
        return states


# The registry: (recipe, group) -> states. Keys compare every recipe field (frozen dataclasses).
_REGISTRY: Dict[Tuple[Recipe, object], _KeyStates] = {}

# Keys whose reduced backward update waits for the next outermost autocast entry (insertion order = update order).
_PENDING_BACKWARD: Dict[tuple, None] = {}


class _Step:
    """One outermost autocast scope: the keys it touched and the FP8 backwards still to run."""

    def __init__(self):
        self.forward_keys: Dict[tuple, None] = {}
        self.backward_keys: Dict[tuple, None] = {}
        self.entered: Dict[tuple, None] = {}  # keys of the delayed-scaling frames entered, in order
        self.pending_backward = 0
        self.backward_finished = False  # the step's backward update has run
        self.lock = threading.Lock()

    def forward_called(self, key, needs_backward: bool) -> None:
        self.forward_keys[key] = None
        if needs_backward:
            with self.lock:
                self.pending_backward += 1
                self.backward_keys[key] = None

    def backward_done(self) -> None:
        with self.lock:
            if self.pending_backward <= 0:
                return
            self.pending_backward -= 1
            run = self.pending_backward == 0
            keys = list(self.backward_keys)
            if run:
                self.backward_keys = {}
        if run:
            self.backward_finished = True
            release_step(self)  # no recompute of this step is left to come
            for key in keys:
                if _reduces(key):  # collective: deferred to the next outermost entry (_run_pending_backward)
                    _REGISTRY[key].backward_ran = True
                else:
                    _update_key(key, "backward")

    def discard_forward_amaxes(self) -> None:
        """Clear the forward staging amaxes of the delayed-scaling keys this step used (an aborted step: they are not
        merged into the next update)."""
        for key in self.forward_keys:
            entry = _REGISTRY.get(key)
            if entry is not None:
                for state in entry.live("forward", key):
                    with torch.no_grad():
                        state.amax_history[0].zero_()


@dataclass(frozen=True)
class Frame:
    """One entry of the autocast stack."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
    group: object
    step: _Step = field(compare=False)
    replay: bool = field(default=False, compare=False)  # entered by a recompute during backward: updates nothing

    @property
    def key(self) -> tuple:
        return (self.recipe, self.group)

    @property
    def records_amax(self) -> bool:
        """True when modules must record amaxes into delayed-scaling state (FP8 or calibration)."""
        return isinstance(self.recipe, DelayedScaling) and (self.enabled or self.calibrating)


_STACK: contextvars.ContextVar[Tuple[Frame, ...]] = contextvars.ContextVar("fp8kit_autocast_stack", default=())


def current_frame() -> Optional[Frame]:
    """The innermost autocast frame, or None outside any autocast."""
    stack = _STACK.get()
    return stack[-1] if stack else None


def register(frame: Frame, forward: ScalingState, backward: ScalingState) -> None:
    """Register a module's states under the frame's key (moving them from another key if needed)."""
    key = frame.key
    entry = _REGISTRY.get(key)
    if entry is None:
        entry = _REGISTRY[key] = _KeyStates(frame.recipe, frame.group)
    for state, which in ((forward, "forward"), (backward, "backward")):
        if state.key != key:
            state.key = key
            getattr(entry, which).append(weakref.ref(state))
            entry.version += 1


def registry_states(recipe: Recipe, group=None) -> Tuple[List[ScalingState], List[ScalingState]]:
    """The live (forward, backward) states registered under `(recipe, group)`."""
    key = (recipe, group)
    entry = _REGISTRY.get(key)
    if entry is None:
        return [], []
    return entry.live("forward", key), entry.live("backward", key)


def _reduce_group(recipe: DelayedScaling, group):
    if not recipe.reduce_amax or not _dist_initialized():
        return None
    return True if group is None else group


_DIST = []  # torch.distributed once imported (it is not imported with torch on every build)


def _dist_initialized() -> bool:
    if not _DIST:
        import torch.distributed as dist

        _DIST.append(dist)
    dist = _DIST[0]
    return dist.is_available() and dist.is_initialized()


def _reduces(key) -> bool:
    return _reduce_group(key[0], key[1]) is not None


def _update_step(step: _Step) -> None:
    """The forward updates at the outermost exit; collective for the keys with amax reduction."""
    reduced = [key for key in step.entered if _reduces(key)]
    for key in step.forward_keys:
        if key not in reduced:
            _update_key(key, "forward")
    if reduced:
        from .distributed import reduced_update

        for key in reduced:
            reduced_update(key, "forward", key in step.forward_keys)
            _PENDING_BACKWARD[key] = None


def has_pending_backward(state: ScalingState) -> bool:
    """True when `state` (a backward state) waits for a deferred, collective backward update."""
    return state.key in _PENDING_BACKWARD


def _run_pending_backward() -> None:
    """The deferred backward updates of reduced keys, in the order their steps exited (the same on every rank)."""
    from .distributed import reduced_update

    while _PENDING_BACKWARD:
        key = next(iter(_PENDING_BACKWARD))
        del _PENDING_BACKWARD[key]
        entry = _REGISTRY.get(key)
        used = entry is not None and entry.backward_ran
        if entry is not None:
            entry.backward_ran = False
        if _reduces(key):
            reduced_update(key, "backward", used)
        elif used:  # torch.distributed was shut down meanwhile: a local update
            _update_key(key, "backward")


def _update_key(key, which: str) -> None:
    entry = _REGISTRY.get(key)
    if entry is None:
        return
    states = entry.live(which, key)
    recipe = entry.recipe
    fmt = recipe.fp8_format.value
    fp8_max = fmt.max_fwd if which == "forward" else fmt.max_bwd
    update_states(states, recipe, fp8_max)


def _check_recipe(recipe) -> Recipe:
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            f"autocast: recipe must be a fp8kit.recipe.DelayedScaling or Float8CurrentScaling, got {recipe!r}"
        )
    return recipe


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
    recipe: DelayedScaling (the default when None) or Float8CurrentScaling.
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
    recipe = _check_recipe(recipe)
    stack = _STACK.get()
    if in_backward() or (stack and stack[-1].replay):
        token = _STACK.set(stack + (Frame(enabled, calibrating, recipe, amax_reduction_group, _Step(), True),))
        try:
            yield
        finally:
            _STACK.reset(token)
        return
    if not stack and _PENDING_BACKWARD and torch.is_grad_enabled():
        _run_pending_backward()
    step = stack[0].step if stack else _Step()
    frame = Frame(enabled, calibrating, recipe, amax_reduction_group, step)
    if frame.records_amax:
        step.entered.setdefault(frame.key, None)
    token = _STACK.set(stack + (frame,))
    try:
        yield
    except BaseException:
        if not stack:
            step.discard_forward_amaxes()
        raise
    finally:
        _STACK.reset(token)
    if not stack and (torch.is_grad_enabled() or in_reentrant_checkpoint()):
        _update_step(step)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None):
    """The older name of `autocast`, with Transformer Engine's older argument names."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)
