"""`autocast` and the trace-time context the FP8 layers read.

Everything here is read when a function is traced. The autocast settings are part of `jax.jit`'s cache key
(fp8kit/jax/settings.py): a jitted function traced outside `autocast` is traced again when called inside one. The
context is a context-local stack; nothing is read from environment variables and nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
import weakref
from typing import Iterator, List, Optional, Tuple

from jax import lax
from jax.extend.core import get_opaque_trace_state

from ..recipe import DelayedScaling, Recipe
from . import settings
from .scaling_modes import block_kind
from .sharding import MeshResource, current_mesh_resource, global_shard_guard

__all__ = ["MeshResource", "autocast", "fp8_autocast", "deferred_update", "get_recipe", "is_fp8_enabled"]


@dataclasses.dataclass(frozen=True)
class _Frame:
    enabled: bool
    recipe: Optional[Recipe]  # None when disabled (so that disabled frames share one jit key)


def _trace_stack() -> Optional[List[object]]:
    """The current trace and its parents (the traces that are still running), or None if this JAX does not expose
    them (jax._src.core.trace_ctx is internal; only used to forget the tokens of finished traces)."""
    try:
        from jax._src.core import trace_ctx

        trace = trace_ctx.trace
    except Exception:  # pragma: no cover - a JAX without this internal
        return None
    stack = []
    while trace is not None:
        stack.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return stack


class _Table(dict):
    """id(x_scale tracer) -> (weakref to it, token); a dict that can be weakly referenced."""


def _forget(table_ref: weakref.ref, key: int) -> None:
    table = table_ref()
    if table is not None:
        table.pop(key, None)


class _TokenRegistry:
    """The latest token of each delayed-scaling state in each running trace, so that every use of one state in one
    trace joins one chain and the state gets ONE cotangent (see dense.py).

    A table per trace, keyed by the identity of the state's `x_scale` value (a tracer: every use in a trace sees the
    same object). Tables of traces that have finished (no longer on the trace stack) are dropped at the next use, and
    an entry goes as soon as its `x_scale` tracer is garbage collected; the registry dies with the outermost
    autocast.
    """

    max_tables = 64  # only used when the trace stack cannot be read

    def __init__(self) -> None:
        self._tables: List[Tuple[object, _Table]] = []

    def _table(self, create: bool) -> Optional[_Table]:
        stack = _trace_stack()
        if stack is None:  # fall back to JAX's opaque trace state and a bounded number of tables
            key = get_opaque_trace_state()
            match = [table for other, table in self._tables if other == key]
            if match or not create:
                return match[0] if match else None
            self._tables = self._tables[-(self.max_tables - 1):] + [(key, _Table())]
            return self._tables[-1][1]
        running = {id(t) for t in stack}
        self._tables = [(ref, table) for ref, table in self._tables
                        if isinstance(ref, weakref.ref) and ref() is not None and id(ref()) in running]
        for ref, table in self._tables:
            if ref() is stack[0]:
                return table
        if not create:
            return None
        self._tables.append((weakref.ref(stack[0]), _Table()))
        return self._tables[-1][1]

    def get(self, leaf: object) -> Optional[object]:
        table = self._table(create=False)
        entry = None if table is None else table.get(id(leaf))
        return entry[1] if entry is not None and entry[0]() is leaf else None

    def put(self, leaf: object, token: object) -> None:
        table = self._table(create=True)
        key = id(leaf)
        if key not in table or table[key][0]() is not leaf:
            weakref.finalize(leaf, _forget, weakref.ref(table), key)
        table[key] = (weakref.ref(leaf), token)


_REGISTRY: contextvars.ContextVar[Optional[_TokenRegistry]] = contextvars.ContextVar("fp8kit_jax_tokens", default=None)


@contextlib.contextmanager
def autocast(
    enabled: bool = False, recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None
) -> Iterator[None]:
    """Run the fp8kit Flax layers (and `fp8kit.jax.dense`) traced inside this context in FP8.

    enabled: False runs them in high precision (the default, as in Transformer Engine).
    recipe: `DelayedScaling`, `Float8CurrentScaling`, `MXFP8BlockScaling`, `Float8BlockScaling` or
      `NVFP4BlockScaling`; None means `DelayedScaling()`. Its fields are read at entry (`recipe.snapshot()`,
      which `get_recipe()` returns): assigning to the recipe later acts from the next entry.
    mesh_resource: which mesh axes are data/tensor/... parallel (amaxes are reduced over all but pipeline).
    Contexts nest; the innermost one decides. Settings are read at trace time.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, Recipe):
        raise ValueError(
            f"recipe: expected fp8kit.recipe.DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
            f"Float8BlockScaling or NVFP4BlockScaling, got {type(recipe).__name__}"
        )
    if not recipe.float8_per_tensor_scaling() and block_kind(recipe) is None:
        raise NotImplementedError(f"autocast: {type(recipe).__name__} is not implemented in fp8kit.jax yet (its "
                                  "quantizers are missing); use DelayedScaling, Float8CurrentScaling, "
                                  "MXFP8BlockScaling, Float8BlockScaling or NVFP4BlockScaling")
    recipe = recipe.snapshot()  # the fields at entry: traces (and jax.jit's cache) key on them
    if mesh_resource is None:
        mesh_resource = MeshResource()
    if not isinstance(mesh_resource, MeshResource):
        raise ValueError(f"mesh_resource: expected a fp8kit.jax.MeshResource, got {type(mesh_resource).__name__}")
    stack = settings.AUTOCAST.get()
    registry_token = _REGISTRY.set(_TokenRegistry()) if not stack else None
    try:
        with global_shard_guard(mesh_resource):
            with settings.scoped(settings.AUTOCAST, stack + (_Frame(enabled, recipe if enabled else None),)):
                yield
    finally:
        if registry_token is not None:
            _REGISTRY.reset(registry_token)


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = False, fp8_recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None
) -> Iterator[None]:
    """The older name of `autocast` (Transformer Engine's `fp8_autocast(enabled, fp8_recipe, mesh_resource)`);
    deprecated in favour of `autocast`, as in Transformer Engine."""
    warnings.warn("fp8_autocast is deprecated; use autocast(enabled=..., recipe=..., mesh_resource=...)",
                  DeprecationWarning, stacklevel=3)
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield


