"""torch.compile of fp8kit's accelerator GEMM path, simulated on a CPU: the per-tensor GEMM rule sends CPU operands
through `gemm.scaled_mm` (torch's CPU `_scaled_mm`, as on a GPU) and the casts write the transposes a GPU's GEMMs
read. Compares a compiled two-Linear net with an eager one, step by step (outputs and gradients, bit for bit).

    python tools/gpu/sim_accelerator_compile.py current aot_eager
    python tools/gpu/sim_accelerator_compile.py delayed aot_eager

Why it exists: on an H200 (torch 2.11) the compiled CUDA step's gradients differed from eager's (docs/performance.md,
"GPU"). This simulation reproduced one cause on a CPU: under delayed scaling and inductor, the partitioner
recomputed the weight's FP8 cast in the backward from the scale that the forward's autocast exit had updated in
place, so the first step's data gradient was off by the scale's change (aot_eager, which does not recompute, was
exact). Fixed by `quantizer.scale_snapshot`; tests/test_compile.py::test_inductor_on_the_accelerator_gemm_path_
matches_eager is this check as a test. The GPU's other differences (zero gradients, current scaling and aot_eager too)
came from torch 2.11's dynamo, which this script reproduces under torch 2.11 (docs/performance.md, "Second
session"); both are fixed.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import torch  # noqa: E402
from accelerator_sim import accelerator_gemm_path  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.pytorch import host  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

torch.manual_seed(4)
recipe = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(amax_history_len=4)}[sys.argv[1]]
backend = sys.argv[2] if len(sys.argv) > 2 else "aot_eager"
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(te.Linear(96, 64, params_dtype=torch.bfloat16), torch.nn.ReLU(),
                               te.Linear(64, 80, params_dtype=torch.bfloat16))
eager, comp = net(), net()
comp.load_state_dict(eager.state_dict())
def fwd(m, x):
    with te.autocast(recipe=recipe):
        return m(x)
fwd_c = torch.compile(fwd, fullgraph=True, backend=backend)
with host.tensor_path(), accelerator_gemm_path():
    warm = torch.randn(48, 96, dtype=torch.bfloat16)
    for m in (eager, comp):  # one eager step for both: torch < 2.12 cannot trace the delayed state's setup
        fwd(m, warm.clone().requires_grad_()).backward(torch.ones(48, 80, dtype=torch.bfloat16))
        m.zero_grad(set_to_none=True)
    te.apply_pending_updates()
    for step in range(3):
        x = torch.randn(48, 96, dtype=torch.bfloat16) * 10.0 ** (step - 1)
        dy = torch.randn(48, 80, dtype=torch.bfloat16)
        res = []
        for m, f in ((eager, fwd), (comp, fwd_c)):
            xi = x.clone().requires_grad_()
            y = f(m, xi)
            y.backward(dy)
            res.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        te.apply_pending_updates()
        names = ["y", "dx"] + [n for n, _ in eager.named_parameters()]
        diffs = {n: (torch.equal(a, b), float((a.float() - b.float()).abs().max())) for n, a, b in zip(names, *res)}
        print(step, diffs)
