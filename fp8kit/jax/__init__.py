"""fp8kit's JAX frontend: `import fp8kit.jax as te` where a Transformer Engine user imports
`transformer_engine.jax`. Flax layers are in `fp8kit.jax.flax`. See docs/jax.md."""

from .cast import Float8Array, dequantize, quantize
from .context import MeshResource, autocast, deferred_update, fp8_autocast, get_recipe, is_fp8_enabled
from .dense import dense
from .state import FP8_COLLECTION, accumulate_grads, split_grads, update_fp8_metas

__all__ = [
    "FP8_COLLECTION",
    "Float8Array",
    "MeshResource",
    "accumulate_grads",
    "autocast",
    "deferred_update",
    "dense",
    "dequantize",
    "fp8_autocast",
    "get_recipe",
    "is_fp8_enabled",
    "quantize",
    "split_grads",
    "update_fp8_metas",
]
