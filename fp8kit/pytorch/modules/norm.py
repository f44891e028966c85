"""LayerNorm and RMSNorm with Transformer Engine's options, as functions (shared by the fused modules) and as
modules (`te.LayerNorm`, `te.RMSNorm`). They run in high precision, with torch's own kernels
(`torch.nn.functional.layer_norm` / `rms_norm`), so without `zero_centered_gamma` they equal `torch.nn.LayerNorm`
and `torch.nn.RMSNorm` bit for bit."""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["LayerNorm", "RMSNorm", "normalize", "NORMALIZATIONS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    # zero_centered_gamma: the parameter holds gamma - 1 (weight decay pulls the scale towards 1, not 0)
    return weight + 1 if zero_centered_gamma else weight


def normalize(normalization: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              zero_centered_gamma: bool = False) -> torch.Tensor:
    """LayerNorm (`(x - mean) / sqrt(var + eps) * gamma + beta`) or RMSNorm (`x / sqrt(mean(x**2) + eps) * gamma`)
    over the trailing `weight.dim()` dimensions of `x`; gamma is `weight`, or `1 + weight` with
    `zero_centered_gamma`."""
    shape = tuple(weight.shape)
    gamma = _gamma(weight, zero_centered_gamma)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, gamma, bias, eps)
    if normalization == "RMSNorm":
        return F.rms_norm(x, shape, gamma, eps)
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


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

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if inp.shape[-len(self.normalized_shape):] != self.normalized_shape:
            raise ValueError(f"{self._kind}: input of shape {tuple(inp.shape)} does not end with normalized_shape "
                             f"{self.normalized_shape}")
        return normalize(self._kind, inp, self.weight, getattr(self, "bias", None), self.eps,
                         self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """Transformer Engine's LayerNorm: `(x - mean) / sqrt(var + eps) * gamma + beta` over `normalized_shape`.

    Args: normalized_shape (or the older `hidden_size`), eps, sequence_parallel (sets the parameters'
    `sequence_parallel` attribute, as Transformer Engine does for Megatron), params_dtype (or `dtype`), device,
    zero_centered_gamma (the weight holds gamma - 1 and starts at 0), sm_margin (accepted, no effect).
    Parameters `weight`, `bias`, as torch.nn.LayerNorm."""

    _kind = "LayerNorm"
    _has_bias = True


class RMSNorm(_Norm):
    """Transformer Engine's RMSNorm: `x / sqrt(mean(x**2) + eps) * gamma` over `normalized_shape`; the arguments of
    `LayerNorm`. Parameter `weight`."""

    _kind = "RMSNorm"
    _has_bias = False
