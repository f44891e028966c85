"""NVFP4 x NVFP4 GEMM, emulated with torch operations on any device (no host synchronisation), in the order of
Transformer Engine's reference (pytorch/custom_recipes/reference_nvfp4.py, `qgemm`):

`nvfp4_gemm(a, b)` computes `A @ B^T` for A (M, K) and B (N, K), each an NVFP4 layout (E2M1 values, E4M3 scale per
16 along K, float32 amax):
1. per 16-wide K block j: `P_j = A[:, j] @ B[:, j]^T` from the E2M1 values. Every product of two E2M1 values is a
   multiple of 1/4 below 36, so a sum of 16 is exact in float32, in any order.
2. `y = y + (sa_j * sb_j) * P_j` in float32, j increasing (sa_j, sb_j the decoded E4M3 scales of A's rows and
   B's rows; their product and its product with P_j are exact in float32, so only the additions round).
   Computed as `y = y + Q_j`, with `Q_j` the block's product of the operands scaled first (`a * sa`, `b * sb`: E2M1
   times E4M3 is exact): every partial sum of Q_j is `sa_j * sb_j` times a multiple of 1/4 below 576, at most 20
   significant bits from 2^-20 up, so Q_j is `(sa_j * sb_j) * P_j` exactly, in any order and on TF32 tensor cores
   too. One pass over the (M, N) output per block: the sequential rounding allows no fewer.
3. `y = alpha * y` with `alpha = float32(amax_a * amax_b) / (6 * 6 * 448 * 448)` (each operand's amax of the layout
   used), then the bias in float32, then the output dtype; with `accumulate`, `out + y.to(out.dtype)`.
Dims: K a multiple of 32 and N of 8, as TE's NVFP4 GEMM requires (refused otherwise).

With a row-scaled operand (TE's `general_gemm` for `row_scaled_nvfp4` tensors, cpp_extensions/gemm.py): step 3 runs
with both amaxes taken as 1 (`alpha = 1 / (6 * 6 * 448 * 448)`), giving float32 `y`; then, in float32, with `r` the
amaxes of A's rows (M,) or A's one amax and `c` those of B's rows (N,) or B's one: `y * (r * c)` when one of them
is a single value (their product first), else `(y * r) * c`; then the bias in float32 and the output dtype (with
`accumulate`, `out + y.to(out.dtype)`), as in step 3.
"""

from __future__ import annotations

from typing import Optional

import torch

from .block_gemm import gemm_epilogue, use_kernel
from .kernels.block_gemm_ops import PRESCALED, block_gemm_tiles
from .nvfp4_cast import NVFP4_BLOCK
from .tensor.block_storage import TransposedBlockOperand
from .tensor.nvfp4_tensor import NVFP4TensorStorage

__all__ = ["nvfp4_gemm", "nvfp4_gemm_rule"]

_CHUNK_ELEMENTS = 1 << 24  # partial products per batch of K blocks: at most 64 MiB of float32
_ALPHA_DIVISOR = 6.0 * 6.0 * 448.0 * 448.0


def _operand(t, columnwise: bool):
    if not isinstance(t, NVFP4TensorStorage):
        raise TypeError(f"nvfp4_gemm: expected an NVFP4 tensor, got {type(t).__name__}")
    return t.layout(columnwise)


def nvfp4_gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
               out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`A @ B^T` (M, N): A is `a`'s rowwise layout (its columnwise one with `transpose_a`), B likewise for `b`. The
    accumulation of the module docstring."""
    va, sa, amax_a = _operand(a, transpose_a)
    vb, sb, amax_b = _operand(b, transpose_b)
    row_scaled = a._row_scaled_nvfp4 or b._row_scaled_nvfp4
    m, k = va.shape
    n = vb.shape[0]
    if vb.shape[1] != k:
        raise ValueError(f"nvfp4_gemm: contraction dims differ: A is {tuple(va.shape)}, B is {tuple(vb.shape)}")
    if k % 32 or n % 8:
        raise ValueError(f"nvfp4_gemm: NVFP4 GEMMs need K divisible by 32 and N by 8 (as Transformer Engine's), "
                         f"got M={m}, N={n}, K={k}")
    nb = k // NVFP4_BLOCK
    ab = va.reshape(m, nb, NVFP4_BLOCK) * sa[:, :nb, None]  # exact: E2M1 times E4M3 (6 significant bits at most)
    bb = vb.reshape(n, nb, NVFP4_BLOCK) * sb[:, :nb, None]
    y = None
    if use_kernel(va):  # one kernel, the output tile in registers across the blocks (TF32 dots: exact here)
        y = block_gemm_tiles(ab.reshape(m, k), bb.reshape(n, k), None, None, NVFP4_BLOCK, PRESCALED)
    if y is None:
        y = _accumulate(ab.transpose(0, 1), bb.permute(1, 2, 0), m, n)
    if not row_scaled:
        alpha = (amax_a * amax_b) / _ALPHA_DIVISOR
        return gemm_epilogue(alpha * y, out_dtype, bias, out, accumulate, "nvfp4_gemm")
    y = y * torch.reciprocal(torch.full((), _ALPHA_DIVISOR, dtype=torch.float32, device=y.device))
    rows, cols = amax_a.reshape(-1, 1), amax_b.reshape(1, -1)
    if rows.numel() not in (1, m) or cols.numel() not in (1, n):
        raise ValueError(f"nvfp4_gemm: row-scaled amaxes {rows.numel()} and {cols.numel()} do not fit a ({m}, {n}) "
                         "output")
    y = y * (rows * cols) if rows.numel() == 1 or cols.numel() == 1 else (y * rows) * cols
    return gemm_epilogue(y, out_dtype, bias, out, accumulate, "nvfp4_gemm")


def _accumulate(ab: torch.Tensor, bb: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Step 2 on blocks (nb, M, 16) and (nb, 16, N) of pre-scaled operands: `y = y + Q_j`, j increasing."""
    nb = ab.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32, device=ab.device)
    per_chunk = max(1, _CHUNK_ELEMENTS // max(m * n, 1))
    for first in range(0, nb, per_chunk):
        last = min(nb, first + per_chunk)
        partial = torch.bmm(ab[first:last], bb[first:last])  # (sa * sb) * P of each block, exact in float32
        for j in range(last - first):
            y.add_(partial[j])
    return y


def _unwrap(t):
    if isinstance(t, TransposedBlockOperand):
        return t.storage, True
    return t, False


def nvfp4_gemm_rule(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                    use_fast_accum: bool = False) -> torch.Tensor:
    """The GEMM rule of NVFP4 operands: `a @ b` for a (M, K) and b (K, N), each an NVFP4 tensor flattened to 2-D or
    its `.transposed()` view (A's rows from `a`'s rowwise layout, B's columns from `b`'s columnwise layout, the
    other layout for a transposed view). `use_fast_accum` changes nothing (float32 accumulation)."""
    a_storage, a_t = _unwrap(a)
    b_storage, b_t = _unwrap(b)
    return nvfp4_gemm(a_storage, b_storage, transpose_a=a_t, transpose_b=not b_t, out_dtype=out_dtype, bias=bias)
