"""Float8Tensor as a torch.Tensor, Transformer Engine's quantizers and import paths, checked against
tests/reference.py (NumPy + ml_dtypes) and against the same operations on the FP8 bytes or the dequantized values."""

import copy
import io
import pickle

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


# ---- Transformer Engine's layout and tensor API (the per-tensor cases of TE's test_quantized_tensor.py) ----------

FMT = {"e4m3": (te.DType.kFloat8E4M3, E4M3), "e5m2": (te.DType.kFloat8E5M2, E5M2)}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype,shape", [(torch.float32, ()), (torch.bfloat16, (1,)), (torch.float16, (7, 11)),
                                         (torch.float32, (2, 3, 5, 3))])
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_data_is_uint8_bytes_named_by_fp8_dtype(fmt, dtype, shape, kind):
    x = (torch.rand(shape) * 4 - 2).to(dtype)
    te_fmt, torch_fmt = FMT[fmt]
    if kind == "delayed":
        q = Float8Quantizer(torch.full([1], 3.5), torch.zeros(1), te_fmt)(x)
        scale = 3.5
    else:
        q = Float8CurrentScalingQuantizer(te_fmt, "cpu", columnwise=False)(x)
        scale = ref.current_scale(ref.amax(np32(x)), 448.0 if fmt == "e4m3" else 57344.0, 0.0, False)
    want, inv = ref.cast(np32(x), fmt, scale)
    assert q._data.dtype == torch.uint8 and q._fp8_dtype == te_fmt and q.fp8_dtype == torch_fmt
    assert tuple(q._data.shape) == tuple(shape) == tuple(q.shape) and q.dtype == dtype
    assert np.array_equal(q._data.numpy(), want) and q._scale_inv.item() == inv
    assert q.fp8_view().dtype == torch_fmt and q.fp8_view().data_ptr() == q._data.data_ptr()
    assert q._transpose is None and q._transpose_invalid  # the CPU GEMM reads either layout: none is made
    deq = q.dequantize(dtype=torch.float32).numpy()
    assert np.array_equal(deq, ref.dequantize(want, fmt, inv), equal_nan=True)


def test_constructor_takes_uint8_with_fp8_dtype_or_float8_data():
    data = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    t = Float8Tensor(shape=(3, 4), dtype=torch.float16, data=data, fp8_dtype=te.DType.kFloat8E5M2,
                     fp8_scale_inv=torch.full([1], 0.375))
    assert t.shape == (3, 4) and t.dtype == torch.float16 and t._data is data and t.fp8_dtype == E5M2
    want = ref.dequantize(data.numpy(), "e5m2", 0.375)
    assert np.array_equal(t.dequantize(dtype=torch.float32).numpy(), want)
    legacy = Float8Tensor(data=data.view(E4M3), fp8_scale_inv=torch.ones(1))  # float8-typed data: its bytes
    assert legacy._data.dtype == torch.uint8 and legacy._fp8_dtype == te.DType.kFloat8E4M3
    assert torch.equal(legacy._data, data)
    assert te.make_float8_tensor(data.view(E4M3), torch.ones(1), torch.float32)._data.dtype == torch.uint8
    with pytest.raises(TypeError, match="uint8 data needs fp8_dtype"):
        Float8Tensor(data=data, fp8_scale_inv=torch.ones(1))
    with pytest.raises(TypeError, match="does not match"):
        Float8Tensor(data=data.view(E4M3), fp8_scale_inv=torch.ones(1), fp8_dtype=te.DType.kFloat8E5M2)
    with pytest.raises(TypeError, match="uint8 bytes"):
        Float8Tensor(data=data.int(), fp8_scale_inv=torch.ones(1), fp8_dtype=te.DType.kFloat8E4M3)


