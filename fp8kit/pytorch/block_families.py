"""Registers the block-scaled recipe families with the modules' seam (docs/architecture.md, "Adding a recipe"):
`MXFP8BlockScaling` and `Float8BlockScaling` -> their role quantizers and plan options
(`recipe_families.register_recipe_family`); MXFP8 and Float8 block storages, and their transposed views -> the block
GEMM rule (`gemm.register_gemm_rule`). Imported by `fp8kit.pytorch`."""

from __future__ import annotations

from ..recipe import Float8BlockScaling, MXFP8BlockScaling
from .block_recipes import block_gemm_rule, block_quantizers, weight_parameter_quantizer
from .gemm import register_gemm_rule
from .recipe_families import register_recipe_family
from .tensor.block_storage import BlockScaledStorage, TransposedBlockOperand

__all__ = ["block_plan"]


def _quantizers(call, gemm: int):
    """The (input, weight, grad_output) quantizers of any GEMM of the call: block scales need no state."""
    return block_quantizers(call.frame.recipe)


def block_plan(plan, recipe, module, call) -> None:
    """Block GEMMs accumulate in float32 (Float8BlockScaling requires the split accumulator, MXFP8 has no choice);
    `backward_override` runs the backward GEMMs in high precision ("high_precision") or on dequantized operands
    ("dequantized"), as for current scaling."""
    plan.fast_accum = (False, False, False)
    plan.backward_override = recipe.backward_override
    if recipe.backward_override is not None:
        plan.fp8 = (call.fp8[0], False, False)


def _weight_quantizer(recipe):
    """The quantizer of a weight parameter under `quantized_model_init(recipe=...)`: the recipe's weight role (both
    layouts: fprop reads the rowwise one, dgrad the columnwise one), making MXFP8Tensor / Float8BlockwiseQTensor."""
    return weight_parameter_quantizer(block_quantizers(recipe)[1])


register_recipe_family(MXFP8BlockScaling, _quantizers, block_plan, _weight_quantizer)
register_recipe_family(Float8BlockScaling, _quantizers, block_plan, _weight_quantizer)
register_gemm_rule(BlockScaledStorage, block_gemm_rule)
register_gemm_rule(TransposedBlockOperand, block_gemm_rule)
