"""Flax modules around functions that call `fp8kit.jax.dense`: `TransformerEngineBase` (a module that owns FP8
state), `wrap_function_in_te_state_module` and `make_dot_general_cls` (an FP8 `dot_general` for any flax layer)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn

from ...recipe import DelayedScaling, Float8CurrentScaling, Recipe
from .. import context
from ..dense import dense
from ..scaling_modes import block_kind
from ..sharding import current_mesh_resource
from ..state import FP8_COLLECTION
from ..training import OVERWRITE_WITH_GRADIENT
from .base import fp8_state
from .dense import check_checkpoint_name

__all__ = ["TransformerEngineBase", "wrap_function_in_te_state_module", "make_dot_general_cls",
           "make_grouped_dense_cls"]


class TransformerEngineBase(nn.Module):
    """Base of modules that own FP8 state: `self.generate_quantizer_set(postfix)` returns the state of one GEMM, to
    pass to `fp8kit.jax.dense(..., quantizer_set=...)` (None unless delayed scaling is on)."""

    def generate_quantizer_set(self, postfix: str = "", variable_collection: Optional[str] = None,
                               quantization_checkpoint_name: Optional[str] = None,
                               fp8_recipe: Optional[Recipe] = None, n_groups: Optional[int] = None):
        """The delayed-scaling state of the GEMM `postfix` in `variable_collection` ("fp8_metas" by default),
        created at init; `fp8_recipe` defaults to the autocast's. Grouped GEMMs (`n_groups`) are not supported."""
        check_checkpoint_name(quantization_checkpoint_name)
        if n_groups is not None:
            raise NotImplementedError("generate_quantizer_set: grouped GEMMs (n_groups) are not implemented")
        return fp8_state(self, postfix, variable_collection or FP8_COLLECTION, fp8_recipe)


def _check_recipe(recipe: Optional[Recipe]) -> None:
    if recipe is None or isinstance(recipe, (DelayedScaling, Float8CurrentScaling)) or block_kind(recipe):
        return
    if isinstance(recipe, Recipe) and recipe._kind:
        raise NotImplementedError(f"quantization_recipe: {type(recipe).__name__} is not implemented in fp8kit.jax "
                                  "yet; use DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
                                  "Float8BlockScaling or NVFP4BlockScaling")
    raise ValueError(f"quantization_recipe: expected None, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
                     f"Float8BlockScaling or NVFP4BlockScaling, got {type(recipe).__name__}")


def wrap_function_in_te_state_module(f: Callable, quantization_recipe: Optional[Recipe], name: Optional[str] = None,
                                     quantization_checkpoint_name: Optional[str] = None) -> type:
    """A Flax module class that calls `f(generate_quantizer_set, *args, **kwargs)`.

    `generate_quantizer_set(postfix="", n_groups=None)` returns the FP8 state of one GEMM under
    `quantization_recipe` (kept in the "_overwrite_with_gradient" collection, as Transformer Engine and flax's
    TrainState expect; None without state). While `f` runs, `fp8kit.jax.dense` uses `quantization_recipe` (None:
    high precision), whatever the enclosing autocast says; the mesh resource is kept.
    """
    _check_recipe(quantization_recipe)
    check_checkpoint_name(quantization_checkpoint_name)

    class Wrapper(TransformerEngineBase):
        @nn.compact
        def __call__(self, *args, **kwargs):
            def generate_quantizer_set(postfix: str = "", n_groups: Optional[int] = None):
                if quantization_recipe is None:
                    return None
                return self.generate_quantizer_set(postfix, OVERWRITE_WITH_GRADIENT, fp8_recipe=quantization_recipe,
                                                   n_groups=n_groups)

            fp8 = quantization_recipe is not None and not self.is_initializing()  # init: shapes only
            with context.autocast(enabled=fp8, recipe=quantization_recipe, mesh_resource=current_mesh_resource()):
                return f(generate_quantizer_set, *args, **kwargs)

    Wrapper.__name__ = Wrapper.__qualname__ = f"TEWrapper_{name or getattr(f, '__name__', 'function')}"
    return Wrapper


def make_dot_general_cls(quantization_recipe: Optional[Recipe]) -> type:
    """A Flax module class whose instances are an FP8 `dot_general` under `quantization_recipe`, for flax layers
    that take one: `nn.Dense(features, dot_general_cls=make_dot_general_cls(recipe))`, or
    `nn.MultiHeadDotProductAttention(..., qkv_dot_general_cls=..., out_dot_general_cls=...)`. The kernel must
    contract its leading axes; batch dimensions are not supported."""

    def fp8_dot_general(generate_quantizer_set, x, kernel, dimension_numbers, precision=None, **kwargs):
        (x_dims, k_dims), (x_batch, k_batch) = dimension_numbers
        if tuple(x_batch) or tuple(k_batch):
            raise ValueError(f"fp8 dot_general: batch dimensions are not supported, got {dimension_numbers!r}")
        unsupported = {k: v for k, v in kwargs.items() if v is not None}
        if unsupported:
            raise ValueError(f"fp8 dot_general: unsupported arguments {sorted(unsupported)}")
        return dense(x, kernel, contracting_dims=(tuple(x_dims), tuple(k_dims)),
                     quantizer_set=generate_quantizer_set(), precision=precision)

    return wrap_function_in_te_state_module(fp8_dot_general, quantization_recipe, "dot_general")


def make_grouped_dense_cls(quantization_recipe: Any, quantization_checkpoint_name: Optional[str] = None):
    """Transformer Engine's grouped GEMM (MXFP8 only there): not implemented in fp8kit."""
    raise NotImplementedError("make_grouped_dense_cls: grouped GEMMs are not implemented (Transformer Engine offers "
                              "them for MXFP8 block scaling, which fp8kit does not implement)")
