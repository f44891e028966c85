"""te.Linear under te.autocast(recipe=MXFP8BlockScaling()) and Float8BlockScaling() on the CPU: forward and backward
against the same Linear computed in float64 from the reference quantization (tests/reference.py)."""

import numpy as np
import pytest
import torch
from block_helpers import to_np32

import fp8kit.pytorch as te
from fp8kit.recipe import Float8BlockScaling, Format, MXFP8BlockScaling

import reference as ref

U = 2.0 ** -24


def _ref_operand(x: np.ndarray, recipe, role: str, columnwise: bool, fmt: str) -> np.ndarray:
    """float64 values of x (M, K) as the recipe quantizes it for `role`, from its rowwise layout (blocks along K) or
    its columnwise layout (blocks along M)."""
    if isinstance(recipe, MXFP8BlockScaling):
        two_d = role == "weight" and recipe.enable_2d_quantization
        block = (32, 32) if two_d else ((32, 1) if columnwise else (1, 32))
        q, code = ref.mxfp8_quantize(x, fmt, block)
        scale = np.repeat(np.repeat(ref.e8m0_value(code).astype(np.float64), block[0], 0), block[1], 1)
        return ref.fp8_values(q, fmt) * scale
    dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
           "grad": recipe.grad_block_scaling_dim}[role]
    qp = {"input": recipe.fp8_quant_fwd_inp, "weight": recipe.fp8_quant_fwd_weight,
          "grad": recipe.fp8_quant_bwd_grad}[role]
    tile = (128, 128) if dim == 2 else (1, 128)
    xt = np.ascontiguousarray(x.T) if columnwise else x
    q, s = ref.float8_block_quantize(xt, fmt, tile, qp.power_2_scale, qp.amax_epsilon)
    rows, cols = xt.shape
    scale = np.repeat(np.repeat(s.astype(np.float64), tile[0], 0)[:rows], 128, 1)[:, :cols]
    values = ref.fp8_values(q, fmt) * scale
    return values.T if columnwise else values


def _bound(a: np.ndarray, b: np.ndarray, k: int, block: int) -> np.ndarray:
    return (k // block + 4) * U * (np.abs(a) @ np.abs(b)) + 1e-30


RECIPES = [MXFP8BlockScaling(), MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True),
           Float8BlockScaling(), Float8BlockScaling(use_f32_scales=True, x_block_scaling_dim=2, w_block_scaling_dim=1)]


@pytest.mark.parametrize("recipe", RECIPES, ids=["mxfp8", "mxfp8_hybrid_2d", "block", "block_f32_x2d"])
def test_linear_forward_backward_against_reference(recipe):
    torch.manual_seed(0)
    m, k, n = 64, 256, 96
    layer = te.Linear(k, n, bias=True)
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n) * 1e-3
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    fwd = "e4m3"
    bwd = "e5m2" if recipe.fp8_format == Format.HYBRID else "e4m3"
    block = 32 if isinstance(recipe, MXFP8BlockScaling) else 128
    xn, wn, dyn = to_np32(x.detach()), to_np32(layer.weight.detach()), to_np32(dy)
    xq, wq = _ref_operand(xn, recipe, "input", False, fwd), _ref_operand(wn, recipe, "weight", False, fwd)
    y_ref = xq @ wq.T + layer.bias.detach().double().numpy()
    assert np.all(np.abs(y.detach().double().numpy() - y_ref) <= _bound(xq, wq.T, k, block))
    dyq = _ref_operand(dyn, recipe, "grad", False, bwd)
    wq_t = _ref_operand(wn, recipe, "weight", True, fwd)
    dx_ref = dyq @ wq_t
    assert np.all(np.abs(x.grad.double().numpy() - dx_ref) <= _bound(dyq, wq_t, n, block))
    dyq_t, xq_t = _ref_operand(dyn, recipe, "grad", True, bwd), _ref_operand(xn, recipe, "input", True, fwd)
    dw_ref = dyq_t.T @ xq_t
    assert np.all(np.abs(layer.weight.grad.double().numpy() - dw_ref) <= _bound(dyq_t.T, xq_t, m, block))
    assert np.array_equal(layer.bias.grad.numpy(), dy.sum(0).numpy())
    # the reference differs from the unquantized product: the test sees quantization
    assert not np.allclose(y_ref, xn.astype(np.float64) @ wn.T.astype(np.float64) + layer.bias.detach().numpy(),
                           rtol=1e-4, atol=0)


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block"])
def test_fused_modules_run_close_to_high_precision(recipe):
    """LayerNormLinear, LayerNormMLP and GroupedLinear run under the block recipes (through the same seam as Linear):
    outputs and gradients within a few FP8 quantization steps of the modules in float32."""
    torch.manual_seed(1)
    x = torch.randn(2, 32, 128)
    for layer in (te.LayerNormLinear(128, 64), te.LayerNormMLP(128, 256), te.GroupedLinear(2, 128, 64)):
        args = (x.reshape(64, 128), [32, 32]) if isinstance(layer, te.GroupedLinear) else (x,)
        inp = args[0].clone().requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = layer(inp, *args[1:])
        y.square().sum().backward()
        grad = inp.grad.clone()
        inp.grad = None
        y_hp = layer(inp, *args[1:])
        y_hp.square().sum().backward()
        rel = (y - y_hp).norm() / y_hp.norm()
        assert 0 < rel < 0.08, (type(layer).__name__, rel)
        assert (grad - inp.grad).norm() / inp.grad.norm() < 0.15
