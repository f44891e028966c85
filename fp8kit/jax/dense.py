"""`dense`: the functional FP8 dense layer with Transformer Engine's arguments (`te.dense.dense` / `te.dense`).

Inside an enabled `autocast` the three GEMMs run in FP8 (fp8kit/jax/gemm.py); outside it, or with FP8 disabled,
`dense` is the `lax.dot_general` a Flax layer would run, in the input's dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ..recipe import DelayedScaling, Float8CurrentScaling
from . import context as jax_context
from .block_dense import block_config, block_dense
from .cast import F32, fp8_dtype_of
from .gemm import GemmConfig, HeadConfig, fp8_gemm, head
from .nvfp4_dense import nvfp4_config, nvfp4_dense
from .scaling_modes import block_kind
from .sharding import with_sharding_constraint_by_logical_axes
from .state import COUNT, GRAD_COUNT, TENSORS

__all__ = ["dense", "check_group", "warn_if_state_not_differentiated", "varying_axes", "amax_axes"]


def check_group(fp8_meta: Any, recipe: DelayedScaling, where: str = "dense") -> dict:
    """Validate one GEMM's delayed-scaling state (postfix removed) against `recipe`; returns it as a dict."""
    if not isinstance(fp8_meta, Mapping):
        raise ValueError(
            f"{where}: delayed scaling needs its state: pass quantizer_set={{'x_scale': ..., 'x_amax_history': ..., "
            "'kernel_scale': ..., ..., 'grad_amax_history': ...}} (fp8kit.jax.state.init_group(recipe) makes one), "
            "or initialize the Flax layer inside te.autocast(enabled=True, recipe=DelayedScaling(...))"
        )
    group = dict(fp8_meta)
    length = recipe.amax_history_len
    for t in TENSORS:
        for name, shape in ((f"{t}_scale", (1,)), (f"{t}_amax_history", (length,))):
            if name not in group:
                raise ValueError(f"{where}: the state has no {name!r} (keys: {sorted(group)})")
            if tuple(group[name].shape) != shape:
                raise ValueError(
                    f"{where}: state[{name!r}] has shape {tuple(group[name].shape)}, the recipe needs {shape} "
                    f"(amax_history_len={length})"
                )
    if recipe.interval > 1:
        for name in (COUNT, GRAD_COUNT):
            if name not in group:
                fix = (" (a state saved by an older fp8kit: convert it with fp8kit.jax.upgrade_fp8_metas)"
                       if name == GRAD_COUNT and COUNT in group else "")
                raise ValueError(f"{where}: recipe.interval={recipe.interval} needs state[{name!r}] (shape (1,)){fix}")
    else:
        group.pop(COUNT, None)
        group.pop(GRAD_COUNT, None)
    return group


# ---- is the state differentiated? ----------------------------------------------------------------------------

_AD_TRACERS = ("JVPTracer", "LinearizeTracer")
_WARNED = set()


def _differentiated(value: Any) -> bool:
    """True when `value` is being differentiated by the innermost transformations (a JVP/linearize tracer, possibly
    inside vmap's batch tracers)."""
    while isinstance(value, jax.core.Tracer):
        if type(value).__name__ in _AD_TRACERS:
            return True
        value = getattr(value, "val", None)
    return False


def warn_if_state_not_differentiated(x: jax.Array, kernel: jax.Array, group: Mapping[str, jax.Array]) -> None:
    """Warn once when a delayed-scaling GEMM is differentiated but its state is not: its update, which comes back
    only as the gradient of the state, would be dropped and the scales would stay where they are."""
    if "state" in _WARNED or not (_differentiated(x) or _differentiated(kernel)):
        return
    if _differentiated(group["x_scale"]):
        return
    _WARNED.add("state")
    warnings.warn(
        "fp8kit: a delayed-scaling layer is differentiated but its 'fp8_metas' state is not, so the state's update "
        "(returned as the gradient of 'fp8_metas') is dropped and its scales stay as they are. Differentiate the "
        "whole variables dict (jax.grad(loss)(variables)) and keep grads['fp8_metas'] as the new state "
        "(te.split_grads / te.update_collections), or wrap the optimizer with te.wrap_optimizer and give it the "
        "whole variables dict. A mutable apply(..., mutable=['fp8_metas']) updates only the forward (x, kernel) "
        "state: the output-gradient state exists only in the backward pass. See docs/jax.md.",
        UserWarning,
        stacklevel=4,
    )


# ---- mesh axes -------------------------------------------------------------------------------------------------

