"""The cast kernels of fp8kit.pytorch.kernels (cast, amax, transpose, bias gradient) against the torch path and
tests/reference.py. See tests/triton_helpers.py for what the interpreter (CPU) cases can and cannot show; the
update kernels are in test_triton_update.py, the compiled code in test_triton_compiled.py, the stress tests for a
GPU in test_triton_stress.py.
"""

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from triton_helpers import (  # noqa: E402,F401
    E4M3,
    E5M2,
    FMT,
    assert_bias_grad,
    assert_cast_equal,
    assert_transpose,
    bits,
    dev_fixture,
    make_x,
    reference_check,
    torch_cast_bytes,
)

from fp8kit.pytorch import cast as tcast  # noqa: E402
from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

import reference  # noqa: E402

SHAPES = [(1, 1), (17, 33), (130, 70), (2, 3, 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_cast_amax_matches_torch_and_reference(dev, shape, dtype, fp8_dtype):
    x = make_x(shape, dtype, seed=len(shape) + shape[0]).to(dev)
    scale = torch.tensor(0.75, device=dev)
    data, data_t, a = kernels.cast_amax(x, scale, fp8_dtype, transpose=True)
    assert data.shape == x.shape and data.dtype == fp8_dtype
    y = x.float() * scale
    assert_cast_equal(data, torch_cast_bytes(x, scale, fp8_dtype), y, exact=dev == "cuda")
    reference_check(data, x, 0.75, FMT[fp8_dtype])
    assert_transpose(data, data_t)
    assert a.dim() == 0 and a.dtype == torch.float32
    assert a.item() == tcast.amax(x).item() == float(reference.amax(x.cpu().float().numpy()))
    flat, none, a2 = kernels.cast_amax(x, scale, fp8_dtype)  # the flat (untransposed) kernel: same bytes
    assert none is None and torch.equal(bits(flat), bits(data)) and a2.item() == a.item()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_special_values_exact(dev, fp8_dtype):
    """NaN is 0x7F whatever its sign, +-inf and overflow saturate, zeros keep their sign: exact bytes even in the
    interpreter (no rounding is involved)."""
    vals = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.0, -0.0, 448.0, -448.0, 2.0, -0.5]
    x = torch.tensor([vals], dtype=torch.float32)
    x.view(torch.int32)[0, 0] = -4194304  # -NaN
    x = x.to(dev)
    scale = torch.tensor(1.0, device=dev)
    for transpose in (False, True):
        data, _, a = kernels.cast_amax(x, scale, fp8_dtype, transpose=transpose)
        assert torch.equal(bits(data), torch_cast_bytes(x, scale, fp8_dtype))
        fp8_max = tcast.FP8_MAX[fp8_dtype]
        assert data.float().cpu()[0, 1:5].tolist() == [fp8_max, -fp8_max, fp8_max, -fp8_max]
        assert a.item() == float("inf")


@pytest.mark.parametrize("shape", [(1, 1), (40, 50), (3, 1000), (9000,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amax(dev, shape, dtype):
    x = make_x(shape, dtype, seed=3).to(dev)
    a = kernels.amax(x)
    assert a.dim() == 0 and a.dtype == torch.float32
    assert a.item() == tcast.amax(x).item() == float(reference.amax(x.cpu().float().numpy()))
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    assert kernels.amax(finite).item() == float(reference.amax(finite.cpu().float().numpy()))


def test_amax_all_nan_and_empty(dev):
    assert kernels.amax(torch.full((5, 7), float("nan"), device=dev)).item() == 0.0
    assert kernels.amax(torch.empty(0, 4, device=dev)).item() == 0.0


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("stage", [0.0, 2.0, 1e9, -1.0, -0.0, "-nan"])
def test_amax_accumulates_into_staging_slot(dev, stage, transpose):
    """With `amax_out` the tensor's amax is max-accumulated into the slot as `ScalingState.record` does (fmax), by
    one atomic per tile: values with the sign bit set (negative numbers, -0.0, a negative NaN) are replaced, larger
    ones kept; the other slots are untouched."""
    history = torch.zeros(4, 3)
    history[0] = torch.tensor([5.0, 0.0, 7.0])
    if stage == "-nan":
        history.view(torch.int32)[0, 1] = -4194304
    else:
        history[0, 1] = stage
    history[1:] = 3.0
    history = history.to(dev)
    x = make_x((33, 65), torch.bfloat16, seed=5).to(dev)
    scale = torch.ones(3, device=dev)
    expected = history.clone()
    expected[0, 1] = torch.fmax(expected[0, 1], tcast.amax(x))
    _, _, a = kernels.cast_amax(x, scale[1], E4M3, transpose=transpose, amax_out=history[0, 1])
    assert a.data_ptr() == history[0, 1].data_ptr()
    assert torch.equal(bits(history), bits(expected))
    kernels.cast_amax(x * 2, scale[1], E4M3, transpose=transpose, amax_out=history[0, 1])
    expected[0, 1] = torch.fmax(expected[0, 1], tcast.amax(x * 2))
    assert torch.equal(bits(history), bits(expected))


def test_positive_nan_in_the_staging_slot_is_kept(dev):
    """The documented limit of the one-atomic accumulation (kernels/cast_ops.py): a positive NaN already in the slot
    stays (fp8kit's own staging rows never hold one)."""
    slot = torch.tensor([float("nan")], device=dev)
    kernels.cast_amax(torch.ones(8, 8, device=dev), torch.ones((), device=dev), E4M3, amax_out=slot[0])
    assert torch.isnan(slot).all()


def test_cast_without_amax_and_scale_inv(dev):
    x = make_x((70, 130), torch.float16, seed=7).to(dev)
    scale = torch.tensor([3.0], device=dev)
    scale_inv = torch.empty((), device=dev)
    data, data_t = kernels.cast(x, scale, E5M2, transpose=True, scale_inv_out=scale_inv)
    ref_data, ref_t, _ = kernels.cast_amax(x, scale, E5M2, transpose=True)
    assert torch.equal(bits(data), bits(ref_data)) and torch.equal(bits(data_t), bits(ref_t))
    assert_cast_equal(data, torch_cast_bytes(x, scale, E5M2), x.float() * scale, exact=dev == "cuda")
    assert bits(scale_inv).item() == bits(torch.reciprocal(scale)).item()
    assert scale_inv.item() == float(np.float32(1) / np.float32(3))
    no_t, none = kernels.cast(x, scale, E5M2)
    assert none is None and torch.equal(bits(no_t), bits(data))


@pytest.mark.parametrize("shape", [(130, 70), (1, 200), (300,), (3, 5, 70), (64, 64)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_cast_transpose_amax(dev, shape, fp8_dtype):
    """One pass: bytes, transposed bytes, scale_inv, and the amax into the staging slot."""
    x = make_x(shape, torch.bfloat16, seed=shape[0]).to(dev)
    scale = torch.tensor(0.5, device=dev)
    slot = torch.tensor([1.5, 0.0], device=dev)
    data, data_t, inv = kernels.cast_transpose_amax(x, scale, fp8_dtype, amax_out=slot[1])
    assert_cast_equal(data, torch_cast_bytes(x, scale, fp8_dtype), x.float() * scale, exact=dev == "cuda")
    assert_transpose(data, data_t)
    assert inv.dtype == torch.float32 and inv.item() == 2.0
    assert slot[0].item() == 1.5 and slot[1].item() == float(reference.amax(x.cpu().float().numpy()))


@pytest.mark.parametrize("shape", [(130, 70), (2, 33, 17), (1, 5), (64, 64), (200, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_transpose_dbias(dev, shape, dtype):
    """grad_output: bytes, transpose, amax and the bias gradient (sum over all leading dimensions) in one pass."""
    g = torch.Generator().manual_seed(sum(shape))
    dy = (torch.randn(shape, generator=g) * 30).to(dtype)
    dy.view(-1)[min(3, dy.numel() - 1)] = 5000.0  # past E5M2's range after the scale: saturates
    dy = dy.to(dev)
    scale = torch.tensor(16.0, device=dev)
    slot = torch.zeros(2, device=dev)
    data, data_t, inv, dbias = kernels.cast_transpose_dbias(dy, scale, E5M2, amax_out=slot[0])
    assert_cast_equal(data, torch_cast_bytes(dy, scale, E5M2), dy.float() * scale, exact=dev == "cuda")
    assert_transpose(data, data_t)
    assert inv.item() == 1 / 16
    assert slot[0].item() == float(reference.amax(dy.cpu().float().numpy())) and slot[1].item() == 0.0
    assert_bias_grad(dbias, dy)


@pytest.mark.parametrize("eps,power_2", [(0.0, False), (1e-3, True)])
def test_current_cast_transpose_dbias(dev, eps, power_2):
    dy = make_x((70, 45), torch.bfloat16, seed=9)
    dy = torch.where(torch.isfinite(dy), dy, torch.zeros_like(dy)).to(dev)  # a finite bias gradient
    data, data_t, scale, scale_inv, a, dbias = kernels.current_cast_transpose_dbias(dy, E5M2, eps, power_2)
    want_scale = tcast.current_scale(dy, 57344.0, eps, power_2)
    assert bits(scale).item() == bits(want_scale).item()
    assert bits(scale_inv).item() == bits(torch.reciprocal(want_scale)).item()
    assert a.item() == tcast.amax(dy).item()
    assert_cast_equal(data, torch_cast_bytes(dy, want_scale, E5M2), dy.float() * want_scale, exact=dev == "cuda")
    assert_transpose(data, data_t)
    assert_bias_grad(dbias, dy)


@pytest.mark.parametrize("fill", ["random", "zeros", "nan_inf", "tiny"])
@pytest.mark.parametrize("eps,power_2", [(0.0, False), (0.0, True), (1e-3, False), (2.0, True)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_current_cast(dev, fill, eps, power_2, fp8_dtype):
    x = make_x((19, 37), torch.bfloat16, seed=11).float()
    x = torch.where(torch.isinf(x), torch.zeros_like(x), x)  # keep NaN, drop inf: a finite amax
    if fill == "zeros":
        x = torch.zeros_like(x)
    elif fill == "nan_inf":
        x = torch.full_like(x, float("nan"))
        x[3, 4] = float("-inf")
    elif fill == "tiny":
        x = torch.full_like(x, 1e-39)  # 448 / 1e-39 overflows float32: the scale becomes FLT_MAX
    x = x.to(dev)
    fp8_max = tcast.FP8_MAX[fp8_dtype]
    data, data_t, scale, scale_inv, a = kernels.current_cast(x, fp8_dtype, eps, power_2, transpose=True)
    want_scale = tcast.current_scale(x, fp8_max, eps, power_2)
    assert bits(scale).item() == bits(want_scale).item()
    assert bits(scale).item() == bits(torch.from_numpy(np.array(
        reference.current_scale(reference.amax(x.cpu().numpy()), fp8_max, eps, power_2)))).item()
    assert bits(scale_inv).item() == bits(torch.reciprocal(want_scale)).item()
    assert a.item() == tcast.amax(x).item()
    assert_cast_equal(data, torch_cast_bytes(x, want_scale, fp8_dtype), x * want_scale, exact=dev == "cuda")
    assert_transpose(data, data_t)


@pytest.mark.parametrize("fill", ["random", "empty"])
@pytest.mark.parametrize("dbias", [False, True])
def test_current_cast_without_the_scale_and_amax_outputs(dev, fill, dbias):
    """`with_scale=False, with_amax=False` (what the quantizers ask: they keep only scale_inv) writes the same bytes,
    transpose, scale_inv and bias gradient as a cast that also gives the scale and the amax, and returns None for
    those two."""
    x = make_x((33, 21), torch.bfloat16, seed=5)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    if fill == "empty":
        x = x[:0]
    x = x.to(dev)
    cast = kernels.current_cast_transpose_dbias if dbias else functools.partial(kernels.current_cast, transpose=True)
    with_scale = cast(x, E4M3, 1e-3, True, raw=True)
    without = cast(x, E4M3, 1e-3, True, raw=True, with_scale=False, with_amax=False)
    assert without[2] is None and without[4] is None and with_scale[2] is not None and with_scale[4] is not None
    for i, (a, b) in enumerate(zip(with_scale, without)):
        if i not in (2, 4) and a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a) if a.is_floating_point() else a,
                                                                             bits(b) if b.is_floating_point() else b)
    assert bits(without[3]).item() == bits(torch.reciprocal(with_scale[2])).item()


def test_empty_tensors(dev):
    for shape in [(0, 5), (5, 0), (0,)]:
        x = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        scale = torch.tensor(2.0, device=dev)
        data, data_t, a = kernels.cast_amax(x, scale, E4M3, transpose=True)
        assert data.shape == x.shape and data_t.numel() == 0 and a.item() == 0.0
        slot = torch.tensor([float("nan"), 4.0], device=dev)
        kernels.cast_amax(x, scale, E4M3, amax_out=slot[0])
        assert slot.tolist() == [0.0, 4.0]  # fmax(NaN, 0) = 0, as ScalingState.record gives
        _, _, s, s_inv, a = kernels.current_cast(x, E5M2, amax_epsilon=0.5)
        assert (s.item(), a.item()) == (57344.0 / 0.5, 0.0)
        assert s_inv.item() == float(np.float32(1) / np.float32(114688.0))
        _, _, inv, dbias = kernels.cast_transpose_dbias(x, scale, E5M2)
        assert inv.item() == 0.5 and dbias.shape == x.shape[-1:] and not dbias.any()


def test_bad_arguments_raise(dev):
    x = torch.ones(4, 4, device=dev)
    one = torch.ones((), device=dev)
    with pytest.raises(TypeError, match="scale must be a float32 tensor with one element"):
        kernels.cast(x, torch.ones(2, device=dev), E4M3)
    with pytest.raises(TypeError, match="float64"):
        kernels.cast(x, torch.ones((), dtype=torch.float64, device=dev), E4M3)
    with pytest.raises(TypeError, match="fp8_dtype"):
        kernels.cast(x, one, torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.cast(x.t()[:, :2], one, E4M3)
    with pytest.raises(TypeError, match="torch.int32"):
        kernels.cast_transpose_dbias(x.int(), one, E5M2)
    with pytest.raises(TypeError, match="list"):
        kernels.amax([1.0, 2.0])
    with pytest.raises(ValueError, match="amax_epsilon"):
        kernels.current_cast(x, E4M3, amax_epsilon=-1.0)
    with pytest.raises(ValueError):
        kernels.update(torch.zeros(4, 3, device=dev), torch.ones(3, device=dev),
                       DelayedScaling(amax_compute_algo=lambda h: h.amax(0)), 448.0)


def test_switches(monkeypatch):
    monkeypatch.delenv("FP8KIT_TRITON", raising=False)
    kernels.set_enabled(None)
    # the default: on for CUDA tensors only (where available), not for meta or interpreted CPU tensors
    assert kernels.enabled() and not kernels.on_for("meta")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.refresh()
    assert not kernels.on_for("cpu")
    monkeypatch.setenv("FP8KIT_TRITON", "1")
    kernels.refresh()
    assert kernels.enabled() and kernels.on_for("meta") and kernels.on_for("cpu") == kernels.available("cpu")
    monkeypatch.setenv("FP8KIT_TRITON", "0")
    kernels.refresh()
    assert not kernels.enabled() and not kernels.on_for("meta")
    kernels.set_enabled(True)
    assert kernels.enabled() and kernels.on_for("meta")
    monkeypatch.delenv("FP8KIT_TRITON")
    kernels.set_enabled(False)
    assert not kernels.enabled() and not kernels.on_for("meta")
    kernels.set_enabled(None)
    assert kernels.enabled() and not kernels.on_for("meta")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.available("cpu")
    assert kernels.available("meta")  # shapes only: outputs are allocated, nothing runs
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.amax(torch.ones(3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.available("cpu") and kernels.available(torch.device("cpu"))
    assert kernels.available("cuda") == (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))


def test_import_without_triton():
    """`import fp8kit.pytorch.kernels` works where Triton cannot be imported, and reports the kernels unavailable."""
    code = ("import sys; sys.modules['triton'] = None; import fp8kit, fp8kit.pytorch.kernels as k; "
            "assert not k.available('cpu'); assert 'triton' not in [m for m in sys.modules if sys.modules[m]]; "
            "print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


CUDA_GRID_X = 2 ** 31 - 1  # the x axis; y and z take 65535


@pytest.mark.parametrize("shape,transpose", [((1 << 26,), False), ((1, 1 << 26), True), ((1 << 20, 64), True),
                                             ((1 << 26,), True)])
def test_grids_fit_cuda_limits(shape, transpose):
    """The launch grids (recorded on meta tensors: nothing runs) are 1-D, within the x axis' limit, and cover the
    tensor: the bench's 2**26-element quantize row used to put cdiv(N, 64) = 2**20 programs on the y axis."""
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    one = torch.ones((), device="meta")
    with kernels.observe_launches() as launches:
        kernels.cast_amax(x, one, E4M3, transpose=transpose)
        kernels.current_cast(x, E5M2, transpose=transpose)
        if transpose:
            kernels.cast_transpose_dbias(x, one, E5M2)
    assert launches
    m, n = x.numel() // shape[-1], shape[-1]
    for launch in launches:
        assert len(launch.grid) == 1 and 1 <= launch.grid[0] <= CUDA_GRID_X, launch
        if launch.kernel == "cast_transpose_kernel":
            assert launch.grid[0] == -(-m // 64) * -(-n // 64)
        elif launch.kernel in ("cast_flat_kernel", "amax_kernel"):
            assert launch.grid[0] * 4096 >= x.numel() > (launch.grid[0] - 1) * 4096


def test_launch_makes_the_tensors_device_current(monkeypatch):
    """Triton launches on the current CUDA device: `launch` enters `torch.cuda.device(x.device)` around it when
    that device is not current already.
    Checked with stand-ins for the CUDA context and the kernel module (no GPU here)."""
    from fp8kit.pytorch.kernels import launch as launch_mod

    events = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            events.append(("enter", self.device))

        def __exit__(self, *exc):
            events.append(("exit", self.device))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: events.append(("launch", grid))

    class Module:
        cast_flat_kernel = Kernel()

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod, "module_for", lambda device, file="triton_fp8": Module())
    monkeypatch.setattr(launch_mod, "_KERNELS", {})
    device = torch.device("cuda", 1)
    launch_mod.launch("cast_flat_kernel", (3,), device, (), {})
    assert events == [("enter", device), ("launch", (3,)), ("exit", device)]
    events.clear()  # on the current device already: no switch
    launch_mod.launch("cast_flat_kernel", (4,), torch.device("cuda", 0), (), {})
    assert events == [("launch", (4,))]
