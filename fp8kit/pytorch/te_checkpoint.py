"""Transformer Engine's FP8 state in its checkpoints (`<prefix>_extra_state`), read without running arbitrary pickle.

Transformer Engine modules keep their delayed-scaling state as a pickled Python dict under `<prefix>_extra_state`.
The layouts this reader takes (from the history of `get_extra_state` in transformer_engine/pytorch/module/base.py,
and module.py before 0.9):

- TE 0.6 - 0.11 and 2.0 - 2.20 (main in 2026): a uint8 tensor holding `pickle.dumps(state)` (TE 0.12 - 1.13 also
  wrote it so under ONNX export). TE 2.x adds `"recipe"` (a `transformer_engine.common.recipe` object) and writes
  the scales for delayed scaling only; from 2.4 a module that never ran in FP8 writes an empty tensor (before: the
  pickle of None), from 2.18 so does a stateless recipe (current scaling, block scaling).
- TE 0.12 - 1.13: an `io.BytesIO` holding `torch.save(state)`.
- a dict: already unpickled by whoever loaded the checkpoint (TE 0.3 - 0.5 stored the dict itself).

`state` is None (no FP8 state) or a dict with `scale_fwd` `[3n]`, `amax_history_fwd` `[L, 3n]`, `scale_bwd` `[2n]`,
`amax_history_bwd` `[L, 2n]` for n GEMMs (TE 0.6 on; TE 0.5 and older used 2 and 1 slots per GEMM, which fp8kit
refuses), `extra_fp8_variables` (plain values: `num_gemms`, `fp8_max_fwd`, ...; no update counter), and depending
on the version `scale_inv_fwd` / `scale_inv_bwd` (0.8 - 1.13), `global_fp8_buffer` / `global_fp8_state` (0.6 -
1.5), `recipe` (2.0 on). Only the histories and scales are used.

The pickle is read by `RestrictedUnpickler`, whose `find_class` admits an explicit allow-list: plain containers,
torch's tensor rebuild function, a replacement for `torch.storage._load_from_bytes` that calls
`torch.load(..., weights_only=True)`, and stand-ins (`TEObject`) for the classes of
`transformer_engine.common.recipe` that record their fields without importing Transformer Engine. Anything else
(`os.system`, a user's recipe class, a callable `amax_compute_algo`) is refused with an error naming it.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, MutableMapping, Optional

import torch

from .state_entry import CheckpointEntryError, bad_fp8_entry

__all__ = ["TEExtraState", "TEObject", "RestrictedUnpickler", "read_extra_state", "EXTRA_STATE_KEY",
           "with_te_extra_state", "accept_extra_state"]

EXTRA_STATE_KEY = "_extra_state"  # torch.nn.Module's suffix for get_extra_state / set_extra_state
_RECIPE_MODULE = "transformer_engine.common.recipe"
_STATE_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_FORMATS = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID", (6, 6): "E2M1"}


class TEObject:
    """Stand-in for an instance of a class of `transformer_engine.common.recipe` (a recipe, `Format`, `MMParams`,
    ...): `te_class` is the class name, `args` the constructor arguments the pickle passed, `fields` the attribute
    dict it restored. Nothing of Transformer Engine is imported or run."""

    te_class = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.fields, obj.member = tuple(args), dict(kwargs), None
        return obj

    def __init__(self, *args, **kwargs):
        pass  # __new__ recorded the arguments (pickle's NEWOBJ calls only __new__)

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{_RECIPE_MODULE}.{self.te_class}: expected a dict of fields, got "
                                         f"{type(state).__name__}")
        self.fields.update(state)

    @property
    def format_name(self) -> Optional[str]:
        """For a `Format` stand-in: "E4M3", "E5M2", "HYBRID" or "E2M1" (None if it cannot tell)."""
        if self.member is not None:
            return self.member
        if len(self.args) == 1:
            helper = self.args[0]
            values = helper.args if isinstance(helper, TEObject) else helper
            if isinstance(values, tuple) and len(values) >= 2:
                return _FORMATS.get((values[0], values[1]))
        return None

    def __repr__(self) -> str:
        if self.member is not None or self.te_class == "Format":
            return f"{self.te_class}.{self.format_name}"
        shown = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.fields.items() if not k.startswith("_")]
        return f"{self.te_class}({', '.join(shown)})"


_STUBS: Dict[str, type] = {}


def _stub_class(name: str) -> type:
    if not name.isidentifier():
        raise pickle.UnpicklingError(f"refusing to unpickle {_RECIPE_MODULE}.{name!r}: not a class name")
    if name not in _STUBS:
        _STUBS[name] = type(name, (TEObject,), {"te_class": name, "__module__": __name__,
                                                "__qualname__": f"TEObject[{name}]"})
    return _STUBS[name]


def _enum_member(owner, name):
    """`getattr` as pickles of enum members by name use it (`getattr(Format, "HYBRID")`), for stand-ins only."""
    if not (isinstance(owner, type) and issubclass(owner, TEObject) and isinstance(name, str)
            and name.isidentifier()):
        raise pickle.UnpicklingError(f"refusing builtins.getattr on {owner!r}: the reader only resolves members of "
                                     f"{_RECIPE_MODULE} classes")
    member = owner()
    member.member = name
    return member


def _load_from_bytes(data: bytes):
    """torch.storage._load_from_bytes (how plain pickle stores a tensor's storage), with weights_only=True and the
    storage on the CPU whatever device it was saved from."""
    if not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError(f"torch.storage._load_from_bytes: expected bytes, got {type(data).__name__}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        named = _globals_in(bytes(data))
        raise pickle.UnpicklingError(
            "refusing the bytes of a tensor storage (torch.storage._load_from_bytes)"
            + (f", which reference {', '.join(named)}" if named else "")
            + f": torch.load(weights_only=True) refused them ({_reason(err)})") from None


def _reason(err: Exception) -> str:
    """The gist of torch.load's weights_only error (which goes on to suggest weights_only=False)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line:
            return line
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line and i + 1 < len(lines):
            return lines[i + 1]
    return lines[0] if lines else type(err).__name__


def _globals_in(data: bytes) -> List[str]:
    """The globals the consecutive pickles in `data` name, read with pickletools (nothing is run), for messages."""
    found: List[str] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data) and len(found) < 8:
        strings: List[str] = []
        try:
            for opcode, arg, _ in pickletools.genops(stream):
                if opcode.name == "GLOBAL":
                    found.append(".".join(str(arg).split(" ", 1)))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
        except Exception:  # not a pickle (a storage's raw bytes follow the pickles): stop
            break
    return found


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    """torch._utils._rebuild_tensor_v2 without the pickled gradient flag and hooks."""
    from torch._utils import _rebuild_tensor_v2 as rebuild  # torch's own name for it

    return rebuild(storage, storage_offset, size, stride, False, collections.OrderedDict(), metadata)


