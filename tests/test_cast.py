"""fp8kit.pytorch.quantize against tests/reference.py, byte for byte."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fp8kit.pytorch import Float8TensorStorage, host, quantize

import reference as ref


@pytest.fixture(autouse=True, params=["host", "tensor"])
def path(request):
    """Every test runs on the CPU fast path (scale math on floats, fp8kit.pytorch.host) and on the torch-operation
    path that accelerators use."""
    if request.param == "host":
        yield request.param
    else:
        with host.tensor_path():
            yield request.param

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = [1.0, 0.5, 3.7, 2.0**-10, 1e-30, 1234.5678, 2.0**40]


def _bytes(q) -> np.ndarray:
    return q._data.view(torch.uint8).cpu().numpy()


def assert_same_as_reference(x_np32, q, fmt, scale):
    want, want_inv = ref.cast(x_np32, fmt, scale)
    got = _bytes(q)
    assert got.shape == want.shape
    # NaN positions agree; every other byte is identical
    got_nan = np.isnan(got.view(ref.FP8[fmt][0]).astype(np.float32))
    want_nan = np.isnan(want.view(ref.FP8[fmt][0]).astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(got[~got_nan], want[~want_nan])
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.numel() == 1
    assert np.float32(q.scale_inv.item()) == want_inv


def all_bf16() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def all_fp16() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_every_bf16_pattern(fmt, scale):
    x = all_bf16()
    q = quantize(x, FORMATS[fmt], scale)
    assert q._data.dtype == torch.uint8 and q.fp8_dtype == FORMATS[fmt] and q.dtype == torch.bfloat16
    assert_same_as_reference(x.float().numpy(), q, fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.01, 300.0])
def test_every_fp16_pattern(fmt, scale):
    x = all_fp16()
    assert_same_as_reference(x.float().numpy(), quantize(x, FORMATS[fmt], scale), fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_random_fp32_bit_patterns(fmt, scale):
    # uniform over all float32 bit patterns: every exponent, subnormals, +-inf and NaNs
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    q = quantize(torch.from_numpy(x.copy()), FORMATS[fmt], torch.tensor(scale))
    assert_same_as_reference(x, q, fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_range_values_around_fp8_range(fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * np.exp2(rng.uniform(-30, 30, 100_000))).astype(np.float32)
    for scale in (1.0, 7.0, 1 / 7.0):
        assert_same_as_reference(x, quantize(torch.from_numpy(x), FORMATS[fmt], scale), fmt, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(fmt):
    dtype = ref.FP8[fmt][0]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.sort(np.unique(values[np.isfinite(values) & (values >= 0)]))
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (finite[:-1].astype(np.float64) + finite[1:]) / 2)  # exact
    x = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    q = quantize(torch.from_numpy(x), FORMATS[fmt], 1.0)
    assert_same_as_reference(x, q, fmt, 1.0)
    # an independent statement of "to even": a tie lands on the neighbour whose mantissa bit 0 is clear
    got = _bytes(q)[: len(mids)]
    lower = finite[:-1].astype(dtype).view(np.uint8)
    upper = finite[1:].astype(dtype).view(np.uint8)
    even = np.where(lower % 2 == 0, lower, upper)
    np.testing.assert_array_equal(got, even)
    negative = quantize(torch.from_numpy(-mids), FORMATS[fmt], 1.0)
    np.testing.assert_array_equal(_bytes(negative), even | 0x80)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_inf_nan_and_subnormals(fmt):
    fp8_max = ref.FP8[fmt][1]
    x = torch.tensor([fp8_max * 1.01, -fp8_max * 5, math.inf, -math.inf, math.nan, 2.0**-9, 2.0**-16, -2.0**-17,
                      2.0**-30])
    q = quantize(x, FORMATS[fmt], 1.0)
    out = q.dequantize()
    assert out[0] == fp8_max and out[1] == -fp8_max and out[2] == fp8_max and out[3] == -fp8_max
    assert torch.isnan(out[4])
    assert_same_as_reference(x.numpy(), q, fmt, 1.0)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_and_dtypes(shape, dtype):
    x = torch.randn(shape).to(dtype) * 10
    for fmt, fp8 in FORMATS.items():
        q = quantize(x, fp8, 2.0)
        assert q.shape == x.shape and q._data.shape == x.shape and q.fp8_dtype == fp8
        assert_same_as_reference(x.float().numpy(), q, fmt, 2.0)
        d = q.dequantize(torch.bfloat16)
        assert d.dtype == torch.bfloat16 and d.shape == x.shape
        q = quantize(x, fp8)  # current scaling
        assert q.shape == x.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_reference(fmt):
    x = np.random.default_rng(2).standard_normal(4096).astype(np.float32) * 30
    q = quantize(torch.from_numpy(x), FORMATS[fmt], 3.3)
    want_bytes, inv = ref.cast(x, fmt, 3.3)
    np.testing.assert_array_equal(q.dequantize().numpy(), ref.dequantize(want_bytes, fmt, inv))


# ---- current scaling -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("eps", [0.0, 1e-3, 10.0])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("magnitude", [1e-12, 1e-3, 1.0, 1e5, 1e30])
def test_current_scaling_matches_reference(fmt, eps, pow2, magnitude):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * magnitude).astype(np.float32)
    q = quantize(torch.from_numpy(x), FORMATS[fmt], amax_epsilon=eps, power_2_scale=pow2)
    scale = ref.current_scale(ref.amax(x), ref.FP8[fmt][1], eps, pow2)
    assert_same_as_reference(x, q, fmt, scale)
    if pow2:
        m, _ = math.frexp(1.0 / q.scale_inv.item())
        assert m == 0.5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("values", [[0.0, 0.0], [], [math.nan, math.nan], [1.0, math.inf], [-math.inf],
                                    [1e-44, -1e-45], [math.nan, 3.0, -5.0]])
def test_current_scaling_special_amax(fmt, values):
    x = np.array(values, dtype=np.float32)
    q = quantize(torch.from_numpy(x), FORMATS[fmt])
    scale = ref.current_scale(ref.amax(x), ref.FP8[fmt][1])
    assert_same_as_reference(x, q, fmt, scale)
    s = 1.0 / q.scale_inv.item()
    assert math.isfinite(s) and s > 0


def test_current_scaling_edge_scales():
    assert quantize(torch.zeros(4), torch.float8_e4m3fn).scale_inv.item() == 1.0
    assert quantize(torch.tensor([math.inf]), torch.float8_e4m3fn).scale_inv.item() == 1.0
    assert quantize(torch.tensor([math.nan]), torch.float8_e4m3fn).scale_inv.item() == 1.0
    # 448 / 1e-44 overflows float32: the scale becomes FLT_MAX
    q = quantize(torch.tensor([1e-44]), torch.float8_e4m3fn)
    assert np.float32(q.scale_inv.item()) == np.float32(1.0) / ref.FLT_MAX
    # the epsilon caps the scale
    q = quantize(torch.tensor([1e-6]), torch.float8_e4m3fn, amax_epsilon=1.0)
    assert np.float32(q.scale_inv.item()) == np.float32(1.0) / np.float32(448.0)


def test_bf16_input_is_multiplied_in_float32():
    # 1.00390625 * 1.5 = 1.505859375 is exact in float32; in bfloat16 it would round to 1.5078125
    x = torch.tensor([1.00390625], dtype=torch.bfloat16)
    q = quantize(x, torch.float8_e4m3fn, 1.5 * 128)
    assert_same_as_reference(x.float().numpy(), q, "e4m3", 1.5 * 128)


# ---- properties ------------------------------------------------------------------------------------------

finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=6), elements=finite_or_not),
       scale=st.floats(min_value=2.0**-100, max_value=2.0**100, width=32), fmt=st.sampled_from(list(FORMATS)))
def test_property_cast_matches_reference(x, scale, fmt):
    assert_same_as_reference(x, quantize(torch.from_numpy(x.copy()), FORMATS[fmt], scale), fmt, scale)


@settings(max_examples=200, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 64),
                    elements=st.floats(min_value=-2.0**100, max_value=2.0**100, width=32)),
       fmt=st.sampled_from(list(FORMATS)), pow2=st.booleans())
def test_property_current_scaling_error_bound(x, fmt, pow2):
    q = quantize(torch.from_numpy(x.copy()), FORMATS[fmt], power_2_scale=pow2)
    scale = ref.current_scale(ref.amax(x), ref.FP8[fmt][1], 0.0, pow2)
    assert_same_as_reference(x, q, fmt, scale)
    # no saturation under current scaling, and relative error within half an FP8 ulp for normal values
    d = q.dequantize().numpy().astype(np.float64)
    mant_bits = 3 if fmt == "e4m3" else 2
    a = float(ref.amax(x))
    fp8_max = ref.FP8[fmt][1]
    # outside this range the scale is clamped (to FLT_MAX or SCALE_MIN) or scale_inv is subnormal
    if a > 0 and ref.SCALE_MIN <= fp8_max / a < 2.0**126:
        assert np.all(np.abs(d) <= a * (1 + 2.0 ** -mant_bits))
        normal = np.abs(x.astype(np.float64)) * float(scale) >= (2.0**-6 if fmt == "e4m3" else 2.0**-14)
        err = np.abs(d - x)[normal] / np.abs(x.astype(np.float64))[normal]
        assert np.all(err <= 2.0 ** -(mant_bits + 1) * 1.0001)


# ---- bad input -------------------------------------------------------------------------------------------

def test_bad_inputs_have_clear_errors():
    x = torch.randn(4)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        quantize(torch.arange(4), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize(x.to(torch.float8_e4m3fn), torch.float8_e5m2)
    with pytest.raises(TypeError, match="fp8_dtype"):
        quantize(x, torch.bfloat16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize(np.ones(3, np.float32), torch.float8_e4m3fn)
    for bad in (0.0, -1.0, math.inf, math.nan, 1e39, torch.tensor(0.0), torch.tensor([-2.0])):
        with pytest.raises(ValueError, match="scale"):
            quantize(x, torch.float8_e4m3fn, bad)
    with pytest.raises(TypeError, match="one element"):
        quantize(x, torch.float8_e4m3fn, torch.ones(2))
    with pytest.raises(TypeError, match="scale"):
        quantize(x, torch.float8_e4m3fn, "1.0")
    with pytest.raises(ValueError, match="amax_epsilon"):
        quantize(x, torch.float8_e4m3fn, amax_epsilon=-1.0)


def test_reference_uses_ml_dtypes_not_torch():
    # the oracle must stay independent of the code under test
    import inspect

    src = inspect.getsource(ref)
    assert "import torch" not in src and "ml_dtypes" in src
    assert ml_dtypes.float8_e4m3fn is ref.FP8["e4m3"][0]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_cast_matches_cpu(fmt):
    x = all_bf16()
    for scale in SCALES:
        q_cpu = quantize(x, FORMATS[fmt], scale)
        q_gpu = quantize(x.cuda(), FORMATS[fmt], scale)
        assert torch.equal(q_gpu._data.view(torch.uint8).cpu(), q_cpu._data.view(torch.uint8))
        assert q_gpu.scale_inv.item() == q_cpu.scale_inv.item()
    y = torch.randn(1000, 100) * 1e3
    q_cpu, q_gpu = quantize(y, FORMATS[fmt]), quantize(y.cuda(), FORMATS[fmt])
    assert torch.equal(q_gpu._data.view(torch.uint8).cpu(), q_cpu._data.view(torch.uint8))



@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_for_the_cpu_gemm_equal_the_conversion(fmt, dtype):
    """Float8Tensor.values widens large CPU tensors by bit manipulation: every code, in any layout, must decode to
    the value ml_dtypes gives it (exact in bf16 and float32); NaN codes and flush-to-zero mode take torch's
    conversion, which must agree too."""
    from fp8kit.pytorch.tensor.storage import WIDEN_BY_BITS_MIN_NUMEL

    codes = torch.arange(256, dtype=torch.uint8).repeat(WIDEN_BY_BITS_MIN_NUMEL // 256 * 2)
    fp8 = codes.view(FORMATS[fmt])
    ml_dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    decoded = codes.numpy().view(ml_dtype).astype(np.float32)
    finite = fp8[torch.from_numpy(np.isfinite(decoded))].reshape(-1, 64)

    def check(data):
        got = Float8TensorStorage(data=data, fp8_scale_inv=torch.ones(1)).values(dtype)
        want = data.contiguous().view(torch.uint8).numpy().view(ml_dtype).astype(np.float32)
        assert got.shape == want.shape and got.dtype == dtype
        got = got.float().contiguous().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want))
        nan = np.isnan(want)
        np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))

    for data in (finite, finite.t(), finite[:, 1::2]):
        check(data)
    check(fp8.reshape(-1, 64))  # NaN codes present: torch's conversion
    torch.set_flush_denormal(True)
    try:
        check(finite)
    finally:
        torch.set_flush_denormal(False)