@contextlib.contextmanager
def deferred_update() -> Iterator[None]:
    """Inside this context, traced delayed-scaling layers return STAGED states as the gradient of "fp8_metas":
    the old history with this step's amax max-accumulated into row 0, the old scale (and update count).

    Staged states of microbatches combine exactly with an elementwise max (`accumulate_grads`); turn them into the
    updated state with `split_grads(..., fp8_metas=old)` / `update_fp8_metas`. See docs/jax.md.
    """
    with settings.scoped(settings.DEFERRED, True):
        yield


def current_frame() -> Optional[_Frame]:
    stack = settings.AUTOCAST.get()
    return stack[-1] if stack else None


def is_fp8_enabled() -> bool:
    """True inside an enabled `autocast`."""
    frame = current_frame()
    return frame is not None and frame.enabled


def get_recipe() -> Optional[Recipe]:
    """The recipe of the innermost enabled `autocast`, or None when FP8 is off."""
    frame = current_frame()
    return frame.recipe if frame is not None and frame.enabled else None


def is_deferred() -> bool:
    """True inside `deferred_update()`."""
    return settings.DEFERRED.get()


def token_registry() -> _TokenRegistry:
    """The token registry of the outermost autocast (a fresh, unshared one outside autocast)."""
    registry = _REGISTRY.get()
    return registry if registry is not None else _TokenRegistry()


def bound_amax_axes() -> Tuple[str, ...]:
    """The amax reduction axes of the current MeshResource that are bound here (inside `shard_map`, or a named
    `vmap` / `pmap`); empty under plain `jit`, where reductions over global arrays are already global."""
    out = []
    for name in current_mesh_resource().amax_axes:
        try:
            lax.axis_size(name)
        except NameError:
            continue
        out.append(name)
    return tuple(out)


def pipeline_axis() -> Optional[str]:
    """The pipeline-parallel axis of the current MeshResource (never reduced over), or None."""
    return current_mesh_resource().pp_resource
