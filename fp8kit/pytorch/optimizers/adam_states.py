"""FusedAdam's states: where a master weight starts, the step tensors of a fused call, and how a state is stored in
a narrower dtype (Transformer Engine's `exp_avg_dtype`, `exp_avg_sq_dtype`, `master_weight_dtype`,
`store_param_remainders`) and read back as float32. The step itself always runs on float32 values; each stored state
is rounded once after it.

  float32   the tensor itself
  bfloat16  rounded to bf16, no scale
  float16   `value / scale` rounded to fp16, with a float32 scale per tensor `absmax / (fp16 max / 2)` (0 for an
            all-zero tensor); the value is `fp16 * scale`
  uint8     an E4M3 Float8Tensor (Transformer Engine's FP8 storage of the moments) cast with the scale
            `1 / (absmax / 448)` (1 for an all-zero tensor); the value is its dequantization
  remainders  (bf16 parameters with float32 master weights) the float32 master is the bf16 parameter's 16 bits
            (rounded to nearest, ties away from zero) and an int16 tensor of the low 16 bits, from which the master
            is rebuilt exactly
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..quantized_tensor import QuantizedTensor
from ..tensor.float8_tensor import Float8Quantizer

__all__ = ["MOMENT_DTYPES", "new_state", "unscaled", "store", "join_master", "split_master", "initial_master",
           "step_tensors"]

MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}


def new_state(dtype: torch.dtype, shape, device, value: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(stored state, its float32 scale or None) holding the float32 `value`."""
    if dtype == torch.uint8:
        quantizer = Float8Quantizer(torch.ones(1, device=device), torch.zeros(1, device=device),
                                    torch.float8_e4m3fn, columnwise=False)
        stored = quantizer.make_empty(shape, device=device)
    else:
        stored = torch.empty(shape, dtype=dtype, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device) if dtype in _RANGE else None
    store(stored, scale, value)
    return stored, scale


def unscaled(stored: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The float32 values of a stored state (the state itself when it is float32)."""
    if isinstance(stored, QuantizedTensor):  # uint8: a Float8Tensor
        return stored.dequantize_impl(torch.float32)
    if stored.dtype == torch.float32 and scale is None:
        return stored
    values = stored.float()
    return values.mul_(scale) if scale is not None else values


@torch.no_grad()
def store(stored: torch.Tensor, scale: Optional[torch.Tensor], value: torch.Tensor) -> None:
    """Write the float32 `value` into the stored state (and its scale), rounding once; `value` is left unchanged."""
    if stored is value:
        return
    if scale is None:
        stored.copy_(value)
        return
    fp8 = isinstance(stored, QuantizedTensor)
    absmax = value.abs().max() if value.numel() else torch.zeros((), device=value.device)
    torch.div(absmax.reshape(1).float(), _RANGE[torch.uint8 if fp8 else torch.float16], out=scale)
    inverse = torch.where(scale > 0, scale.reciprocal(), 1.0 if fp8 else 0.0)
    if fp8:
        stored._quantizer.scale.copy_(inverse)
        stored.quantize_(value)
    else:
        stored.copy_(value * inverse)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master rebuilt from a bf16 parameter and its int16 remainders (the parameter's bits were rounded
    up when the remainder's top bit is set)."""
    high = param.view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    bits = (high << 16) | (remainder.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def split_master(master: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bf16 parameter bits as int16, int16 remainders) of a float32 master: the high half rounded to nearest (ties
    away from zero), the low half kept."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps: 0x8000.. are negative, as the rounding rule reads them
    high = (bits >> 16).to(torch.int16) + (low < 0).to(torch.int16)
    return high, low


def initial_master(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The float32 master a parameter starts from: `get_high_precision_init_val()` when the parameter (or its local
    tensor) has one, else its (dequantized) value."""
    for holder in (local, param):
        getter = getattr(holder, "get_high_precision_init_val", None)
        value = getter() if callable(getter) else None
        if value is not None:
            if tuple(value.shape) != tuple(local.shape):
                raise ValueError(f"FusedAdam: get_high_precision_init_val() of a parameter of local shape "
                                 f"{tuple(local.shape)} has shape {tuple(value.shape)}")
            return value.detach().to(device=local.device, dtype=torch.float32, copy=True)
    if isinstance(local, QuantizedTensor):
        return local.dequantize_impl(torch.float32).clone()
    return local.detach().to(torch.float32, copy=True)


def step_tensors(group: dict, device: torch.device, count: int):
    """The step tensors of a fused Adam call for a parameter group: torch's fused kernels always divide by
    1 - beta**step, so bias_correction=False passes step = inf (both corrections exactly 1)."""
    step = group["step"]
    if not group["bias_correction"]:
        value = torch.full((), math.inf, dtype=torch.float32, device=device)
    elif isinstance(step, torch.Tensor):
        value = step.to(device=device, dtype=torch.float32).reshape(())
    else:
        value = torch.full((), float(step), dtype=torch.float32, device=device)
    return [value] * count
