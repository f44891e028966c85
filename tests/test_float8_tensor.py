"""Float8Tensor as a torch.Tensor, Transformer Engine's quantizers and import paths, checked against
tests/reference.py (NumPy + ml_dtypes) and against the same operations on the FP8 bytes or the dequantized values."""

import copy
import io

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_saved,
)
from fp8kit.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

import reference as ref
from linear_helpers import np32

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def bytes_of(q) -> np.ndarray:
    return q._data.contiguous().view(torch.uint8).numpy()


def make(x, scale=2.0, fmt="e4m3", dtype=torch.bfloat16):
    quantizer = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), te.DType.kFloat8E4M3 if fmt == "e4m3"
                                else te.DType.kFloat8E5M2)
    return quantizer(x.to(dtype)), quantizer


def test_attributes_and_nominal_dtype():
    x = torch.randn(6, 8)
    q, _ = make(x)
    assert isinstance(q, torch.Tensor) and isinstance(q, Float8Tensor) and isinstance(q, QuantizedTensor)
    assert q.dtype == torch.bfloat16 and q.shape == (6, 8) and q.device == x.device and q.size() == (6, 8)
    assert q._data.dtype == torch.uint8 and q._fp8_dtype == te.DType.kFloat8E4M3 and q.fp8_dtype == E4M3
    assert q._scale_inv.shape == (1,) and q._scale_inv.item() == 0.5
    want, _ = ref.cast(np32(x.to(torch.bfloat16)), "e4m3", 2.0)
    assert np.array_equal(bytes_of(q), want)
    d = q.dequantize()
    assert d.dtype == torch.bfloat16  # the nominal dtype, as Transformer Engine
    np.testing.assert_array_equal(q.dequantize(dtype=torch.float32).numpy(), ref.dequantize(want, "e4m3", 0.5))


@pytest.mark.parametrize("op", [
    lambda t: t.view(3, 16), lambda t: t.reshape(48), lambda t: t.t(), lambda t: t.transpose(0, 1),
    lambda t: t.permute(1, 0), lambda t: t.t().contiguous(), lambda t: t.clone(), lambda t: t.detach(),
    lambda t: t.to("cpu"), lambda t: t.cpu(), lambda t: t[1:4], lambda t: t[2], lambda t: t[:, ::2],
])
def test_exact_operations_stay_fp8(op):
    q, _ = make(torch.randn(6, 8))
    out = op(q)
    assert isinstance(out, Float8Tensor) and out.dtype == q.dtype
    assert torch.equal(out._data.view(torch.uint8), op(q._data.view(torch.uint8)))  # the same bytes, moved
    assert torch.equal(out._scale_inv, q._scale_inv)
    assert torch.equal(out.dequantize(), op(q.dequantize()))


def test_split_chunk_and_cat():
    q, _ = make(torch.randn(6, 8))
    parts = q.chunk(3)
    assert all(isinstance(p, Float8Tensor) and p.shape == (2, 8) for p in parts)
    sizes = q.split([2, 4], dim=0)
    assert [p.shape[0] for p in sizes] == [2, 4]
    back = torch.cat(parts)
    assert isinstance(back, Float8Tensor) and torch.equal(back._data.view(torch.uint8), q._data.view(torch.uint8))
    other, _ = make(torch.randn(2, 8), scale=8.0)
    mixed = torch.cat([parts[0], other])  # different scales: the values, concatenated in high precision
    assert not isinstance(mixed, Float8Tensor)
    assert torch.equal(mixed, torch.cat([parts[0].dequantize(), other.dequantize()]))


def test_other_operations_run_on_dequantized_values():
    q, _ = make(torch.randn(6, 8))
    w = torch.randn(8, 3, dtype=torch.bfloat16)
    for got, want in ((q + 1, q.dequantize() + 1), (q @ w, q.dequantize() @ w), (q.sum(), q.dequantize().sum()),
                      (torch.nn.functional.gelu(q), torch.nn.functional.gelu(q.dequantize()))):
        assert not isinstance(got, Float8Tensor) and torch.equal(got, want)
    torch.testing.assert_close(q, q.dequantize())  # compares values


def test_copy_and_inplace_arithmetic_quantize_back_with_its_scale():
    q, quantizer = make(torch.randn(6, 8), scale=4.0)
    src = torch.randn(6, 8)
    q.copy_(src)
    want, _ = ref.cast(np32(src), "e4m3", 4.0)
    assert np.array_equal(bytes_of(q), want) and q._scale_inv.item() == 0.25
    before = q.dequantize(dtype=torch.float32)
    q.mul_(3.0)
    want, _ = ref.cast(np32((before * 3).to(torch.bfloat16)), "e4m3", 4.0)
    assert isinstance(q, Float8Tensor) and np.array_equal(bytes_of(q), want)
    assert quantizer.amax.item() == ref.amax(np32((before * 3).to(torch.bfloat16)))  # delayed: amax recorded


