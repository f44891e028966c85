"""FP8 weights: `quantized_model_init` (and its older name `fp8_model_init`) makes the layers created inside it hold
their GEMM weights as Float8Tensor parameters, so each forward skips the weight cast and the weights take half of
bf16's memory.

- Delayed scaling: a weight's quantizer casts with the module's forward-state scale of the weight slot and records
  its amax into that slot's staging row (`StateQuantizer`), so the weight's scale follows the weight's amax history.
  Quantizing it again (an optimizer step: `param.copy_(master)` or `param.quantize_(master)`) uses the scale of the
  last update, as a forward cast would.
- Current scaling: the weight is cast with its own amax, again after each optimizer step.
- Block scaling (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling): the weight becomes the family's quantized
  tensor (MXFP8Tensor, Float8BlockwiseQTensor, NVFP4Tensor) quantized by the recipe's weight quantizer with both
  layouts (rowwise for fprop, columnwise for dgrad; `recipe_families.RecipeFamily.weight_quantizer`); the GEMMs read
  its bytes and scales as they are, and an optimizer step quantizes the new value into it (`param.quantize_(master)`).
- Created under `torch.no_grad()` (inference), a weight's quantizer leaves the columnwise layout out, as Transformer
  Engine's (block formats then hold the rowwise layout only; a dgrad names the missing layout).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from types import MethodType
from typing import Dict, Iterator, Optional

import torch

from ..recipe import DelayedScaling, Recipe
from .autocast import entry_recipe
from .cast import fp8_dtype_of
from .quantized_tensor import QuantizedTensor
from .recipe_families import recipe_family
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

__all__ = ["quantized_model_init", "fp8_model_init", "quantized_init_settings", "StateQuantizer",
           "quantize_weight_parameter", "parameter_attributes", "restore_parameter_attributes",
           "renew_weight_quantizers", "is_quantized_weight", "check_quantized_weight"]


@dataclass(frozen=True)
class _Settings:
    enabled: bool
    recipe: Recipe
    preserve_high_precision_init_val: bool


_SETTINGS: contextvars.ContextVar[Optional[_Settings]] = contextvars.ContextVar("fp8kit_quantized_init", default=None)


def quantized_init_settings() -> Optional[_Settings]:
    """The innermost `quantized_model_init` in force (None outside, or when it says enabled=False)."""
    settings = _SETTINGS.get()
    return settings if settings is not None and settings.enabled else None


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Layers created inside hold their GEMM weights as Float8Tensor parameters (Transformer Engine's signature).

    enabled: False creates high-precision weights (a way to switch it off in a scope).
    recipe: the recipe the weights are quantized for (DelayedScaling() when None); the FP8 forward must use one of
      the same kind and format.
    preserve_high_precision_init_val: keep each weight's high-precision initial value on the CPU, reachable through
      `param.get_high_precision_init_val()` (for an optimizer's master weights) and released by
      `param.clear_high_precision_init_val()`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"quantized_model_init: enabled must be a bool, got {enabled!r}")
    recipe = entry_recipe(recipe, "quantized_model_init")  # the fields at entry
    if not recipe.float8_per_tensor_scaling() and recipe_family(type(recipe)).weight_quantizer is None:
        raise NotImplementedError(f"quantized_model_init: quantized weights under {type(recipe).__name__} are not "
                                  "implemented; use DelayedScaling, Float8CurrentScaling or a block-scaling recipe")
    token = _SETTINGS.set(_Settings(enabled, recipe, bool(preserve_high_precision_init_val)))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """The older name of `quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


class StateQuantizer(Float8Quantizer):
    """A Float8Quantizer bound to one slot of a module's forward ScalingState: its `scale` and `amax` are the state's
    current tensors for that slot (they follow the state through resizes, device moves and loads). It holds the state,
    not the module, so a module and its FP8 weights form no reference cycle."""

    def __init__(self, state, slot: int, fp8_dtype):
        self.state, self.slot = state, slot
        super().__init__(state.scale[slot:slot + 1], state.staging(slice(slot, slot + 1)), fp8_dtype)

    @property
    def scale(self) -> torch.Tensor:
        return self.state.scale[self.slot:self.slot + 1]

    @property
    def amax(self) -> torch.Tensor:
        return self.state.staging(slice(self.slot, self.slot + 1))

    def copy(self) -> "StateQuantizer":
        out = StateQuantizer(self.state, self.slot, self.dtype)
        out.set_usage(rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        return out


def _weight_quantizer(module, gemm: int, recipe: Recipe, device):
    """The quantizer a weight parameter of GEMM `gemm` of `module` is made with and re-quantized by."""
    if not recipe.float8_per_tensor_scaling():  # a block-scaled family
        return recipe_family(type(recipe)).weight_quantizer(recipe)
    fp8_dtype = fp8_dtype_of(recipe.fp8_format.value.fwd)
    if isinstance(recipe, DelayedScaling):
        module.create_fp8_states(recipe.amax_history_len, device)
        return StateQuantizer(module.fp8_meta["scaling_fwd"], 3 * gemm + 1, fp8_dtype)
    q = recipe.fp8_quant_fwd_weight
    return Float8CurrentScalingQuantizer(fp8_dtype, device, force_pow_2_scales=q.power_2_scale,
                                         amax_epsilon=q.amax_epsilon)


def quantize_weight_parameter(module, name: str, gemm: int, settings: _Settings) -> None:
    """Replace `module.<name>` (a GEMM's weight, initialised in high precision) by a quantized parameter: a
    Float8Tensor under per-tensor recipes, the block family's tensor under block-scaling ones."""
    param = getattr(module, name)
    quantizer = _weight_quantizer(module, gemm, settings.recipe, param.device)
    # Transformer Engine's rule: created without grad (inference), the weight holds no columnwise layout
    quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())
    problem = quantizer._shape_error(param) if hasattr(quantizer, "_shape_error") else None
    if problem:
        raise ValueError(f"quantized_model_init: the weight {name!r} of {type(module).__name__} cannot be quantized "
                         f"under {type(settings.recipe).__name__}: {problem}")
    with torch.no_grad():
        fp8 = quantizer.quantize(param.detach())
    new = torch.nn.Parameter(fp8, requires_grad=param.requires_grad)
    for attr in ("sequence_parallel", "tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(new, attr, getattr(param, attr))
    if settings.preserve_high_precision_init_val:
        _keep_init_value(new, param.detach().cpu().clone())
    setattr(module, name, new)


def renew_weight_quantizers(module: torch.nn.Module, state) -> None:
    """After `state` (a module's forward state) was resized for another `amax_history_len`: give the module's FP8
    weights bound to it a new quantizer, with Transformer Engine's warning ("Quantizer is being updated"), which
    TE gives when it rebuilds a module's quantizers for a new history length. fp8kit's quantizers follow the
    state, so the scales stay right either way."""
    for p in module.parameters(recurse=False):
        q = getattr(p, "_quantizer", None)
        if isinstance(p, Float8Tensor) and isinstance(q, StateQuantizer) and q.state is state:
            p.update_quantizer(q.copy())


def _get_high_precision_init_val(param) -> Optional[torch.Tensor]:
    return getattr(param, "_high_precision_init_val", None)


def _clear_high_precision_init_val(param) -> None:
    if hasattr(param, "_high_precision_init_val"):
        del param._high_precision_init_val


def _keep_init_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Transformer Engine's contract: the value in `param._high_precision_init_val` (on the CPU), read by
    `param.get_high_precision_init_val()` and dropped by `param.clear_high_precision_init_val()`."""
    param._high_precision_init_val = value
    param.get_high_precision_init_val = MethodType(_get_high_precision_init_val, param)
    param.clear_high_precision_init_val = MethodType(_clear_high_precision_init_val, param)


def parameter_attributes(module: torch.nn.Module) -> Dict[str, dict]:
    """The Python attributes of `module`'s own quantized parameters (what `restore_parameter_attributes` puts
    back)."""
    return {name: dict(p.__dict__) for name, p in module._parameters.items() if isinstance(p, QuantizedTensor)}


def restore_parameter_attributes(module: torch.nn.Module, saved: Dict[str, dict]) -> None:
    """Give the FP8 parameters the attributes they had before a conversion (`module.cpu()`, `.to()`, `.cuda()`).
    torch swaps a tensor subclass parameter's contents with the converted tensor's, which has none of the
    attributes set on the parameter (`get_high_precision_init_val`, tensor-parallel flags, ...)."""
    for name, attrs in saved.items():
        p = module._parameters.get(name)
        if p is None:
            continue
        for key, value in attrs.items():
            if key not in p.__dict__:
                setattr(p, key, value)


def is_fp8_parameter(t) -> bool:
    return isinstance(t, Float8Tensor)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the scope (parameters created there take it), restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def is_quantized_weight(t) -> bool:
    """Whether `t` is a weight made by `quantized_model_init` (a Float8Tensor or a block-scaled quantized tensor)."""
    return isinstance(t, QuantizedTensor)


def check_quantized_weight(module, weight, weight_q) -> None:
    """A quantized weight parameter can be the GEMM operand of `weight_q` (the weight quantizer of the autocast's
    recipe) only if it was quantized the same way: a Float8Tensor in the recipe's format under a per-tensor recipe;
    under a block recipe the family's tensor class with the same format and blocks (`weight_q.quantizer`). TypeError
    otherwise: re-quantizing its dequantized values would silently change the numbers."""
    want = getattr(weight_q, "quantizer", None)  # block families' RoleQuantizer
    problem = None
    if want is None:
        if not isinstance(weight, Float8Tensor):
            problem = f"is a {type(weight).__name__}, the recipe's weights are per-tensor Float8Tensors"
    elif not isinstance(weight, want._storage_class):
        problem = f"is a {type(weight).__name__}, the recipe's weights are {want._storage_class.__name__}s"
    elif not weight.get_usages()["rowwise"]:
        problem = f"lacks the rowwise layout (usages {weight.get_usages()}) that fprop reads"
    elif weight._quantizer is not None:
        for attr in ("block_scaling_dim", "with_2d_quantization", "with_rht", "amax_epsilon", "force_pow_2_scales"):
            if getattr(weight._quantizer, attr, None) != getattr(want, attr, None):
                problem = (f"was quantized with {attr}={getattr(weight._quantizer, attr, None)!r}, the recipe's "
                           f"weight quantizer has {getattr(want, attr, None)!r}")
                break
    if problem is None:
        held, cast = (weight.fp8_dtype, weight_q.fp8_dtype) if want is None else (weight._fp8_dtype, want.dtype)
        if held != cast:  # (NVFP4 has one format)
            problem = f"holds {held}, the recipe casts weights to {cast}"
    if problem:
        raise TypeError(f"{type(module).__name__}: the quantized weight {problem}; create the model under "
                        "quantized_model_init with a recipe of the same kind, format and options as the autocast's")
