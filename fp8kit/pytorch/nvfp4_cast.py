"""NVFP4 casts as pure functions on tensors: E2M1 values (4 bits, packed two per byte), one E4M3 scale per 16
consecutive values (or per 16x16 block) and one float32 scale per tensor, as Transformer Engine computes them
(common/cast/nvfp4/core_nvfp4.cuh, quantize_transpose_nvfp4.cuh and its reference quantizer
pytorch/custom_recipes/reference_nvfp4.py). Torch operations only: any device, no host synchronisation.

The rules, in float32 (each operation rounds to nearest even), for a tensor with amax `A` (NaN ignored):
1. global encode scale `S = 2688 / A` (2688 = 6 * 448); `S` above float32's max (A tiny) becomes float32's max;
   A = 0 or `S` = 0 (A infinite) gives 1. Global decode scale `D = 1 / S`.
2. block scale (per 1x16 or 16x16 block with amax `a`): `e4m3(a * (S * float32(1/6)))`, the conversion saturating
   to 448 (satfinite); its float32 value `s`.
3. block encode factor `f = min(1 / (s * D), float32 max)` (a zero block: `f` = float32 max).
4. each value: `v = clamp(x * f, -6, 6)` (NaN stays), then E2M1 by round-to-nearest-even, or stochastically
   (`stochastic_rounding`): up with probability (|v| - lo) / (hi - lo) between the neighbouring E2M1 magnitudes.
   The sign bit is x's sign bit (so -0.0 gives the code of -0); NaN gives code 0, as TE's reference quantizer.
5. packing: element 2i in the low nibble of byte i, element 2i+1 in the high nibble.

Row-scaled NVFP4 (`row_scaled`, TE's `row_scaled_nvfp4`, 1x16 blocks only): rule 1 per row instead of per tensor,
each row's amax `A_r` giving its own `S_r` and `D_r`, which rules 2 to 4 use for that row's blocks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .block_cast import f32, nan_free_abs

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = float(torch.finfo(torch.float32).max)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative

__all__ = ["NVFP4_BLOCK", "E2M1_VALUES", "global_encode_scale", "block_scales", "e2m1_codes", "pack_e2m1",
           "unpack_e2m1", "e2m1_decode", "nvfp4_cast"]

# the code of an E2M1 magnitude m, indexed by 2 * m (0, 1, 2, 3, 4, 6, 8, 12; other entries unused)
_CODE_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """Rule 1: `2688 / amax` in float32, float32 max where that overflows (or is NaN), 1 where amax is 0 or the
    quotient is 0."""
    a = amax.float()
    s = torch.div(_const(E2M1_MAX * E4M3_MAX, a), a)
    s = torch.where(torch.isnan(s) | (s > FLT_MAX), _const(FLT_MAX, a), s)
    return torch.where((a == 0) | (s == 0), _const(1.0, a), s)


def block_scales(block_amax: torch.Tensor, encode: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rule 2 and 3: (E4M3 scale bytes uint8, float32 encode factor f) of blocks with float32 `block_amax`."""
    mult = encode * _const(f32(1.0 / 6.0), encode)
    dec = block_amax.float() * mult
    dec = torch.where(torch.isnan(dec), _const(FLT_MAX, dec), dec).clamp(-E4M3_MAX, E4M3_MAX)
    code = dec.to(torch.float8_e4m3fn)
    decode_global = torch.reciprocal(encode)
    f = torch.reciprocal(code.float() * decode_global)
    f = torch.where(f > FLT_MAX, _const(FLT_MAX, f), f)
    return code.view(torch.uint8), f


def e2m1_codes(v: torch.Tensor, rand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rule 4's E2M1 codes (uint8, 0..15) of the float32 `v` (already clamped to [-6, 6]): round to nearest even,
    or stochastically with `rand` (uniform [0, 1) float32 of v's shape): up when rand < (|v| - lo) / (hi - lo).

    The E2M1 magnitudes are evenly spaced by h = 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so rounding is
    `h * round(|v| / h)` with torch.round's ties-to-even on the (exact) quotient, and the stochastic fraction
    `(|v| - lo) / h` is exact."""
    nan = torch.isnan(v)
    a = v.abs().masked_fill(nan, 0.0)
    h = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)
    if rand is None:
        mag = torch.round(a / h) * h
    else:
        lo = torch.floor(a / h) * h
        mag = lo + torch.where(rand < (a - lo) / h, h, torch.zeros_like(h))
    code = _CODE_OF_TWICE.to(v.device)[(mag * 2).long()]
    code = code | (torch.signbit(v).to(torch.uint8) << 3)
    return code.masked_fill(nan, 0)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Rule 5: (..., K) codes -> (..., K / 2) bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K / 2) bytes -> (..., K) codes."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (code 8, -0, gives -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def nvfp4_cast(x: torch.Tensor, amax: Optional[torch.Tensor] = None, two_d: bool = False,
               rand: Optional[torch.Tensor] = None,
               row_scaled: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the (M, K) tensor `x` (M, K multiples of 16): 1x16 blocks along K, or 16x16 blocks (`two_d`), with
    the per-tensor `amax` (float32, (1,); None: x's own, rule 1). Returns (packed uint8 (M, K / 2), E4M3 scale bytes
    uint8 (M, K / 16), a 16x16 block's scale repeated on its 16 rows; the amax used). `rand`: uniform draws of x's
    shape for stochastic rounding (None: round to nearest even). `row_scaled`: one amax per row (float32 (M,), x's
    own rows' when `amax` is None), 1x16 blocks only."""
    m, k = x.shape
    if m % NVFP4_BLOCK or k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs dims divisible by {NVFP4_BLOCK}: got shape ({m}, {k})")
    if two_d:
        tiles = x.reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK)
        block_amax = nan_free_abs(tiles).amax(dim=(1, 3)).float()
    else:
        block_amax = nan_free_abs(x.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)).amax(dim=2).float()
    if row_scaled:
        if two_d:
            raise ValueError("row-scaled NVFP4 supports 1x16 blocks only, not 16x16 (2D) quantization")
        if amax is None:  # a row's largest block amax is the row's (NaN ignored in both)
            amax = block_amax.amax(dim=1) if k else torch.zeros(m, device=x.device)
        encode = global_encode_scale(amax).reshape(m, 1)
    else:
        if amax is None:  # the largest block amax is the tensor's (NaN ignored in both)
            amax = block_amax.amax().reshape(1) if block_amax.numel() else torch.zeros(1, device=x.device)
        encode = global_encode_scale(amax).reshape(())
    if two_d:
        block_amax = block_amax.repeat_interleave(NVFP4_BLOCK, dim=0)
    scale_bytes, factor = block_scales(block_amax, encode)
    v = x.float().reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK) * factor[:, :, None]
    v = v.clamp(-E2M1_MAX, E2M1_MAX).reshape(m, k)
    return pack_e2m1(e2m1_codes(v, rand)), scale_bytes, amax