def test_save_load_weights_only_deepcopy():
    q, _ = make(torch.randn(5, 4))
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert isinstance(loaded, Float8Tensor) and loaded.dtype == q.dtype
    assert torch.equal(loaded._data.view(torch.uint8), q._data.view(torch.uint8))
    assert torch.equal(loaded._scale_inv, q._scale_inv)
    twin = copy.deepcopy(q)
    twin.copy_(torch.zeros(5, 4))
    assert q.dequantize().abs().sum() > 0 and twin.dequantize().abs().sum() == 0


def test_quantize_and_dequantize_are_differentiable():
    x = torch.randn(4, 4, requires_grad=True)
    quantizer = Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, device="cpu")
    q = quantizer(x)
    assert isinstance(q, Float8Tensor) and q.requires_grad
    (q.dequantize() * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((4, 4), 3.0))  # straight-through
    x.grad = None
    (quantizer(x) * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((4, 4), 2.0))


def test_current_scaling_quantizer_matches_the_reference():
    x = torch.randn(16, 32) * 7
    for pow2, eps in ((False, 0.0), (True, 0.0), (False, 100.0)):
        quantizer = Float8CurrentScalingQuantizer(E5M2, None, force_pow_2_scales=pow2, amax_epsilon=eps)
        q = quantizer(x)
        scale = ref.current_scale(ref.amax(np32(x)), 57344.0, eps, pow2)
        want, inv = ref.cast(np32(x), "e5m2", scale)
        assert np.array_equal(bytes_of(q), want) and q._scale_inv.item() == inv


def test_delayed_quantizer_records_amax_and_update_quantized():
    scale, amax = torch.tensor([8.0]), torch.zeros(1)
    quantizer = Float8Quantizer(scale, amax, te.DType.kFloat8E5M2, columnwise=False)
    x1, x2 = torch.randn(4, 4), torch.randn(4, 4) * 3
    quantizer(x1)
    quantizer(x2)
    assert amax.item() == max(ref.amax(np32(x1)), ref.amax(np32(x2)))  # max-accumulated, as the staging slot
    dst = quantizer.make_empty((4, 4), dtype=torch.float32)
    assert isinstance(dst, Float8Tensor) and dst._fp8_dtype == te.DType.kFloat8E5M2
    quantizer.update_quantized(x1, dst)
    want, _ = ref.cast(np32(x1), "e5m2", 8.0)
    assert np.array_equal(bytes_of(dst), want)
    quantizer.set_usage(rowwise=True, columnwise=True)
    assert quantizer.columnwise_usage
    quantizer.internal = True
    storage = quantizer(x1)
    assert isinstance(storage, QuantizedTensorStorage) and not isinstance(storage, torch.Tensor)
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8Quantizer(scale, amax, torch.bfloat16)
    with pytest.raises(TypeError, match="scale must be a float32 tensor with one element"):
        Float8Quantizer(torch.ones(2), amax, E4M3)


def test_import_paths_as_transformer_engine():
    import fp8kit.pytorch.quantized_tensor as qt
    import fp8kit.pytorch.tensor.float8_tensor as ft

    for name in ("Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"):
        assert getattr(ft, name) is getattr(te, name)
    for name in ("QuantizedTensor", "QuantizedTensorStorage", "Quantizer", "prepare_for_saving",
                 "restore_from_saved", "restore_from_func_ctx"):
        assert hasattr(qt, name)
    assert issubclass(Float8Quantizer, Quantizer)
    assert te.DType.kFloat8E4M3 == 7 and te.DType.kFloat8E5M2 == 8 and te.DType.kBFloat16 == 6


def test_prepare_for_saving_round_trip():
    q, _ = make(torch.randn(4, 4))
    storage = q.storage_view()

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            tensors, ctx.tensor_objects = prepare_for_saving(x, s)
            ctx.save_for_backward(*tensors)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            x, s = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
            ctx.seen = s.dequantize(dtype=torch.float32)
            return g, None

    x = torch.randn(4, 4, requires_grad=True)
    y = F.apply(x, storage)
    y.sum().backward()
    assert torch.equal(y.grad_fn.seen if hasattr(y.grad_fn, "seen") else storage.dequantize(dtype=torch.float32),
                       q.dequantize(dtype=torch.float32))


def test_compile_sees_a_float8_tensor():
    q, _ = make(torch.randn(8, 8))
    fn = torch.compile(lambda t: t.dequantize(dtype=torch.float32) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(q), q.dequantize(dtype=torch.float32) * 2)
