"""Issue 18: the ways a Flax training step can carry the FP8 state (gradient pattern, mutable collection, optax
wrapper), the warning when the state would be dropped, jit under a later autocast, flax's DenseGeneral keywords."""

import sys
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.training import train_state  # noqa: E402

import fp8kit.jax as te  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
from fp8kit.jax.flax import DenseGeneral  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

IN, OUT, ROWS = 16, 8, 12
RECIPE = DelayedScaling(amax_history_len=3)
dense_module = sys.modules["fp8kit.jax.dense"]  # (fp8kit.jax.dense is the function, as in Transformer Engine)
FORWARD = ("x_scale", "x_amax_history", "kernel_scale", "kernel_amax_history")


class Twice(nn.Module):
    """One layer used twice, then another: reuse must max-combine in every pattern."""

    @nn.compact
    def __call__(self, x):
        shared = DenseGeneral(features=IN, name="shared")
        return DenseGeneral(features=OUT, name="head")(shared(jnp.tanh(shared(x))))


MODEL = Twice()
LAYER = DenseGeneral(features=OUT)


def _data(steps):
    rng = np.random.default_rng(0)
    return [(jnp.asarray(rng.standard_normal((ROWS, IN)) * 10.0 ** (i % 3 - 1), jnp.float32),
             jnp.asarray(rng.standard_normal((ROWS, OUT)) * (i + 1), jnp.float32)) for i in range(steps)]


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _init():
    with te.autocast(enabled=True, recipe=RECIPE):
        return jax.jit(MODEL.init)(jax.random.PRNGKey(0), jnp.zeros((ROWS, IN)))


def _gradient_pattern(variables, steps):
    with te.autocast(enabled=True, recipe=RECIPE):
        grad = jax.jit(jax.grad(lambda v, x, c: jnp.sum(MODEL.apply(v, x) * c)))
        out = []
        for x, c in _data(steps):
            _, metas = te.split_grads(grad(variables, x, c), variables["fp8_metas"])
            variables = {"params": variables["params"], "fp8_metas": metas}
            out.append(metas)
    return out


def test_mutable_collection_returns_the_forward_state_and_warns_about_the_backward_state():
    variables = _init()
    want = _gradient_pattern(variables, 2)

    def loss(params, metas, x, c):  # BatchNorm style: only params are differentiated
        y, updates = MODEL.apply({"params": params, "fp8_metas": metas}, x, mutable=["fp8_metas"])
        return jnp.sum(y * c), updates["fp8_metas"]

    metas = variables["fp8_metas"]
    with te.autocast(enabled=True, recipe=RECIPE), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        for i, (x, c) in enumerate(_data(2)):
            (_, metas), _ = step(variables["params"], metas, x, c)
            for layer in ("shared", "head"):
                for name in FORWARD:  # the forward state equals the gradient pattern's, reuse included
                    assert np.array_equal(_bits(metas[layer][name]), _bits(want[i][layer][name])), (i, layer, name)
                assert float(metas[layer]["grad_scale"][0]) == 1.0  # the backward state cannot come from apply
    messages = [str(w.message) for w in caught if "fp8kit" in str(w.message)]
    assert len(messages) <= 1 and (messages or "state" in dense_module._WARNED)


@pytest.mark.slow
def test_mutable_collection_and_differentiated_state_give_the_full_update():
    """Differentiating the state as well gives the full update, identical to the gradient pattern, and the forward
    state written to the mutable collection equals the forward part of it."""
    variables = _init()
    want = _gradient_pattern(variables, 2)

    def loss(params, metas, x, c):
        y, updates = MODEL.apply({"params": params, "fp8_metas": metas}, x, mutable=["fp8_metas"])
        return jnp.sum(y * c), updates["fp8_metas"]

    with te.autocast(enabled=True, recipe=RECIPE):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        metas = variables["fp8_metas"]
        for i, (x, c) in enumerate(_data(2)):
            (_, forward), (_, new) = step(variables["params"], metas, x, c)
            for got, w in zip(jax.tree.leaves(new), jax.tree.leaves(want[i])):
                assert np.array_equal(_bits(got), _bits(w))
            for layer in ("shared", "head"):
                for name in FORWARD:
                    assert np.array_equal(_bits(forward[layer][name]), _bits(new[layer][name]))
            metas = new


