"""fp8kit: FP8 training with Transformer Engine's per-tensor scaling recipes, in pure Python.

`fp8kit.recipe` is framework-free; `fp8kit.pytorch` and `fp8kit.jax` are the frontends.
"""

__version__ = "0.1.0"
