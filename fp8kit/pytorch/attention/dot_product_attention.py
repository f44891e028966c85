"""DotProductAttention: Transformer Engine's core attention module (no projections), with its signature, defaults and
mask conventions (fp8kit.pytorch.attention.masks), on `torch.nn.functional.scaled_dot_product_attention`.

The core runs in the inputs' precision also inside `fp8kit.pytorch.autocast`: FP8 attention (`fp8_dpa`, `fp8_mha`)
is not implemented and raises NotImplementedError."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch

from ..autocast import current_frame
from ..checkpoint import checkpoint
from .bias import attention_bias
from .core import attend
from .inputs import prepare_inputs
from .layouts import check_qkv_format, output_from_batch_first
from .masks import bottom_right_alignment, canonical_mask_type, checked_window_size
from .parallel import GroupRef, positive_int, split_count, tensor_parallel_size

__all__ = ["DotProductAttention"]

_ATTENTION_TYPES = ("self", "cross")


class DotProductAttention(torch.nn.Module):
    """`softmax(Q K^T * softmax_scale, masked) V` over heads (Transformer Engine's `DotProductAttention`).

    Args (Transformer Engine's, in its order):
      num_attention_heads: query heads (in total; each tensor-parallel rank gets num_attention_heads / tp_size).
      kv_channels: the head size, or (key head size, value head size).
      num_gqa_groups: key/value heads (grouped-query attention; 1 is multi-query; None: num_attention_heads).
      attention_dropout: dropout on the attention probabilities (training mode only).
      qkv_format: "sbhd", "bshd" or "thd" (see fp8kit.pytorch.attention.layouts).
      attn_mask_type: "no_mask", "causal", "padding", "padding_causal", "causal_bottom_right",
        "padding_causal_bottom_right" or "arbitrary" (see fp8kit.pytorch.attention.masks); forward can override.
      window_size: sliding window (left, right); None: the mask type's default.
      bottom_right_diagonal: align the window's diagonal to the bottom-right corner (None: True except for
        "causal" and "padding_causal").
      sequence_parallel, tp_size, tp_group: tensor parallelism (this module holds the local heads).
      get_rng_state_tracker: a callable returning a CudaRNGStatesTracker; the dropout runs under its default state
        (not with sequence parallelism), as in Transformer Engine.
      layer_number: the layer's number (>= 1; the key of its KV cache in InferenceParams).
      attention_type: "self" or "cross" (cross-attention takes a tuple of two padding masks).
      cp_group, cp_global_ranks, cp_stream, cp_comm_type: context parallelism, not implemented (cp_group must be
        None).
      softmax_scale: default 1 / sqrt(key head size).
      softmax_type: "vanilla" only ("off-by-one" and "learnable" sink attention are not implemented).
      return_max_logit: not implemented (False only).
      name: the module's name.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group=None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
        name: Optional[str] = None,
    ):
        super().__init__()
        where = "DotProductAttention"
        self.num_attention_heads = positive_int(where, "num_attention_heads", num_attention_heads)
        if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2:
            head_k, head_v = kv_channels
        else:
            head_k = head_v = kv_channels
        self.hidden_size_per_attention_head_k = positive_int(where, "kv_channels", head_k)
        self.hidden_size_per_attention_head_v = positive_int(where, "kv_channels", head_v)
        self.num_gqa_groups = positive_int(where, "num_gqa_groups", num_gqa_groups, allow_none=True) \
            or self.num_attention_heads
        if self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"{where}: num_gqa_groups={self.num_gqa_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if isinstance(attention_dropout, bool) or not isinstance(attention_dropout, (int, float)) \
                or not 0.0 <= attention_dropout <= 1.0:
            raise ValueError(f"{where}: attention_dropout must be a probability in [0, 1], got {attention_dropout!r}")
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = check_qkv_format(qkv_format)
        self.attn_mask_type = canonical_mask_type(attn_mask_type)
        self.window_size = checked_window_size(self.attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        if attention_type not in _ATTENTION_TYPES:
            raise ValueError(f"{where}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.attention_type = attention_type
        self.tp_size = tensor_parallel_size(where, tp_group, tp_size)
        self._tp = GroupRef(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.num_attention_heads_per_partition = split_count(where, "num_attention_heads", self.num_attention_heads,
                                                             self.tp_size)
        self.num_gqa_groups_per_partition = split_count(where, "num_gqa_groups", self.num_gqa_groups, self.tp_size)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else positive_int(where, "layer_number", layer_number)
        if cp_group is not None:
            raise NotImplementedError(f"{where}: context parallelism (cp_group) is not implemented in fp8kit")
        self.cp_global_ranks, self.cp_stream, self.cp_comm_type = cp_global_ranks, cp_stream, cp_comm_type
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head_k)
        self.softmax_scale = float(softmax_scale)
        if softmax_type != "vanilla":
            raise NotImplementedError(f"{where}: softmax_type={softmax_type!r} (sink attention) is not implemented; "
                                      "use 'vanilla'")
        self.softmax_type = softmax_type
        if return_max_logit:
            raise NotImplementedError(f"{where}: return_max_logit=True is not implemented")
        self.return_max_logit = False
        self.name = name

    @property
    def tp_group(self):
        return self._tp.group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supply the tensor-parallel group of a module built with `tp_size` (its size must match)."""
        size = tensor_parallel_size("DotProductAttention", tp_group, self.tp_size)
        if tp_group is not None and size != self.tp_size:
            raise ValueError(f"DotProductAttention.set_tensor_parallel_group: the group has {size} ranks, the module "
                             f"was built for tp_size={self.tp_size}")
        self._tp = GroupRef(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        if cp_group is not None:
            raise NotImplementedError("DotProductAttention: context parallelism is not implemented in fp8kit")

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels="
                f"{self.hidden_size_per_attention_head_k}, num_gqa_groups={self.num_gqa_groups}, "
                f"qkv_format={self.qkv_format}, attn_mask_type={self.attn_mask_type}, "
                f"attention_dropout={self.attention_dropout}")

    def forward(
        self,
        query_layer: Optional[torch.Tensor] = None,
        key_layer: Optional[torch.Tensor] = None,
        value_layer: Optional[torch.Tensor] = None,
        attention_mask=None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        bf16_backward: Optional[bool] = False,
        num_splits: Optional[int] = 1,
        score_mod: Optional[Callable] = None,
        score_mod_bprop: Optional[Callable] = None,
        score_mod_tensors=None,
        score_mod_bprop_tensors=None,
        qkv_layer: Optional[torch.Tensor] = None,
        kv_layer: Optional[torch.Tensor] = None,
        qkv_interleave_dim: int = -3,
    ) -> torch.Tensor:
        """Attention of `query_layer` over `key_layer` / `value_layer` in `qkv_format` (default: the module's).

        Returns `[sq, b, h * dv]` ("sbhd"), `[b, sq, h * dv]` ("bshd") or `[t, h * dv]` ("thd"). attention_mask:
        True = masked out; `[b, 1, 1, s]` for padding (a tuple of two for cross-attention; or give cu_seqlens_q /
        cu_seqlens_kv instead), broadcastable to `[b, h, sq, skv]` for "arbitrary". With a "causal" or "no_mask"
        type a given mask is applied on top (as Transformer Engine's unfused backend does). qkv_layer / kv_layer:
        packed tensors with the 3 (or 2) at `qkv_interleave_dim` (-3 or -2), instead of separate tensors.
        checkpoint_core_attention: recompute the core in backward (fp8kit.pytorch.checkpoint). inference_params:
        an InferenceParams (KV cache; padding mask types only). Transformer Engine's fast_zero_fill, num_splits and
        bf16_backward are kernel options with no effect here; score_mod (cuDNN flex attention) and fp8_output are
        not implemented."""
        frame = current_frame()
        if fp8_output or (frame is not None and frame.enabled and (getattr(frame.recipe, "fp8_dpa", False)
                                                                   or getattr(frame.recipe, "fp8_mha", False))):
            raise NotImplementedError("DotProductAttention: FP8 attention (fp8_dpa / fp8_mha / fp8_output) is not "
                                      "implemented in fp8kit; the attention core runs in high precision")
        if score_mod is not None or score_mod_bprop is not None or score_mod_tensors is not None \
                or score_mod_bprop_tensors is not None:
            raise NotImplementedError("DotProductAttention: score_mod (cuDNN flex attention) is not implemented")
        mask_type = self.attn_mask_type if attn_mask_type is None else canonical_mask_type(attn_mask_type)
        window = checked_window_size(mask_type, self.window_size if window_size is None else window_size)
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        fmt = check_qkv_format(self.qkv_format if qkv_format is None else qkv_format)
        inputs = prepare_inputs(
            self, fmt, mask_type, query_layer, key_layer, value_layer, qkv_layer, kv_layer, qkv_interleave_dim,
            attention_mask, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
            max_seqlen_kv, inference_params, pad_between_seqs)
        if inputs.mask_type != mask_type:  # KV caching turns "padding_causal" into "padding_causal_bottom_right"
            mask_type, bottom_right_diagonal = inputs.mask_type, True
        bottom_right = bottom_right_alignment(mask_type, bottom_right_diagonal)
        allowed, is_causal = inputs.allowed(window, bottom_right)
        q, k, v = (x.transpose(1, 2) for x in (inputs.q, inputs.k, inputs.v))  # [b, heads, s, d]
        bias = attention_bias(core_attention_bias_type, core_attention_bias, alibi_slopes,
                              (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), self.softmax_scale, bottom_right,
                              *inputs.real_lengths(), q.dtype, q.device)
        if bias is not None and is_causal:
            allowed, is_causal = inputs.causal_as_mask(), False
        options = dict(allowed=allowed, bias=bias, is_causal=is_causal,
                       dropout_p=self.attention_dropout if self.training else 0.0, scale=self.softmax_scale,
                       dropout_context=self._dropout_context())
        if checkpoint_core_attention:
            out = checkpoint(attend, q, k, v, distribute_saved_activations=False,
                             get_rng_state_tracker=self.get_rng_state_tracker, tp_group=self.tp_group, **options)
        else:
            out = attend(q, k, v, **options)
        if inputs.packed_q is not None:
            out = inputs.packed_q.scatter(out.transpose(1, 2))
            return out.reshape(out.shape[0], -1)
        return output_from_batch_first(out, inputs.out_format)

    def _dropout_context(self):
        if self.get_rng_state_tracker is None or self.sequence_parallel or self.attention_dropout == 0:
            return None
        return self.get_rng_state_tracker().fork
