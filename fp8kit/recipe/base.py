"""What every recipe shares: the formats, float32 helpers, field checks, `QParams` / `MMParams`, and `Recipe`, the
base class that makes recipes mutable (as Transformer Engine's are), validated on construction and on every
assignment, and able to give a read-only, hashable `snapshot()` of their fields.

Why snapshots: autocast keys its registry, states, compile guards and JAX trace cache on a recipe. Code written for
Transformer Engine mutates recipes between steps (`recipe.reduce_amax = False`), so autocast takes `snapshot()` at
entry and keys everything on that. A snapshot is cached on its recipe until the next assignment, so entering
autocast with an unchanged recipe costs one attribute read; a changed recipe gets a new snapshot (O(fields)) at its
next entry, and states built for the old one keep their own key.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import weakref
from enum import Enum
from typing import Any, ClassVar, Dict, NamedTuple, Tuple

__all__ = ["Format", "Recipe", "QParams", "MMParams", "FLT_MAX", "SCALE_MIN", "f32", "BACKWARD_OVERRIDES"]

# Largest finite float32; an infinite scale is replaced by it.
FLT_MAX = 3.4028234663852886e38
# Smallest scale fp8kit ever uses, 2**-63: the product of two reciprocals (a GEMM's `scale_inv_a * scale_inv_b`) is
# then at most 2**126, so neither dequantized values nor GEMM results overflow because of a scale. Computed scales
# are clamped to [SCALE_MIN, FLT_MAX]; only amaxes above fp8_max * 2**(63 - margin) reach the lower bound.
SCALE_MIN = 2.0 ** -63

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


_FLOAT32 = struct.Struct("f")


def f32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float (beyond the float32 range: +-inf)."""
    if value != value:
        return value
    if abs(value) >= FLT_MAX:
        # within half an ulp beyond FLT_MAX still rounds to FLT_MAX
        return math.copysign(FLT_MAX if abs(value) < FLT_MAX + 2.0 ** 103 else math.inf, value)
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


class _FormatHelper(NamedTuple):
    """Maxima and element type names ("e2m1", "e4m3" or "e5m2") for forward and backward tensors."""

    max_fwd: float
    max_bwd: float
    fwd: str
    bwd: str


class Format(Enum):
    """Element formats: E2M1 (FP4, NVFP4 only), E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2
    backward).

    `Format.HYBRID.value.max_fwd == 448.0`, `.max_bwd == 57344.0`; `.fwd` / `.bwd` name the element type.
    """

    E2M1 = _FormatHelper(6.0, 6.0, "e2m1", "e2m1")
    E4M3 = _FormatHelper(448.0, 448.0, "e4m3", "e4m3")
    E5M2 = _FormatHelper(57344.0, 57344.0, "e5m2", "e5m2")
    HYBRID = _FormatHelper(448.0, 57344.0, "e4m3", "e5m2")


# ---- field checks: a bad value raises ValueError naming the field ------------------------------------------------

def fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(name, f"expected a bool, got {type(value).__name__} {value!r}")


def check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        fail(name, f"expected an int >= {low}, got {value!r}")


