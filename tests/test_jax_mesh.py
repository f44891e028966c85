"""Amax reduction over a mesh of 4 CPU devices (data x tensor parallel), run in a subprocess because the device
count must be set before jax starts: every shard holds the same state, equal to the reference fed the global amax."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    r'''
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import fp8kit.jax as te
    import reference as ref
    from fp8kit.jax.flax import DenseGeneral
    from fp8kit.jax.state import init_group
    from fp8kit.recipe import DelayedScaling

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    resource = te.MeshResource(dp_resource="dp", tp_resource="tp")
    recipe = DelayedScaling(amax_history_len=3)
    ROWS, IN, OUT = 8, 16, 8
    rng = np.random.default_rng(0)

    def put(a, spec):
        return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))

    def check_state(metas, fwd, bwd, what):
        for name, want in (("x_amax_history", fwd.history[:, 0]), ("kernel_amax_history", fwd.history[:, 1]),
                           ("grad_amax_history", bwd.history[:, 0]), ("x_scale", fwd.scale[:1]),
                           ("kernel_scale", fwd.scale[1:]), ("grad_scale", bwd.scale)):
            leaf = metas[name]
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            assert len(shards) == 4, (name, len(shards))
            for s in shards:  # identical on every device, equal to the reference of the global tensors
                assert s.tobytes() == np.asarray(want, np.float32).tobytes(), (what, name, s, want)

    def reference_step(fwd, bwd, x, k, c):
        fwd.record(0, ref.amax(x)); fwd.record(1, ref.amax(k)); bwd.record(0, ref.amax(c))
        fwd.update(); bwd.update()

    # 1. jit with sharded global arrays: the amaxes are global by themselves
    layer = DenseGeneral(features=OUT, use_bias=False)
    with te.autocast(enabled=True, recipe=recipe, mesh_resource=resource):
        @jax.jit
        def step(v, x, c):
            grads = jax.grad(lambda vv: jnp.sum(layer.apply(vv, x) * c))(v)
            return te.split_grads(grads, v["fp8_metas"])

        fwd = ref.DelayedState(3, 2, 448.0)
        bwd = ref.DelayedState(3, 1, 57344.0)
        metas = jax.tree.map(lambda a: put(a, P()), init_group(recipe))
        for i, mag in enumerate([1.0, 40.0, 0.01, 3.0]):
            x = (rng.standard_normal((ROWS, IN)) * mag).astype(np.float32)
            x[5, 3] = 1000.0 * mag if i == 1 else x[5, 3]  # the max sits on one shard only
            k = (rng.standard_normal((IN, OUT)) * (i + 1)).astype(np.float32)
            c = (rng.standard_normal((ROWS, OUT)) / mag).astype(np.float32)
            v = {"params": {"kernel": put(k, P(None, "tp"))}, "fp8_metas": metas}
            _, metas = step(v, put(x, P("dp", None)), put(c, P("dp", "tp")))
            reference_step(fwd, bwd, x, k, c)
            check_state(metas, fwd, bwd, f"jit step {i + 1}")
    print("jit ok")

    # 2. shard_map: each device sees its shard; fp8kit all-reduces (pmax) over the MeshResource axes
    with te.autocast(enabled=True, recipe=recipe, mesh_resource=resource):
        def local_loss(meta, x, k, c):
            return jax.lax.psum(jnp.sum(te.dense(x, k, None, quantizer_set=meta) * c), ("dp", "tp"))

        sharded_loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(), P("dp", None), P(None, "tp"),
                                                                     P("dp", "tp")), out_specs=P())
        grad_fn = jax.jit(jax.grad(sharded_loss))
        fwd = ref.DelayedState(3, 2, 448.0)
        bwd = ref.DelayedState(3, 1, 57344.0)
        meta = jax.tree.map(lambda a: put(a, P()), init_group(recipe))
        for i, mag in enumerate([2.0, 0.5, 70.0]):
            x = (rng.standard_normal((ROWS, IN)) * mag).astype(np.float32)
            x[6, 1] = 500.0 * mag
            k = (rng.standard_normal((IN, OUT)) * (i + 1)).astype(np.float32)
            c = (rng.standard_normal((ROWS, OUT)) * mag).astype(np.float32)
            with jax.set_mesh(mesh):
                meta = grad_fn(meta, put(x, P("dp", None)), put(k, P(None, "tp")), put(c, P("dp", "tp")))
            reference_step(fwd, bwd, x, k, c)
            check_state(meta, fwd, bwd, f"shard_map step {i + 1}")
    print("shard_map ok")

    # 3. pipeline parallelism is never reduced over: two stages with their own layers and states
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("pp", "dp"))
    resource = te.MeshResource(dp_resource="dp", pp_resource="pp")
    with te.autocast(enabled=True, recipe=recipe, mesh_resource=resource):
        def stage_loss(meta, x, k, c):
            meta = jax.tree.map(lambda a: a[0], meta)
            return jax.lax.psum(jnp.sum(te.dense(x[0], k[0], None, quantizer_set=meta) * c[0]), ("pp", "dp"))

        pipelined = jax.shard_map(stage_loss, mesh=mesh, in_specs=(P("pp"), P("pp", "dp"), P("pp"), P("pp", "dp")),
                                  out_specs=P())
        grad_fn = jax.jit(jax.grad(pipelined))
        refs = [(ref.DelayedState(3, 2, 448.0), ref.DelayedState(3, 1, 57344.0)) for _ in range(2)]
        meta = jax.tree.map(lambda a: put(jnp.stack([a, a]), P("pp")), init_group(recipe))
        for i in range(2):
            x = rng.standard_normal((2, ROWS, IN)).astype(np.float32)
            x[0, 1, 2] = 300.0 * (i + 1)  # stage 0 only
            k = rng.standard_normal((2, IN, OUT)).astype(np.float32)
            c = rng.standard_normal((2, ROWS, OUT)).astype(np.float32)
            with jax.set_mesh(mesh):
                meta = grad_fn(meta, put(x, P("pp", "dp")), put(k, P("pp")), put(c, P("pp", "dp")))
            for stage, (fwd, bwd) in enumerate(refs):
                reference_step(fwd, bwd, x[stage], k[stage], c[stage])
                want = {"x_amax_history": fwd.history[:, 0], "kernel_amax_history": fwd.history[:, 1],
                        "grad_amax_history": bwd.history[:, 0], "x_scale": fwd.scale[:1],
                        "kernel_scale": fwd.scale[1:], "grad_scale": bwd.scale}
                for name, value in want.items():
                    got = np.asarray(meta[name])[stage]
                    assert got.tobytes() == np.asarray(value, np.float32).tobytes(), (stage, name, got, value)
    print("pipeline ok")
    '''
)


def run_on_four_cpu_devices(script: str, tmp_path, timeout: int = 240) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout)


def test_amax_reduction_on_a_4_device_mesh(tmp_path):
    result = run_on_four_cpu_devices(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "jit ok" in result.stdout and "shard_map ok" in result.stdout and "pipeline ok" in result.stdout
