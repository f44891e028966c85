"""fp8kit's PyTorch frontend: `import fp8kit.pytorch as te` where a Transformer Engine user imports
`transformer_engine.pytorch`."""

from .autocast import autocast, fp8_autocast
from .cast import quantize
from .modules import Linear
from .tensor import Float8Tensor

__all__ = ["autocast", "fp8_autocast", "quantize", "Linear", "Float8Tensor"]
