"""Attention masks with Transformer Engine's conventions.

A user mask holds True where a position is MASKED OUT (Transformer Engine's convention, the opposite of
`torch.nn.functional.scaled_dot_product_attention`'s boolean `attn_mask`). The mask types:

- "no_mask": every query sees every key.
- "causal": query i sees keys j <= i, the diagonal aligned to the top-left corner of the [sq, skv] matrix.
- "causal_bottom_right": the diagonal aligned to the bottom-right corner: j <= i + skv - sq.
- "padding": padded queries and keys take no part; the padding comes as a `[b, 1, 1, s]` boolean mask (a tuple of
  two, queries then keys, for cross-attention) or as `cu_seqlens` (the first `seqlen` positions of each sequence
  are real).
- "padding_causal" / "padding_causal_bottom_right": both; bottom-right uses each sequence's real lengths.
- "arbitrary": a user mask broadcastable to `[b, h, sq, skv]`.

`window_size = (left, right)` restricts query i to keys in `[i + d - left, i + d + right]` (`d` the diagonal's offset:
0 top-left, `skv - sq` bottom-right, per sequence with padding); -1 means unbounded. Causal types force
`right = 0`. Rows left with no key to attend (padded queries, or a window/diagonal that leaves a row empty) give a
zero output.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

__all__ = ["MASK_TYPES", "canonical_mask_type", "checked_window_size", "bottom_right_alignment", "padding_from_mask",
           "padding_from_cu_seqlens", "allowed_positions", "check_arbitrary_mask", "seqlens_of"]

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right",
              "arbitrary")


def canonical_mask_type(value, arg: str = "attn_mask_type") -> str:
    """The mask type with Transformer Engine's aliases resolved ("padding,causal", "causal,padding",
    "causal_padding" -> "padding_causal"); an unknown type raises ValueError naming `arg`."""
    if not isinstance(value, str):
        raise ValueError(f"{arg} must be one of {', '.join(MASK_TYPES)}; got {value!r}")
    name = value.replace(",", "_")
    if name == "causal_padding":
        name = "padding_causal"
    if name not in MASK_TYPES:
        raise ValueError(f"{arg} must be one of {', '.join(MASK_TYPES)}; got {value!r}")
    return name


def checked_window_size(mask_type: str, window_size, arg: str = "window_size") -> Tuple[int, int]:
    """Transformer Engine's rule for sliding windows: causal types take (-1, 0) or (>= 0, 0), the others (-1, -1)
    or (>= 0, >= 0). None gives the type's default; a window that disagrees with a causal type is adjusted with a
    warning (as in Transformer Engine); an impossible one raises ValueError naming `arg`."""
    if window_size is not None:
        ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
            isinstance(w, int) and not isinstance(w, bool) for w in window_size)
        if not ok:
            raise ValueError(f"{arg} must be None or a pair of ints (left, right), got {window_size!r}")
        window_size = (int(window_size[0]), int(window_size[1]))
    if "causal" in mask_type:
        if window_size is None:
            return (-1, 0)
        if window_size == (-1, -1) or (window_size[0] >= 0 and window_size[1] != 0):
            warnings.warn(f"{arg}={window_size} becomes ({window_size[0]}, 0) for attn_mask_type={mask_type!r}",
                          stacklevel=3)
            return (window_size[0], 0)
        if window_size != (-1, 0) and (window_size[0] < 0 or window_size[1] != 0):
            raise ValueError(f"{arg} must be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type!r}, got {window_size}")
        return window_size
    if window_size is None:
        return (-1, -1)
    if window_size == (-1, 0):
        warnings.warn(f"{arg}=(-1, 0) becomes (-1, -1) for attn_mask_type={mask_type!r} (use a causal type for a "
                      "causal mask)", stacklevel=3)
        return (-1, -1)
    if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
        raise ValueError(f"{arg} must be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type!r}, got {window_size}")
    return window_size


def bottom_right_alignment(mask_type: str, bottom_right_diagonal: Optional[bool]) -> bool:
    """Transformer Engine's rule: "causal" and "padding_causal" align top-left, the "_bottom_right" types
    bottom-right, the others follow `bottom_right_diagonal` (default True)."""
    if mask_type in ("causal", "padding_causal"):
        return False
    if "bottom_right" in mask_type or bottom_right_diagonal is None:
        return True
    return bool(bottom_right_diagonal)


def padding_from_mask(mask, batch: int, seqlen: int, arg: str, device=None) -> torch.Tensor:
    """A `[b, 1, 1, s]` boolean padding mask (True = padded) as `[b, s]`; a wrong shape or dtype raises naming
    `arg`."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{arg} must be a boolean tensor of shape [{batch}, 1, 1, {seqlen}], got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{arg} must be a boolean tensor (True = padded), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, 1, 1, seqlen):
        raise ValueError(f"{arg}: a padding mask has shape [batch, 1, 1, seqlen] = [{batch}, 1, 1, {seqlen}], got "
                         f"{list(mask.shape)}")
    return mask.reshape(batch, seqlen).to(device if device is not None else mask.device)


