"""GPU diagnosis (issue 26): a compiled te.Linear step against eager on CUDA, part by part. The first two GPU runs saw
compiled gradients that differ from eager (dx all zeros under aot_eager, current scaling), where a CPU simulation of
the GPU's GEMM path (tools/gpu/sim_accelerator_compile.py) is bit-identical. This separates dynamo from AOT autograd
(backends "eager" and "aot_eager"), the forward from the backward, eager with the Triton kernels on and off, and
prints the operands' strides; run it with TORCH_LOGS=aot_graphs (stderr to a file) to get the traced graphs.

    TORCH_LOGS=aot_graphs python3 tools/gpu/diag_compile.py --out $OUT/diag_compile.json 2> $OUT/aot_graphs.txt
"""

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402


def describe(a, b):
    a, b = a.float(), b.float()
    return {"equal": bool(torch.equal(a, b)), "max_diff": float((a - b).abs().max()),
            "got_zero": bool((b == 0).all()), "got_finite": bool(torch.isfinite(b).all()),
            "ratio_median": float((b / a)[a.abs() > 1e-3].median()) if (a.abs() > 1e-3).any() else None}


def case(dev, recipe_name, backend, eager_kernels, steps=2):
    torch._dynamo.reset()
    recipe = Float8CurrentScaling() if recipe_name == "current" else DelayedScaling(amax_history_len=4)
    torch.manual_seed(4)
    eager = te.Linear(96, 64, params_dtype=torch.bfloat16, device=dev)
    comp = te.Linear(96, 64, params_dtype=torch.bfloat16, device=dev)
    comp.load_state_dict(eager.state_dict())

    def fwd(layer, x):
        with te.autocast(recipe=recipe):
            return layer(x)

    fwd_c = torch.compile(fwd, fullgraph=True, backend=backend)
    out = []
    for step in range(-1, steps):  # step -1 eager for both: torch < 2.12 cannot trace the state's setup
        x = torch.randn(48, 96, dtype=torch.bfloat16, device=dev) * 10.0 ** (step - 1)
        dy = torch.randn(48, 64, dtype=torch.bfloat16, device=dev)
        res = []
        pair = ((eager, fwd, eager_kernels), (comp, fwd_c, None)) if step >= 0 else \
            ((eager, fwd, eager_kernels), (comp, fwd, eager_kernels))
        for layer, fn, kern in pair:
            xi = x.clone().requires_grad_()
            with kernels.enabled_as(kern) if kern is not None else _null():
                y = fn(layer, xi)
                y.backward(dy)
            res.append({"y": y.detach(), "dx": xi.grad, "dW": layer.weight.grad, "db": layer.bias.grad})
            layer.zero_grad(set_to_none=True)
        te.apply_pending_updates()
        if step >= 0:
            out.append({k: describe(res[0][k], res[1][k]) for k in res[0]})
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    report = {"torch": torch.__version__, "cases": []}
    cases = [("current", "aot_eager", False), ("current", "eager", False), ("current", "aot_eager", True),
             ("delayed", "aot_eager", False), ("delayed", "eager", False), ("current", "inductor", False)]
    for recipe_name, backend, kern in cases:
        name = f"{recipe_name} {backend} eager_kernels={kern}"
        print(f"=== case {name}", file=sys.stderr, flush=True)
        try:
            steps = case(a.device, recipe_name, backend, kern)
            ok = all(v["equal"] for s in steps for v in s.values())
            report["cases"].append({"case": name, "ok": ok, "steps": steps})
            print(f"{name}: {'OK' if ok else 'DIFF'} " + json.dumps(steps[0]), flush=True)
        except Exception as e:  # noqa: BLE001 - a diagnosis records every failure and goes on
            report["cases"].append({"case": name, "error": f"{type(e).__name__}: {e}",
                                    "trace": traceback.format_exc()[-3000:]})
            print(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
