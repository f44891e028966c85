"""Delayed scaling in fp8kit.jax: the fp8_metas state after every step against reference.DelayedState, bit for bit;
the scales the casts use (via the FP8 GEMM results); reuse and microbatches max-combine; one compilation."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as te  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
from fp8kit.jax.flax import DenseGeneral  # noqa: E402
from fp8kit.jax.state import init_group  # noqa: E402
from fp8kit.recipe import DelayedScaling, Format  # noqa: E402

import reference as ref  # noqa: E402

IN, OUT, ROWS = 16, 8, 12
LAYER = DenseGeneral(features=OUT, use_bias=False, kernel_init=nn.initializers.zeros)
split_grads = jax.jit(te.split_grads)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    assert np.array_equal(_bits(got), _bits(want)), f"{what}: got {got}, want {want}"


class RefLayer:
    """reference.DelayedState for one GEMM: forward slots (x, kernel), backward slot (grad)."""

    def __init__(self, recipe: DelayedScaling, reference_scale_algo=None):
        fmt = recipe.fp8_format.value
        algo = recipe.amax_compute_algo
        kw = dict(margin=recipe.margin, algo=algo, scale_algo=reference_scale_algo, interval=recipe.interval,
                  power_2=recipe.power_2_scale)
        self.fwd = ref.DelayedState(recipe.amax_history_len, 2, fmt.max_fwd, **kw)
        self.bwd = ref.DelayedState(recipe.amax_history_len, 1, fmt.max_bwd, **kw)
        self.fmt = fmt

    def scales(self):
        return float(self.fwd.scale[0]), float(self.fwd.scale[1]), float(self.bwd.scale[0])

    def step(self, x_amaxes, kernel_amax, grad_amaxes):
        for a in x_amaxes:
            self.fwd.record(0, a)
        self.fwd.record(1, kernel_amax)
        for a in grad_amaxes:
            self.bwd.record(0, a)
        self.fwd.update()
        self.bwd.update()

    def assert_matches(self, metas, postfix="", what=""):
        assert_bitwise(metas[f"x{postfix}_amax_history"], self.fwd.history[:, 0], f"{what} x history")
        assert_bitwise(metas[f"kernel{postfix}_amax_history"], self.fwd.history[:, 1], f"{what} kernel history")
        assert_bitwise(metas[f"grad{postfix}_amax_history"], self.bwd.history[:, 0], f"{what} grad history")
        assert_bitwise(metas[f"x{postfix}_scale"], self.fwd.scale[:1], f"{what} x scale")
        assert_bitwise(metas[f"kernel{postfix}_scale"], self.fwd.scale[1:], f"{what} kernel scale")
        assert_bitwise(metas[f"grad{postfix}_scale"], self.bwd.scale, f"{what} grad scale")


def _deq(x32, fmt, scale):
    data, inv = ref.cast(np.asarray(x32, np.float32), fmt, scale)
    return ref.dequantize(data, fmt, inv).astype(np.float64)


def assert_close_to(got, want, bound, what):
    got = np.asarray(got, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)), what
    err = np.abs(got - want)[finite]
    tol = (1e-5 * bound + 1e-30)[finite]
    assert np.all(err <= tol), f"{what}: max excess {np.max(err - tol)}"


def check_gemms(refl, x, kernel, c, y, dx, dk):
    """y, dx, dK against float64 GEMMs of the reference casts with the reference's current scales."""
    sx, sk, sg = refl.scales()
    fmt = refl.fmt
    qx, qk, qg = _deq(x, fmt.fwd, sx), _deq(kernel, fmt.fwd, sk), _deq(c, fmt.bwd, sg)
    ax, ak, ag = np.abs(qx), np.abs(qk), np.abs(qg)
    with np.errstate(invalid="ignore", over="ignore"):
        assert_close_to(y, qx @ qk, ax @ ak, "y")
        assert_close_to(dx, qg @ qk.T, ag @ ak.T, "dx")
        assert_close_to(dk, qx.T @ qg, ax.T @ ag, "dkernel")


