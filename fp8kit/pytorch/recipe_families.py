"""What each recipe family gives a GEMM: the one place that knows the recipe types.

A recipe family is registered once with `register_recipe_family(recipe_class, quantizers, configure_plan)`:

- `quantizers(call, gemm) -> (input, weight, grad_output)`: the quantizers of GEMM `gemm` of the module making
  `call` (an `FP8Call`: its `frame.recipe`, its delayed-scaling `_states`, whether it is a recompute (`replay`,
  `record`), its `module`). `FP8Call.quantizers` asks here.
- `configure_plan(plan, recipe, module, call)`: the recipe's options of one GEMM's `LinearPlan` (fast
  accumulation, backward overrides, what the recipe refuses), set by `setup.gemm_plan`.
- `weight_quantizer(recipe)` (optional, block-scaled families): the quantizer of a weight parameter created under
  `quantized_model_init(recipe=...)`, which makes the parameter a quantized tensor of the family (both layouts).
  The per-tensor families make Float8Tensor weights in `fp8_weights.py`.

The modules never branch on the recipe type, so a new family (MXFP8, block scaling, NVFP4) is a recipe class, a
family registered here, a storage class and a GEMM rule (`fp8kit.pytorch.gemm.register_gemm_rule`); see
docs/architecture.md, "Adding a recipe".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe
from .cast import fp8_dtype_of
from .class_table import ClassTable
from .quantizer import CurrentQuantizer, DelayedQuantizer, FixedScaleQuantizer

__all__ = ["RecipeFamily", "register_recipe_family", "recipe_family", "registered_recipes", "FAMILIES"]

QuantizerFactory = Callable[[object, int], Tuple[object, object, object]]
PlanOptions = Callable[[object, Recipe, object, object], None]


@dataclass(frozen=True)
class RecipeFamily:
    """`quantizers(call, gemm)`, `configure_plan(plan, recipe, module, call)` and `weight_quantizer(recipe)` (None:
    the family makes no weight parameters of its own) of one recipe family."""

    quantizers: QuantizerFactory
    configure_plan: PlanOptions
    weight_quantizer: Optional[Callable[[Recipe], object]] = None


FAMILIES = ClassTable("recipe family")  # recipe class -> RecipeFamily; `FAMILIES[type(recipe)]` on hot paths


def _no_plan_options(plan, recipe, module, call) -> None:
    pass


def register_recipe_family(recipe_class: type, quantizers: QuantizerFactory,
                           configure_plan: PlanOptions = _no_plan_options,
                           weight_quantizer: Optional[Callable[[Recipe], object]] = None) -> None:
    """Make `quantizers` and `configure_plan` those of every GEMM run under a recipe of `recipe_class` (or of a
    subclass without a family of its own), and `weight_quantizer` the maker of its quantized weight parameters."""
    if not isinstance(recipe_class, type) or not issubclass(recipe_class, Recipe):
        raise TypeError(f"register_recipe_family: expected a subclass of fp8kit.recipe.Recipe, got {recipe_class!r}")
    for name, fn in (("quantizers", quantizers), ("configure_plan", configure_plan)):
        if not callable(fn):
            raise TypeError(f"register_recipe_family: {name} must be callable, got {fn!r}")
    if weight_quantizer is not None and not callable(weight_quantizer):
        raise TypeError(f"register_recipe_family: weight_quantizer must be callable or None, got {weight_quantizer!r}")
    FAMILIES.register(recipe_class, RecipeFamily(quantizers, configure_plan, weight_quantizer))


def recipe_family(recipe_type: type) -> RecipeFamily:
    """The family of `recipe_type`: its own, else its nearest registered base class's; TypeError if none."""
    return FAMILIES.lookup(recipe_type)


def registered_recipes() -> Tuple[type, ...]:
    """The recipe classes with a family, in registration order."""
    return FAMILIES.classes()


# ---- the per-tensor families: delayed and current scaling ----------------------------------------------------------

def _delayed_quantizers(call, gemm: int):
    """Delayed scaling: casts with the module's forward / backward state slots (3 per GEMM forward, 2 backward); a
    recompute casts input and weight with the scales its original call used."""
    fmt = call.frame.recipe.fp8_format.value
    fwd_dtype, bwd_dtype = fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd)
    fwd, bwd = call._states
    grad_q = DelayedQuantizer(bwd, 2 * gemm, bwd_dtype, defer_bytes=True)
    if call.replay:
        scales = call.record.scales
        return FixedScaleQuantizer(scales[3 * gemm], fwd_dtype), \
            FixedScaleQuantizer(scales[3 * gemm + 1], fwd_dtype), grad_q
    return DelayedQuantizer(fwd, 3 * gemm, fwd_dtype), DelayedQuantizer(fwd, 3 * gemm + 1, fwd_dtype), grad_q


def _delayed_plan(plan, recipe, module, call) -> None:
    if module.save_original_input and call.fp8[2]:
        raise ValueError(f"{type(module).__name__}(save_original_input=True) cannot run under DelayedScaling: a "
                         "delayed-scaling cast of the saved input would record its amax a second time (as in "
                         "Transformer Engine); use Float8CurrentScaling or save_original_input=False")


def _current_quantizers(call, gemm: int):
    """Current scaling: each tensor's scale from its own amax, all-reduced over the module's tensor-parallel group
    where the tensor is split (`module.current_scaling_groups`)."""
    recipe = call.frame.recipe
    fmt = recipe.fp8_format.value
    fwd_dtype, bwd_dtype = fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd)
    groups = call.module.current_scaling_groups(gemm)
    roles = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
    return tuple(CurrentQuantizer(dtype, q.amax_epsilon, q.power_2_scale, group, defer_bytes=grad)
                 for dtype, q, group, grad in zip((fwd_dtype, fwd_dtype, bwd_dtype), roles, groups,
                                                  (False, False, True)))


def _current_plan(plan, recipe, module, call) -> None:
    """The recipe's GEMM options (fast accumulation per GEMM) and backward override."""
    plan.fast_accum = (not recipe.fp8_gemm_fprop.use_split_accumulator,
                       not recipe.fp8_gemm_dgrad.use_split_accumulator,
                       not recipe.fp8_gemm_wgrad.use_split_accumulator)
    plan.backward_override = recipe.backward_override
    if recipe.backward_override is not None:
        plan.fp8 = (call.fp8[0], False, False)


register_recipe_family(DelayedScaling, _delayed_quantizers, _delayed_plan)
register_recipe_family(Float8CurrentScaling, _current_quantizers, _current_plan)
