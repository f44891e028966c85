"""fp8kit's CPU kernels (fp8kit/pytorch/cpu_kernels: C loops compiled on first use) against tests/reference.py
(NumPy + ml_dtypes): the cast's bytes and widened values for every bf16 and fp16 bit pattern, the widening of every
code, the amax; the Linear path with them equal to the path without them, bit for bit; and the fallbacks (no
compiler, switched off, subnormals flushed)."""

import itertools
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import cast as cast_module
from fp8kit.pytorch import cpu_kernels, host
from fp8kit.pytorch.cast import cast_host
from fp8kit.pytorch.tensor import storage
from fp8kit.pytorch.tensor.deferred import DeferredBytesStorage
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from kernel_steps import threads, train_steps

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.reason()}")

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NP16 = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}
# float32 scales: identity, saturating, rounding into subnormals and flushing to zero, the extremes of the scale rule
SCALES = [float(np.float32(s)) for s in (1.0, 3.7, 448 / 4.1, 57344 / 7.3, 1e-3, 2.0 ** -20, 1e30, 2.0 ** -63,
                                          float(np.finfo(np.float32).max))]


def _as_float32(x: torch.Tensor) -> np.ndarray:
    """x as float32 through NumPy (a NaN keeps its sign and payload, whatever torch's loops do)."""
    if x.dtype == torch.float32:
        return x.numpy()
    return x.view(torch.uint16).numpy().view(NP16[x.dtype]).astype(np.float32)


def _want(x: torch.Tensor, fmt: str, scale: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return ref.fp8_bytes(_as_float32(x) * np.float32(scale), fmt)  # NaN: 0x7F whatever its sign


def _every16(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern (NaN, inf, -0 and subnormals included), at an unaligned offset."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).repeat(3)[5:].view(dtype).contiguous()


def _float32_samples() -> torch.Tensor:
    """Random float32 bit patterns and the special values."""
    bits = np.random.default_rng(0).integers(0, 2 ** 32, 1 << 17, dtype=np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1.1754942e-38, 3.4e38, 448, 464,
                        465, 57344, 61439.996, 61440], dtype=np.float32)
    return torch.from_numpy(np.concatenate([bits, special, -special]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "f32"])
def test_cast_matches_reference(fmt, dtype):
    """Bytes (and a bf16 input's widened values) equal the reference's for every 16-bit pattern, or random float32
    bits and the special values, at scales that saturate, round into subnormals and flush to zero."""
    fp8 = FORMATS[fmt]
    x = _every16(dtype) if dtype != torch.float32 else _float32_samples()
    for scale in SCALES:
        q = cast_host(x, scale, fp8, math.inf)
        want = _want(x, fmt, scale)
        np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), want, err_msg=f"scale {scale}")
        if dtype == torch.bfloat16:
            assert q._values is not None and q._values.dtype == torch.bfloat16
            decoded = want.view(ref.FP8[fmt][0]).astype(np.float32)
            np.testing.assert_array_equal(q._values.float().numpy(), decoded)  # NaN positions compare equal
            nan = np.isnan(decoded)
            assert (q._values.view(torch.int16).numpy()[nan] == 0x7FC0).all()  # the positive NaN, as the tables
        else:
            assert q._values is None


