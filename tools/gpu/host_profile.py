"""GPU check (issues 21/26): where the host time of a te.Linear step goes when the tensors are on the GPU. The first
run measured 14.7x torch.nn.Linear's host time per forward there; this says which Python functions and which aten
ops / launches spend it, per recipe, kernels as configured (on by default on CUDA). Text to --out.

    python3 tools/gpu/host_profile.py --out $OUT/host_profile.txt
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from gpu_check_common import timed_steps  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.bench_common import CURRENT, DELAYED  # noqa: E402


def primitives(dev, sync, n=2000) -> str:
    """Host microseconds per call of what one FP8 Linear step is made of (no profiler: cProfile inflates Python)."""
    from fp8kit.pytorch import kernels
    from fp8kit.pytorch.kernels import cast_ops

    x = torch.randn(16, 64, device=dev)
    a8 = x.to(torch.float8_e4m3fn)
    b8 = torch.randn(64, 64, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    cases = {"torch.zeros(()) int32": lambda: torch.zeros((), dtype=torch.int32, device=dev),
             "torch.empty(()) f32": lambda: torch.empty((), device=dev),
             "x.mul(2) (one aten op)": lambda: x.mul(2)}
    if dev.type == "cuda":
        cases["torch._scaled_mm 16x64x64"] = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)
    if kernels.on_for(dev):
        cases["kernels amax (zeros + 1 launch)"] = lambda: cast_ops.amax(x)
        cases["kernels current_cast (zeros, 4 empty, 2 launches)"] = \
            lambda: cast_ops.current_cast(x, torch.float8_e4m3fn, raw=True)
    out = ["-- host us per call (median of 5 x %d calls) --" % n]
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
            sync()
        out.append(f"{name:55s} {sorted(times)[2]:8.2f}")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check this script's logic")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    lines = [f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'} torch {torch.__version__}"]
    x = torch.randn(16, 64, device=dev).requires_grad_()
    dy = torch.randn(16, 64, device=dev)
    lines.append(primitives(dev, sync))
    print(lines[-1], flush=True)
    for name, recipe in (("torch.nn.Linear", None), ("current", CURRENT), ("delayed", DELAYED)):
        layer = (torch.nn.Linear(64, 64, device=dev) if recipe is None else te.Linear(64, 64, device=dev))
        step, _, wall = timed_steps(layer, x, dy, recipe, 20, a.steps, sync)
        header = f"== {name}: {wall * 1e6:.1f} us/step wall (fwd+bwd+exit) =="
        lines.append("\n" + header)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            step()
        sync()
        prof.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
            lines.append(f"-- cProfile by {key}, {a.steps} steps --")
            lines.append(s.getvalue().split("\n", 6)[-1][:6000])
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(20):
                step()
            sync()
        lines.append("-- torch.profiler, CPU self time, 20 steps --")
        lines.append(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
        with open(a.out, "w") as f:
            f.write("\n".join(lines))
        print(header, flush=True)


if __name__ == "__main__":
    main()
