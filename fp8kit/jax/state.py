"""Delayed-scaling state in the Flax collection "fp8_metas", and its update (SPEC sections 4 and 5).

One GEMM owns one *group* of variables, named as in Transformer Engine (postfix "" for DenseGeneral, "_0" and "_1"
for the two GEMMs of LayerNormMLP):

    x{postfix}_scale, kernel{postfix}_scale, grad{postfix}_scale                  float32 (1,), ones
    x{postfix}_amax_history, kernel{postfix}_amax_history, grad{postfix}_amax_history   float32 (L,), zeros
    update_count{postfix}, grad_update_count{postfix}                             float32 (1,), zeros; only when
                                                                                  recipe.interval > 1

A group holds two *states*, as a PyTorch module does: the forward state (x and kernel, fp8_max = max_fwd) and the
backward state (grad, the output gradient, max_bwd). Row 0 of a history is the staging row. Each state counts the
updates it takes part in (one where a slot was used, i.e. its staged amax is not 0; NaN counts as used; every update
when the recipe has callables), modulo `interval`; its scales are recomputed when that count is 0 before the update.
`update_count` is the forward state's count, `grad_update_count` the backward state's.

Inside this module a group is a dict with the postfix removed ("x_scale", ..., "update_count").
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from ..recipe import DelayedScaling
from .cast import F32, fmax_nonneg, is_nonzero, max_nonneg, scale_from_amax

__all__ = [
    "FP8_COLLECTION",
    "TENSORS",
    "FORWARD_TENSORS",
    "COUNT",
    "GRAD_COUNT",
    "group_names",
    "init_group",
    "stage_group",
    "update_forward",
    "update_backward",
    "update_group",
]

FP8_COLLECTION = "fp8_metas"
TENSORS = ("x", "kernel", "grad")
FORWARD_TENSORS = ("x", "kernel")
COUNT = "update_count"
GRAD_COUNT = "grad_update_count"


def group_names(postfix: str, with_count: bool) -> Dict[str, str]:
    """Stripped name -> variable name in the collection, for one GEMM."""
    names = {}
    for t in TENSORS:
        names[f"{t}_scale"] = f"{t}{postfix}_scale"
        names[f"{t}_amax_history"] = f"{t}{postfix}_amax_history"
    if with_count:
        names[COUNT] = f"{COUNT}{postfix}"
        names[GRAD_COUNT] = f"{GRAD_COUNT}{postfix}"
    return names


def init_group(recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """A fresh group: histories of zeros, scales of ones (and zero counts when `interval > 1`)."""
    group = {}
    for t in TENSORS:
        group[f"{t}_scale"] = jnp.ones((1,), F32)
        group[f"{t}_amax_history"] = jnp.zeros((recipe.amax_history_len,), F32)
    if recipe.interval > 1:
        group[COUNT] = jnp.zeros((1,), F32)
        group[GRAD_COUNT] = jnp.zeros((1,), F32)
    return group


# ---- the update rule on stacked [L, n] histories -------------------------------------------------------------

def _rolled(history: jax.Array) -> jax.Array:
    """[0, h[2..L-1], h[0]] per column ([0] for L = 1)."""
    zero = jnp.zeros_like(history[:1])
    if history.shape[0] == 1:
        return zero
    return jnp.concatenate([zero, history[2:], history[:1]], axis=0)


def update_slots(
    history: jax.Array, scale: jax.Array, recompute: jax.Array, fp8_max: float, recipe: DelayedScaling
) -> Tuple[jax.Array, jax.Array]:
    """One SPEC-5 update of a staged `[L, n]` history (row 0 holds this step's reduced amax) and its `[n]` scale.

    `recompute` (a bool scalar) is False on the updates `interval` skips. Returns (history, scale), float32.
    """
    scaled_max = recipe.scaled_max(fp8_max)
    last = history[0]
    algo = recipe.amax_compute_algo
    if not recipe.uses_callables:
        used = is_nonzero(last)  # an unused slot neither rolls nor rescales
        amax = last if algo == "most_recent" else fmax_nonneg(history, axis=0)
        new_scale = scale_from_amax(amax, scaled_max, scale, recipe.power_2_scale)
        new_scale = jnp.where(used & recompute, new_scale, scale)
        return jnp.where(used[None, :], _rolled(history), history), new_scale
    # callables see the whole staged history; the history always rolls
    if callable(algo):
        amax = jnp.asarray(algo(history), F32).reshape(scale.shape)
    elif algo == "most_recent":
        amax = last
    else:
        amax = fmax_nonneg(history, axis=0)
    if recipe.scaling_factor_compute_algo is not None:
        new_scale = jnp.asarray(recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe), F32)
        new_scale = new_scale.reshape(scale.shape)
    else:
        new_scale = scale_from_amax(amax, scaled_max, scale, recipe.power_2_scale)
    return _rolled(history), jnp.where(recompute, new_scale, scale)


def _count_step(count: Optional[jax.Array], history: jax.Array, recipe: DelayedScaling):
    """(recompute, new count) of one state: recompute when its count is 0; the count advances (modulo interval)
    when the state takes part in this update."""
    if count is None:
        return jnp.asarray(True), None
    used = jnp.asarray(True) if recipe.uses_callables else jnp.any(is_nonzero(history[0]))
    nxt = count + 1
    nxt = jnp.where(nxt >= recipe.interval, jnp.zeros_like(nxt), nxt)
    return count[0] == 0, jnp.where(used, nxt, count)


def stage_group(group: Mapping[str, jax.Array], last: jax.Array, tensors=TENSORS) -> Dict[str, jax.Array]:
    """Max-accumulate this step's amaxes `last` (one per name in `tensors`) into the staging rows (SPEC section 4)."""
    out = dict(group)
    for i, t in enumerate(tensors):
        h = group[f"{t}_amax_history"]
        out[f"{t}_amax_history"] = h.at[0].set(max_nonneg(h[0], last[i]))
    return out


def update_forward(group: Mapping[str, jax.Array], recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """SPEC-5 update of the forward state (x, kernel: fp8_max = max_fwd) of a staged group; returns its variables."""
    history = jnp.stack([group["x_amax_history"], group["kernel_amax_history"]], axis=1)
    recompute, count = _count_step(group.get(COUNT), history, recipe)
    h, s = update_slots(history, jnp.concatenate([group["x_scale"], group["kernel_scale"]]), recompute,
                        recipe.fp8_format.value.max_fwd, recipe)
    out = {"x_amax_history": h[:, 0], "kernel_amax_history": h[:, 1], "x_scale": s[0:1], "kernel_scale": s[1:2]}
    if count is not None:
        out[COUNT] = count
    return out


def update_backward(group: Mapping[str, jax.Array], recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """SPEC-5 update of the backward state (grad: fp8_max = max_bwd) of a staged group; returns its variables."""
    history = group["grad_amax_history"][:, None]
    recompute, count = _count_step(group.get(GRAD_COUNT), history, recipe)
    h, s = update_slots(history, group["grad_scale"], recompute, recipe.fp8_format.value.max_bwd, recipe)
    out = {"grad_amax_history": h[:, 0], "grad_scale": s}
    if count is not None:
        out[GRAD_COUNT] = count
    return out


def update_group(group: Mapping[str, jax.Array], recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """Apply the SPEC-5 update to both states of a staged group."""
    return {**update_forward(group, recipe), **update_backward(group, recipe)}
