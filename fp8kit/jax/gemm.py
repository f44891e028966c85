"""The FP8 GEMMs of a dense layer as a `jax.custom_vjp`: fprop, dgrad and wgrad on one screen.

    GEMM    computes            operands (HYBRID)
    fprop   y  = x @ K (+ b)    x E4M3, K E4M3           (K is [in, out], flax's layout: K = W.T)
    dgrad   dx = dy @ K.T       dy E5M2, K E4M3
    wgrad   dK = x.T @ dy       x E4M3, dy E5M2

The GEMMs multiply the FP8 values exactly in float32 (an FP8 product has at most 8 significant bits), accumulate in
float32, apply the two `scale_inv`s and produce the input's dtype (dK: the kernel's dtype). The FP8 x and K are the
residuals kept for backward. The bias gradient is the float32 sum of dy.

Delayed scaling. The casts use the scales stored in the state (never differentiated). Every use of a state in one
trace threads a *token* (three float32 zeros) through a chain that starts at a `head` node reading the state:
in backward each use returns, as the token's cotangent, the max of the cotangent it received and its own amaxes
[x, kernel, grad]; the head receives the max over all uses and returns the updated state as the cotangent of the
state. So a layer called twice in one step gets ONE update from the max of its amaxes, not a sum of two updates.
Under `jax.vmap` with a shared state the amaxes are reduced over the mapped axis (fp8kit/jax/batching.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ..recipe import DelayedScaling
from .batching import state_amax
from .cast import F32, FP8_MAX, Float8Array, amax, cast, max_nonneg, mul_scale_inv, scale_from_amax
from .state import TENSORS, stage_group, update_group

__all__ = ["GemmConfig", "HeadConfig", "fp8_gemm", "hp_gemm", "head", "FPROP"]

QuantOptions = Tuple[float, bool]  # (amax_epsilon, power_2_scale) of one tensor role under current scaling


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Static description of one FP8 GEMM call (a jit/custom_vjp static argument).

    delayed: scales come from a state (else current scaling with `quant` per role x, kernel, grad).
    high_precision: (fprop, dgrad, wgrad) run in float32 on the original operands.
    backward_override: None, "high_precision" or "dequantized" (current scaling only; dy stays unquantized).
    axis_names: mesh axes amaxes are all-reduced over (inside shard_map).
    """

    delayed: bool
    fwd_dtype: Any
    bwd_dtype: Any
    quant: Tuple[QuantOptions, QuantOptions, QuantOptions]
    high_precision: Tuple[bool, bool, bool]
    backward_override: Optional[str]
    axis_names: Tuple[str, ...]
    x_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without bias


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static description of a state's head node: the recipe of its update, and whether it stays staged."""

    recipe: DelayedScaling
    deferred: bool


FPROP = ((1,), (0,))  # x[M, K] . K[K, N]
_DGRAD = ((1,), (1,))  # dy[M, N] . K[K, N] over N
_WGRAD = ((0,), (0,))  # x[M, K] . dy[M, N] over M


def _gemm(a: Float8Array, b: Float8Array, dims) -> jax.Array:
    acc = lax.dot_general(a.data.astype(F32), b.data.astype(F32), (dims, ((), ())), preferred_element_type=F32)
    return mul_scale_inv(mul_scale_inv(acc, a.scale_inv), b.scale_inv)


