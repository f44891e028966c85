"""`TransformerLayer` (attention + MLP block with FP8 GEMMs), `RelativePositionBiases`, `TransformerLayerType` and
`extend_logical_axis_rules`, with Transformer Engine's arguments and parameter layout."""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..sharding import (
    BATCH_AXES,
    HIDDEN_AXES,
    HIDDEN_TP_AXES,
    SEQLEN_AXES,
    SEQLEN_TP_AXES,
    W_FSDP_AXES,
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    W_TP_AXES,
    get_sharding_map_logic_axis_to_mesh_axis,
    with_sharding_constraint_by_logical_axes,
)
from .base import Initializer
from .layernorm import LayerNorm
from .mha import MultiHeadAttention, lora_scope
from .mlp import LayerNormMLP

__all__ = ["TransformerLayer", "TransformerLayerType", "RelativePositionBiases", "extend_logical_axis_rules"]

LogicalRules = Sequence[Tuple[str, Union[str, None]]]


def extend_logical_axis_rules(rules: LogicalRules) -> Tuple[Tuple[str, Optional[str]], ...]:
    """`rules` (flax logical axis rules) followed by the rules of fp8kit's logical axes (`BATCH_AXES`, `W_TP_AXES`,
    ...) for the current MeshResource and mesh. A logical axis that `rules` already maps must map to the same mesh
    axis (ValueError otherwise). Call it inside `te.autocast(mesh_resource=...)` and a mesh context."""
    given = {}
    for item in rules:
        if len(item) != 2 or not isinstance(item[0], str) or not (item[1] is None or isinstance(item[1], str)):
            raise ValueError(f"rules: each rule must be (logical axis name, mesh axis name or None), got {item!r}")
        given.setdefault(item[0], []).append(item[1])
    out = [tuple(item) for item in rules]
    for name, mesh_axis in get_sharding_map_logic_axis_to_mesh_axis().items():
        if name in given:
            if given[name] != [mesh_axis]:
                raise ValueError(f"rules: {name!r} maps to {given[name]} in the given rules but to {mesh_axis!r} "
                                 "under the current MeshResource")
        else:
            out.append((name, mesh_axis))
    return tuple(out)


def relative_position_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int,
                              bidirectional: bool) -> np.ndarray:
    """T5's bucket of each (query, key) distance, int32 `[q_len, k_len]`: exact buckets for short distances, then
    logarithmic up to `max_distance`; with `bidirectional`, half of the buckets are for keys after the query."""
    distance = np.arange(q_len)[:, None] - np.arange(k_len)[None, :]  # query position - key position
    bucket = np.zeros_like(distance)
    buckets = num_buckets
    if bidirectional:
        buckets //= 2
        bucket += (distance < 0).astype(np.int64) * buckets
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    exact = buckets // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(distance.astype(np.float32) / exact + np.finfo(np.float32).eps)
                         / np.log(max_distance / exact) * (buckets - exact)).astype(np.int32)
    bucket += np.where(distance < exact, distance, np.minimum(large, buckets - 1))
    return bucket.astype(np.int32)


