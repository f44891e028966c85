"""Mixture-of-experts token routing with Transformer Engine's API (`te.moe_permute`, `te.moe_unpermute`,
`te.moe_permute_with_probs`, `te.moe_permute_and_pad_with_probs`, `te.moe_sort_chunks_by_index`,
`te.moe_sort_chunks_by_index_with_probs`), as plain torch operations on any device.

Routing maps (as in Transformer Engine):
- "mask": `routing_map` is `[num_tokens, num_experts]`, nonzero where a token goes to an expert. The permuted rows are
  grouped by expert (expert 0's tokens first), tokens in their original order within an expert. `row_id_map` is
  `[num_tokens, 2 * num_experts + 1]` int32: per token, the destination rows of its routed copies (highest first),
  then the experts of those copies, then (last column) the number of copies; unused entries are -1.
- "index": `routing_map` is `[num_tokens, topK]` of expert indices. The copies are sorted by expert with a stable
  sort of the token-major flattening; copies past `num_out_tokens` are dropped. `row_id_map` is `[topK * num_tokens]`
  int32, entry `k * num_tokens + t` being the destination row of copy k of token t, or -1 when dropped.

Sums over the copies of a token (unpermute, and the backward of permute) and the merging-probability products are
computed in float32 and rounded once to the tensor's dtype, as Transformer Engine's kernels do (float64 tensors:
in float64).
A per-tensor FP8 input (`Float8Tensor`) of the permutations gives a `Float8Tensor` with the same scale (its bytes are
moved), as in Transformer Engine; its gradient is a high-precision tensor. `moe_unpermute` refuses FP8 input (as TE),
and other quantized tensors are refused.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from .quantized_tensor import QuantizedTensor
from .tensor.float8_ops import _like
from .tensor.float8_tensor import Float8Tensor

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]


# ---- the two differentiable moves -----------------------------------------------------------------------------------
# A routing is three equal-length int64 vectors: token t, slot s (expert or top-k position) and permuted row d of each
# copy. Permute writes row d from token t (and prob [t, s]); unpermute sums rows d (times prob [t, s]) into token t.

def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are computed in: float32 (as Transformer Engine's kernels), float64 for float64 tensors."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, probs, token, slot, row, num_rows, zero_if_no_prob):
        ctx.save_for_backward(token, slot, row)
        ctx.shape = (inp.shape[0], probs.shape if probs is not None else None)
        fp8 = isinstance(inp, Float8Tensor)  # per-tensor FP8: the bytes move, the scale stays (byte 0 is +0.0)
        source = inp._data.view(torch.uint8) if fp8 else inp
        out = source.new_zeros((num_rows, inp.shape[1]))
        out[row] = source[token]
        permuted_probs = None
        if probs is not None:
            permuted_probs = probs.new_zeros((num_rows,))
            permuted_probs[row] = probs[token, slot]
            if zero_if_no_prob:  # a routed copy with probability 0 is routing-map padding: its row is zero
                out[row[permuted_probs[row] == 0]] = 0
        if fp8:
            out = _like(inp, out.view(inp._data.dtype))
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        token, slot, row = ctx.saved_tensors
        num_tokens, probs_shape = ctx.shape
        grad_inp = grad_probs_in = None
        if ctx.needs_input_grad[0]:
            acc = torch.zeros((num_tokens, grad_out.shape[1]), dtype=_acc(grad_out.dtype), device=grad_out.device)
            acc.index_add_(0, token, grad_out[row].to(acc.dtype))
            grad_inp = acc.to(grad_out.dtype)
        if ctx.needs_input_grad[1] and grad_probs is not None:
            grad_probs_in = grad_probs.new_zeros(probs_shape)
            grad_probs_in[token, slot] = grad_probs[row]
        return grad_inp, grad_probs_in, None, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, probs, token, slot, row, num_tokens):
        ctx.save_for_backward(inp, probs, token, slot, row)
        compute = _acc(inp.dtype)
        rows = inp[row].to(compute)
        if probs is not None:
            rows = rows * probs[token, slot].to(compute).unsqueeze(1)
        acc = torch.zeros((num_tokens, inp.shape[1]), dtype=compute, device=inp.device)
        acc.index_add_(0, token, rows)
        return acc.to(inp.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        inp, probs, token, slot, row = ctx.saved_tensors
        compute = _acc(inp.dtype)
        grad_rows = grad_out[token].to(compute)
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            weighted = grad_rows if probs is None else grad_rows * probs[token, slot].to(compute).unsqueeze(1)
            grad_inp = torch.zeros_like(inp)
            grad_inp[row] = weighted.to(inp.dtype)
        if probs is not None and ctx.needs_input_grad[1]:
            grad_probs = torch.zeros_like(probs)
            grad_probs[token, slot] = (grad_rows * inp[row].to(compute)).sum(dim=1).to(probs.dtype)
        return grad_inp, grad_probs, None, None, None, None


class _Empty(torch.autograd.Function):
    """No tokens: `inp` passes through (a copy) and `probs`, if given, gets a zero gradient of its shape, as in
    Transformer Engine. Returns `(copy, probs_out)`, `probs_out` an empty tensor connected to `probs`."""

    @staticmethod
    def forward(ctx, inp, probs):
        ctx.probs_meta = (probs.shape, probs.dtype, probs.device) if probs is not None else None
        return inp.clone(), (probs.new_zeros((0,)) if probs is not None else None)

    @staticmethod
    def backward(ctx, grad, _grad_probs):
        meta = ctx.probs_meta
        return grad, (torch.zeros(meta[0], dtype=meta[1], device=meta[2]) if meta is not None else None)


# ---- routing maps ----------------------------------------------------------------------------------------------------

def _check_fp8(name: str, inp) -> None:
    if isinstance(inp, QuantizedTensor) and not isinstance(inp, Float8Tensor):
        raise TypeError(f"{name}: of the quantized tensors only per-tensor FP8 (Float8Tensor) input is supported, "
                        f"got {type(inp).__name__}; dequantize it first")


def _check_inputs(name: str, inp: torch.Tensor, routing_map: torch.Tensor) -> None:
    _check_fp8(name, inp)
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2:
        raise ValueError(f"{name}: inp must be a 2-D tensor [num_tokens, hidden_size], got "
                         f"{getattr(inp, 'shape', type(inp).__name__)}")
    if routing_map.dim() != 2 or routing_map.size(0) != inp.size(0):
        raise ValueError(f"{name}: routing_map must be 2-D with routing_map.size(0) == inp.size(0) "
                         f"({inp.size(0)}), got shape {tuple(routing_map.shape)}")


def _mask_routing(routing_map: torch.Tensor, pad_offsets: Optional[torch.Tensor]):
    """(token, expert, row) of every routed copy, expert-major, and the row_id_map."""
    mask = routing_map.bool()
    num_tokens, num_experts = mask.shape
    expert, token = mask.T.nonzero(as_tuple=True)  # expert-major, tokens in order
    row = torch.arange(token.numel(), device=mask.device)
    if pad_offsets is not None:
        row = row + pad_offsets.to(device=mask.device, dtype=torch.int64)[expert]
    row_id_map = torch.full((num_tokens, 2 * num_experts + 1), -1, dtype=torch.int32, device=mask.device)
    dst = torch.full((num_tokens, num_experts), -1, dtype=torch.int64, device=mask.device)
    dst[token, expert] = torch.arange(token.numel(), device=mask.device)
    order = dst.sort(dim=1, descending=True)  # each token's copies, highest destination first
    counts = mask.sum(dim=1)
    valid = torch.arange(num_experts, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    row_id_map[:, :num_experts] = torch.where(valid, order.values, -1).to(torch.int32)
    row_id_map[:, num_experts:2 * num_experts] = torch.where(valid, order.indices, -1).to(torch.int32)
    row_id_map[:, -1] = counts.to(torch.int32)
    return token, expert, row, row_id_map


def _routing_from_mask_map(row_id_map: torch.Tensor, pad_offsets: Optional[torch.Tensor]):
    if row_id_map.dim() != 2 or row_id_map.size(1) % 2 != 1:
        raise ValueError(f"moe_unpermute: a mask-map row_id_map is [num_tokens, 2 * num_experts + 1], got shape "
                         f"{tuple(row_id_map.shape)} (map_type must match moe_permute's)")
    num_experts = (row_id_map.size(1) - 1) // 2
    counts = row_id_map[:, -1].long()
    valid = torch.arange(num_experts, device=row_id_map.device).unsqueeze(0) < counts.unsqueeze(1)
    token, position = valid.nonzero(as_tuple=True)
    row = row_id_map[token, position].long()
    expert = row_id_map[token, num_experts + position].long()
    if pad_offsets is not None:
        row = row + pad_offsets.to(device=row.device, dtype=torch.int64)[expert]
    return token, expert, row


def _index_routing(index: torch.Tensor, num_out_tokens: int):
    num_tokens, top_k = index.shape
    order = torch.argsort(index.reshape(-1), stable=True)[:num_out_tokens]
    token, slot = order // top_k, order % top_k
    row = torch.arange(order.numel(), device=index.device)
    row_id_map = torch.full((top_k * num_tokens,), -1, dtype=torch.int32, device=index.device)
    row_id_map[slot * num_tokens + token] = row.to(torch.int32)
    return token, slot, row, row_id_map


def _routing_from_index_map(row_id_map: torch.Tensor, num_tokens: int):
    if row_id_map.dim() != 1 or row_id_map.numel() % max(num_tokens, 1):
        raise ValueError(f"moe_unpermute: an index-map row_id_map is 1-D of topK * num_tokens entries, got shape "
                         f"{tuple(row_id_map.shape)} for {num_tokens} tokens (map_type must match moe_permute's)")
    (entry,) = (row_id_map >= 0).nonzero(as_tuple=True)
    return entry % num_tokens, entry // num_tokens, row_id_map[entry].long()


# ---- public API ------------------------------------------------------------------------------------------------------

def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int, max_token_num: int = -1,
                map_type: str = "mask") -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the copies of tokens by expert. Returns `(permuted, row_id_map)`; pass `row_id_map` to `moe_unpermute`.

    `num_out_tokens`: rows of the result. Mask map: at least the number of routed copies (extra rows are zero).
    Index map: copies past it (in expert order) are dropped; 0 means all `num_tokens * topK`.
    `max_token_num` only sizes Transformer Engine's workspace and is ignored."""
    del max_token_num
    if map_type not in ("mask", "index"):
        raise ValueError(f"map_type should be one of 'mask' or 'index', got {map_type!r}")
    _check_inputs("moe_permute", inp, routing_map)
    if map_type == "index":
        if routing_map.dtype != torch.int32:
            warnings.warn(f"The data type of the input `index` of Permute is {routing_map.dtype}! "
                          "The recommended type is torch.int32.")
        total = routing_map.numel()
        if num_out_tokens is None or num_out_tokens < 0 or num_out_tokens > total:
            raise ValueError(f"moe_permute (index map): num_out_tokens must be in [0, num_tokens * topK = {total}] "
                             f"(0: all), got {num_out_tokens}")
        num_out_tokens = int(num_out_tokens) or total
        if not inp.numel():
            return _Empty.apply(inp, None)[0], torch.empty(0, dtype=torch.int32, device=inp.device)
        token, slot, row, row_id_map = _index_routing(routing_map.long(), num_out_tokens)
        out, _ = _Permute.apply(inp, None, token, slot, row, num_out_tokens, False)
        return out, row_id_map
    out, _, row_id_map = _permute_mask("moe_permute", inp, routing_map, num_out_tokens, None, None)
    return out, row_id_map


