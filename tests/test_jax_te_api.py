"""Transformer Engine's JAX names and signatures (issue 17), and the functional API against independent math:
activation, layernorm, dense, layernorm_dense, layernorm_mlp, update_collections, sharding."""

import dataclasses
import inspect
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.core import FrozenDict  # noqa: E402

import fp8kit.jax as te  # noqa: E402
import fp8kit.jax.flax as te_flax  # noqa: E402
from fp8kit.jax.sharding import MeshResource, global_mesh_resource, global_shard_guard  # noqa: E402
from fp8kit.recipe import Float8CurrentScaling  # noqa: E402

# Transformer Engine's parameter names, in order (transformer_engine/jax at the mirrored commit). fp8kit may append
# Flax's own keywords (param_dtype, precision) after them.
TE_FIELDS = {
    "DenseGeneral": "features kernel_init kernel_axes use_bias bias_init bias_axes enable_low_rank_adaptation "
                    "low_rank_adaptation_dim low_rank_adaptation_alpha axis dtype input_axes transpose_batch_sequence "
                    "quantization_checkpoint_name",
    "LayerNorm": "epsilon layernorm_type zero_centered_gamma scale_init scale_axes bias_init bias_axes dtype",
    "LayerNormDenseGeneral": "features enable_layernorm layernorm_type epsilon zero_centered_gamma scale_init "
                             "scale_axes ln_bias_init ln_bias_axes kernel_init kernel_axes use_bias bias_init "
                             "bias_axes return_layernorm_output enable_low_rank_adaptation low_rank_adaptation_dim "
                             "low_rank_adaptation_alpha axis dtype layernorm_input_axes dot_input_axes depth_scaling "
                             "transpose_batch_sequence quantization_checkpoint_name",
    "LayerNormMLP": "intermediate_dim enable_layernorm layernorm_type epsilon zero_centered_gamma scale_init "
                    "scale_axes ln_bias_init ln_bias_axes kernel_init kernel_axes_1 kernel_axes_2 use_bias bias_init "
                    "bias_axes_1 bias_axes_2 return_layernorm_output activations activation_params "
                    "intermediate_dropout_rng_name intermediate_dropout_rate intermediate_hidden_dropout_dims "
                    "enable_low_rank_adaptation low_rank_adaptation_dim low_rank_adaptation_alpha axis dtype "
                    "layernorm_input_axes dot_1_input_axes dot_2_input_axes ffn1_ckpt_name ffn2_ckpt_name "
                    "transpose_batch_sequence quantization_checkpoint_name",
    "DotProductAttention": "head_dim num_attention_heads num_gqa_groups attention_dropout attn_mask_type "
                           "attn_bias_type dtype dropout_rng_name float32_logits qkv_layout scale_factor "
                           "transpose_batch_sequence window_size max_segments_per_seq "
                           "context_parallel_causal_load_balanced context_parallel_axis context_parallel_strategy "
                           "context_checkpoint_name softmax_type score_mod score_mod_bprop",
    "MultiHeadAttention": "head_dim num_attention_heads num_gqa_groups attention_dropout dropout_rng_name "
                          "input_layernorm layernorm_type layernorm_epsilon return_layernorm_output "
                          "zero_centered_gamma kernel_init use_bias bias_init attn_mask_type attn_bias_type "
                          "enable_rotary_pos_emb rotary_pos_emb_windows rotary_pos_emb_group_method "
                          "low_rank_adaptation_scope low_rank_adaptation_dim low_rank_adaptation_alpha dtype "
                          "fuse_qkv_params transpose_batch_sequence enable_sequence_parallel scale_attn_logits "
                          "scaled_query_init float32_logits window_size softmax_type score_mod score_mod_bprop "
                          "num_heads dropout_rate output_layernorm apply_residual_connection_post_layernorm fuse_qkv",
    "RelativePositionBiases": "num_buckets max_distance num_attention_heads embedding_init embedding_axes dtype",
    "TransformerLayer": "hidden_size mlp_hidden_size num_attention_heads num_gqa_groups layernorm_type "
                        "layernorm_epsilon zero_centered_gamma hidden_dropout hidden_dropout_dims attention_dropout "
                        "intermediate_dropout intermediate_dropout_dims dropout_rng_name mha_kernel_init "
                        "mlp_kernel_init mlp_activations mlp_activation_params use_bias bias_init "
                        "apply_residual_connection_post_layernorm output_layernorm float32_attention_logits "
                        "layer_type self_attn_mask_type self_attn_bias_type enable_relative_embedding "
                        "relative_embedding enable_rotary_pos_emb rotary_pos_emb_windows rotary_pos_emb_group_method "
                        "low_rank_adaptation_scope low_rank_adaptation_dim low_rank_adaptation_alpha dtype drop_path "
                        "fuse_qkv_params transpose_batch_sequence enable_sequence_parallel scale_attn_logits "
                        "scaled_query_init window_size softmax_type score_mod score_mod_bprop",
}
TE_FUNCTIONS = {
    te.dense: "x kernel bias contracting_dims transpose_batch_sequence input_axes kernel_axes output_axes "
              "collective_op_set quantizer_set",
    te.layernorm_dense: "x kernel gamma beta bias norm_type zero_centered_gamma epsilon transpose_batch_sequence "
                        "layernorm_input_axes dot_input_axes kernel_axes quantizer_set",
    te.layernorm_mlp: "x gamma beta kernels biases norm_type zero_centered_gamma epsilon transpose_batch_sequence "
                      "norm_input_axes dot_1_input_axes dot_2_input_axes kernel_1_axes kernel_2_axes ffn1_ckpt_name "
                      "ffn2_ckpt_name activation_type activation_params collective_op_sets quantizer_sets",
    te.activation.activation: "x activation_type quantizer act_params",
    te.layernorm.layernorm: "x gamma beta norm_type zero_centered_gamma epsilon quantizer",
    te.autocast: "enabled recipe mesh_resource",
    te.fp8_autocast: "enabled fp8_recipe mesh_resource",
    te.update_collections: "new original",
    te_flax.wrap_function_in_te_state_module: "f quantization_recipe name quantization_checkpoint_name",
    te_flax.make_dot_general_cls: "quantization_recipe",
    te_flax.extend_logical_axis_rules: "rules",
}


