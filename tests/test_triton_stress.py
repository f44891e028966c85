"""Stress tests of the Triton kernels on a GPU (marker `cuda`; they skip without a CUDA device of compute capability
8.9+): tensors at the sizes a training run uses, the transposed output against `data.t()`, every byte against the
torch path on the same device, and many tiles racing on one staging slot. None of them has run yet (no GPU was
available to the sessions that wrote them)."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from triton_helpers import E4M3, E5M2, assert_bias_grad, assert_transpose, bits  # noqa: E402

from fp8kit.pytorch import cast as tcast  # noqa: E402
from fp8kit.pytorch import kernels  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture
def gpu():
    if not kernels.available("cuda"):
        pytest.skip("needs a CUDA device of compute capability >= 8.9")
    return torch.device("cuda")


def _randn(shape, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * 300).to(dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_flat_2_pow_26(gpu, fp8_dtype):
    """The bench's quantize row: 2**26 elements in one dimension (used to exceed the grid's y limit)."""
    x = _randn((1 << 26,), torch.bfloat16, gpu, 1)
    x[12345] = float("nan")
    scale = torch.tensor(0.5, device=gpu)
    slot = torch.zeros(1, device=gpu)
    data, none, _ = kernels.cast_amax(x, scale, fp8_dtype, amax_out=slot[0])
    assert none is None
    assert torch.equal(bits(data), bits(tcast.cast_to_fp8(x, scale, fp8_dtype)))
    assert slot.item() == tcast.amax(x).item()
    data2, data_t, s, _, a = kernels.current_cast(x, fp8_dtype, transpose=True)
    assert torch.equal(bits(s), bits(tcast.current_scale(x, tcast.FP8_MAX[fp8_dtype])))
    assert torch.equal(bits(data2), bits(tcast.cast_to_fp8(x, s, fp8_dtype)))
    assert_transpose(data2, data_t)


@pytest.mark.parametrize("shape", [(16384, 4096), (4096 + 17, 12288 + 5), (8, 3, 50257)])
def test_large_transpose_and_dbias(gpu, shape):
    """x for wgrad and dy for wgrad/dbias at layer sizes, with odd edges: data_t equals data.t() byte for byte."""
    x = _randn(shape, torch.bfloat16, gpu, 2)
    scale = torch.tensor(0.25, device=gpu)
    slot = torch.zeros(1, device=gpu)
    data, data_t, inv = kernels.cast_transpose_amax(x, scale, E4M3, amax_out=slot[0])
    assert torch.equal(bits(data), bits(tcast.cast_to_fp8(x, scale, E4M3)))
    assert_transpose(data, data_t)
    assert inv.item() == 4.0 and slot.item() == tcast.amax(x).item()
    dy = x / 300
    data, data_t, _, dbias = kernels.cast_transpose_dbias(dy, scale, E5M2)
    assert torch.equal(bits(data), bits(tcast.cast_to_fp8(dy, scale, E5M2)))
    assert_transpose(data, data_t)
    assert_bias_grad(dbias, dy)


def test_many_tiles_race_on_one_staging_slot(gpu):
    """Thousands of programs max-accumulate into one float32 with one atomic each; repeated with the maximum in
    different tiles, and with a negative NaN and a negative number already in the slot."""
    x = torch.rand(8192, 8192, device=gpu, dtype=torch.bfloat16)
    one = torch.ones((), device=gpu)
    for i, start in enumerate([0.0, -5.0, "-nan"]):
        y = x.clone()
        y.view(-1)[(i * 7919 * 4099) % y.numel()] = 3.0 + i
        slot = torch.full((1,), 0.0 if start == "-nan" else start, device=gpu)
        if start == "-nan":
            slot.view(torch.int32).fill_(-4194304)
        for transpose in (False, True):
            slot_t = slot.clone()
            kernels.cast_amax(y, one, E4M3, transpose=transpose, amax_out=slot_t[0])
            assert slot_t.item() == 3.0 + i


def test_launch_on_a_second_device():
    """Tensors on cuda:1 while cuda:0 is current: the launch must run on cuda:1."""
    if torch.cuda.device_count() < 2 or not kernels.available("cuda:1"):
        pytest.skip("needs two CUDA devices of compute capability >= 8.9")
    x = _randn((300, 500), torch.bfloat16, "cuda:1", 3)
    scale = torch.tensor(2.0, device="cuda:1")
    with torch.cuda.device(0):
        data, data_t, a = kernels.cast_amax(x, scale, E4M3, transpose=True)
    assert data.device == x.device
    assert torch.equal(bits(data), bits(tcast.cast_to_fp8(x, scale, E4M3)))
    assert_transpose(data, data_t)
    assert a.item() == tcast.amax(x).item()
