"""The trace-time settings of fp8kit.jax (autocast stack, deferred updates, mesh resource) and how `jax.jit` sees them.

Each setting is a context variable. Every context manager that changes one also enters a JAX *user context*
(`jax.make_user_context`) holding a key of all settings, which is part of `jax.jit`'s cache key: a jitted function
traced under one autocast is traced again (not silently reused) when it is called under another.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Tuple

import jax

__all__ = ["AUTOCAST", "DEFERRED", "MESH_RESOURCE", "scoped", "jit_key"]

AUTOCAST: contextvars.ContextVar[Tuple[Any, ...]] = contextvars.ContextVar("fp8kit_jax_autocast", default=())
DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8kit_jax_deferred", default=False)
MESH_RESOURCE: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("fp8kit_jax_mesh_resource",
                                                                                default=None)

_USER_CONTEXT = jax.make_user_context(None)


def jit_key() -> Tuple[Any, ...]:
    """What a trace depends on: the innermost autocast frame, the deferred flag and the mesh resource (all
    hashable)."""
    stack = AUTOCAST.get()
    return ("fp8kit", stack[-1] if stack else None, DEFERRED.get(), MESH_RESOURCE.get())


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """Set `var` to `value` for the body, with `jax.jit`'s cache key following."""
    token = var.set(value)
    try:
        with _USER_CONTEXT(jit_key()):
            yield
    finally:
        var.reset(token)
