"""Float8BlockQuantizer / Float8BlockwiseQTensor against the independent reference (tests/reference.py): bytes and
float32 scales bit for bit, TE's transposed scale layouts and columnwise data, special blocks, any shape."""

import io
import pickle

import numpy as np
import pytest
import torch
from block_helpers import all_bf16, special_blocks, to_np32, wide_range

import fp8kit.pytorch  # noqa: F401  (registers the safe globals for torch.load)
from fp8kit.pytorch.tensor.float8_blockwise_tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
)
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

import reference as ref

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def logical_scales(stored: torch.Tensor, rows: int, cols: int, dim: int) -> np.ndarray:
    """TE's stored scale_inv -> (row blocks, col blocks) of the layout's (rows, cols) data; checks the padding."""
    nb_c = -(-cols // 128)
    if dim == 2:
        nb_r = -(-rows // 128)
        assert stored.shape == (nb_r, -(-nb_c // 4) * 4)
        logical = stored[:, :nb_c]
    else:
        assert stored.shape == (nb_c, -(-rows // 4) * 4), "1x128 scales are stored transposed, rows padded to 4"
        logical = stored[:, :rows].t()
    pad = stored.clone()
    pad[: logical.t().shape[0] if dim == 1 else logical.shape[0], : rows if dim == 1 else nb_c] = 0
    assert not pad.any(), "scale padding must be zero"
    return logical.numpy()


def check(x: torch.Tensor, fmt: str, dim: int, pow2: bool = True, eps: float = 0.0):
    q = Float8BlockQuantizer(FMTS[fmt], rowwise=True, columnwise=True, block_scaling_dim=dim,
                             force_pow_2_scales=pow2, amax_epsilon=eps)(x)
    m, k = x.reshape(-1, x.shape[-1]).shape
    x32 = to_np32(x.reshape(m, k))
    big = float(torch.finfo(x.dtype).max)
    tile = (1, 128) if dim == 1 else (128, 128)
    want_b, want_s = ref.float8_block_quantize(x32, fmt, tile, pow2, eps, big)
    np.testing.assert_array_equal(q._rowwise_data.reshape(m, k).numpy(), want_b)
    np.testing.assert_array_equal(logical_scales(q._rowwise_scale_inv, m, k, dim), want_s)
    # columnwise: the transpose (K, *leading), quantized along the first dims
    assert q._columnwise_data.shape == (x.shape[-1],) + tuple(x.shape[:-1])
    want_bt, want_st = ref.float8_block_quantize(np.ascontiguousarray(x32.T), fmt, tile, pow2, eps, big)
    np.testing.assert_array_equal(q._columnwise_data.reshape(k, m).numpy(), want_bt)
    np.testing.assert_array_equal(logical_scales(q._columnwise_scale_inv, k, m, dim), want_st)
    return q


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True], ids=["bit_order", "shuffled"])
def test_every_bf16_pattern(fmt, dim, shuffle):
    check(all_bf16((256, 256), shuffle), fmt, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dim", [1, 2])
def test_full_range_mixed_magnitudes(dtype, pow2, dim):
    check(wide_range((200, 300), dtype, seed=7), "e4m3", dim, pow2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_special_blocks(dtype, fmt):
    rows = special_blocks(128, dtype)
    q = check(rows, fmt, 1, pow2=False)
    scale_inv = q._rowwise_scale_inv[0, : rows.shape[0]]
    assert scale_inv[0] == 1 and scale_inv[1] == 1, "zero and all-NaN blocks get scale 1"
    assert scale_inv[2] == 1, "a block holding inf gets scale 1 (TE's kernel; TE's Python reference differs)"
    check(rows, fmt, 1, pow2=True)
    check(rows, fmt, 2, pow2=True)


@pytest.mark.parametrize("eps", [1e-3, 2.0 ** -100, 1e-30])
def test_amax_epsilon(eps):
    x = wide_range((130, 260), torch.bfloat16, seed=11)
    x[:64] *= 1e-20
    x[70] = 0
    check(x, "e4m3", 1, pow2=False, eps=eps)
    check(x, "e4m3", 2, pow2=True, eps=eps)


def test_tiny_amax_uses_input_dtype_max():
    """fp8_max / amax overflows float32: the scale becomes the input dtype's largest value (TE's value_for_inf)."""
    for dtype, tiny in ((torch.float32, 2.0 ** -140), (torch.bfloat16, 2.0 ** -133)):
        x = torch.zeros(1, 128, dtype=dtype)
        x[0, 0] = tiny
        q = check(x, "e4m3", 1, pow2=False)
        assert q._rowwise_scale_inv[0, 0].item() == np.float32(1) / np.float32(torch.finfo(dtype).max)


@pytest.mark.parametrize("shape", [(1, 1), (5, 129), (130, 7), (3, 17, 200), (257,)])
@pytest.mark.parametrize("dim", [1, 2])
def test_any_shape(shape, dim):
    x = torch.randn(shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    if len(shape) == 1:
        q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=dim)(x)
        assert q._columnwise_data.shape == shape and torch.equal(q.dequantize(), check(x[None], "e4m3",
                                                                                          dim).dequantize()[0])
        return
    q = check(x, "e4m3", dim)
    for columnwise in (False, True):
        t = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=not columnwise, columnwise=columnwise,
                                 block_scaling_dim=dim)(x)
        m, k = x.reshape(-1, shape[-1]).shape
        tile = (1, 128) if dim == 1 else (128, 128)
        if columnwise:
            b, s = ref.float8_block_quantize(np.ascontiguousarray(to_np32(x.reshape(m, k)).T), "e4m3", tile)
            b, s = b.T, s.T
        else:
            b, s = ref.float8_block_quantize(to_np32(x.reshape(m, k)), "e4m3", tile)
        vals = ref.fp8_values(b, "e4m3")
        if columnwise:  # scales per (128 rows block, column) of the original, or square blocks
            scale = np.repeat(np.repeat(s, tile[1], axis=0)[:m], tile[0], axis=1)[:, :k]
        else:
            scale = np.repeat(np.repeat(s, tile[0], axis=0)[:m], tile[1], axis=1)[:, :k]
        want = (vals * scale).astype(np.float32)
        np.testing.assert_array_equal(t.dequantize(dtype=torch.float32).reshape(m, k).numpy(), want)
    assert q.shape == x.shape


def test_scale_shapes_match_te_formula():
    q1 = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    q2 = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2)
    assert q1.get_scale_shape((3, 100, 200), False) == (2, 300) and q1.get_scale_shape((3, 100, 200), True) == (3, 200)
    assert q2.get_scale_shape((300, 1000), False) == (3, 8) and q2.get_scale_shape((300, 1000), True) == (8, 4)
    assert q1.get_columnwise_shape((3, 100, 200)) == (200, 3, 100)


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="rowwise"):
        Float8BlockQuantizer(torch.float8_e4m3fn)  # TE makes both usages required keywords


@pytest.mark.parametrize("dim", [1, 2])
def test_a_0d_tensor_is_one_block(dim):
    """A 0-d tensor quantizes as the (1, 1) tensor (Transformer Engine accepts it), both layouts 0-d."""
    x = torch.tensor(-0.3, dtype=torch.bfloat16)
    q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=dim)(x)
    assert q.shape == () and q._rowwise_data.shape == () and q._columnwise_data.shape == ()
    b, s = ref.float8_block_quantize(to_np32(x.reshape(1, 1)), "e4m3", (1, 128) if dim == 1 else (128, 128))
    assert q._rowwise_data.item() == b[0, 0] and q._columnwise_data.item() == b[0, 0]
    want = np.float32(ref.fp8_values(b, "e4m3")[0, 0] * s[0, 0])
    assert q.dequantize(dtype=torch.float32).item() == want
    q.update_usage(rowwise_usage=False)
    assert q.dequantize(dtype=torch.float32).shape == () and q.dequantize(dtype=torch.float32).item() == want


def test_tensor_behaviour():
    x = torch.randn(130, 260, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    q = quantizer(x)
    assert isinstance(q, Float8BlockwiseQTensor) and q.shape == x.shape and q.dtype == torch.bfloat16
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    for copy in (q.detach(), q.clone(), pickle.loads(pickle.dumps(q)), q.to("cpu"), loaded):
        assert isinstance(copy, Float8BlockwiseQTensor) and torch.equal(copy.dequantize(), q.dequantize())
    empty = quantizer.make_empty(x.shape, dtype=x.dtype)
    empty.copy_(x)
    assert torch.equal(empty.dequantize(), q.dequantize())
    q.update_usage(rowwise_usage=False)
    assert q.size() == x.shape and q.size(1) == 260
    internal = quantizer.copy()
    internal.internal = True
    s = internal(x)
    assert type(s) is Float8BlockwiseQTensorStorage and s.shape == x.shape


@pytest.mark.parametrize("make", [
    lambda: MXFP8Quantizer(torch.float8_e4m3fn),
    lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1),
    lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2),
], ids=["mxfp8", "block1d", "block2d"])
def test_views_keeping_the_last_dim_stay_quantized(make):
    """As in TE: a view or reshape that keeps the last dim keeps every block, so it shares the bytes and scales;
    any other view runs on the values."""
    x = torch.rand(2, 64, 32, 128, generator=torch.Generator().manual_seed(4))
    t = make()(x)
    for v in (t.view(-1, 32, 128), t.reshape(-1, 128), t.view(2, 64, 32, 128)):
        assert type(v) is type(t) and v._rowwise_data.data_ptr() == t._rowwise_data.data_ptr()
        assert v._rowwise_scale_inv is t._rowwise_scale_inv and v._columnwise_scale_inv is t._columnwise_scale_inv
        assert torch.equal(v.dequantize(), t.dequantize().reshape(v.shape))
        assert v._columnwise_data.data_ptr() == t._columnwise_data.data_ptr()
    other = t.view(2, -1)
    assert type(other) is torch.Tensor and torch.equal(other, t.dequantize().view(2, -1))
