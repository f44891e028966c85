"""Transformer Engine's availability queries (`te.is_fp8_available(return_reason=False)` and its siblings,
`te.get_default_recipe()`, `te.get_device_compute_capability()`), answered for fp8kit.

As in Transformer Engine, each query returns a bool, or `(bool, reason)` with `return_reason=True`, the reason being
"" when the answer is yes. Transformer Engine asks about the current CUDA device; fp8kit also runs on CPUs, so the
device asked about is the current CUDA device when CUDA is available and the CPU otherwise, or the one given as
`device=` (an fp8kit keyword).

What "FP8 available" means in fp8kit:
- CPU: always. The casts are exact and the GEMMs are emulated (FP8 values multiplied in float32 or bf16, float32
  accumulation, one scale multiply), giving the same casts, histories and scales as a GPU.
- CUDA, compute capability 8.9 or newer (Ada, Hopper, Blackwell): yes; the GEMMs run `torch._scaled_mm`.
- CUDA below 8.9: no. fp8kit's GEMMs on a CUDA tensor call `torch._scaled_mm`, which those GPUs lack, and fp8kit does
  not fall back to emulation for CUDA tensors (move the model to the CPU for emulated FP8).
- ROCm and other devices: no (fp8kit's device path is written and tested for NVIDIA GPUs only).
MXFP8 and FP8 block scaling: always; fp8kit emulates their casts and GEMMs with torch operations on any device
(docs/numerics.md). NVFP4 is not implemented in fp8kit, on any device.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..recipe import DelayedScaling, Recipe

__all__ = ["is_fp8_available", "is_bf16_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available", "get_default_recipe", "get_device_compute_capability"]

Answer = Union[bool, Tuple[bool, str]]


def _answer(available: bool, reason: str, return_reason: bool) -> Answer:
    return (available, "" if available else reason) if return_reason else available


def _device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from err


def _cuda_capability(device: torch.device) -> Tuple[Tuple[int, int], str]:
    """((major, minor), description) of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor), f"CUDA device {index} ({torch.cuda.get_device_name(index)})"


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def is_fp8_available(return_reason: bool = False, *, device=None) -> Answer:
    """Whether fp8kit runs FP8 (delayed and current per-tensor scaling) on `device` (default: the current CUDA
    device if CUDA is available, else the CPU); with `return_reason=True`, `(available, reason)`."""
    _check_bool("return_reason", return_reason)
    dev = _device(device)
    if dev.type == "cpu":
        return _answer(True, "", return_reason)
    if dev.type != "cuda":
        return _answer(False, f"fp8kit runs FP8 on CPUs and NVIDIA CUDA GPUs, not on {dev.type} devices",
                       return_reason)
    if not torch.cuda.is_available():
        return _answer(False, f"{dev} was asked about, but CUDA is not available", return_reason)
    if torch.version.hip is not None:
        return _answer(False, "fp8kit's GPU path (torch._scaled_mm with float8_e4m3fn / float8_e5m2) is written and "
                              "tested for NVIDIA GPUs only, not ROCm", return_reason)
    capability, what = _cuda_capability(dev)
    if capability >= (8, 9):
        return _answer(True, "", return_reason)
    return _answer(False, f"{what} has compute capability {capability[0]}.{capability[1]}: fp8kit's FP8 GEMMs on "
                          "CUDA run torch._scaled_mm, which needs 8.9 or newer (on the CPU fp8kit emulates them)",
                   return_reason)


def is_bf16_available(return_reason: bool = False, *, device=None) -> Answer:
    """Whether bfloat16 compute is supported on `device` (default as in `is_fp8_available`): on CPUs always (torch
    computes bf16 there), on CUDA GPUs from compute capability 8.0, Transformer Engine's rule."""
    _check_bool("return_reason", return_reason)
    dev = _device(device)
    if dev.type == "cpu":
        return _answer(True, "", return_reason)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return _answer(False, f"fp8kit answers for CPUs and CUDA GPUs, not {dev}", return_reason)
    capability, what = _cuda_capability(dev)
    return _answer(capability >= (8, 0), f"{what} has compute capability {capability[0]}.{capability[1]}: BF16 "
                                         "needs 8.0 or newer", return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Answer:
    """Always True: fp8kit emulates MXFP8 (`MXFP8BlockScaling`) on any device, with TE's bytes and scales (TE needs
    a Blackwell GPU)."""
    _check_bool("return_reason", return_reason)
    return _answer(True, "", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Answer:
    """Always True: fp8kit emulates FP8 block scaling (`Float8BlockScaling`) on any device, with TE's bytes and
    scales (TE needs a Hopper or newer GPU)."""
    _check_bool("return_reason", return_reason)
    return _answer(True, "", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Answer:
    """Always True: fp8kit emulates NVFP4 (`NVFP4BlockScaling`) on every device (Transformer Engine: Blackwell
    GPUs only)."""
    _check_bool("return_reason", return_reason)
    return _answer(True, "", return_reason)


def get_default_recipe() -> Recipe:
    """The recipe `te.autocast(recipe=None)` uses: `DelayedScaling()` on every device. (Transformer Engine picks by
    device: `MXFP8BlockScaling()` on compute capability 10.x, `Float8CurrentScaling()` on 12.0 and newer,
    `DelayedScaling()` otherwise; fp8kit implements neither MXFP8 nor a per-device default.)"""
    return DelayedScaling()


def get_device_compute_capability(device: Optional[Union[int, str, torch.device]] = None) -> Tuple[int, int]:
    """`(major, minor)` compute capability of a CUDA device (default: the current one), as Transformer Engine's.
    Raises RuntimeError without CUDA (a CPU has none)."""
    if not torch.cuda.is_available():
        raise RuntimeError("get_device_compute_capability: CUDA is not available (fp8kit runs FP8 on the CPU "
                           "without one; see is_fp8_available)")
    dev = _device(device if device is None or not isinstance(device, int) else f"cuda:{device}")
    if dev.type != "cuda":
        raise ValueError(f"get_device_compute_capability: {dev} is not a CUDA device")
    return _cuda_capability(dev)[0]
