"""Row-scaled NVFP4 (`NVFP4Quantizer(row_scaled_nvfp4=True)`, `NVFP4BlockScaling(row_scaled_activation=True)`): one
global scale per row, bytes and amaxes against the reference (tests/reference.py, `nvfp4_quantize(row_scaled=True)`),
the GEMM's per-row / per-column output scaling against `reference.nvfp4_gemm`, TE's allocator (`make_empty`) and a
Linear's three GEMMs bit for bit."""

import numpy as np
import pytest
import torch
from block_helpers import special_blocks, to_np32, wide_range

import fp8kit.pytorch as te
from fp8kit.pytorch.nvfp4_gemm import nvfp4_gemm
from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage
from fp8kit.recipe import NVFP4BlockScaling

import reference as ref


def _input(dtype, m=48, k=64, seed=0):
    """Rows over the whole range of `dtype`, some holding special blocks (zero, NaN, inf, subnormal) in their
    first 16 values, and one all-zero row."""
    x = wide_range((m, k), dtype, seed=seed)
    x = x * torch.logspace(-20, 20, m, dtype=torch.float64)[:, None].to(dtype)  # row amaxes far apart
    specials = special_blocks(16, dtype)
    x[: specials.shape[0], :16] = specials
    x[-1] = 0
    return x


