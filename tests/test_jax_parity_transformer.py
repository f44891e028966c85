"""Cross-framework parity for a whole layer (issue 17): a few delayed-scaling training steps of a small
TransformerLayer stack in fp8kit.jax.flax and the same stack of fp8kit.pytorch.TransformerLayer holding the JAX
parameters, fed the same data, give the same outputs, gradients and FP8 states (amax histories and scales).

Configuration chosen so that both frontends compute the same function: no relative position biases, logits scaled
by 1/sqrt(head_dim) (`scale_attn_logits=True`, `scaled_query_init=False`), no dropout, biases on, GELU MLP, causal
self-attention, layer-norm epsilon 1e-6 (the JAX default; torch's is 1e-5), batch-first inputs (torch
`attn_input_format="bshd"`).

Parameters: a torch weight is the transposed JAX kernel. JAX's fused QKV kernel `[hidden, 3, heads * d]` is
`[q | k | v]` along its outputs. The torch QKV projection is run in both of its layouts: split parameters
(`query_weight`, `key_weight`, `value_weight`, one GEMM over their concatenation `[q | k | v]`) and one fused
`weight` with `qkv_weight_interleaved=True`, rows per head `[q_h | k_h | v_h]` (fp8kit/pytorch/attention/qkv.py).

FP8 states: JAX `attention/qkv` and `attention/out` x / kernel / grad <-> forward slots 0, 1 and backward slot 0 of
`self_attention.layernorm_qkv` and `self_attention.proj`; `mlp` x_0 / kernel_0 / grad_0 <-> `layernorm_mlp`
forward slots 0, 1 and backward slot 0, x_1 / kernel_1 / grad_1 <-> its forward slots 3, 4 and backward slot 2.

Tolerances, as in tests/test_jax_parity_mlp.py. Kernel slots are compared bit for bit. The other slots to 1e-6
relative: the norms, the attention core (XLA's einsums and softmax against torch's scaled_dot_product_attention)
and the GEMM sums run in each framework's float32 reduction order, so activations and gradients, and their amaxes,
may differ in the last bits (measured: at most 2.4e-7). Outputs, the input gradient and the parameter gradients
are compared to 2e-5 relative plus 2e-5 of the tensor's largest magnitude. Float32 rounding alone stays below
5e-7 of the largest magnitude here, and the first step's outputs are bit-identical (all scales are still 1). The
margin is for FP8 rounding: an operand that differs in its last bits can round to the neighbouring FP8 value. In a
variant with head size 16, one gelu output rounded to E4M3's smallest subnormal in one framework and to zero in
the other, which moved one row of the fc2 weight gradient by 5e-6 of its largest magnitude.
"""

import functools

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

if not hasattr(tet, "TransformerLayer"):
    pytest.skip("fp8kit.pytorch.TransformerLayer is not available", allow_module_level=True)

HIDDEN, HEADS, MLP, LAYERS, B, S, STEPS = 32, 4, 64, 2, 2, 8, 3
D, EPS = HIDDEN // HEADS, 1e-6
RECIPE = DelayedScaling(amax_history_len=4)
# JAX fp8_metas group -> (torch submodule, {JAX slot suffix: (forward input slot, forward weight slot,
# backward grad_output slot)})
GEMMS = {("attention", "qkv"): ("self_attention.layernorm_qkv", {"": (0, 1, 0)}),
         ("attention", "out"): ("self_attention.proj", {"": (0, 1, 0)}),
         ("mlp",): ("layernorm_mlp", {"_0": (0, 1, 0), "_1": (3, 4, 2)})}
QKV = "self_attention.layernorm_qkv."


class JaxStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = te_flax.TransformerLayer(
                hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS, hidden_dropout=0.0,
                attention_dropout=0.0, enable_relative_embedding=False, scale_attn_logits=True,
                scaled_query_init=False, use_bias=True, mlp_activations=("gelu",), self_attn_mask_type="causal",
                layernorm_epsilon=EPS, name=f"layer_{i}")(x, deterministic=True)
        return x


def _data():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((B, S, HIDDEN)).astype(np.float32) * (i + 1),
             rng.standard_normal((B, S, HIDDEN)).astype(np.float32) * (i + 1)) for i in range(STEPS)]


