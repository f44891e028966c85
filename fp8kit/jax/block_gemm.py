"""Block-scaled GEMM operands and the block-scaled GEMM, emulated with jax.numpy (jit-able, no host sync).

`block_operand(x, spec, transpose)` quantizes a 2-D array as one GEMM operand with its contraction dim last: x
(rowwise usage, blocks along x's last dim) or x.T (columnwise usage, blocks along x's first dim), both from the
high-precision x as Transformer Engine does; 2-D blocks (32x32 or 128x128) are cast once and read both ways.

`block_gemm(A, B)` computes `A @ B^T` for operands A (M, K) and B (N, K):
1. per K block j (32 for MXFP8, 128 for Float8 block; a shorter last block is zero-padded), the partial product
   `P_j` of the unscaled FP8 values. E4M3 x E4M3 (every GEMM of the E4M3 recipes): the exact block sum rounded
   once to float32, as the PyTorch emulation computes it, from integer dots (an E4M3 value is an integer times
   2^-9, below 2^18 in magnitude; split in two 9-bit limbs, each limb dot is exact in int32, and the limbs are
   recombined into `q * 2^20 + r` whose float32 sum `float32(q) * 2^20 + r` rounds once). With an E5M2 operand
   (HYBRID's backward GEMMs): XLA's float32 dot, which can differ from the exact sum in the last bits;
2. in increasing j, `y = y + (P_j * s1) * s2` in float32, s1 the scale_inv of the 1-D operand (A's when both are
   1-D) and s2 the other's, as the PyTorch emulation's order; with power-of-two scales (MXFP8 always, Float8 block
   by default) this is its fused multiply-add exactly;
3. the bias in float32, then the output dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import block_cast as bc
from .cast import F32, mul_scale_inv

__all__ = ["BlockSpec", "BlockOperand", "block_operand", "block_gemm", "dequantize_operand"]


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How one tensor role is quantized: `mxfp8` (E8M0, 32-blocks) or Float8 block scaling (float32, 128-blocks),
    the FP8 dtype, 2-D blocks or not, and Float8 block scaling's `power_2` and `epsilon`."""

    mxfp8: bool
    fp8_dtype: Any
    two_d: bool = False
    power_2: bool = True
    epsilon: float = 0.0

    @property
    def block(self) -> int:
        return bc.MXFP8_BLOCK if self.mxfp8 else bc.FLOAT8_BLOCK


class BlockOperand(NamedTuple):
    """FP8 values (rows, K), float32 scale_inv per (row, K block) (rows, ceil(K / block)), as pytree leaves."""

    values: jax.Array
    scale_inv: jax.Array


def _cast(x: jax.Array, spec: BlockSpec, two_d: bool):
    """(values, per-block float32 scale_inv) of x with 1xB blocks (or BxB with `two_d`)."""
    if spec.mxfp8:
        b = bc.MXFP8_BLOCK
        data, code = bc.mxfp8_cast(x, spec.fp8_dtype, b if two_d else 1, b)
        return data, bc.e8m0_decode(code)
    return bc.float8_block_cast(x, spec.fp8_dtype, two_d, spec.power_2, spec.epsilon)


def block_operand(x: jax.Array, spec: BlockSpec, transpose: bool = False) -> BlockOperand:
    """The operand `x` (M, K) (contraction over K), or `x.T` (K, M) with `transpose` (contraction over M)."""
    if not spec.two_d:
        return BlockOperand(*_cast(x.T if transpose else x, spec, False))
    data, s = _cast(x, spec, True)
    if transpose:
        data, s = data.T, s.T
    rows = data.shape[0]
    return BlockOperand(data, jnp.repeat(s, spec.block, axis=0)[:rows])


def dequantize_operand(op: BlockOperand, spec: BlockSpec) -> jax.Array:
    """float32 `values * scale_inv` per block, the operand's layout."""
    rows, k = op.values.shape
    s = jnp.repeat(op.scale_inv, spec.block, axis=1)[:, :k]
    return mul_scale_inv(op.values.astype(F32), s)


