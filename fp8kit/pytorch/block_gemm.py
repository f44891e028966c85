"""Block-scaled GEMMs, emulated with torch operations on any device (no host synchronisation): MXFP8 (E8M0 scale per
32 along K) and Float8 block scaling (float32 scale per 1x128 or 128x128 block).

`block_gemm(a, b)` computes `A @ B^T` for operands A (M, K) and B (N, K) whose contraction dim K is blocked.
Accumulation order (written down in docs/numerics.md):
1. For each K block j (32 wide for MXFP8, 128 for Float8 block; the last one may be shorter), in increasing j:
   `P_j = A[:, j] @ B[:, j]^T` from the unscaled FP8 values, summed in float64 and rounded once to float32. The
   float64 sum is exact when the block's products span fewer than 53 - log2(block) bits, which E4M3 x E4M3 always
   does, so P_j is then the correctly rounded float32 partial sum, independent of summation order (a tensor core's
   order and internal width are the hardware's and not reproduced).
2. The scales meet the partial sum as Transformer Engine's cuBLAS reference describes
   (tests/pytorch/references/blockwise_fp8_gemm_reference.py): with `sa` the scale of A's rows and `sb` of B's rows
   in block j, `y = fma(P_j * s1, s2, y)` where s1 is the 1-D operand's scale (A's when both are 1-D) and s2 the
   other's; both 2-D: `y = fma(P_j, sa * sb, y)`. MXFP8 operands count as 1-D. Products are float32, the fused
   multiply-add rounds once. Emulated exactly: when s2 is a power of two (MXFP8's E8M0 scales; Float8 block
   scales made with `force_pow_2_scales`), as `float32(y + t * s2)` computed in float64 in one kernel (`t * s2` is
   exact there and rounding the float64 sum to float32 is the single rounding: 53 >= 2 * 24 + 2); otherwise in float64
   with round-to-odd, then one rounding to float32 (`fma32`). Each step is one pass over the (M, N) output: the
   sequential rounding allows no fewer (docs/numerics.md, "Cost on a GPU").
3. `y` (float32) plus the bias in float32, then converted to the output dtype; with `accumulate`, `out +
   y.to(out.dtype)` in the output dtype (cuBLAS converts first, then accumulates).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import block_cast as bc
from . import kernels
from .kernels.block_gemm_ops import A_FIRST, B_FIRST, BOTH_2D, block_gemm_tiles, dot64_for
from .tensor.float8_blockwise_tensor import Float8BlockwiseQTensorStorage
from .tensor.mxfp8_tensor import MXFP8TensorStorage

__all__ = ["BlockOperand", "block_operand", "block_gemm", "fma32", "gemm_epilogue"]

_CHUNK_ELEMENTS = 1 << 23  # partial products computed per batch of blocks: at most 64 MiB of float64


class BlockOperand(NamedTuple):
    """A GEMM operand with its contraction dim last: FP8 values as float32 (rows, K), float32 scale per (row, K
    block) (rows, ceil(K / block)), the block length along K, whether the scales are 1-D (per row), and whether
    every scale is a power of two (or NaN) by construction (E8M0; `force_pow_2_scales`): known without a host read."""
    values: torch.Tensor
    scales: torch.Tensor
    block: int
    one_d: bool
    pow2: bool = False


_NO_COLUMNWISE = (" (the transpose a dgrad GEMM reads; a weight made by quantized_model_init under torch.no_grad() "
                  "holds only the rowwise layout, for inference, as in Transformer Engine: create the model with "
                  "grad enabled to train it)")


def block_operand(t, transpose: bool = False) -> BlockOperand:
    """The operand view of a block-scaled storage: the tensor flattened to (M, K) from its rowwise layout, or its
    transpose (K, M) from its columnwise layout (`transpose=True`)."""
    if isinstance(t, MXFP8TensorStorage):
        data = t._columnwise_data if transpose else t._rowwise_data
        if data is None:
            raise ValueError(f"block_gemm: the MXFP8 operand has no {'columnwise' if transpose else 'rowwise'} data"
                             + (_NO_COLUMNWISE if transpose else ""))
        m = data.numel() // data.shape[-1]
        values = data.reshape(m, data.shape[-1]).view(t.fp8_dtype).float()
        scales = bc.e8m0_decode(t.block_scales(transpose))
        if transpose:
            values, scales = values.t(), scales.t()
        return BlockOperand(values, scales, bc.MXFP8_BLOCK, True, True)
    if isinstance(t, Float8BlockwiseQTensorStorage):
        if transpose and t._columnwise_data is None and t._is_2D_scaled and t._rowwise_data is not None:
            t.update_usage(columnwise_usage=True)  # 128x128 blocks: made from the rowwise layout, as in TE
        data = t._columnwise_data if transpose else t._rowwise_data
        if data is None:
            raise ValueError(f"block_gemm: the Float8 block operand has no {'columnwise' if transpose else 'rowwise'}"
                             f" data" + (_NO_COLUMNWISE if transpose else ""))
        # columnwise data is (K, *M), rowwise (*M, K); either may be empty (zero tokens)
        rows, cols = (data.shape[0], math.prod(data.shape[1:])) if transpose \
            else (math.prod(data.shape[:-1]), data.shape[-1])
        values = data.reshape(rows, cols).view(t.fp8_dtype).float()
        pow2 = bool(getattr(t._quantizer, "force_pow_2_scales", False))
        return BlockOperand(values, t.block_scale_inv(transpose).float(), bc.FLOAT8_BLOCK, not t._is_2D_scaled, pow2)
    raise TypeError(f"block_gemm: expected an MXFP8 or Float8 block-scaled tensor, got {type(t).__name__}")


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 `a * b + c` rounded once, as a fused multiply-add: the product is exact in float64, the sum is
    rounded to odd in float64 (TwoSum error decides), and the float32 conversion rounds once more, correctly."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    bits = s.view(torch.int64)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    return torch.where(fix, bits + step, bits).view(torch.float64).float()


def _check_pair(a: BlockOperand, b: BlockOperand) -> None:
    if a.block != b.block:
        raise TypeError(f"block_gemm: operands of different block formats (blocks of {a.block} and {b.block} along K)")
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"block_gemm: contraction dims differ: A is {tuple(a.values.shape)}, B is "
                         f"{tuple(b.values.shape)} (A @ B^T)")


def _partials(a: BlockOperand, b: BlockOperand, first: int, last: int) -> torch.Tensor:
    """float32 partial products of K blocks [first, last): (blocks, M, N), summed in float64."""
    bl, k = a.block, a.values.shape[1]
    lo, hi = first * bl, min(last * bl, k)
    width = (last - first) * bl
    av, bv = a.values[:, lo:hi], b.values[:, lo:hi]
    if hi - lo != width:  # a shorter last block: zeros add nothing
        av = torch.nn.functional.pad(av, (0, width - (hi - lo)))
        bv = torch.nn.functional.pad(bv, (0, width - (hi - lo)))
    ab = av.reshape(av.shape[0], last - first, bl).transpose(0, 1).double()
    bb = bv.reshape(bv.shape[0], last - first, bl).permute(1, 2, 0).double()
    return torch.bmm(ab, bb).float()


# How a scaled partial sum `t` meets `y` (step 2 of the module docstring), each giving the fused multiply-add's number:
F32 = "f32"  # `y + t * s2` in float32: exact when `_fast_is_exact` holds (decided on the host: CPU only)
F64 = "f64"  # `float32(y + t * s2)` computed in float64 in one kernel: exact when s2 is a power of two
FMA = "fma"  # `fma32`: exact for any s2 (about 20 kernels a step)


def _pow2_second(A: BlockOperand, B: BlockOperand) -> bool:
    """Whether the scale `s2` of step 2 is a power of two (or 0, inf, NaN) by construction: the second operand's
    scale, or with two 2-D operands the float32 product of both (a product of powers of two rounds to one)."""
    if not A.one_d and not B.one_d:
        return A.pow2 and B.pow2
    return A.pow2 if (not A.one_d) and B.one_d else B.pow2


def accumulate_mode(A: BlockOperand, B: BlockOperand, host_read: bool) -> str:
    """The cheapest exact way of step 2: F32 where a host read (`host_read`, CPU eager only) shows it exact, else F64
    where s2 is a power of two by construction, else FMA. All three give the same numbers."""
    if host_read and _fast_is_exact(A, B):
        return F32
    return F64 if _pow2_second(A, B) else FMA


def _accumulate(A: BlockOperand, B: BlockOperand, mode: str) -> torch.Tensor:
    """The accumulation of the module docstring, step 2 as `mode` says (F32, F64 or FMA: the same numbers)."""
    m, n, k = A.values.shape[0], B.values.shape[0], A.values.shape[1]
    nb = bc.ceil_div(k, A.block)
    y = torch.zeros(m, n, dtype=torch.float32, device=A.values.device)
    per_chunk = max(1, _CHUNK_ELEMENTS // max(m * n, 1))
    b_first = (not A.one_d) and B.one_d  # 2-D A with 1-D B: B's scale first
    for first in range(0, nb, per_chunk):
        last = min(nb, first + per_chunk)
        partial = _partials(A, B, first, last)
        for j in range(first, last):
            p = partial[j - first]
            sa, sb = A.scales[:, j, None], B.scales[None, :, j]
            if not A.one_d and not B.one_d:
                t, s2 = p, sa * sb
            elif b_first:
                t, s2 = p * sb, sa
            else:
                t, s2 = p * sa, sb
            if mode == F32:
                y = y + t * s2
            elif mode == F64:  # float64 math (the common dtype), stored to float32: one rounding
                y = torch.addcmul(y, t, s2.double(), out=torch.empty_like(y))
            else:
                y = fma32(t, s2.expand_as(t), y)
    return y


def _fast_is_exact(A: BlockOperand, B: BlockOperand) -> bool:
    """Whether `y + (P * s1) * s2` in float32 is the fused multiply-add for every block: all scales are normal
    powers of two (then `* s2` is exact while the product stays normal) and the products stay within float32's
    normal range: a non-zero partial sum of FP8 products is at least 2^-32 in magnitude (E5M2's smallest subnormal
    squared) and at most 128 * 57344^2 < 2^39. Read on the host (CPU only)."""
    scales = torch.cat([A.scales.reshape(-1), B.scales.reshape(-1)])
    if A.scales.numel() == 0 or B.scales.numel() == 0:  # no products (an empty operand)
        return True
    pow2 = (scales.view(torch.int32) & 0x807FFFFF) == 0
    lo = A.scales.amin(0) * B.scales.amin(0)
    hi = A.scales.amax(0) * B.scales.amax(0)
    return bool(pow2.all() & (lo >= 2.0 ** -90).all() & (hi < 2.0 ** 85).all())


def block_gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
               out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`A @ B^T` (M, N) for block-scaled `a` and `b` (MXFP8 or Float8 block storages/tensors of one family); A is
    `a` flattened to 2-D (its rowwise layout), or its transpose (columnwise layout) with `transpose_a`; B likewise.
    Accumulates in float32 as the module docstring says. `bias` (N,) is added in float32; with `accumulate` the
    result is added to `out` (in out's dtype) and written into it."""
    A, B = block_operand(a, transpose_a), block_operand(b, transpose_b)
    _check_pair(A, B)
    # On the CPU a host read is free: power-of-two scales in range take plain float32 adds, the same numbers.
    # Elsewhere, no host synchronisation: float64 math stored to float32 (power-of-two scales), else the emulated FMA.
    # With the Triton kernels on for the device (CUDA by default): one kernel, each output tile kept in registers
    # across the K blocks, the same numbers (a hardware fused multiply-add).
    if use_kernel(A.values):
        y = block_gemm_tiles(A.values, B.values, A.scales, B.scales, A.block, _kernel_mode(A, B))
        if y is not None:
            return gemm_epilogue(y, out_dtype, bias, out, accumulate, "block_gemm")
    host_read = A.values.device.type == "cpu" and not torch.compiler.is_compiling()
    mode = accumulate_mode(A, B, host_read)
    return gemm_epilogue(_accumulate(A, B, mode), out_dtype, bias, out, accumulate, "block_gemm")


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the block GEMMs of operands on x's device run as the Triton kernel: where the kernels run
    (`kernels.on_for`: CUDA by default, not while torch.compile traces), by default on the GPUs where the kernel was
    measured bit-equal and fast (sm_90, its float64 MMA: `dot64_for`), elsewhere when the kernels were turned on
    explicitly (`kernels.opted_in`: FP8KIT_TRITON=1 or set_enabled(True); docs/kernels.md)."""
    if not kernels.on_for(x.device):
        return False
    return kernels.opted_in() or (x.device.type == "cuda" and dot64_for(x.device))


def _kernel_mode(A: BlockOperand, B: BlockOperand) -> int:
    if not A.one_d and not B.one_d:
        return BOTH_2D
    return B_FIRST if (not A.one_d) and B.one_d else A_FIRST


def gemm_epilogue(y: torch.Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor], out: Optional[torch.Tensor],
                  accumulate: bool, where: str) -> torch.Tensor:
    """The float32 result `y` plus the bias in float32, converted to `out_dtype`; with `accumulate`, `out +
    result.to(out.dtype)` written into `out`; else written into `out` when given."""
    if bias is not None:
        y = y + bias.float()
    result = y.to(out_dtype)
    if accumulate:
        if out is None:
            raise ValueError(f"{where}: accumulate=True needs out")
        return out.copy_(out + result.to(out.dtype))
    if out is not None:
        return out.copy_(result)
    return result
