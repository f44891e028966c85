"""KV caching for generation: Transformer Engine's `InferenceParams` (the API of Transformer Engine 2.2 and later)
with a non-paged cache written in plain torch.

A generation loop (see docs/pytorch.md)::

    params = InferenceParams(max_batch_size, max_sequence_length, num_heads_kv=..., head_dim_k=..., dtype=...)
    params.pre_step(OrderedDict({seq_id: prompt_len, ...}))        # the prompts
    out = model(prompt_tokens, inference_params=params)              # attn_mask_type "padding_causal"
    params.pre_step(OrderedDict({seq_id: 1, ...}))                 # then one token per sequence per step
    out = model(next_tokens, inference_params=params)

Each attention layer (its `layer_number`, unique per layer) appends its new keys and values to its cache and attends
over everything cached for the sequence. The cache is filled without autograd (generation, not training).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from .layouts import packed_index, to_batch_first
from .masks import seqlens_of

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager"]


class KVCacheManager:
    """Base class of KV cache managers: `cache[layer_number] = (k_cache, v_cache)` and the tracked sequences
    (`sequences`: seq_id -> length after this step)."""

    def __init__(self):
        self.cache = {}
        self.sequences = OrderedDict()

    def reset(self) -> None:
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        self.cache[layer_number] = (None, None)

    def pre_step(self, step_dict: OrderedDict) -> OrderedDict:
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        return self.cache[layer_number]


class NonPagedKVCacheManager(KVCacheManager):
    """One `[max_batch_size, max_seqlen, heads, dim]` key and value buffer per layer; sequence i of the current
    batch lives in row i (rows are reordered when sequences finish)."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None):
        super().__init__()
        self.max_batch_size, self.max_seqlen, self.num_heads = max_batch_size, max_seqlen, num_heads
        self.head_dim_k, self.dtype = head_dim_k, dtype
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.batch_indices = torch.arange(max_batch_size)
        self.need_reindex = False

    def allocate_memory(self, layer_number: int) -> None:
        shape = (self.max_batch_size, self.max_seqlen, self.num_heads)
        self.cache[layer_number] = (torch.zeros(*shape, self.head_dim_k, dtype=self.dtype),
                                    torch.zeros(*shape, self.head_dim_v, dtype=self.dtype))

    def pre_step(self, step_dict: OrderedDict) -> OrderedDict:
        """Continue the sequences of `step_dict` already tracked (by their step length), drop the others, add the
        new ones. `step_dict` must list the continuing sequences first, in their previous order."""
        previous = list(self.sequences)
        continuing = [s for s in previous if s in step_dict]
        finished = [s for s in previous if s not in step_dict]
        order = [previous.index(s) for s in continuing + finished]
        self.batch_indices = torch.tensor(order + list(range(len(previous), self.max_batch_size)), dtype=torch.long)
        self.need_reindex = order != list(range(len(order)))
        sequences = OrderedDict((s, self.sequences[s] + step_dict[s]) for s in continuing)
        for s, n in step_dict.items():
            if s not in sequences:
                sequences[s] = n
        if list(sequences) != list(step_dict):
            raise ValueError(f"InferenceParams.pre_step: step_dict must list the continuing sequences first, in their "
                             f"previous order {continuing}, then the new ones; got {list(step_dict)}")
        too_long = {s: n for s, n in sequences.items() if n > self.max_seqlen}
        if too_long:
            raise ValueError(f"InferenceParams.pre_step: sequences {too_long} exceed max_sequence_length="
                             f"{self.max_seqlen}")
        self.sequences = sequences
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """Write the new tokens after each sequence's cached ones; returns the caches of the current batch."""
        k_cache, v_cache = self.cache[layer_number]
        batch = len(self.sequences)
        if k_cache.device != new_k.device:
            k_cache, v_cache = k_cache.to(new_k.device), v_cache.to(new_k.device)
            self.cache[layer_number] = (k_cache, v_cache)
        new_lens = seqlens_of(cu_new_seqlens, batch, "cu_seqlens_q").to(new_k.device)
        total_lens = seqlens_of(cu_cached_seqlens, batch, "cu_seqlens_kv").to(new_k.device)
        with torch.no_grad():
            if self.need_reindex:
                order = self.batch_indices.to(k_cache.device)
                k_cache.copy_(k_cache[order])
                v_cache.copy_(v_cache[order])
            if qkv_format == "thd":
                index = packed_index(cu_new_seqlens[:batch + 1].to(new_k.device), None, new_k.shape[0], None,
                                     "cu_seqlens_q")
                k_new, v_new, valid = index.gather(new_k), index.gather(new_v), index.valid
            else:
                k_new, v_new = to_batch_first(new_k, qkv_format), to_batch_first(new_v, qkv_format)
                if k_new.shape[0] != batch:
                    raise ValueError(f"InferenceParams: the step has {k_new.shape[0]} sequences, pre_step announced "
                                     f"{batch}")
                if bool((new_lens > k_new.shape[1]).any()):
                    raise ValueError(f"InferenceParams: step lengths {new_lens.tolist()} exceed the input's sequence "
                                     f"dimension {k_new.shape[1]}")
                positions = torch.arange(k_new.shape[1], device=new_k.device).view(1, -1)
                valid = positions < new_lens.view(-1, 1)
            rows, cols = valid.nonzero(as_tuple=True)
            dest = (total_lens - new_lens)[rows] + cols
            k_cache.index_put_((rows, dest), k_new[rows, cols].to(k_cache.dtype))
            v_cache.index_put_((rows, dest), v_new[rows, cols].to(v_cache.dtype))
        return k_cache[:batch], v_cache[:batch]