def _inputs(steps, seed=0):
    rng = np.random.default_rng(seed)
    x_mags = [1.0, 1e-3, 100.0, 0.0, 5.0, 7.0, 3e4, 0.5, 2.0, 1.0][:steps]
    k_mags = [0.1, 0.1, 3.0, 0.01, 0.02, 1.0, 1.0, 0.3, 0.3, 0.05][:steps]
    c_mags = [1.0, 1e4, 0.0, 2.0, 1e-2, 3.0, 1.0, 1.0, 8.0, 0.5][:steps]
    xs = [(rng.standard_normal((ROWS, IN)) * m).astype(np.float32) for m in x_mags]
    ks = [(rng.standard_normal((IN, OUT)) * m).astype(np.float32) for m in k_mags]
    cs = [(rng.standard_normal((ROWS, OUT)) * m).astype(np.float32) for m in c_mags]
    return xs, ks, cs


def _loss(layer):
    def loss(variables, x, c):
        return jnp.sum(layer.apply(variables, x) * c)

    return loss


_STEPS = {}


def _step_fn(layer):
    """One jitted step: (y, dx, param grads, new fp8_metas); one per recipe, shared by the tests (the autocast
    settings are read when it is traced, so it is only reused under the same recipe)."""
    key = (layer, te.get_recipe())
    if key not in _STEPS:
        _STEPS[key] = _make_step(layer)
    return _STEPS[key]


def _make_step(layer):

    def loss_and_y(variables, x, c):
        y = layer.apply(variables, x)
        return jnp.sum(y * c), y

    @jax.jit
    def step(variables, x, c):
        (_, y), (grads, dx) = jax.value_and_grad(loss_and_y, argnums=(0, 1), has_aux=True)(variables, x, c)
        params, metas = te.split_grads(grads, variables["fp8_metas"])
        return y, dx, params, metas

    return step


def run_and_compare(recipe, steps=8, reference_scale_algo=None, xs=None, ks=None, cs=None, check_every_gemm=True):
    """Each step sets the kernel, takes the gradient, and compares the GEMMs and the new state with the reference."""
    if xs is None:
        xs, ks, cs = _inputs(steps)
    layer = LAYER
    with te.autocast(enabled=True, recipe=recipe):
        variables = {"fp8_metas": init_group(recipe)}  # what layer.init makes (checked in test_jax_flax.py)
        step = _step_fn(layer)
        refl = RefLayer(recipe, reference_scale_algo)
        refl.assert_matches(variables["fp8_metas"], what="init")
        for i, (x, k, c) in enumerate(zip(xs, ks, cs)):
            variables = {"params": {"kernel": jnp.asarray(k)}, "fp8_metas": variables["fp8_metas"]}
            y, dx, params, metas = step(variables, jnp.asarray(x), jnp.asarray(c))
            if check_every_gemm:
                check_gemms(refl, x, k, c, y, dx, params["kernel"])
            refl.step([ref.amax(x)], ref.amax(k), [ref.amax(c)])
            refl.assert_matches(metas, what=f"step {i + 1}")
            variables = {"params": params, "fp8_metas": metas}
    return variables


@pytest.mark.parametrize(
    "algo,length",
    [("max", 1), ("max", 3), ("max", 16), ("most_recent", 3),
     pytest.param("most_recent", 1, marks=pytest.mark.slow), pytest.param("most_recent", 16, marks=pytest.mark.slow)],
)
def test_state_and_casts_match_reference(algo, length):
    run_and_compare(DelayedScaling(amax_history_len=length, amax_compute_algo=algo), steps=8)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(margin=1, amax_history_len=4),
        pytest.param(dict(margin=3, amax_history_len=2, fp8_format=Format.E4M3), marks=pytest.mark.slow),
        dict(amax_history_len=5, fp8_format=Format.E5M2, power_2_scale=True),
        dict(amax_history_len=3, interval=3),
        pytest.param(dict(amax_history_len=2, interval=2, amax_compute_algo="most_recent", margin=2),
                     marks=pytest.mark.slow),
    ],
    ids=["margin", "e4m3", "e5m2-pow2", "interval3", "interval2-recent"],
)
def test_recipe_fields(kwargs):
    variables = run_and_compare(DelayedScaling(**kwargs), steps=8, check_every_gemm=False)
    if kwargs.get("interval", 1) > 1:
        # each state counts the updates it took part in: x and kernel were used in all 8 steps, the output
        # gradient was zero in one of them (c_mags), as the reference (which the scales above matched) counts
        assert float(variables["fp8_metas"]["update_count"][0]) == 8 % kwargs["interval"]
        assert float(variables["fp8_metas"]["grad_update_count"][0]) == 7 % kwargs["interval"]
    else:
        assert "update_count" not in variables["fp8_metas"]


