"""The attention stack on 2 gloo ranks (tests/dist_workers_attn.py): tensor-parallel MultiheadAttention and
TransformerLayer, with and without sequence parallelism, equal a single-process module with the full weights."""

import pytest
import torch

import fp8kit.pytorch as te

from dist_launch import check_result

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

CHECKS = ["tp_attention", "tp_transformer_layer"]


@pytest.mark.parametrize("check", CHECKS)
def test_tensor_parallel_attention_matches_one_process(two_rank_run, check):
    if check == "tp_transformer_layer" and not hasattr(te, "LayerNormMLP"):
        pytest.skip("TransformerLayer needs te.LayerNormMLP")
    check_result(two_rank_run, check)
