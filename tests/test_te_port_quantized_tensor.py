"""Our port of Transformer Engine's tests/pytorch/test_quantized_tensor.py for the per-tensor FP8 tensors: the
constructor, quantize / dequantize against the NumPy reference (bytes and scale_inv), the noop flag, operations on
dequantized values, chunks, in-place updates, serialization, `.data` assignment and current scaling's options."""

import io

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te

import reference as ref

FMT = {te.DType.kFloat8E4M3: "e4m3", te.DType.kFloat8E5M2: "e5m2"}


def to_float8(x, fp8_dtype=te.DType.kFloat8E4M3, scale=1.0):
    q = te.Float8Quantizer(scale=torch.full([1], scale), amax=torch.empty([1]), fp8_dtype=fp8_dtype)
    return q(x)


def test_constructor():
    t = te.Float8Tensor(shape=[3, 5], dtype=torch.bfloat16, data=torch.zeros(3, 5, dtype=torch.uint8),
                        fp8_dtype=te.DType.kFloat8E4M3, fp8_scale_inv=torch.full([1], 0.375))
    assert list(t.size()) == [3, 5] and t.dtype == torch.bfloat16 and t.is_cpu
    assert torch.count_nonzero(t.dequantize()) == 0


@pytest.mark.parametrize("fp8_dtype,dtype,scale,dims", [
    (te.DType.kFloat8E4M3, torch.float32, 3.5, [23]),
    (te.DType.kFloat8E5M2, torch.bfloat16, 0.25, [7, 5, 3]),
    (te.DType.kFloat8E4M3, torch.float16, 2.0 ** 10, []),
    (te.DType.kFloat8E5M2, torch.float32, 1.0, [2, 3, 5, 3]),
])
def test_quantize_dequantize(fp8_dtype, dtype, scale, dims):
    x = (2 * torch.rand(dims) - 1).to(dtype)
    q = to_float8(x, fp8_dtype, scale)
    expected, scale_inv = ref.cast(x.float().numpy(), FMT[fp8_dtype], scale)
    np.testing.assert_array_equal(q._data.numpy(), expected)
    assert float(q._scale_inv) == scale_inv
    deq = ref.dequantize(expected, FMT[fp8_dtype], scale_inv)
    np.testing.assert_array_equal(q.dequantize(dtype=torch.float32).numpy(), deq)
    assert q.dequantize().dtype == dtype


@pytest.mark.parametrize("noop", [True, False])
def test_quantize_noop_flag(noop):
    x = 2 * torch.rand(23) - 1
    q = to_float8(x, scale=3.5)
    before = q._data.clone()
    q.quantize_(2 * x, noop_flag=torch.full([1], 1.0 if noop else 0.0))
    if noop:
        assert torch.equal(q._data, before)
    else:
        np.testing.assert_array_equal(q._data.numpy(), ref.cast((2 * x).numpy(), "e4m3", 3.5)[0])


def test_basic_and_inplace_ops_run_on_dequantized_values():
    x, y = 2 * torch.rand(23) - 1, 2 * torch.rand(23) - 1
    xq, yq = to_float8(x, scale=3.5), to_float8(y, scale=3.5)
    xd, yd = xq.dequantize(), yq.dequantize()
    assert torch.equal(-xq, -xd) and torch.equal(xq.abs(), xd.abs())
    assert torch.equal(xq + yq, xd + yd) and torch.equal(xq * yq, xd * yd) and torch.equal(torch.sin(xq), torch.sin(xd))
    # in place: the result is quantized back into xq with its scale
    xq += yd
    expected, _ = ref.cast((xd + yd).numpy(), "e4m3", 3.5)
    assert isinstance(xq, te.Float8Tensor)
    np.testing.assert_array_equal(xq._data.numpy(), expected)


@pytest.mark.parametrize("dims", [[2], [4, 4], [8, 5, 3, 3]])
def test_chunk(dims):
    q = to_float8(torch.randn(dims))
    a, b = q.chunk(2, dim=0)
    assert a.shape == b.shape == torch.Size([dims[0] // 2] + dims[1:])
    assert torch.equal(a, q[: dims[0] // 2]) and torch.equal(b, q[dims[0] // 2:])


def test_serialization_round_trips_the_bytes():
    q = to_float8(2 * torch.rand(2, 3, 5) - 1, scale=0.5)
    expected = q.dequantize()
    buf = io.BytesIO()
    torch.save(q, buf)
    q._data.zero_()
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert isinstance(back, te.Float8Tensor) and torch.equal(back.dequantize(), expected)


def test_set_data():
    x = to_float8(torch.zeros(4))
    x.data = torch.zeros(3, 2, dtype=torch.float16)  # a plain tensor is quantized into x
    assert isinstance(x, te.Float8Tensor) and x.shape == x._data.shape == (3, 2) and x.dtype == torch.float16
    y = to_float8(torch.ones(4, 3, 1))
    x.data = y  # a Float8Tensor gives its buffers
    assert x._data is y._data and x._scale_inv is y._scale_inv and x.shape == (4, 3, 1)


@pytest.mark.parametrize("fp8_dtype,dtype,dims,pow2,eps", [
    (te.DType.kFloat8E4M3, torch.bfloat16, [311], False, 0.0),
    (te.DType.kFloat8E5M2, torch.float32, [7, 11], True, 0.0),
    (te.DType.kFloat8E4M3, torch.float16, [2, 3, 5, 3], True, 1e-6),
    (te.DType.kFloat8E4M3, torch.float32, [], False, 1e-6),
])
def test_current_scaling_quantize(fp8_dtype, dtype, dims, pow2, eps):
    x = (2 * torch.rand(dims) - 1).to(dtype)
    q = te.Float8CurrentScalingQuantizer(fp8_dtype=fp8_dtype, device="cpu", force_pow_2_scales=pow2,
                                         amax_epsilon=eps)(x)
    expected, scale_inv = ref.current_cast(x.float().numpy(), FMT[fp8_dtype], eps, pow2)
    np.testing.assert_array_equal(q._data.numpy(), expected)
    assert float(q._scale_inv) == scale_inv


def test_zero_input_current_scaling_keeps_scale_one():
    q = te.Float8CurrentScalingQuantizer(fp8_dtype=te.DType.kFloat8E4M3, device="cpu")(torch.zeros(8))
    assert float(q._scale_inv) == 1.0 and torch.count_nonzero(q._data) == 0


def test_detach_and_view_rules():
    q = to_float8(torch.randn(4, 4))
    d = q.detach()
    assert isinstance(d, te.Float8Tensor) and d._data is q._data
    assert torch.equal(q.view(16), q.dequantize().view(16))  # Float8Tensor keeps views of its bytes
    with pytest.raises(NotImplementedError, match="QuantizedTensor class does not support tensor views"):
        te.QuantizedTensor((8, 8), torch.bfloat16).view(-1)  # the base class has no data to view
