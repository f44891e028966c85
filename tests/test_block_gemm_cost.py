"""What the block-scaled GEMMs dispatch on the accelerator path (`meta` tensors run the code a GPU runs): the
sequential per-block rounding of docs/numerics.md costs one pass over the (M, N) output per K block, so the number
of output-sized tensors per K block is what a GPU pays for. These ceilings fail if the emulated fused multiply-add
(about 20 output-sized float64 and int64 tensors per block) comes back where the scales are powers of two."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.pytorch.block_gemm import block_gemm
from fp8kit.pytorch.nvfp4_gemm import nvfp4_gemm
from fp8kit.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

M, N, K = 1024, 768, 512  # operands (M, K), (N, K) smaller than the output: only output-sized work counts


class _OutputSized(TorchDispatchMode):
    """Per (op, dtype): the elements written by ops whose result has at least M * N elements, in units of M * N
    (passes over the output; views excluded: they move nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= M * N and not func.is_view \
                and not func.overloadpacket.__name__.startswith("empty"):  # an allocation writes nothing
            self.ops[(func.overloadpacket.__name__, out.dtype)] += out.numel() / (M * N)
        return out


def _count(gemm, a, b, **kw):
    with _OutputSized() as c:
        y = gemm(a, b, **kw)
    assert y.shape == (M, N) and y.device.type == "meta"
    return c.ops


def _operands(q):
    x = torch.empty(M, K, device="meta", dtype=torch.bfloat16)
    w = torch.empty(N, K, device="meta", dtype=torch.bfloat16)
    return q(x), q(w)


@pytest.mark.parametrize("name, quantizer, block", [
    ("mxfp8", lambda: MXFP8Quantizer(torch.float8_e4m3fn), 32),
    ("mxfp8 e5m2", lambda: MXFP8Quantizer(torch.float8_e5m2), 32),
    ("float8 block", lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                                  block_scaling_dim=1), 128),
])
def test_block_gemm_passes_per_k_block(name, quantizer, block):
    """Power-of-two scales: per K block, the float64 partial product, its float32 rounding, the scale, and one
    `addcmul` computed in float64 and stored to float32. No int64 bit tricks, no output-sized `where`."""
    ops = _count(block_gemm, *_operands(quantizer()))
    blocks = K // block
    assert ops[("bmm", torch.float64)] == blocks
    assert ops[("addcmul", torch.float32)] == blocks
    assert not any(dtype == torch.int64 or op in ("where", "bitwise_and", "eq") for op, dtype in ops), ops
    f64 = sum(n for (op, dtype), n in ops.items() if dtype == torch.float64)
    assert f64 == blocks, ops  # the partial products only
    assert sum(ops.values()) <= 4 * blocks + 1, ops


def test_float32_scales_keep_the_emulated_fma():
    """Float8 block scales that need not be powers of two (`force_pow_2_scales=False`): the exact FMA emulation."""
    q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1,
                             force_pow_2_scales=False)
    ops = _count(block_gemm, *_operands(q))
    assert ops[("addcmul", torch.float32)] == 0 and ops[("where", torch.int64)] >= K // 128, ops


def test_nvfp4_gemm_passes_per_k_block():
    """NVFP4: per 16-wide K block, one float32 product of the pre-scaled operands and one add into the output."""
    ops = _count(nvfp4_gemm, *_operands(NVFP4Quantizer()))
    blocks = K // 16
    assert ops[("bmm", torch.float32)] == blocks and ops[("add_", torch.float32)] == blocks
    assert sum(ops.values()) <= 2 * blocks + 2, ops  # + the zeros and `alpha * y`
