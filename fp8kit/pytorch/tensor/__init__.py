"""FP8 tensors: `Float8Tensor` (a torch.Tensor subclass) and `Float8TensorStorage` (the same data as a plain object,
what the GEMMs pass around), and Transformer Engine's per-tensor quantizers. `fp8kit.pytorch.tensor.float8_tensor` is
`transformer_engine.pytorch.tensor.float8_tensor`."""

from . import float8_ops  # noqa: F401 (fills Float8Tensor's dispatch table)
from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage
from .nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage
from .storage import FP8_DTYPES, Float8TensorStorage
from .utils import replace_raw_data

__all__ = ["Float8Tensor", "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer", "FP8_DTYPES",
           "replace_raw_data", "MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage", "Float8BlockQuantizer",
           "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "NVFP4Quantizer", "NVFP4Tensor",
           "NVFP4TensorStorage"]
