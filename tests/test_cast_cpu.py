"""The facts the CPU cast relies on, checked against tests/reference.py (NumPy + ml_dtypes), and what the CPU path
then skips: the clamp where torch's conversion already saturates, the widening's NaN check where the cast knows
there is no NaN. See docs/numerics.md, "The cast on a CPU"."""

import collections
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.pytorch as te
from fp8kit.pytorch import cast as cast_module
from fp8kit.pytorch import host, quantize
from fp8kit.pytorch.cast import FP8_MAX, UNCLAMPED_MAX, cast_host
from fp8kit.pytorch.tensor import storage
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _f32_range(lo: float, hi: float) -> np.ndarray:
    """Every float32 in [lo, hi] (both positive)."""
    a, b = np.array([lo, hi], dtype=np.float32).view(np.int32)
    return np.arange(a, b + 1, dtype=np.int32).view(np.float32)


def _torch_bytes(y: np.ndarray, fp8: torch.dtype, clamp: bool) -> np.ndarray:
    t = torch.from_numpy(y)
    if clamp:
        t = t.clamp(-FP8_MAX[fp8], FP8_MAX[fp8])
    return t.to(fp8).view(torch.uint8).numpy()


def _assert_saturating_cast(y: np.ndarray, fmt: str, clamp: bool) -> None:
    """torch's float32 -> FP8 conversion (after a clamp to +-max, or without one) gives the reference's saturating,
    round-to-nearest-even bytes; NaN inputs give a NaN code (any)."""
    got = _torch_bytes(y, FORMATS[fmt], clamp)
    want, _ = ref.cast(y, fmt, 1.0)
    nan = np.isnan(y)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(ref.FP8[fmt][0]).astype(np.float32)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_clamp_then_torch_conversion_is_the_saturating_cast(fmt):
    """Every bf16 and every fp16 bit pattern (as float32), and 1M float32 patterns drawn uniformly."""
    every16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        _assert_saturating_cast(every16.view(dtype).float().numpy(), fmt, clamp=True)
    bits = np.random.default_rng(0).integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    _assert_saturating_cast(bits.view(np.float32), fmt, clamp=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_conversion_without_clamp_saturates_up_to_unclamped_max(fmt):
    """Every float32 in [max, UNCLAMPED_MAX] (either sign) converts to +-max without the clamp; for E5M2 the next
    float32 above does not (it becomes inf: the bound is tight). torch 2.13 saturates E4M3 above 464 too, older
    versions give NaN from 480 on and from the rounding above 464, so 464 is the bound that holds for both."""
    fp8 = FORMATS[fmt]
    top = _f32_range(FP8_MAX[fp8], UNCLAMPED_MAX[fp8])
    assert top[-1] == np.float32(UNCLAMPED_MAX[fp8]) and len(top) > 100_000
    y = np.concatenate([top, -top])
    _assert_saturating_cast(y, fmt, clamp=False)
    if fmt == "e5m2":
        above = np.nextafter(np.float32(UNCLAMPED_MAX[fp8]), np.float32(np.inf))
        past = _torch_bytes(np.array([above, -above], dtype=np.float32), fp8, clamp=False)
        assert np.isinf(past.view(ref.FP8[fmt][0]).astype(np.float32)).all()
    # and below max, without the clamp: every bf16 / fp16 pattern of magnitude <= max
    every16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        v = every16.view(dtype).float().numpy()
        _assert_saturating_cast(v[~(np.abs(v) > FP8_MAX[fp8])], fmt, clamp=False)


def _amax_with_product_above_max(fp8_max: float) -> np.float32:
    """An amax whose current-scaling product `float32(amax * float32(fp8_max / amax))` exceeds fp8_max."""
    a = np.random.default_rng(1).uniform(0.5, 8.0, 10_000).astype(np.float32)
    above = a[a * (np.float32(fp8_max) / a) > fp8_max]  # float32 arithmetic throughout
    assert above.size, "no such amax found"
    assert np.float32(above[0] * ref.current_scale(above[0], fp8_max)) > fp8_max
    return above[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_current_scaling_product_above_max_casts_without_clamp(fmt):
    """Current scaling's `amax * scale` can round above max; the CPU cast then skips the clamp (no clamp op runs)
    and its bytes still equal the reference's saturating cast."""
    fp8 = FORMATS[fmt]
    a = _amax_with_product_above_max(FP8_MAX[fp8])
    x = np.random.default_rng(2).uniform(-1, 1, 4096).astype(np.float32) * a
    x[:2] = a, -a
    with _Ops() as seen:
        q = quantize(torch.from_numpy(x), fp8)
    assert seen.ops["clamp"] + seen.ops["clamp_"] == 0
    want, want_inv = ref.cast(x, fmt, ref.current_scale(ref.amax(x), FP8_MAX[fp8]))
    np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want)
    assert np.float32(q.scale_inv.item()) == want_inv
    assert want[0] & 0x7F == (0x7E if fmt == "e4m3" else 0x7B)  # the largest finite code


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("over", [1.0, 1.02, 1.5, 1e6, np.inf])
def test_host_cast_with_known_amax_matches_reference(fmt, over):
    """cast_host with the amax given: products from below max to far above it (clamped or not), inf inputs."""
    fp8 = FORMATS[fmt]
    x = np.random.default_rng(3).standard_normal(50_000).astype(np.float32)
    x[0] = np.abs(x).max() * over
    scale = float(np.float32(FP8_MAX[fp8] / np.abs(x[1:]).max()))
    xt = torch.from_numpy(x)
    a, nan_free = host.amax_nan(xt)
    assert nan_free
    q = cast_host(xt, scale, fp8, a, nan_free)
    want, _ = ref.cast(x, fmt, scale)
    np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_widening_skips_its_check_only_when_the_cast_saw_no_nan(fmt):
    """A tensor holding NaN: the amax says so, the bytes keep NaN codes and the CPU GEMM's values decode them (via
    torch's conversion); NaN-free: the flag is set and the values equal ml_dtypes' decoding."""
    fp8 = FORMATS[fmt]
    n = storage.WIDEN_BY_BITS_MIN_NUMEL
    x = torch.randn(n) * 3
    a, nan_free = host.amax_nan(x)
    q = cast_host(x, 40.0, fp8, a, nan_free)
    assert nan_free and q._codes_finite
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    want = q._data.view(torch.uint8).numpy().view(dtype).astype(np.float32)
    np.testing.assert_array_equal(q.values(torch.bfloat16).float().numpy(), want)
    x[5] = float("nan")
    a2, nan_free = host.amax_nan(x)
    assert not nan_free and a2 == a
    q = cast_host(x, 40.0, fp8, a2, nan_free)
    assert not q._codes_finite
    got = q.values(torch.bfloat16).float().numpy()
    want = q._data.view(torch.uint8).numpy().view(dtype).astype(np.float32)
    assert np.isnan(got[5]) and np.isnan(want[5])
    np.testing.assert_array_equal(np.delete(got, 5), np.delete(want, 5))


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_linear_widens_each_operand_once(recipe, monkeypatch, one_thread):
    """One Linear forward + backward on CPU widens x and dy once each (x again in the backward, from its saved FP8
    bytes); the weight's values come from its (table) cast."""
    calls = []
    widen = storage.widen

    def spy(data, dtype, codes_finite=False, fp8_dtype=None):
        calls.append((tuple(data.shape), codes_finite))
        return widen(data, dtype, codes_finite, fp8_dtype)

    monkeypatch.setattr(storage, "widen", spy)
    lin = te.Linear(512, 256, params_dtype=torch.bfloat16)
    x = torch.randn(128, 512, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.float().pow(2).sum().backward()
    # the weight (2**17 elements) takes the table cast, which gives its values with its bytes (no widening)
    assert sorted(shape for shape, _ in calls) == sorted([(128, 512), (128, 256), (128, 512)])


def test_cached_fp8_weight_is_widened_once_across_microbatches(monkeypatch, one_thread):
    """is_first_microbatch=True caches the FP8 weight; the later microbatches reuse its bytes and its widened
    values (the weight is widened once for all of them), with the same outputs as casting it again."""
    shapes = []
    widen = storage.widen

    def spy(data, dtype, codes_finite=False, fp8_dtype=None):
        shapes.append(tuple(data.shape))
        return widen(data, dtype, codes_finite, fp8_dtype)

    torch.manual_seed(0)
    lin = te.Linear(512, 256, params_dtype=torch.bfloat16)
    xs = [torch.randn(128, 512, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    recipe = Float8CurrentScaling()
    want = []
    for x in xs:
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.float().pow(2).sum().backward()
        want.append((y.detach(), x.grad))
        x.grad = None
    lin.weight.grad = None
    monkeypatch.setattr(storage, "widen", spy)
    table_cast = cast_module._cast_by_table

    def table_spy(x, scale, fp8_dtype, values=True):
        shapes.append(("table", tuple(x.shape)))
        return table_cast(x, scale, fp8_dtype, values)

    monkeypatch.setattr(cast_module, "_cast_by_table", table_spy)
    for i, x in enumerate(xs):
        with te.autocast(recipe=recipe):
            y = lin(x, is_first_microbatch=i == 0)
        y.float().pow(2).sum().backward()
        assert torch.equal(y.detach(), want[i][0]) and torch.equal(x.grad, want[i][1])
    # the weight (2**17 elements) is cast once, by the table, which gives its values too: never widened
    assert shapes.count(("table", (256, 512))) == 1 and shapes.count((256, 512)) == 0
    assert shapes.count((128, 512)) == 2 * len(xs)  # x in the forward and again in the backward, each time


def _every16(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(dtype)


def _as_float32(x: torch.Tensor) -> np.ndarray:
    """x (bf16 / fp16) as float32 through NumPy (a NaN keeps its sign, whatever torch's loops do)."""
    np_dtype = ml_dtypes.bfloat16 if x.dtype == torch.bfloat16 else np.float16
    return x.view(torch.uint16).numpy().view(np_dtype).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_table_cast_matches_reference_for_every_pattern(fmt, dtype, one_thread):
    """The table cast of large 16-bit tensors (cast.TABLE_MIN_NUMEL): every bit pattern (NaN and inf included), at
    unaligned offsets, for scales that saturate, round into subnormals and flush to zero: bytes equal the
    reference's (NaN: 0x7F whatever its sign), a bf16 input's values equal the bytes decoded by ml_dtypes."""
    fp8 = FORMATS[fmt]
    x = _every16(dtype).repeat(3)[7:]
    assert x.numel() >= cast_module.TABLE_MIN_NUMEL
    for scale in (float(np.float32(s)) for s in (1.0, 3.7, 448 / 4.1, 1e-3, 2.0 ** -20, 1e30)):  # float32 values
        q = cast_host(x, scale, fp8, math.inf)
        _, want_inv = ref.cast(_as_float32(x), fmt, scale)
        with np.errstate(over="ignore", invalid="ignore"):
            want = ref.fp8_bytes(_as_float32(x) * np.float32(scale), fmt)  # NaN: 0x7F whatever its sign, both formats
        np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want)
        assert np.float32(q.scale_inv.item()) == want_inv
        if dtype == torch.bfloat16:
            assert q._values is not None and q._values.dtype == torch.bfloat16
            decoded = want.view(ref.FP8[fmt][0]).astype(np.float32)
            np.testing.assert_array_equal(q._values.float().numpy(), decoded)  # NaN positions compare equal
        else:
            assert q._values is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "fp16"])
def test_widening_matches_ml_dtypes_for_every_code(fmt, dtype):
    """Large FP8 tensors (every code, NaN and inf included, at unaligned offsets and through a transposed view)
    widen to the values ml_dtypes decodes."""
    fp8 = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2 * storage.WIDEN_BY_BITS_MIN_NUMEL // 256 + 3)
    codes = codes[5:5 + 256 * 512].view(512, 256)
    for data in (codes, codes.t()):
        got = storage.widen(data.view(fp8), dtype)
        assert got.dtype == dtype and got.shape == data.shape
        want = data.contiguous().numpy().view(ref.FP8[fmt][0]).astype(np.float32)
        np.testing.assert_array_equal(got.float().numpy(), want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "fp16"])
@pytest.mark.parametrize("rows", [4, 40, 255], ids=["table-min", "mid", "below-bits"])
def test_mid_sized_widening_by_table_matches_ml_dtypes(fmt, dtype, rows):
    """Mid-sized CPU tensors (WIDEN_BY_TABLE_MIN_NUMEL up to the bit path) widen by a gather from the codes'
    values: every code, NaN and inf included, row-major, transposed, and from the uint8 bytes with the format
    named, equal ml_dtypes' decoding; so does a storage's `values` (the CPU GEMM's operand)."""
    fp8 = FORMATS[fmt]
    assert rows * 256 >= storage.WIDEN_BY_TABLE_MIN_NUMEL and rows * 256 < storage.WIDEN_BY_BITS_MIN_NUMEL
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows + 1)[7:7 + 256 * rows].view(rows, 256)
    for data in (codes, codes.t()):
        want = data.contiguous().numpy().view(ref.FP8[fmt][0]).astype(np.float32)
        for got in (storage.widen(data.view(fp8), dtype), storage.widen(data, dtype, fp8_dtype=fp8)):
            # the conversion's layout too (the CPU GEMM's accumulation order follows its operands' strides)
            assert got.dtype == dtype and got.shape == data.shape and got.stride() == data.stride()
            np.testing.assert_array_equal(got.float().numpy(), want)
        q = storage.Float8TensorStorage(data=data, fp8_dtype=fp8, fp8_scale_inv=torch.ones(1))
        np.testing.assert_array_equal(q.values(dtype).float().numpy(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [7, 1000, 5000], ids=["tiny", "below-abs-min", "above-abs-min"])
def test_tensor_path_amax_of_cpu_tensors(dtype, n):
    """The tensor path's amax on CPU tensors (|.| and max, or the norm for small 16-bit ones): max |x| over the
    non-NaN elements as a float32 0-d tensor, with NaN, infinities, -0 and subnormals about, against NumPy."""
    rng = np.random.default_rng(n)
    tiny = float(torch.finfo(dtype).tiny)
    for special in (None, float("nan"), float("inf"), -float("inf"), -0.0, tiny / 4, "all-nan", "zeros"):
        x = rng.standard_normal(n) * 3
        if special == "all-nan":
            x[:] = np.nan
        elif special == "zeros":
            x[:] = 0.0
        elif special is not None:
            x[rng.integers(0, n, size=3)] = special
        t = torch.from_numpy(x).to(dtype)
        values = t.double().numpy()
        finite = values[~np.isnan(values)]
        want = np.float32(np.abs(finite).max()) if finite.size else np.float32(0)
        got = cast_module._device_amax(t)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert np.float32(got.item()) == want or (np.isinf(want) and np.isinf(got.item())), (special, got, want)


def test_table_cast_of_a_noncontiguous_input(one_thread):
    """A transposed (non-contiguous) bf16 input takes the table path with its logical layout."""
    x = torch.randn(512, 768, dtype=torch.bfloat16).t()
    q = cast_host(x, 30.0, torch.float8_e4m3fn, math.inf)
    want, _ = ref.cast(x.float().contiguous().numpy(), "e4m3", 30.0)
    np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want)
    assert q._data.shape == x.shape