@functools.lru_cache(maxsize=None)
def jax_run():
    """The initial parameters, and for each of STEPS steps (parameters fixed, the loss sum(y * c)): the output,
    the parameter gradients, the input gradient and the fp8_metas after the step. Run once, shared by the cases."""
    model = JaxStack()

    def loss(variables, x, c):
        y = model.apply(variables, x)
        return jnp.sum(y * c), y

    with tej.autocast(enabled=True, recipe=RECIPE):
        variables = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((B, S, HIDDEN))))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        steps = []
        for x, c in _data():
            (_, y), (grads, dx) = step(variables, jnp.asarray(x), jnp.asarray(c))
            param_grads, metas = tej.split_grads(nn.unbox(grads), variables["fp8_metas"])
            variables = {"params": variables["params"], "fp8_metas": metas}
            steps.append(jax.tree.map(np.asarray, (y, param_grads, dx, metas)))
    return jax.tree.map(np.asarray, variables["params"]), steps


def _qkv_rows(fused_qkv):
    """The torch QKV weight's rows as indices into JAX's outputs `[q | k | v]` (kernel.reshape(HIDDEN, -1).T):
    the same order for split parameters, per head `[q_h | k_h | v_h]` for the interleaved fused weight."""
    rows = np.arange(3 * HEADS * D).reshape(3, HEADS, D)
    return (rows.transpose(1, 0, 2) if fused_qkv else rows).reshape(-1)


def _torch_params(jax_params, fused_qkv):
    """Each layer's torch parameters (name -> array) from the JAX layout: attention/qkv/{scale, ln_bias, kernel
    [HIDDEN, 3, HEADS*D], bias [3, HEADS*D]}, attention/out/{kernel [HEADS*D, HIDDEN], bias}, mlp/{scale, ln_bias,
    wi_kernel [HIDDEN, 1, MLP], wi_bias [1, MLP], wo_kernel [MLP, HIDDEN], wo_bias}."""
    rows = _qkv_rows(fused_qkv)
    layers = []
    for i in range(LAYERS):
        attention, mlp = jax_params[f"layer_{i}"]["attention"], jax_params[f"layer_{i}"]["mlp"]
        qkv, out = attention["qkv"], attention["out"]
        w, b = qkv["kernel"].reshape(HIDDEN, -1).T[rows], qkv["bias"].reshape(-1)[rows]
        p = {QKV + "layer_norm_weight": qkv["scale"], QKV + "layer_norm_bias": qkv["ln_bias"],
             "self_attention.proj.weight": out["kernel"].T, "self_attention.proj.bias": out["bias"],
             "layernorm_mlp.layer_norm_weight": mlp["scale"], "layernorm_mlp.layer_norm_bias": mlp["ln_bias"],
             "layernorm_mlp.fc1_weight": mlp["wi_kernel"][:, 0, :].T, "layernorm_mlp.fc1_bias": mlp["wi_bias"][0],
             "layernorm_mlp.fc2_weight": mlp["wo_kernel"].T, "layernorm_mlp.fc2_bias": mlp["wo_bias"]}
        if fused_qkv:
            p[QKV + "weight"], p[QKV + "bias"] = w, b
        else:
            for j, name in enumerate(("query", "key", "value")):
                part = slice(j * HEADS * D, (j + 1) * HEADS * D)
                p[f"{QKV}{name}_weight"], p[f"{QKV}{name}_bias"] = w[part], b[part]
        layers.append(p)
    return layers


def _torch_model(jax_params, fused_qkv):
    """LAYERS fp8kit.pytorch.TransformerLayer with the JAX stack's options, holding the JAX parameters."""
    model = torch.nn.Sequential(*(tet.TransformerLayer(
        HIDDEN, MLP, HEADS, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0, layer_number=i + 1,
        self_attn_mask_type="causal", bias=True, activation="gelu", attn_input_format="bshd",
        fuse_qkv_params=fused_qkv, qkv_weight_interleaved=True) for i in range(LAYERS)))
    for layer, params in zip(model, _torch_params(jax_params, fused_qkv)):
        named = dict(layer.named_parameters())
        assert named.keys() == params.keys(), sorted(named.keys() ^ params.keys())
        with torch.no_grad():
            for name, value in params.items():
                assert named[name].shape == value.shape, (name, named[name].shape, value.shape)
                named[name].copy_(torch.from_numpy(np.array(value)))
    return model