def _mix(h):
    return h[0] * 0.5 + h.max(axis=0) * 0.5


def _scale_fn(amax, scale, fp8_max, recipe):
    return fp8_max / (amax + 1.0) + scale * 0.25


def _scale_fn_ref(amax, scale, fp8_max, recipe):
    return (fp8_max / (amax + np.float32(1.0)) + scale * np.float32(0.25)).astype(np.float32)


@pytest.mark.parametrize("which", ["both", "scale-with-recent", pytest.param("amax", marks=pytest.mark.slow),
                                   pytest.param("scale", marks=pytest.mark.slow),
                                   pytest.param("scale-with-max", marks=pytest.mark.slow)])
def test_callables(which):
    amax_algo = {"amax": _mix, "both": _mix, "scale": "max", "scale-with-max": "max",
                 "scale-with-recent": "most_recent"}[which]
    scale_algo = None if which == "amax" else _scale_fn
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=amax_algo, scaling_factor_compute_algo=scale_algo,
                            margin=1)
    run_and_compare(recipe, steps=7, reference_scale_algo=None if scale_algo is None else _scale_fn_ref,
                    check_every_gemm=(which == "both"))


def test_worked_example_of_the_spec():
    # SPEC section 5: L = 3, margin 1, E4M3, amaxes 2, 0, 5, 1, 1, 1
    recipe = DelayedScaling(amax_history_len=3, margin=1, fp8_format=Format.E4M3)
    amaxes = [2.0, 0.0, 5.0, 1.0, 1.0, 1.0]
    xs = [np.full((ROWS, IN), a, np.float32) for a in amaxes]
    ks = [np.full((IN, OUT), 0.5, np.float32)] * 6
    cs = [np.ones((ROWS, OUT), np.float32)] * 6
    want_h = [[0, 0, 2], [0, 0, 2], [0, 2, 5], [0, 5, 1], [0, 1, 1], [0, 1, 1]]
    want_s = [112, 112, 44.8, 44.8, 44.8, 224]
    with te.autocast(enabled=True, recipe=recipe):
        v = {"fp8_metas": init_group(recipe)}
        step = _step_fn(LAYER)
        for x, k, c, h, s in zip(xs, ks, cs, want_h, want_s):
            v = {"params": {"kernel": jnp.asarray(k)}, "fp8_metas": v["fp8_metas"]}
            _, _, _, metas = step(v, jnp.asarray(x), jnp.asarray(c))
            np.testing.assert_array_equal(metas["x_amax_history"], np.array(h, np.float32))
            assert np.float32(metas["x_scale"][0]) == np.float32(s)
            v = {"params": v["params"], "fp8_metas": metas}


def test_zero_inf_nan_inputs():
    xs, ks, cs = _inputs(6, seed=1)
    xs[1] = np.zeros_like(xs[1])  # unused slot: no roll
    xs[2][3, 4] = np.inf  # amax inf: recorded, old scale kept while in the window
    xs[3][0, :] = np.nan  # NaN ignored by the amax
    cs[4] = np.zeros_like(cs[4])  # zero gradient
    ks[5] = np.zeros_like(ks[5])
    run_and_compare(DelayedScaling(amax_history_len=3), xs=xs, ks=ks, cs=cs, check_every_gemm=False)


def test_subnormal_amaxes_are_exact():
    # XLA:CPU flushes subnormals in arithmetic; the state update must not
    xs, ks, cs = _inputs(4, seed=2)
    xs[1] = (xs[1] * np.float32(1e-40)).astype(np.float32)
    xs[2] = np.full_like(xs[2], 1e-45)
    run_and_compare(DelayedScaling(amax_history_len=3, margin=20), xs=xs, ks=ks, cs=cs, check_every_gemm=False)