@pytest.mark.parametrize("noop", [True, False])
@pytest.mark.parametrize("on_device", [False, True])
def test_quantize_noop_flag(noop, on_device):
    from fp8kit.pytorch.tensor.float8_tensor import _update_unless

    x = torch.rand(23) * 2 - 1
    quantizer = Float8Quantizer(torch.full([1], 3.5), torch.zeros(1), te.DType.kFloat8E4M3)
    q = quantizer(x)
    before = (q._data.clone(), q._scale_inv.clone(), quantizer.amax.clone())
    new = 2 * x + 0.5
    flag = torch.ones(1) if noop else torch.zeros(1)
    if on_device:  # the branch-free update that accelerators (and CUDA graphs) use, run on CPU tensors
        _update_unless(quantizer, new, q, flag.reshape(()) != 0)
    else:
        q.quantize_(new, noop_flag=flag)
    if noop:
        assert torch.equal(q._data, before[0]) and torch.equal(q._scale_inv, before[1])
        assert torch.equal(quantizer.amax, before[2])
    else:
        want, inv = ref.cast(np32(new), "e4m3", 3.5)
        assert np.array_equal(q._data.numpy(), want) and q._scale_inv.item() == inv
        assert quantizer.amax.item() == max(ref.amax(np32(x)), ref.amax(np32(new)))


def test_quantize_from_a_quantized_tensor_and_into_another_format():
    x = torch.randn(6, 5)
    q, quantizer = make(x, scale=4.0, dtype=torch.float32)
    other, _ = make(x * 0.5, scale=16.0, fmt="e5m2", dtype=torch.float32)
    q.quantize_(other)  # the other tensor's values, with q's quantizer
    want, _ = ref.cast(other.dequantize().numpy(), "e4m3", 4.0)
    assert np.array_equal(q._data.numpy(), want)
    e5 = Float8Quantizer(torch.full([1], 2.0), torch.zeros(1), te.DType.kFloat8E5M2)
    e5.update_quantized(x, q)  # as Transformer Engine: the quantizer's format is written and recorded
    want, _ = ref.cast(np32(x), "e5m2", 2.0)
    assert q._fp8_dtype == te.DType.kFloat8E5M2 and np.array_equal(q._data.numpy(), want)


def test_setting_data():
    q, quantizer = make(torch.zeros(4), scale=2.0, dtype=torch.float32)
    plain = torch.randn(3, 2, dtype=torch.float16)
    q.data = plain  # quantized with the tensor's quantizer; shape and dtype follow
    assert isinstance(q, Float8Tensor) and q.shape == q._data.shape == (3, 2) and q.dtype == torch.float16
    want, _ = ref.cast(np32(plain), "e4m3", 2.0)
    assert np.array_equal(q._data.numpy(), want) and q.dequantize().dtype == torch.float16
    other, _ = make(torch.randn(4, 3, 1), dtype=torch.float32)
    q.data = other  # the other tensor's buffers
    assert q.shape == (4, 3, 1) and q.dtype == torch.float32
    assert q._data is other._data and q._scale_inv is other._scale_inv
    assert torch.equal(q.dequantize(), other.dequantize())


def test_detach_and_update_keep_a_derived_class():
    q, quantizer = make(torch.randn(8, 8))
    derived = type("DerivedFloat8Tensor", (Float8Tensor,), {})
    q.__class__ = derived
    d = q.detach()
    assert type(d) is derived and not d.requires_grad
    assert all(a is b for a, b in zip(d.get_data_tensors(), q.get_data_tensors()))
    assert type(torch.nn.Parameter(q)) is derived
    quantizer.update_quantized(torch.zeros(8, 8), q)
    assert type(q) is derived and torch.equal(q.dequantize(), torch.zeros(8, 8, dtype=q.dtype))