def test_state_not_differentiated_warns_once_naming_the_fix(monkeypatch):
    monkeypatch.setattr(dense_module, "_WARNED", set())
    with te.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(LAYER.init)(jax.random.PRNGKey(0), jnp.zeros((ROWS, IN)))
    x, c = _data(1)[0]

    def loss(params, x):  # lm1b's train step: the FP8 collection closed over, only params differentiated
        return jnp.sum(LAYER.apply({"params": params, "fp8_metas": variables["fp8_metas"]}, x) * c)

    with te.autocast(enabled=True, recipe=RECIPE):  # the check runs when a step is traced (lowered)
        with pytest.warns(UserWarning, match="wrap_optimizer") as record:
            jax.jit(jax.grad(loss)).lower(variables["params"], x)
        assert sum("fp8kit" in str(w.message) for w in record) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only; and the gradient pattern never warns
            jax.jit(jax.grad(loss)).lower(variables["params"], x + 1)  # a new trace
            monkeypatch.setattr(dense_module, "_WARNED", set())
            jax.jit(jax.grad(lambda v: jnp.sum(LAYER.apply(v, x) * c))).lower(variables)


def test_optax_wrapper_keeps_the_state_out_of_the_optimizer():
    with te.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(LAYER.init)(jax.random.PRNGKey(0), jnp.zeros((ROWS, IN)))
    tx = te.wrap_optimizer(optax.adam(1e-2))
    plain = optax.adam(1e-2)
    with te.autocast(enabled=True, recipe=RECIPE):
        grad = jax.jit(jax.grad(lambda v, x, c: jnp.sum(LAYER.apply(v, x) * c)))
        state, plain_state, params = tx.init(variables), plain.init(variables["params"]), variables["params"]
        v = variables
        for x, c in _data(2):
            grads = grad(v, x, c)
            want = te.split_grads(grads, v["fp8_metas"])[1]
            updates, state = jax.jit(tx.update)(grads, state, v)
            v = optax.apply_updates(v, updates)
            plain_updates, plain_state = jax.jit(plain.update)(grads["params"], plain_state, params)
            params = optax.apply_updates(params, plain_updates)
            for got, w in zip(jax.tree.leaves(v["fp8_metas"]), jax.tree.leaves(want)):
                assert np.array_equal(_bits(got), _bits(w))  # the new state, bit for bit
            for got, w in zip(jax.tree.leaves(v["params"]), jax.tree.leaves(params)):
                assert np.array_equal(_bits(got), _bits(w))  # the optimizer saw the params only
        naive = optax.apply_updates(variables, optax.adam(1e-2).update(grads, optax.adam(1e-2).init(variables))[0])
        assert abs(float(naive["fp8_metas"]["x_scale"][0]) - 0.99) < 0.02  # the bug the wrapper prevents
        # flax's TrainState over the whole variables dict works unchanged
        ts = train_state.TrainState.create(apply_fn=LAYER.apply, params=variables, tx=tx)
        x, c = _data(1)[0]
        grads = grad(ts.params, x, c)
        ts = ts.apply_gradients(grads=grads)
    for got, w in zip(jax.tree.leaves(ts.params["fp8_metas"]), jax.tree.leaves(grads["fp8_metas"])):
        assert np.array_equal(_bits(got), _bits(w))
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, state)


