"""`autocast`, `MeshResource` and the trace-time context the FP8 layers read.

Everything here is read when a function is traced (like every JAX configuration): a jitted function keeps the
autocast settings it was traced with. The context is a context-local stack; nothing is read from environment
variables and nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, List, Optional, Tuple

from jax import lax
from jax.extend.core import get_opaque_trace_state

from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["MeshResource", "autocast", "fp8_autocast", "deferred_update", "get_recipe", "is_fp8_enabled"]


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Names of the mesh axes used for each kind of parallelism (None: not used).

    Amaxes are all-reduced with MAX over every named axis except `pp_resource` (pipeline stages hold different
    layers, so their tensors are not shards of one tensor). Under `jax.jit` with sharded global arrays this happens
    by itself (the max of a global array is global); the names matter inside `shard_map`, where fp8kit calls
    `lax.pmax` over those of them that are bound.
    """

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None
    tpsp_resource: Optional[str] = None
    fsdp_resource: Optional[str] = None
    pp_resource: Optional[str] = None
    cp_resource: Optional[str] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{field.name}: expected a mesh axis name (str) or None, got {value!r}")

    @property
    def amax_axes(self) -> Tuple[str, ...]:
        """The axes amaxes are reduced over: every named axis except pipeline parallelism, without repeats."""
        names = (self.dp_resource, self.fsdp_resource, self.tp_resource, self.tpsp_resource, self.cp_resource)
        out: List[str] = []
        for name in names:
            if name is not None and name != self.pp_resource and name not in out:
                out.append(name)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Frame:
    enabled: bool
    recipe: Recipe
    mesh_resource: MeshResource


class _TokenRegistry:
    """Per trace, the latest token of each delayed-scaling state (keyed by the identity of its scale leaf), so that
    every use of one state in one trace joins one chain and the state gets ONE cotangent (see dense.py)."""

    max_traces = 16

    def __init__(self) -> None:
        self._traces: List[Tuple[object, dict]] = []

    def _table(self, create: bool) -> Optional[dict]:
        state = get_opaque_trace_state()
        for i, (other, table) in enumerate(self._traces):
            if other == state:
                if i != len(self._traces) - 1:
                    self._traces.append(self._traces.pop(i))
                return table
        if not create:
            return None
        self._traces.append((state, {}))
        del self._traces[: -self.max_traces]
        return self._traces[-1][1]

    def get(self, leaf: object) -> Optional[object]:
        table = self._table(create=False)
        entry = None if table is None else table.get(id(leaf))
        return entry[1] if entry is not None and entry[0] is leaf else None

    def put(self, leaf: object, token: object) -> None:
        self._table(create=True)[id(leaf)] = (leaf, token)


_STACK: contextvars.ContextVar[Tuple[_Frame, ...]] = contextvars.ContextVar("fp8kit_jax_autocast", default=())
_REGISTRY: contextvars.ContextVar[Optional[_TokenRegistry]] = contextvars.ContextVar("fp8kit_jax_tokens", default=None)
_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8kit_jax_deferred", default=False)


@contextlib.contextmanager
def autocast(
    enabled: bool = False, recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None
) -> Iterator[None]:
    """Run the fp8kit Flax layers (and `fp8kit.jax.dense`) traced inside this context in FP8.

    enabled: False runs them in high precision (the default, as in Transformer Engine).
    recipe: `DelayedScaling` or `Float8CurrentScaling`; None means `DelayedScaling()`.
    mesh_resource: which mesh axes are data/tensor/... parallel (amaxes are reduced over all but pipeline).
    Contexts nest; the innermost one decides. Settings are read at trace time.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(
            f"recipe: expected fp8kit.recipe.DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}"
        )
    if mesh_resource is None:
        mesh_resource = MeshResource()
    if not isinstance(mesh_resource, MeshResource):
        raise ValueError(f"mesh_resource: expected a fp8kit.jax.MeshResource, got {type(mesh_resource).__name__}")
    stack = _STACK.get()
    token = _STACK.set(stack + (_Frame(enabled, recipe, mesh_resource),))
    registry_token = _REGISTRY.set(_TokenRegistry()) if not stack else None
    try:
        yield
    finally:
        _STACK.reset(token)
        if registry_token is not None:
            _REGISTRY.reset(registry_token)


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = False, fp8_recipe: Optional[Recipe] = None, mesh_resource: Optional[MeshResource] = None
) -> Iterator[None]:
    """The older name of `autocast` (Transformer Engine's `fp8_autocast(enabled, fp8_recipe, mesh_resource)`)."""
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield


@contextlib.contextmanager
def deferred_update() -> Iterator[None]:
    """Inside this context, traced delayed-scaling layers return STAGED states as the gradient of "fp8_metas":
    the old history with this step's amax max-accumulated into row 0, the old scale (and update count).

    Staged states of microbatches combine exactly with an elementwise max (`accumulate_grads`); turn them into the
    updated state with `split_grads(..., fp8_metas=old)` / `update_fp8_metas`. See docs/jax.md.
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def current_frame() -> Optional[_Frame]:
    stack = _STACK.get()
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
    return _DEFERRED.get()


def token_registry() -> _TokenRegistry:
    registry = _REGISTRY.get()
    return registry if registry is not None else _TokenRegistry()


def bound_amax_axes() -> Tuple[str, ...]:
    """The amax reduction axes of the current autocast that are bound here (inside `shard_map`, or a named `vmap`
    / `pmap`); empty under plain `jit`, where reductions over global arrays are already global."""
    frame = current_frame()
    if frame is None:
        return ()
    out = []
    for name in frame.mesh_resource.amax_axes:
        try:
            lax.axis_size(name)
        except NameError:
            continue
        out.append(name)
    return tuple(out)
