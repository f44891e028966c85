"""The random Hadamard transform (RHT) of NVFP4's column-wise operands, as Transformer Engine defines it
(pytorch/tensor/nvfp4_tensor.py: `get_wgrad_sign_vector`, `get_hadamard_matrix`, `get_rht_matrix`).

The 16x16 matrix is `diag(signs) @ H16 / 4`: H16 the Sylvester Hadamard matrix (entry (i, j) is
(-1)^popcount(i & j)), `signs` TE's fixed vector below (not drawn at run time: the same for every tensor and step).
Its entries are +-1/4, exact in bfloat16, the dtype TE keeps it in. It is orthogonal (its transpose undoes it).

`rht(x)` transforms each run of 16 consecutive values along x's last dim: `x16 @ M`. The products are exact; their
sum of 16 is formed in float64 and rounded once to float32, then to x's dtype, as TE's reference (a matmul in x's
dtype, float32 accumulation) does whenever its float32 sum is exact (TE's own kernels sum in another order).
"""

from __future__ import annotations

import torch

RHT_DIM = 16
# TE's hard-coded sign vector (get_wgrad_sign_vector); bit i of its mask is set where the sign is -1
WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

__all__ = ["RHT_DIM", "WGRAD_SIGNS", "hadamard_matrix", "rht_matrix", "sign_mask", "rht"]


def hadamard_matrix(device=None) -> torch.Tensor:
    """H16 / 4 in float32 (Sylvester order, entry (i, j) = (-1)^popcount(i & j) / 4)."""
    i = torch.arange(RHT_DIM, device=device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for b in range(4):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).float() * 0.25


def rht_matrix(with_random_sign_mask: bool = True, device=None) -> torch.Tensor:
    """TE's RHT matrix in bfloat16: diag(signs) @ H16 / 4 (signs all +1 without the random sign mask)."""
    signs = torch.tensor(WGRAD_SIGNS if with_random_sign_mask else (1,) * RHT_DIM, dtype=torch.float32,
                         device=device)
    return (signs[:, None] * hadamard_matrix(device)).to(torch.bfloat16)


def sign_mask(with_random_sign_mask: bool = True) -> int:
    """TE's `rht_matrix_random_sign_mask_t`: bit i set where sign i is -1 (0 without the random sign mask)."""
    if not with_random_sign_mask:
        return 0
    return sum(1 << i for i, s in enumerate(WGRAD_SIGNS) if s == -1)


def rht(x: torch.Tensor, with_random_sign_mask: bool = True) -> torch.Tensor:
    """x with every run of 16 values along its last dim multiplied by the RHT matrix (see the module docstring);
    the last dim must be a multiple of 16."""
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or n % RHT_DIM:
        raise ValueError(f"random Hadamard transform: the last dim must be a multiple of {RHT_DIM}, got shape "
                         f"{tuple(x.shape)}")
    m = rht_matrix(with_random_sign_mask, x.device).double()
    y = x.double().reshape(-1, RHT_DIM) @ m
    return y.float().to(x.dtype).reshape(x.shape)
