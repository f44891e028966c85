"""Delayed-scaling state in the Flax collection "fp8_metas", and its update (SPEC sections 4 and 5).

One GEMM owns one *group* of variables, named as in Transformer Engine (postfix "" for DenseGeneral, "_0" and "_1"
for the two GEMMs of LayerNormMLP):

    x{postfix}_scale, kernel{postfix}_scale, grad{postfix}_scale                  float32 (1,), ones
    x{postfix}_amax_history, kernel{postfix}_amax_history, grad{postfix}_amax_history   float32 (L,), zeros
    update_count{postfix}                                                         float32 (1,), zeros; only when
                                                                                  recipe.interval > 1

`x` and `kernel` are forward tensors (fp8_max = max_fwd), `grad` (the output gradient) is a backward tensor
(max_bwd). Row 0 of a history is the staging row. `update_count` holds the number of updates modulo `interval`.

Inside this module a group is a dict with the postfix removed ("x_scale", ..., "update_count").
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from ..recipe import DelayedScaling
from .cast import F32, fmax_nonneg, is_nonzero, max_nonneg, scale_from_amax

__all__ = [
    "FP8_COLLECTION",
    "TENSORS",
    "group_names",
    "init_group",
    "stage_group",
    "update_group",
    "split_grads",
    "accumulate_grads",
    "update_fp8_metas",
]

FP8_COLLECTION = "fp8_metas"
TENSORS = ("x", "kernel", "grad")
COUNT = "update_count"


def group_names(postfix: str, with_count: bool) -> Dict[str, str]:
    """Stripped name -> variable name in the collection, for one GEMM."""
    names = {}
    for t in TENSORS:
        names[f"{t}_scale"] = f"{t}{postfix}_scale"
        names[f"{t}_amax_history"] = f"{t}{postfix}_amax_history"
    if with_count:
        names[COUNT] = f"{COUNT}{postfix}"
    return names


def init_group(recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """A fresh group: histories of zeros, scales of ones (and a zero count when `interval > 1`)."""
    group = {}
    for t in TENSORS:
        group[f"{t}_scale"] = jnp.ones((1,), F32)
        group[f"{t}_amax_history"] = jnp.zeros((recipe.amax_history_len,), F32)
    if recipe.interval > 1:
        group[COUNT] = jnp.zeros((1,), F32)
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


def stage_group(group: Mapping[str, jax.Array], last: jax.Array) -> Dict[str, jax.Array]:
    """Max-accumulate this step's amaxes `last` = [x, kernel, grad] into the staging rows (SPEC section 4)."""
    out = dict(group)
    for i, t in enumerate(TENSORS):
        h = group[f"{t}_amax_history"]
        out[f"{t}_amax_history"] = h.at[0].set(max_nonneg(h[0], last[i]))
    return out


def update_group(group: Mapping[str, jax.Array], recipe: DelayedScaling) -> Dict[str, jax.Array]:
    """Apply the SPEC-5 update to a staged group: forward tensors (x, kernel) with max_fwd, grad with max_bwd."""
    fmt = recipe.fp8_format.value
    count = group.get(COUNT)
    recompute = jnp.asarray(True) if count is None else count[0] == 0
    fwd_h, fwd_s = update_slots(
        jnp.stack([group["x_amax_history"], group["kernel_amax_history"]], axis=1),
        jnp.concatenate([group["x_scale"], group["kernel_scale"]]),
        recompute,
        fmt.max_fwd,
        recipe,
    )
    bwd_h, bwd_s = update_slots(group["grad_amax_history"][:, None], group["grad_scale"], recompute, fmt.max_bwd,
                                recipe)
    out = {
        "x_amax_history": fwd_h[:, 0],
        "kernel_amax_history": fwd_h[:, 1],
        "grad_amax_history": bwd_h[:, 0],
        "x_scale": fwd_s[0:1],
        "kernel_scale": fwd_s[1:2],
        "grad_scale": bwd_s,
    }
    if count is not None:
        nxt = count + 1
        out[COUNT] = jnp.where(nxt >= recipe.interval, jnp.zeros_like(nxt), nxt)
    return out


# ---- walking fp8_metas trees ---------------------------------------------------------------------------------

_HISTORY_KEY = re.compile(r"x(.*)_amax_history")


def _postfixes(level: Mapping[str, Any]) -> List[str]:
    out = []
    for key in level:
        m = _HISTORY_KEY.fullmatch(str(key))
        if m and all(n in level for n in group_names(m.group(1), False).values()):
            out.append(m.group(1))
    return out


