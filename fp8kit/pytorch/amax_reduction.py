"""The collective delayed-scaling update (amax reduction) and the rules every rank must keep (SPEC section 9).

Every update of a registry key `(recipe, amax_reduction_group)` with `reduce_amax=True` all-reduces (MAX) ONE
float32 tensor over the group:

    [changed, used, key_hash, -key_hash, step, -step, staging row of every slot under the key, in registration order]

- `changed` (any rank's registered states differ from the last agreed set): the ranks exchange a fingerprint of their
  states and raise `RegistrationMismatchError` on every rank if they differ; otherwise the staging rows of the new
  set are all-reduced. This only happens when registration changes (first steps).
- `used` (any rank ran a module of the key): 0 everywhere means nothing rolls and no scale changes.
- `key_hash` of the recipe, the group's ranks and the pass (forward / backward): max(h) == -max(-h) only when every
  rank is updating the same key and pass at this point.
- `step`: the key's autocast-step counter (every outermost autocast that entered the key, with or without grad,
  finished or aborted). Different counters mean a rank skipped or added a step: an exception caught inside autocast,
  a step under no_grad on some ranks only. The ranks then exchange their recent steps and raise on every rank.
The body has the length agreed at the last check, so the collective's size matches on every rank.

Once per key, before its first update, each rank also posts to torch.distributed's store which process group object
and `reduce_amax` it uses for that recipe over those ranks, and compares with the other ranks' posts: passing
different group objects over the same ranks, or different `reduce_amax`, is an error on every rank instead of
collectives that never pair. A rank that is merely slow is waited for, up to the process group's timeout (as a
collective would); a rank that raised a rule error meanwhile ends the wait at once.

Any failure inside these checks and collectives is a DistributedRuleError on every rank (`dist_rules.rule_check`): a
rank that raises a rule error posts it to the store, and a peer that then loses its connection to that rank (it
exited) names it, or names rank 0 when the store it serves cannot be reached.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import registry
from .dist_rules import (
    DistributedRuleError,
    RegistrationMismatchError,
    default_store,
    group_ranks,
    posted_failures,
    rule_check,
    state_label,
)
from .state_block import update_states

__all__ = ["reduced_update", "check_local_key", "mismatch_message", "recipe_description"]


def _dist():
    import torch.distributed as dist

    return dist


def _collective_device(group, states) -> torch.device:
    if states:
        return states[0].scale.device
    if "nccl" in str(_dist().get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- descriptions ------------------------------------------------------------------------------------------------

def recipe_description(recipe, skip: Sequence[str] = ()) -> str:
    """The recipe's fields as text that is the same on every rank (callables by their qualified names)."""
    parts = []
    for f in dataclasses.fields(recipe):
        if f.name in skip:
            continue
        value = getattr(recipe, f.name)
        if callable(value) and not isinstance(value, type):
            value = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
        else:
            value = repr(value)
        parts.append(f"{f.name}={value}")
    return f"{type(recipe).__name__}({', '.join(parts)})"


_KEY_DESC: Dict[tuple, Tuple[str, float]] = {}


def _key_desc(key, which: str) -> Tuple[str, float]:
    """(text, hash below 2**24 so that float32 holds it exactly) of a key and pass, the same on every rank."""
    found = _KEY_DESC.get((key, which))
    if found is None:
        recipe, group = key
        text = f"recipe {recipe_description(recipe)}, group ranks {list(group_ranks(group))}"
        digest = zlib.crc32(f"{text}; {which}".encode()) & 0xFFFFFF
        found = _KEY_DESC[(key, which)] = (text, float(digest + 1))
    return found


def _fingerprint(states) -> List[list]:
    return [[state_label(s), s.num_slots, s.history_len] for s in states]


def _all_gather_bytes(payload: bytes, group, device) -> List[bytes]:
    """Every rank's `payload`, in group order: lengths first, then the zero-padded bytes."""
    dist = _dist()
    n = len(group_ranks(group))
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(n)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t) for t in lengths]
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    buf[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[:size].cpu().tolist()) for b, size in zip(bufs, sizes)]


