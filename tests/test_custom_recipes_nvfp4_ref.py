"""fp8kit.pytorch.custom_recipes.reference_nvfp4 (TE's reference NVFP4 quantizer, the oracle of TE's NVFP4 tests)
against tests/reference.py (NumPy + ml_dtypes): bytes, scales and amaxes of every bf16 pattern, 16x16 tiles,
row-scaled, RHT, padding; the reference GEMM `qgemm` per tensor and row-scaled."""

import numpy as np
import pytest
import torch
from block_helpers import all_bf16, wide_range

from fp8kit.pytorch.custom_recipes import gemm, reference_utils
from fp8kit.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef, NVFP4TensorRef, cast_from_fp4x2

import reference as ref

E2M1 = reference_utils.Fp4Formats.E2M1


def _quantizer(two_d=False, **kwargs):
    return NVFP4QuantizerRef(E2M1, quant_tile_shape=(16, 16) if two_d else (1, 16), **kwargs)


def _check(t: NVFP4TensorRef, x: np.ndarray, two_d: bool, row_scaled: bool, columnwise=True):
    for data, scale, amax, src in ((t.data, t.scale, t.global_amax_row, x),
                                   (t.data_t, t.scale_t, t.global_amax_col, x.T.copy() if columnwise else None)):
        if src is None:
            assert data is None and scale is None
            continue
        packed, scales, want_amax = ref.nvfp4_quantize(src, two_d, row_scaled=row_scaled)
        assert scale.dtype == torch.float8_e4m3fn and amax.dtype == torch.float32
        np.testing.assert_array_equal(data.numpy(), packed)
        np.testing.assert_array_equal(scale.view(torch.uint8).numpy(), scales)
        np.testing.assert_array_equal(amax.numpy(), np.atleast_1d(want_amax))


