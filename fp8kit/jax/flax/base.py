"""Pieces shared by the fp8kit Flax layers: kernel initialization, the FP8 state variables of a GEMM (and their
update under a mutable collection), LayerNorm parameters, low-rank adaptation."""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from ...recipe import DelayedScaling, NVFP4BlockScaling
from .. import context
from ..batching import state_amax
from ..cast import max_nonneg
from ..dense import amax_axes, dense
from ..nvfp4_dense import needs_sr_key
from ..sharding import current_mesh_resource
from ..state import FORWARD_TENSORS, FP8_COLLECTION, group_names, init_group, stage_group, update_forward

__all__ = [
    "Initializer", "tuple_of", "normalize_axes", "with_axes", "flat_kernel_init", "flat_bias_init",
    "default_kernel_init", "compute_dtype", "fp8_state", "record_forward", "layernorm_params", "low_rank_adaptation",
    "uses_fp8", "gemm_scope", "fp8_dense",
]

Initializer = Callable[..., Any]
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def tuple_of(value: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    """`(value,)` for an int, else `tuple(value)`."""
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def normalize_axes(axes: Tuple[int, ...], ndim: int) -> Tuple[int, ...]:
    """Non-negative axes; ValueError for an axis out of range or named twice."""
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an input of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axis {axes} names an axis twice")
    return tuple(out)


def with_axes(init: Initializer, axes: Optional[Tuple]) -> Initializer:
    """`nn.with_logical_partitioning(init, axes)` when `axes` is not empty, else `init`."""
    return nn.with_logical_partitioning(init, tuple(axes)) if axes else init


def _reshaped(value: Any, shape: Tuple[int, ...]) -> Any:
    if isinstance(value, meta.AxisMetadata):  # e.g. an init wrapped in nn.with_logical_partitioning
        return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)


