"""Multi-process checks: rules every rank of an amax reduction must keep (docs/distributed.md, "Rules"). Each
violation must end, on every rank, in an fp8kit error naming the rule and the ranks, within seconds (the worker's
process-group timeout is 30 s and the launcher's hard limit 90 s), and a rank that is merely slow must not trigger
one. Every case uses its own recipe (its own autocast key), so a broken key leaves the next case alone."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import fp8kit.pytorch as te
from fp8kit.pytorch.distributed import DistributedRuleError
from fp8kit.recipe import DelayedScaling

from dist_common import RANK


def _expect_rule_error(run, *needles, limit=20.0):
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
