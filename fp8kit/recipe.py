"""FP8 formats and scaling recipes, shared by the PyTorch and JAX frontends.

This module imports neither torch nor jax. Recipes are frozen dataclasses: immutable, hashable, equal when every
field is equal, and validated at construction (unknown keywords raise TypeError, bad values raise ValueError naming
the field). They derive from `Recipe`, whose class-level predicates (`delayed()`, `float8_current_scaling()`, ...)
answer as Transformer Engine's do, on the class or on an instance.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "QParams", "MMParams", "FLT_MAX",
           "SCALE_MIN", "f32"]

# Largest finite float32; an infinite scale is replaced by it.
FLT_MAX = 3.4028234663852886e38
# Smallest scale fp8kit ever uses, 2**-63: the product of two reciprocals (a GEMM's `scale_inv_a * scale_inv_b`) is
# then at most 2**126, so neither dequantized values nor GEMM results overflow because of a scale. Computed scales
# are clamped to [SCALE_MIN, FLT_MAX]; only amaxes above fp8_max * 2**(63 - margin) reach the lower bound.
SCALE_MIN = 2.0 ** -63


def f32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float (beyond the float32 range: +-inf)."""
    if value != value:
        return value
    if abs(value) >= FLT_MAX:
        # within half an ulp beyond FLT_MAX still rounds to FLT_MAX
        return math.copysign(FLT_MAX if abs(value) < FLT_MAX + 2.0 ** 103 else math.inf, value)
    return struct.unpack("f", struct.pack("f", value))[0]


class _FormatHelper(NamedTuple):
    """Maxima and FP8 element type names ("e4m3" or "e5m2") for forward and backward tensors."""

    max_fwd: float
    max_bwd: float
    fwd: str
    bwd: str


class Format(Enum):
    """FP8 formats: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 backward).

    `Format.HYBRID.value.max_fwd == 448.0`, `.max_bwd == 57344.0`; `.fwd` / `.bwd` name the element type.
    """

    E4M3 = _FormatHelper(448.0, 448.0, "e4m3", "e4m3")
    E5M2 = _FormatHelper(57344.0, 57344.0, "e5m2", "e5m2")
    HYBRID = _FormatHelper(448.0, 57344.0, "e4m3", "e5m2")


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, f"expected a bool, got {type(value).__name__} {value!r}")