def test_replace_raw_data_and_stale_transpose():
    from fp8kit.pytorch.tensor import replace_raw_data

    quantizer = Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, "cpu")
    q = quantizer.make_empty((16, 8), dtype=torch.bfloat16)
    quantizer.update_quantized(torch.randn(16, 8, dtype=torch.bfloat16), q)
    kept = {a: getattr(q, a) for a in ("_quantizer", "_fp8_dtype", "_scale_inv", "_transpose", "_transpose_invalid")}
    old = q._data
    buf = torch.zeros(256, dtype=torch.uint8)
    replace_raw_data(q, buf[64:192].view(16, 8))
    assert q._data.data_ptr() == buf.data_ptr() + 64 and torch.equal(q._data, old)
    assert all(getattr(q, a) is v for a, v in kept.items())
    with pytest.raises(ValueError, match="raw data types differ"):
        replace_raw_data(q, torch.zeros(16, 8, dtype=torch.int8))
    # a transpose marked stale is not read: the transposed operand comes from the row-wise bytes
    s = q.storage_view()
    s._transpose, s._transpose_invalid = torch.zeros(8, 16, dtype=torch.uint8), True
    assert torch.equal(s.transposed()._data, q._data.t())
    s._create_transpose()
    assert not s._transpose_invalid and torch.equal(s._transpose, q._data.t())


@pytest.mark.parametrize("op", ["clone", "view", "reshape", "contiguous"])
def test_identity_ops_are_exact_and_differentiable(op):
    x = Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, "cpu")(torch.randn(16, 16, dtype=torch.bfloat16))
    x.requires_grad_(True)
    y = {"clone": lambda: x.clone(), "view": lambda: x.view(16, 16), "reshape": lambda: x.reshape(16, 16),
         "contiguous": lambda: x.contiguous()}[op]()
    dy = torch.randn(16, 16, dtype=torch.bfloat16)
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    y = y.dequantize() if isinstance(y, QuantizedTensor) else y
    assert torch.equal(y.detach(), x.detach().dequantize())


def test_the_base_class_refuses_views():
    with pytest.raises(NotImplementedError, match="QuantizedTensor class does not support tensor views"):
        QuantizedTensor((4, 4), torch.bfloat16).view(-1)


@pytest.mark.parametrize("with_transpose", [False, True])
def test_storage_holds_what_its_saved_form_handed_out(with_transpose):
    """`holds(t)`: True for the tensor `saved_form` gave (the FP8 view of the bytes, or the transpose of the kept
    transpose view when the storage carries `_transpose`), False for a copy or a fresh view of the same bytes (what a
    saved-tensor hook may hand back), and it makes no view itself."""
    from fp8kit.bench_ops import DispatchCounter
    from fp8kit.pytorch.tensor.storage import Float8TensorStorage

    data = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    t = data.t().contiguous() if with_transpose else None
    q = Float8TensorStorage(data=data, fp8_dtype=torch.float8_e4m3fn, fp8_scale_inv=torch.ones(1), data_transpose=t)
    saved, _ = q.saved_form()
    others = (saved.clone(), data.view(torch.float8_e4m3fn), data.view(torch.float8_e4m3fn).t().contiguous().t())
    with DispatchCounter() as counter:
        assert q.holds(saved) and q.holds(q._data)
        assert not any(q.holds(other) for other in others)
    assert counter.total == 0
    assert torch.equal(saved.view(torch.uint8), data)  # the same bytes in the same [3, 4] layout


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
def test_storage_copies_after_its_views_were_made(copier):
    """A storage whose FP8 views were made (the GEMMs and saved_form make and keep them) pickles and deep-copies:
    the kept views are caches and are not copied (torch does not pickle FP8-typed tensors), the copy makes its own."""
    from fp8kit.pytorch.tensor.storage import Float8TensorStorage

    data = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    q = Float8TensorStorage(data=data, fp8_dtype=torch.float8_e4m3fn, fp8_scale_inv=torch.full((1,), 0.5),
                            data_transpose=data.t().contiguous())
    q.fp8_view(), q.saved_form(), q.column_major_view()
    c = pickle.loads(pickle.dumps(q)) if copier == "pickle" else copy.deepcopy(q)
    saved, inv = c.saved_form()
    assert c.holds(saved) and not c.holds(q.saved_form()[0])
    assert torch.equal(saved.view(torch.uint8), data) and torch.equal(c.fp8_view().view(torch.uint8), data)
    assert inv.item() == 0.5 and torch.equal(c.dequantize(), q.dequantize())
