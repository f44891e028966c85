"""fp8kit.pytorch on torch.distributed (SPEC section 9): amax reduction, modules skipped on some ranks,
registration mismatches, tensor-parallel Linear, DDP and FSDP2, on local gloo processes (CPU).

The checks themselves live in tests/dist_workers.py, tests/dist_workers_tp.py and tests/dist_workers_mlp.py (each
says what it compares against), started by tests/dist_launch.py. The processes start once per world size for the
session (tests/conftest.py: with the 2-rank checks of the other files) and run every check in turn; each launch has a
hard timeout, so nothing can hang.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.amax_reduction import mismatch_message

from dist_launch import check_result

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

TWO_RANKS = ["amax_reduction", "moe_skip", "unused_key_keeps_state", "registration_mismatch", "tp_linear",
             "tp_block_linear",
             "tp_mlp_bf16", "ddp", "ddp_unused_expert", "fsdp2",
             "tp_layernorm_mlp", "tp_layernorm_linear"]  # the last two: tests/dist_workers_mlp.py
RULES = ["rule_caught_exception", "rule_no_grad_step", "rule_different_groups", "rule_different_reduce_amax",
         "rule_slow_rank_is_fine", "rule_peer_stops"]  # rule_peer_stops ends the processes: it runs last
FOUR_RANKS = ["tp_dp_4_ranks", "moe_skip", "amax_reduction"]


@pytest.mark.parametrize("check", TWO_RANKS)
def test_two_ranks(two_rank_run, check):
    check_result(two_rank_run, check)


@pytest.mark.parametrize("check", RULES)
def test_rule_violations_end_in_errors_on_every_rank(two_rank_run, check):
    """Each violation raises an fp8kit DistributedRuleError on every rank within seconds, never a hang."""
    check_result(two_rank_run, check)


@pytest.mark.parametrize("check", FOUR_RANKS)
def test_four_ranks(four_rank_run, check):
    check_result(four_rank_run, check)


def test_example_runs_under_torchrun(tmp_path):
    example = pathlib.Path(__file__).parents[1] / "examples" / "distributed.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(example)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical on all 2 ranks: True" in result.stdout
    assert "output (8, 4, 64)" in result.stdout


# ---- without processes ------------------------------------------------------------------------------------------

def test_tensor_parallel_arguments_are_validated():
    with pytest.raises(ValueError, match="parallel_mode"):
        te.Linear(16, 16, parallel_mode="diagonal")
    # as in Transformer Engine, sequence parallelism takes effect only with a parallel mode and more than one rank
    assert te.Linear(16, 16, sequence_parallel=True).sequence_parallel is False
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        te.Linear(16, 16, parallel_mode="row", sequence_parallel=1)
    with pytest.raises(ValueError, match="tp_size"):
        te.Linear(16, 16, tp_size=0)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            te.Linear(16, 16, parallel_mode="column", tp_group=object())


def test_no_tp_group_means_an_ordinary_layer():
    """As in Transformer Engine, parallel_mode without a tp_group is a tensor-parallel size of 1."""
    torch.manual_seed(0)
    layer = te.Linear(16, 32, parallel_mode="row")
    assert layer.weight.shape == (32, 16) and layer.tp_size == 1 and "parallel_mode=row" in repr(layer)
    x = torch.randn(4, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_mismatch_message_names_ranks_counts_and_position():
    a = {"key": "k", "states": [["Linear(a)", 3, 4], ["Linear(b)", 3, 4]]}
    b = {"key": "k", "states": [["Linear(a)", 3, 4]]}
    msg = mismatch_message("forward", "k", (0, 1, 2), [a, a, b])
    assert "ranks 0 and 2" in msg and "rank 0 has 2 modules, rank 2 has 1" in msg and "position 1" in msg
    assert "Linear(b) [3 slots, history 4]" in msg and "rank 2 has nothing" in msg
    assert mismatch_message("forward", "k", (0, 1), [a, a]) is None
    other_key = mismatch_message("backward", "k", (0, 1), [a, {"key": "j", "states": a["states"]}])
    assert "different autocast keys" in other_key
