"""Rotary position embeddings against a float64 reference written as complex rotations
(tests/attention_reference.rope_reference): both channel layouts, the three formats, start positions, partial
rotation; bad inputs raise."""

import numpy as np
import pytest
import torch

from fp8kit.pytorch.attention import RotaryPositionEmbedding, apply_rotary_pos_emb

import attention_reference as ref

S, B, H, D = 6, 2, 3, 8


def test_angle_table_is_position_times_inverse_frequency():
    for interleaved in (False, True):
        freqs = RotaryPositionEmbedding(D, interleaved=interleaved)(S, offset=2)
        assert freqs.shape == (S, 1, 1, D) and freqs.dtype == torch.float32
        inv = 10000.0 ** (-np.arange(0, D, 2) / D)
        angles = (np.arange(S) + 2)[:, None] * inv[None, :]
        want = np.repeat(angles, 2, axis=1) if interleaved else np.concatenate([angles, angles], axis=1)
        np.testing.assert_allclose(freqs.view(S, D).numpy(), want, rtol=1e-6)
    interpolated = RotaryPositionEmbedding(D, seq_len_interpolation_factor=4,
                                           pretrained_max_position_embeddings=100)(S)
    np.testing.assert_allclose(interpolated.view(S, D).numpy(),
                               RotaryPositionEmbedding(D)(S).view(S, D).numpy() / 4, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_matches_complex_reference(fmt, interleaved):
    x = torch.randn(S, B, H, D, generator=torch.Generator().manual_seed(0))
    t = x if fmt == "sbhd" else x.transpose(0, 1).contiguous()
    freqs = RotaryPositionEmbedding(D, interleaved=interleaved)(S + 3)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    for start_positions in (None, starts):
        out = apply_rotary_pos_emb(t, freqs, fmt, start_positions=start_positions, interleaved=interleaved)
        pos = np.arange(S)[:, None] + (0 if start_positions is None else starts.numpy()[None, :])  # [s, b]
        want = ref.rope_reference(x.numpy(), pos, D, interleaved=interleaved)
        got = out if fmt == "sbhd" else out.transpose(0, 1)
        np.testing.assert_allclose(got.numpy(), want, atol=2e-6)


def test_partial_rotation_passes_the_other_channels_through():
    x = torch.randn(S, B, H, D)
    rope = RotaryPositionEmbedding(D, rotary_percent=0.5)
    freqs = rope(S)
    assert freqs.shape[-1] == D // 2
    out = apply_rotary_pos_emb(x, freqs, "sbhd")
    assert torch.equal(out[..., D // 2:], x[..., D // 2:])
    want = ref.rope_reference(x[..., :D // 2].numpy(), np.arange(S)[:, None], D // 2)
    np.testing.assert_allclose(out[..., :D // 2].numpy(), want, atol=2e-6)


def test_thd_restarts_positions_per_sequence():
    lengths, starts = [2, 4], [0, 5]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    x = torch.randn(6, H, D)
    freqs = RotaryPositionEmbedding(D)(16)
    for start_positions in (None, torch.tensor(starts, dtype=torch.int32)):
        out = apply_rotary_pos_emb(x, freqs, "thd", start_positions=start_positions, cu_seqlens=cu)
        offset = [0, 0] if start_positions is None else starts
        pos = np.concatenate([np.arange(n) + o for n, o in zip(lengths, offset)])
        np.testing.assert_allclose(out.numpy(), ref.rope_reference(x.numpy(), pos, D), atol=2e-6)


def test_bfloat16_rounds_cos_and_sin_to_the_input_dtype():
    x = torch.randn(S, B, H, D).bfloat16()
    freqs = RotaryPositionEmbedding(D)(S)
    out = apply_rotary_pos_emb(x, freqs, "sbhd")
    assert out.dtype == torch.bfloat16
    want = ref.rope_reference(x.float().numpy(), np.arange(S)[:, None], D)
    np.testing.assert_allclose(out.float().numpy(), want, atol=0.05)


def test_bad_inputs_raise():
    x = torch.randn(S, B, H, D)
    with pytest.raises(ValueError, match="need freqs for at least 6 positions"):
        apply_rotary_pos_emb(x, RotaryPositionEmbedding(D)(S - 1), "sbhd")
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(x, RotaryPositionEmbedding(D)(S), "hsbd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_pos_emb(x[0], RotaryPositionEmbedding(D)(S), "thd")
    with pytest.raises(ValueError, match=r"freqs must have shape \[s, 1, 1, d2\]"):
        apply_rotary_pos_emb(x, torch.zeros(S, D), "sbhd")
