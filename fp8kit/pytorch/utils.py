"""The public helpers of Transformer Engine's `transformer_engine.pytorch.utils` that user code and tests import:
weight initialisers, the attention-mask fill, the GEMM layout query and the autocast context of the compute
device."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

__all__ = ["init_method_normal", "scaled_init_method_normal", "attention_mask_func", "is_non_tn_fp8_gemm_supported",
           "gpu_autocast_ctx", "autocast_device_type"]


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initialiser that fills a tensor in place from N(0, sigma^2)."""
    _check_positive("sigma", sigma)
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=float(sigma))


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initialiser from N(0, (sigma / sqrt(2 * num_layers))^2): the output-projection init of GPT-style models."""
    _check_positive("sigma", sigma)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill the masked positions (`attention_mask` True) of `attention_scores` with -10000 in place; returns it."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool tensor, got {attention_mask.dtype}")
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs take operands in any layout, so that no transposed FP8 copy is needed (TE: True on Blackwell).
    True where fp8kit computes on the CPU (the emulated GEMM reads either layout of `_data`, and CPU Float8Tensors
    carry no `_transpose`); False on CUDA, where fp8kit keeps Hopper's TN layout (a Float8Tensor used for wgrad/dgrad
    carries a transposed copy)."""
    return autocast_device_type() == "cpu"


def autocast_device_type() -> str:
    """The device type whose torch.autocast fp8kit's modules compute under: "cuda" when torch sees a GPU, else
    "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_autocast_ctx(*args, **kwargs) -> torch.autocast:
    """`torch.autocast` for the compute device (Transformer Engine: `torch.amp.autocast(device_type="cuda")`). On a
    CPU-only machine this is the CPU autocast, whose default dtype is bfloat16 (CUDA's is float16)."""
    if "device_type" in kwargs:
        raise TypeError("gpu_autocast_ctx: device_type is fixed (the compute device); use torch.autocast to pick one")
    return torch.amp.autocast(autocast_device_type(), *args, **kwargs)