def _map_groups(fn, tree: Mapping[str, Any], *others: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Rebuild `tree` (nested mappings of fp8_metas) with `fn(group, *other_groups)` applied to every group."""
    out: Dict[str, Any] = {}
    postfixes = _postfixes(tree)
    for postfix in postfixes:
        names = group_names(postfix, f"{COUNT}{postfix}" in tree)
        group = {k: tree[v] for k, v in names.items()}
        other_groups = [None if o is None else {k: o[v] for k, v in names.items()} for o in others]
        for k, v in fn(group, *other_groups).items():
            out[names[k]] = v
    for key, value in tree.items():
        if key in out:
            continue
        if isinstance(value, Mapping):
            out[key] = _map_groups(fn, value, *[None if o is None else o[key] for o in others])
        else:
            out[key] = value
    return out


def _keep_old_if_missing(group: Dict[str, jax.Array], old: Optional[Dict[str, jax.Array]]) -> Dict[str, jax.Array]:
    """A group that got no cotangent (its layer did not reach the loss this step) has all-zero scales, which no
    update produces; keep the old state for it."""
    return group if old is None else _keep_old_jit(group, old)


@jax.jit
def _keep_old_jit(group: Dict[str, jax.Array], old: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    # shape (..., 1): one flag per state, also for states stacked by nn.scan / nn.vmap
    missing = (group["x_scale"] == 0) & (group["kernel_scale"] == 0) & (group["grad_scale"] == 0)
    return {k: jnp.where(missing, old[k], v) for k, v in group.items()}


def split_grads(
    grads: Mapping[str, Any], fp8_metas: Optional[Mapping[str, Any]] = None
) -> Tuple[Any, Dict[str, Any]]:
    """Split `grads = jax.grad(loss)(variables)` into `(param_grads, new_fp8_metas)`.

    `param_grads` is `grads["params"]` (what the optimizer may see); `new_fp8_metas` is the updated content of the
    "fp8_metas" collection ({} under current scaling). Pass the old `fp8_metas` so that layers that did not reach
    the loss this step keep their state (their cotangent is all zeros). States gathered under `deferred_update()`
    are staged: use `update_fp8_metas` on them instead.
    """
    if not isinstance(grads, Mapping):
        raise TypeError(f"split_grads: expected the dict returned by jax.grad(loss)(variables), got {type(grads)}")
    params = grads.get("params", {})
    metas = grads.get(FP8_COLLECTION, {})
    if fp8_metas is not None and metas:
        metas = _map_groups(_keep_old_if_missing, metas, fp8_metas)
    return params, dict(metas)


def update_fp8_metas(
    staged: Mapping[str, Any], fp8_metas: Optional[Mapping[str, Any]] = None, recipe: Optional[DelayedScaling] = None
) -> Dict[str, Any]:
    """Turn staged states (gradients of "fp8_metas" taken under `deferred_update()`, possibly combined over
    microbatches with `accumulate_grads`) into updated states: SPEC-5 update of every group, with row 0 of each
    history as this step's amax. Groups that got no cotangent keep the old state from `fp8_metas`.

    `recipe` defaults to the recipe of the enclosing enabled `autocast`.
    """
    from .context import get_recipe

    recipe = get_recipe() if recipe is None else recipe
    if not isinstance(recipe, DelayedScaling):
        raise ValueError("update_fp8_metas: needs a DelayedScaling recipe (pass recipe= or call it inside autocast)")

    def finalize(group, old):
        return _keep_old_if_missing(_batched_update(recipe, group["x_scale"].ndim - 1)(group), old)

    return _map_groups(finalize, staged, fp8_metas)


@functools.lru_cache(maxsize=64)
def _batched_update(recipe: DelayedScaling, batch_ndim: int):
    """`update_group` for one recipe, vmapped over the leading axes of states stacked by nn.scan / nn.vmap, jitted."""
    update = functools.partial(update_group, recipe=recipe)
    for _ in range(batch_ndim):
        update = jax.vmap(update)
    return jax.jit(update)


def accumulate_grads(acc: Optional[Mapping[str, Any]], grads: Mapping[str, Any]) -> Dict[str, Any]:
    """Combine the gradients of two microbatches: "params" (and any other collection) are summed, "fp8_metas" are
    combined with an elementwise max, which is exact for staged states (taken under `deferred_update()`).
    `acc=None` returns `grads`."""
    if acc is None:
        return dict(grads)
    out = {}
    for key in grads:
        if key == FP8_COLLECTION:
            out[key] = jax.tree.map(max_nonneg, acc[key], grads[key])
        else:
            out[key] = jax.tree.map(jnp.add, acc[key], grads[key])
    return out