def check_real(name: str, value: Any, low: float = 0.0) -> float:
    """A finite real >= `low` whose float32 value is finite too; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low \
            or abs(f32(float(value))) > FLT_MAX:
        fail(name, f"expected a finite real number >= {low:g} (within float32), got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices or isinstance(value, bool):
        fail(name, f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def check_format(value: Any, allowed: Tuple[Format, ...], name: str = "fp8_format") -> None:
    if not isinstance(value, Format) or value not in allowed:
        names = " or ".join(f"Format.{f.name}" for f in allowed)
        fail(name, f"expected {names}, got {value!r}")


def check_instance(name: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        fail(name, f"expected a fp8kit.recipe.{cls.__name__}, got {value!r}")


def check_no_attention(recipe: Any) -> None:
    for name in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, name)
        check_bool(name, value)
        if value:
            raise NotImplementedError(
                f"{name}=True asks for FP8 attention, which fp8kit does not implement; "
                f"leave {name}=False (attention then runs in high precision)"
            )


def check_precision_override(recipe: Any) -> None:
    olp = recipe.override_linear_precision
    if not isinstance(olp, (tuple, list)) or len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
        fail("override_linear_precision", f"expected three bools (fprop, dgrad, wgrad), got {olp!r}")
    object.__setattr__(recipe, "override_linear_precision", tuple(olp))


# ---- GEMM and quantization options (immutable, as in Transformer Engine) -------------------------------------------

@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options. `use_split_accumulator=False` lets an FP8 GEMM on CUDA accumulate in the tensor cores' faster,
    less precise mode (cuBLASLt fast accumulation); the CPU emulation always accumulates in float32."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        check_bool("use_split_accumulator", self.use_split_accumulator)


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization options of one tensor role: `power_2_scale` rounds scales down to powers of two, `amax_epsilon`
    floors the amax (per-tensor current scaling and FP8 block scaling); `random_hadamard_transform`,
    `stochastic_rounding` and `fp4_2d_quantization` (16x16 blocks) belong to NVFP4. A recipe refuses options that
    do not apply to it, naming the field."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        check_bool("power_2_scale", self.power_2_scale)
        object.__setattr__(self, "amax_epsilon", check_real("amax_epsilon", self.amax_epsilon))
        for name in FP4_OPTIONS:
            check_bool(name, getattr(self, name))

    def __repr__(self) -> str:  # Transformer Engine's text
        return (f"Qparams(\npower_2_scale={self.power_2_scale},\namax_epsilon={self.amax_epsilon},\n"
                f"random_hadamard_transform={self.random_hadamard_transform},\n"
                f"stochastic_rounding={self.stochastic_rounding},\nfp4_2d_quantization={self.fp4_2d_quantization}\n)")


FP4_OPTIONS = ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")


def check_qparams(recipe: Any, name: str, refused: Tuple[str, ...]) -> None:
    """`recipe.<name>` is a QParams whose options in `refused` are at their defaults."""
    value = getattr(recipe, name)
    check_instance(name, value, QParams)
    default = QParams()
    for option in refused:
        if getattr(value, option) != getattr(default, option):
            fail(name, f"{option}={getattr(value, option)!r} does not apply to {type(recipe).__name__}")


# ---- the base class ------------------------------------------------------------------------------------------------

_CACHES = ("_snapshot", "_repr", "_hash")
# Equal snapshots are one object (while any is referenced): registry keys then match by identity too, which is how
# torch.compile looks up objects of user classes in dicts while it traces.
_INTERNED: "weakref.WeakValueDictionary[tuple, Recipe]" = weakref.WeakValueDictionary()
_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def field_names(cls: type) -> Tuple[str, ...]:
    """The dataclass fields of recipe class `cls`, filled in when the first instance is built (torch.compile, which
    may compare recipes while it traces, cannot trace `dataclasses.fields`)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class Recipe:
    """Base of fp8kit's recipes, as in Transformer Engine.

    - Mutable: assigning a field validates the recipe as construction does (a bad value raises ValueError naming the
      field and leaves the recipe unchanged); assigning a name that is not a field raises AttributeError.
    - Equal when of the same class with equal fields. Not hashable (as in Transformer Engine): `snapshot()` is.
    - The predicates (`delayed()`, `mxfp8()`, ...) are class methods: they answer on the class and on an instance.
    - `snapshot()`: a read-only copy (same class, hashable), the one autocast keys on; cached until the next
      assignment.
    """

    _kind: ClassVar[str] = ""
    # fields that None derives from the others (QParams); those assigned a value stay as assigned
    _derived: ClassVar[Tuple[str, ...]] = ()
    _snapshot: ClassVar[Any] = None
    _frozen: ClassVar[bool] = False

    @classmethod
    def delayed(cls) -> bool:
        """Delayed scaling (per-tensor scales from an amax history)."""
        return cls._kind == "delayed"

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """Per-tensor current scaling."""
        return cls._kind == "current"

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """Either per-tensor recipe (delayed or current scaling)."""
        return cls._kind in ("delayed", "current")

    @classmethod
    def mxfp8(cls) -> bool:
        """MXFP8 block scaling."""
        return cls._kind == "mxfp8"

    @classmethod
    def nvfp4(cls) -> bool:
        """NVFP4 block scaling."""
        return cls._kind == "nvfp4"

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """FP8 block scaling (float32 scales per 1x128 or 128x128 block)."""
        return cls._kind == "float8_block"

    @classmethod
    def custom(cls) -> bool:
        """A custom recipe (user quantizer factory)."""
        return cls._kind == "custom"

    # ---- validation and mutation --------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        d = self.__dict__
        d["_explicit"] = frozenset(n for n in self._derived if d.get(n) is not None)
        field_names(type(self))
        self._validate()
        d["_ready"] = True
        self._take_snapshot()

    def _validate(self) -> None:
        """Check every field (ValueError naming it), normalise values, derive the `_derived` fields left None.
        Each of fp8kit's recipes has its own; a user's subclass may leave this one (no checks)."""

    def _derive(self, name: str) -> Any:
        """The value of derived field `name` when not assigned."""
        raise NotImplementedError

    def _fill_derived(self) -> None:
        explicit = self.__dict__["_explicit"]
        for name in self._derived:
            if name not in explicit:
                object.__setattr__(self, name, self._derive(name))

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if "_ready" not in d:  # the dataclass __init__: __post_init__ validates everything at once
            object.__setattr__(self, name, value)
            return
        cls = type(self).__name__
        if self._frozen:
            raise AttributeError(
                f"{cls}.{name}: this recipe is the read-only snapshot autocast took at entry; assign to the recipe "
                "object passed to autocast instead (the change applies from its next entry)")
        names = field_names(type(self))
        if name not in names:
            raise AttributeError(f"{cls} has no field {name!r}; its fields are: {', '.join(names)}")
        saved = {n: d[n] for n in names}
        saved["_explicit"] = d["_explicit"]
        object.__setattr__(self, name, value)
        if name in self._derived:
            d["_explicit"] = d["_explicit"] - {name} | ({name} if value is not None else frozenset())
        try:
            self._validate()
        except BaseException:
            d.update(saved)
            raise
        d.pop("_repr", None)
        self._take_snapshot()

    def _take_snapshot(self) -> None:
        """Build the snapshot of the current fields now (O(fields), at construction and at each assignment), so that
        `snapshot()` at autocast entry is one attribute read, also while torch.compile traces."""
        values = (type(self),) + self._values()
        try:
            h = hash(values)
        except TypeError:  # a field value that cannot be hashed: hash(snapshot) says which
            h = None
        snap = _INTERNED.get(values) if h is not None else None
        if snap is None:
            snap = object.__new__(type(self))
            sd = snap.__dict__
            sd.update({k: v for k, v in self.__dict__.items() if k not in _CACHES})
            sd["_frozen"] = True
            if h is not None:
                sd["_hash"] = h
                _INTERNED[values] = snap
        self.__dict__["_snapshot"] = snap

    def snapshot(self) -> "Recipe":
        """A read-only copy of the fields as they are now: same class, equal, hashable (`self` if this already is
        one). autocast keys everything it builds on it."""
        if self._frozen:
            return self
        return self._snapshot

    # ---- equality, hashing, repr, copies ------------------------------------------------------------------------

    def _values(self) -> tuple:
        return tuple(getattr(self, n) for n in field_names(type(self)))

    def __eq__(self, other: Any) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self is other or self._values() == other._values()

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            if not self._frozen:
                raise TypeError(f"unhashable type: '{type(self).__name__}' (recipes are mutable, as in Transformer "
                                "Engine; recipe.snapshot() is a read-only, hashable copy)")
            h = hash((type(self),) + self._values())  # raises, naming the unhashable field value's type
        return h

    def _make_repr(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)}" for n in field_names(type(self)))
        return f"recipe_type={type(self).__name__}" + (f", {fields}" if fields else "")

    def __repr__(self) -> str:
        text = self.__dict__.get("_repr")
        if text is None:
            text = self.__dict__["_repr"] = self._make_repr()
        return text

    def __getstate__(self) -> dict:
        # caches hold hashes of callables (by identity) and a snapshot: another process recomputes them
        return {k: v for k, v in self.__dict__.items() if k not in _CACHES}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_ready" not in state:  # pickled by an fp8kit whose recipes were frozen dataclasses
            self.__dict__["_explicit"] = frozenset()
            self._validate()
            self.__dict__["_ready"] = True
        if self._frozen:
            try:
                self.__dict__["_hash"] = hash((type(self),) + self._values())
            except TypeError:
                pass
        else:
            self._take_snapshot()


def format_name(fmt: Format) -> str:
    return fmt.name


def extras_repr(recipe: Any, defaults: Dict[str, Any]) -> str:
    """", name=value" for each fp8kit-only field that differs from its default (Transformer Engine's text then stays
    the same for the recipes it knows)."""
    return "".join(f", {n}={getattr(recipe, n)!r}" for n, d in defaults.items() if getattr(recipe, n) != d)
