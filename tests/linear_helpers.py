"""Shared helpers for the Linear tests: float64 math on reference-quantized operands, SQNR."""

import numpy as np
import torch

import reference as ref


def np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def deq(x: np.ndarray, fmt: str, scale) -> np.ndarray:
    """Reference-quantize x with `scale` and dequantize in float64."""
    q, inv = ref.cast(x, fmt, scale)
    return ref.dequantize(q, fmt, inv).astype(np.float64)


def sqnr_db(signal: np.ndarray, approx: np.ndarray) -> float:
    signal, approx = np.asarray(signal, np.float64), np.asarray(approx, np.float64)
    return float(10 * np.log10(np.sum(signal**2) / np.sum((signal - approx) ** 2)))


def assert_gemm_close(got: torch.Tensor, want64: np.ndarray, a64: np.ndarray, b64: np.ndarray, dtype_eps: float):
    """`got` equals float64 `want64 = a64 @ b64` up to float32 accumulation and output rounding.

    The bound per element: K * 2^-24 * (|a| @ |b|) for the float32 sums, plus one rounding of the output dtype.
    """
    got64 = got.detach().double().cpu().numpy()
    k = a64.shape[1]
    bound = k * 2.0**-24 * (np.abs(a64) @ np.abs(b64)) + dtype_eps * np.abs(want64) + 1e-30
    excess = np.abs(got64 - want64) - bound
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"
