"""FP8 delayed scaling with a Flax layer, trained for a few steps: the natural JAX counterpart of Transformer
Engine's "FP8 Delayed Scaling" example, with fp8kit imports. Sizes are smaller than the page's so that it runs in
seconds on a CPU.

The delayed-scaling state lives in the "fp8_metas" collection; `jax.grad` returns the updated state as the gradient
of those variables, and `te.split_grads` keeps it away from the optimizer.
"""

import jax
import jax.numpy as jnp

import fp8kit.jax as te
from fp8kit.jax.flax import DenseGeneral
from fp8kit.recipe import DelayedScaling

BATCH, SEQ, HIDDEN, STEPS = 4, 32, 256, 5  # the page uses 32, 128, 1024

# START_DELAYED_SCALING_EXAMPLE
# Create FP8 Delayed Scaling recipe
recipe = DelayedScaling(
    margin=0,  # Margin for scaling factor computation (default: 0)
    amax_history_len=1024,  # Length of amax history window (default: 1024)
    amax_compute_algo="max",  # How to compute amax from history (default: "max")
)

with te.autocast(enabled=True, recipe=recipe):
    # Create and initialize layer: "params" and the FP8 state in "fp8_metas"
    layer = DenseGeneral(features=HIDDEN)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (BATCH, SEQ, HIDDEN), dtype=jnp.bfloat16)
    var_collect = layer.init(key, x)

    # Forward and backward pass
    def loss_fn(var_collect):
        output = layer.apply(var_collect, x)
        return output.astype(jnp.float32).sum()

    loss, grads = jax.value_and_grad(loss_fn)(var_collect)

    # The gradient of "fp8_metas" is the updated state; only "params" goes to the optimizer
    param_grads, fp8_metas = te.split_grads(grads, var_collect["fp8_metas"])
    var_collect = {"params": var_collect["params"], "fp8_metas": fp8_metas}
# END_DELAYED_SCALING_EXAMPLE

    # a few training steps under jit: one compilation, the state is data
    @jax.jit
    def train_step(var_collect, x):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean(jnp.square(layer.apply(v, x).astype(jnp.float32))))(
            var_collect)
        param_grads, fp8_metas = te.split_grads(grads, var_collect["fp8_metas"])
        params = jax.tree.map(lambda p, g: p - 0.1 * g, var_collect["params"], param_grads)
        return loss, {"params": params, "fp8_metas": fp8_metas}

    for step in range(STEPS):
        batch = x * (1.0 + step)  # growing activations: the history follows them
        loss, var_collect = train_step(var_collect, batch)
        metas = var_collect["fp8_metas"]
        print(f"step {step + 1}: loss={float(loss):.4f}  x amax={float(metas['x_amax_history'][-1]):.3f}  "
              f"x scale={float(metas['x_scale'][0]):.3f}  grad scale={float(metas['grad_scale'][0]):.1f}")
