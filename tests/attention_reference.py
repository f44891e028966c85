"""An independent float64 reference for attention, written from Transformer Engine's documented mask semantics with
explicit loops (no code shared with fp8kit.pytorch.attention), and plain-torch reference blocks.

Conventions: query i of sequence b may attend key j when every rule of the mask type allows it:
- padding: i < real_q[b] and j < real_kv[b] (padding masks here are right-padded: the first `real` positions are
  tokens), or, for explicit padding masks, not pad_q[b, i] and not pad_kv[b, j];
- causal: j <= i + diag, with diag = 0 (top-left), skv - sq (bottom-right), real_kv[b] - real_q[b] (bottom-right
  with padding);
- window (left, right): i + diag - left <= j <= i + diag + right (-1 = unbounded), diag as above (bottom-right
  unless the type is "causal" / "padding_causal" or bottom_right_diagonal=False);
- a user mask (True = masked out) removes pairs.
Rows with nothing to attend give 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def allowed_pairs(b, h, sq, skv, mask_type, window=None, bottom_right=None, pad_q=None, pad_kv=None,
                  user_mask=None) -> np.ndarray:
    """Boolean [b, h, sq, skv] of attendable pairs, from loops over the rules above. pad_q [b, sq], pad_kv [b, skv]
    (numpy bool, True = padded); user_mask broadcastable to [b, h, sq, skv] (True = masked out)."""
    out = np.ones((b, h, sq, skv), dtype=bool)
    if bottom_right is None:
        bottom_right = mask_type not in ("causal", "padding_causal")
    if mask_type in ("causal", "padding_causal"):
        bottom_right = False
    if "bottom_right" in mask_type:
        bottom_right = True
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask_type:
        right = 0
    for bi in range(b):
        real_q = sq if pad_q is None else int((~pad_q[bi]).sum())
        real_kv = skv if pad_kv is None else int((~pad_kv[bi]).sum())
        if not bottom_right:
            diag = 0
        elif "padding" in mask_type:
            diag = real_kv - real_q
        else:
            diag = skv - sq
        for i in range(sq):
            for j in range(skv):
                ok = True
                if "padding" in mask_type:
                    ok = ok and not pad_q[bi, i] and not pad_kv[bi, j]
                if left >= 0 and j < i + diag - left:
                    ok = False
                if right >= 0 and j > i + diag + right:
                    ok = False
                out[bi, :, i, j] = ok
    if user_mask is not None:
        out &= ~np.broadcast_to(np.asarray(user_mask), out.shape)
    return out


def attention(q, k, v, allowed, scale=None, bias=None):
    """Float64 attention. q [b, sq, h, d], k/v [b, skv, g, d] (torch, any float dtype, may require grad); allowed
    numpy [b, h, sq, skv]; bias (float) broadcastable to [b, h, sq, skv], added to the scaled scores. Returns
    [b, sq, h, dv] float64."""
    b, sq, h, d = q.shape
    g = k.shape[2]
    heads_per_group = h // g
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group_of = torch.tensor([i // heads_per_group for i in range(h)])
    kh, vh = k.double()[:, :, group_of], v.double()[:, :, group_of]  # [b, skv, h, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kh) * scale
    if bias is not None:
        scores = scores + bias.double()
    allowed_t = torch.from_numpy(np.ascontiguousarray(allowed))
    scores = scores.masked_fill(~allowed_t, float("-inf"))
    any_allowed = allowed_t.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_allowed, 0.0), dim=-1)
    probs = torch.where(any_allowed, probs, torch.zeros_like(probs))
    return torch.einsum("bhqk,bkhd->bqhd", probs, vh)


def right_padding(lengths, s) -> np.ndarray:
    """Padding [b, s] (True = padded) for sequences of the given lengths."""
    return np.array([[p >= n for p in range(s)] for n in lengths], dtype=bool)


def rope_reference(x: np.ndarray, positions: np.ndarray, dim: int, base: float = 10000.0,
                   interleaved: bool = False) -> np.ndarray:
    """Rotary embedding in float64 as complex rotations: channel pair (a, b) of frequency index m (pairs (m, m + dim/2)
    by default, (2m, 2m + 1) interleaved) is rotated by angle `position * base**(-2m / dim)`. x [..., n, d] with
    positions broadcastable to x[..., 0, 0] (one position per token)."""
    out = np.array(x, dtype=np.float64)
    half = dim // 2
    pos = np.asarray(positions, dtype=np.float64)[..., None, None]
    for m in range(half):
        theta = pos * base ** (-2.0 * m / dim)
        ia, ib = (2 * m, 2 * m + 1) if interleaved else (m, m + half)
        z = (out[..., ia] + 1j * out[..., ib]) * np.exp(1j * theta[..., 0])
        out[..., ia], out[..., ib] = z.real, z.imag
    return out
