"""The FP8 dense layer as a `jax.custom_vjp`: fprop, dgrad and wgrad on one screen.

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ..recipe import DelayedScaling, Float8CurrentScaling
from . import context as _ac
from .cast import F32, FP8_MAX, Float8Array, amax, cast, fp8_dtype_of, max_nonneg, mul_scale_inv, scale_from_amax
from .state import TENSORS, stage_group, update_group

__all__ = ["dense"]


@dataclasses.dataclass(frozen=True)
class _Config:
    delayed: bool
    fwd_dtype: Any
    bwd_dtype: Any
    amax_epsilon: float
    power_2: bool
    high_precision: Tuple[bool, bool, bool]  # fprop, dgrad, wgrad
    axis_names: Tuple[str, ...]
    x_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without bias


@dataclasses.dataclass(frozen=True)
class _HeadConfig:
    recipe: DelayedScaling
    deferred: bool


def _gemm(a: Float8Array, b: Float8Array, dims) -> jax.Array:
    acc = lax.dot_general(a.data.astype(F32), b.data.astype(F32), (dims, ((), ())), preferred_element_type=F32)
    return mul_scale_inv(mul_scale_inv(acc, a.scale_inv), b.scale_inv)


def _hp_gemm(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    return lax.dot_general(a.astype(F32), b.astype(F32), (dims, ((), ())), preferred_element_type=F32)


def _current(a: jax.Array, fp8_dtype, cfg: _Config) -> jax.Array:
    if cfg.amax_epsilon > 0:
        a = max_nonneg(a, jnp.asarray(cfg.amax_epsilon, F32))
    return scale_from_amax(a, FP8_MAX[fp8_dtype], jnp.ones((), F32), cfg.power_2)


_FPROP = ((1,), (0,))  # x[M, K] . K[K, N]
_DGRAD = ((1,), (1,))  # dy[M, N] . K[K, N] over N
_WGRAD = ((0,), (0,))  # x[M, K] . dy[M, N] over M


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dense(cfg: _Config, x, kernel, bias, scales, token):
    return _fp8_dense_fwd(cfg, x, kernel, bias, scales, token)[0]


def _fp8_dense_fwd(cfg: _Config, x, kernel, bias, scales, token):
    x_amax, k_amax = amax(x, cfg.axis_names), amax(kernel, cfg.axis_names)
    if cfg.delayed:
        x_scale, k_scale, g_scale = scales[0], scales[1], scales[2]
    else:
        x_scale, k_scale, g_scale = _current(x_amax, cfg.fwd_dtype, cfg), _current(k_amax, cfg.fwd_dtype, cfg), None
    qx, qk = cast(x, x_scale, cfg.fwd_dtype), cast(kernel, k_scale, cfg.fwd_dtype)
    y = _hp_gemm(x, kernel, _FPROP) if cfg.high_precision[0] else _gemm(qx, qk, _FPROP)
    if bias is not None:
        y = y + bias.astype(F32)
    hp_x = x if cfg.high_precision[2] else None
    hp_k = kernel if cfg.high_precision[1] else None
    residuals = (qx, qk, hp_x, hp_k, x_amax, k_amax, g_scale, scales)
    return (y.astype(cfg.x_dtype), token), residuals


def _fp8_dense_bwd(cfg: _Config, residuals, cotangents):
    qx, qk, hp_x, hp_k, x_amax, k_amax, g_scale, scales = residuals
    dy, token_ct = cotangents
    g_amax = amax(dy, cfg.axis_names)
    if not cfg.delayed:
        g_scale = _current(g_amax, cfg.bwd_dtype, cfg)
    qg = cast(dy, g_scale, cfg.bwd_dtype)
    dx = _hp_gemm(dy, hp_k, _DGRAD) if cfg.high_precision[1] else _gemm(qg, qk, _DGRAD)
    dk = _hp_gemm(hp_x, dy, _WGRAD) if cfg.high_precision[2] else _gemm(qx, qg, _WGRAD)
    dbias = None if cfg.bias_dtype is None else jnp.sum(dy.astype(F32), axis=0).astype(cfg.bias_dtype)
    if cfg.delayed:
        scales_ct = jnp.zeros_like(scales)
        token_ct = max_nonneg(token_ct, jnp.stack([x_amax, k_amax, g_amax]))
    else:
        scales_ct = None
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), dbias, scales_ct, token_ct


_fp8_dense.defvjp(_fp8_dense_fwd, _fp8_dense_bwd)
# one executable per layer shape when called eagerly (e.g. by `layer.init`), instead of one per primitive
_fp8_dense_jit = jax.jit(_fp8_dense, static_argnums=0)


def _zero_token(group) -> jax.Array:
    # zeros shaped like the three scales, so that inside shard_map the token varies over the axes the state does
    return jnp.zeros_like(jnp.concatenate([group[f"{t}_scale"] for t in TENSORS]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(cfg: _HeadConfig, group):
    return _zero_token(group)


def _head_fwd(cfg: _HeadConfig, group):
    return _zero_token(group), group


def _head_bwd(cfg: _HeadConfig, group, last):
    staged = stage_group(group, last)
    return (staged if cfg.deferred else update_group(staged, cfg.recipe),)


_head.defvjp(_head_fwd, _head_bwd)
_head_jit = jax.jit(_head, static_argnums=0)


def _check_group(fp8_meta: Any, recipe: DelayedScaling) -> dict:
    if not isinstance(fp8_meta, Mapping):
        raise ValueError(
            "dense: delayed scaling needs its state: pass fp8_meta={'x_scale': ..., 'x_amax_history': ..., "
            "'kernel_scale': ..., ..., 'grad_amax_history': ...} (fp8kit.jax.state.init_group(recipe) makes one), "
            "or initialize the Flax layer inside te.autocast(enabled=True, recipe=DelayedScaling(...))"
        )
    group = dict(fp8_meta)
    length = recipe.amax_history_len
    for t in TENSORS:
        for name, shape in ((f"{t}_scale", (1,)), (f"{t}_amax_history", (length,))):
            if name not in group:
                raise ValueError(f"dense: fp8_meta has no {name!r} (keys: {sorted(group)})")
            if tuple(group[name].shape) != shape:
                raise ValueError(
                    f"dense: fp8_meta[{name!r}] has shape {tuple(group[name].shape)}, the recipe needs {shape} "
                    f"(amax_history_len={length})"
                )
    if recipe.interval > 1 and "update_count" not in group:
        raise ValueError(f"dense: recipe.interval={recipe.interval} needs fp8_meta['update_count'] (shape (1,))")
    if recipe.interval == 1:
        group.pop("update_count", None)
    return group


def _token(group: dict, recipe: DelayedScaling) -> jax.Array:
    """The token this use continues from: the latest one of this state in this trace, or a new head."""
    leaf = group["x_scale"]
    registry = _ac.token_registry()
    if isinstance(leaf, jax.core.Tracer):
        token = registry.get(leaf)
        if token is not None:
            return token
    return _head_jit(_HeadConfig(recipe, _ac.is_deferred()), group)


def _varying_axes(a: jax.Array) -> frozenset:
    """The manual mesh axes `a` varies over inside `shard_map` (empty elsewhere)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _same_varying_axes(*arrays):
    """Inside `shard_map`, give the GEMM operands one set of varying axes (as `x @ k` does by itself), so that
    JAX's transpose of that cast sums the custom_vjp's partial cotangents over the axes an operand is replicated on."""
    axes = frozenset().union(*(_varying_axes(a) for a in arrays if a is not None))
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - _varying_axes(a))) if a is not None else ()
        if missing:
            a = lax.pcast(a, missing, to="varying") if hasattr(lax, "pcast") else lax.pvary(a, missing)
        out.append(a)
    return out


