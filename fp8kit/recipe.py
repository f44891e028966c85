"""FP8 formats and scaling recipes, shared by the PyTorch and JAX frontends.

This module imports neither torch nor jax. Recipes are frozen dataclasses: immutable, hashable, equal when every
field is equal, and validated at construction (unknown keywords raise TypeError, bad values raise ValueError naming
the field).
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Recipe", "FLT_MAX"]

# Largest finite float32; an infinite scale is replaced by it.
FLT_MAX = 3.4028234663852886e38


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


def _check_format(value: Any) -> None:
    if not isinstance(value, Format):
        _fail("fp8_format", f"expected a fp8kit.recipe.Format (E4M3, E5M2 or HYBRID), got {value!r}")


def _check_no_attention(recipe: Any) -> None:
    for name in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, name)
        _check_bool(name, value)
        if value:
            raise NotImplementedError(
                f"{name}=True asks for FP8 attention, which fp8kit does not implement yet; "
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
    return state


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor is cast with a scale derived from its amax history.

    Fields (defaults follow current Transformer Engine):
      margin: int >= 0; the scale targets `fp8_max * 2**-margin`.
      interval: int >= 1; the scale is recomputed on every `interval`-th update (histories roll at every update).
      fp8_format: Format.
      amax_history_len: int >= 1; rows of the `[L, n]` history (row 0 is the staging row).
      amax_compute_algo: "max", "most_recent", or `f(amax_history[L, n]) -> amax[n]`.
      scaling_factor_compute_algo: None or `f(amax[n], scale[n], fp8_max: float, recipe) -> scale[n]`.
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      reduce_amax: all-reduce (MAX) the staging amaxes over the autocast's group before each update.
      power_2_scale: round every new scale down to a power of two.
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
    """

    margin: int = 0
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

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            _fail("margin", f"expected an int >= 0, got {self.margin!r}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            _fail("interval", f"expected an int >= 1, got {self.interval!r}")
        _check_format(self.fp8_format)
        length = self.amax_history_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            _fail("amax_history_len", f"expected an int >= 1, got {length!r}")
        algo = self.amax_compute_algo
        if not (callable(algo) or algo in ("max", "most_recent")):
            _fail("amax_compute_algo", f"expected 'max', 'most_recent' or a callable, got {algo!r}")
        sf_algo = self.scaling_factor_compute_algo
        if sf_algo is not None and not callable(sf_algo):
            _fail("scaling_factor_compute_algo", f"expected None or a callable, got {sf_algo!r}")
        olp = self.override_linear_precision
        if not isinstance(olp, (tuple, list)) or len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            _fail("override_linear_precision", f"expected three bools (fprop, dgrad, wgrad), got {olp!r}")
        object.__setattr__(self, "override_linear_precision", tuple(olp))
        _check_bool("reduce_amax", self.reduce_amax)
        _check_bool("power_2_scale", self.power_2_scale)
        _check_no_attention(self)

    __hash__ = _hash_once
    __getstate__ = _state_without_hash

    def delayed(self) -> bool:
        return True

    def float8_current_scaling(self) -> bool:
        return False

    @property
    def uses_callables(self) -> bool:
        """True when the update takes the callable path of the spec (either algorithm is a callable)."""
        return callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Current scaling: each tensor is cast with `fp8_max / amax(tensor)`, computed just before the cast.

    Fields:
      fp8_format: Format.
      use_power_2_scales: round each scale down to a power of two.
      amax_epsilon: float >= 0; the amax is raised to at least this value before the scale is computed.
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_bool("use_power_2_scales", self.use_power_2_scales)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            _fail("amax_epsilon", f"expected a finite float >= 0, got {eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))
        olp = self.override_linear_precision
        if not isinstance(olp, (tuple, list)) or len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            _fail("override_linear_precision", f"expected three bools (fprop, dgrad, wgrad), got {olp!r}")
        object.__setattr__(self, "override_linear_precision", tuple(olp))
        _check_no_attention(self)

    __hash__ = _hash_once
    __getstate__ = _state_without_hash

    def delayed(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return True


Recipe = Union[DelayedScaling, Float8CurrentScaling]