def _describe(item) -> str:
    label, slots, length = item
    return f"{label} [{slots} slots, history {length}]"


def mismatch_message(which: str, key_text: str, ranks: Sequence[int], prints: List[dict]) -> Optional[str]:
    """The error for ranks whose registered states (`prints`, in group order) differ, or None if they agree."""
    first = prints[0]
    for rank, other in zip(ranks[1:], prints[1:]):
        if other == first:
            continue
        head = f"fp8kit: ranks {ranks[0]} and {rank} "
        if other["key"] != first["key"]:
            return (head + f"are updating different autocast keys: rank {ranks[0]} has {first['key']}; rank {rank} "
                    f"has {other['key']}. Enter the same autocast contexts (recipe and amax_reduction_group) in the "
                    "same order on every rank.")
        a, b = first["states"], other["states"]
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        what_a = _describe(a[pos]) if pos < len(a) else "nothing"
        what_b = _describe(b[pos]) if pos < len(b) else "nothing"
        return (head + f"registered different FP8 modules for one amax reduction ({key_text}, {which} states): "
                f"rank {ranks[0]} has {len(a)} modules, rank {rank} has {len(b)}; first difference at position {pos}: "
                f"rank {ranks[0]} has {what_a}, rank {rank} has {what_b}. Every rank must run the first FP8 forward "
                "of every module under this autocast, in the same order (give idle modules, e.g. MoE experts "
                "without tokens, an empty input in the first step); otherwise the all-reduce would mix the slots of "
                "different modules.")
    return None


def _steps_text(notes) -> str:
    parts = []
    for seq, grad, aborted in notes:
        how = "left by an exception" if aborted else ("with grad" if grad else "under no_grad")
        parts.append(f"step {seq} {how}")
    return ", ".join(parts) or "no steps"


def _step_mismatch(key, which: str, seq: int, device) -> DistributedRuleError:
    """Exchange every rank's position and recent steps (one extra collective, on the error path only)."""
    recipe, group = key
    key_text, _ = _key_desc(key, which)
    found = registry.entry(key)
    notes = [(n.seq, n.grad, n.aborted) for n in found.log] if found is not None else []
    mine = {"seq": seq, "which": which, "notes": notes}
    infos = [json.loads(p) for p in _all_gather_bytes(json.dumps(mine).encode(), group, device)]
    ranks = group_ranks(group)
    lines = [f"rank {r}: {info['which']} update of step {info['seq']}; recent steps: {_steps_text(info['notes'])}"
             for r, info in zip(ranks, infos)]
    lo = min(infos, key=lambda i: i["seq"])["seq"]
    ahead = [r for r, i in zip(ranks, infos) if i["seq"] != lo]
    behind = [r for r, i in zip(ranks, infos) if i["seq"] == lo]
    return DistributedRuleError(
        f"fp8kit: the ranks of an amax reduction ({key_text}) are at different autocast steps: ranks {ahead} are "
        f"ahead of ranks {behind}.\n  " + "\n  ".join(lines) + "\nEvery rank of the group must run the same "
        "outermost autocast steps in the same order: do not catch an exception raised inside autocast on one rank "
        "and carry on (re-raise it, or abort the step on every rank), and run steps under no_grad (evaluation) on "
        "every rank, or rank-local ones with te.autocast(enabled=False) or Float8CurrentScaling.")


# ---- the same group object and reduce_amax on every rank (once per key, through the store) -----------------------

# key -> its position among the delayed-scaling keys this process updated while torch.distributed was initialised
_ORDER: Dict[tuple, int] = {}


def _group_name(group) -> str:
    dist = _dist()
    pg = dist.group.WORLD if group is None else group
    return str(getattr(pg, "group_name", "?"))


