"""FP8 current scaling with a Flax layer: the JAX example of Transformer Engine's "FP8 Current Scaling" page, with
fp8kit imports. Sizes are smaller than the page's (32, 128, 1024) so that it runs in seconds on a CPU."""

import jax
import jax.numpy as jnp

import fp8kit.jax as te
from fp8kit.jax.flax import DenseGeneral
from fp8kit.recipe import Float8CurrentScaling, Format

BATCH, SEQ, HIDDEN = 4, 32, 256  # the page uses 32, 128, 1024

# START_CURRENT_SCALING_EXAMPLE
# Create FP8 Current Scaling recipe
# Available formats:
# - Format.HYBRID (default) -- E4M3 for forward pass, E5M2 for backward pass
# - Format.E4M3 -- E4M3 for both forward and backward pass
recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)

with te.autocast(enabled=True, recipe=recipe):
    # Create and initialize layer
    layer = DenseGeneral(features=HIDDEN)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (BATCH, SEQ, HIDDEN), dtype=jnp.bfloat16)
    var_collect = layer.init(key, x)

    # Forward and backward pass
    def loss_fn(var_collect):
        output = layer.apply(var_collect, x)
        return output.sum()

    loss, grads = jax.value_and_grad(loss_fn)(var_collect)
# END_CURRENT_SCALING_EXAMPLE

# the FP8 result against the same layer in high precision
reference = layer.apply(var_collect, x.astype(jnp.float32))
with te.autocast(enabled=True, recipe=recipe):
    output = layer.apply(var_collect, x)
err = jnp.linalg.norm(output.astype(jnp.float32) - reference) / jnp.linalg.norm(reference)
print(f"loss={float(loss):.4f}  kernel grad shape={grads['params']['kernel'].shape}  "
      f"relative error of the FP8 output={float(err):.3%}")