def test_jit_traced_outside_autocast_follows_a_later_autocast():
    layer = DenseGeneral(features=OUT)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((ROWS, IN)), jnp.float32)
    variables = layer.init(jax.random.PRNGKey(1), x)
    apply = jax.jit(layer.apply)
    high = apply(variables, x)  # traced outside autocast
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        fp8 = apply(variables, x)
        fresh = jax.jit(layer.apply)(variables, x)
        again = apply(variables, x)
    np.testing.assert_array_equal(fp8, fresh)  # retraced: FP8, as if traced inside
    assert float(jnp.max(jnp.abs(fp8 - high))) > 1e-3
    np.testing.assert_array_equal(apply(variables, x), high)  # and high precision again outside
    assert apply._cache_size() == 2 and np.array_equal(again, fp8)  # one compilation per setting, no more


def test_dense_general_flax_keywords_match_flax_dense_general():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, IN)), jnp.float32)
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    for kw in (dict(dtype=jnp.bfloat16), dict(dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST),
               dict(param_dtype=jnp.bfloat16)):
        ours = DenseGeneral(features=(2, 4), kernel_init=init, bias_init=nn.initializers.normal(0.1), **kw)
        theirs = nn.DenseGeneral(features=(2, 4), kernel_init=init, bias_init=nn.initializers.normal(0.1), **kw)
        v_ours, v_theirs = ours.init(jax.random.PRNGKey(3), x), theirs.init(jax.random.PRNGKey(3), x)
        assert jax.tree.structure(v_ours) == jax.tree.structure(v_theirs)  # boxed the same way
        assert nn.get_partition_spec(v_ours) == nn.get_partition_spec(v_theirs)
        for a, b in zip(jax.tree.leaves(v_ours), jax.tree.leaves(v_theirs)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        y_ours, y_theirs = ours.apply(v_ours, x), theirs.apply(v_theirs, x)
        assert y_ours.dtype == y_theirs.dtype
        np.testing.assert_array_equal(np.asarray(y_ours, np.float32), np.asarray(y_theirs, np.float32))
    dense, flax_dense = DenseGeneral(features=OUT, dtype=jnp.bfloat16), nn.Dense(features=OUT, dtype=jnp.bfloat16)
    v = flax_dense.init(jax.random.PRNGKey(4), x)
    np.testing.assert_array_equal(np.asarray(dense.apply(v, x), np.float32),
                                  np.asarray(flax_dense.apply(v, x), np.float32))


def test_make_dot_general_cls_is_the_same_fp8_gemm_under_its_own_recipe():
    """flax's nn.Dense with fp8kit's dot_general (no autocast: the wrapper's recipe applies) computes what fp8kit's
    Dense computes under autocast, and keeps the same state in "_overwrite_with_gradient"."""
    recipe = DelayedScaling(amax_history_len=3)
    theirs = nn.Dense(features=OUT, dot_general_cls=te_flax.make_dot_general_cls(recipe))
    ours = te_flax.Dense(features=OUT)
    v = theirs.init(jax.random.PRNGKey(5), jnp.zeros((ROWS, IN)))
    assert set(v) == {"params", "_overwrite_with_gradient"}
    state = v["_overwrite_with_gradient"]["TEWrapper_dot_general_0"]
    ours_v = {"params": v["params"], "fp8_metas": state}
    ours_grad = jax.jit(jax.value_and_grad(lambda vv, x, c: jnp.sum(ours.apply(vv, x) * c)))
    theirs_grad = jax.jit(jax.value_and_grad(lambda vv, x, c: jnp.sum(theirs.apply(vv, x) * c)))
    for x, c in _data(2):
        with te.autocast(enabled=True, recipe=recipe):
            loss_o, g_o = ours_grad(ours_v, x, c)
        loss_t, g_t = theirs_grad(v, x, c)  # outside any autocast
        assert float(loss_o) == float(loss_t)
        new_state = g_t["_overwrite_with_gradient"]["TEWrapper_dot_general_0"]
        for name in g_o["fp8_metas"]:
            assert np.array_equal(_bits(g_o["fp8_metas"][name]), _bits(new_state[name])), name
        ours_v = {"params": v["params"], "fp8_metas": g_o["fp8_metas"]}
        v = {"params": v["params"], "_overwrite_with_gradient": g_t["_overwrite_with_gradient"]}
    assert float(new_state["x_scale"][0]) != 1.0