def flat_kernel_init(init: Optional[Initializer], in_ndim: int) -> Initializer:
    """Initialize a `[*in, *out]` kernel as the 2-D `[prod(in), prod(out)]` matrix it stands for (fan-in counts
    every contracted axis, as in flax's DenseGeneral), then reshape; boxed (logically partitioned) results stay
    boxed."""
    init = init or default_kernel_init

    def flat(key, shape, dtype=jnp.float32):
        rows = math.prod(shape[:in_ndim])
        return _reshaped(init(key, (rows, math.prod(shape) // max(rows, 1)), dtype), tuple(shape))

    return flat


def flat_bias_init(init: Initializer) -> Initializer:
    """Initialize a `[*features]` bias as a flat vector, then reshape (as flax's DenseGeneral)."""

    def flat(key, shape, dtype=jnp.float32):
        return _reshaped(init(key, (math.prod(shape),), dtype), tuple(shape))

    return flat


def compute_dtype(dtype: Any, x: jax.Array) -> Any:
    """The computation dtype of a layer: its `dtype`, or the input's when None."""
    return jnp.dtype(x.dtype if dtype is None else dtype)


def uses_fp8(module: nn.Module) -> bool:
    """True when the module's GEMMs run in FP8: inside an enabled autocast, except while initializing (`init`
    only needs shapes; it creates the FP8 state but computes its outputs in high precision)."""
    return context.is_fp8_enabled() and not module.is_initializing()


def gemm_scope(module: nn.Module):
    """The context for the module's `dense` calls: FP8 off while initializing, else as it is."""
    if module.is_initializing() and context.is_fp8_enabled():
        return context.autocast(enabled=False, mesh_resource=current_mesh_resource())
    return contextlib.nullcontext()


# ---- FP8 state of one GEMM --------------------------------------------------------------------------------------

# per apply (the root flax Scope, alive for the whole apply) and GEMM (scope path, collection, postfix): the state
# as it was when the step started, and the forward amaxes seen so far
_FORWARD_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _memo(module: nn.Module) -> Dict:
    try:
        table = _FORWARD_MEMO.setdefault(module.scope.root, {})
    except TypeError:  # pragma: no cover - a scope that cannot be weakly referenced: no sharing between uses
        return {}
    return table.setdefault(tuple(module.scope.path), {})


def _sr_key(module: nn.Module, recipe: NVFP4BlockScaling) -> Optional[dict]:
    """NVFP4's stochastic-rounding key, {"sr_rng": module.make_rng("sr_rng")} (Transformer Engine JAX's rng
    stream name), when a role rounds stochastically; else None."""
    if not needs_sr_key(recipe):
        return None
    if not module.has_rng("sr_rng") and not module.is_initializing():  # init falls back to the "params" stream
        raise ValueError(f"{type(module).__name__} {module.name or ''}: NVFP4BlockScaling rounds the gradient "
                         "stochastically and needs an 'sr_rng' PRNG stream: pass rngs={'sr_rng': key} to apply "
                         "(a fresh key per step), or use NVFP4BlockScaling(disable_stochastic_rounding=True)")
    return {"sr_rng": module.make_rng("sr_rng")}


def fp8_state(module: nn.Module, postfix: str = "", collection: str = FP8_COLLECTION,
              recipe: Optional[DelayedScaling] = None) -> Optional[dict]:
    """This GEMM's delayed-scaling variables (postfix removed), created at init; None unless delayed FP8 is on.

    `recipe` defaults to the autocast's. Under a mutable collection, every use in one apply sees the state as the
    step started (the value written by `record_forward` is the next step's)."""
    recipe = context.get_recipe() if recipe is None else recipe
    if isinstance(recipe, NVFP4BlockScaling):
        return _sr_key(module, recipe)
    if not isinstance(recipe, DelayedScaling):
        return None
    memo = _memo(module) if module.is_mutable_collection(collection) and not module.is_initializing() else {}
    if (collection, postfix) in memo:
        return dict(memo[(collection, postfix)][0])
    fresh = init_group(recipe)
    group = {}
    for key, name in group_names(postfix, recipe.interval > 1).items():
        if not module.is_initializing() and not module.has_variable(collection, name):
            old = name.startswith("grad_update_count") and module.has_variable(collection, "update_count" + postfix)
            fix = ("it was saved by an older fp8kit: convert the collection with fp8kit.jax.upgrade_fp8_metas" if old
                   else "initialize the layer (layer.init) inside te.autocast(enabled=True, "
                        "recipe=DelayedScaling(...)) and pass all variables to apply")
            raise ValueError(f"{type(module).__name__} {module.name or ''}: no {collection}/{name}: {fix}")
        value = module.variable(collection, name, lambda k=key: fresh[k]).value
        shape = (recipe.amax_history_len,) if key.endswith("_amax_history") else (1,)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{type(module).__name__}: {collection}/{name} has shape {tuple(value.shape)} but the recipe "
                f"needs {shape} (amax_history_len={recipe.amax_history_len}); re-initialize, or resize the history "
                f"(truncate or zero-pad its end)"
            )
        group[key] = value
    return group


def record_forward(module: nn.Module, group: Optional[dict], x: jax.Array, kernel: jax.Array, postfix: str = "",
                   collection: str = FP8_COLLECTION) -> None:
    """Under a mutable `collection` (`apply(..., mutable=[...])`), write this GEMM's forward state (x, kernel)
    updated with this step's amaxes, max-combined over the uses in this apply. A no-op otherwise (the update then
    comes back as the gradient of the state)."""
    if group is None or module.is_initializing() or not module.is_mutable_collection(collection):
        return
    recipe = context.get_recipe()
    axes = amax_axes(x)
    amaxes = jnp.stack([state_amax(x, group["x_scale"], axes), state_amax(kernel, group["kernel_scale"], axes)])
    memo = _memo(module)
    key = (collection, postfix)
    if key in memo:
        amaxes = max_nonneg(memo[key][1], amaxes)
    memo[key] = (dict(group), amaxes)
    staged = stage_group(group, amaxes, FORWARD_TENSORS)
    new = staged if context.is_deferred() else update_forward(staged, recipe)
    names = group_names(postfix, recipe.interval > 1)
    for k in names:
        if k in new and not k.startswith("grad"):
            module.put_variable(collection, names[k], new[k])


def fp8_dense(module: nn.Module, x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array], dtype: Any,
              contracting_dims, input_axes, kernel_axes, postfix: str = "") -> jax.Array:
    """One GEMM of a Flax layer: its delayed-scaling state (`postfix` names it among the layer's GEMMs), the forward
    record under a mutable collection, then `dense` (FP8 off while initializing). Outside FP8 the kernel and bias
    are cast to the computation dtype `dtype` first. The layer's `precision` and `transpose_batch_sequence` apply."""
    group = fp8_state(module, postfix)
    if uses_fp8(module):
        record_forward(module, group, x, kernel, postfix)
    else:
        kernel = kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
    with gemm_scope(module):
        return dense(x, kernel, bias, contracting_dims=contracting_dims, input_axes=input_axes,
                     kernel_axes=kernel_axes, quantizer_set=group, precision=module.precision,
                     transpose_batch_sequence=module.transpose_batch_sequence)


# ---- LayerNorm parameters, LoRA -----------------------------------------------------------------------------------

def layernorm_params(module: nn.Module, norm_type: str, hidden: int, zero_centered_gamma: bool,
                     scale_init: Optional[Initializer], scale_axes, bias_init: Initializer, bias_axes,
                     param_dtype: Any) -> Tuple[jax.Array, Optional[jax.Array]]:
    """The "scale" (gamma) and, for layernorm, "ln_bias" (beta) parameters, shape `[hidden]`."""
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    gamma = module.param("scale", with_axes(scale_init, scale_axes), (hidden,), param_dtype)
    beta = None
    if norm_type == "layernorm":
        beta = module.param("ln_bias", with_axes(bias_init, bias_axes), (hidden,), param_dtype)
    return gamma, beta


def low_rank_adaptation(module: nn.Module, x: jax.Array, in_shape: Tuple[int, ...], features: Tuple[int, ...],
                        rank: int, alpha: Optional[float], kernel_init: Initializer, prefix: str = "",
                        param_dtype: Any = jnp.float32) -> jax.Array:
    """The LoRA term `(x . A) . B * alpha / rank` (1 when alpha is None) in high precision, x's dtype: x
    `[..., *in]` (trailing axes), A "{prefix}lora_a_kernel" `[*in, *features[:-1], rank]` (kernel_init), B
    "{prefix}lora_b_kernel" `[*features[:-1], rank, features[-1]]` (zeros)."""
    a_shape = tuple(in_shape) + tuple(features[:-1]) + (rank,)
    b_shape = tuple(features[:-1]) + (rank, features[-1])
    a = module.param(f"{prefix}lora_a_kernel", flat_kernel_init(kernel_init, len(in_shape)), a_shape, param_dtype)
    b = module.param(f"{prefix}lora_b_kernel", nn.initializers.zeros, b_shape, param_dtype)
    n_in, n_mid = len(in_shape), len(features) - 1
    xa = jax.lax.dot_general(x, a.astype(x.dtype), ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))),
                                                    ((), ())))
    # xa: [..., *mid, rank]; contract (mid, rank) with B's leading axes, keeping mid by an outer einsum
    batch = x.ndim - n_in
    letters = "abcdefghijklmn"  # not r or o
    lead, mid = letters[:batch], letters[batch:batch + n_mid]
    out = jnp.einsum(f"{lead}{mid}r,{mid}ro->{lead}{mid}o", xa, b.astype(x.dtype))
    scaling = alpha / rank if alpha is not None else 1.0
    return (out * scaling).astype(x.dtype)
