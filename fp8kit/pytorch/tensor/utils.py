"""Helpers on quantized tensors with Transformer Engine's names (`transformer_engine.pytorch.tensor.utils`)."""

from __future__ import annotations

import torch

from .float8_tensor import Float8Tensor

__all__ = ["replace_raw_data"]


def replace_raw_data(tensor: Float8Tensor, new_raw_data: torch.Tensor) -> None:
    """Move a Float8Tensor's bytes into `new_raw_data` (a uint8 tensor of the same shape, e.g. a slice of one
    buffer holding many parameters) and make it the tensor's `_data`. The values, scale, format, quantizer and
    transpose stay as they were."""
    if not isinstance(tensor, Float8Tensor):
        raise ValueError(f"replace_raw_data: expected a Float8Tensor, got {type(tensor).__name__}")
    old = tensor._data
    if not isinstance(new_raw_data, torch.Tensor) or new_raw_data.dtype != old.dtype:
        raise ValueError(f"replace_raw_data: the raw data types differ: old dtype={old.dtype}, new dtype="
                         f"{getattr(new_raw_data, 'dtype', type(new_raw_data).__name__)}")
    if new_raw_data.shape != old.shape or new_raw_data.device != old.device:
        raise ValueError(f"replace_raw_data: new raw data of shape {tuple(new_raw_data.shape)} on "
                         f"{new_raw_data.device}, the tensor's is {tuple(old.shape)} on {old.device}")
    new_raw_data.detach().copy_(old)
    tensor._data = new_raw_data
