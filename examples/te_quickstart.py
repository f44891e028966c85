"""Transformer Engine's quickstart tutorial ("Getting Started"), ported to fp8kit.

Ported from docs/examples/quickstart.ipynb of NVIDIA/TransformerEngine at commit c90a921 (the notebook's last
version: TE replaced it with docs/getting_started/ in a976740), cells 1-18, with their helpers in
te_quickstart_utils.py. Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES, Apache License 2.0.

Changes from the notebook: `transformer_engine.pytorch` -> `fp8kit.pytorch`, `transformer_engine.common.recipe` ->
`fp8kit.recipe`; CPU instead of CUDA, with smaller sizes so that it runs in seconds; the notebook's markdown cells
as short comments; lines marked "fp8kit addition" compare the layers' outputs. The cells from 19 on build
`te.TransformerLayer`, which fp8kit does not have yet; the last cell here applies the notebook's "Enabling FP8"
steps (cells 23-25) to the TE layer built earlier instead.

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

# %% [fp8kit addition] Enabling FP8 (the notebook's cells 23-25, on BasicTETransformerLayer: no TransformerLayer yet)
from fp8kit.recipe import Format, DelayedScaling

fp8_format = Format.HYBRID
fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")
torch.manual_seed(1234)
with te.autocast(enabled=True, recipe=fp8_recipe):
    y = basic_te_transformer(x, attention_mask=None)
y_fp8 = y
print("FP8 BasicTETransformerLayer vs BasicTransformerLayer, relative error:",
      ((y_fp8.float() - y_basic.float()).norm() / y_basic.float().norm()).item())

utils.speedometer(
    basic_te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
    autocast_kwargs = { "enabled": True, "recipe": fp8_recipe },
)
