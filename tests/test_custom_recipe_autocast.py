"""CustomRecipe under te.autocast: quantizers from the factory (the roles it is asked for), GEMMs by the custom
quantizer's qgemm. Checked against the reference (tests/reference.py): a Linear under a CustomRecipe of TE's
reference NVFP4 quantizer gives the forward, dgrad and wgrad of the reference's bytes and GEMM."""

import numpy as np
import pytest
import torch
from block_helpers import to_np32

import fp8kit.pytorch as te
from fp8kit.pytorch.custom_recipes import reference_utils
from fp8kit.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef
from fp8kit.pytorch.quantization import DelayedScalingRequest
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
from fp8kit.recipe import CustomRecipe

import reference as ref

_D = np.float32(6.0 * 6.0 * 448.0 * 448.0)


def _ref_factory(seen=None, row_scaled=False):
    def factory(role):
        if seen is not None:
            seen.append(role)
        return NVFP4QuantizerRef(reference_utils.Fp4Formats.E2M1,
                                 row_scaled_nvfp4=row_scaled and role.tensor_type == "input")
    return factory


def _gemm(a: np.ndarray, b: np.ndarray, row_scaled_a=False) -> np.ndarray:
    """The reference quantizer's qgemm of a @ b^T: alpha = (amax_a * amax_b) / D (per row of a when row-scaled)
    times the float32 block accumulation (reference.nvfp4_gemm with a unit alpha)."""
    qa, sa, aa = ref.nvfp4_quantize(a, row_scaled=row_scaled_a)
    qb, sb, ab = ref.nvfp4_quantize(b)
    y = ref.nvfp4_gemm(qa, sa, _D, qb, sb, 1.0)
    alpha = (np.asarray(aa, np.float32) * np.float32(ab)) / _D
    return (np.asarray(alpha, np.float32).reshape(-1, 1) * y).astype(np.float32)


@pytest.mark.parametrize("row_scaled", [False, True])
def test_linear_under_reference_custom_recipe(row_scaled):
    torch.manual_seed(0)
    lin = te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16)
    x = (torch.randn(2, 32, 64) * torch.logspace(-2, 2, 32)[:, None]).bfloat16().requires_grad_(True)
    dy = torch.randn(2, 32, 32, dtype=torch.bfloat16)
    seen = []
    with te.autocast(recipe=CustomRecipe(qfactory=_ref_factory(seen, row_scaled))):
        y = lin(x)
    y.backward(dy)
    assert {(r.module_type, r.tensor_type) for r in seen} == {("linear", t) for t in ("input", "weight",
                                                                                       "grad_output")}
    xn, wn, dyn = to_np32(x.detach().reshape(64, 64)), to_np32(lin.weight.detach()), to_np32(dy.reshape(64, 32))
    np.testing.assert_array_equal(y.detach().float().reshape(64, 32).numpy(),
                                  ref.bf16_of(_gemm(xn, wn, row_scaled)).astype(np.float32))
    np.testing.assert_array_equal(x.grad.float().reshape(64, 64).numpy(),
                                  ref.bf16_of(_gemm(dyn, wn.T.copy())).astype(np.float32))
    # wgrad from the transposes: x's row-scaled transpose has one amax per column of x, per output column of dw
    qd, sd, ad = ref.nvfp4_quantize(dyn.T.copy())
    qx, sx, ax = ref.nvfp4_quantize(xn.T.copy(), row_scaled=row_scaled)
    alpha = (np.float32(ad) * np.asarray(ax, np.float32)) / _D
    dw = np.asarray(alpha, np.float32).reshape(1, -1) * ref.nvfp4_gemm(qd, sd, _D, qx, sx, 1.0)
    np.testing.assert_array_equal(lin.weight.grad.float().numpy(), ref.bf16_of(dw).astype(np.float32))


def test_bias_refused_by_the_reference_qgemm():
    lin = te.Linear(64, 32, bias=True)
    with pytest.raises(ValueError, match="[Bb]ias"):
        with te.autocast(recipe=CustomRecipe(qfactory=_ref_factory())):
            lin(torch.randn(32, 64))


def test_block_quantizer_from_the_factory_runs_as_its_recipe():
    """A factory returning fp8kit's MXFP8 quantizers gives MXFP8BlockScaling's numbers."""
    from fp8kit.recipe import MXFP8BlockScaling

    torch.manual_seed(1)
    lin = te.Linear(64, 32, bias=True)
    x = torch.randn(32, 64)
    with te.autocast(recipe=MXFP8BlockScaling()):
        want = lin(x)
    fwd = torch.float8_e4m3fn

    def factory(role):
        return MXFP8Quantizer(fwd if role.tensor_type != "grad_output" else torch.float8_e5m2)

    with te.autocast(recipe=CustomRecipe(qfactory=factory)):
        got = lin(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("returned, error", [(DelayedScalingRequest(), NotImplementedError), (None, TypeError),
                                             (object(), TypeError)])
def test_factory_results_refused(returned, error):
    with pytest.raises(error, match="qfactory"):
        with te.autocast(recipe=CustomRecipe(qfactory=lambda role: returned)):
            te.Linear(32, 32)(torch.randn(32, 32))
