"""Rotary position embeddings (Su et al., https://arxiv.org/abs/2104.09864) with Transformer Engine's API.

`RotaryPositionEmbedding(dim)(max_seq_len)` gives the angles `freqs [s, 1, 1, dim]` (float32): position p times
`inv_freq = 1 / rotary_base ** (arange(0, dim, 2) / dim)`, laid out as `cat(f, f)` (default) or interleaved
`f0 f0 f1 f1 ...` (`interleaved=True`). `apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first `dim`
channels of each head of `t`:

    t' = t * cos(freqs) + rotate_half(t) * sin(freqs)

with `rotate_half([x1, x2]) = [-x2, x1]` on the two halves (default), or on (even, odd) channel pairs when
interleaved; cos and sin are computed in float32 and rounded to t's dtype, as Transformer Engine's unfused path does.
Channels past `dim` pass through unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]


class RotaryPositionEmbedding(torch.nn.Module):
    """The angle table of rotary position embeddings.

    Args (Transformer Engine's): dim (rotary dimension), rotary_percent (use `int(dim * rotary_percent)` channels),
    seq_len_interpolation_factor (divide positions by it: position interpolation), pretrained_max_position_embeddings
    (with the factor: beyond `pretrained * factor` positions, scale positions by `pretrained / max_seq_len`
    instead), rotary_base, interleaved. The buffer `inv_freq` lives on torch's default device (not on CUDA as in
    Transformer Engine); move the module with `.to()`.
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 2:
            raise ValueError(f"RotaryPositionEmbedding: dim must be an int >= 2, got {dim!r}")
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"RotaryPositionEmbedding: rotary_percent must lie in (0, 1], got {rotary_percent!r}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rotary_base = rotary_base
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """The angles of positions `offset .. offset + max_seq_len - 1`: `[max_seq_len, 1, 1, dim]` float32."""
        device = self.inv_freq.device
        with torch.autocast(device.type, enabled=False):
            seq = torch.arange(max_seq_len, device=device, dtype=self.inv_freq.dtype) + offset
            factor, pretrained = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
            if pretrained is not None and factor is not None:
                if max_seq_len > pretrained * factor:
                    seq *= 1 / (max_seq_len / pretrained)  # dynamic linear scaling
                else:
                    seq *= 1 / factor
            freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        if not self.interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.reshape(x.shape)


def _rotate(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """freqs broadcastable to t's leading dims with the rotary channels last."""
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    dim = freqs.shape[-1]
    rot, rest = t[..., :dim], t[..., dim:]
    rot = rot * cos + _rotate_half(rot, interleaved) * sin
    return torch.cat((rot, rest), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
                         fused: bool = False, cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """Rotate `t` (`[s, b, h, d]` "sbhd", `[b, s, h, d]` "bshd", or `[t, h, d]` "thd" with `cu_seqlens`) by the
    angles `freqs [s2, 1, 1, d2]` (s2 >= the positions used, d2 <= d). Each sequence starts at position
    `start_positions[i]` (None: 0), e.g. its cached length during generation. `fused` selects a kernel in
    Transformer Engine; here both give this function's result. Context parallelism (cp_size > 1) is not
    implemented."""
    if cp_size != 1:
        raise NotImplementedError("apply_rotary_pos_emb: context parallelism (cp_size > 1) is not implemented")
    if tensor_format not in ("sbhd", "bshd", "thd"):
        raise ValueError(f"apply_rotary_pos_emb: tensor_format must be 'sbhd', 'bshd' or 'thd', got {tensor_format!r}")
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) \
            or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: freqs must have shape [s, 1, 1, d2] with d2 <= {t.shape[-1]}, got "
                         f"{list(getattr(freqs, 'shape', []))}")
    table = freqs.float().reshape(freqs.shape[0], freqs.shape[-1]).to(t.device)  # [s2, d2]
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("apply_rotary_pos_emb: tensor_format='thd' needs cu_seqlens")
        cu = cu_seqlens.to(t.device).long()
        tokens = torch.arange(t.shape[0], device=t.device)
        seq = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=cu.numel() - 2)
        positions = tokens - cu[seq]
        if start_positions is not None:
            positions = positions + start_positions.to(t.device).long()[seq]
        inside = tokens < cu[-1]
        _check_positions(positions[inside], table.shape[0])
        angles = table[positions.clamp(0, table.shape[0] - 1)].unsqueeze(1)  # [t, 1, d2]
        rotated = _rotate(t, angles, interleaved)
        return torch.where(inside.view(-1, 1, 1), rotated, t)
    s = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    b = t.shape[1] if tensor_format == "sbhd" else t.shape[0]
    positions = torch.arange(s, device=t.device).view(1, s)
    if start_positions is not None:
        positions = positions + start_positions.to(t.device).long()[:b].view(b, 1)
        _check_positions(positions, table.shape[0])
    elif s > table.shape[0]:
        _check_positions(positions, table.shape[0])
    angles = table[positions]  # [1 or b, s, d2]
    angles = angles.transpose(0, 1) if tensor_format == "sbhd" else angles
    return _rotate(t, angles.unsqueeze(2), interleaved)


def _check_positions(positions: torch.Tensor, available: int) -> None:
    if positions.numel() and int(positions.max()) >= available:
        raise ValueError(f"apply_rotary_pos_emb: positions up to {int(positions.max())} need freqs for at least "
                         f"{int(positions.max()) + 1} positions, got {available}")