def test_bf16_inputs():
    xs, ks, cs = _inputs(4, seed=3)
    xs = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) for x in xs]
    layer = LAYER
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.jit(layer.init)(jax.random.PRNGKey(0), jnp.asarray(xs[0], jnp.bfloat16))
        refl = RefLayer(recipe)
        apply = jax.jit(layer.apply)
        grad_fn = jax.jit(jax.grad(lambda vv, xb, cb: jnp.sum((layer.apply(vv, xb) * cb).astype(jnp.float32))))
        for x, k, c in zip(xs, ks, cs):
            v = {"params": {"kernel": jnp.asarray(k)}, "fp8_metas": v["fp8_metas"]}
            xb = jnp.asarray(x, jnp.bfloat16)
            cb = jnp.asarray(c, jnp.bfloat16)
            y = apply(v, xb)
            assert y.dtype == jnp.bfloat16
            grads = grad_fn(v, xb, cb)
            assert grads["params"]["kernel"].dtype == jnp.float32
            refl.step([ref.amax(x)], ref.amax(k), [ref.amax(np.asarray(cb.astype(jnp.float32)))])
            _, metas = split_grads(grads, v["fp8_metas"])
            refl.assert_matches(metas)
            v = {"params": v["params"], "fp8_metas": metas}


# ---- reuse, microbatches, unused layers ------------------------------------------------------------------------

class Twice(nn.Module):
    """One DenseGeneral applied twice: its state must get the max of both uses' amaxes, once."""

    @nn.compact
    def __call__(self, x):
        d = DenseGeneral(features=IN, use_bias=False, name="shared")
        return d(d(x))


@jax.jit
def _one_use_grads(v, x, c):
    """(y, dL/dx) of a single use with cotangent c, computed separately (same state, so the same scales)."""
    layer = DenseGeneral(features=IN, use_bias=False)
    y, vjp = jax.vjp(lambda xx: layer.apply(v, xx), x)
    return y, vjp(c)[0]


@pytest.mark.filterwarnings("ignore:fp8kit. a delayed-scaling layer is differentiated")  # _one_use_grads: dL/dx only
@pytest.mark.parametrize("how", ["submodule", "two_applies"])
def test_reuse_in_one_step_max_combines(how):
    rng = np.random.default_rng(7)
    recipe = DelayedScaling(amax_history_len=4)
    single = DenseGeneral(features=IN, use_bias=False)
    with te.autocast(enabled=True, recipe=recipe):
        x0 = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)
        if how == "submodule":
            model = Twice()
            v = jax.jit(model.init)(jax.random.PRNGKey(1), x0)
            inner = {"params": v["params"]["shared"], "fp8_metas": v["fp8_metas"]["shared"]}

            def loss(vv, x, c):
                return jnp.sum(model.apply(vv, x) * c)
        else:
            v = jax.jit(single.init)(jax.random.PRNGKey(1), x0)
            inner = v

            def loss(vv, x, c):
                return jnp.sum(single.apply(vv, single.apply(vv, x)) * c)

        refl = RefLayer(recipe)
        grad_fn = jax.jit(jax.grad(loss))
        for step, mag in enumerate([1.0, 30.0, 0.01]):
            x = jnp.asarray(rng.standard_normal((ROWS, IN)) * mag, jnp.float32)
            c = jnp.asarray(rng.standard_normal((ROWS, IN)) * (3.0 - step), jnp.float32)
            y1, _ = _one_use_grads(inner, x, c)
            _, g1 = _one_use_grads(inner, y1, c)  # dL/dy1 = the second use's dgrad
            grads = grad_fn(v, x, c)
            refl.step([ref.amax(x), ref.amax(y1)], ref.amax(inner["params"]["kernel"]), [ref.amax(c), ref.amax(g1)])
            _, metas = split_grads(grads, v["fp8_metas"])
            got = metas["shared"] if how == "submodule" else metas
            refl.assert_matches(got, what=f"step {step + 1}")
            v = {"params": v["params"], "fp8_metas": metas}
            inner = {"params": inner["params"], "fp8_metas": got}