def test_table_cast_only_with_one_thread(monkeypatch, no_cpu_kernels):
    """With two or more intra-op threads the table cast is not used (torch's conversions run in parallel then),
    and the bytes are the same either way."""
    x = torch.randn(512, 512, dtype=torch.bfloat16)
    calls = []
    table_cast = cast_module._cast_by_table

    def spy(*args):
        calls.append(1)
        return table_cast(*args)

    monkeypatch.setattr(cast_module, "_cast_by_table", spy)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(cast_host(x, 30.0, torch.float8_e4m3fn, math.inf)._data)
            assert len(calls) == 1  # the first (one thread) only
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_quantize_api_table_cast_makes_bytes_only(fmt, dtype, one_thread):
    """`quantize` of a large 16-bit tensor (the table cast) gathers the bytes only, no GEMM operand: the bytes equal
    the reference's with current scaling and with a given scale, and values made later decode them."""
    fp8 = FORMATS[fmt]
    x = torch.randn(cast_module.TABLE_MIN_NUMEL + 77, dtype=dtype) * 5
    x[3], x[10] = float("nan"), -float("inf")
    for scale in (None, 0.75):
        q = quantize(x, fp8) if scale is None else quantize(x, fp8, scale)
        s = np.float32(ref.current_scale(ref.amax(x.float().numpy()), FP8_MAX[fp8]) if scale is None else scale)
        assert np.float32(q.scale_inv.item()) == np.float32(1 / s)
        with np.errstate(over="ignore", invalid="ignore"):
            want = ref.fp8_bytes(x.float().numpy() * s, fmt)  # NaN: 0x7F whatever its sign, both formats
        np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want)
        assert q._values is None  # nothing widened for a GEMM that is not there
        decoded = want.view(ref.FP8[fmt][0]).astype(np.float32)
        np.testing.assert_array_equal(q.values(torch.float32).numpy(), decoded)
