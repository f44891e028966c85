"""The accelerator GEMM paths of fp8kit.pytorch.gemm run with real numbers on the CPU: `scaled_mm` (torch's CPU
`_scaled_mm` takes any layout and size, so the operand layouts, `data_t`, the zero padding and the bias handling
are checked for values here, and for CUDA's layout rules on meta tensors in test_cuda_path.py) and `widened_gemm`
(pure E5M2), against tests/reference.py-style decoding with ml_dtypes in float64.

The operands are FP8 values of small magnitude with K <= 64, so every product and sum is exact in float32 and the
results must equal the float64 reference rounded once to the output dtype."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8kit.pytorch.gemm import scaled_mm, widened_gemm
from fp8kit.pytorch.tensor import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
pytestmark = pytest.mark.filterwarnings("ignore:fp8kit. FP8 GEMM:UserWarning")  # the padding notice
NP = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def _fp8(shape, fp8_dtype, seed, inv):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randint(-8, 9, shape, generator=g) / 4).to(fp8_dtype)  # exact in both formats
    return Float8Tensor(data, torch.tensor(inv, dtype=torch.float32), torch.bfloat16)


def _reference(a: Float8Tensor, b: Float8Tensor, bias, out_dtype):
    """float64 GEMM of the decoded bytes, times float32(inv_a * inv_b), plus the bias, rounded to out_dtype."""
    av = a.data.contiguous().view(torch.uint8).numpy().view(NP[a.fp8_dtype]).astype(np.float64)
    bv = b.data.contiguous().view(torch.uint8).numpy().view(NP[b.fp8_dtype]).astype(np.float64)
    alpha = np.float64(np.float32(a.scale_inv.item()) * np.float32(b.scale_inv.item()))
    out = (av @ bv) * alpha
    if bias is not None:
        out = out + bias.double().numpy()
    return torch.from_numpy(out).to(out_dtype)


def _with_transpose(q: Float8Tensor) -> Float8Tensor:
    return Float8Tensor(q.data, q.scale_inv, q.dtype, data_t=q.data.t().contiguous())


@pytest.mark.parametrize("k,n", [(32, 48), (20, 40), (64, 17)])  # aligned; K and N padded; N padded
@pytest.mark.parametrize("bias_dtype,out_dtype", [(None, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("layout", ["plain", "data_t", "transposed_views"])
def test_scaled_mm_values(k, n, bias_dtype, out_dtype, layout):
    m = 24
    a, b = _fp8((m, k), E4M3, 1, 0.5), _fp8((k, n), E5M2, 2, 4.0)
    bias = None if bias_dtype is None else (torch.randint(-8, 9, (n,)) / 8).to(bias_dtype)
    want = _reference(a, b, bias, out_dtype)
    if layout == "data_t":  # b from its transposed bytes (as W for dgrad, x for wgrad)
        b = _with_transpose(b)
    elif layout == "transposed_views":  # a = dy.t() and b = W.t() as the fprop/wgrad operands are made
        a = _with_transpose(Float8Tensor(a.data.t().contiguous(), a.scale_inv, a.dtype)).t()
        b = Float8Tensor(b.data.t().contiguous(), b.scale_inv, b.dtype).t()
    out = scaled_mm(a, b, out_dtype, bias)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    assert torch.equal(out, want)


def test_scaled_mm_empty_and_mismatch():
    a, b = _fp8((0, 32), E4M3, 1, 1.0), _fp8((32, 16), E4M3, 2, 1.0)
    bias = torch.ones(16, dtype=torch.bfloat16)
    out = scaled_mm(a, b, torch.bfloat16, bias)
    assert out.shape == (0, 16)
    out = scaled_mm(_fp8((3, 0), E4M3, 1, 1.0), _fp8((0, 16), E4M3, 2, 1.0), torch.bfloat16, bias)
    assert torch.equal(out, bias.expand(3, 16))
    with pytest.raises(ValueError, match=r"\[M, K\] and b \[K, N\].*\(2, 32\)"):
        scaled_mm(_fp8((4, 32), E4M3, 1, 1.0), _fp8((2, 32), E4M3, 2, 1.0), torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_widened_gemm_values(out_dtype):
    """Pure E5M2 (both operands), any layout, with a bias: the float32 result rounded once."""
    a, b = _fp8((24, 40), E5M2, 3, 0.25), _fp8((40, 18), E5M2, 4, 8.0)
    bias = (torch.randint(-8, 9, (18,)) / 8).to(out_dtype)
    want = _reference(a, b, bias, out_dtype)
    out = widened_gemm(a, Float8Tensor(b.data.t().contiguous(), b.scale_inv, b.dtype).t(), out_dtype, bias)
    assert out.dtype == out_dtype and torch.equal(out, want)


def test_float8_tensor_data_t():
    data = (torch.arange(12).reshape(3, 4) / 4).to(E4M3)
    inv = torch.tensor(2.0)
    q = Float8Tensor(data, inv, torch.bfloat16, data_t=data.t().contiguous())
    qt = q.t()
    assert qt.data.data_ptr() == q.data_t.data_ptr() and qt.data_t.data_ptr() == q.data.data_ptr()  # no copies
    assert qt.t().data.data_ptr() == data.data_ptr()
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    plain = Float8Tensor(data, inv).t()
    assert plain.data_t is None and torch.equal(plain.data.view(torch.uint8), data.t().view(torch.uint8))
    nd = (torch.arange(24).reshape(2, 3, 4) / 8).to(E5M2)
    Float8Tensor(nd, inv, data_t=nd.reshape(6, 4).t().contiguous())  # N-d data: the transpose of its 2-D view
    for bad in (data.t(), data.t().contiguous().to(E5M2), data.contiguous(), torch.zeros(4, 3, dtype=E4M3).t()):
        with pytest.raises(ValueError, match="data_t must be a contiguous"):
            Float8Tensor(data, inv, data_t=bad)