def test_reuse_chain_in_every_kind_of_trace():
    """jit(grad), grad(jit) and eager grad chain the uses alike; finished traces are forgotten; no tracer leaks."""
    from fp8kit.jax import context

    layer = DenseGeneral(features=IN, use_bias=False)
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)

    def loss(v):
        return jnp.sum(layer.apply(v, layer.apply(v, x)) * c)

    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=2)):
        v = {"params": {"kernel": jnp.asarray(rng.standard_normal((IN, IN)), jnp.float32)},
             "fp8_metas": init_group(DelayedScaling(amax_history_len=2))}
        with jax.check_tracer_leaks(True):
            want = jax.jit(jax.grad(loss))(v)["fp8_metas"]
        got_eager = jax.grad(loss)(v)["fp8_metas"]
        got_grad_of_jit = jax.grad(jax.jit(loss))(v)["fp8_metas"]
        assert len(context.token_registry()._tables) <= 1  # the tables of the finished traces are gone
    for name, value in want.items():
        assert_bitwise(got_eager[name], value, f"eager {name}")
        assert_bitwise(got_grad_of_jit[name], value, f"grad(jit) {name}")
    assert float(want["x_amax_history"][1]) > ref.amax(np.asarray(x))  # the second use's input was larger


def test_microbatches_with_deferred_update():
    rng = np.random.default_rng(8)
    recipe = DelayedScaling(amax_history_len=3, interval=2)
    layer = DenseGeneral(features=OUT)
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.jit(layer.init)(jax.random.PRNGKey(2), jnp.ones((ROWS, IN)))
        refl = RefLayer(recipe)
        # settings are read at trace time: the decorator form is active whenever jit traces the function
        grad_fn = jax.jit(te.deferred_update()(jax.grad(_loss(layer))))
        accumulate = jax.jit(te.accumulate_grads)
        update = jax.jit(te.update_fp8_metas)  # reads the recipe of the autocast when traced
        for step in range(4):
            mbs = [(rng.standard_normal((ROWS, IN)) * m, rng.standard_normal((ROWS, OUT)) * (1 + m))
                   for m in ([0.1, 10.0, 1.0] if step % 2 else [2.0, 0.0, 0.5])]
            acc = None
            for x, c in mbs:
                acc = accumulate(acc, grad_fn(v, jnp.asarray(x, jnp.float32), jnp.asarray(c, jnp.float32)))
            params, staged = split_grads(acc)
            metas = update(staged, v["fp8_metas"])
            xs32 = [np.asarray(x, np.float32) for x, _ in mbs]
            cs32 = [np.asarray(c, np.float32) for _, c in mbs]
            refl.step([ref.amax(x) for x in xs32], ref.amax(v["params"]["kernel"]), [ref.amax(c) for c in cs32])
            refl.assert_matches(metas, what=f"step {step + 1}")
            # parameter gradients are summed
            want_bias = sum(np.sum(c, axis=0, dtype=np.float64) for c in cs32)
            np.testing.assert_allclose(params["bias"], want_bias, rtol=1e-5)
            v = {"params": v["params"], "fp8_metas": metas}


class TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x, use_second: bool):
        y = DenseGeneral(features=IN, use_bias=False, name="first")(x)
        if use_second:
            y = DenseGeneral(features=IN, use_bias=False, name="second")(y)
        return y


def test_layer_not_in_the_loss_keeps_its_state():
    recipe = DelayedScaling(amax_history_len=3)
    model = TwoLayers()
    x = jnp.asarray(np.random.default_rng(9).standard_normal((ROWS, IN)), jnp.float32)
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.jit(model.init, static_argnums=2)(jax.random.PRNGKey(3), x, True)
        grad_fn = jax.jit(jax.grad(lambda vv, second: jnp.sum(model.apply(vv, x, second))), static_argnums=1)
        grads = grad_fn(v, True)
        _, metas = split_grads(grads, v["fp8_metas"])
        v = {"params": v["params"], "fp8_metas": metas}
        before = jax.tree.map(np.asarray, metas["second"])
        grads = grad_fn(v, False)
        assert float(grads["fp8_metas"]["second"]["x_scale"][0]) == 0.0  # no cotangent ...
        _, metas = split_grads(grads, v["fp8_metas"])
        for name, value in before.items():  # ... so the old state is kept
            assert_bitwise(metas["second"][name], value, name)
        assert float(metas["first"]["x_amax_history"][1]) > 0  # the used layer rolled twice


