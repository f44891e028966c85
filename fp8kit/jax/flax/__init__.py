"""Flax linen layers of fp8kit: `from fp8kit.jax.flax import DenseGeneral` where a Transformer Engine user imports
`transformer_engine.jax.flax`."""

from .module import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP

__all__ = ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"]
