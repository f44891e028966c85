"""The block-scaled recipes (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling) on a 2 x 2 ("dp", "tp") mesh of
CPU devices. Under `jax.jit`, inputs sharded over dp (rows) and kernels over tp (output features, shards a multiple of
the block size): DenseGeneral's and LayerNormMLP's forward and backward equal bit for bit the same jitted computation
on one device (the bias and LayerNorm gradients, float32 sums over the rows that dp splits, up to the order of that
sum); NVFP4's per-tensor amax is the global one; stochastic rounding is deterministic for a key and equal to one
device's (jit's results do not depend on the inputs' shardings, whichever threefry jax uses). Under `shard_map` the
forward is the same bit for bit and NVFP4's amaxes are all-reduced. Runs in a subprocess because the device count must
be set before jax starts."""

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
    import reference as ref
    from fp8kit.jax.flax import DenseGeneral, LayerNormMLP
    from fp8kit.jax.nvfp4_gemm import NVFP4Spec, nvfp4_operand
    from fp8kit.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    ONE = jax.devices()[0]
    # B * S / 2 rows per dp shard and N / 2 features per tp shard: multiples of 128 (Float8 block), so of 32 and 16
    B, S, K, N = 4, 64, 256, 256
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, K)).astype(np.float32)
    x[3, 7, 11] = 40.0  # the tensor maxima sit on one shard only
    kernel = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    kernel[5, 200] = 3.0
    bias = rng.standard_normal(N).astype(np.float32)
    dy = rng.standard_normal((B, S, N)).astype(np.float32)
    dy[0, 1, 3] = 30.0

    def put(a, spec):
        return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))

    def same_bits(got, want, what):
        bad = []
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            g, w = np.asarray(g), np.asarray(_at(want, path))
            name = jax.tree_util.keystr(path)
            if name.endswith(ROW_SUMS) and g.shape == w.shape:  # float32 sums over the rows, which dp splits
                if g.tobytes() != w.tobytes():
                    print("row sum", what, name, int(np.sum(g != w)), "of", g.size, "differ, by at most",
                          float(np.max(np.abs(g.astype(np.float64) - w))), "max |w|", float(np.max(np.abs(w))))
                np.testing.assert_allclose(g, w, rtol=0, atol=2.0 ** -18 * float(np.max(np.abs(w))), err_msg=name)
                continue
            if g.shape != w.shape or g.tobytes() != w.tobytes():
                bad.append((jax.tree_util.keystr(path), g.shape, int(np.sum(g != w)),
                            float(np.max(np.abs(g.astype(np.float64) - w)))))
        assert not bad, (what, bad)

    ROW_SUMS = ("bias']", "['scale']")  # bias / LayerNorm gradients: XLA sums each dp shard's rows, then the shards

    def _at(tree, path):
        for k in path:
            tree = tree[getattr(k, "key", getattr(k, "idx", None))]
        return tree

    def vjp_step(apply):
        """jit: (outputs, vjp cotangents) of apply(params, x) for the cotangent dy."""
        @jax.jit
        def step(params, x, dy, key):
            out, vjp = jax.vjp(lambda p, xx: apply(p, xx, key), params, x)
            return out, vjp(dy)
        return step

    def compare(recipe, apply, params, specs, what, key=jax.random.PRNGKey(7)):
        """Run under `recipe` on one device and on the mesh; the same bits. Returns the mesh results."""
        with te.autocast(enabled=True, recipe=recipe):
            step = vjp_step(apply)
            single = step(jax.device_put(params, ONE), jax.device_put(x, ONE), jax.device_put(dy, ONE),
                          jax.device_put(key, ONE))
            sharded = step(jax.tree.map(put, params, specs), put(x, P("dp")), put(dy, P("dp", None, "tp")),
                           put(key, P()))
        out = sharded[0][0] if isinstance(sharded[0], tuple) else sharded[0]
        assert len(out.addressable_shards) == 4 and out.sharding.spec[0] == "dp", out.sharding
        same_bits(sharded, single, what)
        return sharded

    # ---- DenseGeneral: fprop x @ K, dgrad dy @ K^T (contraction over tp), wgrad x^T dy (contraction over dp) ----
    dense_layer = DenseGeneral(features=N)
    dense_params = {"params": {"kernel": kernel, "bias": bias}}
    dense_specs = {"params": {"kernel": P(None, "tp"), "bias": P("tp")}}

    def dense_apply(p, xx, key):
        return dense_layer.apply(p, xx, rngs={"sr_rng": key})

    def dense_case(recipe, name):
        got = compare(recipe, dense_apply, dense_params, dense_specs, name)
        y = np.asarray(got[0], np.float64)
        hp = x.astype(np.float64) @ kernel + bias
        assert not np.allclose(y, hp, rtol=1e-4) and np.allclose(y, hp, atol=0.3 * np.abs(hp).max()), name
        print(name, "ok")
        return got

    def nvfp4_amax_is_global():
        """The per-tensor amax (and so every byte) of an operand cast from a sharded array is the global one."""
        spec1, spec2 = NVFP4Spec(), NVFP4Spec(two_d=True)
        cast = jax.jit(nvfp4_operand, static_argnums=(1, 2))
        for a, spec, sharding, transpose, what in ((x.reshape(-1, K), spec1, P("dp"), False, "x rowwise"),
                                                   (kernel, spec2, P(None, "tp"), True, "kernel 16x16")):
            op = cast(put(a, sharding), spec, transpose)
            want = ref.nvfp4_quantize(a.T if transpose else a, spec.two_d)
            assert np.asarray(op.amax).tobytes() == np.float32(ref.amax(a)).tobytes(), (what, op.amax)
            for g, w in zip(op[:2], want[:2]):
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=what)
        print("nvfp4 amax ok")

    def nvfp4_stochastic_rounding():
        recipe = NVFP4BlockScaling()
        first = compare(recipe, dense_apply, dense_params, dense_specs, "nvfp4 sr", key=jax.random.PRNGKey(7))
        again = compare(recipe, dense_apply, dense_params, dense_specs, "nvfp4 sr", key=jax.random.PRNGKey(7))
        same_bits(again, first, "nvfp4 sr: the same key twice")
        other = compare(recipe, dense_apply, dense_params, dense_specs, "nvfp4 sr", key=jax.random.PRNGKey(8))
        rne = dense_case(NVFP4BlockScaling(disable_stochastic_rounding=True), "nvfp4 rne")
        for a, b in ((first, other), (first, rne)):  # the gradient's rounding is stochastic: dgrad and wgrad move
            dx_a, dk_a = (np.asarray(g) for g in (a[1][1], a[1][0]["params"]["kernel"]))
            dx_b, dk_b = (np.asarray(g) for g in (b[1][1], b[1][0]["params"]["kernel"]))
            assert not np.array_equal(dx_a, dx_b) and not np.array_equal(dk_a, dk_b)
        print("nvfp4 sr ok", f"threefry_partitionable={jax.config.jax_threefry_partitionable}")

    # ---- LayerNormMLP: wi column-parallel, wo row-parallel (its fprop contracts over tp) ----
    def mlp_case(recipe, name):
        layer = LayerNormMLP(intermediate_dim=N, activations=("gelu", "linear"), use_bias=True)
        params = nn.unbox(layer.init(jax.random.PRNGKey(1), jnp.zeros((B, S, K))))
        leaves, tree = jax.tree.flatten(params)
        params = jax.tree.unflatten(tree, [rng.standard_normal(a.shape).astype(np.float32) * 0.1 for a in leaves])
        specs = {"params": {"scale": P(), "ln_bias": P(), "wi_kernel": P(None, None, "tp"), "wi_bias": P(None, "tp"),
                            "wo_kernel": P("tp", None), "wo_bias": P()}}
        assert set(params["params"]) == set(specs["params"]), sorted(params["params"])
        compare(recipe, lambda p, xx, key: layer.apply(p, xx, rngs={"sr_rng": key})[0], params, specs, name)
        print(name, "ok")

    # ---- shard_map: each device casts its own shard; NVFP4's per-tensor amaxes are all-reduced (pmax) ----
    def shard_map_case():
        """The forward equals the unsharded one bit for bit (block-aligned shards, global NVFP4 amaxes); dgrad and
        wgrad are sums of per-shard partial GEMMs (psum over tp, dp): equal up to the float32 order of the sum."""
        x2, c = x.reshape(-1, K), dy.reshape(-1, N)

        def loss(a, b, cc):
            return jnp.sum(te.dense(a, b) * cc)

        def local_loss(a, b, cc):
            return jax.lax.psum(loss(a, b, cc), ("dp", "tp"))

        specs = (P("dp"), P(None, "tp"), P("dp", "tp"))
        for name, recipe in RECIPES.items():
            with te.autocast(enabled=True, recipe=recipe):
                y1, g1 = jax.jit(lambda a, b, cc: (te.dense(a, b), jax.grad(loss, (0, 1))(a, b, cc)))(x2, kernel, c)
                fwd = jax.shard_map(lambda a, b: te.dense(a, b), mesh=mesh, in_specs=specs[:2], out_specs=specs[2])
                grad = jax.grad(jax.shard_map(local_loss, mesh=mesh, in_specs=specs, out_specs=P()), (0, 1))
                y, g = jax.jit(lambda a, b, cc: (fwd(a, b), grad(a, b, cc)))(x2, kernel, c)
            same_bits(y, y1, f"shard_map {name} forward")
            for got, want in zip(g, g1):
                got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
                np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -20 * np.abs(want).max(), err_msg=name)
        print("shard_map ok")

    RECIPES = {"mxfp8": MXFP8BlockScaling(), "block": Float8BlockScaling(),
               "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True)}
    for part in PARTS:  # set by the test
        if part == "nvfp4-amax":
            nvfp4_amax_is_global()
        elif part == "nvfp4-sr":
            nvfp4_stochastic_rounding()
        elif part == "shard_map":
            shard_map_case()
        elif part.startswith("mlp-"):
            mlp_case(RECIPES[part[4:]], part)
        else:
            dense_case(RECIPES[part], part)
    '''
)


def _run(tmp_path, *parts):
    result = run_on_four_cpu_devices(f"PARTS = {list(parts)!r}\n" + SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for part in parts:
        assert f"{part} ok" in result.stdout or part.startswith("nvfp4-"), result.stdout + result.stderr
    return result.stdout


def test_mxfp8_dense_and_nvfp4_amax_on_a_2x2_mesh(tmp_path):
    out = _run(tmp_path, "nvfp4-amax", "mxfp8")
    assert "nvfp4 amax ok" in out


def test_block_recipes_under_shard_map(tmp_path):
    """Under shard_map the block GEMMs' scan carries the mesh axes, and NVFP4's amaxes are all-reduced."""
    assert "shard_map ok" in _run(tmp_path, "shard_map")


@pytest.mark.slow
@pytest.mark.parametrize("part", ["block", "mlp-mxfp8", "mlp-block", "mlp-nvfp4"])
def test_block_recipes_on_a_2x2_mesh(tmp_path, part):
    _run(tmp_path, part)


@pytest.mark.slow
@pytest.mark.parametrize("partitionable", ["1", "0"])
def test_nvfp4_stochastic_rounding_on_a_2x2_mesh(tmp_path, monkeypatch, partitionable):
    """Deterministic for a key and equal to one device's draws, whichever threefry implementation jax uses."""
    monkeypatch.setenv("JAX_THREEFRY_PARTITIONABLE", partitionable)
    out = _run(tmp_path, "nvfp4-sr")
    assert "nvfp4 rne ok" in out and "nvfp4 sr ok" in out and f"threefry_partitionable={partitionable == '1'}" in out
