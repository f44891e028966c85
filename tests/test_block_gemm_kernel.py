"""The Triton kernel of the block-scaled GEMMs (fp8kit.pytorch.kernels.block_gemm_ops) gives the torch path's numbers
bit for bit: MXFP8 (1-D and 2-D), Float8 block (power-of-two and float32 scales, K not a multiple of 128), NVFP4
(1x16 and 16x16 weights, RHT), as a Linear's fprop, dgrad and wgrad call them, with edge tiles. On the CPU through
Triton's interpreter (its `tl.fma` rounds once, as the GPU's `fma.rn.f32`); on a CUDA device with `-m cuda`. Both
ways of the float64 block sum (the float64 MMA, DOT64, and the rank-1 updates) are checked on either. The compiled
code (fp64 MMA on sm_90, rank-1 `fma.rn.f64` elsewhere, hardware FMA, the TF32 MMA's sum not folded into its
accumulator) is checked offline for sm_89, sm_90 and sm_100."""

import re

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from block_helpers import wide_range  # noqa: E402
from triton_helpers import dev_fixture  # noqa: E402,F401

from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.pytorch.block_gemm import block_gemm  # noqa: E402
from fp8kit.pytorch.kernels import launch as klaunch  # noqa: E402
from fp8kit.pytorch.nvfp4_gemm import nvfp4_gemm  # noqa: E402
from fp8kit.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer  # noqa: E402
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer  # noqa: E402
from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F8 = dict(rowwise=True, columnwise=True)
BLOCK_QUANTIZERS = {
    "mxfp8": (lambda: MXFP8Quantizer(E4M3), lambda: MXFP8Quantizer(E4M3)),
    "mxfp8 2d w": (lambda: MXFP8Quantizer(E4M3), lambda: MXFP8Quantizer(E4M3, with_2d_quantization=True)),
    "mxfp8 e5m2": (lambda: MXFP8Quantizer(E5M2), lambda: MXFP8Quantizer(E4M3)),
    "float8 pow2": (lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=1),
                    lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=2)),
    "float8 f32": (lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=1, force_pow_2_scales=False),
                   lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=2, force_pow_2_scales=False)),
    "float8 1d x 1d": (lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=1, force_pow_2_scales=False),
                       lambda: Float8BlockQuantizer(E4M3, **F8, block_scaling_dim=1, force_pow_2_scales=False)),
}


def _gemms(gemm, qx, qw, qdy):
    """fprop x @ w^T, dgrad dy @ w, wgrad dy^T @ x, and both 2-D: w^T w."""
    return [gemm(qx, qw), gemm(qdy, qw, transpose_b=True), gemm(qdy, qx, transpose_a=True, transpose_b=True)]


def _both_paths(dev, gemm, make_x, make_w, shapes, seed, nan=False):
    m, n, k = shapes
    g = torch.Generator().manual_seed(seed)
    x = wide_range((m, k), torch.float32, seed).clamp(-1e30, 1e30) if seed % 2 else torch.randn(m, k, generator=g)
    w, dy = torch.randn(n, k, generator=g), torch.randn(m, n, generator=g) * 1e-3
    if nan:  # NaN stays in its own byte (block casts): its row and column of each product become NaN
        x[3, 40], w[7, 100], dy[5, 9] = float("nan"), float("nan"), float("nan")
    qx, qw, qdy = make_x()(x.to(dev)), make_w()(w.to(dev)), make_x()(dy.to(dev))
    with kernels.enabled_as(False):
        want = _gemms(gemm, qx, qw, qdy)
    with kernels.enabled_as(True), klaunch.observe_launches() as launches:
        got = _gemms(gemm, qx, qw, qdy)
    assert [r.kernel for r in launches] == ["block_gemm_kernel"] * 3
    assert kernels.block_gemm_ops.kernel_failure() is None  # ran, not fallen back to the torch path
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if nan:  # a NaN's sign and payload are the hardware's (NVFP4 has no NaN code: its NaN-free casts)
            assert a.isnan().any() or gemm is nvfp4_gemm
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


@pytest.mark.parametrize("name", list(BLOCK_QUANTIZERS))
def test_block_kernel_equals_torch_path(dev, name):
    make_x, make_w = BLOCK_QUANTIZERS[name]
    shapes = (96, 160, 320) if name.startswith("float8") else (96, 160, 256)  # K = 320: a short last 128 block
    # E5M2 blocks of wide range can span more bits than float64 holds: their sums depend on the order (the BLAS's
    # or the MMA's), so only random normals (seed 2) for them
    for seed in (2,) if "e5m2" in name else (1, 2):
        _both_paths(dev, block_gemm, make_x, make_w, shapes, seed)