def _blocked(values: jax.Array, block: int) -> jax.Array:
    """(rows, K) FP8 values as float32 (nb, rows, block), the last block zero-padded."""
    rows, k = values.shape
    nb = -(-k // block)
    v = values.astype(F32)
    if nb * block != k:
        v = jnp.pad(v, ((0, 0), (0, nb * block - k)))
    return v.reshape(rows, nb, block).transpose(1, 0, 2)


_BATCHED = (((2,), (2,)), ((0,), (0,)))  # (nb, M, block) . (nb, N, block) -> (nb, M, N)


def _int_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.dot_general(a, b, _BATCHED, preferred_element_type=jnp.int32)


def _exact_e4m3_partials(av: jax.Array, bv: jax.Array) -> jax.Array:
    """float32 block sums of E4M3 x E4M3 products (float32 values (nb, M, block), (nb, N, block)), each the exact
    sum rounded once (block <= 128)."""
    ai, bi = (jnp.round(v * F32(512.0)).astype(jnp.int32) for v in (av, bv))  # exact: |v| * 2^9 < 2^18
    ah, al = ai >> 9, ai & 511  # ai = ah * 2^9 + al, 0 <= al < 2^9
    bh, bl = bi >> 9, bi & 511
    hh, ll = _int_dot(ah, bh), _int_dot(al, bl)  # |hh| < 2^25, 0 <= ll < 2^25
    mid = _int_dot(ah, bl) + _int_dot(al, bh)  # |mid| < 2^26
    # T = hh * 2^18 + mid * 2^9 + ll = q * 2^20 + r, 0 <= r < 2^20, |q| < 2^23 (|T| < 2^43)
    low = ll + ((mid & 0x7FF) << 9) + ((hh & 3) << 18)  # < 2^26
    q = (hh >> 2) + (mid >> 11) + (low >> 20)
    r = low & 0xFFFFF
    total = q.astype(F32) * F32(2.0 ** 20) + r.astype(F32)  # one rounding: both terms are exact
    return total * F32(2.0 ** -18)  # the values were scaled by 2^9 each; |total| >= 1 unless 0, so no underflow


def _partials(a: BlockOperand, b: BlockOperand, block: int) -> jax.Array:
    av, bv = _blocked(a.values, block), _blocked(b.values, block)
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if a.values.dtype == e4m3 and b.values.dtype == e4m3:
        return _exact_e4m3_partials(av, bv)
    return lax.dot_general(av, bv, _BATCHED, preferred_element_type=F32)


def block_gemm(a: BlockOperand, b: BlockOperand, spec_a: BlockSpec, spec_b: BlockSpec) -> jax.Array:
    """float32 `A @ B^T` (M, N) for block-scaled operands A (M, K) and B (N, K) (see the module docstring)."""
    if spec_a.block != spec_b.block:
        raise TypeError(f"block_gemm: operands of different block formats ({spec_a.block} and {spec_b.block})")
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"block_gemm: contraction dims differ: A {a.values.shape}, B {b.values.shape} (A @ B^T)")
    partials = _partials(a, b, spec_a.block)  # (nb, M, N)
    b_first = spec_a.two_d and not spec_b.two_d
    sa, sb = a.scale_inv.T[:, :, None], b.scale_inv.T[:, None, :]  # (nb, M, 1), (nb, 1, N)
    if spec_a.two_d and spec_b.two_d:
        raise ValueError("block_gemm: two 2-D scaled operands (the recipes never pair them)")
    s1, s2 = (sb, sa) if b_first else (sa, sb)

    def step(y, block):
        p, t1, t2 = block
        return y + mul_scale_inv(mul_scale_inv(p, t1), t2), None

    y0 = jnp.zeros_like(partials[0])  # zeros_like: inside shard_map the carry varies over the partials' mesh axes
    y, _ = lax.scan(step, y0, (partials, s1, s2))
    return y
