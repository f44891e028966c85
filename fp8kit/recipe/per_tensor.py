"""The per-tensor recipes: `DelayedScaling` and `Float8CurrentScaling` (Transformer Engine's fields, defaults and
repr, plus fp8kit's keyword-only `interval`, `override_linear_precision`, `power_2_scale` and `amax_epsilon`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple, Union

from .base import (
    BACKWARD_OVERRIDES,
    FP4_OPTIONS,
    Format,
    MMParams,
    QParams,
    Recipe,
    check_bool,
    check_choice,
    check_format,
    check_instance,
    check_int,
    check_no_attention,
    check_precision_override,
    check_qparams,
    check_real,
    extras_repr,
    f32,
    fail,
)

__all__ = ["DelayedScaling", "Float8CurrentScaling"]

_FP8_FORMATS = (Format.E4M3, Format.E5M2, Format.HYBRID)  # unlike Transformer Engine, pure E5M2 works
_NO_OVERRIDE = (False, False, False)


@dataclasses.dataclass(eq=False, repr=False)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor is cast with a scale derived from its amax history.

    Fields (Transformer Engine's, in its order, then fp8kit's keyword-only ones):
      margin: real >= 0; the scale targets `float32(fp8_max * float32(2**-margin))`.
      fp8_format: Format.E4M3, E5M2 or HYBRID.
      amax_history_len: int >= 1; rows of the `[L, n]` history (row 0 is the staging row).
      amax_compute_algo: "max", "most_recent", or `f(amax_history[L, n]) -> amax[n]`.
      scaling_factor_compute_algo: None or `f(amax[n], scale[n], fp8_max: float, recipe) -> scale[n]` (`recipe` is
        the snapshot autocast took).
      reduce_amax: all-reduce (MAX) the staging amaxes over the autocast's group before each update.
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
      backward_override: None only (as in Transformer Engine, delayed scaling has no backward override).
      interval: int >= 1; a state's scale is recomputed on every `interval`-th update it takes part in (histories
        roll at every such update).
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      power_2_scale: round every new scale down to a power of two.
    """

    _kind = "delayed"

    margin: float = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    _: dataclasses.KW_ONLY
    interval: int = 1
    override_linear_precision: Tuple[bool, bool, bool] = _NO_OVERRIDE
    power_2_scale: bool = False

    def _validate(self) -> None:
        margin = check_real("margin", self.margin)
        if not isinstance(self.margin, int):
            object.__setattr__(self, "margin", margin)  # an int stays an int (its repr), a real becomes a float
        check_int("interval", self.interval, 1)
        check_format(self.fp8_format, _FP8_FORMATS)
        # kept on the recipe (read while torch.compile traces, which cannot trace the float32 rounding)
        scaled = self.__dict__["_scaled_max"] = {m: self._compute_scaled_max(m) for m in
                                                 (self.fp8_format.value.max_fwd, self.fp8_format.value.max_bwd)}
        for fp8_max, value in scaled.items():
            if value < 2.0 ** -126:  # below float32's normal range
                fail("margin", f"{self.margin!r} is too large: fp8_max * 2**-margin = {fp8_max} * 2**-{self.margin} "
                     "is below the float32 normal range, so no scale could be computed")
        check_int("amax_history_len", self.amax_history_len, 1)
        algo = self.amax_compute_algo
        if not (callable(algo) or (isinstance(algo, str) and algo in ("max", "most_recent"))):
            fail("amax_compute_algo", f"expected 'max', 'most_recent' or a callable, got {algo!r}")
        sf_algo = self.scaling_factor_compute_algo
        if sf_algo is not None and not callable(sf_algo):
            fail("scaling_factor_compute_algo", f"expected None or a callable, got {sf_algo!r}")
        check_precision_override(self)
        check_bool("reduce_amax", self.reduce_amax)
        check_bool("power_2_scale", self.power_2_scale)
        check_no_attention(self)
        if self.backward_override is not None:
            fail("backward_override", f"delayed scaling supports only None, got {self.backward_override!r}")

    def _compute_scaled_max(self, fp8_max: float) -> float:
        return f32(fp8_max * f32(2.0 ** -f32(float(self.margin))))

    def scaled_max(self, fp8_max: float) -> float:
        """The value a new scale maps the amax to: `float32(fp8_max * float32(2**-margin))`, as Transformer
        Engine computes it (`fp8_max * powf(2, -margin)` in float32); exact for integer margins."""
        value = self.__dict__["_scaled_max"].get(fp8_max)
        return self._compute_scaled_max(fp8_max) if value is None else value

    @property
    def uses_callables(self) -> bool:
        """True when the update takes the callable path of the spec (either algorithm is a callable)."""
        return callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None

    def _make_repr(self) -> str:
        return (f"recipe_type={type(self).__name__}, margin={self.margin}, format={self.fp8_format.name}, "
                f"amax_history_len={self.amax_history_len}, reduce_amax={self.reduce_amax}, "
                f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, backward_override={self.backward_override}"
                + extras_repr(self, {"amax_compute_algo": "max", "scaling_factor_compute_algo": None,
                                     "interval": 1, "override_linear_precision": _NO_OVERRIDE,
                                     "power_2_scale": False}))