def padding_from_cu_seqlens(cu_seqlens, batch: int, seqlen: int, arg: str, device=None) -> torch.Tensor:
    """Padding `[b, s]` (True = padded) from cumulative sequence lengths `[b + 1]`: sequence i holds its first
    `cu_seqlens[i + 1] - cu_seqlens[i]` positions."""
    lengths = seqlens_of(cu_seqlens, batch, arg)
    bad = (lengths < 0) | (lengths > seqlen)
    if bool(bad.any()):
        raise ValueError(f"{arg}: sequence lengths {lengths.tolist()} must lie in [0, {seqlen}]")
    device = device if device is not None else lengths.device
    positions = torch.arange(seqlen, device=device)
    return positions.view(1, seqlen) >= lengths.to(device).view(batch, 1)


def seqlens_of(cu_seqlens, batch: int, arg: str) -> torch.Tensor:
    """The lengths `cu_seqlens[1:] - cu_seqlens[:-1]` (int64) of the first `batch` sequences, validated."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{arg} must be a 1-D integer tensor [batch_size + 1], got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                         f"{list(getattr(cu_seqlens, 'shape', []))}")
    if cu_seqlens.numel() < batch + 1:
        raise ValueError(f"{arg} has {cu_seqlens.numel()} entries; a batch of {batch} needs {batch + 1}")
    cu = cu_seqlens[:batch + 1].long()
    return cu[1:] - cu[:-1]


def check_arbitrary_mask(mask, shape: Tuple[int, int, int, int], arg: str = "attention_mask") -> torch.Tensor:
    """A boolean mask (True = masked out) broadcastable to `shape` = [b, h, sq, skv], as a 4-D tensor."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{arg} must be a boolean tensor broadcastable to {list(shape)}, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{arg} must be a boolean tensor (True = masked out), got dtype {mask.dtype}")
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(tuple(mask.shape), shape) == tuple(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{arg} of shape {list(mask.shape)} is not broadcastable to [batch, heads, seqlen_q, "
                         f"seqlen_kv] = {list(shape)}")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def allowed_positions(sq: int, skv: int, mask_type: str, window: Tuple[int, int], bottom_right: bool,
                      pad_q: Optional[torch.Tensor], pad_kv: Optional[torch.Tensor],
                      masked: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Boolean `[B, H, sq, skv]` (B, H possibly 1), True where query i may attend key j; None when every pair may.

    pad_q `[b, sq]`, pad_kv `[b, skv]`: True at padded positions (padding types). masked: a 4-D user mask, True
    = masked out (arbitrary masks, or a mask given alongside another type)."""
    left, right = window
    if "causal" in mask_type:
        right = 0
    allowed = None
    if left >= 0 or right >= 0:
        rows = torch.arange(sq, device=device).view(1, 1, sq, 1)
        cols = torch.arange(skv, device=device).view(1, 1, 1, skv)
        if not bottom_right:
            offset = 0
        elif "padding" in mask_type and pad_q is not None and pad_kv is not None:
            real_q = (~pad_q).sum(-1)
            real_kv = (~pad_kv).sum(-1)
            offset = (real_kv - real_q).view(-1, 1, 1, 1)
        else:
            offset = skv - sq
        rel = cols - rows - offset  # the key's distance right of the query's diagonal
        allowed = torch.ones(1, 1, sq, skv, dtype=torch.bool, device=device)
        if left >= 0:
            allowed = allowed & (rel >= -left)
        if right >= 0:
            allowed = allowed & (rel <= right)
    if pad_q is not None and pad_kv is not None:
        pads = ~pad_q[:, None, :, None] & ~pad_kv[:, None, None, :]
        allowed = pads if allowed is None else allowed & pads
    if masked is not None:
        allowed = ~masked if allowed is None else allowed & ~masked
    return allowed
