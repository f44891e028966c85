"""What DotProductAttention's forward arguments describe: the query/key/value tensors validated and brought to the
batch-first padded layout `[b, s, heads, dim]`, the padding of each side, a user mask, and the KV cache step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .layouts import PackedIndex, packed_index, to_batch_first
from .masks import (
    allowed_positions,
    check_arbitrary_mask,
    padding_from_cu_seqlens,
    padding_from_mask,
)

__all__ = ["AttentionInputs", "prepare_inputs"]


@dataclass
class AttentionInputs:
    q: torch.Tensor  # [b, sq, h, d]
    k: torch.Tensor  # [b, skv, g, d]
    v: torch.Tensor  # [b, skv, g, dv]
    mask_type: str
    out_format: str  # "sbhd" or "bshd" (a "thd" output is scattered back through packed_q)
    pad_q: Optional[torch.Tensor] = None  # [b, sq], True = padded
    pad_kv: Optional[torch.Tensor] = None
    masked: Optional[torch.Tensor] = None  # 4-D user mask, True = masked out
    packed_q: Optional[PackedIndex] = None

    def allowed(self, window: Tuple[int, int], bottom_right: bool):
        """(boolean allowed-positions mask or None, whether torch's top-left causal flag does the job instead)."""
        sq, skv = self.q.shape[1], self.k.shape[1]
        plain = window[0] < 0 and self.masked is None and self.pad_q is None
        if plain and (self.mask_type == "causal" or (self.mask_type == "causal_bottom_right" and sq == skv)):
            return None, True
        return allowed_positions(sq, skv, self.mask_type, window, bottom_right, self.pad_q, self.pad_kv, self.masked,
                                 self.q.device), False

    def causal_as_mask(self) -> torch.Tensor:
        return allowed_positions(self.q.shape[1], self.k.shape[1], "causal", (-1, 0), False, None, None, None,
                                 self.q.device)

    def real_lengths(self):
        """The real sequence lengths `[b]` of queries and keys under padding, else (None, None)."""
        if self.pad_q is None or self.pad_kv is None:
            return None, None
        return (~self.pad_q).sum(-1), (~self.pad_kv).sum(-1)


def _unpack(q, k, v, qkv_layer, kv_layer, dim):
    if qkv_layer is None and kv_layer is None:
        return q, k, v
    if dim not in (-3, -2):
        raise ValueError(f"qkv_interleave_dim must be -3 or -2, got {dim!r}")
    if qkv_layer is not None:
        if any(t is not None for t in (q, k, v, kv_layer)):
            raise ValueError("qkv_layer replaces query_layer, key_layer, value_layer and kv_layer: give it alone")
        if qkv_layer.shape[dim] != 3:
            raise ValueError(f"qkv_layer must have 3 entries at dim {dim}, got shape {list(qkv_layer.shape)}")
        return qkv_layer.unbind(dim)
    if k is not None or v is not None or q is None:
        raise ValueError("kv_layer replaces key_layer and value_layer: give query_layer and kv_layer")
    if kv_layer.shape[dim] != 2:
        raise ValueError(f"kv_layer must have 2 entries at dim {dim}, got shape {list(kv_layer.shape)}")
    k, v = kv_layer.unbind(dim)
    return q, k, v


def _check_tensors(module, fmt, q, k, v):
    names = ("query_layer", "key_layer", "value_layer")
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"DotProductAttention: {name} must be a floating tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"DotProductAttention: query, key and value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"DotProductAttention: query, key and value are on {q.device}, {k.device}, {v.device}")
    dims = 3 if fmt == "thd" else 4
    layout = "[t, h, d]" if fmt == "thd" else f"[{', '.join(fmt)}]"
    for name, t in zip(names, (q, k, v)):
        if t.dim() != dims:
            raise ValueError(f"DotProductAttention: {name} must be {dims}-D {layout} for qkv_format={fmt!r}, got "
                             f"shape {list(t.shape)}")
    heads, groups = module.num_attention_heads_per_partition, module.num_gqa_groups_per_partition
    if q.shape[-2] != heads:
        raise ValueError(f"DotProductAttention: query_layer has {q.shape[-2]} heads, expected num_attention_heads"
                         f"{' / tp_size' if module.tp_size > 1 else ''} = {heads}")
    if k.shape[-2] != groups or v.shape[-2] != groups:
        raise ValueError(f"DotProductAttention: key_layer / value_layer have {k.shape[-2]} / {v.shape[-2]} heads, "
                         f"expected num_gqa_groups{' / tp_size' if module.tp_size > 1 else ''} = {groups}")
    if q.shape[-1] != module.hidden_size_per_attention_head_k or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"DotProductAttention: query / key head sizes {q.shape[-1]} / {k.shape[-1]} must equal "
                         f"kv_channels = {module.hidden_size_per_attention_head_k}")
    if v.shape[-1] != module.hidden_size_per_attention_head_v:
        raise ValueError(f"DotProductAttention: value head size {v.shape[-1]} must equal "
                         f"{module.hidden_size_per_attention_head_v}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"DotProductAttention: key_layer {list(k.shape)} and value_layer {list(v.shape)} differ in "
                         "their leading dimensions")
    if fmt != "thd":
        batch_dim = 1 if fmt == "sbhd" else 0
        if q.shape[batch_dim] != k.shape[batch_dim]:
            raise ValueError(f"DotProductAttention: query batch {q.shape[batch_dim]} != key batch "
                             f"{k.shape[batch_dim]} ({fmt})")


