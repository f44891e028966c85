"""MultiheadAttention: Transformer Engine's attention block (QKV projection, rotary embedding, core attention, output
projection) with its signature, defaults, submodule and parameter names. The projections are fp8kit's
LayerNormLinear / Linear (FP8 GEMMs inside `fp8kit.pytorch.autocast`); the core is DotProductAttention."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch

from ..modules import LayerNormLinear, Linear
from .dot_product_attention import DotProductAttention
from .layouts import check_qkv_format
from .parallel import positive_int, tensor_parallel_size
from .qkv import qk_norms, split_kv, split_qkv
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention"]


class MultiheadAttention(torch.nn.Module):
    """Multi-head (grouped-query) attention with its projections (Transformer Engine's `MultiheadAttention`).

    Submodules (Transformer Engine's names): self-attention `layernorm_qkv` (LayerNormLinear, with
    `input_layernorm=True`) or `qkv` (Linear); cross-attention `layernorm_query` or `query_layer`, and `key_value`;
    then `core_attention` (DotProductAttention) and `proj` (Linear). With `fuse_qkv_params=False` (the default)
    the QKV weight is split into `query_weight`, `key_weight`, `value_weight` (and biases); with True it is one
    `weight`, laid out per `qkv_weight_interleaved` (see fp8kit.pytorch.attention.qkv).

    Args: Transformer Engine's (hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
    init_method, output_layer_init_method, layer_number, attn_mask_type, window_size, bottom_right_diagonal,
    tp_group, tp_size, num_gqa_groups, fuse_wgrad_accumulation, get_rng_state_tracker, sequence_parallel,
    params_dtype, return_bias, return_layernorm_output, input_layernorm, attention_type, set_parallel_mode,
    fuse_qkv_params, zero_centered_gamma, qkv_weight_interleaved, rotary_pos_interleaved, ub_* (accepted, no
    effect), bias, normalization, device (default: torch's default device), qkv_format, name, qk_norm_type,
    qk_norm_eps, qk_norm_before_rope, seq_length, micro_batch_size (accepted; no JIT warm-up needed),
    softmax_type ("vanilla" only)). Tensor parallelism needs `set_parallel_mode=True`: QKV column-parallel, `proj`
    row-parallel, each rank holding num_attention_heads / tp_size heads.

    forward returns the output, then the projection's bias if `return_bias`, then the norm's output if
    `input_layernorm and return_layernorm_output`.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels: Optional[int] = None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                 tp_group=None, tp_size: int = 1, num_gqa_groups: Optional[int] = None,
                 fuse_wgrad_accumulation: bool = False, get_rng_state_tracker: Optional[Callable] = None,
                 sequence_parallel: bool = False, params_dtype: Optional[torch.dtype] = None,
                 return_bias: bool = False, return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 rotary_pos_interleaved: bool = False, ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 bias: bool = True, normalization: str = "LayerNorm", device=None, qkv_format: str = "sbhd",
                 name: Optional[str] = None, qk_norm_type: Optional[str] = None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, softmax_type: str = "vanilla"):
        super().__init__()
        where = "MultiheadAttention"
        hidden_size = positive_int(where, "hidden_size", hidden_size)
        num_attention_heads = positive_int(where, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"{where}: num_attention_heads={num_attention_heads} does not divide hidden_size="
                                 f"{hidden_size} (or give kv_channels)")
            kv_channels = hidden_size // num_attention_heads
        kv_channels = positive_int(where, "kv_channels", kv_channels)
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else positive_int(
            where, "num_gqa_groups", num_gqa_groups)
        if num_attention_heads % num_gqa_groups:
            raise ValueError(f"{where}: num_gqa_groups={num_gqa_groups} must divide num_attention_heads="
                             f"{num_attention_heads}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{where}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.qkv_format = check_qkv_format(qkv_format)
        self.tp_size = tensor_parallel_size(where, tp_group, tp_size)
        if self.tp_size > 1 and not set_parallel_mode:
            raise ValueError(f"{where}: tensor parallelism (tp_size={self.tp_size}) splits the heads over the ranks: "
                             "set set_parallel_mode=True (QKV column-parallel, proj row-parallel)")
        self.hidden_size, self.num_attention_heads, self.num_gqa_groups = hidden_size, num_attention_heads, \
            num_gqa_groups
        self.attn_mask_type, self.window_size, self.bottom_right_diagonal = attn_mask_type, window_size, \
            bottom_right_diagonal
        self.layer_number = 1 if layer_number is None else positive_int(where, "layer_number", layer_number)
        self.input_layernorm, self.attention_type = bool(input_layernorm), attention_type
        self.return_bias, self.return_layernorm_output = bool(return_bias), bool(return_layernorm_output)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved) and bool(fuse_qkv_params)
        self.rotary_pos_interleaved, self.qk_norm_before_rope = rotary_pos_interleaved, qk_norm_before_rope
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q, self.hidden_size_kv = kv_channels * num_attention_heads, kv_channels * num_gqa_groups
        self.name, self.softmax_type = name, softmax_type
        params_dtype = params_dtype or torch.get_default_dtype()
        self.params_dtype = params_dtype
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=self.qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, tp_size=self.tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type,
            name=f"{name}.core_attention" if name else None)
        self.num_attention_heads_per_partition = self.core_attention.num_attention_heads_per_partition
        self.num_gqa_groups_per_partition = self.core_attention.num_gqa_groups_per_partition
        common = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=self.tp_size,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, device=device)
        ub = dict(ub_bulk_wgrad=ub_bulk_wgrad, ub_bulk_dgrad=ub_bulk_dgrad, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                  ub_overlap_ag=ub_overlap_ag)
        norm_args = dict(eps=layernorm_epsilon, return_layernorm_output=return_layernorm_output,
                         zero_centered_gamma=zero_centered_gamma, normalization=normalization, **ub)
        column = "column" if set_parallel_mode else None
        label = lambda suffix: f"{name}.{suffix}" if name else None  # noqa: E731
        if attention_type == "self":
            split = None if fuse_qkv_params else OrderedDict(
                [("query", self.hidden_size_q), ("key", self.hidden_size_kv), ("value", self.hidden_size_kv)])
            width = self.hidden_size_q + 2 * self.hidden_size_kv
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden_size, width, init_method=init_method, bias=bias, return_bias=False, parallel_mode=column,
                    parameters_split=split, ub_name="qkv", name=label("layernorm_linear_qkv"), **norm_args, **common)
            else:
                self.qkv = Linear(hidden_size, width, init_method=init_method, bias=bias, return_bias=False,
                                  parallel_mode=column, parameters_split=split, name=label("linear_qkv"), **common)
        else:
            if self.input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, self.hidden_size_q, init_method=init_method, bias=bias, return_bias=False,
                    parallel_mode=column, parameters_split=None if fuse_qkv_params else ("query",), ub_name="qkv",
                    name=label("layernorm_linear_q"), **norm_args, **common)
            else:
                self.query_layer = Linear(hidden_size, self.hidden_size_q, init_method=init_method, bias=bias,
                                          return_bias=False, parallel_mode=column, **common)
            self.key_value = Linear(hidden_size, 2 * self.hidden_size_kv, init_method=init_method, bias=bias,
                                    return_bias=False, parallel_mode=column,
                                    parameters_split=None if fuse_qkv_params else ("key", "value"),
                                    name=label("linear_kv"), **common)
        self.q_norm, self.k_norm = qk_norms(qk_norm_type, qk_norm_eps, kv_channels, device, params_dtype)
        self.proj = Linear(self.hidden_size_q, hidden_size, init_method=output_layer_init_method, bias=bias,
                           return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None,
                           ub_overlap_rs=ub_overlap_rs, ub_overlap_ag=ub_overlap_ag, ub_name="proj",
                           name=label("proj"), **common)

    @property
    def tp_group(self):
        return self.core_attention.tp_group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supply the tensor-parallel group to every submodule (modules built with `tp_size` and no group)."""
        for module in self.modules():
            if module is not self and hasattr(module, "set_tensor_parallel_group"):
                module.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None, cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None):
        """`hidden_states` `[s, b, hidden]` ("sbhd"), `[b, s, hidden]` ("bshd") or `[t, hidden]` ("thd"); see
        DotProductAttention.forward for the mask and sequence arguments. rotary_pos_emb: RoPE angles `[s, 1, 1, d]`
        (or a (query, key) pair), applied after the projections with each sequence's cached length as offset
        during generation."""
        if inference_params is not None and self.layer_number not in inference_params.cache_manager.cache:
            inference_params.allocate_memory(self.layer_number)
        heads, groups = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition
        head_dim = self.hidden_size_per_attention_head
        layernorm_output = None
        if self.attention_type == "self":
            if self.input_layernorm:
                mixed = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
                if self.return_layernorm_output:
                    mixed, layernorm_output = mixed
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            query, key, value = split_qkv(mixed, heads, groups, head_dim, self.qkv_weight_interleaved)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention(attention_type='cross'): forward needs encoder_output")
            mixed_kv = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
            key, value = split_kv(mixed_kv, groups, head_dim, self.qkv_weight_interleaved)
            if self.input_layernorm:
                query = self.layernorm_query(hidden_states, is_first_microbatch=is_first_microbatch)
                if self.return_layernorm_output:
                    query, layernorm_output = query
            else:
                query = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
            query = query.view(*query.shape[:-1], heads, head_dim)
        if self.q_norm is not None and self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            starts = inference_params.get_seqlens_pre_step() if inference_params is not None else None
            cu_q, cu_kv = (cu_seqlens_q_padded, cu_seqlens_kv_padded) if pad_between_seqs else (cu_seqlens_q,
                                                                                                 cu_seqlens_kv)
            if inference_params is not None and self.qkv_format == "thd":
                cu_q = cu_kv = inference_params.cu_seqlens_q
            query = apply_rotary_pos_emb(query, q_emb, self.qkv_format, start_positions=starts,
                                         interleaved=self.rotary_pos_interleaved, cu_seqlens=cu_q)
            key = apply_rotary_pos_emb(key, k_emb, self.qkv_format, start_positions=starts,
                                       interleaved=self.rotary_pos_interleaved, cu_seqlens=cu_kv)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        context = self.core_attention(
            query, key, value, attention_mask=attention_mask, qkv_format=self.qkv_format, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
            checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill,
            inference_params=inference_params, pad_between_seqs=pad_between_seqs)
        projected = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = list(projected) if self.return_bias else [projected]
        if self.input_layernorm and self.return_layernorm_output:
            outputs.append(layernorm_output)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
