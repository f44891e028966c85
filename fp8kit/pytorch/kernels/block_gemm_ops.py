"""Host side of the block-scaled GEMM kernel (`triton_block_gemm.block_gemm_kernel`): checks, allocation, launch.

`block_gemm_tiles` gives the float32 `y` of step 2 of `fp8kit.pytorch.block_gemm` (MXFP8, Float8 block) and of
`fp8kit.pytorch.nvfp4_gemm` (pre-scaled NVFP4 operands), the same numbers as their torch paths: each output tile
stays in registers across the K blocks, so the per-block rounding costs no pass over memory.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Optional

import torch

from .launch import cdiv, cuda_capability, launch

__all__ = ["A_FIRST", "B_FIRST", "BOTH_2D", "PRESCALED", "block_gemm_tiles", "describe_error", "kernel_failure"]

A_FIRST, B_FIRST, BOTH_2D, PRESCALED = 0, 1, 2, 3  # how the scales meet a block's partial sum (the kernel's MODE)
_failure: list = []  # the first error Triton raised compiling or launching the kernel (then the torch path runs)


def kernel_failure() -> Optional[str]:
    """The error Triton raised for the kernel in this process (after which the callers take the torch path, the
    same numbers), or None."""
    return _failure[0] if _failure else None


def describe_error(e: BaseException) -> str:
    """One line that ends with the error itself: `Type: ` and the last line of the message (a CompilationError's
    message is the source excerpt, ending with `^` under the failing call: then its first line, `at L:C:`, and the
    line it points at), then each cause the same way; a cause without a message names where it was raised and the
    source line there (a bare `assert` in Triton's front end)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) >= 3 and lines[-1] == "^":  # the excerpt: "at 24:20:", ..., the failing line, "^"
        text = f"{type(e).__name__} {lines[0]} {lines[-2]}"
    elif lines:
        text = f"{type(e).__name__}: {lines[-1]}"
    else:
        frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
        where = frames[-1].filename.replace(os.sep, "/").rpartition("/site-packages/")[2] if frames else ""
        text = type(e).__name__ + (f" at {where}:{frames[-1].lineno}: {frames[-1].line}" if frames else "")
    cause = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    if cause is None or (str(cause).strip() and str(cause).strip().splitlines()[-1].strip() in text):
        return text  # no cause, or its message already ends this one
    return f"{text}; caused by {describe_error(cause)}"


_TILES = {True: (64, 64, 4, 2), False: (128, 128, 8, 3)}  # F64 or not: (BM, BN, warps, stages) on a GPU
_INTERPRETER_TILES = (128, 128, 1, 1)  # CPU (the interpreter): fewer, larger programs (its cost is per operation)


def dot64_for(device: torch.device) -> bool:
    """The kernel's DOT64: a block's float64 sum on the float64 MMA (`tl.dot`) where measured fastest and compiled by
    Triton 3.6 and 3.9 (sm_90: 3.0-3.5 ms for MXFP8 and Float8 block at 4096^3 on an H200, against 76-890 ms for the
    rank-1 updates) and in the interpreter; the float64 rank-1 updates elsewhere (sm_100: Triton 3.6 cannot lower a
    float64 dot there; sm_89). Both give the same bits (the sums are exact)."""
    if device.type == "cpu":
        return True  # the interpreter: NumPy's dot is fast where its rank-1 loop is not (tests force both)
    return device.type == "cuda" and dot64_for_capability(cuda_capability(device))


def dot64_for_capability(capability: tuple) -> bool:
    """DOT64 on a CUDA device of this compute capability (major, minor): sm_90 only."""
    return capability[0] == 9



def block_gemm_tiles(a: torch.Tensor, b: torch.Tensor, sa, sb, block: int, mode: int) -> Optional[torch.Tensor]:
    """float32 `y` (M, N) of `A @ B^T` for A `a` (M, K) and B `b` (N, K), K in blocks of `block`, in increasing
    order. MODE A_FIRST / B_FIRST / BOTH_2D: `a`, `b` FP8 values as float32, `sa` (M, ceil(K / block)) and `sb`
    (N, ...) float32 block scales, `fma(P * s1, s2, y)` as the modes say. PRESCALED: `a`, `b` float32 values
    already times their block scales (NVFP4: exact in TF32), `sa`, `sb` None, `y = y + dot`. Any strides.
    None when Triton cannot compile or launch the kernel here (a Triton error, warned once: the caller then takes its
    torch path, which gives the same numbers); other errors propagate."""
    where = "kernels.block_gemm_tiles"
    f64 = mode != PRESCALED
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.device != b.device \
            or a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"{where}: expected A (M, K) and B (N, K) float32 on one device, got {tuple(a.shape)} "
                         f"{a.dtype} on {a.device} and {tuple(b.shape)} {b.dtype} on {b.device}")
    (m, k), n = a.shape, b.shape[0]
    nb = cdiv(k, block)
    if f64:
        if sa.shape[0] != m or sb.shape[0] != n or sa.shape[1] < nb or sb.shape[1] < nb \
                or sa.dtype != torch.float32 or sb.dtype != torch.float32:
            raise ValueError(f"{where}: scales {tuple(sa.shape)} {sa.dtype} and {tuple(sb.shape)} {sb.dtype} do not "
                             f"fit A {tuple(a.shape)} and B {tuple(b.shape)} in blocks of {block}")
    else:
        sa = sb = a  # not read
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    if _failure:
        return None
    bm, bn, warps, stages = _INTERPRETER_TILES if a.device.type == "cpu" else _TILES[f64]
    try:
        _launch(a, b, sa, sb, y, m, n, k, nb, block, mode, f64 and dot64_for(a.device), bm, bn, warps, stages)
    except Exception as e:  # noqa: BLE001 - only Triton's own errors (compiler, resources) are caught
        if type(e).__module__.split(".")[0] != "triton":
            raise
        _failure.append(describe_error(e))
        warnings.warn(f"fp8kit: the Triton block GEMM kernel failed ({_failure[0]}); block-scaled GEMMs take the "
                      "torch path from now on (the same numbers, slower)", RuntimeWarning, stacklevel=3)
        return None
    return y


def _launch(a, b, sa, sb, y, m, n, k, nb, block, mode, dot64, bm, bn, warps, stages) -> None:
    f64 = mode != PRESCALED
    launch("block_gemm_kernel", (cdiv(m, bm), cdiv(n, bn)), a.device,
           (a, b, sa, sb, y, m, n, k, nb, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            sa.stride(0) if f64 else 0, sa.stride(1) if f64 else 0, sb.stride(0) if f64 else 0,
            sb.stride(1) if f64 else 0),
           dict(BLOCK=block, KC=min(block, 32), BM=bm, BN=bn, MODE=mode, F64=f64, DOT64=dot64, num_warps=warps,
                num_stages=stages), reads=(a, b), writes=(y,),
           file="triton_block_gemm")
