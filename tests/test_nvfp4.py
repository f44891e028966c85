"""NVFP4Quantizer / NVFP4Tensor against the independent reference (tests/reference.py, NumPy + ml_dtypes): packed
E2M1 bytes, E4M3 block scales and amaxes bit for bit for every bf16 pattern, mixed magnitudes, special blocks, 1x16
and 16x16 blocks, both usages, the random Hadamard transform, TE's padded layouts, errors."""

import numpy as np
import pytest
import torch
from block_helpers import all_bf16, special_blocks, to_np32, wide_range

from fp8kit.pytorch import hadamard
from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage

import reference as ref


def check(x: torch.Tensor, two_d: bool = False, with_rht: bool = False):
    """Quantize x with both usages and compare every field with the reference."""
    q = NVFP4Quantizer(with_2d_quantization=two_d, with_rht=with_rht, with_post_rht_amax=with_rht)(x)
    m, k = x.reshape(-1, x.shape[-1]).shape
    x2 = x.reshape(m, k)
    xt = to_np32(x2.t().contiguous())
    if with_rht:
        xt = ref.rht_bf16(ref.bf16_of(xt) if x.dtype == torch.bfloat16 else xt).astype(np.float32)
    for name, data, scales, amax, src, rows, cols in (
            ("row", q._rowwise_data, q._rowwise_scale_inv, q._amax_rowwise, to_np32(x2), m, k),
            ("col", q._columnwise_data, q._columnwise_scale_inv, q._amax_columnwise, xt, k, m)):
        want_data, want_scales, want_amax = ref.nvfp4_quantize(src, two_d)
        np.testing.assert_array_equal(data.reshape(rows, cols // 2).numpy(), want_data, err_msg=f"{name} bytes")
        np.testing.assert_array_equal(scales[:rows, : cols // 16].numpy(), want_scales, err_msg=f"{name} scales")
        assert amax.dtype == torch.float32 and amax.shape == (1,)
        np.testing.assert_array_equal(amax.numpy(), [want_amax], err_msg=f"{name} amax")
        padded = scales.clone()
        padded[:rows, : cols // 16] = 0
        assert not padded.any(), "scale padding must be zero"
    return q


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_bf16_pattern(shuffle, two_d):
    """All 65536 bf16 patterns (inf and NaN included: the tensor amax is inf, so the global scale is 1)."""
    check(all_bf16((256, 256), shuffle), two_d)


@pytest.mark.parametrize("two_d", [False, True])
def test_every_finite_bf16_pattern_in_blocks(two_d):
    """All finite bf16 patterns, shuffled into blocks that mix magnitudes, under a finite tensor amax."""
    x = all_bf16((256, 256), shuffle=True, seed=3)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
    check(x, two_d)
    check(x * 2.0 ** -100, two_d)  # tiny amax: the global scale near float32's top


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("two_d", [False, True])
def test_wide_range_and_3d(dtype, two_d):
    check(wide_range((4, 32, 48), dtype, seed=1), two_d)
    check(torch.randn(64, 32, dtype=dtype) * 0.01, two_d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_blocks_and_tensors(dtype):
    rows = special_blocks(16, dtype)
    rows = torch.cat([rows, torch.randn(32 - rows.shape[0], 16).to(dtype)])
    check(rows.repeat(1, 2))
    check(rows[2:].repeat(1, 2)[:16])  # without the all-NaN row
    for fill in (0.0, float("nan"), float("inf"), -3.0):
        check(torch.full((16, 32), fill, dtype=dtype))


def test_rht_columnwise_against_reference():
    """Columnwise usage of the transform of x^T (amax after it); the rowwise usage never transformed."""
    for x in (torch.randn(64, 32).bfloat16(), wide_range((32, 48), torch.bfloat16, seed=4)):
        q = check(x, with_rht=True)
        plain = NVFP4Quantizer()(x)
        assert torch.equal(q._rowwise_data, plain._rowwise_data)


def test_rht_matrix_is_tes():
    """TE's sign vector and Sylvester order; orthogonal; the float64 reference matrix equals it."""
    m = hadamard.rht_matrix().double()
    np.testing.assert_array_equal(m.numpy(), ref.rht_matrix64())
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    assert hadamard.sign_mask() == sum(1 << i for i, s in enumerate(ref.NVFP4_SIGNS) if s < 0)
    assert hadamard.sign_mask(False) == 0


def test_rht_undone_recovers_input():
    """float32 in: undoing the transform in float64 recovers x to float32 rounding (|err| <= 2^-23 * 16 * max)."""
    x = torch.randn(8, 64, dtype=torch.float32)
    y = hadamard.rht(x)
    back = y.double().reshape(-1, 16) @ hadamard.rht_matrix().double().t()
    err = (back.reshape(x.shape) - x.double()).abs().max().item()
    assert err <= 16 * 2.0 ** -24 * x.abs().max().item()
    want = x.double().reshape(-1, 16) @ torch.from_numpy(ref.rht_matrix64())
    assert torch.equal(y, want.float().reshape(x.shape))
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard.rht(torch.ones(4, 24))


def test_layout_and_dequantize():
    x = torch.randn(2, 48, 64)
    q = NVFP4Quantizer()(x)
    assert isinstance(q, NVFP4Tensor) and q.shape == (2, 48, 64) and q.dtype == torch.float32
    assert q._rowwise_data.shape == (2, 48, 32) and q._rowwise_data.dtype == torch.uint8
    assert q._rowwise_scale_inv.shape == (128, 4) and q._columnwise_scale_inv.shape == (128, 8)
    assert q._columnwise_data.shape == (64, 48)
    assert NVFP4Quantizer().get_scale_shape((2, 48, 64), True) == (128, 8)
    assert NVFP4Quantizer.get_columnwise_shape((2, 48, 64)) == (64, 2, 48)
    data, scales, amax = ref.nvfp4_quantize(to_np32(x.reshape(96, 64)))
    s_dec = np.float32(1) / ref.nvfp4_global_scale(amax)
    sc = scales.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float32) * s_dec
    want = (ref.nvfp4_values(data).reshape(96, 4, 16) * sc[:, :, None]).astype(np.float32)
    np.testing.assert_array_equal(q.dequantize().reshape(96, 64).numpy(), want.reshape(96, 64))
    q.update_usage(rowwise_usage=False)  # from the columnwise layout: the same values (no RHT)
    assert (q.dequantize() - x).abs().max() <= x.abs().max() / 6
    internal = NVFP4Quantizer()
    internal.internal = True
    s = internal(x)
    assert type(s) is NVFP4TensorStorage and s.shape == (2, 48, 64)
    saved, obj = s.prepare_for_saving()
    assert len(saved) == 6 and obj.restore_from_saved(saved) == []


def test_errors():
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Quantizer()(torch.ones(16, 24))
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Quantizer()(torch.ones(32))
    with pytest.raises(NotImplementedError, match="nvfp4_use_4over6"):
        NVFP4Quantizer(nvfp4_use_4over6=True)
    with pytest.raises(NotImplementedError, match="with_post_rht_amax"):
        NVFP4Quantizer(with_rht=True)
    with pytest.raises(TypeError, match="kFloat4E2M1"):
        NVFP4Quantizer(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        NVFP4Quantizer()(torch.ones(16, 16, dtype=torch.int32))


def _near_midpoints(amax: np.float32, count: int, seed: int) -> np.ndarray:
    """Block amaxes whose scaled value `b * (S * float32(1/6))` lands next to an E4M3 rounding midpoint."""
    rng = np.random.default_rng(seed)
    s = np.float32(2688.0) / amax
    mids = np.array([1.0625, 1.1875, 2.125, 3.875, 17.0, 104.0, 0.015625 * 1.5], dtype=np.float32)
    out = []
    while len(out) < count:
        b0 = np.float32(rng.choice(mids) / (s * np.float32(1 / 6)))
        out.append(np.float32(b0 + np.float32(rng.integers(-3, 4)) * np.spacing(b0)))
    return np.minimum(np.array(out, dtype=np.float32), amax)


@pytest.mark.parametrize("amax", [637.3247, 41.932549, 729.92578])
def test_block_scale_order_of_operations(amax):
    """TE multiplies the block amax by `S * float32(1/6)`; `S / 6` or `(b / 6) * S` round differently next to an
    E4M3 midpoint. These rows are built to sit there: the bytes follow TE's order (and the other orders would
    differ on some row, so the test tells them apart)."""
    a = np.float32(amax)
    b = _near_midpoints(a, 64, seed=int(amax))
    x = np.zeros((64, 32), dtype=np.float32)
    x[:, 16], x[0, 0] = b, a
    q = NVFP4Quantizer(columnwise=False)(torch.from_numpy(x))
    _, want, _ = ref.nvfp4_quantize(x)
    np.testing.assert_array_equal(q._rowwise_scale_inv[:64, :2].numpy(), want)
    s = ref.nvfp4_global_scale(a)
    others = [(v).astype(ref.ml_dtypes.float8_e4m3fn).view(np.uint8)
              for v in (b * (s / np.float32(6)), (b / np.float32(6)) * s)]
    assert any((o != want[:, 1]).any() for o in others)


def test_views_detach_clone_keep_fields():
    x = torch.randn(4, 32, 64)
    q = NVFP4Quantizer()(x)
    v = q.view(128, 64)
    assert isinstance(v, NVFP4Tensor) and v.shape == (128, 64) and v._rowwise_data.shape == (128, 32)
    assert torch.equal(v.dequantize(), q.dequantize().reshape(128, 64))
    for t in (q.detach(), q.clone()):
        assert isinstance(t, NVFP4Tensor) and torch.equal(t._amax_columnwise, q._amax_columnwise)
        assert torch.equal(t.dequantize(), q.dequantize())


def test_quantize_in_place():
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    t = q(torch.randn(32, 64))
    x2 = torch.randn(32, 64) * 3
    t.quantize_(x2)
    fresh = q(x2)
    for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv", "_amax_rowwise",
                 "_amax_columnwise"):
        assert torch.equal(getattr(t, name), getattr(fresh, name)), name


def test_block_whose_scale_rounds_to_zero():
    """A block far below the tensor amax: its E4M3 scale is 0, so f is float32's max and its non-zero values
    saturate to +-6 (codes 7 / 15); they dequantize to 0. TE's rule, checked against the reference."""
    x = torch.zeros(16, 32)
    x[0, 0], x[:, 16:] = 1e6, 1e-3
    x[1, 16:] = -1e-3
    q = check(x)
    assert (q._rowwise_scale_inv[:16, 1] == 0).all()
    assert (q._rowwise_data[0, 8:] == 0x77).all() and (q._rowwise_data[1, 8:] == 0xFF).all()
    assert (q.dequantize()[:, 16:] == 0).all()
