"""Shared helpers of the Triton kernel tests (tests/test_triton_*.py): the device fixture, test data, and byte
comparisons against the torch path and tests/reference.py.

CPU cases run the kernels in Triton's interpreter. Its FP8 conversion mis-rounds (triton 3.9.0: ties go away from
zero, the carry into the exponent is lost at some exponent boundaries, e.g. 7.997 -> 4.0 in E4M3, and FP8 subnormals
are truncated), so there casts may differ from the torch bytes at a few elements, each only in those known ways;
amaxes, scales, NaN bytes, saturation, transposes and histories are exact. CUDA cases (marker `cuda`, skipped
without a GPU) run the compiled kernels and require every byte to be equal.
"""

import numpy as np
import pytest
import torch

from fp8kit.pytorch import cast as tcast
from fp8kit.pytorch import kernels

import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4M3: "e4m3", E5M2: "e5m2"}
# Fraction of elements: observed 3-6% on most data below, 14% where many values land in the FP8 subnormal range
# (truncated by the interpreter); a conversion that truncated everywhere would miss about half.
MAX_INTERPRETER_MISMATCH = 0.25


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], name="dev")
def dev_fixture(request, monkeypatch):
    """The device the kernels run on: CPU through the interpreter, or a CUDA device of compute capability 8.9+."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif not kernels.available("cuda"):
        pytest.skip("needs a CUDA device of compute capability >= 8.9")
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t` on the CPU (int32 for 4-byte, int16 for 2-byte, uint8 for 1-byte elements)."""
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    return t.detach().cpu().contiguous().view(view)


def make_x(shape, dtype, seed=0):
    """Random values around the FP8 range, plus NaN (both signs), +-inf, values past the FP8 max, zeros of both
    signs and tiny values (FP8 subnormals after scaling) at fixed positions when the tensor is big enough."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 200
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), 1e6, -1e6, 0.0, -0.0, 1e-3, -2.5e-3, 7.997, 0.0]
    for i, v in enumerate(specials[: max(flat.numel() - 1, 0)]):
        flat[(i * 7 + 3) % flat.numel()] = v
    if flat.numel() > 20:
        flat.view(torch.int32)[11] = -4194304  # a NaN with the sign bit set
    return x.to(dtype)


def grid_values(shape, seed=0, device="cpu"):
    """Multiples of 1/4 in [-2, 2]: exact in E4M3 and E5M2 times any power of two, and their sums over a few
    hundred rows are exact in float32 (no cast rounds, so the interpreter's mis-rounding cannot show)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(device)


def assert_cast_equal(q: torch.Tensor, ref_bytes: torch.Tensor, y: torch.Tensor, exact: bool) -> None:
    """`q` (FP8) against the expected bytes `ref_bytes` (uint8, same format) of `y = float32(x) * scale`.

    exact: every byte equal. Otherwise (interpreter) NaN and equal-code positions must match byte for byte, and each
    mismatch must be one the interpreter is known to make: the neighbouring FP8 code (one step; tie or subnormal
    rounding) or half a power of two (lost carry), at no more than MAX_INTERPRETER_MISMATCH of the elements
    (or 2 elements).
    """
    got = q.detach().cpu().view(torch.uint8).reshape(-1).long()
    want = ref_bytes.reshape(-1).long()
    assert got.shape == want.shape
    if exact:
        assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"
        return
    bad = got != want
    if not bad.any():
        return
    y = y.detach().cpu().reshape(-1)
    assert not torch.isnan(y[bad]).any(), "NaN bytes differ"
    gv = got[bad].to(torch.uint8).view(q.dtype).float()
    wv = want[bad].to(torch.uint8).view(q.dtype).float()
    same_sign = (got[bad] >> 7) == (want[bad] >> 7)
    one_step = same_sign & ((got[bad] & 0x7F) - (want[bad] & 0x7F)).abs().eq(1)
    lost_carry = (gv * 2 == wv) & (torch.frexp(wv)[0].abs() == 0.5)
    unexplained = ~(one_step | lost_carry)
    assert not unexplained.any(), (
        f"unexplained mismatches: y={y[bad][unexplained][:5].tolist()} got={gv[unexplained][:5].tolist()} "
        f"want={wv[unexplained][:5].tolist()}")
    assert bad.sum().item() <= max(2, MAX_INTERPRETER_MISMATCH * bad.numel()), f"{bad.float().mean():.1%} differ"


def torch_cast_bytes(x, scale, fp8_dtype):
    """The torch path's FP8 bytes (fp8kit.pytorch.cast.cast_to_fp8) on the CPU."""
    return tcast.cast_to_fp8(x, scale, fp8_dtype).cpu().view(torch.uint8)


def reference_check(q, x, scale, fmt):
    """Decoded kernel values against tests/reference.py (NumPy + ml_dtypes), same tolerance as torch's bytes;
    NaN bytes are compared as NaN (ml_dtypes writes E5M2 NaN as 0x7E, torch 0x7F)."""
    ref_bytes, _ = reference.cast(x.detach().cpu().float().numpy(), fmt, float(scale))
    ref = torch.from_numpy(np.ascontiguousarray(ref_bytes)).view(q.dtype).float()
    got = q.detach().cpu().float()
    nan = torch.isnan(ref)
    assert torch.equal(nan, torch.isnan(got))
    close = got[~nan] == ref[~nan]
    if q.device.type == "cuda":
        assert close.all()
    else:
        assert (~close).sum().item() <= max(2, MAX_INTERPRETER_MISMATCH * close.numel())


def assert_transpose(data: torch.Tensor, data_t: torch.Tensor) -> None:
    """`data_t` is the contiguous transpose of `data` seen as [prod(shape[:-1]), shape[-1]], byte for byte."""
    n = data.shape[-1] if data.dim() else 1
    d2 = data.reshape(-1, n)
    assert data_t.dtype == data.dtype and data_t.is_contiguous()
    assert tuple(data_t.shape) == (d2.shape[1], d2.shape[0])
    assert torch.equal(bits(data_t), bits(d2.t()))


def assert_bias_grad(dbias: torch.Tensor, dy: torch.Tensor) -> None:
    """`dbias` (dy's dtype) against the float64 sum of dy over its leading dimensions (NumPy): within the error of
    float32 accumulation plus one rounding to dy's dtype (one ulp of the result)."""
    assert dbias.dtype == dy.dtype and dbias.shape == dy.shape[-1:]
    x = dy.detach().cpu().double().numpy().reshape(-1, dy.shape[-1])
    exact = x.sum(axis=0)
    got = dbias.detach().cpu().double().numpy()
    finite = np.isfinite(exact)
    assert np.array_equal(np.isnan(got), np.isnan(exact))
    assert np.array_equal(got[np.isinf(exact)], exact[np.isinf(exact)])
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dy.dtype]
    accum = x.shape[0] * 2.0 ** -24 * np.abs(x).sum(axis=0)
    bound = accum + ulp * np.abs(exact) + 1e-30
    assert np.all(np.abs(got[finite] - exact[finite]) <= bound[finite])
