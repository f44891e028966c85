"""`MultiHeadAttention`: LayerNorm + query/key/value projections (FP8 dense layers), high-precision
DotProductAttention, and the output projection (FP8), with Transformer Engine's arguments and parameter layout."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..sharding import (
    BATCH_AXES,
    HEAD_AXES,
    HIDDEN_AXES,
    HIDDEN_TP_AXES,
    SEQLEN_AXES,
    SEQLEN_TP_AXES,
    W_FSDP_AXES,
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    W_TP_AXES,
    with_sharding_constraint_by_logical_axes,
)
from .attention import DotProductAttention
from .base import Initializer
from .dense import DenseGeneral
from .layernorm import LayerNormDenseGeneral

__all__ = ["MultiHeadAttention", "rotary_pos_emb", "lora_scope"]

_LORA_SCOPES = {
    "none": (False, False, False), "all": (True, True, True), "qkv_proj": (True, False, False),
    "output_proj": (False, True, False), "mlp": (False, False, True), "exclude_qkv_proj": (False, True, True),
    "exclude_output_proj": (True, False, True), "exclude_mlp": (True, True, False),
}


def lora_scope(scope: Optional[str]) -> Tuple[bool, bool, bool]:
    """(qkv projections, output projection, MLP) flags of a `low_rank_adaptation_scope` name."""
    key = "none" if scope is None else str(scope).lower()
    if key not in _LORA_SCOPES:
        raise ValueError(f"low_rank_adaptation_scope: expected one of {sorted(_LORA_SCOPES)}, got {scope!r}")
    return _LORA_SCOPES[key]


def rotary_pos_emb(x: jax.Array, windows: Tuple[float, float], transpose_batch_sequence: bool,
                   group_method: str = "consecutive") -> jax.Array:
    """Rotary position embedding of `x[batch, seq, ..., heads, dim]` (`[seq, batch, ...]` when transposed): pair
    i of the `dim/2` pairs rotates by `position / timescale_i`, `timescale_i = min * (max/min)**(2i/dim)`.
    "consecutive" pairs elements (2i, 2i+1); "alternate" pairs (i, i + dim/2)."""
    method = str(group_method).lower().replace("-", "").replace("_", "")
    if method not in ("consecutive", "alternate"):
        raise ValueError(f"rotary_pos_emb_group_method: expected 'consecutive' or 'alternate', got {group_method!r}")
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"rotary_pos_emb: the head dimension must be even, got {dim}")
    low, high = windows
    timescale = low * (high / low) ** (2 * jnp.arange(dim // 2) / dim)
    seq_axis = 0 if transpose_batch_sequence else 1
    shape = [1] * (x.ndim - 1) + [dim // 2]
    shape[seq_axis] = x.shape[seq_axis]
    angle = (jnp.arange(x.shape[seq_axis])[:, None] / timescale).reshape(shape)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    xf = x.astype(jnp.float32)
    if method == "alternate":
        a, b = xf[..., : dim // 2], xf[..., dim // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        pairs = xf.reshape(x.shape[:-1] + (dim // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention: `[Query, Key, Value projections] -> DotProductAttention -> output
    projection`, the projections in FP8 inside an enabled `autocast`, attention in high precision.

    Parameters (Transformer Engine's layout): self-attention without GQA and `fuse_qkv_params` (the default) has
    "qkv" (LayerNormDenseGeneral, kernel `[hidden, 3, heads*head_dim]`); with GQA or cross-attention "query"
    (LayerNormDenseGeneral) and "kv" (DenseGeneral, kernel `[hidden, 2, gqa*head_dim]`); without
    `fuse_qkv_params` "query", "key" and "value"; then "out" (DenseGeneral, `[heads*head_dim, hidden]`). The query
    kernel is initialized divided by sqrt(head_dim) (`scaled_query_init`) and the logits are not scaled unless
    `scale_attn_logits`. Returns `(output, ln_output)`, the output in the input's dtype. dtype: computation dtype
    (None: the input's); param_dtype: the parameters'. Not implemented: the autoregressive cache (`decode=True`)
    and cuDNN score_mod. Deprecated aliases `num_heads`, `dropout_rate`, `fuse_qkv` are honoured;
    `output_layernorm` must stay None.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Optional[Initializer] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = None
    fuse_qkv_params: bool = True
    transpose_batch_sequence: Optional[bool] = None
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None
    num_heads: Optional[int] = None
    dropout_rate: Optional[float] = None
    output_layernorm: Optional[bool] = None
    apply_residual_connection_post_layernorm: Optional[bool] = None
    fuse_qkv: Optional[bool] = None
    param_dtype: Any = jnp.float32

    def _heads(self) -> Tuple[int, int]:
        heads = self.num_heads if self.num_heads is not None else self.num_attention_heads
        return heads, self.num_gqa_groups or heads

    def _kernel_init(self) -> Initializer:
        return self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "normal")

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array, mask: Optional[jax.Array] = None,
                 bias: Optional[jax.Array] = None, *, decode: bool = False, deterministic: bool = False,
                 score_mod_tensors: Optional[Mapping[str, Any]] = None,
                 score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None) -> Tuple[jax.Array, Optional[jax.Array]]:
        """inputs_q `[b, sq, hidden]`, inputs_kv `[b, skv, hidden]` (the same object for self-attention; seq first
        with `transpose_batch_sequence`); mask `[b, 1, sq, skv]` (True = masked out); bias added to the logits.
        Returns (`[b, sq, hidden]`, the normalized inputs or None)."""
        if decode:
            raise NotImplementedError("MultiHeadAttention: the autoregressive cache (decode=True) is not implemented")
        if self.output_layernorm is not None:
            raise ValueError("output_layernorm is deprecated in MultiHeadAttention; use input_layernorm")
        if inputs_q.dtype != inputs_kv.dtype:
            raise ValueError(f"MultiHeadAttention: inputs_q is {inputs_q.dtype} but inputs_kv is {inputs_kv.dtype}")
        heads, groups = self._heads()
        d = self.head_dim
        dropout = self.dropout_rate if self.dropout_rate is not None else self.attention_dropout
        fuse = self.fuse_qkv if self.fuse_qkv is not None else self.fuse_qkv_params
        tbs = bool(self.transpose_batch_sequence)
        lora_qkv, lora_out, _ = lora_scope(self.low_rank_adaptation_scope)
        kernel_init = self._kernel_init()
        depth = math.sqrt(d) if self.scaled_query_init else 1.0

        def query_init(key, shape, dtype=jnp.float32):
            return kernel_init(key, shape, dtype) / jnp.asarray(depth, dtype)

        def packed_init(parts):  # per-part init of a flattened [hidden, n * width] kernel (q part scaled)
            def init(key, shape, dtype=jnp.float32):
                width = shape[-1] // len(parts)
                keys = jax.random.split(key, len(parts))
                blocks = [fn(k, (shape[0], width), dtype) for fn, k in zip(parts, keys)]
                return jnp.stack(blocks, axis=-2).reshape(shape).astype(dtype)
            return init

        def seq_axes(sharded: bool):
            seq = SEQLEN_TP_AXES if sharded else SEQLEN_AXES
            return (seq, BATCH_AXES) if tbs else (BATCH_AXES, seq)

        in_axes_sp = (*seq_axes(self.enable_sequence_parallel), HIDDEN_AXES)
        in_axes = (*seq_axes(False), HIDDEN_AXES)
        is_self = inputs_q is inputs_kv
        inputs_q = with_sharding_constraint_by_logical_axes(inputs_q, in_axes_sp)
        common = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias,
                      bias_init=self.bias_init, low_rank_adaptation_dim=self.low_rank_adaptation_dim,
                      low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
                      transpose_batch_sequence=tbs)
        ln = dict(enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
                  zero_centered_gamma=self.zero_centered_gamma, epsilon=self.layernorm_epsilon,
                  scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,), layernorm_input_axes=in_axes_sp,
                  dot_input_axes=in_axes, enable_low_rank_adaptation=lora_qkv, **common)
        lead = inputs_q.shape[:2]
        if fuse and is_self and heads == groups:
            qkv, ln_out = LayerNormDenseGeneral(
                features=(3, heads * d), return_layernorm_output=self.return_layernorm_output,
                kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES), bias_axes=(W_JOINED_AXES, W_TP_AXES),
                kernel_init=packed_init((query_init, kernel_init, kernel_init)), name="qkv", **ln)(inputs_q)
            qkv = qkv.reshape(*lead, 3, heads, d)
            query, key, value = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        else:
            query, ln_out = LayerNormDenseGeneral(
                features=heads * d, return_layernorm_output=self.return_layernorm_output or is_self or not fuse,
                kernel_axes=(W_FSDP_AXES, W_TP_AXES), bias_axes=(W_TP_AXES,), kernel_init=query_init, name="query",
                **ln)(inputs_q)
            kv_in = ln_out if is_self else inputs_kv
            kv_lead = kv_in.shape[:2]
            dense_kw = dict(enable_low_rank_adaptation=lora_qkv, **common)
            if fuse:
                kv = DenseGeneral(features=(2, groups * d), kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
                                  bias_axes=(W_JOINED_AXES, W_TP_AXES), kernel_init=packed_init((kernel_init,) * 2),
                                  name="kv", **dense_kw)(kv_in)
                key, value = kv[..., 0, :], kv[..., 1, :]
            else:
                proj = dict(features=groups * d, kernel_axes=(W_FSDP_AXES, W_TP_AXES), bias_axes=(W_TP_AXES,),
                            kernel_init=kernel_init, **dense_kw)
                key, value = DenseGeneral(name="key", **proj)(kv_in), DenseGeneral(name="value", **proj)(kv_in)
            query = query.reshape(*lead, heads, d)
            key, value = key.reshape(*kv_lead, groups, d), value.reshape(*kv_lead, groups, d)
        if self.enable_rotary_pos_emb:
            query = rotary_pos_emb(query, self.rotary_pos_emb_windows, tbs, self.rotary_pos_emb_group_method)
            key = rotary_pos_emb(key, self.rotary_pos_emb_windows, tbs, self.rotary_pos_emb_group_method)
        head_axes = (*seq_axes(False), HEAD_AXES, HIDDEN_AXES)
        query, key, value = (with_sharding_constraint_by_logical_axes(t, head_axes) for t in (query, key, value))
        x = DotProductAttention(
            head_dim=d, num_attention_heads=heads, num_gqa_groups=groups, attn_mask_type=self.attn_mask_type,
            attn_bias_type=self.attn_bias_type, attention_dropout=dropout, dropout_rng_name=self.dropout_rng_name,
            float32_logits=self.float32_logits, scale_factor=1.0 / math.sqrt(d) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=tbs, window_size=self.window_size, softmax_type=self.softmax_type,
            score_mod=self.score_mod, score_mod_bprop=self.score_mod_bprop)(
            query, key, value, mask, bias, deterministic=deterministic, score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors)
        x = x.reshape(*x.shape[:2], heads * d)
        x = with_sharding_constraint_by_logical_axes(x, (*seq_axes(False), HIDDEN_TP_AXES))
        out = DenseGeneral(features=inputs_q.shape[-1], kernel_init=kernel_init, kernel_axes=(W_TP_AXES, W_FSDP_AXES),
                           bias_axes=(W_NO_SHARD_AXES,), enable_low_rank_adaptation=lora_out, name="out",
                           **common)(x)
        return out.astype(inputs_q.dtype), ln_out
