"""Transformer Engine's policy for pickled `_extra_state` payloads (`transformer_engine.pytorch._extra_state`).

A module's `_extra_state` may be a pickle. Transformer Engine only unpickles one when the payload can carry
delayed-scaling state (the one recipe whose state it checkpoints as a pickle) and the user opted in with
`NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`; payloads that can only describe a stateless recipe are ignored.
`should_load_extra_state_pickle` makes that decision by reading the pickle's opcodes (nothing is executed).

fp8kit itself reads such payloads with the allow-list unpickler of `te_checkpoint` whatever this says; the query is
here for code written against Transformer Engine that asks it before loading a checkpoint itself.
"""

from __future__ import annotations

import enum
import os
import pickletools
from typing import Optional

from ..recipe import Recipe

__all__ = ["CheckpointExtraStatePolicy", "UNSAFE_PICKLE_EXTRA_STATE_ENV", "recipe_extra_state_policy",
           "is_stateless_recipe", "should_load_extra_state_pickle", "unsafe_pickle_extra_state_enabled"]

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"

# the module names a pickled recipe class may carry: fp8kit's public one, where its classes are defined, and TE's
_RECIPE_MODULES = ("fp8kit.recipe", "fp8kit.recipe.per_tensor", "fp8kit.recipe.block",
                   "transformer_engine.common.recipe")
_PUBLIC_RECIPE_MODULE = "fp8kit.recipe"
# the keys of the delayed-scaling state dict that Transformer Engine pickles
_DELAYED_STATE_KEYS = frozenset({"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"})
_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "BINUNICODE8",
                         "SHORT_BINUNICODE"})


class CheckpointExtraStatePolicy(enum.Enum):
    """What a recipe's pickled extra state can hold: nothing (`STATELESS`), delayed-scaling state that needs the
    pickle (`STATEFUL_FP8_DELAYED_SCALING`), or it depends on the payload (`DYNAMIC`, CustomRecipe)."""

    STATELESS = "stateless"
    STATEFUL_FP8_DELAYED_SCALING = "stateful_fp8_delayed_scaling"
    DYNAMIC = "dynamic"


_POLICY_BY_CLASS = {
    "DelayedScaling": CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING,
    "Float8CurrentScaling": CheckpointExtraStatePolicy.STATELESS,
    "MXFP8BlockScaling": CheckpointExtraStatePolicy.STATELESS,
    "Float8BlockScaling": CheckpointExtraStatePolicy.STATELESS,
    "NVFP4BlockScaling": CheckpointExtraStatePolicy.STATELESS,
    "CustomRecipe": CheckpointExtraStatePolicy.DYNAMIC,
}
# keyed as Transformer Engine keys it: (public module of the recipe classes, class name)
_RECIPE_POLICIES = {(_PUBLIC_RECIPE_MODULE, name): policy for name, policy in _POLICY_BY_CLASS.items()}


def _policy_of_global(module: str, name: str) -> Optional[CheckpointExtraStatePolicy]:
    return _POLICY_BY_CLASS.get(name) if module in _RECIPE_MODULES else None


def recipe_extra_state_policy(recipe: Recipe) -> Optional[CheckpointExtraStatePolicy]:
    """The checkpoint policy of a recipe instance (None for a recipe class this table does not know)."""
    cls = type(recipe)
    return _policy_of_global(cls.__module__, cls.__name__)


def is_stateless_recipe(recipe: Recipe) -> bool:
    """True when the recipe keeps no state that a checkpoint must carry."""
    return recipe_extra_state_policy(recipe) is CheckpointExtraStatePolicy.STATELESS


def unsafe_pickle_extra_state_enabled() -> bool:
    """True when the user opted in to unpickling extra state (`NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`)."""
    return os.environ.get(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1"


def _as_text(arg) -> Optional[str]:
    if isinstance(arg, str):
        return arg
    if isinstance(arg, bytes):
        try:
            return arg.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _needs_unpickling(data: bytes) -> bool:
    """False when the payload can be ignored (empty, or it can only describe a stateless recipe); True when only
    unpickling it could recover its content (delayed-scaling state, an unknown shape, or not a pickle at all)."""
    if not data:
        return False
    texts = []
    has_global = has_recipe_key = has_delayed_keys = False
    policies = set()
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _STRING_OPS:
                text = _as_text(arg)
                if text is not None:
                    texts.append(text)
                    has_recipe_key |= text == "recipe"
                    has_delayed_keys |= text in _DELAYED_STATE_KEYS
                continue
            if op.name == "GLOBAL":
                parts = arg.split() if isinstance(arg, str) else []
                ref = tuple(parts) if len(parts) == 2 else None
            elif op.name == "STACK_GLOBAL":
                ref = tuple(texts[-2:]) if len(texts) >= 2 else None
            else:
                continue
            has_global = True
            policy = _policy_of_global(*ref) if ref else None
            if policy is not None:
                policies.add(policy)
    except Exception:  # not a pickle that pickletools can walk: only the user can decide to trust it
        return True
    if not has_global and not has_delayed_keys:
        return False  # no global: unpickling builds only plain containers, which carry no FP8 state
    if not has_recipe_key or has_delayed_keys or not policies:
        return True  # Transformer Engine 1.x (delayed scaling, no recipe stored), delayed state, or unknown
    return CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING in policies


def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
    """False: the pickled extra state `data` holds nothing to load (ignore it). True: it must be unpickled and the
    user allowed that. Raises RuntimeError naming `UNSAFE_PICKLE_EXTRA_STATE_ENV` when it must be unpickled and
    the user did not allow it. `context` names the module or checkpoint in the message."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"should_load_extra_state_pickle: data must be bytes, got {type(data).__name__}")
    if not _needs_unpickling(bytes(data)):
        return False
    if unsafe_pickle_extra_state_enabled():
        return True
    raise RuntimeError(
        f"{context}: the pickled extra state may hold delayed-scaling FP8 state, and unpickling it can run "
        f"arbitrary code; set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 to load it if the checkpoint comes from a trusted "
        "source")