def _torch_grads(model, fused_qkv):
    """The torch parameter gradients in the JAX layout (the inverse of _torch_params)."""
    back = np.argsort(_qkv_rows(fused_qkv))
    out = {}
    for i, layer in enumerate(model):
        g = {name: p.grad.numpy() for name, p in layer.named_parameters()}
        parts = ("",) if fused_qkv else ("query_", "key_", "value_")
        w = np.concatenate([g[f"{QKV}{part}weight"] for part in parts])[back]
        b = np.concatenate([g[f"{QKV}{part}bias"] for part in parts])[back]
        out[f"layer_{i}"] = {
            "attention": {
                "qkv": {"scale": g[QKV + "layer_norm_weight"], "ln_bias": g[QKV + "layer_norm_bias"],
                        "kernel": w.T.reshape(HIDDEN, 3, HEADS * D), "bias": b.reshape(3, HEADS * D)},
                "out": {"kernel": g["self_attention.proj.weight"].T, "bias": g["self_attention.proj.bias"]}},
            "mlp": {"scale": g["layernorm_mlp.layer_norm_weight"], "ln_bias": g["layernorm_mlp.layer_norm_bias"],
                    "wi_kernel": g["layernorm_mlp.fc1_weight"].T[:, None, :],
                    "wi_bias": g["layernorm_mlp.fc1_bias"][None], "wo_kernel": g["layernorm_mlp.fc2_weight"].T,
                    "wo_bias": g["layernorm_mlp.fc2_bias"]}}
    return out


def _torch_states(model):
    """The torch FP8 states in the JAX fp8_metas layout: for each GEMM (qkv, out, mlp _0, mlp _1) x from its
    forward input slot, kernel from its forward weight slot, grad from its backward grad_output slot (GEMMS)."""
    out = {}
    for i, layer in enumerate(model):
        modules = dict(layer.named_modules())
        for path, (module, slots) in GEMMS.items():
            fwd, bwd = modules[module].fp8_meta["scaling_fwd"], modules[module].fp8_meta["scaling_bwd"]
            group = out.setdefault(f"layer_{i}", {})
            for key in path:
                group = group.setdefault(key, {})
            for suffix, (x_slot, kernel_slot, grad_slot) in slots.items():
                for name, state, slot in (("x", fwd, x_slot), ("kernel", fwd, kernel_slot), ("grad", bwd, grad_slot)):
                    group[f"{name}{suffix}_amax_history"] = state.amax_history[:, slot].detach().numpy().copy()
                    group[f"{name}{suffix}_scale"] = state.scale[slot:slot + 1].detach().numpy().copy()
    return out


def _flat(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf, np.float32)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()), err_msg=what)


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["split-qkv", "fused-interleaved-qkv"])
def test_transformer_stack_matches_pytorch(fused_qkv):
    params, want = jax_run()
    # the JAX states move: every GEMM's states record every step, all scales leave 1 after the first step, and
    # the gradient scales (the loss grows with the step) change at every later one
    metas = [_flat(step[3]) for step in want]
    assert len(metas[0]) == LAYERS * 4 * 3 * 2
    for step, (before, after) in enumerate(zip([None] + metas, metas)):
        for name, value in after.items():
            if name.endswith("amax_history']"):
                assert np.count_nonzero(value) == min(step + 1, RECIPE.amax_history_len), (step, name)
            elif step == 0:
                assert value != 1, name
            elif "grad" in name:
                assert value != before[name], (step, name)

    model = _torch_model(params, fused_qkv)
    for step, ((x, c), (y_j, grads_j, dx_j, metas_j)) in enumerate(zip(_data(), want)):
        x_t = torch.from_numpy(x).requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with tet.autocast(enabled=True, recipe=RECIPE):
            y_t = model(x_t)
        (y_t * torch.from_numpy(c)).sum().backward()
        _close(y_t.detach().numpy(), y_j, f"step {step} output")
        _close(x_t.grad.numpy(), dx_j, f"step {step} input gradient")
        got, exp = _flat(_torch_grads(model, fused_qkv)), _flat(grads_j)
        assert got.keys() == exp.keys(), sorted(got.keys() ^ exp.keys())
        for name in exp:
            _close(got[name], exp[name], f"step {step} gradient {name}")
        got, exp = _flat(_torch_states(model)), _flat(metas_j)
        assert got.keys() == exp.keys(), sorted(got.keys() ^ exp.keys())
        for name in exp:
            g, w = got[name], exp[name]
            if "kernel" in name:
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (step, name, g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"step {step} {name}")