def _check_real(name: str, value: Any, low: float = 0.0) -> float:
    """A finite real >= `low` whose float32 value is finite too; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low \
            or abs(f32(float(value))) > FLT_MAX:
        _fail(name, f"expected a finite real number >= {low:g} (within float32), got {value!r}")
    return float(value)


def _check_format(value: Any) -> None:
    if not isinstance(value, Format):
        _fail("fp8_format", f"expected a fp8kit.recipe.Format (E4M3, E5M2 or HYBRID), got {value!r}")


def _check_precision_override(recipe) -> None:
    olp = recipe.override_linear_precision
    if not isinstance(olp, (tuple, list)) or len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
        _fail("override_linear_precision", f"expected three bools (fprop, dgrad, wgrad), got {olp!r}")
    object.__setattr__(recipe, "override_linear_precision", tuple(olp))


def _check_no_attention(recipe: Any) -> None:
    for name in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, name)
        _check_bool(name, value)
        if value:
            raise NotImplementedError(
                f"{name}=True asks for FP8 attention, which fp8kit does not implement; "
                f"leave {name}=False (attention then runs in high precision)"
            )


def _hash_once(recipe) -> int:
    """Recipes key the autocast registry and are hashed several times per step: hash the fields once."""
    h = recipe.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(recipe, f.name) for f in dataclasses.fields(recipe)))
        object.__setattr__(recipe, "_hash", h)
    return h


def _state_without_hash(recipe) -> dict:
    state = dict(recipe.__dict__)
    state.pop("_hash", None)  # callables hash by identity: another process recomputes
    state.pop("_scaled_max", None)
    return state


class Recipe:
    """Base of fp8kit's recipes. The predicates are class methods, as in Transformer Engine: they answer on the
    class (`DelayedScaling.delayed()`) and on an instance (`recipe.delayed()`)."""

    @classmethod
    def delayed(cls) -> bool:
        """Delayed scaling (per-tensor scales from an amax history)."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """Per-tensor current scaling."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """Either per-tensor recipe (delayed or current scaling): all fp8kit implements."""
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def mxfp8(cls) -> bool:
        """MXFP8 block scaling: not in fp8kit, always False."""
        return False

    @classmethod
    def nvfp4(cls) -> bool:
        """NVFP4 block scaling: not in fp8kit, always False."""
        return False

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """FP8 block scaling: not in fp8kit, always False."""
        return False

    @classmethod
    def custom(cls) -> bool:
        """A custom (user-defined quantizer) recipe: not in fp8kit, always False."""
        return False


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options. `use_split_accumulator=False` lets an FP8 GEMM on CUDA accumulate in the tensor cores' faster,
    less precise mode (cuBLASLt fast accumulation); the CPU emulation always accumulates in float32."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_bool("use_split_accumulator", self.use_split_accumulator)


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization options of one tensor role under current scaling: `power_2_scale` rounds the scale down to a
    power of two, `amax_epsilon` floors the amax. The block-scaling options of Transformer Engine
    (`random_hadamard_transform`, `stochastic_rounding`, `fp4_2d_quantization`) must stay False."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_bool("power_2_scale", self.power_2_scale)
        object.__setattr__(self, "amax_epsilon", _check_real("amax_epsilon", self.amax_epsilon))
        for name in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            _check_bool(name, getattr(self, name))
            if getattr(self, name):
                raise NotImplementedError(f"QParams({name}=True) belongs to FP4 / block-scaling recipes, which "
                                          "fp8kit does not implement")


_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor is cast with a scale derived from its amax history.

    Fields (defaults follow current Transformer Engine):
      margin: real >= 0; the scale targets `float32(fp8_max * float32(2**-margin))`.
      interval: int >= 1; a state's scale is recomputed on every `interval`-th update it takes part in (histories
        roll at every such update).
      fp8_format: Format.
      amax_history_len: int >= 1; rows of the `[L, n]` history (row 0 is the staging row).
      amax_compute_algo: "max", "most_recent", or `f(amax_history[L, n]) -> amax[n]`.
      scaling_factor_compute_algo: None or `f(amax[n], scale[n], fp8_max: float, recipe) -> scale[n]`.
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      reduce_amax: all-reduce (MAX) the staging amaxes over the autocast's group before each update.
      power_2_scale: round every new scale down to a power of two.
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
      backward_override: None only (as in Transformer Engine, delayed scaling has no backward override).
    """

    margin: float = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False)
    reduce_amax: bool = True
    power_2_scale: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        margin = _check_real("margin", self.margin)
        if not isinstance(self.margin, int):
            object.__setattr__(self, "margin", margin)  # an int stays an int (its repr), a real becomes a float
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            _fail("interval", f"expected an int >= 1, got {self.interval!r}")
        _check_format(self.fp8_format)
        for fp8_max in {self.fp8_format.value.max_fwd, self.fp8_format.value.max_bwd}:
            if self.scaled_max(fp8_max) < 2.0 ** -126:  # below float32's normal range
                _fail("margin", f"{self.margin!r} is too large: fp8_max * 2**-margin = {fp8_max} * 2**-{self.margin} "
                      "is below the float32 normal range, so no scale could be computed")
        length = self.amax_history_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            _fail("amax_history_len", f"expected an int >= 1, got {length!r}")
        algo = self.amax_compute_algo
        if not (callable(algo) or algo in ("max", "most_recent")):
            _fail("amax_compute_algo", f"expected 'max', 'most_recent' or a callable, got {algo!r}")
        sf_algo = self.scaling_factor_compute_algo
        if sf_algo is not None and not callable(sf_algo):
            _fail("scaling_factor_compute_algo", f"expected None or a callable, got {sf_algo!r}")
        _check_precision_override(self)
        _check_bool("reduce_amax", self.reduce_amax)
        _check_bool("power_2_scale", self.power_2_scale)
        _check_no_attention(self)
        if self.backward_override is not None:
            _fail("backward_override", f"delayed scaling supports only None, got {self.backward_override!r}")

    __hash__ = _hash_once
    __getstate__ = _state_without_hash

    def scaled_max(self, fp8_max: float) -> float:
        """The value a new scale maps the amax to: `float32(fp8_max * float32(2**-margin))`, as Transformer
        Engine computes it (`fp8_max * powf(2, -margin)` in float32); exact for integer margins."""
        cache = self.__dict__.get("_scaled_max")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_scaled_max", cache)
        value = cache.get(fp8_max)
        if value is None:
            value = cache[fp8_max] = f32(fp8_max * f32(2.0 ** -f32(float(self.margin))))
        return value

    @property
    def uses_callables(self) -> bool:
        """True when the update takes the callable path of the spec (either algorithm is a callable)."""
        return callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Current scaling: each tensor is cast with `fp8_max / amax(tensor)`, computed just before the cast.

    Fields:
      fp8_format: Format.
      use_power_2_scales: round each scale down to a power of two (the default of the three QParams below).
      amax_epsilon: float >= 0; the amax is raised to at least this value before the scale is computed (the
        default of the three QParams below).
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: QParams per tensor role, as in Transformer
        Engine; None takes `QParams(use_power_2_scales, amax_epsilon)`.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: MMParams per GEMM (Transformer Engine's defaults: fast
        accumulation for fprop only).
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
      backward_override: None; "high_precision" runs dgrad and wgrad on the original high-precision operands;
        "dequantized" runs them in high precision on the dequantized FP8 operands saved by the forward pass.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False)
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_bool("use_power_2_scales", self.use_power_2_scales)
        object.__setattr__(self, "amax_epsilon", _check_real("amax_epsilon", self.amax_epsilon))
        _check_precision_override(self)
        default = QParams(self.use_power_2_scales, self.amax_epsilon)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not isinstance(value, QParams):
                _fail(name, f"expected a fp8kit.recipe.QParams or None, got {value!r}")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not isinstance(getattr(self, name), MMParams):
                _fail(name, f"expected a fp8kit.recipe.MMParams, got {getattr(self, name)!r}")
        _check_no_attention(self)
        if self.backward_override not in _BACKWARD_OVERRIDES:
            _fail("backward_override", f"expected None, 'high_precision' or 'dequantized', "
                  f"got {self.backward_override!r}")

    __hash__ = _hash_once
    __getstate__ = _state_without_hash
