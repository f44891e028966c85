"""FP8 formats and scaling recipes, shared by the PyTorch and JAX frontends (Transformer Engine's
`transformer_engine.common.recipe`).

This package imports neither torch nor jax. Recipes are mutable dataclasses, as Transformer Engine's are, validated
at construction and at every assignment (unknown keywords raise TypeError, unknown attributes AttributeError, bad
values ValueError naming the field). They derive from `Recipe`, whose class-level predicates (`delayed()`,
`float8_current_scaling()`, `mxfp8()`, ...) answer as Transformer Engine's do, on the class or on an instance.
autocast keys what it builds on `recipe.snapshot()`, a read-only, hashable copy taken at entry, so a recipe changed
between steps acts from the next entry on (fp8kit.recipe.base explains why).
"""

from .base import FLT_MAX, SCALE_MIN, Format, MMParams, QParams, Recipe, f32
from .block import CustomRecipe, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from .per_tensor import DelayedScaling, Float8CurrentScaling

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
           "NVFP4BlockScaling", "CustomRecipe", "QParams", "MMParams", "FLT_MAX", "SCALE_MIN", "f32"]
