"""Additive attention biases (Transformer Engine's `core_attention_bias_type`), as the float `attn_mask` of
`scaled_dot_product_attention` (added to the scaled scores):

- "no_bias": none.
- "post_scale_bias": `softmax(Q K^T * scale + bias)`, `core_attention_bias` broadcastable to `[b, h, sq, skv]`.
- "pre_scale_bias": `softmax((Q K^T + bias) * scale)`, i.e. a post-scale bias of `bias * scale`.
- "alibi": `-slope_h * |i - j + offset|` (offset: 0 top-left, `skv - sq` bottom-right, per sequence with padding),
  with `alibi_slopes` `[h]` or `[b, h]` (default: the ALiBi paper's geometric slopes, as Transformer Engine).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["BIAS_TYPES", "attention_bias", "default_alibi_slopes"]

BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


def default_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The ALiBi slopes of Press et al. for `num_heads` heads (float32), as Transformer Engine computes them."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (num_heads - n), 2))
        slopes = torch.cat([slopes, extra])
    return slopes.to(dtype=torch.float32, device=device)


def attention_bias(bias_type: str, bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                   shape, scale: float, bottom_right: bool, real_q: Optional[torch.Tensor],
                   real_kv: Optional[torch.Tensor], dtype: torch.dtype, device) -> Optional[torch.Tensor]:
    """The float bias `[B, H, sq, skv]` to add to the scaled scores, or None. `shape` = (b, h, sq, skv);
    `real_q`, `real_kv` `[b]`: the real sequence lengths under padding (bottom-right ALiBi), else None."""
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"core_attention_bias_type must be one of {', '.join(BIAS_TYPES)}; got {bias_type!r}")
    b, h, sq, skv = shape
    if bias_type in ("no_bias", "alibi"):
        if bias is not None:
            raise ValueError(f"core_attention_bias must be None for core_attention_bias_type={bias_type!r}")
    if alibi_slopes is not None and bias_type != "alibi":
        raise ValueError("alibi_slopes needs core_attention_bias_type='alibi'")
    if bias_type == "no_bias":
        return None
    if bias_type == "alibi":
        return _alibi(alibi_slopes, shape, bottom_right, real_q, real_kv, device).to(dtype)
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"core_attention_bias must be a floating tensor for core_attention_bias_type={bias_type!r}")
    try:
        ok = bias.dim() == 4 and torch.broadcast_shapes(tuple(bias.shape), tuple(shape)) == tuple(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"core_attention_bias of shape {list(bias.shape)} is not one of Transformer Engine's "
                         f"bias shapes (bhss, 1hss, b1ss, 11ss, 111s) for [b, h, sq, skv] = {list(shape)}")
    if bias_type == "pre_scale_bias":
        return (bias.float() * scale).to(dtype)
    return bias.to(dtype)


def _alibi(slopes, shape, bottom_right, real_q, real_kv, device) -> torch.Tensor:
    b, h, sq, skv = shape
    if slopes is None:
        slopes = default_alibi_slopes(h, device)
    if not isinstance(slopes, torch.Tensor) or tuple(slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes must have shape [{h}] or [{b}, {h}], got "
                         f"{list(getattr(slopes, 'shape', [])) or slopes!r}")
    rel = (torch.arange(sq, device=device).view(1, 1, sq, 1) - torch.arange(skv, device=device).view(1, 1, 1, skv))
    if bottom_right:
        if real_q is not None and real_kv is not None:
            rel = rel + (real_kv - real_q).view(-1, 1, 1, 1)
        else:
            rel = rel + (skv - sq)
    slopes = slopes.to(device=device, dtype=torch.float32)
    slopes = slopes.view(1, h, 1, 1) if slopes.dim() == 1 else slopes.view(b, h, 1, 1)
    return -rel.abs().float() * slopes
