"""Multi-process checks: rules every rank of an amax reduction must keep (docs/distributed.md, "Rules"). Each
violation must end, on every rank, in an fp8kit error naming the rule and the ranks, within seconds (the worker's
process-group timeout is 30 s and the launcher's hard limit 90 s), and a rank that is merely slow must not trigger
one. Every case uses its own recipe (its own autocast key), so a broken key leaves the next case alone."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import fp8kit.pytorch as te
from fp8kit.pytorch.dist_rules import rule_check
from fp8kit.pytorch.distributed import DistributedRuleError
from fp8kit.recipe import DelayedScaling

from dist_common import RANK


def _expect_rule_error(run, *needles, limit=20.0, barrier=True):
    start = time.time()
    try:
        run()
    except DistributedRuleError as e:
        message = str(e)
    else:
        raise AssertionError("no DistributedRuleError")
    took = time.time() - start
    assert took < limit, f"the error took {took:.1f} s"
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    if barrier:
        dist.barrier()  # the ranks are aligned again (every rank raised)
    return message


def _steps(layer, recipe, steps, fail_at=None, no_grad_at=None, group=None):
    for step in range(steps):
        x = torch.randn(4, 16, requires_grad=True)
        if step == fail_at:
            try:
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    layer(x)
                    raise ValueError("a bad batch")
            except ValueError:
                continue  # caught and carried on: the violation
        if step == no_grad_at:
            with torch.no_grad(), te.autocast(recipe=recipe, amax_reduction_group=group):
                layer(x)
            continue
        with te.autocast(recipe=recipe, amax_reduction_group=group):
            y = layer(x)
        y.sum().backward()


def check_rule_caught_exception():
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=11)
    msg = _expect_rule_error(lambda: _steps(layer, recipe, 6, fail_at=2 if RANK == 1 else None),
                             "at different autocast steps", "ranks [1] are ahead of ranks [0]",
                             "step 3 left by an exception", "do not catch an exception")
    assert "rank 0:" in msg and "rank 1:" in msg


def check_rule_no_grad_step():
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=12)
    _expect_rule_error(lambda: _steps(layer, recipe, 6, no_grad_at=3 if RANK == 0 else None),
                       "at different autocast steps", "ranks [0] are ahead of ranks [1]", "step 4 under no_grad")
    # evaluation under no_grad on every rank is fine
    layer2 = te.Linear(16, 16)
    recipe2 = DelayedScaling(amax_history_len=13)
    _steps(layer2, recipe2, 5, no_grad_at=2)
    assert layer2.fp8_meta["scaling_fwd"].update_count == 4


def check_rule_different_groups():
    other = dist.new_group(ranks=list(range(dist.get_world_size())))  # same ranks, another group object
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=14)
    _expect_rule_error(lambda: _steps(layer, recipe, 3, group=None if RANK == 0 else other),
                       "different amax_reduction_group object", "ranks ")


def check_rule_different_reduce_amax():
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=15, reduce_amax=RANK == 0)
    _expect_rule_error(lambda: _steps(layer, recipe, 8), "different reduce_amax", "reduce_amax=True",
                       "reduce_amax=False")


def check_rule_slow_rank_is_fine():
    """A rank that pauses for a while (writing a checkpoint, say) is waited for, at registration and later."""
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=16)
    # 1.5 s: 150 polls of the registration handshake; nothing in fp8kit has a timeout (the warning comes at 30 s)
    if RANK == 1:
        time.sleep(1.5)  # before the key's first update: the registration handshake waits
    for step in range(4):
        if RANK == 0 and step == 2:
            time.sleep(1.5)  # in the steady state: the all-reduce waits
        _steps(layer, recipe, 1)
    assert layer.fp8_meta["scaling_fwd"].update_count == 4


def _stop_process(check: str) -> None:
    """Record `check` as passed on this rank and end the process at once, as a rank does after an uncaught error
    (no barrier, no destroy_process_group)."""
    path = os.path.join(os.environ["FP8KIT_TEST_OUT"], f"result{RANK}.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[check] = {"ok": True, "error": "", "seconds": 0.0}
    with open(path + ".tmp", "w") as fh:
        json.dump(results, fh)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    os._exit(0)


def check_rule_peer_stops():
    """A rank that stops during a rule check leaves its peers an fp8kit DistributedRuleError that says which rank
    and where to look, within seconds, instead of torch's connection errors or a wait that never ends. Last of the
    2-rank checks: both processes end here."""
    # 1. Rank 1 raises a rule error (posted to the store) while rank 0 waits for it at a new key's handshake.
    te.distributed.apply_pending_updates()  # the earlier checks' deferred backward updates, on both ranks
    layer = te.Linear(16, 16)
    if RANK == 1:
        time.sleep(0.5)  # rank 0 is waiting by now
        try:
            with rule_check("a test check", (DelayedScaling(amax_history_len=18), None)):
                raise DistributedRuleError("fp8kit: rank 1 broke a rule (a test)")
        except DistributedRuleError:
            pass
    else:
        _expect_rule_error(lambda: _steps(layer, DelayedScaling(amax_history_len=18), 1), "waited for ranks [1]",
                           "rank 1 raised 'fp8kit: rank 1 broke a rule (a test)'", "See that rank's error",
                           barrier=False)
    dist.barrier()
    # 2. Rank 0, which serves torch.distributed's store, stops; rank 1 is at a new key's handshake (a store read).
    if RANK == 0:
        _stop_process("rule_peer_stops")
    time.sleep(0.5)
    message = _expect_rule_error(lambda: _steps(layer, DelayedScaling(amax_history_len=19), 1),
                                 "fp8kit: rank 1 could not finish the forward amax reduction",
                                 "rank 0 failed a rule check (see its error)", barrier=False)
    assert "Connection" in message or "Dist" in message, message  # torch's cause is quoted, not thrown
    _stop_process("rule_peer_stops")