def _padding(module, mask, cu_q, cu_kv, b, sq, skv, device):
    if mask is not None:
        if isinstance(mask, (tuple, list)):
            if len(mask) != 2:
                raise ValueError("attention_mask: a padding mask pair is (query mask, key mask), got "
                                 f"{len(mask)} entries")
            return (padding_from_mask(mask[0], b, sq, "attention_mask[0]", device),
                    padding_from_mask(mask[1], b, skv, "attention_mask[1]", device))
        if module.attention_type == "cross" or sq != skv:
            raise ValueError("attention_mask: cross-attention (or seqlen_q != seqlen_kv) needs a pair of padding "
                             "masks ([b, 1, 1, seqlen_q], [b, 1, 1, seqlen_kv])")
        pad = padding_from_mask(mask, b, sq, "attention_mask", device)
        return pad, pad
    if cu_q is None and cu_kv is None:
        raise ValueError("a padding attn_mask_type needs attention_mask ([b, 1, 1, s], True = padded) or "
                         "cu_seqlens_q / cu_seqlens_kv")
    if cu_kv is None or cu_q is None:
        if sq != skv:
            raise ValueError("give both cu_seqlens_q and cu_seqlens_kv when seqlen_q != seqlen_kv")
        cu_q = cu_kv = cu_q if cu_q is not None else cu_kv
    return (padding_from_cu_seqlens(cu_q, b, sq, "cu_seqlens_q", device),
            padding_from_cu_seqlens(cu_kv, b, skv, "cu_seqlens_kv", device))


