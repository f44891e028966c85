"""FP8 delayed scaling on a 2 x 2 (data x tensor parallel) mesh: the natural JAX counterpart of Transformer Engine's
amax-reduction example. Amaxes are reduced over every mesh axis except pipeline parallelism; under `jax.jit` with
sharded global arrays that happens by itself (the max of a global array is global), so every device computes the
same scales.

Without 4 accelerators it runs on 4 CPU devices (the flag must be set before jax starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8kit.jax as te  # noqa: E402
from fp8kit.jax.flax import DenseGeneral  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

BATCH, SEQ, HIDDEN = 8, 32, 256

devices = jax.devices()
if len(devices) < 4:
    devices = jax.devices("cpu")
mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("dp", "tp"))

# START_AMAX_REDUCTION_EXAMPLE
recipe = DelayedScaling(amax_history_len=16)
mesh_resource = te.MeshResource(dp_resource="dp", tp_resource="tp")

with te.autocast(enabled=True, recipe=recipe, mesh_resource=mesh_resource):
    layer = DenseGeneral(features=HIDDEN)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (BATCH, SEQ, HIDDEN), dtype=jnp.bfloat16)
    var_collect = layer.init(key, x)

    # data parallel input, column-parallel kernel, replicated FP8 state
    x = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
    params = {"kernel": jax.device_put(var_collect["params"]["kernel"], NamedSharding(mesh, P(None, "tp"))),
              "bias": jax.device_put(var_collect["params"]["bias"], NamedSharding(mesh, P("tp")))}
    var_collect = {"params": params, "fp8_metas": jax.device_put(var_collect["fp8_metas"], NamedSharding(mesh, P()))}

    @jax.jit
    def train_step(var_collect, x):
        loss, grads = jax.value_and_grad(lambda v: layer.apply(v, x).astype(jnp.float32).sum())(var_collect)
        param_grads, fp8_metas = te.split_grads(grads, var_collect["fp8_metas"])
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, var_collect["params"], param_grads)
        return loss, {"params": params, "fp8_metas": fp8_metas}

    for step in range(3):
        loss, var_collect = train_step(var_collect, x * (step + 1))
# END_AMAX_REDUCTION_EXAMPLE

        scale = var_collect["fp8_metas"]["x_scale"]
        per_device = sorted({float(s.data[0]) for s in scale.addressable_shards})
        print(f"step {step + 1}: loss={float(loss):.2f}  x scale on every device: {per_device}")
        assert len(per_device) == 1, per_device
print(f"mesh {dict(mesh.shape)}: identical scales on all {len(mesh.devices.flat)} devices")
