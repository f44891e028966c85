"""The random Hadamard transform (RHT) of NVFP4's column-wise operands in JAX, the same transform as
fp8kit/pytorch/hadamard.py (Transformer Engine's `get_rht_matrix`): the 16x16 matrix `diag(signs) @ H16 / 4`, H16 the
Sylvester Hadamard matrix and `signs` TE's fixed vector (the same for every tensor and step). Orthogonal: its
transpose undoes it.

`rht(x)` multiplies every run of 16 consecutive values along x's last dim by the matrix. The products x_i * (+-1/4)
are exact; their sum of 16 is accumulated without rounding error as an unevaluated float32 pair (hi, lo), with
Knuth's two-sum at each step, so `hi` is the exact sum rounded once to float32 wherever the pair holds the sum
exactly (a block whose values span less than about 2^24 in magnitude beyond float32's 24 bits; float64, which the
PyTorch side sums in, has the same kind of limit). Then the result is rounded to x's dtype. The same bits as the
PyTorch side for such blocks; values near float32's subnormal range are flushed by XLA:CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .cast import F32

RHT_DIM = 16
# Transformer Engine's hard-coded sign vector (get_wgrad_sign_vector)
WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

__all__ = ["RHT_DIM", "WGRAD_SIGNS", "hadamard_matrix", "rht_matrix", "rht"]


def hadamard_matrix() -> np.ndarray:
    """H16 / 4 in float32 (Sylvester order, entry (i, j) = (-1)^popcount(i & j) / 4)."""
    i = np.arange(RHT_DIM)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return ((1 - 2 * parity) * 0.25).astype(np.float32)


def rht_matrix(with_random_sign_mask: bool = True) -> np.ndarray:
    """The RHT matrix as float32 (its entries +-1/4, exact in bfloat16 where Transformer Engine keeps it):
    diag(signs) @ H16 / 4 (signs all +1 without the random sign mask)."""
    signs = np.array(WGRAD_SIGNS if with_random_sign_mask else (1,) * RHT_DIM, dtype=np.float32)
    return signs[:, None] * hadamard_matrix()


def _two_sum(a: jax.Array, b: jax.Array):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def rht(x: jax.Array, with_random_sign_mask: bool = True) -> jax.Array:
    """x with every run of 16 values along its last dim multiplied by the RHT matrix (see the module docstring);
    the last dim must be a multiple of 16."""
    if x.ndim == 0 or x.shape[-1] % RHT_DIM:
        raise ValueError(f"random Hadamard transform: the last dim must be a multiple of {RHT_DIM}, got shape "
                         f"{tuple(x.shape)}")
    m = rht_matrix(with_random_sign_mask)
    v = x.astype(F32).reshape(-1, RHT_DIM)
    hi = lo = plain = None
    for i in range(RHT_DIM):
        t = v[:, i, None] * jnp.asarray(m[i])[None, :]  # exact: a multiple by +-1/4
        if hi is None:
            hi, lo, plain = t, jnp.zeros_like(t), t
            continue
        plain = plain + t
        hi, e = _two_sum(hi, t)
        lo = lo + e
        hi, lo = _two_sum(hi, lo)
    y = jnp.where(jnp.isfinite(hi), hi, plain)  # inf / NaN inputs: the two-sum's error terms are NaN
    return y.astype(x.dtype).reshape(x.shape)
