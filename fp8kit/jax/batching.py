"""Amaxes of tensors cast with a delayed-scaling state, under `jax.vmap`.

A state shared by every member of a `jax.vmap` (the variables mapped with `in_axes=None`, or `nn.vmap` with the
collection broadcast) must see one amax per step, as one call on the whole batch would: the max over all members.
A plain `jnp.max` under vmap gives one amax per member instead, and JAX then SUMS the members' state cotangents,
which makes scales B times too small. `state_amax` reduces over the mapped axis exactly when the state is not mapped
along it (its `ref` argument, a leaf of the state, is unbatched); a state mapped with the data (an ensemble, one
state per member) keeps one amax per member.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from .cast import amax

__all__ = ["state_amax"]


@custom_vmap
def _amax(x: jax.Array, ref: jax.Array) -> jax.Array:
    del ref
    return amax(x)


@_amax.def_vmap
def _amax_vmap(axis_size: int, in_batched, x: jax.Array, ref: jax.Array):
    x_batched, ref_batched = in_batched
    if ref_batched:  # one state per member: one amax per member
        if x_batched:
            return jax.vmap(amax)(x), True
        return jnp.broadcast_to(amax(x), (axis_size,)), True
    return _amax(x, ref), False  # a shared state: the max over every member (x's mapped axis included)


def state_amax(x: jax.Array, ref: jax.Array, axis_names: Tuple[str, ...] = ()) -> jax.Array:
    """`max |x|` (NaN ignored) as a float32 scalar, for a tensor cast with the state `ref` belongs to: reduced over
    a `jax.vmap` axis when `ref` is not mapped along it, and all-reduced (MAX) over the bound mesh `axis_names`."""
    a = _amax(jax.lax.stop_gradient(x), jax.lax.stop_gradient(ref))
    if axis_names:  # on the bit patterns: exact for subnormals (non-negative floats order as their bits)
        bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
        for name in axis_names:
            bits = jax.lax.pmax(bits, name)
        a = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return a
