"""fp8kit's PyTorch frontend: `import fp8kit.pytorch as te` where a Transformer Engine user imports
`transformer_engine.pytorch`."""

from . import distributed
from .autocast import autocast, fp8_autocast
from .cast import quantize
from .checkpoint import checkpoint
from .convert import convert_model
from .modules import LayerNorm, LayerNormLinear, Linear, RMSNorm
from .rng import CudaRNGStatesTracker
from .stats import disable_stats, enable_stats, format_stats, reset_stats, stats, stats_to_csv
from .tensor import Float8Tensor

__all__ = ["autocast", "fp8_autocast", "quantize", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear",
           "Float8Tensor", "convert_model", "distributed",
           "checkpoint", "CudaRNGStatesTracker",
           "enable_stats", "disable_stats", "reset_stats", "stats", "stats_to_csv", "format_stats"]