def test_cast_equals_the_torch_paths_bit_for_bit(one_thread):
    """The same bytes and values as the table cast (kernels off, one thread) and torch's conversion (two threads)."""
    x = _every16(torch.bfloat16)
    for fmt, fp8 in FORMATS.items():
        for scale in SCALES[:4]:
            with cpu_kernels.switched(True):
                native = cast_host(x, scale, fp8, math.inf)
            table = cast_host(x, scale, fp8, math.inf)
            assert torch.equal(native._data, table._data)
            assert torch.equal(native._values.view(torch.int16), table._values.view(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_deferred_cast_with_kernels(fmt):
    """grad_output: the values now, the bytes on first read, both the reference's; a source changed in place
    before that is an error."""
    fp8 = FORMATS[fmt]
    x = _every16(torch.bfloat16)[:384 * 256].view(384, 256)
    for scale in SCALES[:5]:
        q = cast_host(x, scale, fp8, math.inf, defer_bytes=True)
        assert isinstance(q, DeferredBytesStorage) and not q.bytes_made
        want = _want(x, fmt, scale).reshape(x.shape)
        np.testing.assert_array_equal(q.values(torch.bfloat16).float().numpy(),
                                      want.view(ref.FP8[fmt][0]).astype(np.float32))
        np.testing.assert_array_equal(q._data.numpy(), want)
    y = torch.randn(64, 64, dtype=torch.bfloat16)
    q = cast_host(y, 2.0, fp8, math.inf, defer_bytes=True)
    y.mul_(3)
    with pytest.raises(RuntimeError, match="modified in place before its FP8 bytes were read"):
        q.fp8_view()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_widening_matches_ml_dtypes(fmt, dtype, monkeypatch):
    """Every finite code widens in the kernel to ml_dtypes' value; bytes holding NaN or inf codes go to torch's
    path (the kernel refuses them) with the same result."""
    fp8 = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(40)[3:]
    special = (codes & 0x7F) >= (0x7F if fmt == "e4m3" else 0x7C)
    calls = []
    kernel = cpu_kernels.widen
    monkeypatch.setattr(cpu_kernels, "widen", lambda *a: calls.append(kernel(*a)) or calls[-1])
    for data in (codes[~special].contiguous(), codes):
        got = storage.widen(data.view(fp8), dtype)
        want = data.numpy().view(ref.FP8[fmt][0]).astype(np.float32)
        assert got.dtype == dtype and got.is_contiguous()
        np.testing.assert_array_equal(got.float().numpy(), want)
    assert calls[0] is not None and calls[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_matches_reference(dtype):
    """max |x| over the non-NaN elements and whether x holds a NaN, with NaN, infinities, -0 and subnormals about."""
    rng = np.random.default_rng(3)
    tiny = float(torch.finfo(dtype).tiny)
    for special in (None, float("nan"), float("inf"), -float("inf"), -0.0, tiny / 4, "all-nan", "zeros", "neg"):
        x = rng.standard_normal(5000) * 3
        if special == "all-nan":
            x[:] = np.nan
        elif special == "zeros":
            x[:] = 0.0
        elif special == "neg":
            x = -np.abs(x)
        elif special is not None:
            x[rng.integers(0, 5000, size=3)] = special
        t = torch.from_numpy(x).to(dtype)
        assert t.numel() >= cpu_kernels.MIN_NUMEL
        a, nan_free = host.amax_nan(t)
        assert np.float32(a) == ref.amax(t.float().numpy()), special
        assert nan_free == (not np.isnan(x).any())


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("n", [1, 2])
def test_linear_with_and_without_kernels_bit_identical(recipe, n):
    """Linear training steps give the same outputs, gradients, histories and scales with the kernels as without
    (the table cast with one thread, torch's conversion with two)."""
    def make():
        return te.Linear(512, 384, params_dtype=torch.bfloat16)

    with threads(n):
        got, want = train_steps(make, recipe, True, 384, 512), train_steps(make, recipe, False, 384, 512)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_linear_with_kernels_widens_only_the_saved_input(monkeypatch):
    """The kernels give x's, the weight's and dy's values with their casts: the only widening left in a Linear
    step is x's saved bytes for wgrad."""
    shapes = []
    widen = storage.widen
    monkeypatch.setattr(storage, "widen",
                        lambda data, *a, **k: shapes.append(tuple(data.shape)) or widen(data, *a, **k))
    lin = te.Linear(512, 256, params_dtype=torch.bfloat16)
    x = torch.randn(128, 512, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = lin(x)
    y.float().pow(2).sum().backward()
    assert shapes == [(128, 512)]


def test_flushed_subnormals_take_torch(no_cpu_kernels):
    """Under torch.set_flush_denormal(True) the cast kernel refuses (it needs subnormal arithmetic) and the cast is
    torch's, as without it; the widening has no subnormal operand and stays exact."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        x = _every16(torch.bfloat16)
        with cpu_kernels.switched(True):
            history, scale = np.full((4, 3), 2.0, dtype=np.float32), np.ones(3, dtype=np.float32)
            assert not cpu_kernels.delayed_update(history, scale, None, False, 448.0, 2.0 ** -63, 3.4e38, False)
            assert (history == 2.0).all() and (scale == 1.0).all()  # refused before writing: NumPy updates then
            for t in (x, x.repeat(5)):  # one chunk, called directly; several, each checked on its own thread
                assert not cpu_kernels.cast(t, 1.0, torch.float8_e4m3fn, torch.empty(t.shape, dtype=torch.uint8), None)
                assert cpu_kernels.cast_amax(t, 1.0, torch.float8_e4m3fn, None, torch.empty_like(t)) is None
            for fmt, fp8 in FORMATS.items():
                codes = torch.arange(0x7C, dtype=torch.uint8).repeat(40)
                np.testing.assert_array_equal(cpu_kernels.widen(codes, fp8, torch.float32).numpy(),
                                              codes.numpy().view(ref.FP8[fmt][0]).astype(np.float32))
            with_kernels = cast_host(x, 3.7, torch.float8_e4m3fn, math.inf)
        without = cast_host(x, 3.7, torch.float8_e4m3fn, math.inf)
        assert torch.equal(with_kernels._data, without._data)
    finally:
        torch.set_flush_denormal(False)


def _subprocess(code: str, **env) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout


CHECK = ("import math, torch\ntorch.manual_seed(0)\nfrom fp8kit.pytorch import cpu_kernels\n"
         "from fp8kit.pytorch.cast import cast_host\n"
         "x = torch.randn(4096, dtype=torch.bfloat16)\nq = cast_host(x, 3.0, torch.float8_e4m3fn, math.inf)\n"
         "print(cpu_kernels.available(), '|', cpu_kernels.reason(), '|', q._data.view(torch.uint8).sum().item())")


def test_switched_off_or_no_compiler_falls_back(tmp_path):
    """FP8KIT_CPU_KERNELS=0, or a compiler that fails, leaves fp8kit on torch operations, with the reason kept and
    the same bytes."""
    on = _subprocess(CHECK).split("|")
    off = _subprocess(CHECK, FP8KIT_CPU_KERNELS="0").split("|")
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CC": "false", "FP8KIT_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0 and "could not be built" in run.stderr  # a failed build says so, once
    broken = run.stdout.split("|")
    assert on[0].strip() == "True" and off[0].strip() == "False" and broken[0].strip() == "False"
    assert "FP8KIT_CPU_KERNELS=0" in off[1] and "could not be built" in broken[1]
    assert on[2] == off[2] == broken[2]


def test_built_once_per_machine(tmp_path):
    """The library is built into the cache directory once; the next process loads it."""
    assert "True" in _subprocess(CHECK, FP8KIT_CACHE_DIR=str(tmp_path)).split("|")[0]
    (built,) = tmp_path.iterdir()
    assert built.name.startswith("fp8_cpu-") and built.name.endswith(".so")
    stamp = built.stat().st_mtime_ns
    assert "True" in _subprocess(CHECK, FP8KIT_CACHE_DIR=str(tmp_path)).split("|")[0]
    assert list(tmp_path.iterdir()) == [built] and built.stat().st_mtime_ns == stamp  # loaded, not built again


def test_table_path_still_used_without_kernels(one_thread, monkeypatch):
    """With the kernels off (one thread), large 16-bit tensors still take the table cast."""
    calls = []
    table_cast = cast_module._cast_by_table
    monkeypatch.setattr(cast_module, "_cast_by_table", lambda *a: calls.append(1) or table_cast(*a))
    cast_host(torch.randn(512, 512, dtype=torch.bfloat16), 3.0, torch.float8_e4m3fn, math.inf)
    assert calls == [1]


@pytest.mark.parametrize("count", [2, 3])
def test_split_across_threads_equals_one_thread(count):
    """With several torch threads a large tensor is cast, reduced and widened in chunks on a thread pool: the same
    bytes, values, amax and NaN flag as one thread and the reference (a NaN and the largest value in the last
    chunk)."""
    x = (torch.randn((1 << 19) + 77) * 7).bfloat16()
    x[-5], x[-9] = float("nan"), -1000.0
    results = []
    for n in (1, count):
        with threads(n):
            assert len(cpu_kernels._chunks(x.numel())) == n
            q = cast_host(x, 0.25, torch.float8_e4m3fn, math.inf)
            results.append((q._data.view(torch.uint8), q._values.view(torch.int16), host.amax_nan(x),
                            cpu_kernels.widen(q._data.view(torch.uint8)[:-77], torch.float8_e4m3fn, torch.float32)))
    (d1, v1, a1, w1), (dn, vn, an, wn) = results
    assert torch.equal(d1, dn) and torch.equal(v1, vn) and a1 == an == (1000.0, False) and torch.equal(w1, wn)
    np.testing.assert_array_equal(dn.numpy(), _want(x, "e4m3", 0.25))


def test_unwritable_cache_directory_uses_the_temporary_one(tmp_path):
    """A cache directory that cannot be made (a file stands there) leaves the library in the temporary directory."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    out = _subprocess(CHECK, FP8KIT_CACHE_DIR=str(blocker / "cache"), TMPDIR=str(tmp_path / "tmp"))
    assert out.split("|")[0].strip() == "True"
    assert [p.name[:8] for p in (tmp_path / "tmp").glob("fp8kit-*/*.so")] == ["fp8_cpu-"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "f32"])
def test_delayed_cast_records_the_amax_of_the_same_pass(dtype):
    """Delayed scaling's cast with its amax in one pass (`cast_host_recording`): the bytes and values of `cast_host`
    and the amax and NaN flag of the reference, with NaN, infinities and all-NaN inputs, in chunks on two threads."""
    rng = np.random.default_rng(5)
    cases = [(1, None), (1, "nan"), (2, "inf"), (2, "nan"), (1, "all-nan"), (1, "zeros")]
    # the large size goes through the chunked call (split on two threads), the small one is one direct call
    for (n, special), size in itertools.product(cases, [(1 << 18) + 3, 1027]):
        with threads(n):
            x = rng.standard_normal(size) * 9
            if special == "all-nan":
                x[:] = np.nan
            elif special == "zeros":
                x[:] = 0
            elif special is not None:
                x[rng.integers(0, x.size, 4)] = {"nan": np.nan, "inf": -np.inf}[special]
            t = torch.from_numpy(x).to(dtype)
            q, a, nan_free = cast_module.cast_host_recording(t, 3.5, torch.float8_e4m3fn)
            assert np.float32(a) == ref.amax(_as_float32(t)) and nan_free == (not np.isnan(x).any()), special
            np.testing.assert_array_equal(q._data.view(torch.uint8).numpy(), _want(t, "e4m3", 3.5))
            want = cast_host(t, 3.5, torch.float8_e4m3fn, math.inf)
            assert torch.equal(q._data, want._data) and (q._values is None) == (want._values is None)
            if q._values is not None:
                assert torch.equal(q._values.view(torch.int16), want._values.view(torch.int16))
    with cpu_kernels.switched(False):
        assert cast_module.cast_host_recording(t, 3.5, torch.float8_e4m3fn) is None


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_stats_counted_by_the_kernels_equal_the_torch_counts(recipe):
    """A bf16 Linear's statistics counted by the kernels (on the casts' bf16 values: dy's deferred bytes stay
    unmade) equal those counted by torch without the kernels, row for row, including saturation and underflow."""
    from fp8kit.pytorch.stats import RoleStats

    def run(on):
        torch.manual_seed(0)
        lin = te.Linear(256, 128, params_dtype=torch.bfloat16)
        te.enable_stats(lin)
        g = torch.Generator().manual_seed(2)
        made = []
        record_host = RoleStats.record_host

        def spy(self, x, q, scale, a):
            record_host(self, x, q, scale, a)
            made.append(getattr(q, "bytes_made", True))
        RoleStats.record_host = spy
        try:
            with cpu_kernels.switched(on):
                for _ in range(2):
                    x = (torch.randn(512, 256, generator=g) * torch.logspace(-9, 3, 256)).bfloat16()
                    x[0, :4] = torch.tensor([0.0, -0.0, float("nan"), 1e-30])
                    x.requires_grad_()
                    with te.autocast(recipe=recipe):
                        y = lin(x)
                    (y.float() * torch.logspace(-12, 4, 128)).sum().backward()
        finally:
            RoleStats.record_host = record_host
        return te.stats(lin), made

    (got, made_on), (want, _) = run(True), run(False)
    assert got == want and got[0]["saturated"] > 0 and got[0]["underflow"] > 0
    assert False in made_on  # a grad_output counted without making its bytes


def test_stats_rows_combine_host_and_tensor_casts():
    """Casts recorded by torch (`record`) and by the kernels (`record_host`) into one RoleStats give the row of all
    of them (reference counts), with the most recent cast's scale."""
    from fp8kit.pytorch.stats import RoleStats

    rng = np.random.default_rng(7)
    xs = [(rng.standard_normal(4096) * 10.0 ** rng.uniform(-8, 3, 4096)).astype(np.float32) for _ in range(3)]
    for x in xs:
        x[:3] = [0.0, np.nan, 1e-30]
    scales = [2.0, 0.5, 8.0]
    rs = RoleStats()
    for i, (x, s) in enumerate(zip(xs, scales)):
        t = torch.from_numpy(x)
        q = cast_host(t, s, torch.float8_e4m3fn, math.inf)
        if i == 1:
            rs.record(t, q, torch.tensor(s), torch.tensor(float(ref.amax(x))))
        else:
            rs.record_host(t, q, s, float(ref.amax(x)))
    row = rs.row()
    bytes_ = [ref.cast(x, "e4m3", s)[0] for x, s in zip(xs, scales)]
    n = sum(x.size for x in xs)
    saturated = sum(int(np.sum((b & 0x7F) == 0x7E)) for b in bytes_) / n
    nonzero = sum(int(np.count_nonzero(x)) for x in xs)
    flushed = sum(int(np.sum((x != 0) & ((b & 0x7F) == 0))) for x, b in zip(xs, bytes_))
    assert row["saturated"] == pytest.approx(saturated, rel=1e-12) and saturated > 0
    assert row["underflow"] == pytest.approx(flushed / nonzero, rel=1e-12) and flushed > 0
    assert row["amax"] == float(max(ref.amax(x) for x in xs)) and row["scale"] == 8.0 and row["casts"] == 3
