"""fp8kit's PyTorch frontend: `import fp8kit.pytorch as te` where a Transformer Engine user imports
`transformer_engine.pytorch`."""

import torch

from . import (  # fsdp: Float8Tensor's FSDP2 all-gather hooks
    attention,
    block_families,  # noqa: F401  (registers the block-scaled recipe families and their GEMM rule)
    custom_recipe,  # noqa: F401  (registers CustomRecipe: quantizers from its factory, GEMMs by their qgemm)
    distributed,
    fsdp,
    nvfp4_recipe,  # noqa: F401  (registers the NVFP4 recipe family and its GEMM rules)
    optimizers,
)
from .attention import DotProductAttention, InferenceParams, MultiheadAttention, RotaryPositionEmbedding
from .autocast import autocast, fp8_autocast
from .availability import (
    get_default_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .checkpoint import checkpoint
from .constants import DType
from .convert import convert_model
from .cpu_offload import ManualOffloadSynchronizer, get_cpu_offload_context, mark_not_offload
from .distributed import apply_pending_updates
from .fp8_weights import fp8_model_init, quantized_model_init
from .graph import make_graphed_callables
from .modules import (
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
)
from .permutation import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .quantization import DelayedScalingRequest, QuantizerRequest, QuantizerRole
from .quantize_api import quantize
from .quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_func_ctx,
    restore_from_saved,
)
from .rng import CudaRNGStatesTracker
from .stats import disable_stats, enable_stats, format_stats, reset_stats, stats, stats_to_csv
from .tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    MXFP8Quantizer,
    MXFP8Tensor,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4Tensor,
    NVFP4TensorStorage,
)
from .tensor.block_storage import rebuild_pickled_block_tensor
from .tensor.float8_tensor import make_float8_tensor
from .transformer import TransformerLayer

# torch.load(weights_only=True) rebuilds Float8Tensors and block-scaled tensors
torch.serialization.add_safe_globals([make_float8_tensor, rebuild_pickled_block_tensor, MXFP8Tensor,
                                      Float8BlockwiseQTensor, NVFP4Tensor])

__all__ = ["autocast", "fp8_autocast", "quantize", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear",
           "LayerNormMLP", "GroupedLinear", "Fp8Padding", "Fp8Unpadding",
           "Float8Tensor", "convert_model", "distributed", "fsdp", "optimizers",
           "checkpoint", "CudaRNGStatesTracker", "make_graphed_callables", "apply_pending_updates", "DType",
           "constants", "Float8TensorStorage", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage",
           "Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage",
           "NVFP4Quantizer", "NVFP4Tensor", "NVFP4TensorStorage",
           "QuantizedTensor", "QuantizedTensorStorage", "Quantizer",
           "prepare_for_saving", "restore_from_saved", "restore_from_func_ctx", "quantized_model_init",
           "fp8_model_init",
           "attention", "DotProductAttention", "MultiheadAttention", "InferenceParams", "RotaryPositionEmbedding",
           "TransformerLayer",
           "enable_stats", "disable_stats", "reset_stats", "stats", "stats_to_csv", "format_stats",
           # Transformer Engine's availability queries (availability.py)
           "is_fp8_available", "is_bf16_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available", "get_default_recipe", "get_device_compute_capability",
           # MoE token routing (permutation.py) and activation offload (cpu_offload.py)
           "moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs",
           "get_cpu_offload_context", "mark_not_offload", "ManualOffloadSynchronizer",
           # what a CustomRecipe's quantizer factory receives and returns (quantization.py)
           "QuantizerRole", "QuantizerRequest", "DelayedScalingRequest"]
