"""fp8kit's layers: one module per file over shared pieces (base.py, linear_function.py, setup.py, norm.py)."""

from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear"]