def varying_axes(a: jax.Array) -> frozenset:
    """The manual mesh axes `a` varies over inside `shard_map` (empty elsewhere)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _same_varying_axes(*arrays):
    """Inside `shard_map`, give the GEMM operands one set of varying axes (as `x @ k` does by itself), so that
    JAX's transpose of that cast sums the custom_vjp's partial cotangents over the axes an operand is replicated on."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - varying_axes(a))) if a is not None else ()
        if missing:
            a = lax.pcast(a, missing, to="varying") if hasattr(lax, "pcast") else lax.pvary(a, missing)
        out.append(a)
    return out


def amax_axes(operand: jax.Array) -> Tuple[str, ...]:
    """Mesh axes to all-reduce amaxes over: inside `shard_map`, every axis the GEMM operands are sharded over and
    every bound axis the current MeshResource names, except pipeline parallelism."""
    axes = varying_axes(operand) | frozenset(jax_context.bound_amax_axes())
    return tuple(sorted(axes - {jax_context.pipeline_axis()}))


# ---- dense -----------------------------------------------------------------------------------------------------

def _dims(contracting_dims, x: jax.Array, kernel: jax.Array) -> Tuple[Tuple[int, ...], int]:
    """(x's contracting axes, their count) after checking that the kernel contracts its leading axes in order."""
    try:
        x_dims, k_dims = (tuple(int(d) for d in dims) for dims in contracting_dims)
    except (TypeError, ValueError):
        raise ValueError(f"dense: contracting_dims must be ((x axes...), (kernel axes...)), got {contracting_dims!r}")
    x_dims = tuple(d % x.ndim for d in x_dims) if x.ndim else x_dims
    k_dims = tuple(d % kernel.ndim for d in k_dims) if kernel.ndim else k_dims
    n = len(x_dims)
    if len(k_dims) != n or len(set(x_dims)) != n or k_dims != tuple(range(n)) or n > kernel.ndim:
        raise ValueError(
            f"dense: contracting_dims={contracting_dims!r}: the kernel must contract its leading axes in order "
            f"((0,), (0, 1), ...) with as many distinct x axes (x {x.shape}, kernel {kernel.shape})"
        )
    if tuple(x.shape[d] for d in x_dims) != tuple(kernel.shape[:n]):
        raise ValueError(f"dense: x {x.shape} and kernel {kernel.shape} do not contract over {contracting_dims!r}")
    return x_dims, n


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: Optional[jax.Array] = None,
    contracting_dims: Tuple[Sequence[int], Sequence[int]] = ((1,), (0,)),
    transpose_batch_sequence: bool = False,
    input_axes: Optional[Tuple[str, ...]] = None,
    kernel_axes: Optional[Tuple[str, ...]] = None,
    output_axes: Optional[Tuple[str, ...]] = None,
    collective_op_set: Any = None,
    quantizer_set: Optional[Mapping[str, jax.Array]] = None,
    *,
    precision: Any = None,
) -> jax.Array:
    """`y = x . kernel (+ bias)`, contracting `contracting_dims = (x axes, kernel axes)`; the kernel contracts its
    leading axes. Shapes: x `[..]`, kernel `[*in, *out]`, bias `[*out]`; y is x's other axes then `*out`, in x's
    dtype (the kernel gradient in the kernel's dtype).

    Inside an enabled `autocast` the GEMMs run in FP8. Delayed scaling needs `quantizer_set`: this GEMM's state, a
    dict "x_scale", "x_amax_history", "kernel_scale", ..., "grad_amax_history" (["update_count",
    "grad_update_count"]) (`fp8kit.jax.state.init_group(recipe)` makes one); its gradient is the updated state.
    Current scaling and the block recipes (MXFP8BlockScaling, Float8BlockScaling: fp8kit/jax/block_dense.py)
    need none; NVFP4BlockScaling (fp8kit/jax/nvfp4_dense.py) takes `quantizer_set={"sr_rng": key}`, the PRNG key
    of its stochastic rounding (required unless `disable_stochastic_rounding`). Outside autocast this is
    `lax.dot_general(x, kernel.astype(x.dtype), ..., precision=precision)` plus the bias, in x's dtype.
    `input_axes` / `kernel_axes` / `output_axes` are logical axis names for sharding constraints.
    `transpose_batch_sequence` does not change the result (each row is independent); `collective_op_set` must be
    None (no collective GEMMs).
    """
    if collective_op_set is not None:
        raise NotImplementedError("dense: collective GEMMs (collective_op_set) are not implemented; pass None")
    del transpose_batch_sequence  # rows are independent: the layout of the batch axes does not matter
    x_dims, nc = _dims(contracting_dims, x, kernel)
    x = with_sharding_constraint_by_logical_axes(x, input_axes)
    kernel = with_sharding_constraint_by_logical_axes(kernel, kernel_axes)
    x = jnp.moveaxis(x, x_dims, tuple(range(x.ndim - nc, x.ndim)))
    batch, out_shape = tuple(x.shape[: x.ndim - nc]), tuple(kernel.shape[nc:])
    if bias is not None and tuple(bias.shape) != out_shape:
        raise ValueError(f"dense: bias {bias.shape} must have the kernel's output shape {out_shape}")
    recipe = jax_context.get_recipe()
    if recipe is None:
        dims = (tuple(range(x.ndim - nc, x.ndim)), tuple(range(nc)))
        y = lax.dot_general(x, kernel.astype(x.dtype), (dims, ((), ())), precision=precision)
        if bias is not None:
            y = y + bias.astype(x.dtype)
        return with_sharding_constraint_by_logical_axes(y, output_axes)
    m, k, n = math.prod(batch), math.prod(kernel.shape[:nc]), math.prod(out_shape)
    x2, k2 = x.reshape(m, k), kernel.reshape(k, n)
    b2 = None if bias is None else bias.reshape(n)
    x2, k2, b2 = _same_varying_axes(x2, k2, b2)
    y = _fp8_dense(recipe, x2, k2, b2, x.dtype, kernel.dtype, quantizer_set)
    return with_sharding_constraint_by_logical_axes(y.reshape(batch + out_shape), output_axes)


