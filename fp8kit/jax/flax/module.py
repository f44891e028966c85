"""Transformer Engine's module path `transformer_engine.jax.flax.module`: the dense and norm layers and the
wrappers, defined in the neighbouring files."""

from .dense import DenseGeneral
from .layernorm import LayerNorm, LayerNormDenseGeneral
from .mlp import LayerNormMLP
from .wrap import TransformerEngineBase, make_dot_general_cls, make_grouped_dense_cls, wrap_function_in_te_state_module

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "TransformerEngineBase",
           "make_dot_general_cls", "make_grouped_dense_cls", "wrap_function_in_te_state_module"]
