"""Transformer Engine's quickstart tutorial ("Getting Started"), ported to fp8kit.

Ported from docs/examples/quickstart.ipynb of NVIDIA/TransformerEngine at commit c90a921 (the notebook's last
version: TE replaced it with docs/getting_started/ in a976740), all its cells, with their helpers in
te_quickstart_utils.py. Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES, Apache License 2.0.

Changes from the notebook: `transformer_engine.pytorch` -> `fp8kit.pytorch`, `transformer_engine.common.recipe` ->
`fp8kit.recipe`; CPU instead of CUDA, with smaller sizes so that it runs in seconds; the notebook's markdown cells
as short comments; lines marked "fp8kit addition" compare the layers' outputs. Cell 24 passes the recipe as
`recipe=`: the notebook's `te.autocast(..., fp8_recipe=...)` is a TypeError in Transformer Engine too (the keyword
belongs to the older `te.fp8_autocast`).

The "Mean time" lines are CPU times of emulated FP8 and of CPU float16 GEMMs: they say nothing about GPU speed.

Run: python examples/te_quickstart.py   (cells start at "# %%", as in Jupyter's percent format)
"""
# ruff: noqa: E402, I001  (the notebook's imports stay in the cells where it has them)

# %% [cell 1] Let's build a Transformer layer! (plain PyTorch; helpers in te_quickstart_utils.py)
import torch
import te_quickstart_utils as utils

class BasicTransformerLayer(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        layernorm_eps: int = 1e-5,
        attention_dropout: float = 0.1,
        hidden_dropout: float = 0.1,
    ):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = torch.nn.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = utils.BasicMLP(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
        )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor
    ) -> torch.Tensor:
        res = x
        x = self.ln1(x)

        # Fused QKV projection
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln2(x)
        x = self.mlp(x)

        return x + res

# %% [cell 3] Layer configuration (the notebook: 4096, 2048, 4, 16384, 32 on a GPU)
hidden_size = 64
sequence_length = 32
batch_size = 2
ffn_hidden_size = 256
num_attention_heads = 4
dtype = torch.float16

# Synthetic data
x = torch.rand(sequence_length, batch_size, hidden_size).cpu().to(dtype=dtype)
dy = torch.rand(sequence_length, batch_size, hidden_size).cpu().to(dtype=dtype)

# %% [cell 4]
basic_transformer = BasicTransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
)
basic_transformer.to(dtype=dtype).cpu()

# %% [cell 5]
torch.manual_seed(1234)
y = basic_transformer(x, attention_mask=None)
y_basic = y  # fp8kit addition

# %% [cell 6]
utils.speedometer(
    basic_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)

# %% [cell 8] Meet Transformer Engine: its simplest modules, Linear and LayerNorm
import fp8kit.pytorch as te

# %% [cell 10]
class BasicTEMLP(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int) -> None:
        super().__init__()
        self.linear1 = te.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = te.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        x = self.linear1(x)
        x = torch.nn.functional.gelu(x, approximate='tanh')
        x = self.linear2(x)
        return x

class BasicTETransformerLayer(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int,
                 num_attention_heads: int,
                 layernorm_eps: int = 1e-5,
                 attention_dropout: float = 0.1,
                 hidden_dropout: float = 0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = te.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = BasicTEMLP(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
        )

    def forward(self,
                x: torch.Tensor,
                attention_mask: torch.Tensor):
        res = x
        x = self.ln1(x)

        # Fused QKV projection
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln2(x)
        x = self.mlp(x)

        return x + res

# %% [cell 11]
basic_te_transformer = BasicTETransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
)
basic_te_transformer.to(dtype=dtype).cpu()
utils.share_parameters_with_basic_te_model(basic_te_transformer, basic_transformer)

# %% [cell 12]
torch.manual_seed(1234)
y = basic_te_transformer(x, attention_mask=None)
print("BasicTETransformerLayer - BasicTransformerLayer, largest difference:",
      (y - y_basic).abs().max().item())  # fp8kit addition
