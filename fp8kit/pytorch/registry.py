"""The registry of delayed-scaling states: `(recipe, amax_reduction_group)` -> the states registered under it, in
registration order, with the bookkeeping amax reduction needs (a version bumped when the set changes, a counter of
the autocast steps that entered the key, and a short log of them for error messages)."""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from ..recipe import DelayedScaling, Recipe
from .state import ScalingState
from .state_block import can_update_whole, place, update_states

__all__ = ["KeyStates", "StepNote", "all_keys", "entry", "key_entry", "register", "registry_states", "reduces",
           "reduce_group", "dist_initialized", "update_key"]


@dataclass
class StepNote:
    """One autocast step that entered a key, as seen by this rank."""

    seq: int  # the key's step counter for it (1, 2, ...)
    grad: bool  # grad was enabled when the step entered the key
    aborted: bool = False  # left by an exception


class KeyStates:
    """The states registered under one registry key, in registration order (held weakly)."""

    def __init__(self, recipe: DelayedScaling, group):
        self.recipe = recipe
        self.group = group
        self.forward: List[weakref.ref] = []
        self.backward: List[weakref.ref] = []
        self.version = 0  # bumped whenever the registered set changes (the distributed registration check)
        self.backward_ran = False  # a step's backwards completed since the last reduced backward update
        self.steps = 0  # autocast steps that entered this key (the step counter amax reduction compares)
        self.log: Deque[StepNote] = collections.deque(maxlen=4)
        self.local_checks_left = 8  # first local updates that look for conflicting registrations on other ranks
        self.blocks: Dict[str, object] = {}  # "forward" / "backward" -> the SlotBlock its eager states live in

    def live(self, which: str, key) -> List[ScalingState]:
        refs = getattr(self, which)
        states = [r() for r in refs]
        states = [s for s in states if s is not None and s.key == key]
        if len(states) != len(refs):  # drop states of deleted or re-registered modules
            setattr(self, which, [weakref.ref(s) for s in states])
            self.version += 1
        return states

    def begin_step(self, grad: bool) -> int:
        """A new autocast step entered the key; returns its number."""
        self.steps += 1
        self.log.append(StepNote(self.steps, grad))
        return self.steps

    def abort_step(self, seq: int) -> None:
        for note in self.log:
            if note.seq == seq:
                note.aborted = True


# The registry: (recipe snapshot, group) -> states. Keys compare every recipe field (snapshots are read-only).
_REGISTRY: Dict[Tuple[Recipe, object], KeyStates] = {}


def entry(key) -> Optional[KeyStates]:
    """The registry entry of `key`, or None."""
    return _REGISTRY.get(key)


def all_keys() -> list:
    """Every registry key, in creation order."""
    return list(_REGISTRY)


def key_entry(recipe: DelayedScaling, group) -> KeyStates:
    """The registry entry of `(recipe, group)`, created if needed."""
    key = (recipe, group)
    found = _REGISTRY.get(key)
    if found is None:
        found = _REGISTRY[key] = KeyStates(recipe, group)
    return found


def register(recipe: DelayedScaling, group, forward: ScalingState, backward: ScalingState,
             flat: bool = True) -> None:
    """Register a module's states under `(recipe, group)` (moving them from another key if needed). `flat`: place
    them into the key's flat buffers (fp8kit.pytorch.state_block); False while torch.compile traces or a graph is
    captured."""
    key = (recipe, group)
    if forward.key == key and backward.key == key:
        # registered already: no registry lookup, so torch.compile guards on the states, not on the registry
        return
    found = key_entry(recipe, group)
    for state, which in ((forward, "forward"), (backward, "backward")):
        if state.key != key:
            state.key = key
            getattr(found, which).append(weakref.ref(state))
            found.version += 1
            if state._block is not None:  # moving from another key
                state._block.detach(state)
            if flat:
                place(found.blocks, which, state)


def registry_states(recipe: Recipe, group=None) -> Tuple[List[ScalingState], List[ScalingState]]:
    """The live (forward, backward) states registered under `(recipe, group)` (the recipe's fields as they are now)."""
    key = (recipe.snapshot(), group)
    found = _REGISTRY.get(key)
    if found is None:
        return [], []
    return found.live("forward", key), found.live("backward", key)


def dist_initialized() -> bool:
    import torch.distributed as dist  # a sys.modules lookup after the first call; no module state to guard on

    return dist.is_available() and dist.is_initialized()


def reduce_group(recipe: DelayedScaling, group):
    """The group a key's amaxes are all-reduced over (True for the default group), or None without reduction."""
    if not recipe.reduce_amax or not dist_initialized():
        return None
    return True if group is None else group


def reduces(key) -> bool:
    return reduce_group(key[0], key[1]) is not None


def update_key(key, which: str) -> None:
    """The local (not collective) update of `which` ("forward" or "backward") states under `key`: every state
    registered under it, in registration order, whether its module ran in the step or not, as in Transformer Engine
    (whose update covers every module in its buffer) and as the collective update (`amax_reduction`). A state with
    nothing staged keeps its history, scale and update counter (recipes with callables roll every update); one
    with an amax staged outside a training step (the requantization of an FP8 weight by an optimizer step, an
    evaluation under no_grad) rolls it in even when its module did not run."""
    found = _REGISTRY.get(key)
    if found is None:
        return
    recipe = found.recipe
    fmt = recipe.fp8_format.value
    fp8_max = fmt.max_fwd if which == "forward" else fmt.max_bwd
    block = found.blocks.get(which)
    # O(1): every registered state lives in the key's flat buffer (dead ones leave it at once, their references
    # here at the next `live`), so whole-buffer operations update exactly them
    if block is not None and block.attached == len(getattr(found, which)) and can_update_whole(block, recipe):
        block.update(recipe, fp8_max)
        return
    update_states(found.live(which, key), recipe, fp8_max)
