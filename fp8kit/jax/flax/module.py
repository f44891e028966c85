"""Flax linen layers whose GEMMs run in FP8 inside `fp8kit.jax.autocast`: DenseGeneral, LayerNormDenseGeneral,
LayerNormMLP (the Transformer Engine names and parameter names).

Parameters ("params"): "kernel" `[*in, *features]` and "bias" `[*features]` like flax's DenseGeneral; LayerNorm
"scale" `[hidden]` and "ln_bias" `[hidden]`; LayerNormMLP "wi_kernel" `[hidden, n_activations, intermediate]`,
"wi_bias", "wo_kernel" `[intermediate, hidden]`, "wo_bias". Delayed-scaling state lives in "fp8_metas" (see
fp8kit/jax/state.py); it is created when the layer is initialized inside an enabled delayed-scaling autocast.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ...recipe import DelayedScaling
from .. import context as _ac
from ..dense import dense
from ..state import FP8_COLLECTION, group_names, init_group

__all__ = ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"]

Initializer = Callable[..., jax.Array]
_default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _tuple(value: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _normalize_axes(axes: Tuple[int, ...], ndim: int) -> Tuple[int, ...]:
    out = tuple(a % ndim for a in axes)
    if len(set(out)) != len(out):
        raise ValueError(f"axis {axes} names an axis twice")
    return out


def _with_axes(init: Initializer, axes: Tuple) -> Initializer:
    return nn.with_logical_partitioning(init, axes) if axes else init


def _kernel_init(init: Optional[Initializer], in_ndim: int) -> Initializer:
    """Initialize a `[*in, *out]` kernel as the 2-D `[prod(in), prod(out)]` matrix it stands for (so fan-in counts
    every contracted axis, as in flax's DenseGeneral), then reshape."""
    init = init or _default_kernel_init

    def flat(key, shape, dtype=jnp.float32):
        rows = math.prod(shape[:in_ndim])
        return jnp.reshape(init(key, (rows, math.prod(shape) // max(rows, 1)), dtype), shape)

    return flat


def _fp8_group(module: nn.Module, postfix: str) -> Optional[dict]:
    """This GEMM's delayed-scaling variables (postfix removed), created at init; None unless delayed FP8 is on."""
    recipe = _ac.get_recipe()
    if not isinstance(recipe, DelayedScaling):
        return None
    names = group_names(postfix, recipe.interval > 1)
    group = {}
    for key, name in names.items():
        if not module.is_initializing() and not module.has_variable(FP8_COLLECTION, name):
            raise ValueError(
                f"{type(module).__name__} {module.name or ''}: no {FP8_COLLECTION}/{name}. Delayed scaling keeps its "
                f"state in the {FP8_COLLECTION!r} collection: initialize the layer (layer.init) inside "
                f"te.autocast(enabled=True, recipe=DelayedScaling(...)) and pass all variables to apply"
            )
        value = module.variable(FP8_COLLECTION, name, lambda k=key: init_group(recipe)[k]).value
        shape = (recipe.amax_history_len,) if key.endswith("_amax_history") else (1,)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{type(module).__name__}: {FP8_COLLECTION}/{name} has shape {tuple(value.shape)} but the recipe "
                f"needs {shape} (amax_history_len={recipe.amax_history_len}); re-initialize, or resize the history "
                f"(truncate or zero-pad its end)"
            )
        group[key] = value
    return group


def _dense_general(module: nn.Module, x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array],
                   axis: Tuple[int, ...], postfix: str) -> jax.Array:
    """Contract the input `axis` of `x` with the leading axes of `kernel`; output `[*other axes, *features]`."""
    n = len(axis)
    x = jnp.moveaxis(x, axis, tuple(range(x.ndim - n, x.ndim)))
    return dense(x, kernel, bias, _fp8_group(module, postfix), contracting_ndim=n)


class DenseGeneral(nn.Module):
    """`y = x @ kernel + bias` over the input `axis`, in FP8 inside an enabled `autocast`.

    features: output features (int or tuple). axis: input axes to contract (default -1). dtype: the parameters'
    dtype (float32 by default); the output has the input's dtype. kernel_axes / bias_axes: logical axis names for
    `nn.with_logical_partitioning` (empty: no annotation).
    """

    features: Union[int, Sequence[int]]
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[Optional[str], ...] = ()
    use_bias: bool = True
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        features = _tuple(self.features)
        axis = _normalize_axes(_tuple(self.axis), inputs.ndim)
        kernel_init = _kernel_init(self.kernel_init, len(axis))
        kernel_shape = tuple(inputs.shape[a] for a in axis) + features
        kernel = self.param("kernel", _with_axes(kernel_init, self.kernel_axes), kernel_shape, self.dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", _with_axes(self.bias_init, self.bias_axes), features, self.dtype)
        return _dense_general(self, inputs, kernel, bias, axis, "")


def _layernorm(module: nn.Module, x: jax.Array, layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
               scale_init: Optional[Initializer], scale_axes: Tuple, ln_bias_init: Initializer, ln_bias_axes: Tuple,
               dtype: Any) -> jax.Array:
    """LayerNorm or RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    if layernorm_type not in ("layernorm", "rmsnorm"):
        raise ValueError(f"layernorm_type: expected 'layernorm' or 'rmsnorm', got {layernorm_type!r}")
    hidden = x.shape[-1]
    x32 = x.astype(jnp.float32)
    if layernorm_type == "layernorm":
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        y = centered * lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + epsilon)
    else:
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    gamma = module.param("scale", _with_axes(scale_init, scale_axes), (hidden,), dtype).astype(jnp.float32)
    y = y * (gamma + 1.0 if zero_centered_gamma else gamma)
    if layernorm_type == "layernorm":
        y = y + module.param("ln_bias", _with_axes(ln_bias_init, ln_bias_axes), (hidden,), dtype).astype(jnp.float32)
    return y.astype(x.dtype)


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm (or RMSNorm) over the last axis followed by a DenseGeneral, in FP8 inside an enabled `autocast`.

    Returns `(output, ln_output)`; `ln_output` is the normalized input when `return_layernorm_output` (the default,
    as in Transformer Engine), else None. Parameters: "scale", "ln_bias" (layernorm only), "kernel", "bias".
    """

    features: Union[int, Sequence[int]]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ()
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ()
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[Optional[str], ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    return_layernorm_output: bool = True
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array) -> Tuple[jax.Array, Optional[jax.Array]]:
        y = inputs
        if self.enable_layernorm:
            y = _layernorm(self, inputs, self.layernorm_type, self.epsilon, self.zero_centered_gamma,
                           self.scale_init, self.scale_axes, self.ln_bias_init, self.ln_bias_axes, self.dtype)
        features = _tuple(self.features)
        axis = _normalize_axes(_tuple(self.axis), y.ndim)
        kernel_shape = tuple(y.shape[a] for a in axis) + features
        kernel_init = _kernel_init(self.kernel_init, len(axis))
        kernel = self.param("kernel", _with_axes(kernel_init, self.kernel_axes), kernel_shape, self.dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", _with_axes(self.bias_init, self.bias_axes), features, self.dtype)
        out = _dense_general(self, y, kernel, bias, axis, "")
        return out, (y if self.return_layernorm_output else None)


def _activation(name: str) -> Callable[[jax.Array], jax.Array]:
    table = {
        "relu": nn.relu,
        "gelu": nn.gelu,
        "silu": nn.silu,
        "swish": nn.silu,
        "linear": lambda v: v,
        "quick_gelu": lambda v: v * nn.sigmoid(1.702 * v),
        "squared_relu": lambda v: jnp.square(nn.relu(v)),
    }
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"activations: unknown activation {name!r}; expected one of {sorted(table)}")
    return table[key]


class LayerNormMLP(nn.Module):
    """LayerNorm, then `wo(act(wi(x)))` with both GEMMs in FP8 inside an enabled `autocast`.

    With several `activations` (e.g. ("gelu", "linear") for GeGLU) the first GEMM makes one slice per activation and
    their activated values are multiplied. FP8 state postfixes: "_0" for wi, "_1" for wo. Returns
    `(output, ln_output)` like LayerNormDenseGeneral. Dropout on the intermediate values (rate 0.1 by default, as in
    Transformer Engine) needs a "dropout" rng unless `deterministic=True`.
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ()
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ()
    kernel_init: Optional[Initializer] = None
    kernel_axes_1: Tuple[Optional[str], ...] = ()
    kernel_axes_2: Tuple[Optional[str], ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Tuple[Optional[str], ...] = ()
    bias_axes_2: Tuple[Optional[str], ...] = ()
    return_layernorm_output: bool = True
    activations: Sequence[str] = ("relu",)
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.1
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False) -> Tuple[jax.Array, Optional[jax.Array]]:
        y = inputs
        if self.enable_layernorm:
            y = _layernorm(self, inputs, self.layernorm_type, self.epsilon, self.zero_centered_gamma,
                           self.scale_init, self.scale_axes, self.ln_bias_init, self.ln_bias_axes, self.dtype)
        axis = _normalize_axes(_tuple(self.axis), y.ndim)
        acts = tuple(self.activations)
        if not acts:
            raise ValueError("activations: expected at least one activation")
        hidden_shape = tuple(y.shape[a] for a in axis)
        wi_shape = hidden_shape + (len(acts), self.intermediate_dim)
        wi_init = _kernel_init(self.kernel_init, len(axis))
        wi = self.param("wi_kernel", _with_axes(wi_init, self.kernel_axes_1), wi_shape, self.dtype)
        wi_bias = None
        if self.use_bias:
            wi_bias = self.param("wi_bias", _with_axes(self.bias_init, self.bias_axes_1),
                                 (len(acts), self.intermediate_dim), self.dtype)
        h = _dense_general(self, y, wi, wi_bias, axis, "_0")  # [*batch, n_act, intermediate]
        z = None
        for i, name in enumerate(acts):
            part = _activation(name)(h[..., i, :].astype(jnp.float32))
            z = part if z is None else z * part
        z = z.astype(inputs.dtype)
        z = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                       rng_collection=self.intermediate_dropout_rng_name)(z, deterministic=deterministic)
        out_features = hidden_shape
        wo_shape = (self.intermediate_dim,) + out_features
        wo_init = _kernel_init(self.kernel_init, 1)
        wo = self.param("wo_kernel", _with_axes(wo_init, self.kernel_axes_2), wo_shape, self.dtype)
        wo_bias = None
        if self.use_bias:
            wo_bias = self.param("wo_bias", _with_axes(self.bias_init, self.bias_axes_2), out_features, self.dtype)
        out = _dense_general(self, z, wo, wo_bias, (z.ndim - 1,), "_1")
        return out, (y if self.return_layernorm_output else None)
