"""KV caching (InferenceParams): generating token by token gives the outputs of running each whole sequence at once,
with rotary embeddings, several layers, sequences joining and finishing mid-way, in the three formats."""

from collections import OrderedDict

import pytest
import torch

import fp8kit.pytorch as te

HID, H, G = 16, 4, 2
D = HID // H


class _Stack(torch.nn.Module):
    """Two pre-norm attention layers with residuals (float64), RoPE on queries and keys."""

    def __init__(self, fmt):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            te.MultiheadAttention(HID, H, num_gqa_groups=G, layer_number=i + 1, input_layernorm=True,
                                  attention_dropout=0.0, qkv_format=fmt, params_dtype=torch.float64)
            for i in range(2))
        self.rope = te.RotaryPositionEmbedding(D)

    def forward(self, x, **kwargs):
        freqs = self.rope(32)
        for layer in self.layers:
            x = x + layer(x, rotary_pos_emb=freqs, **kwargs)
        return x


def _full_outputs(model, tokens):
    """Each sequence alone, all its tokens at once, causal: {seq_id: [L, HID]}."""
    out = {}
    for sid, seq in tokens.items():
        x = seq.unsqueeze(0) if model.layers[0].qkv_format == "bshd" else seq.unsqueeze(1)
        if model.layers[0].qkv_format == "thd":
            y = model(seq, attn_mask_type="padding_causal", cu_seqlens_q=torch.tensor([0, len(seq)]),
                      cu_seqlens_kv=torch.tensor([0, len(seq)]))
        else:
            y = model(x, attn_mask_type="causal")
            y = y[0] if model.layers[0].qkv_format == "bshd" else y[:, 0]
        out[sid] = y
    return out


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_generation_token_by_token_equals_whole_sequences(fmt):
    model = _Stack(fmt).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = {0: 6, 1: 10, 2: 8}
    tokens = {s: torch.randn(n, HID, generator=gen, dtype=torch.float64) for s, n in lengths.items()}
    want = _full_outputs(model, tokens)
    params = te.InferenceParams(3, 16, num_heads_kv=G, head_dim_k=D, dtype=torch.float64, qkv_format=fmt,
                                max_ctx_len=8)
    # (seq_id, new tokens) per step: 0 and 1 start with prompts, 2 joins at step 2, 0 finishes after step 3
    schedule = [{0: 3, 1: 5}, {0: 1, 1: 1}, {0: 1, 1: 1, 2: 4}, {0: 1, 1: 1, 2: 1}, {1: 1, 2: 1}, {1: 1, 2: 1},
                {2: 1}]
    done = {s: 0 for s in lengths}
    with torch.no_grad():
        for step in schedule:
            params.pre_step(OrderedDict(step))
            news = [tokens[s][done[s]:done[s] + n] for s, n in step.items()]
            longest = max(step.values())
            if fmt == "thd":
                x = torch.cat(news)
            else:
                x = torch.zeros(len(step), longest, HID, dtype=torch.float64)
                for i, t in enumerate(news):
                    x[i, :len(t)] = t
                x = x if fmt == "bshd" else x.transpose(0, 1).contiguous()
            y = model(x, attn_mask_type="padding_causal", inference_params=params)
            offset = 0
            for i, (s, n) in enumerate(step.items()):
                if fmt == "thd":
                    got = y[offset:offset + n]
                    offset += n
                else:
                    got = y[i, :n] if fmt == "bshd" else y[:n, i]
                torch.testing.assert_close(got, want[s][done[s]:done[s] + n], rtol=1e-10, atol=1e-10)
                done[s] += n
    assert done == lengths


def test_inference_params_api_and_errors():
    with pytest.raises(TypeError, match="num_heads_kv, head_dim_k, dtype required"):
        te.InferenceParams(2, 8)
    with pytest.raises(NotImplementedError, match="paged"):
        te.InferenceParams(2, 8, num_heads_kv=1, head_dim_k=4, dtype=torch.float32, is_paged=True, page_size=4,
                           total_num_pages=4)
    params = te.InferenceParams(2, 8, num_heads_kv=1, head_dim_k=4, dtype=torch.float32)
    params.allocate_memory(1)
    k_cache, v_cache = params.cache_manager.cache[1]
    assert k_cache.shape == (2, 8, 1, 4) and v_cache.shape == (2, 8, 1, 4)
    params.pre_step(OrderedDict({7: 3, 9: 2}))
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.cu_seqlens_kv.tolist() == [0, 3, 5]
    params.pre_step(OrderedDict({7: 1, 9: 1}))
    assert params.get_seqlens_pre_step().tolist() == [3, 2] and params.cu_seqlens_kv.tolist() == [0, 4, 7]
    with pytest.raises(ValueError, match="continuing sequences first"):
        params.pre_step(OrderedDict({9: 1, 7: 1}))
    with pytest.raises(ValueError, match="exceed max_sequence_length=8"):
        params.pre_step(OrderedDict({7: 5, 9: 1}))
    with pytest.raises(ValueError, match="exceed max_batch_size=2"):
        params.pre_step(OrderedDict({1: 1, 2: 1, 3: 1}))
    mha = te.MultiheadAttention(8, 2, num_gqa_groups=1, attention_dropout=0.0, qkv_format="bshd")
    params.pre_step(OrderedDict({7: 1, 9: 1}))
    with pytest.raises(ValueError, match="needs a padding attn_mask_type"):
        mha(torch.randn(2, 1, 8), inference_params=params)
    mha(torch.randn(2, 1, 8), attn_mask_type="padding_causal", inference_params=params)
    with pytest.raises(RuntimeError, match="stepped twice"):  # two layers sharing layer_number 1
        mha(torch.randn(2, 1, 8), attn_mask_type="padding_causal", inference_params=params)
