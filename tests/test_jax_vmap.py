"""jax.vmap / nn.vmap over FP8 layers: a state shared by the members sees the max of their amaxes, exactly like one
call on the concatenated batch (issue 11 item 7); a state per member (an ensemble) sees its own member's."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as te  # noqa: E402
from fp8kit.jax.flax import DenseGeneral  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

B, R, IN, OUT = 3, 4, 16, 8
RECIPE = DelayedScaling(amax_history_len=3)


def _bits(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32).view(np.uint32), tree)


def _assert_same_state(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(_bits(got)), jax.tree.leaves(_bits(want))):
        name = jax.tree_util.keystr(path)
        assert np.array_equal(g, w), f"{what} {name}: {g.view(np.float32)} vs {w.view(np.float32)}"


def _batches(steps):
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps):
        x = rng.standard_normal((B, R, IN)).astype(np.float32)
        x[i % B] *= 10.0 ** (i + 1)  # the largest member changes from step to step
        c = (rng.standard_normal((B, R, OUT)) * (i + 1)).astype(np.float32)
        out.append((jnp.asarray(x), jnp.asarray(c)))
    return out


def _train(loss_fn, variables, steps, member=None, grad_fn=None):
    """Steps of SGD on params, the new fp8_metas from the gradient; returns the fp8_metas after each step.
    `member`: train on that member's slice of the data only; `grad_fn`: an already jitted gradient to reuse."""
    grad_fn = grad_fn or jax.jit(jax.grad(loss_fn))
    states = []
    for x, c in _batches(steps):
        if member is not None:
            x, c = x[member], c[member]
        grads = grad_fn(variables, x, c)
        params, metas = te.split_grads(grads, variables["fp8_metas"])
        variables = {"params": jax.tree.map(lambda p, g: p - 1e-3 * g, variables["params"], params),
                     "fp8_metas": metas}
        states.append(metas)
    return states


@pytest.mark.parametrize("how", ["jax.vmap", pytest.param("nn.vmap", marks=pytest.mark.slow)])
def test_vmap_over_a_shared_state_equals_one_call_on_the_whole_batch(how):
    layer = DenseGeneral(features=OUT)
    with te.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(layer.init)(jax.random.PRNGKey(0), jnp.zeros((R, IN)))

        def whole(v, x, c):
            return jnp.sum(layer.apply(v, x.reshape(B * R, IN)) * c.reshape(B * R, OUT))

        if how == "jax.vmap":
            def mapped(v, x, c):
                return jnp.sum(jax.vmap(lambda xi: layer.apply(v, xi))(x) * c)
        else:
            vmapped = nn.vmap(DenseGeneral, variable_axes={"params": None, "fp8_metas": None},
                              split_rngs={"params": False}, in_axes=0)(features=OUT)

            def mapped(v, x, c):
                return jnp.sum(vmapped.apply(v, x) * c)

        want = _train(whole, variables, 4)
        got = _train(mapped, variables, 4)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same_state(g, w, f"step {i + 1}")
    # the scales follow the largest member: 448 / max |x| of the window
    assert float(got[-1]["x_scale"][0]) < 448.0 / 1e3


def test_vmap_outputs_match_one_call():
    layer = DenseGeneral(features=OUT, use_bias=False)
    x, _ = _batches(1)[0]
    with te.autocast(enabled=True, recipe=RECIPE):
        v = jax.jit(layer.init)(jax.random.PRNGKey(1), x[0])
        v = {"params": v["params"], "fp8_metas": {**v["fp8_metas"], "x_scale": jnp.array([3.0])}}
        y_map = jax.jit(jax.vmap(lambda xi: layer.apply(v, xi)))(x)
        y_one = jax.jit(layer.apply)(v, x.reshape(B * R, IN))
    np.testing.assert_allclose(np.asarray(y_map).reshape(B * R, OUT), y_one, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_one_state_per_member_sees_its_own_member():
    ensemble = nn.vmap(DenseGeneral, variable_axes={"params": 0, "fp8_metas": 0}, split_rngs={"params": True},
                       in_axes=0)(features=OUT)
    single = DenseGeneral(features=OUT)
    with te.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(ensemble.init)(jax.random.PRNGKey(2), jnp.zeros((B, R, IN)))
        states = _train(lambda v, x, c: jnp.sum(ensemble.apply(v, x) * c), variables, 2)
        member_grad = jax.jit(jax.grad(lambda v, x, c: jnp.sum(single.apply(v, x) * c)))  # one compilation
        for m in range(B):  # member m alone, on its own data
            own = _train(None, jax.tree.map(lambda a: a[m], variables), 2, member=m, grad_fn=member_grad)
            for i, (g, w) in enumerate(zip(states, own)):
                _assert_same_state(jax.tree.map(lambda a: a[m], g), w, f"member {m} step {i + 1}")
