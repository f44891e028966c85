"""TransformerLayer on a 4-device CPU mesh with data, fsdp and tensor axes (MeshResource + logical axis rules):
the same losses and FP8 states as on one device, every state identical on all devices (amaxes reduced globally).
Runs in a subprocess because the device count must be set before jax starts."""

import textwrap

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from test_jax_mesh import run_on_four_cpu_devices  # noqa: E402

SCRIPT = textwrap.dedent(
    r'''
    import numpy as np
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import fp8kit.jax as te
    import fp8kit.jax.flax as te_flax
    from fp8kit.recipe import DelayedScaling

    assert len(jax.devices()) == 4
    B, S, H = 4, 8, 32
    recipe = DelayedScaling(amax_history_len=4)
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                                     attention_dropout=0.0, use_bias=True)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((B, S, H)).astype(np.float32) * (i + 1), rng.standard_normal((B, S, H)).astype(
        np.float32)) for i in range(3)]

    def make_step():
        @jax.jit
        def step(v, x, c):
            loss, grads = jax.value_and_grad(lambda vv: jnp.sum(layer.apply(vv, x, deterministic=True) * c))(v)
            params, metas = te.split_grads(grads, v["fp8_metas"])
            params = jax.tree.map(lambda p, g: p - 1e-4 * g, v["params"], params)
            return loss, {"params": params, "fp8_metas": metas}
        return step

    with te.autocast(enabled=True, recipe=recipe):
        variables = layer.init(jax.random.PRNGKey(0), jnp.zeros((B, S, H)), deterministic=True)
        step, v, single = make_step(), variables, []
        for x, c in data:
            loss, v = step(v, x, c)
            single.append((float(loss), jax.tree.map(np.asarray, v["fp8_metas"])))

    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    resource = te.MeshResource(dp_resource="data", fsdp_resource="fsdp", tp_resource="tensor")
    with jax.set_mesh(mesh), te.autocast(enabled=True, recipe=recipe, mesh_resource=resource):
        rules = te_flax.extend_logical_axis_rules(())
        table = dict(rules)
        assert table[te.sharding.BATCH_AXES] == "fsdp" and table[te.sharding.W_TP_AXES] == "tensor"
        with nn.logical_axis_rules(rules):
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)
            v = jax.device_put(variables, shardings)
            qkv = v["params"]["attention"]["qkv"]["kernel"].value
            assert qkv.sharding.spec == P("fsdp", None, "tensor"), qkv.sharding.spec
            step = make_step()
            for i, (x, c) in enumerate(data):
                xs = jax.device_put(x, NamedSharding(mesh, P("fsdp", None, None)))
                cs = jax.device_put(c, NamedSharding(mesh, P("fsdp", None, None)))
                loss, v = step(v, xs, cs)
                want_loss, want_metas = single[i]
                assert abs(float(loss) - want_loss) <= 1e-5 * abs(want_loss), (i, float(loss), want_loss)
                flat = jax.tree_util.tree_leaves_with_path(v["fp8_metas"])
                for (path, leaf), want in zip(flat, jax.tree.leaves(want_metas)):
                    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
                    assert len(shards) == 4 and all(s.tobytes() == shards[0].tobytes() for s in shards), path
                    np.testing.assert_allclose(shards[0], want, rtol=1e-5, err_msg=f"step {i} {path}")
    print("mesh transformer ok", single[-1][0])
    '''
)


@pytest.mark.slow
def test_transformer_layer_on_a_data_fsdp_tensor_mesh(tmp_path):
    result = run_on_four_cpu_devices(SCRIPT, tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mesh transformer ok" in result.stdout
