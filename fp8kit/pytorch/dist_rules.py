"""What amax reduction's rule checks share: their errors (and `rule_check`, which turns any failure inside a check
into one), the ranks of a process group, and the module names their messages use. The bottom of the distributed
pieces: amax_reduction.py and distributed.py import it, it imports no other fp8kit module (the public names are
re-exported by fp8kit.pytorch.distributed).
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

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


# ---- torch.distributed's store ----------------------------------------------------------------------------------

def default_store():
    """torch.distributed's default store (None when there is none)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no default store (an unusual init): this check is skipped
        return None


# ---- failures inside a rule check -----------------------------------------------------------------------------

_FAILED = "fp8kit/failed/"  # + rank: the last rule error that rank raised, {"time", "error"} (read by its peers)
_RECENT_S = 300.0


@contextlib.contextmanager
def rule_check(what: str, key) -> Iterator[None]:
    """Whatever fails inside a rule check or its collectives becomes a DistributedRuleError saying what happened
    and where to look: a rank that raises a rule error posts its first line to the store first, so a peer that
    then loses its connection to it (the collective or the store read fails: the rank exited) names that rank and
    its error instead of torch's "Connection reset by peer"."""
    try:
        yield
    except DistributedRuleError as err:
        _post_failure(str(err))
        raise
    except Exception as err:
        raise DistributedRuleError(_lost_peer_message(what, key, err)) from err


def _post_failure(message: str) -> None:
    store = default_store()
    if store is None:
        return
    try:
        post = {"time": time.time(), "error": message.splitlines()[0][:300]}
        store.set(f"{_FAILED}{_dist().get_rank()}", json.dumps(post))
    except Exception:  # the store may be gone too; the error itself is what matters
        pass


def posted_failures(ranks: Sequence[int], since: Optional[float] = None) -> Optional[List[str]]:
    """The rule errors `ranks` (this one left out) posted recently, or after `since` (a time.time()), as
    "rank r raised ...", or None when the store cannot be reached."""
    store = default_store()
    if store is None:
        return []
    me = _dist().get_rank()
    try:
        names = {r: f"{_FAILED}{r}" for r in ranks if r != me}
        posts = [(r, json.loads(store.get(name))) for r, name in names.items() if store.check([name])]
    except Exception:
        return None
    now = time.time()  # a rule error that a rank caught and got past long ago is not news
    oldest = now - _RECENT_S if since is None else since
    return [f"rank {r} raised {p['error']!r} {now - p['time']:.0f} s ago" for r, p in posts if p["time"] >= oldest]


def _lost_peer_message(what: str, key, err: Exception) -> str:
    dist = _dist()
    recipe, group = key
    me = dist.get_rank()
    try:
        ranks = list(group_ranks(group))
    except Exception:
        ranks = list(range(dist.get_world_size()))
    text = str(err).strip().splitlines()
    cause = f"{type(err).__name__}: {text[0] if text else ''}"[:300]
    head = (f"fp8kit: rank {me} could not finish {what} for {type(recipe).__name__} over ranks {ranks} ({cause}). ")
    posted = posted_failures(ranks)
    if posted:
        return head + ("Another rank raised an fp8kit rule error first and stopped: " + "; ".join(posted)
                       + ". See that rank's error for the rule and how to keep it.")
    if posted is None:  # torch.distributed's store runs in rank 0 (init_process_group's TCP store)
        return head + ("torch.distributed's store, which rank 0 serves, cannot be reached: rank 0 has stopped. "
                       "Most likely rank 0 failed a rule check (see its error); otherwise see rank 0's output for "
                       "why it exited.")
    return head + ("A peer rank of the group has stopped (no fp8kit rule error was posted by any rank): most likely "
                   "it failed (see its error) or exited; see the other ranks' output.")