@pytest.mark.parametrize("kw", [{}, dict(with_2d_quantization=True), dict(with_rht=True, with_post_rht_amax=True)])
def test_nvfp4_kernel_equals_torch_path(dev, kw):
    for seed in (1, 2):
        _both_paths(dev, nvfp4_gemm, lambda: NVFP4Quantizer(), lambda: NVFP4Quantizer(**kw), (160, 224, 288), seed)


@pytest.mark.parametrize("name", ["mxfp8", "float8 f32", "nvfp4"])
def test_nan_operands(dev, name):
    if name == "nvfp4":
        _both_paths(dev, nvfp4_gemm, NVFP4Quantizer, NVFP4Quantizer, (160, 224, 288), 2, nan=True)
    else:
        _both_paths(dev, block_gemm, *BLOCK_QUANTIZERS[name], (96, 160, 256), 2, nan=True)


@pytest.mark.parametrize("name", ["mxfp8", "float8 f32", "nan"])
def test_rank1_branch_equals_torch_path(dev, name, monkeypatch):
    """The F64 branch without the float64 MMA (DOT64 off: the rank-1 updates sm_100 and sm_89 run) gives the same
    bits: MXFP8, Float8 block with float32 scales and a short last block, NaN operands."""
    monkeypatch.setattr(kernels.block_gemm_ops, "dot64_for", lambda device: False)
    if name == "nan":
        _both_paths(dev, block_gemm, *BLOCK_QUANTIZERS["mxfp8"], (96, 160, 256), 2, nan=True)
    else:
        _both_paths(dev, block_gemm, *BLOCK_QUANTIZERS[name], (96, 160, 320 if name == "float8 f32" else 256), 1)


def test_dot64_choice():
    """The float64 MMA on sm_90 only (Triton 3.6 cannot lower it for sm_100), and in the interpreter."""
    ops = kernels.block_gemm_ops
    assert ops.dot64_for_capability((9, 0)) and not ops.dot64_for_capability((10, 0))
    assert not ops.dot64_for_capability((8, 9)) and not ops.dot64_for_capability((12, 0))
    assert ops.dot64_for(torch.device("cpu")) and not ops.dot64_for(torch.device("meta"))


def test_failure_message_ends_with_the_cause():
    """A CompilationError's message is a source excerpt ending with `^`; the warning names the failing line and the
    cause, down to a bare assert's source line (Triton 3.6's float64 `tl.dot` failed so on an H200)."""
    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"

    def bare_assert(acc_dtype):  # pytest rewrites `assert` in tests (with a message): raised by hand instead
        if acc_dtype != "fp32":
            raise AssertionError()

    try:
        try:
            bare_assert("fp64")
        except AssertionError as cause:
            raise CompilationError("at 24:20:\n    if F64:\n        p = tl.dot(a, b, p)\n            ^") from cause
    except CompilationError as e:
        text = kernels.block_gemm_ops.describe_error(e)
    assert text.startswith("CompilationError at 24:20: p = tl.dot(a, b, p); caused by AssertionError at ")
    assert text.endswith(": raise AssertionError()") and "test_block_gemm_kernel.py" in text
    plain = ValueError("first line\nthe error itself")
    assert kernels.block_gemm_ops.describe_error(plain) == "ValueError: the error itself"


