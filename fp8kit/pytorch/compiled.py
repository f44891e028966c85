"""FP8 module calls inside torch.compile: what is traced, and what runs at the graph boundary.

Inside a compiled region every number comes from traced tensor operations: the casts read the state's scale tensor,
record their amax into the staging row (in place, forward and backward), and an outermost autocast entered inside the
region runs the batched update at its exit as tensor operations (`state.update_states` on the tensor path). What the
eager code keeps in Python per step (which modules ran, how many backwards are outstanding, recompute records) cannot
be traced without recompiling at every step, so a compiled call keeps none of it. Instead:

- An autocast entered inside the region (`step.traced`) lists the states its calls used while tracing (the same
  list at every run of the graph). At its exit the graph updates the forward states of those calls, as eager does,
  and also their backward states: that update applies the amaxes the previous step's backward recorded, so every
  backward cast still uses the scale eager would use. The update rule leaves a state with no recorded amax unchanged
  (SPEC section 5), so running it when nothing is pending changes nothing.
- A compiled call inside an eager autocast flags its states (`ScalingState.compiled`); the eager exit updates the
  flagged forward states with the step's others.
- The backward amaxes of the last compiled step wait in the staging rows (where checkpoints keep them too): the next
  eager outermost entry with grad enabled, or `apply_pending_updates()`, runs them (`flush_backward`).

Recipes with callables are refused inside a compiled region: their scales are checked on the host before use.
Amax reduction across ranks inside a compiled region is refused as well (its rule checks read the step counters on
the host); compile the model and keep the reducing autocast outside it.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from ..recipe import DelayedScaling
from .registry import all_keys, entry, reduces, update_key
from .state import ScalingState, update_states

__all__ = ["compiling", "check_state_setup", "TracedCalls", "note_compiled_call", "PENDING", "flagged_forward",
           "flush_backward"]


def compiling() -> bool:
    """True while torch.compile traces (fp8kit then takes the tensor path and keeps no per-step Python state)."""
    return torch.compiler.is_compiling()


# torch.compile before torch 2.12 (2.11 seen) loses the tensors a traced call gives a module's delayed-scaling state
# the first time (the state placed into its key's flat buffer while tracing): the compiled graph records no amax and
# updates no scale, silently (docs/pytorch.md, "torch.compile and CUDA graphs")
SETUP_TRACEABLE = torch.__version__ >= (2, 12)  # torch.torch_version.TorchVersion compares as a version


def check_state_setup(module_name: str) -> None:
    """Refuse to set up a module's delayed-scaling state inside a compiled region where torch cannot trace it."""
    if compiling() and not SETUP_TRACEABLE:
        raise RuntimeError(
            f"fp8kit: {module_name}'s first delayed-scaling call under this recipe is inside torch.compile, and torch "
            f"{torch.__version__} loses the FP8 state such a call sets up (no amax would be recorded, no scale "
            "updated). Run one step eagerly, outside torch.compile, with the same recipe first, or use torch >= 2.12")


class _Pending:
    """`any` is set by compiled code whose states eager code must update (flags on the states say which)."""

    def __init__(self):
        self.any = False


PENDING = _Pending()


class TracedCalls:
    """The delayed-scaling calls of one autocast step traced by torch.compile: per registry key, its forward and
    backward states in call order (each once)."""

    def __init__(self):
        self.keys: List[tuple] = []
        self.forward: List[List[ScalingState]] = []
        self.backward: List[List[ScalingState]] = []

    def add(self, key, states: Tuple[ScalingState, ScalingState], counted: bool) -> None:
        index = None
        for i, k in enumerate(self.keys):
            if k == key:
                index = i
        if index is None:
            self.keys.append(key)
            self.forward.append([])
            self.backward.append([])
            index = len(self.keys) - 1
        _add_once(self.forward[index], states[0])
        if counted:
            _add_once(self.backward[index], states[1])

    def update(self) -> None:
        """The updates at the step's exit, as traced tensor operations (see the module docstring)."""
        for key, forward, backward in zip(self.keys, self.forward, self.backward):
            recipe = key[0]
            fmt = recipe.fp8_format.value
            update_states(forward, recipe, fmt.max_fwd)
            update_states(backward, recipe, fmt.max_bwd)


def _add_once(states: List[ScalingState], state: ScalingState) -> None:
    for s in states:
        if s is state:
            return
    states.append(state)


def note_compiled_call(frame, states: Tuple[ScalingState, ScalingState], counted: bool) -> None:
    """A delayed-scaling FP8 call traced by torch.compile under `frame`."""
    recipe: DelayedScaling = frame.recipe
    if recipe.uses_callables:
        raise NotImplementedError(
            "fp8kit: a DelayedScaling recipe with callables (amax_compute_algo / scaling_factor_compute_algo) cannot "
            "run inside torch.compile: fp8kit checks the scales they return on the host before using them. Use "
            "amax_compute_algo='max' or 'most_recent', or keep these modules out of the compiled region")
    if reduces(frame.key):
        raise NotImplementedError(
            "fp8kit: amax reduction (DelayedScaling(reduce_amax=True) with torch.distributed initialised) cannot run "
            "inside torch.compile: its rule checks compare step counters on the host. Keep the autocast outside the "
            "compiled region, or use reduce_amax=False or Float8CurrentScaling")
    step = frame.step
    if step.traced is not None:
        step.traced.add(frame.key, states, counted)
    else:  # an eager step: its exit updates the flagged forward states
        states[0].compiled = True
    if counted:  # the amaxes its backward records wait for the next update (flush_backward or a traced exit)
        states[1].compiled = True
    PENDING.any = True


def flagged_forward(key) -> List[ScalingState]:
    """The forward states under `key` that compiled calls flagged (flags cleared)."""
    found = entry(key)
    if found is None:
        return []
    flagged = [s for s in found.live("forward", key) if s.compiled]
    for s in flagged:
        s.compiled = False
    return flagged


def flush_backward() -> None:
    """Update the backward states flagged by compiled calls (the backward amaxes they left pending), locally."""
    if not PENDING.any:
        return
    PENDING.any = False
    for key in all_keys():
        flagged = [s for s in entry(key).live("backward", key) if s.compiled]
        for s in flagged:
            s.compiled = False
        if flagged:
            update_key(key, "backward")