_ROLES = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_GEMMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def gemm_and_role_repr(recipe, roles=_ROLES) -> str:
    """Transformer Engine's text for the per-role QParams and per-GEMM MMParams."""
    return "".join(f"{n}={getattr(recipe, n)}, " for n in roles + _GEMMS)


@dataclasses.dataclass(eq=False, repr=False)
class Float8CurrentScaling(Recipe):
    """Current scaling: each tensor is cast with `fp8_max / amax(tensor)`, computed just before the cast.

    Fields (Transformer Engine's, then fp8kit's keyword-only ones):
      use_power_2_scales: round each scale down to a power of two (the default of the three QParams below).
      fp8_format: Format.E4M3, E5M2 or HYBRID.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: MMParams per GEMM (Transformer Engine's defaults: fast
        accumulation for fprop only).
      fp8_dpa, fp8_mha: FP8 attention; not implemented, True raises NotImplementedError.
      backward_override: None; "high_precision" runs dgrad and wgrad on the original high-precision operands;
        "dequantized" runs them in high precision on the dequantized FP8 operands saved by the forward pass.
      amax_epsilon: float >= 0; the amax is raised to at least this value (the default of the QParams below).
      override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
      fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: QParams per tensor role; None (or never
        assigned) follows `QParams(use_power_2_scales, amax_epsilon)`, also after those two change.
    """

    _kind = "current"
    _derived = _ROLES

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    _: dataclasses.KW_ONLY
    amax_epsilon: float = 0.0
    override_linear_precision: Tuple[bool, bool, bool] = _NO_OVERRIDE
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None

    def _derive(self, name: str) -> QParams:
        return QParams(power_2_scale=self.use_power_2_scales, amax_epsilon=self.amax_epsilon)

    def _validate(self) -> None:
        check_format(self.fp8_format, _FP8_FORMATS)
        check_bool("use_power_2_scales", self.use_power_2_scales)
        object.__setattr__(self, "amax_epsilon", check_real("amax_epsilon", self.amax_epsilon))
        check_precision_override(self)
        self._fill_derived()
        for name in _ROLES:
            check_qparams(self, name, FP4_OPTIONS)
        for name in _GEMMS:
            check_instance(name, getattr(self, name), MMParams)
        check_no_attention(self)
        check_choice("backward_override", self.backward_override, BACKWARD_OVERRIDES)

    def _make_repr(self) -> str:
        return (f"recipe_type={type(self).__name__}, format={self.fp8_format.name}, " + gemm_and_role_repr(self)
                + f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, backward_override={self.backward_override}"
                + extras_repr(self, {"override_linear_precision": _NO_OVERRIDE}))