def _announce(key, store) -> Tuple[int, dict]:
    """Post this rank's n-th key (n = its position here) to the store; returns (n, what was posted)."""
    recipe, group = key
    index = _ORDER.get(key)
    if index is None:
        index = _ORDER[key] = len(_ORDER)
    mine = {"recipe": recipe_description(recipe, skip=("reduce_amax",)), "ranks": list(group_ranks(group)),
            "reduce": recipe.reduce_amax, "group": _group_name(group)}
    store.set(f"fp8kit/key/{index}/{_dist().get_rank()}", json.dumps(mine))
    return index, mine


def _peer(store, index: int, rank: int) -> Optional[dict]:
    name = f"fp8kit/key/{index}/{rank}"
    return json.loads(store.get(name)) if store.check([name]) else None


def _conflict(mine: dict, rank: int, other: dict) -> Optional[str]:
    """The error if rank `rank`'s key at the same position is this key with another group object or reduce_amax."""
    if other["recipe"] != mine["recipe"] or other["ranks"] != mine["ranks"]:
        return None  # another key altogether: the collective's key check names it if the two meet
    if other["reduce"] == mine["reduce"] and other["group"] == mine["group"]:
        return None
    what = "reduce_amax" if other["reduce"] != mine["reduce"] else "amax_reduction_group object"
    me = _dist().get_rank()
    return (f"fp8kit: ranks {me} and {rank} use the same recipe over ranks {mine['ranks']} with a different {what}: "
            f"rank {me} has reduce_amax={mine['reduce']} and process group {mine['group']!r}, rank {rank} has "
            f"reduce_amax={other['reduce']} and process group {other['group']!r} ({mine['recipe']}). Every rank must "
            "pass the same amax_reduction_group object (the same new_group, or None everywhere) and the same "
            "reduce_amax, or the amax all-reduces would never pair.")


def _timeout_s(store) -> Optional[float]:
    """The process group's timeout, which init_process_group gives its store (None if it cannot be read)."""
    try:
        return store.timeout.total_seconds()
    except Exception:
        return None


def _check_reduced_key(key) -> None:
    """Before the first collective of a reduced key: the other ranks of the group registered the same key at this
    position with the same group object and reduce_amax. Waits for ranks that have not got there yet (they may be
    slow); a rank whose key at this position is another one is left to the collective's key check."""
    if key in _ORDER:
        return
    store = default_store()
    if store is None:
        _ORDER[key] = len(_ORDER)
        return
    index, mine = _announce(key, store)
    me = _dist().get_rank()
    pending = [r for r in mine["ranks"] if r != me]
    start = last_note = last_look = time.time()
    limit = _timeout_s(store)
    while pending:
        for rank in list(pending):
            other = _peer(store, index, rank)
            if other is not None:
                pending.remove(rank)
                problem = _conflict(mine, rank, other)
                if problem:
                    raise DistributedRuleError(problem)
        if pending:
            failed = None
            if time.time() - last_look > 0.5:
                last_look = time.time()
                failed = posted_failures(pending, since=start)
            if failed:  # a rank we wait for raised a rule error meanwhile: it will not come
                raise DistributedRuleError(
                    f"fp8kit: rank {me} waited for ranks {pending} to reach the autocast key "
                    f"{_key_desc(key, 'forward')[0]}, but {'; '.join(failed)}. See that rank's error for the rule "
                    "and how to keep it.")
            if limit is not None and time.time() - start > limit:  # as a collective would time out
                raise DistributedRuleError(
                    f"fp8kit: rank {me} waited {limit:.0f} s (the process group's timeout) for ranks {pending} to "
                    f"reach the autocast key {_key_desc(key, 'forward')[0]}: they have stopped or run other autocast "
                    "steps; see their output.")
            if time.time() - last_note > 30:  # a rank not there yet: keep waiting, say so now and then
                last_note = time.time()
                warnings.warn(f"fp8kit: rank {me} has waited {last_note - start:.0f} s for ranks {pending} to reach "
                              f"the autocast key {_key_desc(key, 'forward')[0]}")
            time.sleep(0.01)