def _encode(text, encoding="latin1"):
    """_codecs.encode as protocol 2 pickles use it for bytes."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("refusing _codecs.encode other than of a str to latin1 bytes")
    return text.encode("latin1")


_ALLOWED = {
    ("builtins", "dict"): dict, ("builtins", "list"): list, ("builtins", "tuple"): tuple, ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset, ("builtins", "bytearray"): bytearray, ("builtins", "complex"): complex,
    ("builtins", "getattr"): _enum_member,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _encode,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
}


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that builds only plain containers, tensors and `TEObject` stand-ins (see the module
    docstring); any other global raises `pickle.UnpicklingError` naming it."""

    def find_class(self, module: str, name: str):
        if module == _RECIPE_MODULE:
            return _stub_class(name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: a Transformer Engine `_extra_state` holds only containers, "
            f"tensors and {_RECIPE_MODULE} objects, and fp8kit runs no other code from a checkpoint")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"refusing a pickle persistent id ({type(pid).__name__}): not part of "
                                     "Transformer Engine's `_extra_state`")


@dataclass
class TEExtraState:
    """What a Transformer Engine `_extra_state` holds. `scales` maps "scaling_fwd" / "scaling_bwd" to
    `(amax_history [L, n], scale [n])` (empty when the module kept no delayed-scaling state, e.g. under current
    scaling); `recipe` is the TE recipe as a `TEObject` (TE 2.0 on) or None; `extra` is `extra_fp8_variables`;
    `layout` says which serialisation it came in."""

    layout: str
    recipe: Optional[TEObject] = None
    scales: Dict[str, tuple] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)


def _unpickle(data: bytes):
    return RestrictedUnpickler(io.BytesIO(data)).load()