@pytest.mark.parametrize("name", sorted(TE_FIELDS))
def test_flax_layers_have_te_fields_in_te_order(name):
    fields = [f.name for f in dataclasses.fields(getattr(te_flax, name)) if f.name not in ("parent", "name")]
    want = TE_FIELDS[name].split()
    assert fields[: len(want)] == want, f"{name}: {fields}"
    assert set(fields[len(want):]) <= {"param_dtype", "precision"}, fields[len(want):]


def test_functions_and_names_of_te_jax():
    for fn, names in TE_FUNCTIONS.items():
        params = [p for p in inspect.signature(fn).parameters if p != "precision"]
        assert params == names.split(), (fn.__name__, params)
    assert te.NVTE_FP8_COLLECTION_NAME == "fp8_metas"
    assert te.dense.dense is te.dense and te.layernorm_dense.layernorm_dense is te.layernorm_dense  # TE module paths
    assert te.layernorm_mlp.layernorm_mlp is te.layernorm_mlp and te.flax.DenseGeneral is te_flax.DenseGeneral
    assert te_flax.module.LayerNorm is te_flax.LayerNorm and te.sharding.MeshResource is te.MeshResource
    assert [m.value for m in te_flax.TransformerLayerType] == ["encoder", "decoder"]
    assert [f.name for f in dataclasses.fields(MeshResource)] == [
        "dp_resource", "tp_resource", "tpsp_resource", "fsdp_resource", "pp_resource", "cp_resource", "ep_resource"]
    for axis in ("BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES", "HEAD_AXES", "HIDDEN_AXES", "HIDDEN_TP_AXES",
                 "JOINED_AXES", "W_NO_SHARD_AXES", "W_FSDP_AXES", "W_TP_AXES", "W_JOINED_AXES"):
        assert getattr(te.sharding, axis).startswith("nvte_")
    with pytest.raises(NotImplementedError, match="grouped"):
        te_flax.make_grouped_dense_cls(None)


def _gelu64(v):
    return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))


def _sigmoid64(v):
    return 1 / (1 + np.exp(-v))


