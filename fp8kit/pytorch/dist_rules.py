"""What amax reduction's rule checks share: their errors, the ranks of a process group, and the module names their
messages use. The bottom of the distributed pieces: amax_reduction.py and distributed.py import it, it imports no
other fp8kit module (the public names are re-exported by fp8kit.pytorch.distributed).
"""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch


class DistributedRuleError(RuntimeError):
    """Ranks of an amax reduction broke a rule they must keep together (docs/distributed.md, "Rules"): raised on
    every rank of the group instead of collectives that never pair."""


class RegistrationMismatchError(DistributedRuleError):
    """Ranks registered different FP8 modules (or are updating different autocast keys) for one amax reduction."""


def _dist():
    import torch.distributed as dist

    return dist


# ---- process groups ---------------------------------------------------------------------------------------------

_RANKS: Dict[object, Tuple[int, ...]] = {}


def group_ranks(group) -> Tuple[int, ...]:
    """Global ranks of `group` (None: the default group; other groups are cached)."""
    dist = _dist()
    if group is None:
        return tuple(range(dist.get_world_size()))
    ranks = _RANKS.get(group)
    if ranks is None:
        ranks = _RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


# ---- module labels in error messages ------------------------------------------------------------------------

_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def label_states(label: str, *states) -> None:
    """Name the module that owns `states` in registration-mismatch messages (modules call this; cheap). Not while
    torch.compile traces: amax reduction, whose messages use the names, is refused there, and guards on this weak
    dictionary would fail as other modules' states are collected."""
    if torch.compiler.is_compiling():
        return
    for state in states:
        if _LABELS.get(state) != label:
            _LABELS[state] = label


def state_label(state) -> str:
    """The name `label_states` gave `state` ("an unnamed FP8 module" if none)."""
    return _LABELS.get(state, "an unnamed FP8 module")
