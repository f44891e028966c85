"""How MultiheadAttention's fused projections are laid out (Transformer Engine's conventions), and its optional query /
key normalisation.

Self-attention, one projection of `(h + 2 g) * d` outputs (h query heads, g key/value groups, d the head size):
- `qkv_weight_interleaved=False` (always the case with `fuse_qkv_params=False`, where the weight is the three
  parameters `query_weight`, `key_weight`, `value_weight` concatenated): `[q heads 0..h-1 | k groups | v groups]`.
- `qkv_weight_interleaved=True` (with `fuse_qkv_params=True`): per group j, its `h / g` query heads, then its key,
  then its value: `[q(j, 0) .. q(j, h/g - 1), k(j), v(j)]` for j = 0..g-1.
Query head i attends with key/value group `i // (h / g)` in both.

Cross-attention, the key/value projection of `2 g d` outputs: `[k groups | v groups]`, or per group `[k(j), v(j)]`
when interleaved.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..modules import LayerNorm, RMSNorm

__all__ = ["split_qkv", "split_kv", "L2Normalization", "qk_norms"]


def split_qkv(mixed: torch.Tensor, heads: int, groups: int, head_dim: int,
              interleaved: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[..., (heads + 2 groups) * head_dim]` -> q `[..., heads, d]`, k, v `[..., groups, d]`."""
    per_group = heads // groups
    lead = mixed.shape[:-1]
    if interleaved:
        x = mixed.view(*lead, groups, per_group + 2, head_dim)
        q, k, v = torch.split(x, (per_group, 1, 1), dim=-2)
    else:
        x = mixed.view(*lead, per_group + 2, groups, head_dim)
        q, k, v = torch.split(x, (per_group, 1, 1), dim=-3)
    return q.reshape(*lead, heads, head_dim), k.reshape(*lead, groups, head_dim), v.reshape(*lead, groups, head_dim)


def split_kv(mixed: torch.Tensor, groups: int, head_dim: int, interleaved: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """`[..., 2 groups * head_dim]` -> k, v `[..., groups, d]`."""
    lead = mixed.shape[:-1]
    if interleaved:
        k, v = torch.split(mixed.view(*lead, groups, 2 * head_dim), head_dim, dim=-1)
    else:
        k, v = torch.split(mixed.view(*lead, 2 * groups, head_dim), groups, dim=-2)
    return k.reshape(*lead, groups, head_dim), v.reshape(*lead, groups, head_dim)


class L2Normalization(torch.nn.Module):
    """`x / sqrt(sum(x**2) + eps)` over the last dimension (the sum in float32); no parameters."""

    def __init__(self, eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + self.eps).to(x.dtype)


def qk_norms(qk_norm_type: Optional[str], eps: float, head_dim: int, device, params_dtype):
    """(q_norm, k_norm) modules over the head dimension, or (None, None)."""
    if qk_norm_type is None:
        return None, None
    if qk_norm_type == "L2Normalization":
        norm = L2Normalization(eps)
        return norm, norm
    if qk_norm_type in ("RMSNorm", "LayerNorm"):
        cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
        return tuple(cls(head_dim, eps=eps, device=device, params_dtype=params_dtype) for _ in range(2))
    raise ValueError(f"qk_norm_type must be None, 'L2Normalization', 'RMSNorm' or 'LayerNorm'; got {qk_norm_type!r}")
