"""Named random-number-generator states for model parallelism (Transformer Engine's `CudaRNGStatesTracker`).

The tracker keeps named generator states (e.g. one for the tensor-parallel region, seeded differently per rank) and
`fork(name)` runs a block under one of them. It drives the CUDA default generator when CUDA is initialised and the
CPU default generator otherwise, so the same code runs on a CPU.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

__all__ = ["CudaRNGStatesTracker"]


def _use_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def get_rng_state() -> torch.Tensor:
    """The default generator's state (CUDA's current device when CUDA is initialised, else the CPU's)."""
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named generator states. `add(name, seed)` creates one; `fork(name)` runs a block with it and keeps what the
    block drew; `get_states()` / `set_states()` save and restore them all (activation recompute does)."""

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A new dict of the current states (the tensors themselves, not copies)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the states by `states` (name -> generator state, as `get_states` returns)."""
        if not isinstance(states, dict):
            raise TypeError(f"CudaRNGStatesTracker.set_states: expected a dict of name -> state, got "
                            f"{type(states).__name__}")
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create the state `name` from `seed` (each name and each seed at most once)."""
        if seed in self.seeds_:
            raise RuntimeError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        self.seeds_.add(seed)
        original = get_rng_state()
        try:
            if _use_cuda():
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states_[name] = get_rng_state().clone()
        finally:
            set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block with the state `name`, keep the state it leaves, then restore the previous one."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added")
        original = get_rng_state()
        set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_rng_state()
            set_rng_state(original)
