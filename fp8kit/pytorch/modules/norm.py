"""LayerNorm and RMSNorm with Transformer Engine's options, as functions (shared by the fused modules) and as
modules (`te.LayerNorm`, `te.RMSNorm`).

Precision, as Transformer Engine's norm kernels: the operands are first cast to the output dtype (the torch.autocast
dtype inside torch.autocast, else the input's dtype in the fused modules and the weight's in `LayerNorm` /
`RMSNorm`); for bf16 / fp16, forward and backward are then computed in float32 (torch's `layer_norm` / `rms_norm` on
float32 tensors) and each result is rounded once to its dtype. (torch's own CPU kernels at bf16 / fp16 round partial
results, which puts dbeta off by whole units.) In float32 and float64 they are `torch.nn.LayerNorm` /
`torch.nn.RMSNorm` on the contiguous input, bit for bit."""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..te_checkpoint import accept_extra_state

__all__ = ["LayerNorm", "RMSNorm", "normalize", "NORMALIZATIONS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_NARROW = (torch.bfloat16, torch.float16)


def _widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded to `dtype` (Transformer Engine casts the operands to the output dtype first), then as float32 if
    that dtype is 16-bit (float32 and float64 compute in their own dtype)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.float() if dtype in _NARROW else t


def normalize(normalization: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              zero_centered_gamma: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """LayerNorm (`(x - mean) / sqrt(var + eps) * gamma + beta`) or RMSNorm (`x / sqrt(mean(x**2) + eps) * gamma`)
    over the trailing `weight.dim()` dimensions of `x`; gamma is `weight`, or `1 + weight` (in the compute dtype) with
    `zero_centered_gamma`. The result has the torch.autocast dtype inside torch.autocast, else `dtype` (default: x's
    dtype); for bf16 / fp16 the math runs in float32 (see the module docstring)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):  # the float32 math is not autocast's to change
            return normalize(normalization, x, weight, bias, eps, zero_centered_gamma,
                             torch.get_autocast_dtype(device_type))
    if dtype is None:
        dtype = x.dtype
    shape = tuple(weight.shape)
    x32 = _widened(x.contiguous(), dtype)
    gamma = _widened(weight, dtype)
    if zero_centered_gamma:  # the parameter holds gamma - 1 (weight decay pulls the scale towards 1, not 0)
        gamma = gamma + 1
    if normalization == "LayerNorm":
        y = F.layer_norm(x32, shape, gamma, None if bias is None else _widened(bias, dtype), eps)
    elif normalization == "RMSNorm":
        y = F.rms_norm(x32, shape, gamma, eps)
    else:
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return y if y.dtype == dtype else y.to(dtype)


def check_normalization(where: str, normalization) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{where}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return normalization


def check_eps(where: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"{where}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _shape(where: str, normalized_shape, hidden_size) -> Tuple[int, ...]:
    if normalized_shape is None:
        if hidden_size is None:
            raise TypeError(f"{where}: give normalized_shape (or the older hidden_size)")
        warnings.warn(f"{where}: hidden_size is the older name of normalized_shape", DeprecationWarning, stacklevel=3)
        normalized_shape = hidden_size
    elif hidden_size is not None:
        raise TypeError(f"{where}: give normalized_shape or hidden_size, not both")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(f"{where}: normalized_shape must be a positive int or ints, got {normalized_shape!r}")
    return shape


class _Norm(torch.nn.Module):
    _kind = "LayerNorm"
    _has_bias = True

    def __init__(self, normalized_shape: Union[int, Iterable[int], None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None, *, device=None,
                 dtype: Optional[torch.dtype] = None, sm_margin=0):
        super().__init__()
        kind = self._kind
        self.normalized_shape = _shape(kind, normalized_shape, hidden_size)
        self.eps = check_eps(kind, eps)
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"{kind}: params_dtype={params_dtype} and dtype={dtype} disagree")
        dtype = params_dtype or dtype or torch.get_default_dtype()
        if not isinstance(zero_centered_gamma, bool):
            raise TypeError(f"{kind}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.sm_margin = sm_margin  # a CUDA-kernel scheduling hint of Transformer Engine: no effect here
        self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        if self._has_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """gamma = 1 (the parameter is 0 with `zero_centered_gamma`), beta = 0. With `sequence_parallel` set, the
        parameters carry a `sequence_parallel` attribute (Megatron all-reduces their gradients)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self._has_bias:
                self.bias.zero_()
        if self.sequence_parallel is not None:
            for p in self.parameters(recurse=False):
                p.sequence_parallel = self.sequence_parallel

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        accept_extra_state(prefix, unexpected_keys)  # Transformer Engine's norms save one (te_checkpoint.py)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if inp.shape[-len(self.normalized_shape):] != self.normalized_shape:
            raise ValueError(f"{self._kind}: input of shape {tuple(inp.shape)} does not end with normalized_shape "
                             f"{self.normalized_shape}")
        return normalize(self._kind, inp, self.weight, getattr(self, "bias", None), self.eps,
                         self.zero_centered_gamma, self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """Transformer Engine's LayerNorm: `(x - mean) / sqrt(var + eps) * gamma + beta` over `normalized_shape`.

    Args: normalized_shape (or the older `hidden_size`), eps, sequence_parallel (sets the parameters'
    `sequence_parallel` attribute, as Transformer Engine does for Megatron), params_dtype (or `dtype`), device,
    zero_centered_gamma (the weight holds gamma - 1 and starts at 0), sm_margin (accepted, no effect).
    Parameters `weight`, `bias`, as torch.nn.LayerNorm. The output has the weight's dtype (the input is cast to it),
    or torch.autocast's dtype inside torch.autocast, as in Transformer Engine; bf16 / fp16 are computed in float32."""

    _kind = "LayerNorm"
    _has_bias = True


class RMSNorm(_Norm):
    """Transformer Engine's RMSNorm: `x / sqrt(mean(x**2) + eps) * gamma` over `normalized_shape`; the arguments of
    `LayerNorm`. Parameter `weight`."""

    _kind = "RMSNorm"
    _has_bias = False
