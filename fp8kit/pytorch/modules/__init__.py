"""fp8kit's layers: one module per file over shared pieces (base.py, linear_function.py, setup.py, norm.py,
activation.py, splits.py; linear_base.py holds the one GEMM call path)."""

from .fp8_padding import Fp8Padding
from .fp8_unpadding import Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "Fp8Padding",
           "Fp8Unpadding"]
