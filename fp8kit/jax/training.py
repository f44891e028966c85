"""Training-step helpers on trees of FP8 state: split the gradients, merge collections, combine microbatches.

A tree of FP8 state is the content of the "fp8_metas" collection (or of "_overwrite_with_gradient" for
`make_dot_general_cls`): nested mappings whose leaves are the groups of fp8kit/jax/state.py.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from ..recipe import DelayedScaling
from .cast import max_nonneg
from .state import COUNT, FP8_COLLECTION, GRAD_COUNT, group_names, update_group

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "OVERWRITE_WITH_GRADIENT",
    "FP8_COLLECTIONS",
    "split_grads",
    "update_collections",
    "accumulate_grads",
    "update_fp8_metas",
    "upgrade_fp8_metas",
    "map_groups",
    "keep_old_if_missing",
]

NVTE_FP8_COLLECTION_NAME = FP8_COLLECTION  # Transformer Engine's name for "fp8_metas"
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # flax's collection, used by make_dot_general_cls
FP8_COLLECTIONS = (FP8_COLLECTION, OVERWRITE_WITH_GRADIENT)

_HISTORY_KEY = re.compile(r"x(.*)_amax_history")


def _postfixes(level: Mapping[str, Any]) -> List[str]:
    out = []
    for key in level:
        m = _HISTORY_KEY.fullmatch(str(key))
        if m and all(n in level for n in group_names(m.group(1), False).values()):
            out.append(m.group(1))
    return out


def _has_counts(level: Mapping[str, Any], postfix: str) -> bool:
    fwd, bwd = f"{COUNT}{postfix}" in level, f"{GRAD_COUNT}{postfix}" in level
    if fwd and not bwd:
        raise ValueError(
            f"fp8_metas: {COUNT}{postfix} without {GRAD_COUNT}{postfix}: a state saved by an older fp8kit, whose one "
            "count served both states; convert it with fp8kit.jax.upgrade_fp8_metas(fp8_metas)"
        )
    return fwd


def map_groups(fn: Callable, tree: Mapping[str, Any], *others: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Rebuild `tree` (nested mappings of FP8 state) with `fn(group, *other_groups)` applied to every group (dicts
    with the postfix removed); `others` are trees of the same layout or None."""
    out: Dict[str, Any] = {}
    for postfix in _postfixes(tree):
        names = group_names(postfix, _has_counts(tree, postfix))
        group = {k: tree[v] for k, v in names.items()}
        other_groups = [None if o is None else {k: o[v] for k, v in names.items()} for o in others]
        for k, v in fn(group, *other_groups).items():
            out[names[k]] = v
    for key, value in tree.items():
        if key in out:
            continue
        if isinstance(value, Mapping):
            out[key] = map_groups(fn, value, *[None if o is None else o[key] for o in others])
        else:
            out[key] = value
    return out


@jax.jit
def _keep_old_jit(group: Dict[str, jax.Array], old: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    # shape (..., 1): one flag per state, also for states stacked by nn.scan / nn.vmap
    missing = (group["x_scale"] == 0) & (group["kernel_scale"] == 0) & (group["grad_scale"] == 0)
    return {k: jnp.where(missing, old[k], v) for k, v in group.items()}


def keep_old_if_missing(group: Dict[str, jax.Array], old: Optional[Dict[str, jax.Array]]) -> Dict[str, jax.Array]:
    """A group that got no cotangent (its layer did not reach the loss this step) has all-zero scales, which no
    update produces; keep the old state for it."""
    return group if old is None else _keep_old_jit(group, old)


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
        metas = map_groups(keep_old_if_missing, metas, fp8_metas)
    return params, dict(metas)


def update_collections(new: Mapping[str, Any], original: Mapping[str, Any]) -> Mapping[str, Any]:
    """`original` with the collections of `new` put in its place (Transformer Engine's helper), e.g.
    `variables = update_collections({"fp8_metas": new_fp8_metas}, variables)`. Returns a FrozenDict when
    `original` is one, else a dict."""
    for name, value in (("new", new), ("original", original)):
        if not isinstance(value, (dict, FrozenDict)):
            raise TypeError(f"update_collections: {name} must be a dict or FrozenDict, got {type(value).__name__}")
    merged = {**dict(original), **dict(new)}
    return FrozenDict(merged) if isinstance(original, FrozenDict) else merged


def accumulate_grads(acc: Optional[Mapping[str, Any]], grads: Mapping[str, Any]) -> Dict[str, Any]:
    """Combine the gradients of two microbatches: "params" (and any other collection) are summed, the FP8 collections
    are combined with an elementwise max, which is exact for staged states (taken under `deferred_update()`).
    `acc=None` returns `grads`."""
    if acc is None:
        return dict(grads)
    out = {}
    for key in grads:
        combine = max_nonneg if key in FP8_COLLECTIONS else jnp.add
        out[key] = jax.tree.map(combine, acc[key], grads[key])
    return out


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
    recipe = recipe.snapshot()  # its fields now (the jitted update is cached per snapshot)

    def finalize(group, old):
        return keep_old_if_missing(_batched_update(recipe, group["x_scale"].ndim - 1)(group), old)

    return map_groups(finalize, staged, fp8_metas)


@functools.lru_cache(maxsize=64)
def _batched_update(recipe: DelayedScaling, batch_ndim: int):
    """`update_group` for one recipe, vmapped over the leading axes of states stacked by nn.scan / nn.vmap, jitted."""
    update = functools.partial(update_group, recipe=recipe)
    for _ in range(batch_ndim):
        update = jax.vmap(update)
    return jax.jit(update)


def upgrade_fp8_metas(tree: Mapping[str, Any]) -> Dict[str, Any]:
    """Convert FP8 state saved before the two states of a GEMM counted `interval` separately: every group with
    `update_count{postfix}` but no `grad_update_count{postfix}` gets one, equal to its `update_count` (the shared
    count the group had). Other groups are returned unchanged."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        out[key] = upgrade_fp8_metas(value) if isinstance(value, Mapping) else value
        m = re.fullmatch(f"{COUNT}(.*)", str(key))
        if m and f"{GRAD_COUNT}{m.group(1)}" not in tree:
            out[f"{GRAD_COUNT}{m.group(1)}"] = value
    return out
