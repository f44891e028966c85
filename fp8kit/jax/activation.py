"""`activation(x, activation_type)`: Transformer Engine's (gated) activations, in high precision.

`x` has shape `[..., len(activation_type), hidden]`: slice i goes through activation i and the slices are
multiplied, so ("gelu",) is GELU and ("gelu", "linear") is GeGLU. The result has shape `[..., hidden]` and x's
dtype. Names: "linear", "gelu" (tanh approximation, as `jax.nn.gelu`), "silu"/"swish", "relu", "sigmoid",
"quick_gelu" (`x * sigmoid(1.702 x)`), "squared_relu" (`relu(x)**2`), "clamped_silu" and "clamped_linear" (GPT-OSS's
clamped SwiGLU, parameters `limit`, `alpha`, `glu_linear_offset`), any other `jax.nn` function by name, or a callable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp

__all__ = ["activation", "ClampedSwigluParams", "activation_function"]


@dataclasses.dataclass(frozen=True)
class ClampedSwigluParams:
    """Parameters of the clamped SwiGLU: `clamped_silu(x) = sigmoid(alpha * min(x, limit)) * min(x, limit)`,
    `clamped_linear(x) = clip(x, -limit, limit) + glu_linear_offset`."""

    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0


def _params(act_params: Any) -> ClampedSwigluParams:
    if act_params is None:
        return ClampedSwigluParams()
    if isinstance(act_params, ClampedSwigluParams):
        return act_params
    inner = getattr(act_params, "clamped_swiglu", None)  # Transformer Engine's ActivationParams
    if isinstance(inner, ClampedSwigluParams):
        return inner
    if isinstance(act_params, Mapping):
        try:
            return ClampedSwigluParams(**act_params)
        except TypeError as e:
            raise ValueError(f"act_params: {e}; expected keys limit, alpha, glu_linear_offset") from None
    raise ValueError(f"act_params: expected None, a dict or ClampedSwigluParams, got {type(act_params).__name__}")


def activation_function(name: Union[str, Callable], act_params: Any = None) -> Callable[[jax.Array], jax.Array]:
    """The elementwise function for one activation name (or the callable itself)."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise ValueError(f"activation_type: expected names or callables, got {name!r}")
    key = name.lower()
    p = _params(act_params)
    table = {
        "linear": lambda v: v,
        "quick_gelu": lambda v: v * jax.nn.sigmoid(1.702 * v),
        "squared_relu": lambda v: jnp.square(jax.nn.relu(v)),
        "swish": jax.nn.silu,
        "clamped_silu": lambda v: jax.nn.sigmoid(p.alpha * jnp.minimum(v, p.limit)) * jnp.minimum(v, p.limit),
        "clamped_linear": lambda v: jnp.clip(v, -p.limit, p.limit) + p.glu_linear_offset,
    }
    if key in table:
        return table[key]
    fn = getattr(jax.nn, key, None)
    if fn is None or not callable(fn):
        raise ValueError(f"activation_type: unknown activation {name!r}")
    return fn


def activation(
    x: jax.Array,
    activation_type: Sequence[Union[str, Callable]],
    quantizer: Any = None,
    act_params: Optional[Any] = None,
) -> jax.Array:
    """Apply `activation_type` to `x[..., len(activation_type), hidden]` and multiply the slices; returns
    `[..., hidden]` in x's dtype (computed in float32). `quantizer` must be None (fp8kit quantizes inside the dense
    GEMMs)."""
    if quantizer is not None:
        raise NotImplementedError("activation: quantizer is not supported; fp8kit quantizes inside the dense GEMMs")
    if isinstance(activation_type, str):
        activation_type = (activation_type,)
    acts = tuple(activation_type)
    if not acts:
        raise ValueError("activation_type: expected at least one activation")
    if x.ndim < 2 or x.shape[-2] != len(acts):
        raise ValueError(f"activation: x must have shape [..., {len(acts)}, hidden] for activation_type={acts}, "
                         f"got {x.shape}")
    out = None
    for i, name in enumerate(acts):  # in float32, as Transformer Engine's fused kernels compute
        part = activation_function(name, act_params)(x[..., i, :].astype(jnp.float32))
        out = part if out is None else out * part
    return out.astype(x.dtype)
