"""Cross-framework parity for a whole multi-GEMM layer: fp8kit.pytorch.LayerNormMLP and fp8kit.jax.flax.LayerNormMLP
with the same weights and data, several delayed-scaling steps (plain and gated GELU).

Slots: JAX x_0 / kernel_0 / grad_0 (wi) <-> torch forward slots 0, 1 and backward slot 0 (fc1); x_1 / kernel_1 /
grad_1 (wo) <-> forward slots 3, 4 and backward slot 2 (fc2). A torch weight is the transposed kernel; fc1's rows
[i * ffn, (i + 1) * ffn) are JAX's activation slice i (wi_kernel[:, i, :]).

The kernels' amaxes and everything derived from them are bit-identical. The norm runs in each framework's float32
reduction order, so the norm output (fc1's input) and what follows may differ in the last bit: those histories and
scales are compared to 1e-6 relative.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as tej  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
import fp8kit.pytorch as tet  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

if not hasattr(tet, "LayerNormMLP"):
    pytest.skip("fp8kit.pytorch.LayerNormMLP is not available", allow_module_level=True)

HIDDEN, FFN, ROWS, STEPS = 32, 48, 24, 4
RECIPE = DelayedScaling(amax_history_len=3)
SLOTS = {"x_0": ("fwd", 0), "kernel_0": ("fwd", 1), "grad_0": ("bwd", 0),
         "x_1": ("fwd", 3), "kernel_1": ("fwd", 4), "grad_1": ("bwd", 2)}


def _np(t):
    return t.detach().cpu().float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("activation,acts", [("gelu", ("gelu",)), ("geglu", ("gelu", "linear"))])
def test_layernorm_mlp_matches_pytorch(activation, acts):
    torch.manual_seed(0)
    torch_layer = tet.LayerNormMLP(HIDDEN, FFN, eps=1e-5, activation=activation, bias=True)
    jax_layer = te_flax.LayerNormMLP(intermediate_dim=FFN, epsilon=1e-5, activations=acts, use_bias=True)
    n = len(acts)
    fc1_w, fc2_w = _np(torch_layer.fc1_weight), _np(torch_layer.fc2_weight)
    params = {"scale": _np(torch_layer.layer_norm_weight), "ln_bias": _np(torch_layer.layer_norm_bias),
              "wi_kernel": fc1_w.reshape(n, FFN, HIDDEN).transpose(2, 0, 1), "wo_kernel": fc2_w.T,
              "wi_bias": _np(torch_layer.fc1_bias).reshape(n, FFN), "wo_bias": _np(torch_layer.fc2_bias)}
    params = {k: jnp.asarray(v) for k, v in params.items()}

    def loss(variables, x, c):
        y, _ = jax_layer.apply(variables, x, deterministic=True)
        return jnp.sum(y * c), y

    with tej.autocast(enabled=True, recipe=RECIPE):
        fp8_metas = jax.jit(jax_layer.init)(jax.random.PRNGKey(0), jnp.zeros((ROWS, HIDDEN)))["fp8_metas"]
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    rng = np.random.default_rng(1)
    for i in range(STEPS):
        x = (rng.standard_normal((ROWS, HIDDEN)) * (i + 1)).astype(np.float32)
        c = (rng.standard_normal((ROWS, HIDDEN)) / (i + 1)).astype(np.float32)
        x_t = torch.from_numpy(x).requires_grad_(True)
        with tet.autocast(enabled=True, recipe=RECIPE):
            y_t = torch_layer(x_t)
        (y_t * torch.from_numpy(c)).sum().backward()
        with tej.autocast(enabled=True, recipe=RECIPE):
            (_, y_j), grads = step({"params": params, "fp8_metas": fp8_metas}, jnp.asarray(x), jnp.asarray(c))
        _, fp8_metas = tej.split_grads(grads, fp8_metas)
        np.testing.assert_allclose(y_j, _np(y_t), rtol=2e-5, atol=2e-5 * float(np.abs(_np(y_t)).max()))
        for name, (side, slot) in SLOTS.items():
            state = torch_layer.fp8_meta["scaling_fwd" if side == "fwd" else "scaling_bwd"]
            for field, want in (("amax_history", _np(state.amax_history)[:, slot]),
                                ("scale", _np(state.scale)[slot:slot + 1])):
                got = np.asarray(fp8_metas[f"{name}_{field}"], np.float32)
                what = f"step {i + 1} {name}_{field}"
                if name.startswith("kernel"):
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (what, got, want)
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=what)