def hp_gemm(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """A float32 GEMM of high-precision operands (2-D `dims` as `lax.dot_general`'s contracting dims)."""
    return lax.dot_general(a.astype(F32), b.astype(F32), (dims, ((), ())), preferred_element_type=F32)


def _current(a: jax.Array, fp8_dtype, options: QuantOptions) -> jax.Array:
    epsilon, power_2 = options
    if epsilon > 0:
        a = max_nonneg(a, jnp.asarray(epsilon, F32))
    return scale_from_amax(a, FP8_MAX[fp8_dtype], jnp.ones((), F32), power_2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dense(cfg: GemmConfig, x, kernel, bias, scales, token):
    return _fp8_dense_fwd(cfg, x, kernel, bias, scales, token)[0]


def _fp8_dense_fwd(cfg: GemmConfig, x, kernel, bias, scales, token):
    if cfg.delayed:
        x_amax = state_amax(x, scales[0], cfg.axis_names)
        k_amax = state_amax(kernel, scales[1], cfg.axis_names)
        x_scale, k_scale, g_scale = scales[0], scales[1], scales[2]
    else:
        x_amax, k_amax = amax(x, cfg.axis_names), amax(kernel, cfg.axis_names)
        x_scale, k_scale = _current(x_amax, cfg.fwd_dtype, cfg.quant[0]), _current(k_amax, cfg.fwd_dtype, cfg.quant[1])
        g_scale = None
    qx, qk = cast(x, x_scale, cfg.fwd_dtype), cast(kernel, k_scale, cfg.fwd_dtype)
    y = hp_gemm(x, kernel, FPROP) if cfg.high_precision[0] else _gemm(qx, qk, FPROP)
    if bias is not None:
        y = y + bias.astype(F32)
    keep_hp = cfg.backward_override == "high_precision"
    hp_x = x if (cfg.high_precision[2] or keep_hp) else None
    hp_k = kernel if (cfg.high_precision[1] or keep_hp) else None
    residuals = (qx, qk, hp_x, hp_k, x_amax, k_amax, g_scale, scales)
    return (y.astype(cfg.x_dtype), token), residuals


def _fp8_dense_bwd(cfg: GemmConfig, residuals, cotangents):
    qx, qk, hp_x, hp_k, x_amax, k_amax, g_scale, scales = residuals
    dy, token_ct = cotangents
    override = cfg.backward_override
    if override is not None:  # dy stays in high precision; the operands are the originals or the dequantized FP8
        x_op = hp_x if override == "high_precision" else qx.dequantize(F32)
        k_op = hp_k if override == "high_precision" else qk.dequantize(F32)
        dx, dk = hp_gemm(dy, k_op, _DGRAD), hp_gemm(x_op, dy, _WGRAD)
        g_amax = None
    else:
        if cfg.delayed:
            g_amax = state_amax(dy, scales[2], cfg.axis_names)
        else:
            g_amax = amax(dy, cfg.axis_names)
            g_scale = _current(g_amax, cfg.bwd_dtype, cfg.quant[2])
        qg = cast(dy, g_scale, cfg.bwd_dtype)
        dx = hp_gemm(dy, hp_k, _DGRAD) if cfg.high_precision[1] else _gemm(qg, qk, _DGRAD)
        dk = hp_gemm(hp_x, dy, _WGRAD) if cfg.high_precision[2] else _gemm(qx, qg, _WGRAD)
    dbias = None if cfg.bias_dtype is None else jnp.sum(dy.astype(F32), axis=0).astype(cfg.bias_dtype)
    if cfg.delayed:
        scales_ct = jnp.zeros_like(scales)
        token_ct = max_nonneg(token_ct, jnp.stack([x_amax, k_amax, g_amax]))
    else:
        scales_ct = None
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), dbias, scales_ct, token_ct


_fp8_dense.defvjp(_fp8_dense_fwd, _fp8_dense_bwd)
# one executable per layer shape when called eagerly (e.g. by `layer.init`), instead of one per primitive
fp8_gemm = jax.jit(_fp8_dense, static_argnums=0)
fp8_gemm.__doc__ = """`fp8_gemm(cfg, x[M, K], kernel[K, N], bias[N] | None, scales[3] | None, token[3] | None)` ->
`(y[M, N], token)`: the FP8 dense GEMM with its custom backward (see the module docstring)."""


def _zero_token(group) -> jax.Array:
    # zeros computed FROM the three scales (their bits and 0), so that the token is mapped (vmap) and varies (shard_map)
    # over the same axes as the state; a constant would be unmapped and JAX would sum the members' cotangents
    scales = jnp.concatenate([group[f"{t}_scale"] for t in TENSORS]).astype(F32)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(scales, jnp.uint32) & jnp.uint32(0), F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(cfg: HeadConfig, group):
    return _zero_token(group)


def _head_fwd(cfg: HeadConfig, group):
    return _zero_token(group), group


def _head_bwd(cfg: HeadConfig, group, last):
    staged = stage_group(group, last)
    return (staged if cfg.deferred else update_group(staged, cfg.recipe),)


_head.defvjp(_head_fwd, _head_bwd)
head = jax.jit(_head, static_argnums=0)
head.__doc__ = """`head(cfg, group)` -> a zero token [3] that starts the chain of a state's uses; its backward turns the
max of the uses' amaxes into the updated (or, deferred, staged) state, the cotangent of `group`."""
