"""`LayerNormMLP`: LayerNorm, then `wo(act(wi(x)))` with both GEMMs in FP8 inside an enabled `autocast`."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..activation import activation
from ..sharding import with_sharding_constraint_by_logical_axes
from .base import (
    Initializer,
    default_kernel_init,
    fp8_dense,
    low_rank_adaptation,
    with_axes,
)
from .layernorm import normed_input

__all__ = ["LayerNormMLP", "normalize_activations"]


def normalize_activations(activations: Sequence[Union[str, Callable]]) -> Tuple[Union[str, Callable], ...]:
    """Lower-case names, with a leading "linear" (or "clamped_linear") moved last, as Transformer Engine orders
    gated activations (("linear", "gelu") is GeGLU like ("gelu", "linear"))."""
    acts = tuple(a.lower() if isinstance(a, str) else a for a in activations)
    if not acts:
        raise ValueError("activations: expected at least one activation")
    if acts[0] in ("linear", "clamped_linear"):
        acts = tuple(reversed(acts))
    return acts


class LayerNormMLP(nn.Module):
    """LayerNorm (or RMSNorm), then `wo(act(wi(x)))`, both GEMMs in FP8 inside an enabled `autocast`.

    With several `activations` (e.g. ("gelu", "linear") for GeGLU) the first GEMM makes one slice per activation and
    their activated values are multiplied. Parameters: "scale", "ln_bias", "wi_kernel" `[hidden, n_act,
    intermediate]` (one `kernel_init` draw per activation, stacked), "wi_bias" `[n_act, intermediate]`, "wo_kernel"
    `[intermediate, hidden]`, "wo_bias" `[hidden]`. FP8 state postfixes: "_0" for wi, "_1" for wo. Returns
    `(output, ln_output)` like LayerNormDenseGeneral. Dropout on the activated values (`intermediate_dropout_rate`,
    0 by default) needs a "dropout" rng unless `deterministic=True`. dtype / param_dtype / precision as in
    DenseGeneral. Only `axis=-1` is supported, as in Transformer Engine.
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[Optional[str], ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes_1: Tuple[Optional[str], ...] = ("embed", "act", "mlp")
    kernel_axes_2: Tuple[Optional[str], ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Tuple[Optional[str], ...] = ("act", "mlp")
    bias_axes_2: Tuple[Optional[str], ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Sequence[Union[str, Callable]] = ("gelu",)
    activation_params: Optional[Any] = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = None
    layernorm_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_1_input_axes: Optional[Tuple[Optional[str], ...]] = None
    dot_2_input_axes: Optional[Tuple[Optional[str], ...]] = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    def _wi_init(self, key, num: int, shape: Tuple[int, int], dtype) -> jax.Array:
        init = self.kernel_init or default_kernel_init
        kernels = []
        for _ in range(num):
            key, sub = jax.random.split(key)
            kernels.append(init(sub, shape, dtype))
        return jnp.stack(kernels, axis=-2).astype(dtype)

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False) -> Tuple[jax.Array, Optional[jax.Array]]:
        """inputs `[..., hidden]` -> (`[..., hidden]`, normalized inputs or None), computation dtype."""
        acts = normalize_activations(self.activations)
        dtype, y, ln_output = normed_input(self, inputs, "LayerNormMLP")
        hidden, n_act, inter = y.shape[-1], len(acts), self.intermediate_dim
        wi = self.param("wi_kernel", with_axes(lambda k, s, d: self._wi_init(k, n_act, (hidden, inter), d),
                                               self.kernel_axes_1), (hidden, n_act, inter), self.param_dtype)
        wo = self.param("wo_kernel", with_axes(self.kernel_init or default_kernel_init, self.kernel_axes_2),
                        (inter, hidden), self.param_dtype)
        wi_bias = wo_bias = None
        if self.use_bias:
            wi_bias = self.param("wi_bias", with_axes(self.bias_init, self.bias_axes_1), (n_act, inter),
                                 self.param_dtype)
            wo_bias = self.param("wo_bias", with_axes(self.bias_init, self.bias_axes_2), (hidden,), self.param_dtype)
        y = with_sharding_constraint_by_logical_axes(y, self.dot_1_input_axes)
        h = fp8_dense(self, y, wi, wi_bias, dtype, ((y.ndim - 1,), (0,)), self.dot_1_input_axes,
                      self.kernel_axes_1 or None, "_0")
        if self.enable_low_rank_adaptation:
            h = h + low_rank_adaptation(self, y, (hidden,), (n_act, inter), self.low_rank_adaptation_dim,
                                        self.low_rank_adaptation_alpha, self.kernel_init, "wi_", self.param_dtype)
        h = checkpoint_name(h, self.ffn1_ckpt_name)
        z = activation(h, acts, act_params=self.activation_params).astype(dtype)
        z = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                       rng_collection=self.intermediate_dropout_rng_name)(z, deterministic=deterministic)
        z = with_sharding_constraint_by_logical_axes(z, self.dot_2_input_axes)

        out = fp8_dense(self, z, wo, wo_bias, dtype, ((z.ndim - 1,), (0,)), self.dot_2_input_axes,
                        self.kernel_axes_2 or None, "_1")
        if self.enable_low_rank_adaptation:
            out = out + low_rank_adaptation(self, z, (inter,), (hidden,), self.low_rank_adaptation_dim,
                                            self.low_rank_adaptation_alpha, self.kernel_init, "wo_", self.param_dtype)
        out = checkpoint_name(out, self.ffn2_ckpt_name)
        return out.astype(dtype), ln_output