def test_triton_failure_falls_back_to_the_torch_path(monkeypatch):
    """A Triton error (compiling or launching) is warned once; the GEMMs then take the torch path (the same
    numbers). Any other error propagates."""
    ops = kernels.block_gemm_ops
    monkeypatch.setattr(ops, "_failure", [])

    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"
    calls = []

    def broken(*args):
        calls.append(1)
        raise CompilationError("no fp64 dot here")

    monkeypatch.setattr(ops, "_launch", broken)
    q = MXFP8Quantizer(E4M3)
    qx, qw = q(torch.randn(64, 128)), q(torch.randn(32, 128))
    with kernels.enabled_as(False):
        want = block_gemm(qx, qw)
    monkeypatch.setattr("fp8kit.pytorch.block_gemm.use_kernel", lambda x: True)
    with pytest.warns(RuntimeWarning, match="no fp64 dot here"):
        assert torch.equal(block_gemm(qx, qw), want)
    assert torch.equal(block_gemm(qx, qw), want) and len(calls) == 1  # not tried again
    assert "CompilationError: no fp64 dot here" in ops.kernel_failure()
    monkeypatch.setattr(ops, "_failure", [])
    monkeypatch.setattr(ops, "_launch", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        block_gemm(qx, qw)


def test_kernel_argument_errors():
    a = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="expected A"):
        kernels.block_gemm_ops.block_gemm_tiles(a, torch.zeros(4, 64), torch.ones(4, 1), torch.ones(4, 1), 32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.block_gemm_ops.block_gemm_tiles(a, a, torch.ones(4, 1), torch.ones(3, 1), 32, 0)


@pytest.mark.parametrize("arch", [pytest.param(89, marks=pytest.mark.slow), 90,
                                  pytest.param(100, marks=pytest.mark.slow)])  # the rank-1 unrolling: ~30 s each
def test_compiled_code(arch, monkeypatch, tmp_path):
    """Offline compile (no GPU) of what the host launches there: the float64 block sum on the fp64 MMA (sm_90) or as
    rank-1 `fma.rn.f64` updates (sm_89, sm_100), `fma.rn.f32` for the scales, and for NVFP4 a TF32 MMA whose block
    sum is added to y by a separate `add.f32` (never folded into the MMA's accumulator).
    tools/gpu/aot_compile_block_gemm.py compiles every combination."""
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 3):
        pytest.skip("ASTSource signature API of Triton >= 3.3")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ops = kernels.block_gemm_ops
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    fn = kernels.kernel_module(False, "triton_block_gemm").block_gemm_kernel
    dot64 = ops.dot64_for_capability(divmod(arch, 10))
    for f64, block, mode in ((True, 32, 0), (True, 128, 1), (True, 128, 2), (False, 16, 3)):
        bm, bn, warps, stages = ops._TILES[f64]
        cx = dict(BLOCK=block, KC=min(block, 32), BM=bm, BN=bn, MODE=mode, F64=f64, DOT64=dot64 and f64)
        sig = {a: "constexpr" if a in cx else "*fp32" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
        try:
            k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=warps, num_stages=stages))
        except (FileNotFoundError, PermissionError) as e:
            pytest.skip(f"cannot compile for CUDA here: {e}")
        ptx = k.asm["ptx"]
        assert ".ftz" not in ptx
        assert k.metadata.shared <= 99 * 1024  # fits an sm_89 block
        if f64:
            assert "cvt.rn.f32.f64" in ptx and "fma.rn.f32" in ptx  # fma.rn.f32x2 on sm_100: one rounding a lane
            f64_mma = re.search(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.f64", ptx)
            assert bool(f64_mma) == dot64 and (dot64 or "fma.rn.f64" in ptx)
            assert not re.search(r"\badd(\.rn)?\.f32", ptx)  # every y update is the fused multiply-add
        else:
            mma = {89: "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
                   90: "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", 100: "kind::tf32"}[arch]
            assert mma in ptx and re.search(r"\badd(\.rn)?\.f32", ptx)


def test_the_block_kernel_needs_an_explicit_switch(monkeypatch):
    """Opt-in: the CUDA default of the cast kernels does not turn it on; FP8KIT_TRITON=1 does."""
    from fp8kit.pytorch import block_gemm

    x = torch.empty(4, 4, device="meta")
    monkeypatch.delenv("FP8KIT_TRITON", raising=False)
    with kernels.enabled_as(None):
        assert not block_gemm.use_kernel(x)
    with kernels.enabled_as(True):
        assert block_gemm.use_kernel(x)
    monkeypatch.setenv("FP8KIT_TRITON", "1")
    kernels.refresh()
    assert block_gemm.use_kernel(x)
    monkeypatch.delenv("FP8KIT_TRITON")
    kernels.refresh()


def test_kernel_default_follows_the_measured_gpus(monkeypatch):
    """The block GEMM kernel runs by default on CUDA devices where it was measured (sm_90: the float64 MMA), elsewhere
    only when the kernels were turned on explicitly; never where the kernels do not run."""
    from fp8kit.pytorch import block_gemm as bg

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(bg.kernels, "on_for", lambda device: True)
    for capability, explicit, want in (((9, 0), False, True), ((10, 0), False, False), ((8, 9), False, False),
                                       ((10, 0), True, True)):
        monkeypatch.setattr(bg, "dot64_for", lambda device, c=capability: c[0] == 9)
        monkeypatch.setattr(bg.kernels, "opted_in", lambda e=explicit: e)
        fake = type("T", (), {"device": cuda})()
        assert bg.use_kernel(fake) is want, (capability, explicit)
    monkeypatch.setattr(bg.kernels, "on_for", lambda device: False)
    assert bg.use_kernel(type("T", (), {"device": cuda})()) is False
