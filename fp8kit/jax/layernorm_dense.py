"""`layernorm_dense`: LayerNorm (or RMSNorm) over the last axis, then an FP8 dense layer (Transformer Engine's
`transformer_engine.jax.layernorm_dense.layernorm_dense`)."""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import jax

from .dense import dense
from .layernorm import layernorm
from .sharding import with_sharding_constraint_by_logical_axes

__all__ = ["layernorm_dense"]


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    bias: Optional[jax.Array] = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    layernorm_input_axes: Optional[Tuple[str, ...]] = None,
    dot_input_axes: Optional[Tuple[str, ...]] = None,
    kernel_axes: Optional[Tuple[str, ...]] = None,
    quantizer_set: Optional[Mapping[str, jax.Array]] = None,
) -> jax.Array:
    """`dense(layernorm(x), kernel, bias)`: x `[..., hidden]`, kernel `[hidden, *out]`, gamma/beta `[hidden]` (beta
    None for rmsnorm), bias `[*out]`; returns `[..., *out]` in x's dtype. The GEMMs run in FP8 inside an enabled
    autocast; `quantizer_set` is the GEMM's delayed-scaling state (see `dense`)."""
    x = with_sharding_constraint_by_logical_axes(x, layernorm_input_axes)
    y = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    return dense(y, kernel, bias, contracting_dims=((y.ndim - 1,), (0,)),
                 transpose_batch_sequence=transpose_batch_sequence, input_axes=dot_input_axes,
                 kernel_axes=kernel_axes, quantizer_set=quantizer_set)


# `te.layernorm_dense.layernorm_dense(...)` (Transformer Engine's module path) works as well as `te.layernorm_dense`
layernorm_dense.layernorm_dense = layernorm_dense
