"""NVFP4 x NVFP4 GEMM against the reference's accumulation (tests/reference.py, `nvfp4_gemm`), bit for bit, as a
Linear's fprop, dgrad and wgrad call it; close to the float64 product of the dequantized operands; dims refused."""

import numpy as np
import pytest
import torch
from block_helpers import wide_range

from fp8kit.pytorch.nvfp4_gemm import nvfp4_gemm, nvfp4_gemm_rule
from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

import reference as ref


def _ref(a, a_col: bool, b, b_col: bool) -> np.ndarray:
    def fields(t, col):
        k = t.shape[-1]
        m = t.numel() // k
        if col:
            return (t._columnwise_data.numpy(), t._columnwise_scale_inv[:k, : m // 16].numpy(),
                    t._amax_columnwise.item())
        return t._rowwise_data.reshape(m, k // 2).numpy(), t._rowwise_scale_inv[:m, : k // 16].numpy(), \
            t._amax_rowwise.item()
    qa, sa, aa = fields(a, a_col)
    qb, sb, ab = fields(b, b_col)
    return ref.nvfp4_gemm(qa, sa, aa, qb, sb, ab)


@pytest.mark.parametrize("two_d_w", [False, True])
def test_linear_gemms_bit_exact(two_d_w):
    x = wide_range((64, 96), torch.bfloat16, seed=5).float().clamp(-1e3, 1e3).bfloat16()
    w = torch.randn(32, 96, dtype=torch.bfloat16)
    dy = torch.randn(64, 32, dtype=torch.bfloat16)
    qx = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)(x)
    qw = NVFP4Quantizer(with_2d_quantization=two_d_w)(w)
    qdy = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)(dy)
    y = nvfp4_gemm_rule(qx, qw.transposed(), torch.float32)  # x @ w^T
    np.testing.assert_array_equal(y.numpy(), _ref(qx, False, qw, False))
    dx = nvfp4_gemm_rule(qdy, qw, torch.float32)  # dy @ w
    np.testing.assert_array_equal(dx.numpy(), _ref(qdy, False, qw, True))
    dw = nvfp4_gemm_rule(qdy.transposed(), qx, torch.float32)  # dy^T @ x, both through the transform
    np.testing.assert_array_equal(dw.numpy(), _ref(qdy, True, qx, True))
    # the transform cancels in the wgrad product (H^T H = I): close to dy^T @ x
    exact = dy.double().t() @ x.double()
    assert (dw.double() - exact).norm() < 0.35 * exact.norm()


def test_close_to_dequantized_product_and_out_dtype():
    a, b = torch.randn(32, 64), torch.randn(48, 64)
    qa, qb = NVFP4Quantizer()(a), NVFP4Quantizer()(b)
    y = nvfp4_gemm(qa, qb)
    exact = qa.dequantize().double() @ qb.dequantize().double().t()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    bias = torch.randn(48)
    yb = nvfp4_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, (y + bias).bfloat16())
    out = torch.ones(32, 48)
    nvfp4_gemm(qa, qb, out=out, accumulate=True)
    assert torch.equal(out, 1 + y)


def test_dims_refused():
    qa, qb = NVFP4Quantizer()(torch.randn(32, 48)), NVFP4Quantizer()(torch.randn(32, 48))
    with pytest.raises(ValueError, match="K divisible by 32"):
        nvfp4_gemm(qa, qb)
    qc = NVFP4Quantizer()(torch.randn(32, 64))
    with pytest.raises(ValueError, match="contraction dims differ"):
        nvfp4_gemm(qa, qc)
    with pytest.raises(TypeError, match="expected an NVFP4 tensor"):
        nvfp4_gemm(qa, torch.randn(32, 48))


def test_no_host_reads_on_meta():
    """Quantizer (RHT, 2D, stochastic rounding), dequantize and GEMM on the `meta` device, where any read of a value on
    the host raises: nothing in them synchronises a GPU."""
    x = torch.randn(64, 96, device="meta", dtype=torch.bfloat16)
    for kw in (dict(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True), dict(with_2d_quantization=True)):
        t = NVFP4Quantizer(**kw)(x)
        assert t._rowwise_data.device.type == "meta" and t.dequantize().shape == (64, 96)
        y = nvfp4_gemm(t, t, transpose_a=True, transpose_b=True, bias=torch.zeros(96, device="meta"))
        assert y.shape == (96, 96) and y.device.type == "meta"
