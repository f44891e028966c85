"""The attention core: `softmax(Q K^T * scale + bias, masked) V` with dropout, on batch-first heads-second tensors,
through `torch.nn.functional.scaled_dot_product_attention` (so torch picks its fastest kernel: flash attention for
causal or unmasked inputs on GPUs). It runs in the inputs' precision; no FP8 is involved."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["attend"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, allowed: Optional[torch.Tensor],
           bias: Optional[torch.Tensor], is_causal: bool, dropout_p: float, scale: float,
           dropout_context: Optional[Callable] = None) -> torch.Tensor:
    """q `[b, h, sq, d]`, k `[b, g, skv, d]`, v `[b, g, skv, dv]` (h a multiple of g: query head i uses key/value
    head i // (h / g)) -> `[b, h, sq, dv]`.

    allowed: boolean `[B, H, sq, skv]`, True where a query may attend a key (None: all may; `is_causal` instead
    applies torch's top-left causal mask). Rows with no allowed key give zeros. bias: float, added to the scaled
    scores. dropout_context: a context manager factory the dropout runs under (e.g. a named RNG state)."""
    empty = None
    mask = allowed
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        mask = allowed | empty  # attend somewhere finite; the row is zeroed below
    if bias is not None:
        mask = bias if mask is None else torch.where(mask, bias, float("-inf"))  # broadcasts both
    with (dropout_context() if dropout_context is not None and dropout_p > 0 else contextlib.nullcontext()):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out
