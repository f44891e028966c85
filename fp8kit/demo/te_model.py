"""The demo GPT built from Transformer Engine's `TransformerLayer` (`fp8kit demo --model te`).

The same model as fp8kit.demo.model.GPT (token and position embeddings, pre-norm causal blocks, a final LayerNorm, an
output head tied to the token embedding, all in high precision outside the blocks), with each block one
`fp8kit.pytorch.TransformerLayer`: LayerNormLinear QKV, causal attention, Linear output projection, LayerNormMLP
(FC1, GELU, FC2), dropout off. It starts from the plain model's initial weights (the plain model is built from the
same seed and its parameters copied: the fused QKV weight keeps its [q | k | v] layout), so the two train from the
same point on the same batches. What differs: Transformer Engine's GELU is the tanh approximation, and under
torch.autocast TransformerLayer keeps the residual stream in the autocast dtype (bf16) where the plain model keeps
float32.
"""

from __future__ import annotations

import math

import torch.nn as nn

import fp8kit.pytorch as te

from .model import GPT, GPTBody, GPTConfig

__all__ = ["TEGPT", "MODELS", "build_model", "plain_to_te"]


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class TEGPT(GPTBody):
    """`forward(idx [B, T] int64, targets [B, T] or None) -> (logits [B, T, vocab], loss or None)`, as GPT."""

    tracked_layer = "blocks.0.layernorm_mlp"  # the module whose delayed-scaling state the demo records

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        plain = GPT(cfg)  # first, so that it draws the plain model's initial weights from the generator
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            te.TransformerLayer(cfg.n_embd, 4 * cfg.n_embd, cfg.n_head, hidden_dropout=0.0, attention_dropout=0.0,
                                init_method=_normal(0.02),
                                output_layer_init_method=_normal(0.02 / math.sqrt(2 * cfg.n_layer)),
                                layer_number=i + 1, self_attn_mask_type="causal", attn_input_format="bshd",
                                fuse_qkv_params=True, qkv_weight_interleaved=False)
            for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.load_state_dict(plain_to_te(plain.state_dict(), cfg.n_layer))


_BLOCK_NAMES = {  # plain GPT block -> TransformerLayer (fuse_qkv_params=True, qkv_weight_interleaved=False)
    "ln_1.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "ln_1.bias": "self_attention.layernorm_qkv.layer_norm_bias",
    "attn.qkv.weight": "self_attention.layernorm_qkv.weight", "attn.qkv.bias": "self_attention.layernorm_qkv.bias",
    "attn.proj.weight": "self_attention.proj.weight", "attn.proj.bias": "self_attention.proj.bias",
    "ln_2.weight": "layernorm_mlp.layer_norm_weight", "ln_2.bias": "layernorm_mlp.layer_norm_bias",
    "mlp.fc.weight": "layernorm_mlp.fc1_weight", "mlp.fc.bias": "layernorm_mlp.fc1_bias",
    "mlp.proj.weight": "layernorm_mlp.fc2_weight", "mlp.proj.bias": "layernorm_mlp.fc2_bias",
}


def plain_to_te(state: dict, n_layer: int) -> dict:
    """A plain GPT's state_dict under TEGPT's names (the FP8 state, if any, is left out)."""
    out = {}
    for key, value in state.items():
        if "fp8_meta" in key:
            continue
        if key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            key = f"blocks.{i}.{_BLOCK_NAMES[rest]}"
        out[key] = value
    return out


MODELS = {"plain": GPT, "te": TEGPT}


def build_model(cfg: GPTConfig, arch: str = "plain") -> nn.Module:
    """The demo model `arch` ("plain": fp8kit Linears in a hand-written GPT; "te": te.TransformerLayer blocks)."""
    if arch not in MODELS:
        raise ValueError(f"unknown demo model {arch!r}; expected one of {', '.join(MODELS)}")
    return MODELS[arch](cfg)