ACTIVATIONS = {
    ("gelu",): lambda a: _gelu64(a[0]),
    ("gelu", "linear"): lambda a: _gelu64(a[0]) * a[1],
    ("silu", "linear"): lambda a: a[0] * _sigmoid64(a[0]) * a[1],
    ("relu",): lambda a: np.maximum(a[0], 0),
    ("quick_gelu",): lambda a: a[0] * _sigmoid64(1.702 * a[0]),
    ("squared_relu", "linear"): lambda a: np.maximum(a[0], 0) ** 2 * a[1],
    ("sigmoid", "linear"): lambda a: _sigmoid64(a[0]) * a[1],
    ("clamped_silu", "clamped_linear"): lambda a: (_sigmoid64(1.702 * np.minimum(a[0], 7)) * np.minimum(a[0], 7)
                                                  * (np.clip(a[1], -7, 7) + 1)),
}


@pytest.mark.parametrize("acts", list(ACTIVATIONS), ids=["-".join(a) for a in ACTIVATIONS])
def test_activation_against_float64(acts):
    x = np.random.default_rng(0).standard_normal((3, 5, len(acts), 7)).astype(np.float32) * 4
    y = te.activation.activation(jnp.asarray(x), activation_type=acts)
    want = ACTIVATIONS[acts]([x[..., i, :].astype(np.float64) for i in range(len(acts))])
    assert y.shape == (3, 5, 7) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="activation"):
        te.activation.activation(jnp.asarray(x), activation_type=acts + ("relu",))


@pytest.mark.parametrize("kind,zero_centered", [("layernorm", False), ("rmsnorm", True)])
def test_layernorm_against_float64(kind, zero_centered):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 9, 32)) * 3 + 2).astype(np.float32)
    gamma = rng.standard_normal(32).astype(np.float32)
    beta = rng.standard_normal(32).astype(np.float32) if kind == "layernorm" else None
    y = te.layernorm.layernorm(jnp.asarray(x), jnp.asarray(gamma), None if beta is None else jnp.asarray(beta),
                               kind, zero_centered, 1e-5)
    x64 = x.astype(np.float64)
    g = gamma + (1.0 if zero_centered else 0.0)
    if kind == "layernorm":
        c = x64 - x64.mean(-1, keepdims=True)
        want = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + beta
    else:
        want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    # the module computes the same ops on the same parameters: bit for bit
    module = te_flax.LayerNorm(epsilon=1e-5, layernorm_type=kind, zero_centered_gamma=zero_centered)
    params = {"scale": jnp.asarray(gamma)} | ({} if beta is None else {"ln_bias": jnp.asarray(beta)})
    np.testing.assert_array_equal(module.apply({"params": params}, jnp.asarray(x)), y)


def test_dense_contracting_dims_and_high_precision_path():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    k = rng.standard_normal((5, 4, 6)).astype(np.float32)
    y = te.dense(jnp.asarray(x), jnp.asarray(k), contracting_dims=((1, 3), (0, 1)))
    np.testing.assert_allclose(y, np.einsum("asbc,sco->abo", x.astype(np.float64), k), rtol=1e-5, atol=1e-5)
    xb, kb = jnp.asarray(x[:, :, 0, :]).astype(jnp.bfloat16), jnp.asarray(k[:, :, 0])
    # outside autocast: the dot_general a flax layer runs, in x's dtype
    got = te.dense(xb, kb, contracting_dims=((1, 2), (0, 1)))
    want = jax.lax.dot_general(xb, kb.astype(jnp.bfloat16), (((1, 2), (0, 1)), ((), ())))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="leading axes"):
        te.dense(jnp.asarray(x), jnp.asarray(k), contracting_dims=((1,), (1,)))
    with pytest.raises(NotImplementedError, match="collective"):
        te.dense(jnp.ones((2, 3)), jnp.ones((3, 4)), collective_op_set=object())


