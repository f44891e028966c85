"""Transformer Engine's attention modules (`transformer_engine.pytorch.attention`): DotProductAttention,
MultiheadAttention, RotaryPositionEmbedding and InferenceParams. The attention core runs in high precision on
`torch.nn.functional.scaled_dot_product_attention`; the projections are fp8kit's FP8 modules."""

from .dot_product_attention import DotProductAttention
from .inference import InferenceParams
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["DotProductAttention", "MultiheadAttention", "InferenceParams", "RotaryPositionEmbedding",
           "apply_rotary_pos_emb"]
