"""`ScalingMode`: Transformer Engine JAX's names for the scaling modes (`transformer_engine.jax.quantize.
ScalingMode`), with the predicates user code reads, and which mode a recipe runs with.

Transformer Engine JAX has no mode for Float8 block scaling; fp8kit adds `FLOAT8_BLOCK_SCALING` (not in TE) so
that `scaling_mode_of(Float8BlockScaling())` has an answer. NVFP4BlockScaling runs `NVFP4_1D_SCALING`, and
`NVFP4_2D_SCALING` for the kernel unless `disable_2d_quantization` (Transformer Engine JAX's
`get_scaling_mode(TensorSource.KERNEL)`): `scaling_mode_of(recipe, "kernel")`.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

__all__ = ["ScalingMode", "block_kind", "scaling_mode_of"]


class ScalingMode(enum.Enum):
    """The scaling modes, with Transformer Engine JAX's values (its C++ enum) and one fp8kit addition."""

    NO_SCALING = 0
    DELAYED_TENSOR_SCALING = 1
    MXFP8_1D_SCALING = 2
    CURRENT_TENSOR_SCALING = 3
    NVFP4_1D_SCALING = 4
    NVFP4_2D_SCALING = 5
    FLOAT8_BLOCK_SCALING = 100  # fp8kit only: Float8BlockScaling (1x128 / 128x128 float32 block scales)

    def is_tensor_scaling(self) -> bool:
        """One scale per tensor (delayed or current scaling)."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    def is_1d_block_scaling(self) -> bool:
        """MXFP8 or NVFP4 (Transformer Engine counts both NVFP4 modes as 1-D)."""
        return self == ScalingMode.MXFP8_1D_SCALING or self.is_nvfp4_scaling

    @property
    def is_block_scaling(self) -> bool:
        return self.is_1d_block_scaling() or self == ScalingMode.FLOAT8_BLOCK_SCALING

    @property
    def is_mxfp8_scaling(self) -> bool:
        return self == ScalingMode.MXFP8_1D_SCALING

    @property
    def is_nvfp4_scaling(self) -> bool:
        return self in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING)


def block_kind(recipe: Any) -> Optional[str]:
    """"mxfp8", "float8_block" or "nvfp4" for the block-scaled recipes (read from the recipe's predicates), else
    None."""
    for kind, predicate in (("mxfp8", "mxfp8"), ("float8_block", "float8_block_scaling"), ("nvfp4", "nvfp4")):
        fn = getattr(recipe, predicate, None)
        if callable(fn) and fn() is True:
            return kind
    return None


def scaling_mode_of(recipe: Any, tensor_source: str = "x") -> ScalingMode:
    """The scaling mode a recipe quantizes `tensor_source` ("x", "kernel" or "grad") with (None: NO_SCALING)."""
    if tensor_source not in ("x", "kernel", "grad"):
        raise ValueError(f"scaling_mode_of: tensor_source must be 'x', 'kernel' or 'grad', got {tensor_source!r}")
    if recipe is None:
        return ScalingMode.NO_SCALING
    kind = block_kind(recipe)
    if kind == "nvfp4":
        two_d = tensor_source == "kernel" and not recipe.disable_2d_quantization
        return ScalingMode.NVFP4_2D_SCALING if two_d else ScalingMode.NVFP4_1D_SCALING
    if kind is not None:
        return ScalingMode.MXFP8_1D_SCALING if kind == "mxfp8" else ScalingMode.FLOAT8_BLOCK_SCALING
    for mode, predicate in ((ScalingMode.DELAYED_TENSOR_SCALING, "delayed"),
                            (ScalingMode.CURRENT_TENSOR_SCALING, "float8_current_scaling")):
        fn = getattr(recipe, predicate, None)
        if callable(fn) and fn() is True:
            return mode
    raise ValueError(f"scaling_mode_of: no scaling mode for {type(recipe).__name__}")
