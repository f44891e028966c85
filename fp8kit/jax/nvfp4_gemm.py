"""NVFP4 GEMM operands and the NVFP4 GEMM, emulated with jax.numpy (jit-able, no host sync), in the order of
fp8kit/pytorch/nvfp4_gemm.py (Transformer Engine's reference `qgemm`); the same bits as the PyTorch side.

`nvfp4_operand(x, spec, transpose, key)` quantizes a 2-D array as one GEMM operand with its contraction dim last:
x (rowwise usage, blocks along x's last dim) or x.T (columnwise usage: after the random Hadamard transform when
the role has one; its amax taken after the transform), from the high-precision x as Transformer Engine does. With
16x16 blocks both usages share each block's amax. Stochastic rounding draws `jax.random.uniform(key, ...)`.

`nvfp4_gemm(A, B)` computes `A @ B^T` for A (M, K) and B (N, K):
1. per 16-wide K block j, the dot product P_j of the E2M1 values (multiples of 1/4 below 16 * 36: exact in
   float32 in any order);
2. `y = y + (sa_j * sb_j) * P_j` in float32, j increasing (the E4M3 scales' product and its product with P_j are
   exact: only the additions round);
3. `y = alpha * y`, `alpha = float32(amax_a * amax_b) / (6 * 6 * 448 * 448)`.
K must be a multiple of 32 and N of 8, as Transformer Engine's NVFP4 GEMM requires.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from . import nvfp4_cast as nc
from .cast import F32, mul_scale_inv, reciprocal
from .hadamard import rht

__all__ = ["NVFP4Spec", "NVFP4Operand", "nvfp4_operand", "nvfp4_gemm", "dequantize_nvfp4"]

_ALPHA_DIVISOR = 6.0 * 6.0 * 448.0 * 448.0


@dataclasses.dataclass(frozen=True)
class NVFP4Spec:
    """How one tensor role is quantized (its QParams): random Hadamard transform of the columnwise usage, 16x16
    blocks, stochastic rounding."""

    rht: bool = False
    two_d: bool = False
    stochastic_rounding: bool = False


class NVFP4Operand(NamedTuple):
    """Packed E2M1 bytes (rows, K / 2), E4M3 scale bytes (rows, K / 16), float32 amax (scalar), as pytree leaves."""

    data: jax.Array
    scales: jax.Array
    amax: jax.Array


def nvfp4_operand(x: jax.Array, spec: NVFP4Spec, transpose: bool = False, key: Optional[jax.Array] = None,
                  axis_names: Tuple[str, ...] = ()) -> NVFP4Operand:
    """The operand `x` (M, K) (contraction over K), or `x.T` (K, M) with `transpose` (contraction over M; the
    columnwise usage, transformed when `spec.rht`). `key`: the PRNG key of stochastic rounding (needed when
    `spec.stochastic_rounding`). `axis_names`: inside `shard_map`, the mesh axes to all-reduce the amax over."""
    t = x.T if transpose else x
    if transpose and spec.rht:
        t = rht(t)
    rand = None
    if spec.stochastic_rounding:
        if key is None:
            raise ValueError("nvfp4_operand: stochastic rounding needs a PRNG key (key=jax.random.key(...))")
        rand = jax.random.uniform(key, t.shape, F32)
    return NVFP4Operand(*nc.nvfp4_cast(t, spec.two_d, rand, axis_names))


def _values(op: NVFP4Operand) -> jax.Array:
    return nc.e2m1_decode(nc.unpack_e2m1(op.data))


def dequantize_nvfp4(op: NVFP4Operand) -> jax.Array:
    """float32 `e2m1 * e4m3_scale * (amax / 2688)` per block (the global decode scale of the cast), the operand's
    layout (a columnwise usage with RHT gives the transformed tensor)."""
    v = _values(op)
    rows, k = v.shape
    s = mul_scale_inv(nc.e4m3_decode(op.scales), reciprocal(nc.global_encode_scale(op.amax)))
    return (v.reshape(rows, k // nc.NVFP4_BLOCK, nc.NVFP4_BLOCK) * s[:, :, None]).reshape(rows, k)


_BATCHED = (((2,), (2,)), ((0,), (0,)))  # (nb, M, 16) . (nb, N, 16) -> (nb, M, N)


def nvfp4_gemm(a: NVFP4Operand, b: NVFP4Operand) -> jax.Array:
    """float32 `A @ B^T` (M, N) for NVFP4 operands A (M, K) and B (N, K) (see the module docstring)."""
    m, k = a.data.shape[0], a.data.shape[1] * 2
    n = b.data.shape[0]
    if b.data.shape[1] * 2 != k:
        raise ValueError(f"nvfp4_gemm: contraction dims differ: A has K={k}, B has K={b.data.shape[1] * 2}")
    if k % 32 or n % 8:
        raise ValueError(f"nvfp4_gemm: NVFP4 GEMMs need K divisible by 32 and N by 8 (as Transformer Engine's), "
                         f"got M={m}, N={n}, K={k}")
    nb = k // nc.NVFP4_BLOCK
    av = _values(a).reshape(m, nb, nc.NVFP4_BLOCK).transpose(1, 0, 2)
    bv = _values(b).reshape(n, nb, nc.NVFP4_BLOCK).transpose(1, 0, 2)
    partials = lax.dot_general(av, bv, _BATCHED, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    sa = nc.e4m3_decode(a.scales).T[:, :, None]  # (nb, M, 1)
    sb = nc.e4m3_decode(b.scales).T[:, None, :]  # (nb, 1, N)

    def step(y, block):
        p, s1, s2 = block
        return y + (s1 * s2) * p, None

    y0 = jnp.zeros_like(partials[0])  # zeros_like: inside shard_map the carry varies over the partials' mesh axes
    y, _ = lax.scan(step, y0, (partials, sa, sb))
    alpha = (a.amax.astype(F32) * b.amax.astype(F32)) / jnp.float32(_ALPHA_DIVISOR)
    return alpha * y
