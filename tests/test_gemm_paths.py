"""The accelerator GEMM paths of fp8kit.pytorch.gemm run with real numbers on the CPU: `scaled_mm` (torch's CPU
`_scaled_mm` takes any layout and size, so the operand layouts, `_transpose`, the zero padding and the bias handling
are checked for values here, and for CUDA's layout rules on meta tensors in test_cuda_path.py) and `widened_gemm`
(pure E5M2), against tests/reference.py-style decoding with ml_dtypes in float64.

The operands are FP8 values of small magnitude with K <= 64, so every product and sum is exact in float32 and the
results must equal the float64 reference rounded once to the output dtype."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8kit.pytorch.gemm import scaled_mm, widened_gemm
from fp8kit.pytorch.tensor import Float8TensorStorage

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
pytestmark = pytest.mark.filterwarnings("ignore:fp8kit. FP8 GEMM:UserWarning")  # the padding notice
NP = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def _st(data, inv, dtype=None, data_t=None) -> Float8TensorStorage:
    return Float8TensorStorage(data=data, fp8_scale_inv=inv.reshape(1), fake_dtype=dtype, data_transpose=data_t)


def _fp8(shape, fp8_dtype, seed, inv):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randint(-8, 9, shape, generator=g) / 4).to(fp8_dtype)  # exact in both formats
    return _st(data, torch.tensor(inv, dtype=torch.float32), torch.bfloat16)


def _reference(a: Float8TensorStorage, b: Float8TensorStorage, bias, out_dtype):
    """float64 GEMM of the decoded bytes, times float32(inv_a * inv_b), plus the bias, rounded to out_dtype."""
    av = a._data.contiguous().view(torch.uint8).numpy().view(NP[a.fp8_dtype]).astype(np.float64)
    bv = b._data.contiguous().view(torch.uint8).numpy().view(NP[b.fp8_dtype]).astype(np.float64)
    alpha = np.float64(np.float32(a.scale_inv.item()) * np.float32(b.scale_inv.item()))
    out = (av @ bv) * alpha
    if bias is not None:
        out = out + bias.double().numpy()
    return torch.from_numpy(out).to(out_dtype)


def _with_transpose(q: Float8TensorStorage) -> Float8TensorStorage:
    return _st(q.fp8_view(), q.scale_inv, q.dtype, data_t=q.fp8_view().t().contiguous())


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
        a = _with_transpose(_st(a.fp8_view().t().contiguous(), a.scale_inv, a.dtype)).transposed()
        b = _st(b.fp8_view().t().contiguous(), b.scale_inv, b.dtype).transposed()
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
    out = widened_gemm(a, _st(b.fp8_view().t().contiguous(), b.scale_inv, b.dtype).transposed(), out_dtype, bias)
    assert out.dtype == out_dtype and torch.equal(out, want)


def test_float8_storage_transpose():
    data = (torch.arange(12).reshape(3, 4) / 4).to(E4M3)
    inv = torch.tensor(2.0)
    q = _st(data, inv, torch.bfloat16, data_t=data.t().contiguous())
    qt = q.transposed()
    # no copies
    assert qt._data.data_ptr() == q._transpose.data_ptr() and qt._transpose.data_ptr() == q._data.data_ptr()
    assert qt.transposed()._data.data_ptr() == data.data_ptr()
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    plain = _st(data, inv).transposed()
    assert plain._transpose is None and torch.equal(plain._data.view(torch.uint8), data.t().view(torch.uint8))
    nd = (torch.arange(24).reshape(2, 3, 4) / 8).to(E5M2)
    _st(nd, inv, data_t=nd.reshape(6, 4).t().contiguous())  # N-d data: the transpose of its 2-D view
    for bad in (data.t(), data.t().contiguous().to(E5M2), data.contiguous(), torch.zeros(4, 3, dtype=E4M3).t()):
        with pytest.raises(ValueError, match="data_transpose must be a contiguous"):
            _st(data, inv, data_t=bad)
