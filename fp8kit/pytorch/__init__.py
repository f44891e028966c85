"""fp8kit's PyTorch frontend: `import fp8kit.pytorch as te` where a Transformer Engine user imports
`transformer_engine.pytorch`."""

from .cast import quantize
from .tensor import Float8Tensor

__all__ = ["quantize", "Float8Tensor"]