def check_local_key(key) -> None:
    """A key updated locally while torch.distributed is initialised (`reduce_amax=False`): at its first updates,
    look (without waiting) whether a rank registered the same recipe at the same position with amax reduction."""
    found = registry.entry(key)
    if found is None or found.local_checks_left <= 0:
        return
    found.local_checks_left -= 1
    store = default_store()
    if store is None:
        return
    with rule_check("the check of a local (reduce_amax=False) key against the other ranks' keys", key):
        index, mine = _announce(key, store)
        for rank in mine["ranks"]:
            other = _peer(store, index, rank) if rank != _dist().get_rank() else None
            problem = other is not None and _conflict(mine, rank, other)
            if problem:
                raise DistributedRuleError(problem)


# ---- the collective update --------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Agreed:
    version: int  # the registry entry's version when the ranks last agreed
    sizes: List[int]  # slots per state, in registration order


_AGREED: Dict[Tuple[tuple, str], _Agreed] = {}


def reduced_update(key, which: str, used: bool, seq: int) -> None:
    """The collective update of `which` ("forward" or "backward") states under registry `key`; every rank of the
    key's group must call it at the same point. `used`: this rank ran a module of the key since the last update;
    `seq`: the key's step counter of the step this update belongs to. A failure in its checks or collectives is a
    DistributedRuleError on every rank (`dist_rules.rule_check`)."""
    with rule_check(f"the {which} amax reduction", key):
        reduced = _reduce(key, which, used, seq)
    if reduced is not None:
        recipe, _ = key
        fmt = recipe.fp8_format.value
        update_states(reduced, recipe, fmt.max_fwd if which == "forward" else fmt.max_bwd)


def _reduce(key, which: str, used: bool, seq: int):
    """The checks and collectives of `reduced_update`; returns the states to update (their staging rows hold the
    group's maxima), or None when there is nothing to update."""
    dist = _dist()
    recipe, group = key
    _check_reduced_key(key)
    found = registry.entry(key)
    states = found.live(which, key) if found is not None else []
    version = found.version if found is not None else 0
    agreed = _AGREED.get((key, which))
    changed = agreed is None or agreed.version != version
    device = _collective_device(group, states)
    key_text, key_hash = _key_desc(key, which)
    head = torch.tensor([float(changed), float(used), key_hash, -key_hash, float(seq), -float(seq)],
                        dtype=torch.float32, device=device)
    if changed or not states:
        body = torch.zeros(sum(agreed.sizes) if agreed is not None else 0, dtype=torch.float32, device=device)
    else:
        body = torch.cat([s.amax_history[0] for s in states])
    buf = torch.cat([head, body])
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    any_changed, any_used, hash_max, neg_hash_max, seq_max, neg_seq_max = buf[:6].tolist()
    if hash_max != -neg_hash_max:
        raise RegistrationMismatchError(
            f"fp8kit: the ranks of group {list(group_ranks(group))} are updating different autocast keys or passes "
            f"at this point (this rank, {dist.get_rank()}: the {which} update of {key_text}). Enter the same "
            "autocast contexts (recipe and amax_reduction_group) in the same order on every rank.")
    if seq_max != -neg_seq_max:
        raise _step_mismatch(key, which, seq, device)
    staging = buf[6:]
    if any_changed:
        mine = {"key": key_text, "states": _fingerprint(states)}
        prints = [json.loads(p) for p in _all_gather_bytes(json.dumps(mine).encode(), group, device)]
        problem = mismatch_message(which, key_text, group_ranks(group), prints)
        if problem:
            raise RegistrationMismatchError(problem)
        _AGREED[(key, which)] = _Agreed(version, [s.num_slots for s in states])
        if not any_used or not states:
            return None
        staging = torch.cat([s.amax_history[0] for s in states])
        dist.all_reduce(staging, op=dist.ReduceOp.MAX, group=group)
    if not any_used or not states:
        return None
    sizes = [s.num_slots for s in states]
    torch._foreach_copy_([s.amax_history[0] for s in states], list(staging.split(sizes)))
    return states