@pytest.mark.slow
def test_scanned_layers_keep_one_state_each():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return DenseGeneral(features=IN, use_bias=False, name="dense")(x), None

    model = nn.scan(Block, variable_axes={"params": 0, "fp8_metas": 0}, split_rngs={"params": True}, length=3)()
    x = jnp.asarray(np.random.default_rng(11).standard_normal((ROWS, IN)) * 3, jnp.float32)
    recipe = DelayedScaling(amax_history_len=2)
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.jit(lambda: model.init(jax.random.PRNGKey(0), x, None))()
        grads = jax.jit(jax.grad(lambda vv: jnp.sum(model.apply(vv, x, None)[0])))(v)
        _, metas = split_grads(grads, v["fp8_metas"])
        with te.deferred_update():
            staged = jax.jit(jax.grad(lambda vv: jnp.sum(model.apply(vv, x, None)[0])))(v)["fp8_metas"]
        np.testing.assert_array_equal(np.asarray(staged["dense"]["x_amax_history"])[:, 0],
                                      np.asarray(metas["dense"]["x_amax_history"])[:, 1])
        finalized = jax.tree.map(np.asarray, te.update_fp8_metas(staged, v["fp8_metas"]))
        kernels = v["params"]["dense"]["kernel"]
        single = DenseGeneral(features=IN, use_bias=False)
        h = x
        for i in range(3):  # each layer's state saw its own input and kernel
            layer_vars = {"params": {"kernel": kernels[i]}, "fp8_metas": jax.tree.map(lambda a: a[i], v["fp8_metas"])}
            layer_vars["fp8_metas"] = layer_vars["fp8_metas"]["dense"]
            refl = RefLayer(recipe)
            refl.fwd.record(0, ref.amax(np.asarray(h)))
            refl.fwd.record(1, ref.amax(np.asarray(kernels[i])))
            refl.fwd.update()
            got = jax.tree.map(lambda a: a[i], metas["dense"])
            assert_bitwise(got["x_amax_history"], refl.fwd.history[:, 0], f"layer {i} x")
            assert_bitwise(got["kernel_amax_history"], refl.fwd.history[:, 1], f"layer {i} kernel")
            assert_bitwise(got["x_scale"], refl.fwd.scale[:1], f"layer {i} x scale")
            for name, value in got.items():
                assert_bitwise(finalized["dense"][name][i], value, f"layer {i} {name} (deferred)")
            h = jax.jit(single.apply)(layer_vars, h)
        assert float(metas["dense"]["grad_amax_history"][2, 1]) == 1.0  # d(sum)/dy of the last layer


# ---- compilation, errors ---------------------------------------------------------------------------------------

def test_one_compilation_across_steps():
    traces = []
    recipe = DelayedScaling(amax_history_len=8)
    layer = DenseGeneral(features=OUT)
    with te.autocast(enabled=True, recipe=recipe):
        x = jnp.ones((ROWS, IN))
        v = jax.jit(layer.init)(jax.random.PRNGKey(4), x)

        @jax.jit
        def train_step(v, x):
            traces.append(1)
            grads = jax.grad(lambda vv: jnp.sum(layer.apply(vv, x) ** 2))(v)
            param_grads, metas = split_grads(grads, v["fp8_metas"])
            params = jax.tree.map(lambda p, g: p - 1e-3 * g, v["params"], param_grads)
            return {"params": params, "fp8_metas": metas}

        scales = []
        for i in range(5):
            v = train_step(v, x * (i + 1))
            scales.append(float(v["fp8_metas"]["x_scale"][0]))
    assert len(traces) == 1 and train_step._cache_size() == 1
    assert scales[0] == 448.0 and scales[-1] == np.float32(448.0) / np.float32(5.0)


