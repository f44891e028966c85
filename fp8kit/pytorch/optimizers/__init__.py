"""Transformer Engine's optimizers (`fp8kit.pytorch.optimizers` is `transformer_engine.pytorch.optimizers`):
`FusedAdam` (float32 master weights for FP8 parameters) and `FusedSGD`, built on torch's fused CPU/GPU kernels."""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