class RelativePositionBiases(nn.Module):
    """T5-style relative position biases for the attention logits: a table "rel_embedding" `[heads, num_buckets]`
    looked up by the bucket of each (query, key) distance. Returns `[1, heads, q_seqlen, k_seqlen]` in `dtype`
    (also the table's dtype, as in Transformer Engine)."""

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., jax.Array] = nn.linear.default_embed_init
    embedding_axes: Tuple[Optional[str], ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        buckets = relative_position_buckets(q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional)
        table = self.param("rel_embedding", nn.with_logical_partitioning(self.embedding_init, self.embedding_axes),
                           (self.num_attention_heads, self.num_buckets), self.dtype)
        return jnp.take(jnp.asarray(table, self.dtype), jnp.asarray(buckets), axis=1)[None]


class TransformerLayerType(Enum):
    """ENCODER: self-attention and MLP. DECODER: self-attention, cross-attention on `encoded`, MLP."""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):
    """A transformer block (Transformer Engine's TransformerLayer): [relative position biases], MultiHeadAttention
    ("attention" for an encoder, "self_attention" for a decoder), dropout and residual, [cross-attention
    "encoder_decoder_attention"], LayerNormMLP ("mlp"), dropout and residual, [LayerNorm "output_layernorm"].
    Projections and the MLP run in FP8 inside an enabled autocast; attention runs in high precision.

    Defaults follow Transformer Engine (causal self-attention, relative position biases on, dropout 0.1 on hidden
    and attention, GELU). dtype: computation dtype (None: the input's); the output has the input's dtype;
    param_dtype: the parameters'. Inputs `[batch, seq, hidden]` (`[seq, batch, hidden]` with
    `transpose_batch_sequence`). Not implemented: the autoregressive cache (`decode=True`) and cuDNN score_mod.
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: Optional[dict] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    relative_embedding: Optional[nn.Module] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = None
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None
    param_dtype: Any = jnp.float32

    def _dropout(self, x: jax.Array, rate: float, dims: Sequence[int], deterministic: bool) -> jax.Array:
        for d in dims:
            if not -x.ndim <= d < x.ndim:
                raise ValueError(f"dropout dims: {d} is out of range for an input of rank {x.ndim}")
        return nn.Dropout(rate=rate, broadcast_dims=tuple(dims), rng_collection=self.dropout_rng_name)(
            x, deterministic=deterministic)

    def _drop_path(self, x: jax.Array, batch_dim: int, deterministic: bool) -> jax.Array:
        if self.drop_path <= 0.0:
            return x
        return self._dropout(x, self.drop_path, [d for d in range(x.ndim) if d != batch_dim], deterministic)

    @nn.compact
    def __call__(self, inputs: jax.Array, encoded: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None, encoder_decoder_mask: Optional[jax.Array] = None,
                 deterministic: bool = False, decode: bool = False, max_decode_length: Optional[int] = None,
                 score_mod_tensors: Optional[Mapping[str, Any]] = None,
                 score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None) -> jax.Array:
        """inputs `[b, s, hidden]`; encoded: the encoder output (DECODER only); attention_mask /
        encoder_decoder_mask `[b, 1, sq, skv]`, True = masked out (used by padding mask types). Returns
        `[b, s, hidden]` in the input's dtype."""
        if not isinstance(self.layer_type, TransformerLayerType):
            raise ValueError(f"layer_type: expected a TransformerLayerType, got {self.layer_type!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                             f"{self.num_attention_heads}")
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"inputs: expected [batch, seq, {self.hidden_size}], got {inputs.shape}")
        encoder = self.layer_type == TransformerLayerType.ENCODER
        if encoder and decode:
            raise ValueError("decode=True needs layer_type=TransformerLayerType.DECODER")
        head_dim = self.hidden_size // self.num_attention_heads
        seq_dim = 0 if self.transpose_batch_sequence else 1
        batch_dim = 1 - seq_dim

        def act_axes(sharded_seq: Optional[bool] = None, hidden=HIDDEN_AXES):
            sharded = self.enable_sequence_parallel if sharded_seq is None else sharded_seq
            axes = [None, None]
            axes[batch_dim], axes[seq_dim] = BATCH_AXES, SEQLEN_TP_AXES if sharded else SEQLEN_AXES
            return (*axes, hidden)

        attn_bias = None
        if self.enable_relative_embedding:
            rel = self.relative_embedding or RelativePositionBiases(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads, dtype=self.param_dtype,
                embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"), name="relpos_bias")
            length = inputs.shape[seq_dim]
            if encoder:
                attn_bias = rel(length, length, True)
            else:
                length = max_decode_length if (decode and max_decode_length) else length
                attn_bias = rel(length, length, False)
        mha = dict(num_attention_heads=self.num_attention_heads, dtype=self.dtype, param_dtype=self.param_dtype,
                   head_dim=head_dim, num_gqa_groups=self.num_gqa_groups,
                   transpose_batch_sequence=self.transpose_batch_sequence,
                   enable_sequence_parallel=self.enable_sequence_parallel, attention_dropout=self.attention_dropout,
                   dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_attention_logits,
                   scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
                   layernorm_type=self.layernorm_type, layernorm_epsilon=self.layernorm_epsilon,
                   zero_centered_gamma=self.zero_centered_gamma,
                   return_layernorm_output=self.apply_residual_connection_post_layernorm,
                   enable_rotary_pos_emb=self.enable_rotary_pos_emb,
                   rotary_pos_emb_windows=self.rotary_pos_emb_windows,
                   rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
                   low_rank_adaptation_scope=self.low_rank_adaptation_scope,
                   low_rank_adaptation_dim=self.low_rank_adaptation_dim,
                   low_rank_adaptation_alpha=self.low_rank_adaptation_alpha, fuse_qkv_params=self.fuse_qkv_params,
                   kernel_init=self.mha_kernel_init, use_bias=self.use_bias, bias_init=self.bias_init,
                   window_size=self.window_size, softmax_type=self.softmax_type)
        x_in = with_sharding_constraint_by_logical_axes(inputs, act_axes())
        x, ln_out = MultiHeadAttention(
            input_layernorm=not self.output_layernorm, attn_mask_type=self.self_attn_mask_type,
            attn_bias_type=self.self_attn_bias_type, score_mod=self.score_mod, score_mod_bprop=self.score_mod_bprop,
            name="attention" if encoder else "self_attention", **mha)(
            x_in, x_in, attention_mask, attn_bias, deterministic=deterministic, decode=decode,
            score_mod_tensors=score_mod_tensors, score_mod_bprop_tensors=score_mod_bprop_tensors)
        x = self._dropout(with_sharding_constraint_by_logical_axes(x, act_axes()), self.hidden_dropout,
                          self.hidden_dropout_dims, deterministic)
        x = self._drop_path(x, batch_dim, deterministic)
        residual = ln_out if self.apply_residual_connection_post_layernorm else x_in
        mlp_input = x + residual.astype(x.dtype)
        if not encoder:
            if encoded is None:
                raise ValueError("encoded: a DECODER TransformerLayer needs the encoder output")
            y, ln_out = MultiHeadAttention(input_layernorm=True, attn_mask_type="padding", attn_bias_type="no_bias",
                                           name="encoder_decoder_attention", **mha)(
                mlp_input, encoded.astype(mlp_input.dtype), encoder_decoder_mask, deterministic=deterministic)
            y = self._dropout(y, self.hidden_dropout, self.hidden_dropout_dims, deterministic)
            residual = ln_out if self.apply_residual_connection_post_layernorm else mlp_input
            mlp_input = y + residual.astype(y.dtype)
        mlp_input = with_sharding_constraint_by_logical_axes(mlp_input, act_axes())
        z, ln_out = LayerNormMLP(
            layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.layernorm_epsilon, return_layernorm_output=self.apply_residual_connection_post_layernorm,
            intermediate_dim=self.mlp_hidden_size, activations=self.mlp_activations,
            activation_params=self.mlp_activation_params, intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=self.intermediate_dropout_dims, dtype=self.dtype,
            param_dtype=self.param_dtype, scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,),
            kernel_init=self.mlp_kernel_init, kernel_axes_1=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
            kernel_axes_2=(W_TP_AXES, W_FSDP_AXES), use_bias=self.use_bias, bias_init=self.bias_init,
            bias_axes_1=(W_JOINED_AXES, W_TP_AXES), bias_axes_2=(W_NO_SHARD_AXES,),
            enable_low_rank_adaptation=lora_scope(self.low_rank_adaptation_scope)[2],
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha, layernorm_input_axes=act_axes(),
            dot_1_input_axes=act_axes(False), dot_2_input_axes=act_axes(False, HIDDEN_TP_AXES),
            transpose_batch_sequence=self.transpose_batch_sequence, name="mlp")(mlp_input, deterministic=deterministic)
        residual = ln_out if self.apply_residual_connection_post_layernorm else mlp_input
        z = self._dropout(with_sharding_constraint_by_logical_axes(z, act_axes()), self.hidden_dropout,
                          self.hidden_dropout_dims, deterministic)
        z = self._drop_path(z, batch_dim, deterministic)
        z = z + residual.astype(z.dtype)
        if self.output_layernorm:
            z = LayerNorm(layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
                          epsilon=self.layernorm_epsilon, scale_axes=(W_NO_SHARD_AXES,), bias_axes=(W_NO_SHARD_AXES,),
                          dtype=self.dtype, param_dtype=self.param_dtype, name="output_layernorm")(z)
        return z.astype(inputs.dtype)
