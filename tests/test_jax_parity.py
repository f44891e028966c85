"""Cross-framework parity: the same recipe and inputs through fp8kit.pytorch.Linear and fp8kit.jax.flax.DenseGeneral
give bit-identical amax histories and scales, and outputs and gradients within float tolerance.

Slots: JAX x <-> torch forward slot 0 (input), kernel <-> forward slot 1 (weight), grad <-> backward slot 0
(grad_output). The flax kernel is [in, out] = weight.T.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as tej  # noqa: E402
import fp8kit.pytorch as tet  # noqa: E402
from fp8kit.jax.flax import DenseGeneral  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

if not hasattr(tet, "Linear"):
    pytest.skip("fp8kit.pytorch.Linear is not available yet", allow_module_level=True)

IN, OUT, ROWS = 32, 16, 24
MAGNITUDES = [(1.0, 0.1, 1.0), (1e-2, 0.5, 300.0), (50.0, 0.02, 1e-3), (0.0, 0.3, 1.0), (3.0, 3.0, 0.0),
              (7.0, 0.05, 2.0)]


def _np(t: "torch.Tensor") -> np.ndarray:
    return t.detach().cpu().float().numpy()


def _bits_equal(got, want, what):
    got = np.ascontiguousarray(np.asarray(got, np.float32))
    want = np.ascontiguousarray(np.asarray(want, np.float32))
    assert got.shape == want.shape, f"{what}: shapes {got.shape} vs {want.shape}"
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{what}: jax {got} vs torch {want}"


def _close(jax_value, torch_value, bound, what, rel):
    got = np.asarray(jnp.asarray(jax_value).astype(jnp.float32), np.float64)
    want = _np(torch_value).astype(np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want)
    assert np.all(err <= rel * bound + 1e-30), f"{what}: max excess {np.max(err - rel * bound)}"


RECIPES = [
    DelayedScaling(amax_history_len=4, margin=1),
    DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
    DelayedScaling(amax_history_len=3, interval=2, fp8_format=Format.E4M3),
    DelayedScaling(amax_history_len=5, power_2_scale=True),
    DelayedScaling(amax_history_len=3, margin=5.0),
    DelayedScaling(amax_history_len=2, margin=2.5, interval=3),
    Float8CurrentScaling(),
]


IDS = ["delayed", "most-recent-L1", "interval-e4m3", "pow2", "margin-5.0", "margin-2.5-interval3", "current"]
# interval counts the updates each state takes part in (MAGNITUDES has a zero x and a zero gradient): the same
# steps recompute the scales in both frontends; real margins give the same float32 scaled maxima
FAST = {("delayed", "float32"), ("current", "bfloat16"), ("margin-2.5-interval3", "bfloat16")}
CASES = [pytest.param(r, d, id=f"{i}-{d}", marks=() if (i, d) in FAST else pytest.mark.slow)
         for r, i in zip(RECIPES, IDS) for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("recipe,dtype", CASES)
def test_linear_and_dense_general_agree(recipe, dtype):
    torch_dtype = getattr(torch, dtype)
    jax_dtype = getattr(jnp, dtype)
    rng = np.random.default_rng(0)
    torch_layer = tet.Linear(IN, OUT, bias=True, params_dtype=torch_dtype)
    jax_layer = DenseGeneral(features=OUT, dtype=jax_dtype)
    delayed = isinstance(recipe, DelayedScaling)

    def loss(variables, x, c):
        y = jax_layer.apply(variables, x)
        return jnp.sum((y * c).astype(jnp.float32)), y

    with tej.autocast(enabled=True, recipe=recipe):
        variables = jax.jit(jax_layer.init)(jax.random.PRNGKey(0), jnp.zeros((ROWS, IN), jax_dtype))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    fp8_metas = variables.get("fp8_metas", {})

    for i, (xm, wm, cm) in enumerate(MAGNITUDES):
        # the same values in both frameworks, rounded to the layer dtype once
        x = torch.from_numpy((rng.standard_normal((ROWS, IN)) * xm).astype(np.float32)).to(torch_dtype)
        w = torch.from_numpy((rng.standard_normal((OUT, IN)) * wm).astype(np.float32)).to(torch_dtype)
        b = torch.from_numpy(rng.standard_normal(OUT).astype(np.float32)).to(torch_dtype)
        c = torch.from_numpy((rng.standard_normal((ROWS, OUT)) * cm).astype(np.float32)).to(torch_dtype)
        with torch.no_grad():
            torch_layer.weight.copy_(w)
            torch_layer.bias.copy_(b)
        torch_layer.zero_grad(set_to_none=True)
        x_t = x.clone().requires_grad_(True)
        with tet.autocast(enabled=True, recipe=recipe):
            y_t = torch_layer(x_t)
        (y_t.float() * c.float()).sum().backward()

        to_jax = lambda t: jnp.asarray(_np(t)).astype(jax_dtype)  # noqa: E731
        variables = {"params": {"kernel": to_jax(w).T, "bias": to_jax(b)}, "fp8_metas": fp8_metas}
        with tej.autocast(enabled=True, recipe=recipe):
            (_, y_j), (grads, dx_j) = step(variables, to_jax(x), to_jax(c))
        _, fp8_metas = tej.split_grads(grads, fp8_metas if delayed else None)

        what = f"step {i + 1}"
        rel = 1e-5 if dtype == "float32" else 2.0**-7
        xa, wa, ca = np.abs(_np(x)).astype(np.float64), np.abs(_np(w)).astype(np.float64), np.abs(_np(c))
        _close(y_j, y_t, 2 * (xa @ wa.T + np.abs(_np(b))), f"{what} y", rel)
        _close(dx_j, x_t.grad, 2 * (ca @ wa), f"{what} dx", rel)
        _close(grads["params"]["kernel"].T, torch_layer.weight.grad, 2 * (ca.T @ xa), f"{what} dW", max(rel, 1e-5))
        _close(grads["params"]["bias"], torch_layer.bias.grad, np.abs(ca).sum(0) + 1e-6, f"{what} db", max(rel, 1e-5))
        if not delayed:
            continue
        fwd, bwd = torch_layer.fp8_meta["scaling_fwd"], torch_layer.fp8_meta["scaling_bwd"]
        _bits_equal(fp8_metas["x_amax_history"], _np(fwd.amax_history)[:, 0], f"{what} input history")
        _bits_equal(fp8_metas["kernel_amax_history"], _np(fwd.amax_history)[:, 1], f"{what} weight history")
        _bits_equal(fp8_metas["grad_amax_history"], _np(bwd.amax_history)[:, 0], f"{what} grad_output history")
        _bits_equal(fp8_metas["x_scale"], _np(fwd.scale)[0:1], f"{what} input scale")
        _bits_equal(fp8_metas["kernel_scale"], _np(fwd.scale)[1:2], f"{what} weight scale")
        _bits_equal(fp8_metas["grad_scale"], _np(bwd.scale)[0:1], f"{what} grad_output scale")
