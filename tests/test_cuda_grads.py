"""CUDA gradients against the CPU and float64, and torch.compile against eager on CUDA (marker `cuda`).

The first GPU run (docs/performance.md, "GPU") compared CUDA forwards with the CPU and eager steps with CUDA graphs,
but no CUDA gradient with an independent one; and a compiled CUDA step (kernels off, inductor and aot_eager alike)
gave forward outputs equal to eager but input and parameter gradients that differed far beyond rounding. These
tests say which side is right: eager CUDA gradients must match the CPU emulation and float64 closely (the GEMMs
accumulate in another order, so not bit for bit), and a compiled CUDA step must equal the eager one bit for bit.
Non-square shapes, so that a GEMM operand read in the wrong orientation cannot pass unnoticed."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import kernels
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

from linear_helpers import sqnr_db

pytestmark = pytest.mark.cuda

DEV = "cuda"  # a dry run of the logic on a CPU sets it to "cpu"
RECIPES = {"current": Float8CurrentScaling, "delayed": lambda: DelayedScaling(amax_history_len=4)}


def _step(layer, x, dy, recipe):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    out = [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]
    layer.zero_grad(set_to_none=True)
    return [t.double().cpu() for t in out]


def _float64(layer, x, dy):
    w, b = layer.weight.detach().double().cpu(), layer.bias.detach().double().cpu()
    x, dy = x.double().cpu(), dy.double().cpu()
    return [x @ w.t() + b, dy @ w, dy.t() @ x, dy.sum(0)]


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_cuda_gradients_match_cpu_and_float64(recipe_name, triton):
    torch.manual_seed(3)
    cpu = te.Linear(96, 64, params_dtype=torch.bfloat16)
    gpu = te.Linear(96, 64, params_dtype=torch.bfloat16, device=DEV)
    gpu.load_state_dict(cpu.state_dict())
    recipe = RECIPES[recipe_name]()
    names = ("y", "dx", "dW", "db")
    with kernels.enabled_as(triton):
        for step in range(3):
            x = torch.randn(48, 96, dtype=torch.bfloat16) * 10.0 ** (step - 1)
            dy = torch.randn(48, 64, dtype=torch.bfloat16)
            got = _step(gpu, x.to(DEV), dy.to(DEV), recipe)
            want = _step(cpu, x, dy, recipe)
            exact = _float64(cpu, x, dy)
            for name, g, w, e in zip(names, got, want, exact):
                assert sqnr_db(w.numpy(), g.numpy()) > 35, f"step {step}: {name} CUDA vs CPU"
                if recipe_name == "current":  # delayed scaling saturates on purpose when the magnitude jumps
                    assert sqnr_db(e.numpy(), g.numpy()) > 20, f"step {step}: {name} CUDA vs float64"


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_cuda_compiled_step_equals_eager(recipe_name):
    torch._dynamo.reset()
    torch.manual_seed(4)
    eager = te.Linear(96, 64, params_dtype=torch.bfloat16, device=DEV)
    compiled = te.Linear(96, 64, params_dtype=torch.bfloat16, device=DEV)
    compiled.load_state_dict(eager.state_dict())
    recipe = RECIPES[recipe_name]()

    def fwd(layer, x):
        with te.autocast(recipe=recipe):
            return layer(x)

    fwd_c = torch.compile(fwd, fullgraph=True, backend="aot_eager")
    for step in range(4):  # step 0 eager for both: torch < 2.12 cannot trace the state's setup (docs/pytorch.md)
        x = torch.randn(48, 96, dtype=torch.bfloat16, device=DEV) * 10.0 ** (step - 1)
        dy = torch.randn(48, 64, dtype=torch.bfloat16, device=DEV)
        results = []
        for layer, fn in ((eager, fwd), (compiled, fwd_c if step else fwd)):
            xi = x.clone().requires_grad_()
            fn(layer, xi).backward(dy)
            results.append([xi.grad, layer.weight.grad, layer.bias.grad])
            layer.zero_grad(set_to_none=True)
        te.apply_pending_updates()
        for name, a, b in zip(("dx", "dW", "db"), *results):
            assert torch.equal(a, b), f"step {step}: {name}"
