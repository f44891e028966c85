"""`layernorm`: LayerNorm and RMSNorm over the last axis, computed in float32 (Transformer Engine's formula).

    layernorm: y = (x - mean(x)) * rsqrt(mean((x - mean(x))**2) + epsilon) * g + beta
    rmsnorm:   y = x * rsqrt(mean(x**2) + epsilon) * g
    g = gamma + 1 with zero_centered_gamma, else gamma
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["layernorm", "canonicalize_norm_type"]


def canonicalize_norm_type(norm_type: str) -> str:
    """"layernorm" or "rmsnorm" from any spelling ("LayerNorm", "rms_norm", ...); ValueError otherwise."""
    key = str(norm_type).lower().strip().replace("-", "").replace("_", "")
    if key not in ("layernorm", "rmsnorm"):
        raise ValueError(f"norm_type: expected 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return key


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer: Any = None,
) -> jax.Array:
    """Normalize `x[..., hidden]` over its last axis with `gamma[hidden]` (and `beta[hidden]` for layernorm; None
    for rmsnorm). Computed in float32; returns x's dtype and shape. `quantizer` must be None."""
    if quantizer is not None:
        raise NotImplementedError("layernorm: quantizer is not supported; fp8kit quantizes inside the dense GEMMs")
    norm_type = canonicalize_norm_type(norm_type)
    hidden = x.shape[-1]
    if tuple(gamma.shape) != (hidden,):
        raise ValueError(f"layernorm: gamma has shape {gamma.shape}, expected ({hidden},)")
    if norm_type == "rmsnorm" and beta is not None:
        raise ValueError("layernorm: rmsnorm has no beta; pass beta=None")
    if norm_type == "layernorm" and (beta is None or tuple(beta.shape) != (hidden,)):
        raise ValueError(f"layernorm: beta must have shape ({hidden},), got {None if beta is None else beta.shape}")
    x32 = x.astype(jnp.float32)
    if norm_type == "layernorm":
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centered * lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + epsilon)
    else:
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
    g = gamma.astype(jnp.float32)
    y = y * (g + 1.0 if zero_centered_gamma else g)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(x.dtype)