class InferenceParams:
    """Transformer Engine's KV-cache state for generation.

    Args (Transformer Engine's): max_batch_size, max_sequence_length (per sequence, prompt included),
    num_heads_kv (key/value heads per layer), head_dim_k, dtype (of the cache: the attention's dtype), head_dim_v
    (default head_dim_k), is_paged / total_num_pages / page_size (a paged cache: not implemented), max_ctx_len (the
    longest prompt; required with qkv_format "thd"), qkv_format (of the incoming tokens), custom_cache_manager (a
    KVCacheManager subclass to use instead of NonPagedKVCacheManager).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, num_heads_kv: Optional[int] = None,
                 head_dim_k: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 head_dim_v: Optional[int] = None, is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, max_ctx_len: Optional[int] = None, qkv_format: str = "bshd",
                 custom_cache_manager=None):
        for arg, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InferenceParams: {arg} must be a positive int, got {value!r}")
        missing = [n for n, v in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k), ("dtype", dtype))
                   if v is None]
        if missing:
            raise TypeError(f"InferenceParams: {', '.join(missing)} required (as in Transformer Engine 2.2 and later)")
        if is_paged:
            raise NotImplementedError("InferenceParams(is_paged=True): the paged KV cache is not implemented in "
                                      "fp8kit; the non-paged cache gives the same results")
        if qkv_format not in ("bshd", "sbhd", "thd"):
            raise ValueError(f"InferenceParams: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
        if qkv_format == "thd" and max_ctx_len is None:
            raise ValueError("InferenceParams: max_ctx_len is required with qkv_format='thd'")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.is_paged, self.total_num_pages, self.page_size = False, total_num_pages, page_size
        self.max_ctx_len = max_ctx_len
        manager = custom_cache_manager if custom_cache_manager is not None else NonPagedKVCacheManager
        self.cache_manager = manager(max_batch_size=max_batch_size, max_seqlen=max_sequence_length,
                                     num_heads=num_heads_kv, head_dim_k=head_dim_k, dtype=dtype,
                                     head_dim_v=self.head_dim_v)
        self.input_qkv_format = qkv_format
        self.cache_qkv_format = "bshd"
        self.sequences_pre_step = OrderedDict()
        self.sequences = OrderedDict()
        self.batch_size = 0
        self.cu_seqlens_q = torch.zeros(max_batch_size + 1, dtype=torch.int32)
        self.cu_seqlens_kv = torch.zeros(max_batch_size + 1, dtype=torch.int32)
        self.pre_step_seqlens = torch.zeros(max_batch_size, dtype=torch.int32)
        self._stepped = set()

    def __repr__(self) -> str:
        return (f"InferenceParams(dtype={self.dtype}, is_paged=False, max_batch_size={self.max_batch_size}, "
                f"max_seqlen={self.max_sequence_length}, num_heads={self.num_heads_kv}, head_dim_k={self.head_dim_k}, "
                f"head_dim_v={self.head_dim_v})")

    def reset(self) -> None:
        """Forget every sequence (the buffers stay allocated)."""
        self.sequences = OrderedDict()
        self.cache_manager.reset()

    def allocate_memory(self, layer_number: int) -> None:
        """Allocate layer `layer_number`'s key and value caches `[max_batch_size, max_sequence_length, heads, dim]`."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: OrderedDict) -> None:
        """Announce the next forward: `step_dict` maps each sequence id of the batch, in batch order, to its number
        of new tokens (the prompt length for a new sequence, usually 1 afterwards)."""
        if not isinstance(step_dict, dict) or not step_dict:
            raise ValueError(f"InferenceParams.pre_step: step_dict must be a non-empty OrderedDict of seq_id -> "
                             f"new tokens, got {step_dict!r}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"InferenceParams.pre_step: {len(step_dict)} sequences exceed max_batch_size="
                             f"{self.max_batch_size}")
        bad = {s: n for s, n in step_dict.items() if not isinstance(n, int) or isinstance(n, bool) or n < 1}
        if bad:
            raise ValueError(f"InferenceParams.pre_step: new-token counts must be positive ints, got {bad}")
        self.batch_size = len(step_dict)
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.sequences_pre_step = OrderedDict((s, n - step_dict[s]) for s, n in self.sequences.items())
        self.pre_step_seqlens.zero_()
        self.pre_step_seqlens[:self.batch_size] = torch.tensor(list(self.sequences_pre_step.values()),
                                                               dtype=torch.int32)
        self.cu_seqlens_q.copy_(_cumulative(list(step_dict.values()), self.max_batch_size))
        self.cu_seqlens_kv.copy_(_cumulative(list(self.sequences.values()), self.max_batch_size))
        self._stepped = set()

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """Each sequence's cached length before this step `[max_batch_size]` (the RoPE offset of its new tokens)."""
        return self.pre_step_seqlens

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Append the new keys and values of layer `layer_number`; returns (k_cache, v_cache `[batch, max_seqlen,
        heads, dim]`, cu_seqlens_q, cu_seqlens_kv, max_sequence_length, the query's format after the step)."""
        if self.batch_size == 0:
            raise RuntimeError("InferenceParams: call pre_step(step_dict) before each forward")
        if layer_number in self._stepped:
            raise RuntimeError(f"InferenceParams: layer_number={layer_number} stepped twice since pre_step: give "
                               "every attention layer its own layer_number (1, 2, ...), and call pre_step before "
                               "each forward")
        if layer_number not in self.cache_manager.cache:
            self.allocate_memory(layer_number)
        self._stepped.add(layer_number)
        k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v, self.cu_seqlens_q, self.cu_seqlens_kv,
                                                   qkv_format)
        out_format = "bshd" if qkv_format == "bshd" else f"{qkv_format}_2bshd"
        return k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_kv, self.max_sequence_length, out_format


def _cumulative(lengths, size: int) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu + [cu[-1]] * (size + 1 - len(cu)), dtype=torch.int32)
