"""te.Linear under te.autocast(recipe=NVFP4BlockScaling()): forward, dgrad and wgrad bit for bit against the
reference (tests/reference.py: quantization, RHT and GEMM in NumPy + ml_dtypes), close to the float64 product;
stochastic rounding reproduced under te.checkpoint recompute."""

import numpy as np
import pytest
import torch
from block_helpers import to_np32

import fp8kit.pytorch as te
from fp8kit.recipe import NVFP4BlockScaling, QParams

import reference as ref


def _q(x: np.ndarray, two_d=False, rht=False):
    """Reference quantization of the float32 `x` (bf16 values), through the RHT (bf16 result) when asked."""
    if rht:
        x = ref.rht_bf16(x).astype(np.float32)
    return ref.nvfp4_quantize(x, two_d)


def _linear(seed=0):
    torch.manual_seed(seed)
    lin = te.Linear(64, 32, bias=True, params_dtype=torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 32, dtype=torch.bfloat16)
    return lin, x, dy


def test_forward_and_backward_bit_exact_without_sr():
    """Default RHT and 16x16 weights, round-to-nearest gradients: y, dx and dw equal the reference's."""
    lin, x, dy = _linear()
    with te.autocast(recipe=NVFP4BlockScaling(disable_stochastic_rounding=True)):
        y = lin(x)
    y.backward(dy)
    xn, wn, dyn = to_np32(x.detach()), to_np32(lin.weight.detach()), to_np32(dy)
    bias = to_np32(lin.bias.detach())
    y_ref = ref.nvfp4_gemm(*_q(xn), *_q(wn, two_d=True)) + bias
    np.testing.assert_array_equal(y.detach().float().numpy(), ref.bf16_of(y_ref).astype(np.float32))
    dx_ref = ref.nvfp4_gemm(*_q(dyn), *_q(wn.T.copy(), two_d=True))
    np.testing.assert_array_equal(x.grad.float().numpy(), ref.bf16_of(dx_ref).astype(np.float32))
    dw_ref = ref.nvfp4_gemm(*_q(dyn.T.copy(), rht=True), *_q(xn.T.copy(), rht=True))
    np.testing.assert_array_equal(lin.weight.grad.float().numpy(), ref.bf16_of(dw_ref).astype(np.float32))


def test_default_recipe_close_to_float64():
    """With the default recipe (RHT, SR, 16x16 weights) the three products stay within NVFP4's error of float64."""
    lin, x, dy = _linear(1)
    with te.autocast(recipe=NVFP4BlockScaling()):
        y = lin(x)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), lin.weight.detach().double(), dy.double()
    for got, want in ((y.detach() - lin.bias.detach(), x64 @ w64.t()), (x.grad, dy64 @ w64),
                      (lin.weight.grad, dy64.t() @ x64)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 0.3, rel


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_recompute_draws_the_same(use_reentrant):
    """Stochastic rounding in the forward too (QParams on the input): te.checkpoint's recompute restores torch's
    RNG state, so its draws and every gradient equal those of the run without checkpointing."""
    recipe = NVFP4BlockScaling(fp4_quant_fwd_inp=QParams(random_hadamard_transform=True, stochastic_rounding=True))
    grads = []
    for ckpt in (False, True):
        lin, x, dy = _linear(2)
        torch.manual_seed(5)
        with te.autocast(recipe=recipe):
            y = te.checkpoint(lin, x, use_reentrant=use_reentrant) if ckpt else lin(x)
        y.backward(dy)
        grads.append((y.detach(), x.grad, lin.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    lin, x, dy = _linear(2)
    torch.manual_seed(6)  # another RNG state: other draws
    with te.autocast(recipe=recipe):
        y = lin(x)
    assert not torch.equal(y.detach(), grads[0][0])


@pytest.mark.parametrize("name", ["layernorm_linear", "layernorm_mlp", "grouped_linear", "transformer_layer"])
def test_modules_run_and_stay_close_to_high_precision(name):
    """Every module's GEMMs under the default recipe: forward and input gradient within NVFP4's error of the same
    module without autocast (the residual-free modules by a relative norm; the layer's error is smaller still)."""
    torch.manual_seed(0)
    make = {"layernorm_linear": lambda: (te.LayerNormLinear(64, 32), (64, 64)),
            "layernorm_mlp": lambda: (te.LayerNormMLP(64, 128), (64, 64)),
            "grouped_linear": lambda: (te.GroupedLinear(2, 64, 32), (64, 64)),
            "transformer_layer": lambda: (te.TransformerLayer(64, 128, 4, hidden_dropout=0.0,
                                                              attention_dropout=0.0), (32, 2, 64))}[name]
    module, shape = make()
    x = torch.randn(*shape, requires_grad=True)
    runs, dy = [], None
    for recipe in (None, NVFP4BlockScaling()):
        x.grad = None
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, [32, 32]) if name == "grouped_linear" else module(x)
        dy = torch.randn_like(y) if dy is None else dy
        y.backward(dy)
        runs.append((y.detach(), x.grad.clone()))
    (y0, g0), (y1, g1) = runs
    for a, b in ((y0, y1), (g0, g1)):
        assert torch.isfinite(b).all() and 0 < ((a - b).norm() / a.norm()).item() < 0.3


def test_state_dict_round_trip():
    """A Linear's state_dict after NVFP4 steps loads into a fresh Linear that computes the same bits."""
    import io

    lin, x, _ = _linear(3)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    with te.autocast(recipe=recipe):
        y0 = lin(x)
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    fresh = te.Linear(64, 32, bias=True, params_dtype=torch.bfloat16)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    with te.autocast(recipe=recipe):
        assert torch.equal(fresh(x), y0)
