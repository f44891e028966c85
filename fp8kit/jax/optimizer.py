"""`wrap_optimizer`: an optax optimizer over the whole variables dict that keeps the FP8 state out of it.

With delayed scaling the gradient of "fp8_metas" is the updated state, not a gradient: fed to Adam it would turn
every scale into about 0.999. The wrapper runs the inner optimizer on the other collections only and returns, for
the FP8 collections, updates that `optax.apply_updates` turns into exactly the new state:

    tx = te.wrap_optimizer(optax.adam(1e-3))
    opt_state = tx.init(variables)
    grads = jax.grad(loss)(variables)                       # variables = {"params": ..., "fp8_metas": ...}
    updates, opt_state = tx.update(grads, opt_state, variables)
    variables = optax.apply_updates(variables, updates)     # or flax TrainState(params=variables).apply_gradients

An FP8 update is a `Replace` leaf: `param + Replace(new)` is `new` (bit for bit). Use the wrapper as the outermost
transformation: another optax transformation applied to its updates would not know what a `Replace` is.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax

from .training import FP8_COLLECTIONS, keep_old_if_missing, map_groups

__all__ = ["wrap_optimizer", "Replace"]


@jax.tree_util.register_pytree_node_class
class Replace:
    """An update that replaces the parameter: `param + Replace(value)` is `value` (cast to the parameter's dtype by
    `optax.apply_updates`)."""

    __slots__ = ("value",)

    def __init__(self, value: jax.Array):
        self.value = value

    def __radd__(self, param: Any) -> Any:
        return self.value

    def __repr__(self) -> str:
        return f"Replace({self.value!r})"

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class WrappedState(NamedTuple):
    """The inner optimizer's state (over the non-FP8 collections)."""

    inner: Any


def _split(tree: Any, names: Tuple[str, ...]):
    if not isinstance(tree, Mapping) or not any(n in tree for n in names):
        return tree, {}
    rest = {k: v for k, v in tree.items() if k not in names}
    return rest, {k: v for k, v in tree.items() if k in names}


def wrap_optimizer(
    inner: optax.GradientTransformation, fp8_collections: Sequence[str] = FP8_COLLECTIONS
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` (any optax transformation) for the whole variables dict: the collections in `fp8_collections`
    ("fp8_metas" and flax's "_overwrite_with_gradient") are left out of `inner`, and their "gradients" (the updated
    FP8 state) become `Replace` updates. FP8 state of layers that did not reach the loss (all-zero scales in the
    gradient) keeps its old value, so `update` needs `params` (the current variables)."""
    names = tuple(fp8_collections)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        rest, _ = _split(params, names)
        return WrappedState(inner.init(rest))

    def update_fn(updates, state: WrappedState, params: Optional[Any] = None, **extra):
        rest, fp8 = _split(updates, names)
        params_rest, params_fp8 = _split(params, names) if params is not None else (None, {})
        new_rest, inner_state = inner.update(rest, state.inner, params_rest, **extra)
        if not fp8:
            return new_rest, WrappedState(inner_state)
        if params is None:
            raise ValueError("wrap_optimizer: update(grads, state, params) needs params (the current variables) to "
                             f"keep the FP8 state of layers absent from the step ({', '.join(sorted(fp8))})")
        out = dict(new_rest)
        for key, new_state in fp8.items():
            if key not in params_fp8:
                raise ValueError(f"wrap_optimizer: the gradients hold {key!r} but params do not")
            kept = map_groups(keep_old_if_missing, new_state, params_fp8[key])
            out[key] = jax.tree.map(lambda v: Replace(jnp.asarray(v)), kept)
        return out, WrappedState(inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