def _check_layout(q, x2: np.ndarray, columnwise: bool):
    want = x2.T.copy() if columnwise else x2
    rows, cols = want.shape
    packed, scales, amax = ref.nvfp4_quantize(want, row_scaled=True)
    data = q._columnwise_data if columnwise else q._rowwise_data
    padded = q._columnwise_scale_inv if columnwise else q._rowwise_scale_inv
    got_amax = q._amax_columnwise if columnwise else q._amax_rowwise
    np.testing.assert_array_equal(data.reshape(rows, cols // 2).numpy(), packed)
    np.testing.assert_array_equal(padded[:rows, : cols // 16].numpy(), scales)
    assert got_amax.dtype == torch.float32 and got_amax.shape == (rows,)
    np.testing.assert_array_equal(got_amax.numpy(), amax)
    rest = padded.clone()
    rest[:rows, : cols // 16] = 0
    assert not rest.any(), "scale padding must be zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_matches_reference_both_usages(dtype):
    x = _input(dtype)
    q = NVFP4Quantizer(row_scaled_nvfp4=True)(x)
    assert q._row_scaled_nvfp4
    for columnwise in (False, True):
        _check_layout(q, to_np32(x), columnwise)


def test_3d_input_and_rowwise_only():
    x = wide_range((2, 32, 48), torch.bfloat16, seed=2)
    q = NVFP4Quantizer(columnwise=False, row_scaled_nvfp4=True)(x)
    assert q._columnwise_data is None and q._rowwise_data.shape == (2, 32, 24)
    _check_layout(q, to_np32(x.reshape(64, 48)), False)


def test_a_row_scale_changes_only_its_row():
    """Scaling one row by 2**k leaves every other row's bytes alone (per-tensor NVFP4 would change them all)."""
    x = torch.randn(32, 64)
    y = x.clone()
    y[5] *= 2.0 ** 40
    a, b = (NVFP4Quantizer(columnwise=False, row_scaled_nvfp4=True)(t) for t in (x, y))
    same = torch.ones(32, dtype=torch.bool)
    same[5] = False
    assert torch.equal(a._rowwise_data[same], b._rowwise_data[same])
    assert torch.equal(a._rowwise_data[5], b._rowwise_data[5])  # a power of two: the same codes, amax x 2**40
    assert b._amax_rowwise[5] == a._amax_rowwise[5] * 2.0 ** 40


def test_dequantize_uses_each_rows_scale():
    x = _input(torch.float32, seed=3)
    x = torch.where(torch.isfinite(x), x, torch.zeros(()))
    q = NVFP4Quantizer(row_scaled_nvfp4=True)(x)
    packed, scales, amax = ref.nvfp4_quantize(to_np32(x), row_scaled=True)
    e4m3 = ref.fp8_values(scales, "e4m3").astype(np.float32)
    decode = np.array([np.float32(1) / ref.nvfp4_global_scale(a) for a in amax], np.float32)
    want = ref.nvfp4_values(packed).astype(np.float32).reshape(48, 4, 16) * (e4m3 * decode[:, None])[:, :, None]
    np.testing.assert_array_equal(q.dequantize().numpy(), want.reshape(48, 64))
    col_only = NVFP4Quantizer(row_scaled_nvfp4=True)(x)
    col_only.update_usage(rowwise_usage=False)  # then from the transpose, each of its rows (x's columns) scaled
    packed_t, scales_t, amax_t = ref.nvfp4_quantize(to_np32(x).T.copy(), row_scaled=True)
    decode_t = np.array([np.float32(1) / ref.nvfp4_global_scale(a) for a in amax_t], np.float32)
    want_t = ref.nvfp4_values(packed_t).astype(np.float32).reshape(64, 3, 16) * \
        (ref.fp8_values(scales_t, "e4m3").astype(np.float32) * decode_t[:, None])[:, :, None]
    np.testing.assert_array_equal(col_only.dequantize().numpy(), want_t.reshape(64, 48).T)


def test_refused_combinations():
    x = torch.randn(32, 32)
    for kwargs in (dict(with_rht=True, with_post_rht_amax=True), dict(with_2d_quantization=True),
                   dict(stochastic_rounding=True)):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"does not support {name}"):
            NVFP4Quantizer(row_scaled_nvfp4=True, **kwargs)(x)
    with pytest.raises(ValueError, match="requires rowwise usage"):
        NVFP4Quantizer(rowwise=False, row_scaled_nvfp4=True)(x)
    with pytest.raises(NotImplementedError, match="4over6"):
        NVFP4TensorStorage(None, None, torch.zeros(16, 8, dtype=torch.uint8), None, None, None,
                           nvfp4_use_4over6=True)


@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("internal", [False, True])
def test_make_empty_then_update_quantized(row_scaled, internal):
    """TE's python allocator: the layouts of TE's C++ one, then `update_quantized` gives the bytes of `quantize`."""
    q = NVFP4Quantizer(row_scaled_nvfp4=row_scaled)
    q.internal = internal
    e = q.make_empty((2, 48, 64), dtype=torch.bfloat16)
    assert type(e) is (NVFP4TensorStorage if internal else NVFP4Tensor)
    assert e._rowwise_data.shape == (2, 48, 32) and e._columnwise_data.shape == (64, 48)
    assert e._rowwise_scale_inv.shape == (128, 4) and e._columnwise_scale_inv.shape == (128, 8)
    assert e._amax_rowwise.shape == ((96,) if row_scaled else (1,))
    assert e._amax_columnwise.shape == ((64,) if row_scaled else (1,))
    assert e.dtype == torch.bfloat16 and tuple(e.shape) == (2, 48, 64) and e._row_scaled_nvfp4 == row_scaled
    x = _input(torch.bfloat16, 96, 64, seed=4).reshape(2, 48, 64)
    out = q.update_quantized(x, e)
    want = q(x)
    for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
                 "_amax_rowwise", "_amax_columnwise"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name
    with pytest.raises(ValueError, match="divisible by 16"):
        q.make_empty((24, 64))


def _fields(t, columnwise: bool):
    m, k = t.shape[0], t.shape[1]
    if columnwise:
        return (t._columnwise_data.numpy(), t._columnwise_scale_inv[:k, : m // 16].numpy(),
                t._amax_columnwise.numpy())
    return t._rowwise_data.numpy(), t._rowwise_scale_inv[:m, : k // 16].numpy(), t._amax_rowwise.numpy()


@pytest.mark.parametrize("a_rows, b_rows", [(True, False), (False, True), (True, True)])
def test_gemm_scales_output_rows_and_columns(a_rows, b_rows):
    """Row-scaled A (output rows), row-scaled B (output columns), both (bilateral): against the reference."""
    g = torch.Generator().manual_seed(5)
    a, b = ((torch.randn(n, 64, generator=g) * torch.logspace(-6, 6, n)[:, None]).bfloat16() for n in (48, 32))
    a[7] = 0
    qa = NVFP4Quantizer(row_scaled_nvfp4=a_rows)(a)
    qb = NVFP4Quantizer(row_scaled_nvfp4=b_rows)(b)
    want = ref.nvfp4_gemm(*_fields(qa, False), *_fields(qb, False))
    np.testing.assert_array_equal(nvfp4_gemm(qa, qb).numpy(), want)
    bias = torch.randn(32)
    got = nvfp4_gemm(qa, qb, bias=bias, out_dtype=torch.bfloat16)
    np.testing.assert_array_equal(got.float().numpy(), ref.bf16_of(want + to_np32(bias)).astype(np.float32))
    out = torch.randn(48, 32)
    expect = out + torch.from_numpy(want)
    nvfp4_gemm(qa, qb, out=out, accumulate=True)
    assert torch.equal(out, expect)
    # the transposes: A^T B from the columnwise layouts (a wgrad), per-column scales of the (64, 64) output
    at = NVFP4Quantizer(row_scaled_nvfp4=a_rows)(a[:32].contiguous())
    want_t = ref.nvfp4_gemm(*_fields(at, True), *_fields(qb, True))
    np.testing.assert_array_equal(nvfp4_gemm(at, qb, transpose_a=True, transpose_b=True).numpy(), want_t)


def test_linear_row_scaled_activation_bit_exact():
    """fprop with the row-scaled input, dgrad per tensor, wgrad with the input's per-column amaxes."""
    torch.manual_seed(7)
    lin = te.Linear(64, 32, bias=True, params_dtype=torch.bfloat16)
    x = (torch.randn(64, 64) * torch.logspace(-4, 4, 64)[:, None]).bfloat16().requires_grad_(True)
    dy = torch.randn(64, 32, dtype=torch.bfloat16)
    recipe = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
                               row_scaled_activation=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    xn, wn, dyn = to_np32(x.detach()), to_np32(lin.weight.detach()), to_np32(dy)
    y_ref = ref.nvfp4_gemm(*ref.nvfp4_quantize(xn, row_scaled=True), *ref.nvfp4_quantize(wn))
    y_ref = y_ref + to_np32(lin.bias.detach())
    np.testing.assert_array_equal(y.detach().float().numpy(), ref.bf16_of(y_ref).astype(np.float32))
    dx_ref = ref.nvfp4_gemm(*ref.nvfp4_quantize(dyn), *ref.nvfp4_quantize(wn.T.copy()))
    np.testing.assert_array_equal(x.grad.float().numpy(), ref.bf16_of(dx_ref).astype(np.float32))
    dw_ref = ref.nvfp4_gemm(*ref.nvfp4_quantize(dyn.T.copy()), *ref.nvfp4_quantize(xn.T.copy(), row_scaled=True))
    np.testing.assert_array_equal(lin.weight.grad.float().numpy(), ref.bf16_of(dw_ref).astype(np.float32))


def test_row_scaled_recipe_with_rht_refused_when_quantizing():
    lin = te.Linear(32, 32)
    with pytest.raises(ValueError, match="does not support with_rht"):
        with te.autocast(recipe=NVFP4BlockScaling(row_scaled_activation=True)):
            lin(torch.randn(32, 32))


def test_views_copies_and_pickle_keep_row_scaling(tmp_path):
    x = torch.randn(4, 16, 32)
    q = NVFP4Quantizer(row_scaled_nvfp4=True)(x)
    for t in (q.view(64, 32), q.detach(), q.clone(), q.reshape(64, 32)):
        assert t._row_scaled_nvfp4 and torch.equal(t.dequantize().reshape(4, 16, 32), q.dequantize())
    path = tmp_path / "t.pt"
    torch.save(q, path)
    back = torch.load(path, weights_only=True)
    assert back._row_scaled_nvfp4 and torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("row_scaled", [False, True])
def test_empty_tensor_dequantizes(row_scaled):
    """An empty split (GroupedLinear) quantizes and dequantizes from either usage; its row amaxes are empty."""
    t = NVFP4Quantizer(row_scaled_nvfp4=row_scaled)(torch.empty(0, 32))
    assert t._amax_rowwise.shape == ((0,) if row_scaled else (1,))
    assert t.dequantize().shape == (0, 32)
    t.update_usage(rowwise_usage=False)
    assert t.dequantize().shape == (0, 32)
