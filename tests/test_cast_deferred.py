"""The CPU grad_output cast with its FP8 bytes deferred to their first read (fp8kit/pytorch/tensor/deferred.py):
the values now, the bytes on demand, both equal to tests/reference.py's (NumPy + ml_dtypes) cast."""

import copy
import math
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import cast as cast_module
from fp8kit.pytorch import quantizer as quantizer_module
from fp8kit.pytorch.cast import cast_host
from fp8kit.pytorch.tensor.deferred import DeferredBytesStorage
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _every_bf16(rows: int, cols: int) -> torch.Tensor:
    """Every bf16 bit pattern (NaN, inf, -0 and subnormals included), repeated, shifted by 7, as [rows, cols]."""
    n = rows * cols
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).repeat(n // (1 << 16) + 2)[7:7 + n]
    return codes.view(torch.bfloat16).view(rows, cols)


def _reference_bytes(x: torch.Tensor, fmt: str, scale: float) -> np.ndarray:
    xf = x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return ref.fp8_bytes(xf * np.float32(scale), fmt)  # NaN: 0x7F whatever its sign, both formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_deferred_cast_matches_reference(fmt, one_thread):
    """Values at once, bytes (and the transpose's) on first read: both the reference's, for every bf16 pattern."""
    fp8 = FORMATS[fmt]
    x = _every_bf16(512, 384)
    assert x.numel() >= cast_module.TABLE_MIN_NUMEL
    for scale in (float(np.float32(s)) for s in (1.0, 448 / 4.1, 2.0 ** -20, 1e30)):
        want = _reference_bytes(x, fmt, scale).reshape(512, 384)
        q = cast_host(x, scale, fp8, math.inf, defer_bytes=True)
        assert isinstance(q, DeferredBytesStorage) and not q.bytes_made
        assert q.shape == x.shape and q.device == x.device and q.fp8_dtype == fp8
        decoded = want.view(ref.FP8[fmt][0]).astype(np.float32)
        np.testing.assert_array_equal(q.values(torch.bfloat16).float().numpy(), decoded)  # NaN positions equal
        assert np.float32(q.scale_inv.item()) == ref.cast(np.ones(1, np.float32), fmt, scale)[1]
        t = q.transposed()
        assert isinstance(t, DeferredBytesStorage) and not q.bytes_made and not t.bytes_made
        assert t.shape == (384, 512)
        assert torch.equal(t.values(torch.bfloat16).view(torch.int16), q._values.t().view(torch.int16))
        np.testing.assert_array_equal(t._data.view(torch.uint8).numpy(), want.T)  # reading the transpose's ...
        assert q.bytes_made  # ... made the bytes once, on the tensor itself
        np.testing.assert_array_equal(q.fp8_view().view(torch.uint8).numpy(), want)
        # the same bytes, scale and values as the cast without deferral
        eager = cast_host(x, scale, fp8, math.inf)
        assert torch.equal(eager._data, q._data) and eager.scale_inv_value == q.scale_inv_value
        assert torch.equal(eager._values.view(torch.int16), q._values.view(torch.int16))


def test_deferred_bytes_of_a_tensor_changed_in_place_are_an_error(one_thread):
    """The bytes come from the source's codes when first read: a source modified in place before that is an
    error naming the cause, never other bytes."""
    x = torch.randn(512, 512, dtype=torch.bfloat16)
    q = cast_host(x, 2.0, torch.float8_e5m2, math.inf, defer_bytes=True)
    x.mul_(3)
    for _ in range(2):  # every read, not only the first
        with pytest.raises(RuntimeError, match="modified in place before its FP8 bytes were read"):
            q.fp8_view()


def test_no_deferral_for_inference_tensors_or_small_ones(one_thread):
    """Inference tensors (no version counter) and tensors below the table size get their bytes at once."""
    with torch.inference_mode():
        x = torch.randn(512, 512, dtype=torch.bfloat16)
    assert not isinstance(cast_host(x, 2.0, torch.float8_e5m2, math.inf, defer_bytes=True), DeferredBytesStorage)
    small = torch.randn(64, 64, dtype=torch.bfloat16)
    assert not isinstance(cast_host(small, 2.0, torch.float8_e5m2, math.inf, defer_bytes=True),
                          DeferredBytesStorage)


def _linear_run(recipe, steps=2):
    torch.manual_seed(0)
    lin = te.Linear(1024, 512, params_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(256, 1024, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(256, 512, generator=g).bfloat16()  # 2**17 elements: the table cast
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)
        results.append((y.detach(), x.grad))
    state = {k: v for k, v in lin.state_dict().items() if isinstance(v, torch.Tensor)}
    return results, lin.weight.grad, lin.bias.grad, state


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_linear_backward_makes_no_grad_output_bytes(recipe, monkeypatch, one_thread):
    """A Linear's backward on the CPU reads dy's FP8 values only, so its bytes are never made; outputs, gradients
    and the recipe's state (histories, scales) equal a run that makes them."""
    made = []
    make = DeferredBytesStorage.make.__func__

    def spy(cls, *args):
        made.append(make(cls, *args))
        return made[-1]

    monkeypatch.setattr(DeferredBytesStorage, "make", classmethod(spy))
    got = _linear_run(recipe)
    assert made and not any(q.bytes_made for q in made)
    monkeypatch.undo()

    def eager_cast_host(x, scale, fp8_dtype, amax_value, nan_free=False, defer_bytes=False):
        return cast_host(x, scale, fp8_dtype, amax_value, nan_free)

    monkeypatch.setattr(quantizer_module, "cast_host", eager_cast_host)
    want = _linear_run(recipe)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)


def test_deferred_storage_copies_and_pickles_with_its_bytes(one_thread):
    """deepcopy and pickle of a storage whose bytes are still deferred give the bytes the reference gives."""
    x = torch.randn(512, 512, dtype=torch.bfloat16) * 4
    for copy_of in (copy.deepcopy, lambda q: pickle.loads(pickle.dumps(q))):
        q = cast_host(x, 20.0, torch.float8_e5m2, float(x.abs().max()), True, defer_bytes=True)
        assert isinstance(q, DeferredBytesStorage) and not q.bytes_made
        c = copy_of(q)
        with np.errstate(over="ignore", invalid="ignore"):
            want = ref.fp8_bytes(x.float().numpy() * np.float32(20.0), "e5m2")
        np.testing.assert_array_equal(c._data.numpy(), want)
        got, kept = c.values(torch.bfloat16).float().numpy(), q.values(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got, kept)
