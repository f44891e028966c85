"""Cross-framework parity for a whole layer: a few delayed-scaling training steps of a small TransformerLayer stack
give fp8_metas identical to the same model built from fp8kit.pytorch modules fed the same data (issue 17).

The JAX half is complete. The PyTorch half waits for `fp8kit.pytorch.TransformerLayer`: until it exists the test
skips; once it exists, `_torch_model` and `_torch_states` below must map parameters and states (marked TODO) and
the test runs. Configuration chosen so that both frontends compute the same function: no relative position biases,
logits scaled by 1/sqrt(head_dim) (`scale_attn_logits=True`, `scaled_query_init=False`), no dropout, biases on,
GELU MLP, causal self-attention.

Kernel slots are compared bit for bit; the others to 1e-6 relative: the norms, the softmax and the GEMM sums run in
each framework's float32 reduction order, so activations (and their amaxes) may differ in the last bit
(tests/test_jax_parity_mlp.py measures this for LayerNormMLP: kernels bit-identical, the rest within 1e-6).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as tej  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
import fp8kit.pytorch as tet  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

HIDDEN, HEADS, MLP, LAYERS, B, S, STEPS = 32, 4, 64, 2, 2, 8, 3
RECIPE = DelayedScaling(amax_history_len=4)


class JaxStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = te_flax.TransformerLayer(
                hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS, hidden_dropout=0.0,
                attention_dropout=0.0, enable_relative_embedding=False, scale_attn_logits=True,
                scaled_query_init=False, use_bias=True, mlp_activations=("gelu",), self_attn_mask_type="causal",
                name=f"layer_{i}")(x, deterministic=True)
        return x


def _data():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((B, S, HIDDEN)).astype(np.float32) * (i + 1),
             rng.standard_normal((B, S, HIDDEN)).astype(np.float32)) for i in range(STEPS)]


def jax_states():
    """fp8_metas after each of STEPS steps (parameters fixed, the loss sum(y * c))."""
    model = JaxStack()
    with tej.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((B, S, HIDDEN)))
        grad = jax.jit(jax.grad(lambda v, x, c: jnp.sum(model.apply(v, x) * c)))
        states = []
        for x, c in _data():
            _, metas = tej.split_grads(grad(variables, jnp.asarray(x), jnp.asarray(c)), variables["fp8_metas"])
            variables = {"params": variables["params"], "fp8_metas": metas}
            states.append(jax.tree.map(np.asarray, metas))
    return nn.unbox(variables)["params"], states


def _torch_model(jax_params):  # pragma: no cover - waits for fp8kit.pytorch.TransformerLayer
    """TODO(lead): build LAYERS fp8kit.pytorch.TransformerLayer(HIDDEN, MLP, HEADS, ...) with the same options and
    copy the JAX parameters in. JAX layout (per layer): attention/qkv/{scale, ln_bias, kernel [HIDDEN, 3, HEADS*D],
    bias [3, HEADS*D]}, attention/out/{kernel [HEADS*D, HIDDEN], bias}, mlp/{scale, ln_bias, wi_kernel [HIDDEN, 1,
    MLP], wi_bias [1, MLP], wo_kernel [MLP, HIDDEN], wo_bias}. A torch weight is the transposed kernel; mind how
    the torch layer orders the fused q/k/v rows (per head or per projection)."""
    raise NotImplementedError


def _torch_states(model):  # pragma: no cover - waits for fp8kit.pytorch.TransformerLayer
    """TODO(lead): the torch states in the JAX layout: for each GEMM (qkv, out, mlp _0, mlp _1) x from forward slot
    0 (input), kernel from forward slot 1 (weight), grad from backward slot 0 (grad_output); see
    tests/test_jax_parity.py for one Linear."""
    raise NotImplementedError


@pytest.mark.slow
def test_jax_half_runs():
    """The JAX half on its own (until the PyTorch half exists): every GEMM of both layers took part in every step,
    and the scales are the SPEC rule on their histories."""
    _, states = jax_states()
    histories = [h for h in jax.tree.leaves(states[-1]) if h.shape == (RECIPE.amax_history_len,)]
    assert len(histories) == LAYERS * 4 * 3 and all(np.count_nonzero(h) == STEPS for h in histories)
    layer = states[-1]["layer_1"]["attention"]["qkv"]
    assert np.float32(layer["kernel_scale"][0]) == np.float32(448.0) / np.max(layer["kernel_amax_history"])


def test_transformer_stack_matches_pytorch():
    if not hasattr(tet, "TransformerLayer"):
        pytest.skip("fp8kit.pytorch.TransformerLayer does not exist yet; the PyTorch half of this parity test "
                    "(parameter and state mapping) is written once it does")
    params, want = jax_states()
    model = _torch_model(params)
    for step, (x, c) in enumerate(_data()):
        x_t = torch.from_numpy(x).requires_grad_(True)
        with tet.autocast(enabled=True, recipe=RECIPE):
            y = model(x_t)
        (y * torch.from_numpy(c)).sum().backward()
        got = _torch_states(model)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want[step])):
            g, name = np.asarray(g, np.float32), jax.tree_util.keystr(path)
            if "kernel" in name:
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (step, name, g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"step {step} {name}")