def prepare_inputs(module, fmt, mask_type, q, k, v, qkv_layer, kv_layer, interleave_dim, attention_mask, cu_q, cu_kv,
                   cu_q_pad, cu_kv_pad, max_q, max_kv, inference_params, pad_between_seqs) -> AttentionInputs:
    """Validate DotProductAttention's inputs and describe them as AttentionInputs."""
    q, k, v = _unpack(q, k, v, qkv_layer, kv_layer, interleave_dim)
    _check_tensors(module, fmt, q, k, v)
    if inference_params is not None:
        return _inference_inputs(module, fmt, mask_type, q, k, v, attention_mask, inference_params)
    if fmt == "thd":
        if "padding" not in mask_type:
            raise ValueError(f"qkv_format='thd' needs a padding attn_mask_type ('padding', 'padding_causal', "
                             f"'padding_causal_bottom_right'), got {mask_type!r}")
        if attention_mask is not None:
            raise ValueError("attention_mask is not used with qkv_format='thd': cu_seqlens_q / cu_seqlens_kv give "
                             "the sequences")
        if cu_q is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_q (and cu_seqlens_kv for cross-attention)")
        if pad_between_seqs is False:
            cu_q_pad = cu_kv_pad = None
        if cu_kv is None:
            cu_kv, cu_kv_pad, max_kv = cu_q, cu_q_pad, max_q
        index_q = packed_index(cu_q, cu_q_pad, q.shape[0], max_q, "cu_seqlens_q", q.device)
        index_kv = packed_index(cu_kv, cu_kv_pad, k.shape[0], max_kv, "cu_seqlens_kv", q.device)
        if index_q.index.shape[0] != index_kv.index.shape[0]:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_kv describe {index_q.index.shape[0]} and "
                             f"{index_kv.index.shape[0]} sequences")
        return AttentionInputs(index_q.gather(q), index_kv.gather(k), index_kv.gather(v), mask_type, "bshd",
                               ~index_q.valid, ~index_kv.valid, None, index_q)
    if cu_q_pad is not None or cu_kv_pad is not None:
        raise ValueError("cu_seqlens_q_padded / cu_seqlens_kv_padded apply to qkv_format='thd' only")
    qb, kb, vb = (to_batch_first(x, fmt) for x in (q, k, v))
    b, sq, skv = qb.shape[0], qb.shape[1], kb.shape[1]
    inputs = AttentionInputs(qb, kb, vb, mask_type, fmt)
    if "padding" in mask_type:
        inputs.pad_q, inputs.pad_kv = _padding(module, attention_mask, cu_q, cu_kv, b, sq, skv, qb.device)
        return inputs
    if cu_q is not None or cu_kv is not None:
        raise ValueError(f"cu_seqlens_q / cu_seqlens_kv describe padding, which attn_mask_type={mask_type!r} does "
                         "not use: choose a padding mask type")
    if attention_mask is not None:
        inputs.masked = check_arbitrary_mask(attention_mask, (b, qb.shape[2], sq, skv))
    elif mask_type == "arbitrary":
        raise ValueError("attn_mask_type='arbitrary' needs attention_mask (broadcastable to [b, h, sq, skv], "
                         "True = masked out)")
    return inputs


def _inference_inputs(module, fmt, mask_type, q, k, v, attention_mask, params) -> AttentionInputs:
    if "padding" not in mask_type:
        raise ValueError(f"KV caching (inference_params) needs a padding attn_mask_type ('padding', "
                         f"'padding_causal', 'padding_causal_bottom_right'), got {mask_type!r}")
    if attention_mask is not None:
        raise ValueError("attention_mask is not used with inference_params: InferenceParams.pre_step gives the "
                         "sequence lengths")
    if mask_type == "padding_causal":  # the new tokens follow the cached ones: align the diagonal bottom-right
        mask_type = "padding_causal_bottom_right"
    k_cache, v_cache, cu_q, cu_kv, _, _ = params.step(module.layer_number, k, v, fmt)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"InferenceParams(dtype={k_cache.dtype}) holds a cache of another dtype than the attention's "
                        f"inputs ({q.dtype})")
    batch = k_cache.shape[0]
    packed = None
    if fmt == "thd":
        packed = packed_index(cu_q[:batch + 1], None, q.shape[0], None, "InferenceParams.cu_seqlens_q", q.device)
        qb, pad_q = packed.gather(q), ~packed.valid
    else:
        qb = to_batch_first(q, fmt)
        if qb.shape[0] != batch:
            raise ValueError(f"DotProductAttention: the query batch ({qb.shape[0]}) differs from the sequences "
                             f"InferenceParams.pre_step announced ({batch})")
        pad_q = padding_from_cu_seqlens(cu_q, batch, qb.shape[1], "InferenceParams.cu_seqlens_q", q.device)
    pad_kv = padding_from_cu_seqlens(cu_kv, batch, k_cache.shape[1], "InferenceParams.cu_seqlens_kv", q.device)
    return AttentionInputs(qb, k_cache, v_cache, mask_type, "bshd" if fmt == "thd" else fmt, pad_q, pad_kv, None,
                           packed)
