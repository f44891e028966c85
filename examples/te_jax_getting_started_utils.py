"""Timing helper for examples/te_jax_getting_started.py (the counterpart of the guide's getting_started_utils_jax):
`speedometer` times a jitted forward + backward of a Flax module's `apply` inside `te.autocast`."""

import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

import fp8kit.jax as te
from fp8kit.jax.sharding import MeshResource


def speedometer(apply_fn: Callable, params: Any, x: jnp.ndarray, forward_kwargs: Optional[dict] = None,
                autocast_kwargs: Optional[dict] = None, timing_iters: int = 3, warmup_iters: int = 1,
                label: str = "benchmark") -> float:
    """Mean milliseconds of `jax.value_and_grad(sum(apply_fn(params, x, **forward_kwargs)))`, jitted inside
    `te.autocast(**autocast_kwargs)` (high precision by default). CPU-sized iteration counts."""
    forward_kwargs = dict(forward_kwargs or {})
    autocast_kwargs = dict(autocast_kwargs or {"enabled": False})
    autocast_kwargs.setdefault("mesh_resource", MeshResource())

    def loss_fn(params, x):
        return jnp.sum(apply_fn(params, x, **forward_kwargs).astype(jnp.float32))

    with te.autocast(**autocast_kwargs):
        step = jax.jit(jax.value_and_grad(loss_fn))
        for _ in range(warmup_iters):
            jax.block_until_ready(step(params, x))
        start = time.perf_counter()
        for _ in range(timing_iters):
            jax.block_until_ready(step(params, x))
    mean_ms = (time.perf_counter() - start) / timing_iters * 1000
    print(f"{label}: mean time {mean_ms:.3f} ms")
    return mean_ms
