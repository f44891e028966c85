"""fp8kit's JAX frontend: `import fp8kit.jax as te` where a Transformer Engine user imports
`transformer_engine.jax`. Flax layers are in `fp8kit.jax.flax` (also `te.flax`). See docs/jax.md."""

from . import (
    activation,
    flax,  # noqa: E402  (last: the layers import the modules above)
    layernorm,
    sharding,
)
from .cast import Float8Array, dequantize, quantize
from .context import autocast, deferred_update, fp8_autocast, get_recipe, is_fp8_enabled
from .dense import dense
from .layernorm_dense import layernorm_dense
from .layernorm_mlp import layernorm_mlp
from .optimizer import wrap_optimizer
from .scaling_modes import ScalingMode
from .sharding import MeshResource
from .state import FP8_COLLECTION
from .training import (
    NVTE_FP8_COLLECTION_NAME,
    accumulate_grads,
    split_grads,
    update_collections,
    update_fp8_metas,
    upgrade_fp8_metas,
)

__all__ = [
    "FP8_COLLECTION",
    "NVTE_FP8_COLLECTION_NAME",
    "Float8Array",
    "MeshResource",
    "ScalingMode",
    "accumulate_grads",
    "activation",
    "autocast",
    "deferred_update",
    "dense",
    "dequantize",
    "flax",
    "fp8_autocast",
    "get_recipe",
    "is_fp8_enabled",
    "layernorm",
    "layernorm_dense",
    "layernorm_mlp",
    "quantize",
    "sharding",
    "split_grads",
    "update_collections",
    "update_fp8_metas",
    "upgrade_fp8_metas",
    "wrap_optimizer",
]

# `te.quantize.ScalingMode` (Transformer Engine JAX's module path) works as well as `te.ScalingMode`
quantize.ScalingMode = ScalingMode
