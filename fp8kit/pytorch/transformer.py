"""TransformerLayer: Transformer Engine's transformer block (attention, optional cross-attention, MLP, residuals), with
its signature, defaults, submodule names (`self_attention`, `inter_attention`, `layernorm_mlp`, `layernorm`) and
forward arguments. The projections and the MLP are fp8kit's FP8 modules; attention runs in high precision."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .attention.layouts import check_qkv_format
from .attention.masks import canonical_mask_type, checked_window_size
from .attention.multi_head_attention import MultiheadAttention
from .attention.parallel import positive_int, tensor_parallel_size
from .modules import LayerNorm, LayerNormMLP, RMSNorm

__all__ = ["TransformerLayer", "DropPath"]


class DropPath(torch.nn.Module):
    """Stochastic depth: in training, zero each sample's branch with probability `drop_prob` (scaling the kept ones
    by 1 / (1 - drop_prob)); the identity in eval mode."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.ndim - 1)
        mask = (keep + torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device)).floor_()
        return hidden_state.div(keep) * mask


class TransformerLayer(torch.nn.Module):
    """LayerNorm -> attention -> residual -> LayerNorm -> MLP -> residual (Transformer Engine's `TransformerLayer`).

    Every argument of Transformer Engine's signature, in its order; see its documentation. The notable ones:
    hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, layernorm_epsilon, hidden_dropout
    (after the attention and MLP outputs), attention_dropout, init_method (QKV and FC1) / output_layer_init_method
    (proj and FC2; default normal with std 0.023), layer_number (the KV-cache key; give each layer its own),
    kv_channels (default hidden_size / num_attention_heads), self_attn_mask_type (default "causal"), window_size,
    enc_dec_attn_mask_type / enc_dec_window_size (decoder cross-attention), layer_type ("encoder" or "decoder":
    adds `inter_attention`), drop_path_rate, apply_residual_connection_post_layernorm (residuals from the norms'
    outputs), output_layernorm (one norm after the block instead of before each part; BERT),
    parallel_attention_mlp (attention and MLP on the same input, summed; Falcon), fuse_qkv_params (one QKV
    weight), qkv_weight_interleaved, zero_centered_gamma, bias, activation (LayerNormMLP's), normalization
    ("LayerNorm" or "RMSNorm"), attn_input_format ("sbhd", "bshd" or "thd"), params_dtype, device (default:
    torch's default device), set_parallel_mode / sequence_parallel / tp_group / tp_size (tensor parallelism),
    qk_norm_type, softmax_type ("vanilla" only). ub_* options are accepted and have no effect; seq_length is checked
    against the input under sequence parallelism; micro_batch_size is accepted (no JIT warm-up is needed).

    forward(hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None, ..., encoder_output,
    enc_dec_attn_mask, is_first_microbatch, checkpoint_core_attention, inference_params, rotary_pos_emb, ...)
    returns a tensor shaped like `hidden_states`.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, layer_number: Optional[int] = None,
                 kv_channels: Optional[int] = None, self_attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                 enc_dec_attn_mask_type: str = "no_mask", enc_dec_bottom_right_diagonal: Optional[bool] = None,
                 enc_dec_window_size: Optional[Tuple[int, int]] = None, tp_group=None, tp_size: int = 1,
                 params_dtype: Optional[torch.dtype] = None, get_rng_state_tracker: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
                 parallel_attention_mlp: bool = False, layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False, rotary_pos_interleaved: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 ub_tp_comm_overlap: bool = False, ub_overlap_ag: bool = True, ub_overlap_rs: bool = True,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = True, ub_bulk_wgrad: bool = True,
                 bias: bool = True, activation: str = "gelu", activation_params: Optional[dict] = None,
                 normalization: str = "LayerNorm", device=None, attn_input_format: str = "sbhd",
                 name: Optional[str] = None, qk_norm_type: Optional[str] = None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, softmax_type: str = "vanilla"):
        super().__init__()
        where = "TransformerLayer"
        if LayerNormMLP is None:
            raise NotImplementedError(f"{where} needs fp8kit.pytorch.LayerNormMLP, which this build lacks")
        hidden_size = positive_int(where, "hidden_size", hidden_size)
        num_attention_heads = positive_int(where, "num_attention_heads", num_attention_heads)
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(f"{where}: num_attention_heads={num_attention_heads} does not divide hidden_size="
                             f"{hidden_size} (or give kv_channels)")
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"{where}: layer_type must be 'encoder' or 'decoder', got {layer_type!r}")
        if parallel_attention_mlp and (layer_type != "encoder" or apply_residual_connection_post_layernorm
                                       or output_layernorm):
            raise ValueError(f"{where}: parallel_attention_mlp=True needs layer_type='encoder', "
                             "apply_residual_connection_post_layernorm=False and output_layernorm=False")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{where}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True (one QKV weight)")
        for arg, p in (("hidden_dropout", hidden_dropout), ("drop_path_rate", drop_path_rate)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ValueError(f"{where}: {arg} must be a probability in [0, 1], got {p!r}")
        self.self_attn_mask_type = canonical_mask_type(self_attn_mask_type, "self_attn_mask_type")
        self.enc_dec_attn_mask_type = canonical_mask_type(enc_dec_attn_mask_type, "enc_dec_attn_mask_type")
        self.window_size = checked_window_size(self.self_attn_mask_type, window_size)
        self.enc_dec_window_size = checked_window_size(self.enc_dec_attn_mask_type, enc_dec_window_size,
                                                       "enc_dec_window_size")
        self.bottom_right_diagonal, self.enc_dec_bottom_right_diagonal = bottom_right_diagonal, \
            enc_dec_bottom_right_diagonal
        self.attn_input_format = check_qkv_format(attn_input_format, "attn_input_format")
        self.layer_number, self.layer_type = layer_number, layer_type
        self.output_layernorm, self.parallel_attention_mlp = bool(output_layernorm), bool(parallel_attention_mlp)
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size = tensor_parallel_size(where, tp_group, tp_size)
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.seq_length, self.get_rng_state_tracker = seq_length, get_rng_state_tracker
        self.hidden_dropout, self.name, self.softmax_type = float(hidden_dropout), name, softmax_type
        params_dtype = params_dtype or torch.get_default_dtype()
        if not fuse_qkv_params:
            qkv_weight_interleaved = False
        on = bool(ub_tp_comm_overlap)  # Transformer Engine's userbuffer options count only with ub_tp_comm_overlap
        ub = dict(ub_bulk_wgrad=on and ub_bulk_wgrad, ub_bulk_dgrad=on and ub_bulk_dgrad,
                  ub_overlap_ag=on and ub_overlap_ag, ub_overlap_rs=on and ub_overlap_rs,
                  ub_overlap_rs_dgrad=on and ub_overlap_rs_dgrad)
        attention_args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout, layernorm_epsilon,
                          init_method, output_layer_init_method)
        common = dict(layer_number=layer_number, tp_group=tp_group, tp_size=self.tp_size,
                      num_gqa_groups=num_gqa_groups, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=self.sequence_parallel,
                      params_dtype=params_dtype, return_layernorm_output=apply_residual_connection_post_layernorm,
                      set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
                      zero_centered_gamma=zero_centered_gamma, qkv_weight_interleaved=qkv_weight_interleaved,
                      rotary_pos_interleaved=rotary_pos_interleaved, qkv_format=self.attn_input_format,
                      seq_length=seq_length, micro_batch_size=micro_batch_size, softmax_type=softmax_type,
                      bias=bias, normalization=normalization, device=device, qk_norm_type=qk_norm_type,
                      qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope, **ub)
        self.self_attention = MultiheadAttention(
            *attention_args, **common, attn_mask_type=self.self_attn_mask_type, window_size=self.window_size,
            input_layernorm=not output_layernorm, attention_type="self", return_bias=not self.parallel_attention_mlp,
            name=f"{name}.self_attention" if name else None)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args, **common, attn_mask_type=self.enc_dec_attn_mask_type,
                window_size=self.enc_dec_window_size, input_layernorm=True, attention_type="cross", return_bias=True,
                name=f"{name}.inter_attention" if name else None)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group, tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker,
            init_method=init_method, output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=not self.parallel_attention_mlp, sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype, return_layernorm_output=apply_residual_connection_post_layernorm,
            seq_length=seq_length, micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, activation=activation, activation_params=activation_params,
            normalization=normalization, device=device, name=f"{name}.layernorm_mlp" if name else None, **ub)
        if self.sequence_parallel and not self.parallel_attention_mlp:
            # the returned biases are added here, to this rank's tokens: partial gradients, summed like the norms'
            returned = [self.self_attention.proj.bias, self.layernorm_mlp.fc2_bias]
            if layer_type == "decoder":
                returned.append(self.inter_attention.proj.bias)
            for bias_param in returned:
                if bias_param is not None:
                    bias_param.sequence_parallel = True
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if self.output_layernorm:
            norm = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supply the tensor-parallel group to every submodule (layers built with `tp_size` and no group)."""
        for module in self.modules():
            if module is not self and hasattr(module, "set_tensor_parallel_group") \
                    and not isinstance(module, MultiheadAttention):
                module.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        if cp_group is not None:
            raise NotImplementedError("TransformerLayer: context parallelism is not implemented in fp8kit")

    def reset_fp8_meta_tensors(self) -> None:
        """Reset every FP8 module's delayed-scaling histories (to 0) and scales (to 1)."""
        for module in self.modules():
            meta = getattr(module, "fp8_meta", None)
            for key in ("scaling_fwd", "scaling_bwd"):
                state = meta.get(key) if isinstance(meta, dict) else None
                if state is not None:
                    with torch.no_grad():
                        state.amax_history.zero_()
                        state.scale.fill_(1.0)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, self_attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size: Optional[Tuple[int, int]] = None,
                enc_dec_bottom_right_diagonal: Optional[bool] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None, cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None) -> torch.Tensor:
        """The block on `hidden_states` (`[s, b, h]`, `[b, s, h]` or `[t, h]` per attn_input_format). Masks follow
        DotProductAttention (True = masked out); self-attention uses cu_seqlens_q for both sides, cross-attention
        cu_seqlens_q and cu_seqlens_kv."""
        mask_type = self.self_attn_mask_type if self_attn_mask_type is None else canonical_mask_type(
            self_attn_mask_type, "self_attn_mask_type")
        enc_type = self.enc_dec_attn_mask_type if enc_dec_attn_mask_type is None else canonical_mask_type(
            enc_dec_attn_mask_type, "enc_dec_attn_mask_type")
        window_size = self.window_size if window_size is None else window_size
        enc_dec_window_size = self.enc_dec_window_size if enc_dec_window_size is None else enc_dec_window_size
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        if enc_dec_bottom_right_diagonal is None:
            enc_dec_bottom_right_diagonal = self.enc_dec_bottom_right_diagonal
        for arg, mask in (("attention_mask", attention_mask), ("enc_dec_attn_mask", enc_dec_attn_mask)):
            masks = mask if isinstance(mask, (tuple, list)) else ([] if mask is None else [mask])
            bad = [getattr(m, "dtype", type(m).__name__) for m in masks
                   if not isinstance(m, torch.Tensor) or m.dtype != torch.bool]
            if bad:
                raise TypeError(f"TransformerLayer: {arg} must be boolean tensor(s) (True = masked out), got {bad}")
        hidden_states = hidden_states.contiguous()
        if self.sequence_parallel and self.seq_length is not None \
                and hidden_states.shape[0] != self.seq_length // self.tp_size:
            raise ValueError(f"TransformerLayer(sequence_parallel=True): hidden_states.shape[0] must be seq_length / "
                             f"tp_size = {self.seq_length // self.tp_size}, got {hidden_states.shape[0]}")
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type) and hidden_states.is_floating_point():
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))
        attention_kwargs = dict(is_first_microbatch=is_first_microbatch, inference_params=inference_params,
                                checkpoint_core_attention=checkpoint_core_attention, rotary_pos_emb=rotary_pos_emb,
                                core_attention_bias_type=core_attention_bias_type,
                                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                                max_seqlen_q=max_seqlen_q, fast_zero_fill=fast_zero_fill,
                                pad_between_seqs=pad_between_seqs)
        attention_outputs = self.self_attention(
            hidden_states, attention_mask=attention_mask, attn_mask_type=mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_q_padded,
            max_seqlen_kv=max_seqlen_q, **attention_kwargs)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            output, bias, residual = attention_outputs
            hidden_states = self._bias_dropout_add(output, bias, residual, self.drop_path)
        elif not self.parallel_attention_mlp:
            output, bias = attention_outputs
            hidden_states = self._bias_dropout_add(output, bias, hidden_states, self.drop_path)
        if self.layer_type == "decoder":
            cross_outputs = self.inter_attention(
                hidden_states, attention_mask=enc_dec_attn_mask, attn_mask_type=enc_type,
                window_size=enc_dec_window_size, bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                encoder_output=encoder_output, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_kv=max_seqlen_kv, **attention_kwargs)
            if self.apply_residual_connection_post_layernorm:
                output, bias, residual = cross_outputs
            else:
                (output, bias), residual = cross_outputs, hidden_states
            hidden_states = self._bias_dropout_add(output, bias, residual)
        mlp_outputs = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            output, bias, residual = mlp_outputs
            result = self._bias_dropout_add(output, bias, residual, self.drop_path)
        elif self.parallel_attention_mlp:
            result = self._bias_dropout_add(attention_outputs, mlp_outputs, hidden_states, self.drop_path)
        else:
            output, bias = mlp_outputs
            result = self._bias_dropout_add(output, bias, hidden_states, self.drop_path)
        if self.output_layernorm:
            result = self.layernorm(result)
        return result

    def _bias_dropout_add(self, hidden_state, bias, residual, drop_path=None):
        """`residual + drop_path(dropout(hidden_state + bias))`, as Transformer Engine's bias-dropout-add."""
        if bias is not None and bias.numel() != 0:
            hidden_state = hidden_state + bias
        out = torch.nn.functional.dropout(hidden_state, p=self.hidden_dropout, training=self.training)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out