def _amax_axes(operand: jax.Array) -> Tuple[str, ...]:
    """Mesh axes to all-reduce amaxes over: inside `shard_map`, every axis the GEMM operands are sharded over and
    every bound axis the autocast's MeshResource names, except pipeline parallelism."""
    axes = _varying_axes(operand) | frozenset(_ac.bound_amax_axes())
    return tuple(sorted(axes - {_ac.pipeline_axis()}))


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: Optional[jax.Array] = None,
    fp8_meta: Optional[Mapping[str, jax.Array]] = None,
    *,
    contracting_ndim: int = 1,
) -> jax.Array:
    """`y = x @ kernel (+ bias)` contracting the last `contracting_ndim` axes of `x` with the first ones of `kernel`.

    Shapes: x `[*batch, *in]`, kernel `[*in, *out]`, bias `[*out]`; y `[*batch, *out]` in x's dtype.
    Inside an enabled `autocast` the three GEMMs run in FP8 (see the module docstring); otherwise it is a plain
    float32-accumulated dot. Delayed scaling needs `fp8_meta`, a dict of this GEMM's state
    ("x_scale", "x_amax_history", "kernel_scale", ..., "grad_amax_history" [, "update_count"]); its gradient is the
    updated state.
    """
    nc = int(contracting_ndim)
    if nc < 0 or nc > min(x.ndim, kernel.ndim):
        raise ValueError(
            f"dense: contracting_ndim={contracting_ndim} does not fit x {x.shape} and kernel {kernel.shape}"
        )
    in_shape = tuple(kernel.shape[:nc])
    if tuple(x.shape[x.ndim - nc:]) != in_shape:
        raise ValueError(f"dense: x {x.shape} and kernel {kernel.shape} do not contract over {nc} axes")
    batch, out_shape = tuple(x.shape[: x.ndim - nc]), tuple(kernel.shape[nc:])
    if bias is not None and tuple(bias.shape) != out_shape:
        raise ValueError(f"dense: bias {bias.shape} must have the kernel's output shape {out_shape}")
    m, k, n = math.prod(batch), math.prod(in_shape), math.prod(out_shape)
    x2, k2 = x.reshape(m, k), kernel.reshape(k, n)
    b2 = None if bias is None else bias.reshape(n)
    x2, k2, b2 = _same_varying_axes(x2, k2, b2)
    recipe = _ac.get_recipe()
    if recipe is None:
        y = _hp_gemm(x2, k2, _FPROP)
        if b2 is not None:
            y = y + b2.astype(F32)
        return y.astype(x.dtype).reshape(batch + out_shape)
    fmt = recipe.fp8_format.value
    current = isinstance(recipe, Float8CurrentScaling)
    cfg = _Config(
        delayed=not current,
        fwd_dtype=fp8_dtype_of(fmt.fwd),
        bwd_dtype=fp8_dtype_of(fmt.bwd),
        amax_epsilon=recipe.amax_epsilon if current else 0.0,
        power_2=recipe.use_power_2_scales if current else False,
        high_precision=tuple(recipe.override_linear_precision),
        axis_names=_amax_axes(x2),
        x_dtype=jnp.dtype(x.dtype),
        kernel_dtype=jnp.dtype(kernel.dtype),
        bias_dtype=None if b2 is None else jnp.dtype(b2.dtype),
    )
    if current:
        y, _ = _fp8_dense_jit(cfg, x2, k2, b2, None, None)
    else:
        group = _check_group(fp8_meta, recipe)
        scales = lax.stop_gradient(jnp.concatenate([group[f"{t}_scale"] for t in TENSORS]).astype(F32))
        token = _token(group, recipe)
        y, token = _fp8_dense_jit(cfg, x2, k2, b2, scales, token)
        if isinstance(group["x_scale"], jax.core.Tracer):
            _ac.token_registry().put(group["x_scale"], token)
    return y.reshape(batch + out_shape)
