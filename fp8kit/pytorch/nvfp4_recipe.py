"""The NVFP4 recipe family as fp8kit's modules use it: per-role quantizers from an `NVFP4BlockScaling` recipe and
the GEMM rule of NVFP4 operands, registered through the seam (`recipe_families.register_recipe_family`,
`gemm.register_gemm_rule`).

Transformer Engine's choices (pytorch/quantization.py): each role's quantizer takes its QParams
(`fp4_quant_fwd_inp`, `fp4_quant_fwd_weight`, `fp4_quant_bwd_grad`): `random_hadamard_transform` (the columnwise
usage, read by the wgrad GEMM, is transformed and its amax taken after the transform), `fp4_2d_quantization` (16x16
blocks) and `stochastic_rounding`. By default: input RHT; weight 16x16 blocks; grad RHT and stochastic rounding.
Stochastic rounding draws from torch's default generator of the tensor's device, so a recompute that restores the
RNG state (te.checkpoint) draws the same numbers.
"""

from __future__ import annotations

from typing import Tuple

from ..recipe import NVFP4BlockScaling
from .block_families import block_plan
from .block_recipes import RoleQuantizer, weight_parameter_quantizer
from .gemm import register_gemm_rule
from .nvfp4_gemm import nvfp4_gemm_rule
from .recipe_families import register_recipe_family
from .tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4TensorStorage, TransposedNVFP4Operand

__all__ = ["nvfp4_role_quantizers"]


def _quantizer(qparams, row_scaled: bool = False) -> NVFP4Quantizer:
    rht = bool(qparams.random_hadamard_transform)
    return NVFP4Quantizer(rowwise=True, columnwise=True, with_rht=rht, with_post_rht_amax=rht,
                          with_2d_quantization=bool(qparams.fp4_2d_quantization),
                          stochastic_rounding=bool(qparams.stochastic_rounding), row_scaled_nvfp4=row_scaled)


def nvfp4_role_quantizers(recipe) -> Tuple[RoleQuantizer, RoleQuantizer, RoleQuantizer]:
    """(input, weight, grad_output) quantizers of a Linear-like GEMM under an NVFP4BlockScaling `recipe` (read by
    attribute: `fp4_quant_fwd_inp`, `fp4_quant_fwd_weight`, `fp4_quant_bwd_grad`). With `row_scaled_activation`
    the input (the forward activation) is row-scaled, as in Transformer Engine (its QParams must then ask for no
    RHT, 2D blocks or stochastic rounding: refused when quantizing otherwise)."""
    return (RoleQuantizer(_quantizer(recipe.fp4_quant_fwd_inp, bool(recipe.row_scaled_activation))),
            RoleQuantizer(_quantizer(recipe.fp4_quant_fwd_weight)),
            RoleQuantizer(_quantizer(recipe.fp4_quant_bwd_grad)))


def _quantizers(call, gemm: int):
    return nvfp4_role_quantizers(call.frame.recipe)


def _plan(plan, recipe, module, call) -> None:
    """The block families' options (float32 accumulation, `backward_override`); the 4over6 options are refused."""
    recipe.check_implemented(row_scaled=True)
    block_plan(plan, recipe, module, call)


register_gemm_rule(NVFP4TensorStorage, nvfp4_gemm_rule)
register_gemm_rule(TransposedNVFP4Operand, nvfp4_gemm_rule)


def _weight_quantizer(recipe) -> NVFP4Quantizer:
    """The quantizer of a weight parameter under `quantized_model_init(recipe=...)` (the recipe's weight QParams,
    both layouts): it makes NVFP4Tensor parameters."""
    return weight_parameter_quantizer(RoleQuantizer(_quantizer(recipe.fp4_quant_fwd_weight)))


register_recipe_family(NVFP4BlockScaling, _quantizers, _plan, _weight_quantizer)