def _fp8_dense(recipe, x2, k2, b2, x_dtype, kernel_dtype, quantizer_set) -> jax.Array:
    kind = block_kind(recipe)
    if kind == "nvfp4":  # current per-block scales; a PRNG key for stochastic rounding
        cfg = nvfp4_config(recipe, x_dtype, kernel_dtype, None if b2 is None else b2.dtype, amax_axes(x2))
        return nvfp4_dense(cfg, x2, k2, b2, _sr_key(quantizer_set))
    if kind is not None:  # current per-block scales: no state
        if quantizer_set is not None:
            raise ValueError(f"dense: {type(recipe).__name__} keeps no scaling state; pass quantizer_set=None")
        cfg = block_config(recipe, kind, x_dtype, kernel_dtype, None if b2 is None else b2.dtype)
        return block_dense(cfg, x2, k2, b2)
    fmt = recipe.fp8_format.value
    current = isinstance(recipe, Float8CurrentScaling)
    if current:
        roles = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        quant = tuple((q.amax_epsilon, q.power_2_scale) for q in roles)
    else:
        quant = ((0.0, False),) * 3
    cfg = GemmConfig(
        delayed=not current,
        fwd_dtype=fp8_dtype_of(fmt.fwd),
        bwd_dtype=fp8_dtype_of(fmt.bwd),
        quant=quant,
        high_precision=tuple(recipe.override_linear_precision),
        backward_override=recipe.backward_override,
        axis_names=amax_axes(x2),
        x_dtype=jnp.dtype(x_dtype),
        kernel_dtype=jnp.dtype(kernel_dtype),
        bias_dtype=None if b2 is None else jnp.dtype(b2.dtype),
    )
    if current:
        y, _ = fp8_gemm(cfg, x2, k2, b2, None, None)
        return y
    group = check_group(quantizer_set, recipe)
    warn_if_state_not_differentiated(x2, k2, group)
    scales = lax.stop_gradient(jnp.concatenate([group[f"{t}_scale"] for t in TENSORS]).astype(F32))
    token = _token(group, recipe)
    y, token = fp8_gemm(cfg, x2, k2, b2, scales, token)
    if isinstance(group["x_scale"], jax.core.Tracer):
        jax_context.token_registry().put(group["x_scale"], token)
    return y


def _sr_key(quantizer_set) -> Optional[jax.Array]:
    """The stochastic-rounding key of an NVFP4 call: quantizer_set None or {"sr_rng": key}."""
    if quantizer_set is None:
        return None
    if not isinstance(quantizer_set, Mapping) or set(quantizer_set) != {"sr_rng"}:
        raise ValueError("dense: NVFP4BlockScaling keeps no scaling state; quantizer_set must be None or "
                         "{'sr_rng': PRNG key} (the key of stochastic rounding)")
    return quantizer_set["sr_rng"]


def _token(group: dict, recipe: DelayedScaling) -> jax.Array:
    """The token this use continues from: the latest one of this state in this trace, or a new head."""
    leaf = group["x_scale"]
    if isinstance(leaf, jax.core.Tracer):
        token = jax_context.token_registry().get(leaf)
        if token is not None:
            return token
    return head(HeadConfig(recipe, jax_context.is_deferred()), group)


# `te.dense.dense(...)` (Transformer Engine's module path) works as well as `te.dense(...)`
dense.dense = dense
