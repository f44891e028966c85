"""Flax linen layers of fp8kit: `import fp8kit.jax.flax as te_flax` where a Transformer Engine user imports
`transformer_engine.jax.flax`. The GEMMs of the dense layers run in FP8 inside an enabled `fp8kit.jax.autocast`;
attention runs in high precision."""

from . import module  # noqa: E402,F401  (Transformer Engine's module path: te.flax.module.DenseGeneral)
from .attention import DotProductAttention
from .dense import Dense, DenseGeneral
from .layernorm import LayerNorm, LayerNormDenseGeneral
from .mha import MultiHeadAttention
from .mlp import LayerNormMLP
from .transformer import RelativePositionBiases, TransformerLayer, TransformerLayerType, extend_logical_axis_rules
from .wrap import TransformerEngineBase, make_dot_general_cls, make_grouped_dense_cls, wrap_function_in_te_state_module

__all__ = [
    "Dense",
    "DenseGeneral",
    "DotProductAttention",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerEngineBase",
    "TransformerLayer",
    "TransformerLayerType",
    "extend_logical_axis_rules",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]