def test_recipe_assigned_between_steps_is_traced_again_with_its_fields():
    """Recipes are mutable: autocast reads the fields at entry (the snapshot jax.jit's cache key holds), so an
    assignment between steps retraces once and the new margin sets the next scales; a custom recipe is refused (the
    block recipes run: tests/test_jax_block.py, tests/test_jax_nvfp4.py)."""
    from fp8kit.recipe import CustomRecipe

    traces = []
    recipe = DelayedScaling(amax_history_len=8)
    layer = DenseGeneral(features=OUT)
    x = jnp.ones((ROWS, IN))
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.jit(layer.init)(jax.random.PRNGKey(4), x)
        assert te.get_recipe() == recipe and te.get_recipe() is recipe.snapshot()

    @jax.jit
    def train_step(v, x):
        traces.append(1)
        grads = jax.grad(lambda vv: jnp.sum(layer.apply(vv, x) ** 2))(v)
        return {"params": v["params"], "fp8_metas": split_grads(grads, v["fp8_metas"])[1]}

    scales = []
    for i in range(4):
        if i == 2:
            recipe.margin = 1
        with te.autocast(enabled=True, recipe=recipe):
            v = train_step(v, x * (i + 1))
        scales.append(float(v["fp8_metas"]["x_scale"][0]))
    assert len(traces) == 2  # one trace per set of fields
    # the x amax of step i is i + 1 (history max); the scale is float32(448 * 2**-margin) / amax
    assert scales == [float(ref.scaled_max(448.0, m) / np.float32(i + 1)) for i, m in enumerate((0, 0, 1, 1))]
    custom = CustomRecipe(qfactory=lambda role: None)
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        with te.autocast(enabled=True, recipe=custom):
            pass
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        te_flax.make_dot_general_cls(custom)


def test_clear_errors():
    layer = LAYER
    x = jnp.ones((2, IN))
    v = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)  # outside autocast: no fp8_metas
    assert "fp8_metas" not in v
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="initialize the layer"):
            jax.eval_shape(layer.apply, v, x)
        v = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=7)):
        with pytest.raises(ValueError, match="amax_history_len=7"):
            jax.eval_shape(layer.apply, v, x)
    with pytest.raises(ValueError, match="recipe"):
        with te.autocast(enabled=True, recipe="delayed"):
            pass
    with pytest.raises(ValueError, match="mesh_resource"):
        with te.autocast(enabled=True, mesh_resource=("dp",)):
            pass
    with pytest.raises(ValueError, match="update_fp8_metas"):
        te.update_fp8_metas({})


def test_state_saved_with_one_count_is_refused_then_upgraded():
    recipe = DelayedScaling(amax_history_len=2, interval=2)
    layer = DenseGeneral(features=OUT)
    x = jnp.ones((ROWS, IN))
    with te.autocast(enabled=True, recipe=recipe):
        v = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)
        old = {k: val for k, val in v["fp8_metas"].items() if k != "grad_update_count"}
        old["update_count"] = jnp.array([1.0])  # the rest only needs shapes
        with pytest.raises(ValueError, match="upgrade_fp8_metas"):
            jax.eval_shape(layer.apply, {"params": v["params"], "fp8_metas": old}, x)
        with pytest.raises(ValueError, match="upgrade_fp8_metas"):
            te.split_grads({"params": {}, "fp8_metas": old}, old)
        new = te.upgrade_fp8_metas({"layer": old})["layer"]
        assert new["grad_update_count"] is old["update_count"] and set(new) == set(v["fp8_metas"])
        jax.eval_shape(layer.apply, {"params": v["params"], "fp8_metas": new}, x)


def test_disabled_autocast_ignores_the_state():
    layer = DenseGeneral(features=OUT)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((ROWS, IN)), jnp.float32)
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=2)):
        v = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
    with te.autocast(enabled=False):
        y, grads = jax.jit(jax.value_and_grad(lambda vv: jnp.sum(layer.apply(vv, x) * x[:, :OUT])))(v)
        y = jax.jit(layer.apply)(v, x)
    want = np.asarray(x, np.float64) @ np.asarray(v["params"]["kernel"], np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads["fp8_metas"]))
    assert math.isfinite(float(jnp.sum(grads["params"]["kernel"])))
