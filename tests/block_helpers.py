"""Inputs shared by the block-scaling tests: every bf16 bit pattern, blocks mixing magnitudes over the full range,
special blocks (zero, NaN, inf, subnormal), as torch tensors and their float32 NumPy twins."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch


def all_bf16(shape, shuffle: bool, seed: int = 0) -> torch.Tensor:
    """All 65536 bf16 bit patterns (NaN and inf included) as a tensor of `shape` (65536 elements), in bit order or
    shuffled (then every block mixes magnitudes, signs and specials)."""
    bits = np.arange(65536, dtype=np.uint16)
    if shuffle:
        bits = np.random.default_rng(seed).permutation(bits)
    return torch.from_numpy(bits.astype(np.int16).reshape(shape)).view(torch.bfloat16)


def wide_range(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random signs and exponents over the whole range of `dtype` (subnormals included), random mantissas."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = int(np.log2(info.smallest_normal)) - info.bits // 4, int(np.log2(info.max))
    e = torch.randint(lo, hi + 1, shape, generator=g).double()
    m = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    s = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (s * m * torch.pow(2.0, e)).clamp(-info.max, info.max).to(dtype)


def special_blocks(block: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of `block` elements, each a special case: zeros, all NaN, one inf, inf and NaN, max values, subnormals,
    amax exactly 448 * 2^k and its neighbours, a tiny value next to a large one."""
    info = torch.finfo(dtype)
    nan, inf = float("nan"), float("inf")
    tiny = info.smallest_normal * 2.0 ** -3 if dtype != torch.float32 else 1e-42
    rows = [
        [0.0] * block,
        [nan] * block,
        [inf] + [1.0] * (block - 1),
        [-inf, nan] + [2.0 ** 100] * (block - 2),
        [info.max] * block,
        [-info.max] + [1.0] * (block - 1),
        [tiny] * block,
        [tiny, -tiny / 2] + [0.0] * (block - 2),
        [448.0] + [0.5] * (block - 1),
        [57344.0] + [3.0] * (block - 1),
        [448.0 * 2.0 ** -20] + [2.0 ** -30] * (block - 1),
        [nan] + [0.25] * (block - 1),
    ]
    t = torch.tensor(rows, dtype=torch.float64).to(dtype)
    # neighbours of 448 in the input dtype
    up = torch.nextafter(torch.tensor(448.0, dtype=dtype).float(), torch.tensor(1e9)).to(dtype)
    down = torch.nextafter(torch.tensor(448.0, dtype=dtype).float(), torch.tensor(0.0)).to(dtype)
    if dtype != torch.float32:
        up = (torch.tensor(448.0, dtype=dtype).view(torch.int16) + 1).view(dtype)
        down = (torch.tensor(448.0, dtype=dtype).view(torch.int16) - 1).view(dtype)
    extra = torch.stack([torch.full((block,), float(v), dtype=dtype) for v in (up, down)])
    return torch.cat([t, extra])


def to_np32(x: torch.Tensor) -> np.ndarray:
    """The float32 values of x (exact for bf16 / fp16 / fp32) as NumPy."""
    return x.float().numpy()


def bf16_np(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