def _permute_mask(name, inp, routing_map, num_out_tokens, probs, pad_offsets):
    _check_inputs(name, inp, routing_map)
    if not inp.numel():
        out, permuted_probs = _Empty.apply(inp, probs)
        return out, permuted_probs, torch.empty(0, dtype=torch.int32, device=inp.device)
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(f"{name}: probs must have routing_map's shape {tuple(routing_map.shape)}, got "
                         f"{tuple(probs.shape)}")
    token, expert, row, row_id_map = _mask_routing(routing_map, pad_offsets)
    needed = int(row.max()) + 1 if row.numel() else 0
    if num_out_tokens is None or num_out_tokens <= 0 or num_out_tokens < needed:
        raise ValueError(f"{name} (mask map): num_out_tokens must be positive and hold every routed copy "
                         f"({needed} rows), got {num_out_tokens}")
    out, permuted_probs = _Permute.apply(inp, probs, token, expert, row, int(num_out_tokens), True)
    return out, permuted_probs, row_id_map


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_permute` (mask map) that also permutes `probs` ([num_tokens, num_experts]) along with the tokens.
    Returns `(permuted, permuted_probs, row_id_map)`. A routed copy whose probability is 0 gets a zero row."""
    return _permute_mask("moe_permute_with_probs", inp, routing_map, num_out_tokens, probs, None)


def moe_permute_and_pad_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                                   tokens_per_expert: torch.Tensor, align_size: int):
    """`moe_permute_with_probs` where each expert's rows are padded with zero rows to a multiple of `align_size`.
    Returns `(permuted, permuted_probs, row_id_map, pad_offsets, padded_tokens_per_expert)`; `pad_offsets` (None when
    nothing is padded) goes to `moe_unpermute`."""
    if tokens_per_expert is None:
        raise ValueError("tokens_per_expert must be provided to the fused permute padding function.")
    if align_size <= 0:
        raise ValueError(f"align_size must be positive, got {align_size}.")
    tokens_per_expert = tokens_per_expert.to(inp.device)
    target = (torch.ceil(tokens_per_expert / align_size) * align_size).long()
    pad_offsets = None
    if not torch.equal(tokens_per_expert.long(), target):
        pad = torch.cumsum(target - tokens_per_expert.long(), dim=0)
        pad_offsets = torch.cat([pad.new_zeros(1), pad[:-1]])
    out, permuted_probs, row_id_map = _permute_mask("moe_permute_and_pad_with_probs", inp, routing_map,
                                                    int(target.sum()), probs, pad_offsets)
    return out, permuted_probs, row_id_map, pad_offsets, target


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[torch.Size] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None, pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Undo `moe_permute`: every token gets the sum of its copies' rows, each weighted by `merging_probs[token,
    expert-or-k]` when given. `restore_shape` (mask map) is `(num_tokens, hidden_size)`, default `inp.shape`.
    `probs` is the deprecated name of `merging_probs`. `pad_offsets` comes from `moe_permute_and_pad_with_probs`."""
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs kwarg are provided. probs is deprecated.")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.", DeprecationWarning)
        merging_probs = probs
    if map_type not in ("mask", "index"):
        raise ValueError(f"map_type should be one of 'mask' or 'index', got {map_type!r}")
    if isinstance(inp, QuantizedTensor):
        raise TypeError("moe_unpermute: FP8 (QuantizedTensor) input is not supported; dequantize it first")
    if map_type == "index":
        if merging_probs is not None:
            if merging_probs.dtype != torch.float32:
                warnings.warn(f"The data type of the input `probs` of Unpermute is {merging_probs.dtype}! "
                              "The recommended type is torch.float32.")
                merging_probs = merging_probs.float()
            num_tokens = merging_probs.size(0)
        else:
            num_tokens = row_id_map.size(0)
        if not inp.numel():
            return _Empty.apply(inp, merging_probs)[0]
        token, slot, row = _routing_from_index_map(row_id_map, num_tokens)
        return _Unpermute.apply(inp, merging_probs, token, slot, row, num_tokens)
    if not inp.numel():
        return _Empty.apply(inp, merging_probs)[0]
    num_tokens, hidden_size = tuple(restore_shape) if restore_shape is not None else tuple(inp.shape)
    if inp.dim() != 2 or inp.size(1) != hidden_size:
        raise ValueError(f"moe_unpermute: inp must be [num_permuted, {hidden_size}], got {tuple(inp.shape)}")
    if row_id_map.size(0) != num_tokens:
        raise ValueError(f"moe_unpermute: row_id_map has {row_id_map.size(0)} tokens, restore_shape {num_tokens}")
    token, expert, row = _routing_from_mask_map(row_id_map, pad_offsets)
    if merging_probs is not None and merging_probs.shape != (num_tokens, (row_id_map.size(1) - 1) // 2):
        raise ValueError(f"moe_unpermute: merging_probs must be [num_tokens, num_experts], got "
                         f"{tuple(merging_probs.shape)}")
    return _Unpermute.apply(inp, merging_probs, token, expert, row, num_tokens)


def _sort_chunks(inp, probs, split_sizes, sorted_index):
    _check_fp8("moe_sort_chunks_by_index", inp)
    sizes = torch.as_tensor(split_sizes).long().cpu()
    order = torch.as_tensor(sorted_index).long().cpu()
    if int(sizes.sum()) != inp.size(0):
        raise ValueError(f"moe_sort_chunks_by_index: split_sizes sum to {int(sizes.sum())}, inp has {inp.size(0)} rows")
    if sorted(order.tolist()) != list(range(sizes.numel())):
        raise ValueError(f"moe_sort_chunks_by_index: sorted_index must be a permutation of range({sizes.numel()}), "
                         f"got {order.tolist()}")
    if not inp.numel():
        out, _ = _Empty.apply(inp, probs)
        return out, (probs.clone() if probs is not None else None)
    starts = torch.cumsum(sizes, 0) - sizes
    source = torch.cat([torch.arange(int(starts[i]), int(starts[i] + sizes[i])) for i in order.tolist()])
    source = source.to(inp.device)
    row = torch.arange(source.numel(), device=inp.device)
    column = probs.unsqueeze(1) if probs is not None else None
    out, permuted = _Permute.apply(inp, column, source, torch.zeros_like(source), row, inp.size(0), False)
    return out, permuted


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor) -> torch.Tensor:
    """Split `inp` along dim 0 into chunks of `split_sizes` rows and concatenate them in the order `sorted_index`."""
    return _sort_chunks(inp, None, split_sizes, sorted_index)[0]


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`moe_sort_chunks_by_index` that moves `probs` ([num_tokens]) with the rows. Returns `(output, probs)`."""
    if probs.dim() != 1 or probs.size(0) != inp.size(0):
        raise ValueError(f"moe_sort_chunks_by_index_with_probs: probs must be [num_tokens] ({inp.size(0)}), got "
                         f"{tuple(probs.shape)}")
    return _sort_chunks(inp, probs, split_sizes, sorted_index)