def test_layernorm_dense_and_mlp_functions_equal_the_modules():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 6, 16)), jnp.float32)
    ldg = te_flax.LayerNormDenseGeneral(features=8, use_bias=True, bias_init=nn.initializers.normal(0.5))
    mlp = te_flax.LayerNormMLP(intermediate_dim=12, activations=("gelu", "linear"), use_bias=True,
                               bias_init=nn.initializers.normal(0.5))
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        p1, p2 = jax.jit(lambda x: (nn.unbox(ldg.init(jax.random.PRNGKey(0), x))["params"],
                                    nn.unbox(mlp.init(jax.random.PRNGKey(1), x))["params"]))(x)

        @jax.jit
        def outputs(p1, p2, x):
            y1, _ = ldg.apply({"params": p1}, x)
            f1 = te.layernorm_dense(x, p1["kernel"], p1["scale"], p1["ln_bias"], p1["bias"], epsilon=1e-6)
            y2, _ = mlp.apply({"params": p2}, x, deterministic=True)
            f2 = te.layernorm_mlp(x, p2["scale"], p2["ln_bias"], [p2["wi_kernel"], p2["wo_kernel"]],
                                  [p2["wi_bias"], p2["wo_bias"]], "layernorm", activation_type=("gelu", "linear"))
            return y1, f1, y2, f2

        y1, f1, y2, f2 = outputs(p1, p2, x)
    np.testing.assert_array_equal(f1, y1)
    np.testing.assert_array_equal(f2, y2)
    assert float(jnp.max(jnp.abs(y2))) > 0


def test_update_collections_and_mesh_resource():
    old = {"params": {"w": 1}, "fp8_metas": {"s": 1}}
    new = te.update_collections({"fp8_metas": {"s": 2}}, old)
    assert new == {"params": {"w": 1}, "fp8_metas": {"s": 2}} and isinstance(new, dict)
    assert isinstance(te.update_collections({"fp8_metas": {}}, FrozenDict(old)), FrozenDict)
    with pytest.raises(TypeError, match="original"):
        te.update_collections({}, [1])
    with pytest.raises(ValueError, match="dp_resource"):
        MeshResource(dp_resource=3)
    with pytest.raises(ValueError, match="MeshResource"):
        global_mesh_resource()
    resource = MeshResource(dp_resource="data", tp_resource="model", pp_resource="pipe")
    with global_shard_guard(resource):
        assert global_mesh_resource() is resource and resource.amax_axes == ("data", "model")
    with te.autocast(enabled=False):
        assert global_mesh_resource() == MeshResource()  # an autocast always sets one


def test_bad_arguments_are_named():
    x = jnp.ones((2, 4, 16))
    q = jnp.ones((2, 4, 2, 8))
    cases = [
        (ValueError, "attn_mask_type", lambda: te_flax.DotProductAttention(8, 2, attn_mask_type="diagonal").init(
            jax.random.PRNGKey(0), q, q, q)),
        (ValueError, "softmax_type", lambda: te_flax.DotProductAttention(8, 2, softmax_type="sparse").init(
            jax.random.PRNGKey(0), q, q, q)),
        (ValueError, "num_gqa_groups", lambda: te_flax.DotProductAttention(8, 3).init(jax.random.PRNGKey(0), q, q, q)),
        (ValueError, "norm_type", lambda: te_flax.LayerNorm(layernorm_type="batchnorm").init(jax.random.PRNGKey(0),
                                                                                               x)),
        (ValueError, "low_rank_adaptation_scope", lambda: te_flax.MultiHeadAttention(
            8, 2, low_rank_adaptation_scope="some").init(jax.random.PRNGKey(0), x, x)),
        (NotImplementedError, "decode", lambda: te_flax.MultiHeadAttention(8, 2).init(
            jax.random.PRNGKey(0), x, x, decode=True)),
        (ValueError, "layer_type", lambda: te_flax.TransformerLayer(16, 32, 2, layer_type="encoder").init(
            jax.random.PRNGKey(0), x)),
        (ValueError, "num_attention_heads", lambda: te_flax.TransformerLayer(16, 32, 3).init(jax.random.PRNGKey(0),
                                                                                              x)),
        (NotImplementedError, "quantization_checkpoint_name", lambda: te_flax.DenseGeneral(
            4, quantization_checkpoint_name="q").init(jax.random.PRNGKey(0), x)),
        (ValueError, "axis", lambda: te_flax.LayerNormDenseGeneral(4, axis=0).init(jax.random.PRNGKey(0), x)),
        (ValueError, "activation_type", lambda: te.activation.activation(jnp.ones((2, 1, 4)), ("nonsense",))),
    ]
    for error, name, fn in cases:
        with pytest.raises(error, match=name):
            jax.eval_shape(fn)
