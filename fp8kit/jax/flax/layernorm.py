"""`LayerNorm` and `LayerNormDenseGeneral` (LayerNorm or RMSNorm, then an FP8 dense layer)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..layernorm import canonicalize_norm_type, layernorm
from ..sharding import with_sharding_constraint_by_logical_axes
from .base import (
    Initializer,
    compute_dtype,
    flat_bias_init,
    flat_kernel_init,
    fp8_dense,
    layernorm_params,
    low_rank_adaptation,
    normalize_axes,
    tuple_of,
    with_axes,
)
from .dense import check_checkpoint_name

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "apply_layernorm", "normed_input"]


def normed_input(module: nn.Module, inputs: jax.Array, kind: str):
    """The start of a layer with an optional norm before its GEMMs (LayerNormDenseGeneral, LayerNormMLP): the
    checks (quantization_checkpoint_name, axis=-1 only), the computation dtype, the input in it, normalized when
    `enable_layernorm`. Returns (dtype, normalized input, the normalized input when `return_layernorm_output`
    else None)."""
    check_checkpoint_name(module.quantization_checkpoint_name)
    if normalize_axes(tuple_of(module.axis), inputs.ndim) != (inputs.ndim - 1,):
        raise ValueError(f"axis: {kind} supports only axis=-1, got {module.axis!r}")
    dtype = compute_dtype(module.dtype, inputs)
    y = inputs.astype(dtype)
    if module.enable_layernorm:
        y = with_sharding_constraint_by_logical_axes(y, module.layernorm_input_axes)
        y = apply_layernorm(module, y, module.layernorm_type, module.epsilon, module.zero_centered_gamma,
                            module.scale_init, module.scale_axes, module.ln_bias_init, module.ln_bias_axes,
                            module.param_dtype, dtype)
    return dtype, y, (y if module.return_layernorm_output else None)


def apply_layernorm(module: nn.Module, x: jax.Array, layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
                    scale_init, scale_axes, bias_init, bias_axes, param_dtype, dtype) -> jax.Array:
    """Create the norm parameters of `module` and normalize `x` over its last axis; the parameters are rounded to
    the computation dtype first (as Transformer Engine rounds them to the input's), the math is float32."""
    norm_type = canonicalize_norm_type(layernorm_type)
    gamma, beta = layernorm_params(module, norm_type, x.shape[-1], zero_centered_gamma, scale_init, scale_axes,
                                   bias_init, bias_axes, param_dtype)
    x = x.astype(dtype)
    beta = None if beta is None else beta.astype(dtype)
    return layernorm(x, gamma.astype(dtype), beta, norm_type, zero_centered_gamma, epsilon)


class LayerNorm(nn.Module):
    """LayerNorm (`layernorm_type="layernorm"`) or RMSNorm ("rmsnorm") over the last axis.

    Parameters: "scale" `[hidden]` (ones, or zeros with `zero_centered_gamma`, which multiplies by `1 + scale`) and,
    for layernorm, "ln_bias" `[hidden]`. dtype: computation/output dtype (None: the input's); param_dtype: the
    parameters'. The normalization itself is computed in float32.
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ("embed",)
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[..., hidden]` -> same shape, in the computation dtype."""
        return apply_layernorm(self, x, self.layernorm_type, self.epsilon, self.zero_centered_gamma, self.scale_init,
                               self.scale_axes, self.bias_init, self.bias_axes, self.param_dtype,
                               compute_dtype(self.dtype, x))


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm (or RMSNorm) over the last axis, then a DenseGeneral whose GEMMs run in FP8 inside an enabled
    `autocast`. Returns `(output, ln_output)`; `ln_output` is the normalized input when `return_layernorm_output`,
    else None. Parameters: "scale", "ln_bias" (layernorm only), "kernel" `[hidden, *features]`, "bias"
    `[*features]` (with `use_bias`). `depth_scaling` divides the output. dtype / param_dtype / precision as in
    DenseGeneral. Only `axis=-1` is supported, as in Transformer Engine.
    """

    features: Union[int, Sequence[int]]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[Optional[str], ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = None
    layernorm_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_input_axes: Optional[Tuple[Optional[str], ...]] = None
    depth_scaling: Optional[float] = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> Tuple[jax.Array, Optional[jax.Array]]:
        """inputs `[..., hidden]` -> (`[..., *features]`, normalized inputs or None), computation dtype."""
        dtype, y, ln_output = normed_input(self, inputs, "LayerNormDenseGeneral")
        features = tuple_of(self.features)
        kernel_shape = (y.shape[-1],) + features
        kernel = self.param("kernel", with_axes(flat_kernel_init(self.kernel_init, 1), self.kernel_axes),
                            kernel_shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", with_axes(flat_bias_init(self.bias_init), self.bias_axes), features,
                              self.param_dtype)
        z = fp8_dense(self, y, kernel, bias, dtype, ((y.ndim - 1,), (0,)), self.dot_input_axes,
                      self.kernel_axes or None)
        if self.enable_low_rank_adaptation:
            z = z + low_rank_adaptation(self, y, (y.shape[-1],), features, self.low_rank_adaptation_dim,
                                        self.low_rank_adaptation_alpha, self.kernel_init, param_dtype=self.param_dtype)
        if self.depth_scaling is not None:
            z = z / self.depth_scaling
        return z.astype(dtype), ln_output
