"""FSDP2 (fully_shard) with FP8 weights from quantized_model_init, on 2 local gloo processes: the all-gather sends FP8
bytes (about half of bf16's), every rank gathers the same weight and scale, training matches the bf16-weight run
within FP8 noise, checkpoints (torch.save and torch.distributed.checkpoint) resume exactly, the delayed-scaling state
equals the unsharded model's bit for bit, and shards quantized with different scales are put on one. The checks live
in tests/dist_workers_fsdp8.py (each says what it compares against); the processes start once for the session
(tests/conftest.py)."""

import pytest
import torch

from dist_launch import check_result

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

CHECKS = ["fsdp8_current", "fsdp8_delayed", "fsdp8_delayed_state", "fsdp8_state_dict", "fsdp8_state_dict_current",
          "fsdp8_different_init"]


@pytest.mark.parametrize("check", CHECKS)
def test_fsdp2_fp8_weights(two_rank_run, check):
    check_result(two_rank_run, check)


# ---- without processes: the tensor operations FSDP2 applies to a Float8Tensor parameter ---------------------------

def _fp8(rows=6, cols=8, scale=4.0):
    import fp8kit.pytorch as te
    from fp8kit.pytorch.tensor.float8_tensor import Float8Quantizer

    quantizer = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), te.DType.kFloat8E4M3)
    return quantizer(torch.randn(rows, cols).bfloat16())


def _bytes(t):
    assert t._data.dtype == torch.uint8  # Transformer Engine's layout
    return t._data.contiguous()


def test_sharding_operations_keep_the_fp8_bytes():
    import fp8kit.pytorch as te

    torch.manual_seed(0)
    q = _fp8(7, 8)
    chunks = torch.chunk(q, 2)  # FSDP2: chunk, pad with new_zeros, narrow + copy_, view(-1)
    assert [c.shape[0] for c in chunks] == [4, 3] and all(isinstance(c, te.Float8Tensor) for c in chunks)
    padded = chunks[1].new_zeros((4, 8))
    assert isinstance(padded, te.Float8Tensor) and padded.dtype == q.dtype and torch.equal(padded._scale_inv,
                                                                                            q._scale_inv)
    assert not bool(_bytes(padded).any())
    padded.narrow(0, 0, 3).copy_(chunks[1])
    assert torch.equal(_bytes(padded)[:3], _bytes(q)[4:]) and not bool(_bytes(padded)[3].any())
    flat = padded.view(-1)
    assert isinstance(flat, te.Float8Tensor) and flat.shape == (32,)
    # the gathered weight is an as_strided view of the all-gather output (its first rows)
    gathered = torch.cat([chunks[0], padded])
    weight = torch.as_strided(gathered, (7, 8), (8, 1), 0)
    assert isinstance(weight, te.Float8Tensor) and torch.equal(_bytes(weight), _bytes(q))
    assert torch.equal(weight.dequantize(), q.dequantize())
    for fresh in (q.new_empty((2, 3)), torch.empty_like(q)):
        assert isinstance(fresh, te.Float8Tensor) and fresh._data.dtype == torch.uint8 \
            and fresh.fp8_dtype == torch.float8_e4m3fn
    # another nominal dtype: the operation runs on values and returns a plain tensor
    other = q.new_zeros((2, 2), dtype=torch.float32)
    assert not isinstance(other, te.Float8Tensor) and other.dtype == torch.float32


def test_post_all_gather_reads_the_gathered_bytes_with_the_shared_scale():
    import fp8kit.pytorch as te

    torch.manual_seed(1)
    q = _fp8(6, 8, scale=8.0)
    shard = torch.chunk(q, 2)[0]
    gathered = _bytes(q).clone()  # what an all-gather of both shards' uint8 bytes returns
    full, inner = shard.fsdp_post_all_gather((gathered,), (q._scale_inv.clone(), torch.float8_e4m3fn),
                                             torch.float32)
    assert isinstance(full, te.Float8Tensor) and full.dtype == torch.float32 and full.shape == (6, 8)
    assert torch.equal(full.dequantize(), q.dequantize(dtype=torch.float32)) and inner[0] is gathered
    # later gathers update the same parameter in place (new bytes, new scale)
    newer = _fp8(6, 8, scale=2.0)
    assert shard.fsdp_post_all_gather((_bytes(newer).clone(),), (newer._scale_inv.clone(), torch.float8_e4m3fn),
                                      torch.float32, out=full) is None
    assert torch.equal(full.dequantize(), newer.dequantize(dtype=torch.float32))