y_basic_te = y  # fp8kit addition

# %% [cell 13]
utils.speedometer(
    basic_te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)

# %% [cell 15] Fused TE Modules: LayerNormLinear and LayerNormMLP
class FusedTETransformerLayer(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int,
                 num_attention_heads: int,
                 layernorm_eps: int = 1e-5,
                 attention_dropout: float = 0.1,
                 hidden_dropout: float = 0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln_qkv = te.LayerNormLinear(hidden_size, 3 * hidden_size, eps=layernorm_eps, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln_mlp = te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_eps, bias=True)


    def forward(self,
                x: torch.Tensor,
                attention_mask: torch.Tensor):
        res = x
        qkv = self.ln_qkv(x)

        # Split qkv into query, key and value
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln_mlp(x)

        return x + res

# %% [cell 16]
fused_te_transformer = FusedTETransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
fused_te_transformer.to(dtype=dtype).cpu()
utils.share_parameters_with_fused_te_model(fused_te_transformer, basic_transformer)

# %% [cell 17]
torch.manual_seed(1234)
y = fused_te_transformer(x, attention_mask=None)
print("FusedTETransformerLayer - BasicTransformerLayer, largest difference:",
      (y - y_basic).abs().max().item())  # fp8kit addition

# %% [cell 18]
utils.speedometer(
    fused_te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)

# %% [cell 20] Finally, TransformerLayer: the whole layer in one module
te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
te_transformer.to(dtype=dtype).cpu()
utils.share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)

# %% [cell 21]
torch.manual_seed(1234)
y = te_transformer(x, attention_mask=None)

# %% [fp8kit addition] The basic layer as a TransformerLayer, weight for weight
# Cell 20's layer is Transformer Engine's default: causal, and with fuse_qkv_params=False its QKV weight is three
# parameters (query_weight, key_weight, value_weight), so the helper's `layernorm_qkv.weight = ...` adds a parameter
# the layer does not use (in Transformer Engine as here): its output is not the basic layer's. With the basic
# layer's settings (no mask) and one fused QKV weight, whose default interleaved layout (per head: q, k, v) is the
# basic layer's view/split, it computes the basic layer (compared without dropout).
twin = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads, self_attn_mask_type="no_mask",
                           fuse_qkv_params=True)
twin.to(dtype=dtype).cpu()
utils.share_parameters_with_transformerlayer_te_model(twin, basic_transformer)
twin.eval(), basic_transformer.eval()
y_twin, y_basic_eval = twin(x, attention_mask=None), basic_transformer(x, attention_mask=None)
twin.train(), basic_transformer.train()
print("TransformerLayer (fused QKV, no mask) - BasicTransformerLayer, largest difference:",
      (y_twin - y_basic_eval).abs().max().item())

# %% [cell 22]
utils.speedometer(
    te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)

# %% [cell 24] Enabling FP8: wrap the forward pass in autocast
from fp8kit.recipe import Format, DelayedScaling

te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
te_transformer.to(dtype=dtype).cpu()
utils.share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)

fp8_format = Format.HYBRID
fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")
torch.manual_seed(1234)
with te.autocast(enabled=True, recipe=fp8_recipe):  # the notebook: fp8_recipe=fp8_recipe (see the top)
    y = te_transformer(x, attention_mask=None)

# %% [cell 25]
utils.speedometer(
    te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
    autocast_kwargs = { "enabled": True, "recipe": fp8_recipe },
)

# %% [fp8kit addition] FP8 against high precision, on the layer that computes the basic one
twin.eval()
with te.autocast(enabled=True, recipe=fp8_recipe):
    y_twin_fp8 = twin(x, attention_mask=None)
twin.train()
print("FP8 TransformerLayer vs BasicTransformerLayer, relative error:",
      ((y_twin_fp8.float() - y_basic_eval.float()).norm() / y_basic_eval.float().norm()).item())
