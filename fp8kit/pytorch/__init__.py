"""fp8kit's PyTorch frontend: `import fp8kit.pytorch as te` where a Transformer Engine user imports
`transformer_engine.pytorch`."""

import torch

from . import distributed, optimizers
from .autocast import autocast, fp8_autocast
from .cast import quantize
from .checkpoint import checkpoint
from .constants import DType
from .convert import convert_model
from .fp8_weights import fp8_model_init, quantized_model_init
from .modules import LayerNorm, LayerNormLinear, Linear, RMSNorm
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer, prepare_for_saving, restore_from_saved
from .rng import CudaRNGStatesTracker
from .stats import disable_stats, enable_stats, format_stats, reset_stats, stats, stats_to_csv
from .tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage
from .tensor.float8_tensor import make_float8_tensor

torch.serialization.add_safe_globals([make_float8_tensor])  # torch.load(weights_only=True) rebuilds Float8Tensors

__all__ = ["autocast", "fp8_autocast", "quantize", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear",
           "Float8Tensor", "convert_model", "distributed", "optimizers",
           "checkpoint", "CudaRNGStatesTracker", "DType", "Float8TensorStorage", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "QuantizedTensor", "QuantizedTensorStorage", "Quantizer",
           "prepare_for_saving", "restore_from_saved", "quantized_model_init", "fp8_model_init",
           "enable_stats", "disable_stats", "reset_stats", "stats", "stats_to_csv", "format_stats"]