@pytest.mark.parametrize("two_d, row_scaled", [(False, False), (True, False), (False, True)])
def test_every_bf16_pattern(two_d, row_scaled):
    x = all_bf16((256, 256), shuffle=True)
    t = _quantizer(two_d, row_scaled_nvfp4=row_scaled).quantize(x)
    assert isinstance(t, NVFP4TensorRef) and t.original_shape == (256, 256) and t.dtype == torch.bfloat16
    _check(t, x.float().numpy(), two_d, row_scaled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wide_range_3d_and_rowwise_only(dtype):
    x = wide_range((2, 32, 48), dtype, seed=1).requires_grad_(True)
    t = _quantizer(columnwise=False).quantize(x)
    assert not t.global_amax_row.requires_grad
    x = x.detach()
    assert t.original_shape == (2, 32, 48) and t.size() == torch.Size((2, 32, 48))
    assert t.global_amax_col is t.global_amax_row  # aliased without the columnwise usage, as TE's
    _check(t, x.reshape(64, 48).float().numpy(), False, False, columnwise=False)


def test_rht_columnwise():
    x = wide_range((32, 64), torch.bfloat16, seed=2)
    for signs in (True, False):
        t = _quantizer(with_rht=True, with_random_sign_mask=signs).quantize(x)
        xt = x.float().numpy().T.copy()
        if signs:
            xt = ref.rht_bf16(xt).astype(np.float32)
        else:  # H16 / 4 without the signs: the reference's transform of sign-flipped rows undone
            flip = np.array(ref.NVFP4_SIGNS, np.float32)
            xt = ref.rht_bf16(xt * np.tile(flip, xt.shape[1] // 16)).astype(np.float32)
        packed, scales, amax = ref.nvfp4_quantize(xt)
        np.testing.assert_array_equal(t.data_t.numpy(), packed)
        np.testing.assert_array_equal(t.scale_t.view(torch.uint8).numpy(), scales)
        assert t.global_amax_col.item() == amax
        _check(NVFP4TensorRef(data=t.data, scale=t.scale, global_amax_row=t.global_amax_row), x.float().numpy(),
               False, False, columnwise=False)


def test_padding_to_the_tile():
    """Dims not multiple of the tile: zero padding, the data trimmed back, the scales kept padded."""
    x = torch.randn(20, 40)
    t = _quantizer(two_d=True).quantize(x)
    padded = torch.nn.functional.pad(x, (0, 8, 0, 12)).numpy()
    packed, scales, _ = ref.nvfp4_quantize(padded, two_d=True)
    np.testing.assert_array_equal(t.data.numpy(), packed[:20, :20])
    np.testing.assert_array_equal(t.scale.view(torch.uint8).numpy(), scales)


def test_update_quantized_and_dequantize():
    q = _quantizer(row_scaled_nvfp4=True)
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32)[:, None]
    dst = q.update_quantized(x, NVFP4TensorRef())
    _check(dst, x.numpy(), False, True)
    packed, scales, amax = ref.nvfp4_quantize(x.numpy(), row_scaled=True)
    e4m3 = ref.fp8_values(scales, "e4m3").astype(np.float32)
    decode = np.array([np.float32(1) / ref.nvfp4_global_scale(a) for a in amax], np.float32)
    want = ref.nvfp4_values(packed).astype(np.float32).reshape(32, 4, 16) * e4m3[:, :, None] * decode[:, None, None]
    np.testing.assert_allclose(dst.dequantize().numpy(), want.reshape(32, 64), rtol=2**-23, atol=0)
    skipped = q.update_quantized(torch.zeros(32, 64), dst, noop_flag=torch.ones(1))
    assert skipped.global_amax_row.equal(dst.global_amax_row) and skipped.data.any()


def test_refusals():
    with pytest.raises(ValueError, match="rowwise"):
        NVFP4QuantizerRef(E2M1, rowwise=False, row_scaled_nvfp4=True)
    with pytest.raises(NotImplementedError, match="4over6"):
        NVFP4QuantizerRef(E2M1, nvfp4_use_4over6=True)
    with pytest.raises(NotImplementedError, match="pow_2_scales"):
        NVFP4QuantizerRef(E2M1, pow_2_scales=True, quant_tile_shape=(1, 32))
    with pytest.raises(ValueError, match="quant_tile_shape"):
        NVFP4QuantizerRef(E2M1, quant_tile_shape=(1, 32))
    with pytest.raises(ValueError, match="1x16"):
        _quantizer(two_d=True, row_scaled_nvfp4=True).quantize(torch.randn(32, 32))
    with pytest.raises(TypeError, match="dtype"):
        _quantizer().quantize(torch.ones(16, 16, dtype=torch.int32))


def _operands(row_scaled_x: bool, m=48, n=32, k=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m)[:, None]
    w = torch.randn(n, k, generator=g)
    return (_quantizer(row_scaled_nvfp4=row_scaled_x).quantize(x), _quantizer().quantize(w))


def _unit_alpha_product(tx, tw) -> np.ndarray:
    """The float32 accumulation alone: reference.nvfp4_gemm with amaxes whose alpha is exactly 1."""
    return ref.nvfp4_gemm(tx.data.numpy(), tx.scale.view(torch.uint8).numpy(), 6.0 * 6.0 * 448.0 * 448.0,
                          tw.data.numpy(), tw.scale.view(torch.uint8).numpy(), 1.0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_qgemm_per_tensor_against_reference(out_dtype):
    tx, tw = _operands(False)
    y = tx._quantizer.qgemm(tx.data, tw.data, gemm.MMParams(), out_dtype, tx.scale, tw.scale, qresult_x=tx,
                            qresult_w=tw)
    want = ref.nvfp4_gemm(tx.data.numpy(), tx.scale.view(torch.uint8).numpy(), tx.global_amax_row.item(),
                          tw.data.numpy(), tw.scale.view(torch.uint8).numpy(), tw.global_amax_row.item())
    np.testing.assert_array_equal(y.float().numpy(), ref.bf16_of(want).astype(np.float32)
                                  if out_dtype == torch.bfloat16 else want)
    out = torch.randn(48, 32)
    acc = tx._quantizer.qgemm(tx.data, tw.data, None, torch.float32, tx.scale.view(torch.uint8),
                              tw.scale.view(torch.uint8), out=out.clone(), accumulate=True, qresult_x=tx, qresult_w=tw)
    np.testing.assert_array_equal(acc.numpy(), (want + out.numpy()).astype(np.float32))


def test_qgemm_row_scaled_alpha_per_output_row_and_column():
    tx, tw = _operands(True)
    y = tx._quantizer.qgemm(tx.data, tw.data, None, torch.float32, tx.scale, tw.scale, qresult_x=tx, qresult_w=tw)
    alpha = (tx.global_amax_row.numpy() * tw.global_amax_row.numpy()) / np.float32(6.0 * 6.0 * 448.0 * 448.0)
    np.testing.assert_array_equal(y.numpy(), (alpha.astype(np.float32)[:, None] * _unit_alpha_product(tx, tw)))
    # a wgrad dy^T x from the transposes: the columnwise amaxes, x's (row-scaled) one per output column
    g = torch.Generator().manual_seed(4)
    dy = _quantizer().quantize(torch.randn(64, 48, generator=g))
    x = _quantizer(row_scaled_nvfp4=True).quantize(torch.randn(64, 32, generator=g) * torch.logspace(-3, 3, 32))
    dw = dy._quantizer.qgemm(dy.data_t, x.data_t, None, torch.float32, dy.scale_t, x.scale_t,
                             gemm_type=gemm.GEMMType.WGRAD, qresult_x=dy, qresult_w=x)
    assert x.global_amax_col.shape == (32,)
    alpha = (dy.global_amax_col.numpy() * x.global_amax_col.numpy()) / np.float32(6.0 * 6.0 * 448.0 * 448.0)
    transposes = (NVFP4TensorRef(data=t.data_t, scale=t.scale_t) for t in (dy, x))
    np.testing.assert_array_equal(dw.numpy(), alpha.astype(np.float32)[None, :] * _unit_alpha_product(*transposes))


def test_qgemm_refusals_and_decode():
    tx, tw = _operands(False)
    q = tx._quantizer
    with pytest.raises(ValueError, match="bias"):
        q.qgemm(tx.data, tw.data, None, torch.float32, tx.scale, tw.scale, bias=torch.ones(32), qresult_x=tx,
                qresult_w=tw)
    with pytest.raises(ValueError, match="qresult_x"):
        q.qgemm(tx.data, tw.data, None, torch.float32, tx.scale, tw.scale)
    with pytest.raises(ValueError, match="needs out"):
        q.qgemm(tx.data, tw.data, None, torch.float32, tx.scale, tw.scale, accumulate=True, qresult_x=tx,
                qresult_w=tw)
    with pytest.raises(ValueError, match="multiple of 32"):
        q.qgemm(tx.data[:, :8], tw.data[:, :8], None, torch.float32, tx.scale[:, :1], tw.scale[:, :1],
                qresult_x=tx, qresult_w=tw)
    np.testing.assert_array_equal(cast_from_fp4x2(tx.data, torch.float32).numpy(),
                                  ref.nvfp4_values(tx.data.numpy()).astype(np.float32))
