"""MXFP8Quantizer / MXFP8Tensor against the independent reference (tests/reference.py): bytes and E8M0 scales bit for
bit, TE's padded layouts, special blocks, errors."""

import io
import pickle

import numpy as np
import pytest
import torch
from block_helpers import all_bf16, special_blocks, to_np32, wide_range

import fp8kit.pytorch  # noqa: F401  (registers the safe globals for torch.load)
from fp8kit.pytorch import block_cast as bc
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage

import reference as ref

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def check_against_reference(x: torch.Tensor, fmt: str, two_d: bool = False):
    q = MXFP8Quantizer(FMTS[fmt], rowwise=True, columnwise=True, with_2d_quantization=two_d)(x)
    m, k = x.reshape(-1, x.shape[-1]).shape
    x32 = to_np32(x.reshape(m, k))
    blocks = {"row": (32, 32) if two_d else (1, 32), "col": (32, 32) if two_d else (32, 1)}
    for name, data, scales, cols in (("row", q._rowwise_data, q._rowwise_scale_inv, k // 32),
                                     ("col", q._columnwise_data, q._columnwise_scale_inv, k)):
        want_bytes, want_code = ref.mxfp8_quantize(x32, fmt, blocks[name])
        if two_d:
            want_code = np.repeat(want_code, 32, axis=0) if name == "row" else np.repeat(want_code, 32, axis=1)
        rows = m if name == "row" else m // 32
        np.testing.assert_array_equal(data.reshape(m, k).numpy(), want_bytes, err_msg=f"{fmt} {name} bytes")
        np.testing.assert_array_equal(scales[:rows, :cols].numpy(), want_code, err_msg=f"{fmt} {name} scales")
        padded = scales.clone()
        padded[:rows, :cols] = 0
        assert not padded.any(), "scale padding must be zero"
    return q


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["bit_order", "shuffled"])
def test_every_bf16_pattern(fmt, shuffle):
    """All 65536 bf16 patterns, in bit order (blocks of neighbours) and shuffled (blocks mixing everything)."""
    check_against_reference(all_bf16((256, 256), shuffle), fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_full_range_mixed_magnitudes(dtype, fmt):
    check_against_reference(wide_range((128, 320), dtype, seed=3), fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_special_blocks(dtype, fmt):
    rows = special_blocks(32, dtype)
    x = torch.cat([rows, torch.zeros(32 - rows.shape[0] % 32, 32, dtype=dtype)]).repeat(1, 2)
    q = check_against_reference(x, fmt)
    codes = q._rowwise_scale_inv[: rows.shape[0], 0]
    assert codes[0] == 0 and codes[1] == 0, "zero and all-NaN blocks take code 0 (NaN does not enter the amax)"
    assert codes[2] == 254, "a block holding inf saturates to code 254"
    assert codes[8 if fmt == "e4m3" else 9] == 127, "amax fp8_max is exactly 2^0 * fp8_max"
    data = q._rowwise_data.view(FMTS[fmt]).float()
    assert torch.isnan(data[1]).all() and data[2, 0] == torch.finfo(FMTS[fmt]).max


def test_scale_byte_sweep():
    """Every float32 exponent with mantissas at the rounding edges (and subnormals, inf, NaN)."""
    e = np.arange(-149, 128, dtype=np.float64)
    mant = np.array([1.0, 1.0 + 2.0 ** -23, 1.5, 2.0 - 2.0 ** -23])
    vals = (np.ldexp(mant[None, :], e[:, None].astype(int))).ravel()
    vals = np.concatenate([vals, [0.0, np.inf, np.nan, 448.0 * 2.0 ** -127, 448.0 * 2.0 ** -128]])
    amax = vals.astype(np.float32)
    amax = amax[np.isnan(amax) | (amax >= 0)]
    for fmt, fp8 in FMTS.items():
        got = bc.e8m0_from_amax(torch.from_numpy(amax), fp8).numpy()
        np.testing.assert_array_equal(got, ref.e8m0_scale(amax, fmt))


def test_decode_matches_ml_dtypes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    np.testing.assert_array_equal(bc.e8m0_decode(codes).numpy(), ref.e8m0_value(codes.numpy()))
    # the cast factor is the reciprocal (2^(127 - code)), exact for every code but NaN
    inv = bc.e8m0_cast_scale(codes[:255]).double() * bc.e8m0_decode(codes[:255]).double()
    assert torch.all(inv == 1)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_2d_blocks(fmt):
    """with_2d_quantization: one scale per 32x32 block, shared by both layouts (TE uses it for weights)."""
    x = wide_range((96, 64), torch.bfloat16, seed=5)
    q = check_against_reference(x, fmt, two_d=True)
    assert torch.equal(q._rowwise_data, q._columnwise_data)


def test_layouts_and_dequantize():
    x = torch.randn(2, 64, 160, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    q = MXFP8Quantizer(torch.float8_e4m3fn)(x)
    assert q._rowwise_data.dtype == torch.uint8 and q._rowwise_data.shape == x.shape
    assert q._rowwise_scale_inv.shape == (128, 8) and q._columnwise_scale_inv.shape == (4, 256)
    assert not torch.equal(q._rowwise_data, q._columnwise_data), "both layouts come from the input"
    x32 = to_np32(x.reshape(128, 160))
    for columnwise, block in ((False, (1, 32)), (True, (32, 1))):
        b, code = ref.mxfp8_quantize(x32, "e4m3", block)
        want = ref.fp8_values(b, "e4m3").reshape(128 // block[0], block[0], 5 * 32 // block[1], block[1])
        want = (want * ref.e8m0_value(code)[:, None, :, None].astype(np.float64)).reshape(128, 160)
        t = MXFP8Quantizer(torch.float8_e4m3fn, rowwise=not columnwise, columnwise=columnwise)(x)
        np.testing.assert_array_equal(t.dequantize(dtype=torch.float32).reshape(128, 160).numpy(),
                                      want.astype(np.float32))


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (64,), (3, 10, 32)])
def test_refuses_non_multiples(shape):
    with pytest.raises(ValueError, match="divisible by 32"):
        MXFP8Quantizer(torch.float8_e4m3fn)(torch.randn(shape))


def test_bad_arguments():
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Quantizer(torch.bfloat16)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        MXFP8Quantizer(torch.float8_e4m3fn)(torch.ones(32, 32, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="swizzled"):
        MXFP8TensorStorage(None, None, torch.zeros(32, 32, dtype=torch.uint8), torch.zeros(4, 128, dtype=torch.uint8),
                           torch.float8_e4m3fn, None, True)


def test_tensor_behaviour():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    quantizer = MXFP8Quantizer(torch.float8_e4m3fn)
    q = quantizer(x)
    assert isinstance(q, MXFP8Tensor) and q.shape == x.shape and q.dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    for copy in (q.detach(), q.clone(), pickle.loads(pickle.dumps(q)), q.to("cpu"), loaded):
        assert isinstance(copy, MXFP8Tensor) and torch.equal(copy.dequantize(), q.dequantize())
    assert torch.equal(q + 0, q.dequantize()), "other ops run on the values"
    empty = quantizer.make_empty((64, 64))
    quantizer.update_quantized(x, empty)
    assert torch.equal(empty._rowwise_data, q._rowwise_data) and torch.equal(empty._columnwise_scale_inv,
                                                                            q._columnwise_scale_inv)
    quantizer.update_quantized(x * 4, empty, noop_flag=torch.ones(1))
    assert torch.equal(empty.dequantize(), q.dequantize()), "noop_flag=1 keeps the old bytes"
    empty.copy_(x * 2)
    assert torch.equal(empty.dequantize(), q.dequantize() * 2)
    q.update_usage(rowwise_usage=False)
    empty.update_usage(rowwise_usage=False)  # both from their columnwise layouts now
    assert q._rowwise_data is None and torch.equal(q.dequantize(), empty.dequantize() / 2)
    with pytest.raises(RuntimeError, match="rowwise data was not quantized"):
        q.update_usage(rowwise_usage=True)
    internal = quantizer.copy()
    internal.internal = True
    s = internal(x)
    assert type(s) is MXFP8TensorStorage and s.shape == x.shape
    tensors, obj = s.prepare_for_saving()
    obj.restore_from_saved(tensors)
    assert torch.equal(s.dequantize(), quantizer(x).dequantize())


def test_grad_is_straight_through():
    x = torch.randn(32, 64, requires_grad=True)
    MXFP8Quantizer(torch.float8_e4m3fn)(x).dequantize().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
