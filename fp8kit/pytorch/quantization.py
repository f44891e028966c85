"""What a `CustomRecipe` quantizer factory receives and may return (Transformer Engine's
`transformer_engine.pytorch.quantization`): `QuantizerRole`, `QuantizerRequest`, `DelayedScalingRequest`; and, from
the same TE module, `FP8GlobalStateManager` (fp8kit.pytorch.global_state) and `get_align_size_for_quantization`.

The classes only, with Transformer Engine's fields, defaults and text; autocast does not run a CustomRecipe yet
(NotImplementedError naming it)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch

from ..recipe import DelayedScaling, Format, Recipe
from .autocast import autocast
from .cast import fp8_dtype_of, scale_from_amax
from .constants import DType, te_dtype
from .global_state import FP8GlobalStateManager

__all__ = ["autocast", "QuantizerRole", "QuantizerRequest", "DelayedScalingRequest", "FP8GlobalStateManager",
           "get_align_size_for_quantization", "get_fp8_torch_dtype", "get_fp8_te_dtype"]


def _default_sf_compute(amax, scale, fp8_max: float, margin: float, _fp32_max: float = None):
    """Transformer Engine's default amax -> scale rule (a name its tests pass inside a `scaling_factor_compute_algo`
    callable), the rule fp8kit's delayed-scaling updates use: `fp8_max * 2**-margin / amax` in float32 where amax is
    finite and > 0, the previous scale elsewhere (zero, inf, NaN amax); an infinite quotient (a tiny amax) becomes
    FLT_MAX. Writes `scale` in place and returns it. `_fp32_max` is accepted for TE's signature (always FLT_MAX)."""
    if _fp32_max is not None and _fp32_max != torch.finfo(torch.float32).max:
        raise ValueError(f"_default_sf_compute: _fp32_max must be FLT_MAX, got {_fp32_max}")
    scaled_max = float(torch.tensor(fp8_max, dtype=torch.float32) * torch.tensor(2.0 ** -float(margin),
                                                                                   dtype=torch.float32))
    scale.copy_(scale_from_amax(amax.to(torch.float32), scaled_max, scale.to(torch.float32)))
    return scale


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    """The FP8 dtype of a recipe's forward tensors (`fprop_tensor=True`) or gradients: E4M3 for Format.E4M3, E5M2
    for Format.E5M2, and E4M3 forward / E5M2 backward for Format.HYBRID."""
    fmt = fp8_recipe.fp8_format.value
    name = fmt.fwd if fprop_tensor else fmt.bwd
    if name not in ("e4m3", "e5m2"):
        raise ValueError(f"get_fp8_torch_dtype: {fp8_recipe.fp8_format} is not an FP8 format")
    return fp8_dtype_of(name)


def get_fp8_te_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> DType:
    """`get_fp8_torch_dtype` as a DType (kFloat8E4M3 or kFloat8E5M2)."""
    return te_dtype(get_fp8_torch_dtype(fp8_recipe, fprop_tensor))


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """The row multiple that grouped quantized operations pad each split to under `recipe`, as Transformer Engine
    pads them: a CustomRecipe's `quantization_alignment`, 32 for MXFP8 (its scaling block), 128 for NVFP4, and 16
    for the per-tensor and 2D block recipes (the FP8 GEMM's alignment)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"get_align_size_for_quantization: recipe must be a Recipe, got {type(recipe).__name__}")
    if recipe.custom():
        return recipe.quantization_alignment
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Which tensor slot asks for a quantizer: `module_type` ("linear", "grouped_linear", "dpa", ...),
    `tensor_type` ("input", "weight", "grad_output", ...) and `name` (the module instance's name); "" when not
    set."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("module_type", "tensor_type", "name"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise ValueError(f"{field}: expected a str, got {type(value).__name__} {value!r}")

    def __str__(self) -> str:  # Transformer Engine's text: the fields that are set, joined by "|"
        parts = [f"{f}={getattr(self, f)}" for f in ("module_type", "tensor_type", "name") if getattr(self, f)]
        return "|".join(parts) if parts else "QuantizerRole()"


@dataclasses.dataclass(frozen=True)
class QuantizerRequest:
    """Base of the requests a quantizer factory returns instead of a quantizer when the quantizer needs state that
    the library allocates and shares."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingRequest(QuantizerRequest):
    """A request for a delayed-scaling quantizer with library-managed state (history and scale shared with the
    step's batched update). Fields and defaults as DelayedScaling's (validated the same way, a bad value raising
    ValueError naming the field); every request of one recipe state must carry equal values."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        DelayedScaling(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # the same checks
