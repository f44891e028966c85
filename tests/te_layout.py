"""Checkpoints in Transformer Engine's layout, made without Transformer Engine.

`fake_te_recipe_module()` inserts a module named `transformer_engine.common.recipe` into `sys.modules` (and removes
it on exit) holding stand-ins with TE 2.x's class names and fields (`Format`, `DelayedScaling`,
`Float8CurrentScaling`, ...), so that `pickle.dumps` writes the same class references TE's pickles hold.
`te_extra_state(...)` serialises a state dict exactly as TE's `get_extra_state` does
(`torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import pickle
import sys
import types
from typing import NamedTuple, Optional

import torch

MODULE = "transformer_engine.common.recipe"


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@contextlib.contextmanager
def format_pickled_by_name():
    """Format members pickle as `getattr(Format, name)` inside the block (how some Python versions write enums)."""
    Format.__reduce_ex__ = lambda self, proto: (getattr, (self.__class__, self._name_))
    try:
        yield
    finally:
        del Format.__reduce_ex__


@dataclasses.dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclasses.dataclass()
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: object = "max"
    scaling_factor_compute_algo: Optional[object] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass()
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_dpa: bool = False


_CLASSES = {"_FormatHelper": _FormatHelper, "Format": Format, "MMParams": MMParams, "DelayedScaling": DelayedScaling,
            "Float8CurrentScaling": Float8CurrentScaling}
for _name, _cls in _CLASSES.items():
    _cls.__module__ = MODULE
    _cls.__qualname__ = _name


@contextlib.contextmanager
def fake_te_recipe_module():
    """`transformer_engine.common.recipe` importable (for pickle) inside the block only."""
    names = ("transformer_engine", "transformer_engine.common", MODULE)
    saved = {n: sys.modules.get(n) for n in names}
    mod = types.ModuleType(MODULE)
    for name, cls in _CLASSES.items():
        setattr(mod, name, cls)
    sys.modules.update({"transformer_engine": types.ModuleType("transformer_engine"),
                        "transformer_engine.common": types.ModuleType("transformer_engine.common"), MODULE: mod})
    try:
        yield mod
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def pickled_state(state) -> torch.Tensor:
    """What TE's get_extra_state returns for `state` (2.x, and 0.6 - 0.11 outside ONNX export)."""
    with fake_te_recipe_module():
        data = pickle.dumps(state)
    assert MODULE not in sys.modules
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def te_state(history_fwd, scale_fwd, history_bwd, scale_bwd, recipe=None, num_gemms=1):
    """The dict TE 2.x pickles for a delayed-scaling module (CPU copies of the tensors)."""
    recipe = recipe if recipe is not None else DelayedScaling(amax_history_len=history_fwd.shape[0])
    extra = {"fp8_checkpoint": True, "num_gemms": num_gemms, "fp8_max_fwd": 448, "fp8_max_bwd": 57344}
    return {"recipe": recipe, "scale_fwd": scale_fwd.clone(), "amax_history_fwd": history_fwd.clone(),
            "scale_bwd": scale_bwd.clone(), "amax_history_bwd": history_bwd.clone(), "extra_fp8_variables": extra}


def te_layout(fp8kit_state_dict, prefix: str = "", extra_state=None):
    """An fp8kit module's state dict rewritten in TE's layout: the parameters as they are, the `fp8_meta.*` keys
    replaced by one `_extra_state` (made from them unless `extra_state` is given)."""
    out, meta = {}, {}
    for key, value in fp8kit_state_dict.items():
        if key.startswith(prefix + "fp8_meta."):
            meta[key[len(prefix + "fp8_meta."):]] = value
        else:
            out[key] = value
    if extra_state is None:
        extra_state = pickled_state(te_state(meta["scaling_fwd.amax_history"], meta["scaling_fwd.scale"],
                                             meta["scaling_bwd.amax_history"], meta["scaling_bwd.scale"]))
    out[prefix + "_extra_state"] = extra_state
    return out
