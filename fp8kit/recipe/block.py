"""The block-scaled recipes and the custom recipe, with Transformer Engine's classes, fields, defaults, validation
and repr: `MXFP8BlockScaling`, `Float8BlockScaling`, `NVFP4BlockScaling`, `CustomRecipe`. These are the recipe
objects only: autocast refuses them (NotImplementedError naming the recipe) until their quantizers exist.

Unlike Transformer Engine, no field reads an environment variable, and options given to the constructor take effect
(TE derives `Float8BlockScaling`'s QParams from `NVTE_FP8_BLOCK_SCALING_FP32_SCALES` at import, not from
`use_f32_scales`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

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
    check_qparams,
    fail,
)
from .per_tensor import gemm_and_role_repr

__all__ = ["MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]

_BLOCK_FORMATS = (Format.E4M3, Format.HYBRID)  # Transformer Engine refuses pure E5M2 training


def _common(recipe: Recipe) -> None:
    check_no_attention(recipe)
    check_choice("backward_override", recipe.backward_override, BACKWARD_OVERRIDES)


@dataclasses.dataclass(eq=False, repr=False)
class MXFP8BlockScaling(Recipe):
    """MXFP8: every 32 consecutive values share one power-of-two (E8M0) scale.

    Fields: margin (int >= 0), fp8_format (Format.E4M3 or HYBRID), fp8_dpa / fp8_mha (FP8 attention, not
    implemented), backward_override (None, "high_precision", "dequantized"), enable_2d_quantization (32x32 blocks
    for weights).
    """

    _kind = "mxfp8"

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    enable_2d_quantization: bool = False

    def _validate(self) -> None:
        check_int("margin", self.margin, 0)
        check_format(self.fp8_format, _BLOCK_FORMATS)
        check_bool("enable_2d_quantization", self.enable_2d_quantization)
        _common(self)

    def _make_repr(self) -> str:
        return (f"recipe_type={type(self).__name__}, margin={self.margin}, format={self.fp8_format.name}, "
                f"backward_override={self.backward_override}, enable_2d_quantization={self.enable_2d_quantization}")


_ROLES = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_DIMS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")


@dataclasses.dataclass(eq=False, repr=False)
class Float8BlockScaling(Recipe):
    """FP8 block scaling (DeepSeek-V3's recipe): float32 scales per 1x128 block (1D) or 128x128 block (2D).

    Fields:
      use_f32_scales: False (default) rounds block scales down to powers of two; the default of the QParams below.
      fp8_format: Format.E4M3 (default) or HYBRID.
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 or 2 (defaults 1, 2, 1); no GEMM may
        take two 2D operands, so at most one of them is 2.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: MMParams, all with use_split_accumulator=True (required).
      fp8_dpa, fp8_mha: must stay False.
      backward_override: None, "high_precision" or "dequantized".
      fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad (keyword-only): QParams(power_2_scale,
        amax_epsilon) per role; None follows `QParams(power_2_scale=not use_f32_scales)`.
    """

    _kind = "float8_block"
    _derived = _ROLES

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    _: dataclasses.KW_ONLY
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None

    def _derive(self, name: str) -> QParams:
        return QParams(power_2_scale=not self.use_f32_scales, amax_epsilon=0.0)

    def _validate(self) -> None:
        check_bool("use_f32_scales", self.use_f32_scales)
        check_format(self.fp8_format, _BLOCK_FORMATS)
        for name in _DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2):
                fail(name, f"expected 1 (1x128 blocks) or 2 (128x128 blocks), got {value!r}")
        two_d = [n for n in _DIMS if getattr(self, n) == 2]
        if len(two_d) > 1:
            fail(two_d[1], f"{' and '.join(f'{n}=2' for n in two_d)}: a GEMM cannot take two 2D-scaled operands")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            check_instance(name, getattr(self, name), MMParams)
            if not getattr(self, name).use_split_accumulator:
                fail(name, "FP8 block scaling needs use_split_accumulator=True")
        for name in ("fp8_dpa", "fp8_mha"):
            check_bool(name, getattr(self, name))
            if getattr(self, name):
                fail(name, "FP8 attention is not supported with Float8BlockScaling")
        check_choice("backward_override", self.backward_override, BACKWARD_OVERRIDES)
        self._fill_derived()
        for name in _ROLES:
            check_qparams(self, name, FP4_OPTIONS)

    def _make_repr(self) -> str:
        dims = "".join(f"{n}={getattr(self, n)}, " for n in _DIMS)
        text = gemm_and_role_repr(self)
        split = text.index("fp8_gemm_fprop")
        return (f"recipe_type={type(self).__name__}, format={self.fp8_format.name}, " + text[:split] + dims
                + text[split:] + f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, "
                f"backward_override={self.backward_override}")


_FP4_ROLES = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")
# Transformer Engine's 4over6 options and their defaults: fp8kit implements only the defaults
_4OVER6 = {"nvfp4_4over6": ("none", ("none", "weights", "activations", "all")),
           "nvfp4_4over6_e4m3_use_256": ("all", ("none", "weights", "activations", "all")),
           "nvfp4_4over6_err_mode": ("MAE", ("MAE", "MSE"))}


@dataclasses.dataclass(eq=False, repr=False)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 consecutive values and a float32 scale per tensor.

    Fields:
      disable_rht: no random Hadamard transform (by default applied to the column-wise input and gradient).
      disable_stochastic_rounding: round gradients to nearest instead of stochastically.
      disable_2d_quantization: 1x16 blocks for weights too (by default weights use 16x16 blocks).
      row_scaled_activation: forward activations carry one float32 amax per row (fp8kit.pytorch only).
      nvfp4_4over6, nvfp4_4over6_e4m3_use_256, nvfp4_4over6_err_mode: Transformer Engine's 4over6 options,
        validated as Transformer Engine does; fp8kit implements only their defaults ("none", "all", "MAE"): a recipe
        with another value constructs (Transformer Engine's tests build one at import) and its first FP8 forward
        raises NotImplementedError naming the field (`unsupported_4over6`).
      fp4_format: Format.E2M1 only. fp8_format: Format.E4M3 only (the block scales).
      fp8_dpa, fp8_mha: FP8 attention, not implemented. backward_override: None, "high_precision", "dequantized".
      fp4_quant_fwd_inp, fp4_quant_fwd_weight, fp4_quant_bwd_grad (keyword-only, also assignable as in Transformer
        Engine): QParams per role; None follows the disable_* flags (input: RHT; weight: 2D blocks; gradient: RHT
        and stochastic rounding), also after they change.
    """

    _kind = "nvfp4"
    _derived = _FP4_ROLES

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    _: dataclasses.KW_ONLY
    fp4_quant_fwd_inp: Optional[QParams] = None
    fp4_quant_fwd_weight: Optional[QParams] = None
    fp4_quant_bwd_grad: Optional[QParams] = None

    def _derive(self, name: str) -> QParams:
        if name == "fp4_quant_fwd_inp":
            return QParams(random_hadamard_transform=not self.disable_rht)
        if name == "fp4_quant_fwd_weight":
            return QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        return QParams(random_hadamard_transform=not self.disable_rht,
                       stochastic_rounding=not self.disable_stochastic_rounding)

    def _validate(self) -> None:
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                     "row_scaled_activation"):
            check_bool(name, getattr(self, name))
        for name, (default, choices) in _4OVER6.items():
            check_choice(name, getattr(self, name), choices)  # other values: refused where quantizers are made
        check_format(self.fp4_format, (Format.E2M1,), "fp4_format")
        check_format(self.fp8_format, (Format.E4M3,))
        _common(self)
        self._fill_derived()
        for name in _FP4_ROLES:
            check_qparams(self, name, ("power_2_scale", "amax_epsilon"))

    def unsupported_4over6(self) -> Optional[str]:
        """The first 4over6 option set to a value fp8kit does not implement, as `name=value`, or None."""
        for name, (default, _) in _4OVER6.items():
            if getattr(self, name) != default:
                return f"{name}={getattr(self, name)!r}"
        return None

    def check_implemented(self, row_scaled: bool = False) -> None:
        """Raise NotImplementedError, naming the field, where the recipe asks for what the caller does not implement
        (4over6 options other than their defaults; `row_scaled_activation` unless `row_scaled`, fp8kit.pytorch
        implementing it and fp8kit.jax not); called at the first FP8 forward."""
        unsupported = self.unsupported_4over6()
        if unsupported is not None:
            raise NotImplementedError(f"NVFP4BlockScaling({unsupported}): NVFP4 4over6 block scaling is not "
                                      "implemented in fp8kit; leave the 4over6 options at their defaults")
        if self.row_scaled_activation and not row_scaled:
            raise NotImplementedError("NVFP4BlockScaling(row_scaled_activation=True): row-scaled NVFP4 activations "
                                      "are not implemented in fp8kit.jax")

    def _make_repr(self) -> str:
        return (f"recipe_type={type(self).__name__}, fp4_format={self.fp4_format.name}, "
                f"fp8_format={self.fp8_format.name}, fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, "
                f"backward_override={self.backward_override}, row_scaled_activation={self.row_scaled_activation}, "
                + "".join(f"{n}={getattr(self, n)}, " for n in _4OVER6)
                + "".join(f"{n}={getattr(self, n)}, " for n in _FP4_ROLES))


@dataclasses.dataclass(eq=False, repr=False)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from a user factory (experimental in Transformer Engine).

    Fields: qfactory (required): `qfactory(role: QuantizerRole) -> quantizer or QuantizerRequest`; fp8_format
    (default HYBRID); fp8_dpa / fp8_mha (not implemented); backward_override; quantization_alignment (int > 0,
    default 128: the padding grouped operations use).
    """

    _kind = "custom"

    qfactory: Callable[..., Any]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    quantization_alignment: int = 128

    def _validate(self) -> None:
        if not callable(self.qfactory):
            fail("qfactory", f"expected a callable qfactory(role) -> quantizer, got {self.qfactory!r}")
        check_format(self.fp8_format, tuple(Format))
        _common(self)
        check_int("quantization_alignment", self.quantization_alignment, 1)

    def _make_repr(self) -> str:
        return (f"recipe_type={type(self).__name__}, qfactory={self.qfactory}, "
                f"backward_override={self.backward_override}, quantization_alignment={self.quantization_alignment}")