def read_extra_state(value) -> Optional[TEExtraState]:
    """Decode the value of a `<prefix>_extra_state` key of a Transformer Engine checkpoint; None when it holds no
    FP8 state. Raises `pickle.UnpicklingError` (a global outside the allow-list), `TypeError` or `ValueError`
    (anything else it cannot read), naming what it found."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise TypeError(f"expected a 1-D uint8 tensor of pickled bytes, got {value.dtype} of shape "
                            f"{tuple(value.shape)}")
        if value.numel() == 0:
            return None
        state, layout = _unpickle(value.detach().cpu().contiguous().numpy().tobytes()), "pickled uint8 tensor"
    elif isinstance(value, io.BytesIO):
        try:
            state = torch.load(io.BytesIO(value.getvalue()), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as err:
            raise pickle.UnpicklingError(
                f"torch.load(weights_only=True) refused the io.BytesIO: {_reason(err)}") from None
        layout = "io.BytesIO of torch.save (TE 0.12 - 1.13)"
    elif isinstance(value, dict):
        state, layout = value, "dict"
    elif isinstance(value, list):
        raise ValueError("a list is Transformer Engine's layout up to 0.2 (2 forward slots per GEMM), which fp8kit "
                         "does not read")
    else:
        raise TypeError(f"expected a uint8 tensor, an io.BytesIO or a dict, got {type(value).__name__}")
    return _interpret(state, layout)


def _interpret(state, layout: str) -> Optional[TEExtraState]:
    if state is None:
        return None
    if not isinstance(state, dict):
        raise TypeError(f"expected the pickled state to be a dict (or None), got {type(state).__name__}")
    recipe = state.get("recipe")
    if recipe is not None and not isinstance(recipe, TEObject):
        raise TypeError(f"expected 'recipe' to be a {_RECIPE_MODULE} object, got {type(recipe).__name__}")
    extra = state.get("extra_fp8_variables", {})
    result = TEExtraState(layout, recipe, {}, dict(extra) if isinstance(extra, dict) else {})
    present = [k for k in _STATE_TENSORS if k in state]
    if not present:
        return result  # a recipe without delayed-scaling state (current scaling, ...)
    missing = [k for k in _STATE_TENSORS if k not in state]
    if missing:
        raise ValueError(f"holds {', '.join(present)} but not {', '.join(missing)}")
    for key in _STATE_TENSORS:
        if not isinstance(state[key], torch.Tensor):
            raise TypeError(f"expected '{key}' to be a tensor, got {type(state[key]).__name__}")
    result.scales = {"scaling_fwd": (state["amax_history_fwd"], state["scale_fwd"]),
                     "scaling_bwd": (state["amax_history_bwd"], state["scale_bwd"])}
    return result


def _entries(decoded: TEExtraState, num_gemms: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """fp8kit's `fp8_meta.<pass>` entries from decoded TE state; raises ValueError naming TE's field."""
    entries = {}
    for name, per_gemm, te_pass in (("scaling_fwd", 3, "fwd"), ("scaling_bwd", 2, "bwd")):
        history, scale = decoded.scales[name]
        slots = per_gemm * num_gemms
        if history.dim() == 2 and history.shape[1] == (per_gemm - 1) * num_gemms != slots:
            raise ValueError(f"amax_history_{te_pass} has {history.shape[1]} columns: Transformer Engine 0.5 and "
                             f"older kept {per_gemm - 1} per GEMM, fp8kit (and TE 0.6 on) {per_gemm}")
        found = {"amax_history": history, "scale": scale, "update_count": torch.zeros((), dtype=torch.int64)}
        field, problem = bad_fp8_entry(found, slots)
        if problem:
            raise ValueError(f"amax_history_{te_pass} / scale_{te_pass}: {field} {problem} (this module has "
                             f"{num_gemms} GEMM{'s' if num_gemms > 1 else ''})")
        entries[name] = found
    return entries


def with_te_extra_state(state_dict: Mapping, prefix: str, num_gemms: int) -> Mapping:
    """What fp8kit modules' `_load_from_state_dict` (modules/base.py) reads: when the checkpoint holds
    `<prefix>_extra_state` and no fp8kit `<prefix>fp8_meta.*` key, `state_dict` with the TE state added as fp8kit's
    keys (a ChainMap, nothing copied; the update counter starts at 0: TE keeps none); else `state_dict` as it is.
    Unreadable TE state raises CheckpointEntryError naming the key, before anything of the module is loaded.
    (`accept_extra_state` takes the key off the unexpected ones.)"""
    key = prefix + EXTRA_STATE_KEY
    if key not in state_dict:
        return state_dict
    ours = prefix + "fp8_meta."
    if any(isinstance(k, str) and k.startswith(ours) for k in state_dict):
        return state_dict  # fp8kit's own keys win
    try:
        decoded = read_extra_state(state_dict[key])
        entries = _entries(decoded, num_gemms) if decoded is not None and decoded.scales else {}
    except Exception as err:  # untrusted bytes: whatever fails to decode is reported, naming the key
        raise CheckpointEntryError(f"{key} (Transformer Engine's FP8 state): {type(err).__name__}: {err}") from err
    if not entries:
        return state_dict
    added: MutableMapping[str, torch.Tensor] = {}
    for name, found in entries.items():
        for f, value in found.items():
            added[f"{ours}{name}.{f}"] = value
    return ChainMap(added, state_dict)


def accept_extra_state(prefix: str, unexpected_keys: List[str]) -> None:
    """The hook of fp8kit modules without FP8 state (LayerNorm, RMSNorm): Transformer Engine's versions of them
    (built on te.ops since TE 1.13) save a `<prefix>_extra_state` too, which holds nothing such a module uses, so it
    is not an unexpected key. Nothing of it is read."""
    key = prefix + EXTRA_STATE_KEY
    unexpected_keys[:] = [k for k in unexpected_keys if k != key]
