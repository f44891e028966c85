"""The one place that multiplies FP8 tensors.

`gemm(a, b)` computes `a @ b` for Float8Tensors `a` `[M, K]` and `b` `[K, N]` (any strides), accumulating in
float32 and scaling by `a.scale_inv * b.scale_inv`. On CUDA it calls `torch._scaled_mm` (row-major `a`,
column-major `b`); elsewhere it emulates the same arithmetic: FP8 values are exact in float32, the products and
sums are float32, the result is scaled once.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import host
from .tensor import Float8Tensor


def check_cuda_shape(leading: int, in_features: int, out_features: int) -> None:
    """FP8 GEMMs on CUDA need the product of the leading dims % 8 == 0 and both feature dims % 16 == 0."""
    problems = []
    if leading % 8:
        problems.append(f"the product of the leading dimensions ({leading}) is not a multiple of 8")
    if in_features % 16:
        problems.append(f"in_features ({in_features}) is not a multiple of 16")
    if out_features % 16:
        problems.append(f"out_features ({out_features}) is not a multiple of 16")
    if problems:
        raise ValueError(
            "FP8 GEMM on CUDA cannot take this shape: " + "; ".join(problems)
            + ". Pad the input, or run this layer outside fp8kit.pytorch.autocast."
        )


def gemm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`(a @ b) * a.scale_inv * b.scale_inv (+ bias)` in `out_dtype`; a `[M, K]`, b `[K, N]`."""
    if a.data.is_cuda and not (a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2):
        return _scaled_mm(a, b, out_dtype, bias, use_fast_accum)
    return _emulated(a, b, out_dtype, bias)


def _emulated(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor]):
    if a.scale_inv_value is not None and b.scale_inv_value is not None:  # CPU fast path: no tensor op for alpha
        alpha = host.f32(a.scale_inv_value * b.scale_inv_value)  # the float32 product (exact in float64, rounded)
        scale = None
    else:
        scale = a.scale_inv * b.scale_inv  # float32, as the GPU's alpha
        alpha = float(scale)
    m, k = a.shape
    if out_dtype == torch.bfloat16 and alpha != float("inf") and m * k * b.shape[1] >= _BF16_GEMM_MIN_MACS:
        # FP8 values are exact in bf16; addmm applies alpha to the float32 accumulator and rounds once to bf16,
        # which is what the float32 path below gives, at the speed of a bf16 GEMM.
        base = bias if bias is not None else _ZERO_BF16
        return torch.addmm(base, a.values(torch.bfloat16), b.values(torch.bfloat16),
                           beta=1 if bias is not None else 0, alpha=alpha)
    if scale is None:  # alpha is a float: one addmm
        base = bias.float() if bias is not None else _ZERO_F32
        out = torch.addmm(base, a.values(torch.float32), b.values(torch.float32),
                          beta=1 if bias is not None else 0, alpha=alpha)
    else:
        out = torch.mm(a.values(torch.float32), b.values(torch.float32))
        out.mul_(scale)
        if bias is not None:
            out.add_(bias.float())
    return out.to(out_dtype)


# Below this many multiply-adds a float32 GEMM beats a bf16 one on CPUs (its fixed cost is lower).
_BF16_GEMM_MIN_MACS = 1 << 24
_ZERO_BF16 = torch.zeros((), dtype=torch.bfloat16)
_ZERO_F32 = torch.zeros((), dtype=torch.float32)


def _pad_inner(a: torch.Tensor, b: torch.Tensor):
    """Zero-pad the shared dimension to a multiple of 16 (zeros add nothing to the products)."""
    k = a.shape[1]
    pad = (-k) % 16
    if pad == 0:
        return a, b
    a = torch.nn.functional.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
    b = torch.nn.functional.pad(b.view(torch.uint8).t(), (0, pad)).view(b.dtype).t()
    return a, b


def _scaled_mm(a: Float8Tensor, b: Float8Tensor, out_dtype, bias, use_fast_accum):
    mat_a = a.data.contiguous()
    mat_b = b.data.t().contiguous().t()  # column-major, as cuBLASLt FP8 wants
    mat_a, mat_b = _pad_inner(mat_a, mat_b)
    mm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32
    use_bias = bias is not None and bias.dtype == mm_dtype and mm_dtype != torch.float32
    out = torch._scaled_mm(
        mat_a,
        mat_b,
        scale_a=a.scale_inv.reshape(()).float(),
        scale_b=b.scale_inv.reshape(()).float(),
        bias=bias if use_bias else None,
        out_dtype=mm_dtype,
        use_fast_accum=use_fast_accum,
    )
    if bias is not None and not use_bias:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)
