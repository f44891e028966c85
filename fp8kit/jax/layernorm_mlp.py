"""`layernorm_mlp`: LayerNorm, an FP8 dense layer, (gated) activation and a second FP8 dense layer (Transformer
Engine's `transformer_engine.jax.layernorm_mlp.layernorm_mlp`)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import jax
from jax.ad_checkpoint import checkpoint_name

from .activation import activation
from .dense import dense
from .layernorm import layernorm
from .sharding import with_sharding_constraint_by_logical_axes

__all__ = ["layernorm_mlp"]


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    kernels: Sequence[jax.Array],
    biases: Sequence[Optional[jax.Array]],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: Optional[Tuple[str, ...]] = None,
    dot_1_input_axes: Optional[Tuple[str, ...]] = None,
    dot_2_input_axes: Optional[Tuple[str, ...]] = None,
    kernel_1_axes: Optional[Tuple[str, ...]] = None,
    kernel_2_axes: Optional[Tuple[str, ...]] = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[Union[str, Callable]] = ("gelu",),
    activation_params: Optional[Any] = None,
    collective_op_sets: Tuple[Any, Any] = (None, None),
    quantizer_sets: Tuple[Any, Any] = (None, None),
) -> jax.Array:
    """`wo(act(wi(layernorm(x))))`: x `[..., hidden]`; kernels `(wi [hidden, n_act, inter], wo [inter, hidden])`,
    n_act = len(activation_type); biases `(bi [n_act, inter] | None, bo [hidden] | None)`. Returns `[..., hidden]`
    in x's dtype. The wi output and the result are named `ffn1_ckpt_name` / `ffn2_ckpt_name` for
    `jax.checkpoint` policies. `quantizer_sets` are the two GEMMs' delayed-scaling states (see `dense`)."""
    if len(kernels) != 2 or len(biases) != 2 or len(quantizer_sets) != 2:
        raise ValueError("layernorm_mlp: kernels, biases and quantizer_sets must each hold two entries (wi, wo)")
    if any(c is not None for c in collective_op_sets):
        raise NotImplementedError("layernorm_mlp: collective GEMMs (collective_op_sets) are not implemented")
    wi, wo = kernels
    acts = (activation_type,) if isinstance(activation_type, str) else tuple(activation_type)
    if wi.ndim != 3 or wi.shape[1] != len(acts):
        raise ValueError(f"layernorm_mlp: kernels[0] must have shape [hidden, {len(acts)}, intermediate] for "
                         f"activation_type={acts}, got {wi.shape}")
    x = with_sharding_constraint_by_logical_axes(x, norm_input_axes)
    y = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    h = dense(y, wi, biases[0], contracting_dims=((y.ndim - 1,), (0,)), input_axes=dot_1_input_axes,
              kernel_axes=kernel_1_axes, quantizer_set=quantizer_sets[0],
              transpose_batch_sequence=transpose_batch_sequence)
    h = checkpoint_name(h, ffn1_ckpt_name)
    z = activation(h, acts, act_params=activation_params)
    z = with_sharding_constraint_by_logical_axes(z, dot_2_input_axes)
    out = dense(z, wo, biases[1], contracting_dims=((z.ndim - 1,), (0,)), kernel_axes=kernel_2_axes,
                quantizer_set=quantizer_sets[1], transpose_batch_sequence=transpose_batch_sequence)
    return checkpoint_name(out, ffn2_ckpt_name)


# `te.layernorm_mlp.layernorm_mlp(...)` (Transformer Engine's module path) works as well as `te.layernorm_mlp`
layernorm_mlp.layernorm_mlp = layernorm_mlp
