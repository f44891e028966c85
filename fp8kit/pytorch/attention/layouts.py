"""The query/key/value layouts of Transformer Engine's `qkv_format`, and their conversion to the batch-first padded
layout the attention core runs on.

- "sbhd": `[seq, batch, heads, dim]`; the output is `[seq, batch, heads * dim]`.
- "bshd": `[batch, seq, heads, dim]`; the output is `[batch, seq, heads * dim]`.
- "thd": `[tokens, heads, dim]`, the sequences of a batch packed one after another (no padding), delimited by
  `cu_seqlens` `[batch + 1]` (sequence i is tokens `cu_seqlens[i]:cu_seqlens[i + 1]`), or placed at
  `cu_seqlens_padded` when there are unused tokens between them; the output is `[tokens, heads * dim]`, zero at
  tokens that belong to no sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .masks import seqlens_of

__all__ = ["QKV_FORMATS", "check_qkv_format", "to_batch_first", "output_from_batch_first", "PackedIndex",
           "packed_index"]

QKV_FORMATS = ("sbhd", "bshd", "thd")


def check_qkv_format(value, arg: str = "qkv_format") -> str:
    if value not in QKV_FORMATS:
        raise ValueError(f"{arg} must be one of 'sbhd', 'bshd', 'thd'; got {value!r}")
    return value


def to_batch_first(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """`[b, s, h, d]` view of a "sbhd" or "bshd" tensor."""
    return x.transpose(0, 1) if qkv_format == "sbhd" else x


def output_from_batch_first(out: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """The attention output `[b, h, s, d]` in the layout of `qkv_format` ("sbhd" or "bshd"), heads merged."""
    b, h, s, d = out.shape
    if qkv_format == "sbhd":
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return out.transpose(1, 2).reshape(b, s, h * d)


@dataclass
class PackedIndex:
    """Where the sequences of a packed ("thd") tensor lie: token `index[i, p]` is position p of sequence i when
    `valid[i, p]`."""

    index: torch.Tensor  # [b, S] int64 (0 where not valid)
    valid: torch.Tensor  # [b, S] bool
    tokens: int

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, ...]` -> `[b, S, ...]` (padded positions hold a copy of token 0; they are masked out)."""
        return x[self.index]

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """`[b, S, ...]` -> `[tokens, ...]`; tokens outside every sequence are zero."""
        out = y.new_zeros((self.tokens,) + tuple(y.shape[2:]))
        return out.index_put((self.index[self.valid],), y[self.valid])


def packed_index(cu_seqlens, cu_seqlens_padded: Optional[torch.Tensor], tokens: int, max_seqlen: Optional[int],
                 arg: str, device=None) -> PackedIndex:
    """The PackedIndex of a "thd" tensor of `tokens` tokens. `max_seqlen` (None: the longest sequence) sets the
    padded length S; a sequence longer than S, or one that runs past the last token, raises ValueError naming
    `arg`. (Reads the lengths on the host, as Transformer Engine does when max_seqlen is not given.)"""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{arg} must be a 1-D integer tensor [batch_size + 1] for qkv_format='thd', got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens.shape)}")
    batch = cu_seqlens.numel() - 1
    lengths = seqlens_of(cu_seqlens, batch, arg)
    if cu_seqlens_padded is None:
        starts = cu_seqlens[:-1].long()
    else:
        padded_lengths = seqlens_of(cu_seqlens_padded, batch, f"{arg}_padded")
        if cu_seqlens_padded.numel() != batch + 1:
            raise ValueError(f"{arg}_padded has {cu_seqlens_padded.numel()} entries, {arg} has {batch + 1}")
        if bool((padded_lengths < lengths).any()):
            raise ValueError(f"{arg}_padded leaves less room ({padded_lengths.tolist()}) than the sequence lengths "
                             f"{lengths.tolist()}")
        starts = cu_seqlens_padded[:-1].long()
    longest = int(lengths.max()) if batch else 0
    if bool((lengths < 0).any()) or bool((starts < 0).any()):
        raise ValueError(f"{arg} must not decrease, got {cu_seqlens.tolist()}")
    if batch and int((starts + lengths).max()) > tokens:
        raise ValueError(f"{arg} describes sequences up to token {int((starts + lengths).max())}, but the tensor has "
                         f"{tokens} tokens")
    if max_seqlen is None:
        max_seqlen = longest
    elif longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence in {arg} ({longest})")
    device = device if device is not None else lengths.device
    lengths, starts = lengths.to(device), starts.to(device)
    positions = torch.arange(max_seqlen, device=device).view(1, -1)
    valid = positions < lengths.view(-1, 1)
    index = torch.where(valid, starts.view(-1, 1) + positions, torch.zeros_like(positions))
    return PackedIndex(index, valid, tokens)
