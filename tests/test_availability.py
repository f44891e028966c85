"""Transformer Engine's availability queries: TE's return shapes, and answers that match what fp8kit actually does on
each device (CPU emulation, torch._scaled_mm on CUDA)."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import gemm as gemm_module
from fp8kit.pytorch.tensor import Float8TensorStorage
from fp8kit.recipe import DelayedScaling


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA runtime that reports one device of a chosen compute capability."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
        monkeypatch.setattr(torch.version, "hip", None)
    return install


def te_fp8_rule(capability):
    """Transformer Engine's _compute_fp8_support (leaving out its cuBLASLt / CUDA version checks on Ada)."""
    return capability >= (9, 0) or capability >= (8, 9)


def test_cpu_always_has_fp8_and_runs_it():
    assert te.is_fp8_available(device="cpu") is True
    assert te.is_fp8_available(True, device="cpu") == (True, "")  # TE: the reason is "" when available
    if not torch.cuda.is_available():
        assert te.is_fp8_available() is True and te.is_fp8_available(return_reason=True) == (True, "")
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16)
    with te.autocast(recipe=DelayedScaling()):
        y = layer(x)
    assert not torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))  # FP8 really ran


@pytest.mark.parametrize("capability", [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_cuda_answer_follows_compute_capability(fake_cuda, capability):
    fake_cuda(capability)
    expected = te_fp8_rule(capability)
    assert te.is_fp8_available() is expected
    ok, reason = te.is_fp8_available(return_reason=True)
    assert ok is expected
    if expected:
        assert reason == ""
    else:
        assert f"{capability[0]}.{capability[1]}" in reason and "8.9" in reason and "Fake GPU" in reason
    assert te.is_fp8_available(device="cpu") is True  # the CPU still emulates
    assert te.is_bf16_available() is (capability >= (8, 0))
    assert te.get_device_compute_capability() == capability


def test_cuda_tensors_never_take_the_emulated_gemm(monkeypatch):
    """Why a GPU below 8.9 is 'not available': a non-CPU FP8 GEMM goes to torch._scaled_mm, never to emulation
    (checked on meta tensors, which take the device path)."""
    calls = []

    def scaled_mm(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        return torch.empty(a.shape[0], b.shape[1], dtype=kwargs["out_dtype"], device=a.device)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(gemm_module, "emulated", lambda *a, **k: pytest.fail("emulated GEMM on a device tensor"))
    a = Float8TensorStorage(data=torch.empty(16, 32, dtype=torch.float8_e4m3fn, device="meta"),
                            fp8_scale_inv=torch.ones(1, device="meta"))
    b = Float8TensorStorage(data=torch.empty(32, 16, dtype=torch.float8_e4m3fn, device="meta"),
                            fp8_scale_inv=torch.ones(1, device="meta"))
    out = gemm_module.gemm(a, b, torch.bfloat16)
    assert calls == [(torch.float8_e4m3fn, torch.float8_e4m3fn)] and out.shape == (16, 16)


def test_other_devices_and_rocm(fake_cuda, monkeypatch):
    ok, reason = te.is_fp8_available(True, device="mps")
    assert not ok and "mps" in reason
    fake_cuda((9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.0")
    ok, reason = te.is_fp8_available(return_reason=True)
    assert not ok and "ROCm" in reason


@pytest.mark.parametrize("query", [te.is_mxfp8_available, te.is_fp8_block_scaling_available, te.is_nvfp4_available])
@pytest.mark.parametrize("capability", [(8, 0), (10, 0)])
def test_block_recipes_are_emulated_everywhere(fake_cuda, query, capability):
    assert query() is True and query(return_reason=True) == (True, "")
    fake_cuda(capability)
    assert query() is True


def test_default_recipe_is_what_autocast_uses():
    recipe = te.get_default_recipe()
    layer = te.Linear(16, 16)
    with te.autocast():
        layer(torch.randn(2, 16))
    assert layer.fp8_meta["recipe"] == recipe and isinstance(recipe, DelayedScaling)


def test_bad_arguments_and_no_cuda(monkeypatch):
    with pytest.raises(TypeError, match="return_reason must be a bool, got 'yes'"):
        te.is_fp8_available("yes")
    with pytest.raises(ValueError, match="device must be"):
        te.is_fp8_available(device="not-a-device")
    assert te.is_bf16_available(device="cpu") is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        te.get_device_compute_capability()
