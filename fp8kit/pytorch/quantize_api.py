"""`fp8kit.pytorch.quantize`: the public one-call cast, validated, returning a Float8Tensor.

It sits above both the cast (cast.py, the bottom: bytes and scales as Float8TensorStorage) and the tensor type
(tensor/float8_tensor.py), which builds on the cast.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ..recipe import FLT_MAX
from . import host
from .cast import FP8_MAX, cast, cast_host, current_scale, fp8_max_of
from .tensor.float8_tensor import wrap
from .tensor.storage import FP8_DTYPES


def _check_input(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"quantize: input must be a float32/bfloat16/float16 tensor, got dtype {x.dtype}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"quantize: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")


def _checked_scale(scale: Union[torch.Tensor, float], device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not (scale.is_floating_point()):
            raise TypeError(
                f"quantize: scale must be a float or a floating tensor with one element, got dtype {scale.dtype} "
                f"and shape {tuple(scale.shape)}"
            )
        s = scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        s = torch.tensor(float(scale), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"quantize: scale must be a float or a tensor, got {type(scale).__name__}")
    value = float(s)
    if not (0 < value <= FLT_MAX and host.reciprocal(value) <= FLT_MAX):
        raise ValueError(f"quantize: scale must be finite and > 0 as float32, with a finite reciprocal, got {value!r} "
                         f"(from {scale!r})")
    return s


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: Optional[Union[torch.Tensor, float]] = None,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
):
    """Quantize `x` (float32, bfloat16 or float16, any shape, CPU or CUDA) to FP8; returns a
    `fp8kit.pytorch.Float8Tensor` (nominal dtype x's, `_data` the FP8 bytes, `_scale_inv` float32 `[1]`).

    With `scale` (a float or a one-element floating tensor, finite and > 0 in float32, with a finite reciprocal) cast
    as SPEC section 1. Without it, apply current scaling (SPEC section 3):
    `scale = fp8_max / max(amax(x), amax_epsilon)`, 1 when that amax is 0, inf or NaN, optionally rounded down to a
    power of two.
    """
    _check_input(x, fp8_dtype)
    x = x.detach()
    fast = host.active(x.device)
    if scale is None:
        eps = float(amax_epsilon)
        if not (eps >= 0 and eps != float("inf")):
            raise ValueError(f"quantize: amax_epsilon must be finite and >= 0, got {amax_epsilon!r}")
        if fast:
            a = host.amax(x)
            return wrap(cast_host(x, host.current_scale(a, FP8_MAX[fp8_dtype], eps, bool(power_2_scale)),
                                  fp8_dtype, a, values=False))  # no GEMM follows: the bytes only
        s = current_scale(x, fp8_max_of(fp8_dtype), eps, bool(power_2_scale))
    else:
        s = _checked_scale(scale, x.device)
        if fast:
            return wrap(cast_host(x, float(s), fp8_dtype, math.inf, values=False))  # amax unknown: always clamp
    return wrap(cast(x, s, fp8_dtype))
