"""The dense GEMMs under the block-scaled recipes (MXFP8BlockScaling, Float8BlockScaling) as a `jax.custom_vjp`.

    GEMM    computes            A (contraction last)          B (contraction last)
    fprop   y  = x @ K          x, rowwise (blocks along K)   W = K.T, rowwise (blocks along in)
    dgrad   dx = dy @ K.T       dy, rowwise (along out)       W.T = K, its columnwise usage (along out)
    wgrad   dK = x.T @ dy       x.T, columnwise (along M)     dy.T, columnwise (along M)

Every usage is quantized from the high-precision tensor with current per-block scales (no state). Roles follow
Transformer Engine: input and weight in the forward format, the gradient in the backward one; MXFP8 casts weights
with 32x32 blocks under `enable_2d_quantization`; Float8 block scaling takes each role's block dim (1: 1x128, 2:
128x128) and QParams (power_2_scale, amax_epsilon). `backward_override` keeps dy unquantized and runs dgrad / wgrad
in float32 with the original operands ("high_precision") or the dequantized forward operands ("dequantized").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from .block_gemm import BlockSpec, block_gemm, block_operand, dequantize_operand
from .cast import F32, fp8_dtype_of
from .gemm import hp_gemm

__all__ = ["BlockDenseConfig", "block_config", "block_dense"]

_DGRAD = ((1,), (1,))  # dy[M, N] . K[K, N] over N
_WGRAD = ((0,), (0,))  # x[M, K] . dy[M, N] over M


@dataclasses.dataclass(frozen=True)
class BlockDenseConfig:
    """Static description of one block-scaled dense call: the specs of x, kernel and grad, the backward override,
    and the dtypes of the results."""

    x: BlockSpec
    kernel: BlockSpec
    grad: BlockSpec
    backward_override: Optional[str]
    x_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without bias


def _specs(recipe: Any, kind: str) -> Tuple[BlockSpec, BlockSpec, BlockSpec]:
    fmt = recipe.fp8_format.value
    fwd, bwd = fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd)
    if kind == "mxfp8":
        two_d = bool(getattr(recipe, "enable_2d_quantization", False))
        return BlockSpec(True, fwd), BlockSpec(True, fwd, two_d), BlockSpec(True, bwd)
    roles = ((fwd, recipe.fp8_quant_fwd_inp, recipe.x_block_scaling_dim),
             (fwd, recipe.fp8_quant_fwd_weight, recipe.w_block_scaling_dim),
             (bwd, recipe.fp8_quant_bwd_grad, recipe.grad_block_scaling_dim))
    return tuple(BlockSpec(False, dtype, dim == 2, bool(q.power_2_scale), float(q.amax_epsilon))
                 for dtype, q, dim in roles)


def block_config(recipe: Any, kind: str, x_dtype, kernel_dtype, bias_dtype) -> BlockDenseConfig:
    x, kernel, grad = _specs(recipe, kind)
    return BlockDenseConfig(x, kernel, grad, getattr(recipe, "backward_override", None), jnp.dtype(x_dtype),
                            jnp.dtype(kernel_dtype), None if bias_dtype is None else jnp.dtype(bias_dtype))


def _check_shapes(cfg: BlockDenseConfig, x: jax.Array, kernel: jax.Array) -> None:
    if not cfg.x.mxfp8:
        return
    (m, k), n = x.shape, kernel.shape[1]
    if m % 32 or k % 32 or n % 32:
        raise ValueError(f"dense: MXFP8 needs the flattened batch ({m}), input ({k}) and output ({n}) dims to be "
                         "multiples of 32 (each is a block dim of one GEMM), as Transformer Engine requires")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_dense(cfg: BlockDenseConfig, x, kernel, bias):
    return _block_dense_fwd(cfg, x, kernel, bias)[0]


def _block_dense_fwd(cfg: BlockDenseConfig, x, kernel, bias):
    qx = block_operand(x, cfg.x)
    qw = block_operand(kernel, cfg.kernel, transpose=True)  # W = K.T (N, K), blocks along K
    y = block_gemm(qx, qw, cfg.x, cfg.kernel)
    if bias is not None:
        y = y + bias.astype(F32)
    override = cfg.backward_override
    if override is None:  # the columnwise usages the backward GEMMs read
        saved = (block_operand(x, cfg.x, transpose=True), block_operand(kernel, cfg.kernel))
    elif override == "dequantized":
        saved = (dequantize_operand(qx, cfg.x), dequantize_operand(qw, cfg.kernel).T)
    else:
        saved = (x, kernel)
    return y.astype(cfg.x_dtype), saved


def _block_dense_bwd(cfg: BlockDenseConfig, saved, dy):
    if cfg.backward_override is not None:
        x_op, k_op = saved
        dx, dk = hp_gemm(dy, k_op, _DGRAD), hp_gemm(x_op, dy, _WGRAD)
    else:
        qx_t, qk = saved  # x.T (K, M) blocks along M; K (K, N) blocks along N
        dx = block_gemm(block_operand(dy, cfg.grad), qk, cfg.grad, cfg.kernel)
        dk = block_gemm(qx_t, block_operand(dy, cfg.grad, transpose=True), cfg.x, cfg.grad)
    dbias = None if cfg.bias_dtype is None else jnp.sum(dy.astype(F32), axis=0).astype(cfg.bias_dtype)
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), dbias


_block_dense.defvjp(_block_dense_fwd, _block_dense_bwd)
_block_dense_jit = jax.jit(_block_dense, static_argnums=0)


def block_dense(cfg: BlockDenseConfig, x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array]) -> jax.Array:
    """`x[M, K] @ kernel[K, N] (+ bias[N])` in x's dtype with block-scaled FP8 GEMMs and their custom backward."""
    _check_shapes(cfg, x, kernel)
    return _block_dense_jit(cfg, x, kernel, bias)
