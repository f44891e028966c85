"""`DotProductAttention`: softmax attention in high precision (no FP8), with Transformer Engine's arguments.

Logits `q . k` are computed with float32 accumulation and the softmax in float32; the attention weights are
rounded to the input dtype before they multiply the values (float32 accumulation again). Masks: "no_mask",
"padding" (the caller's mask, True = masked out), "causal" (top-left aligned), "causal_bottom_right",
"padding_causal" / "causal_padding", "padding_causal_bottom_right"; `window_size=(left, right)` keeps keys j with
i - left <= j <= i + right (negative: unbounded). Grouped-query attention when there are fewer key/value heads
than query heads (query head i uses key/value head i // (heads / kv_heads)). A fully masked row gets uniform
weights (masked logits are float32's lowest value, as in flax).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ..sharding import HEAD_AXES
from .base import with_axes

__all__ = ["DotProductAttention", "canonicalize_mask_type", "attention_keep_mask"]

_MASK_TYPES = {
    "no_mask": (False, False, False), "padding": (True, False, False), "causal": (False, True, False),
    "causal_bottom_right": (False, True, True), "bottom_right_causal": (False, True, True),
    "padding_causal": (True, True, False), "causal_padding": (True, True, False),
    "padding_causal_bottom_right": (True, True, True), "causal_padding_bottom_right": (True, True, True),
    "bottom_right_causal_padding": (True, True, True), "bottom_right_padding_causal": (True, True, True),
}
_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "off_by_one", "learnable")


def canonicalize_mask_type(attn_mask_type: str) -> Tuple[bool, bool, bool]:
    """(padding, causal, bottom_right) for a mask type name; ValueError for an unknown name."""
    key = str(attn_mask_type).lower()
    if key not in _MASK_TYPES:
        raise ValueError(f"attn_mask_type: expected one of {sorted(_MASK_TYPES)}, got {attn_mask_type!r}")
    return _MASK_TYPES[key]


def attention_keep_mask(mask_type: str, sq: int, skv: int, mask: Optional[jax.Array],
                        window_size: Optional[Tuple[int, int]]) -> Optional[jax.Array]:
    """Boolean `[b or 1, h or 1, sq, skv]` mask of the logits to keep (None: keep all)."""
    padding, causal, bottom_right = canonicalize_mask_type(mask_type)
    keep = None
    if padding:
        if mask is None:
            raise ValueError(f"attn_mask_type={mask_type!r} needs a mask [batch, 1, {sq}, {skv}] (True = masked out)")
        keep = jnp.logical_not(jnp.asarray(mask, bool))
    i = jnp.arange(sq)[:, None] + (skv - sq if bottom_right else 0)
    j = jnp.arange(skv)[None, :]
    positional = None
    if causal:
        positional = j <= i
    if window_size is not None:
        left, right = window_size
        in_window = jnp.ones((sq, skv), bool)
        if left >= 0:
            in_window &= j >= i - left
        if right >= 0:
            in_window &= j <= i + right
        positional = in_window if positional is None else positional & in_window
    if positional is not None:
        keep = positional[None, None] if keep is None else keep & positional[None, None]
    return keep


class _UnfusedDotProductAttention(nn.Module):
    """The computation (named as Transformer Engine's, so that a learnable softmax offset lands at the same path)."""

    attention_dropout: float
    attn_mask_type: str
    attn_bias_type: str
    scale_factor: float
    window_size: Optional[Tuple[int, int]]
    softmax_type: str
    default_scale: bool

    @nn.compact
    def __call__(self, query, key, value, mask, bias, dropout_rng, deterministic):
        b, sq, h, d = query.shape
        skv, hkv = key.shape[1], key.shape[2]
        dtype = query.dtype
        group = h // hkv
        if self.default_scale:
            query = query / jnp.sqrt(d).astype(dtype)
        q = query.reshape(b, sq, hkv, group, d)
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=jnp.float32).reshape(b, h, sq, skv)
        if self.attn_bias_type == "pre_scale_bias":
            logits = logits + bias.astype(jnp.float32)
        if not self.default_scale:
            logits = logits * jnp.float32(self.scale_factor)
        if self.attn_bias_type == "post_scale_bias":
            logits = logits + bias.astype(jnp.float32)
        keep = attention_keep_mask(self.attn_mask_type, sq, skv, mask, self.window_size)
        if keep is not None:
            logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
        if self.softmax_type == "vanilla":
            weights = jax.nn.softmax(logits, axis=-1)
        else:  # an extra logit in the denominator: 0 (off-by-one) or a learned one per head
            if self.softmax_type == "learnable":
                offset = self.param("softmax_offset", with_axes(nn.initializers.zeros, (None, HEAD_AXES, None, None)),
                                    (1, h, 1, 1), jnp.float32)
            else:
                offset = jnp.zeros((1, h, 1, 1), jnp.float32)
            extra = jnp.broadcast_to(offset, (b, h, sq, 1))
            weights = jax.nn.softmax(jnp.concatenate([logits, extra], axis=-1), axis=-1)[..., :skv]
        weights = weights.astype(dtype)
        if not deterministic and self.attention_dropout > 0.0:
            keep_prob = 1.0 - self.attention_dropout
            kept = jax.random.bernoulli(dropout_rng, keep_prob, weights.shape)
            weights = weights * (kept.astype(dtype) / jnp.asarray(keep_prob, dtype))
        weights = weights.reshape(b, hkv, group, sq, skv)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, value, preferred_element_type=jnp.float32)
        return out.reshape(b, sq, h, value.shape[-1]).astype(dtype)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention over `[batch, seq, heads, head_dim]` inputs (`[seq, batch, ...]` with
    `transpose_batch_sequence`), in high precision. See the module docstring for masks and GQA.

    qkv_layout: "bshd_bshd_bshd" (separate q, k, v), "bs3hd" (query is `[b, s, 3, h, d]`; key and value ignored),
    "bshd_bs2hd" (key is `[b, s, 2, h_kv, d]`; value ignored). scale_factor: None means 1/sqrt(head_dim).
    attn_bias_type: None picks "post_scale_bias" when a bias is given, else "no_bias". softmax_type: "vanilla",
    "off-by-one" (1 added to the denominator) or "learnable" (a "softmax_offset" parameter `[1, h, 1, 1]`).
    Dropout on the weights (`attention_dropout`) uses the `dropout_rng_name` rng unless `deterministic`.
    Sequence packing (THD layouts, `max_segments_per_seq > 1`), context parallelism and cuDNN score_mod are not
    implemented (a clear error); `float32_logits` is always in effect.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: Optional[float] = None
    transpose_batch_sequence: Optional[bool] = None
    window_size: Optional[Tuple[int, int]] = None
    max_segments_per_seq: Optional[int] = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None

    def _check(self, score_mod_tensors, score_mod_bprop_tensors) -> None:
        if self.score_mod is not None or self.score_mod_bprop is not None or score_mod_tensors is not None \
                or score_mod_bprop_tensors is not None:
            raise NotImplementedError("DotProductAttention: score_mod (a cuDNN frontend feature) is not implemented")
        if self.context_parallel_axis:
            raise NotImplementedError("DotProductAttention: context parallelism is not implemented")
        if self.max_segments_per_seq not in (None, 1):
            raise NotImplementedError("DotProductAttention: sequence packing (max_segments_per_seq > 1) is not "
                                      "implemented")
        if self.softmax_type.lower() not in _SOFTMAX_TYPES:
            raise ValueError(f"softmax_type: expected 'vanilla', 'off-by-one' or 'learnable', got "
                             f"{self.softmax_type!r}")
        canonicalize_mask_type(self.attn_mask_type)

    def _unpack(self, query, key, value):
        layout = self.qkv_layout.lower()
        if layout == "bs3hd":
            return query[..., 0, :, :], query[..., 1, :, :], query[..., 2, :, :]
        if layout == "bshd_bs2hd":
            return query, key[..., 0, :, :], key[..., 1, :, :]
        if layout == "bshd_bshd_bshd":
            return query, key, value
        raise NotImplementedError(f"qkv_layout={self.qkv_layout!r}: only 'bs3hd', 'bshd_bs2hd' and "
                                  "'bshd_bshd_bshd' are implemented (THD sequence packing is not)")

    @nn.compact
    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array,
                 sequence_descriptor: Optional[jax.Array] = None, bias: Optional[jax.Array] = None, *,
                 deterministic: bool = False, mask: Optional[jax.Array] = None,
                 score_mod_tensors: Optional[Mapping[str, Any]] = None,
                 score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None) -> jax.Array:
        """query/key/value as `qkv_layout` says; mask (or `sequence_descriptor`) `[b, 1, sq, skv]`, True = masked
        out; bias broadcastable to `[b, h, sq, skv]`. Returns `[b, sq, h, head_dim]` in the query's dtype."""
        self._check(score_mod_tensors, score_mod_bprop_tensors)
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError("DotProductAttention: pass the mask as sequence_descriptor or mask, not both")
            sequence_descriptor = mask
        if sequence_descriptor is not None and not isinstance(sequence_descriptor, (jax.Array, np.ndarray)):
            raise NotImplementedError("DotProductAttention: only an array mask is supported as sequence_descriptor")
        if self.dtype is not None and jnp.dtype(self.dtype) != query.dtype:
            raise ValueError(f"DotProductAttention: dtype={self.dtype} (deprecated) differs from the inputs' "
                             f"{query.dtype}; drop the argument")
        query, key, value = self._unpack(query, key, value)
        if self.transpose_batch_sequence:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise ValueError(f"DotProductAttention: q, k, v dtypes differ ({query.dtype}, {key.dtype}, {value.dtype})")
        h, hkv = query.shape[-2], key.shape[-2]
        groups = self.num_gqa_groups or self.num_attention_heads
        if h != self.num_attention_heads or hkv != groups or value.shape[-2] != hkv or h % hkv:
            raise ValueError(f"DotProductAttention: num_attention_heads={self.num_attention_heads}, "
                             f"num_gqa_groups={groups} do not match query heads {h}, key/value heads {hkv}, "
                             f"{value.shape[-2]}")
        bias_type = self.attn_bias_type or ("no_bias" if bias is None else "post_scale_bias")
        if bias_type.lower() not in _BIAS_TYPES:
            raise ValueError(f"attn_bias_type: expected one of {_BIAS_TYPES}, got {self.attn_bias_type!r}")
        if (bias is None) != (bias_type.lower() == "no_bias"):
            raise ValueError(f"DotProductAttention: attn_bias_type={bias_type!r} but bias is "
                             f"{'missing' if bias is None else 'given'}")
        dropout_rng = None
        if not deterministic and self.attention_dropout > 0.0:
            dropout_rng = self.make_rng(self.dropout_rng_name)
        # 1/sqrt(head_dim) divides the query, as flax's dot_product_attention does (except with a pre-scale bias)
        default_scale = self.scale_factor is None and bias_type.lower() != "pre_scale_bias"
        scale = 1.0 / math.sqrt(query.shape[-1]) if self.scale_factor is None else float(self.scale_factor)
        softmax_type = self.softmax_type.lower().replace("_", "-")
        out = _UnfusedDotProductAttention(self.attention_dropout, self.attn_mask_type, bias_type.lower(), scale,
                                          self.window_size, softmax_type, default_scale)(
            query, key, value, sequence_descriptor, bias, dropout_rng, deterministic)
        if self.transpose_batch_sequence:
            out = jnp.swapaxes(out, 0, 1)
        return checkpoint_name(out, self.context_checkpoint_name)
