"""Transformer Engine's JAX "Getting Started" guide, step by step, with fp8kit: the imports are renamed and the
sizes shrunk so that it runs on a CPU; every model and call is the guide's.

    transformer_engine.jax             -> fp8kit.jax
    transformer_engine.jax.flax        -> fp8kit.jax.flax
    transformer_engine.jax.sharding    -> fp8kit.jax.sharding
    transformer_engine.common.recipe   -> fp8kit.recipe
    getting_started_utils_jax          -> te_jax_getting_started_utils

Steps: a plain Flax decoder layer; the same with fp8kit's DenseGeneral, LayerNorm and activation; with
DotProductAttention; in FP8 (delayed scaling); with the fused LayerNormDenseGeneral / LayerNormMLP; and
TransformerLayer. Each step prints its mean forward + backward time; a CSV summary is written to the current
directory. (CPU times say nothing about GPU speed-ups: on a CPU the FP8 GEMMs are emulated.)
"""

import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn

import fp8kit.jax as te
import fp8kit.jax.flax as te_flax
from fp8kit.jax.sharding import MeshResource
from fp8kit.recipe import DelayedScaling, Format

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from te_jax_getting_started_utils import speedometer  # noqa: E402

hidden_size = 64  # the guide: 4096
sequence_length = 32  # 2048
batch_size = 2  # 8
ffn_hidden_size = 256  # 16384
num_attention_heads = 4  # 32
dtype = jnp.bfloat16

key = jax.random.PRNGKey(42)
x = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)
mesh_resource = MeshResource()


# ---- step 1: plain Flax -----------------------------------------------------------------------------------------

class FlaxMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True)(x)
        x = nn.gelu(x, approximate=True)
        return nn.Dense(features=self.hidden_size, use_bias=True)(x)


def self_attention_block(x, attention_mask, deterministic, module, dense_cls, norm_cls, heads, dropout):
    """LayerNorm, fused QKV projection, flax attention, output projection (the guide's unfused attention)."""
    kv_channels = x.shape[-1] // heads
    h = norm_cls(x)
    qkv = dense_cls(features=3 * x.shape[-1], use_bias=True)(h)
    qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], heads, 3 * kv_channels)
    q, k, v = jnp.split(qkv, 3, axis=3)
    dropout_rng = None if deterministic or dropout == 0 else module.make_rng("dropout")
    h = nn.dot_product_attention(query=q, key=k, value=v, mask=attention_mask, dropout_rng=dropout_rng,
                                 dropout_rate=dropout, deterministic=deterministic, broadcast_dropout=True)
    h = h.reshape(h.shape[0], h.shape[1], x.shape[-1])
    h = dense_cls(features=x.shape[-1], use_bias=True)(h)
    return nn.Dropout(rate=dropout)(h, deterministic=deterministic)


class FlaxTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        x = x + self_attention_block(x, attention_mask, deterministic, self, nn.Dense,
                                     nn.LayerNorm(epsilon=self.layernorm_eps), self.num_attention_heads,
                                     self.attention_dropout)
        h = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        return x + FlaxMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size)(h)


# ---- step 2: fp8kit's DenseGeneral, LayerNorm and activation -------------------------------------------------------

class TEUnfusedMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x, deterministic: bool):
        x = te_flax.DenseGeneral(features=self.ffn_hidden_size, use_bias=True)(x)
        x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
        x = te.activation.activation(x, activation_type=("gelu",))
        return te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)


class TEUnfusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        x = x + self_attention_block(x, attention_mask, deterministic, self, te_flax.DenseGeneral,
                                     te_flax.LayerNorm(epsilon=self.layernorm_eps), self.num_attention_heads,
                                     self.attention_dropout)
        h = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)
        h = TEUnfusedMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size)(h, deterministic)
        return x + nn.Dropout(rate=self.attention_dropout)(h, deterministic=deterministic)


# ---- step 3: and fp8kit's DotProductAttention (steps 4 and 5 add FP8) -----------------------------------------------

class TEUnfusedAttnTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        kv_channels = self.hidden_size // self.num_attention_heads
        h = te_flax.LayerNorm(epsilon=self.layernorm_eps, dtype=jnp.bfloat16)(x)
        qkv = te_flax.DenseGeneral(features=3 * self.hidden_size, use_bias=True, dtype=jnp.bfloat16)(h)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)
        h = te_flax.DotProductAttention(head_dim=kv_channels, num_attention_heads=self.num_attention_heads,
                                        num_gqa_groups=self.num_attention_heads,
                                        attention_dropout=self.attention_dropout, attn_mask_type="causal",
                                        transpose_batch_sequence=False)(q, k, v, deterministic=deterministic)
        h = h.reshape((h.shape[0], h.shape[1], h.shape[2] * h.shape[3]))
        h = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True, dtype=jnp.bfloat16)(h)
        x = x + nn.Dropout(rate=self.attention_dropout)(h, deterministic=deterministic)
        h = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)
        h = TEUnfusedMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size)(h, deterministic)
        return x + nn.Dropout(rate=self.attention_dropout)(h, deterministic=deterministic)


# ---- step 5: fused LayerNormDenseGeneral and LayerNormMLP -----------------------------------------------------------

class TEFusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        kv_channels = self.hidden_size // self.num_attention_heads
        qkv, _ = te_flax.LayerNormDenseGeneral(features=3 * self.hidden_size, epsilon=self.layernorm_eps,
                                               use_bias=True, return_layernorm_output=False)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], 3, self.num_attention_heads, kv_channels)
        q, k, v = qkv[:, :, 0, :, :], qkv[:, :, 1, :, :], qkv[:, :, 2, :, :]
        h = te_flax.DotProductAttention(head_dim=kv_channels, num_attention_heads=self.num_attention_heads,
                                        num_gqa_groups=self.num_attention_heads,
                                        attention_dropout=self.attention_dropout, attn_mask_type="causal",
                                        qkv_layout="bshd_bshd_bshd", transpose_batch_sequence=False)(
            q, k, v, deterministic=deterministic)
        h = h.reshape((h.shape[0], h.shape[1], h.shape[2] * h.shape[3]))
        h = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(h)
        x = x + nn.Dropout(rate=self.attention_dropout)(h, deterministic=deterministic)
        h, _ = te_flax.LayerNormMLP(intermediate_dim=self.ffn_hidden_size, epsilon=self.layernorm_eps, use_bias=True,
                                    activations=("gelu",), intermediate_dropout_rate=0.0,
                                    return_layernorm_output=False)(x, deterministic=deterministic)
        return x + nn.Dropout(rate=self.attention_dropout)(h, deterministic=deterministic)


sizes = dict(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_attention_heads=num_attention_heads)
forward = {"deterministic": True}
times = {}

baseline = FlaxTransformerLayer(**sizes)
params = baseline.init(key, x, deterministic=False)
times["Baseline Flax"] = speedometer(baseline.apply, params, x, forward_kwargs=forward, label="baseline")

te_unfused = TEUnfusedTransformerLayer(**sizes)
params = te_unfused.init(key, x, deterministic=False)
times["TE Unfused"] = speedometer(te_unfused.apply, params, x, forward_kwargs=forward, label="te_unfused")

te_unfused_attn = TEUnfusedAttnTransformerLayer(**sizes)
with te.autocast(enabled=False, mesh_resource=mesh_resource):
    params = te_unfused_attn.init(key, x, deterministic=False)
times["TE Unfused + TE Attention"] = speedometer(
    te_unfused_attn.apply, params, x, forward_kwargs=forward,
    autocast_kwargs={"enabled": False, "mesh_resource": mesh_resource}, label="te_unfused_attn")

recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
fp8 = {"enabled": True, "recipe": recipe, "mesh_resource": mesh_resource}

te_unfused_fp8 = TEUnfusedAttnTransformerLayer(**sizes)
with te.autocast(**fp8):
    params = te_unfused_fp8.init(key, x, deterministic=False)
times["TE Unfused + TE Attention + FP8"] = speedometer(te_unfused_fp8.apply, params, x, forward_kwargs=forward,
                                                       autocast_kwargs=fp8, label="te_unfused_fp8")

te_fused_fp8 = TEFusedTransformerLayer(**sizes)
with te.autocast(**fp8):
    params = te_fused_fp8.init(key, x, deterministic=False)
times["TE Fused + TE Attention + FP8"] = speedometer(te_fused_fp8.apply, params, x, forward_kwargs=forward,
                                                     autocast_kwargs=fp8, label="te_fused_fp8")

te_transformer_layer = te_flax.TransformerLayer(
    hidden_size=hidden_size, mlp_hidden_size=ffn_hidden_size, num_attention_heads=num_attention_heads,
    mlp_activations=("gelu",), self_attn_mask_type="causal", layernorm_epsilon=1e-5, use_bias=True,
    attention_dropout=0.0, intermediate_dropout=0.0, hidden_dropout=0.0, enable_relative_embedding=False,
    self_attn_bias_type="no_bias", dtype=jnp.bfloat16, transpose_batch_sequence=False)
with te.autocast(**fp8):
    params = te_transformer_layer.init(key, x, deterministic=False)
times["TE TransformerLayer + FP8"] = speedometer(te_transformer_layer.apply, params, x, forward_kwargs=forward,
                                                 autocast_kwargs=fp8, label="te_transformer_layer")

with open("getting_started_jax_summary.csv", "w") as f:
    f.write("Implementation,Time (ms),Speedup\n")
    for name, ms in times.items():
        f.write(f"{name},{ms:.2f},{times['Baseline Flax'] / ms:.2f}x\n")
print("Summary written to getting_started_jax_summary.csv")

# not in the guide: how far the FP8 TransformerLayer is from the same layer in high precision
with te.autocast(**fp8):
    y_fp8 = jax.jit(lambda p: te_transformer_layer.apply(p, x, deterministic=True))(params)
y_high = jax.jit(lambda p: te_transformer_layer.apply(p, x, deterministic=True))(params)
difference = jnp.linalg.norm((y_fp8 - y_high).astype(jnp.float32)) / jnp.linalg.norm(y_high.astype(jnp.float32))
print(f"TransformerLayer FP8 vs high precision: relative difference {float(difference):.4f}")
