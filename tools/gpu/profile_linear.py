"""GPU check (issue 26 follow-up): where the time of one te.Linear forward + backward goes on the device, per recipe,
kernels on: torch.profiler's CUDA kernel table (device time per kernel) and the host time of the step, written as
text to --out. Answers why delayed scaling was slower than current at 8192^3 on an H200, and how much of a 4096^3
step the host costs.

    python3 tools/gpu/profile_linear.py --out $OUT/profile.txt --shape 8192x8192x8192 --shape 4096x4096x4096
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from gpu_check_common import timed_steps  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.bench_common import CURRENT, DELAYED  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=[])
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check this script's logic")
    a = p.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = [tuple(int(v) for v in s.split("x")) for s in (a.shape or ["8192x8192x8192"])]
    lines = [f"{torch.cuda.get_device_name() if cuda else 'cpu'} torch {torch.__version__}"]
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16).requires_grad_()
        dy = torch.randn(m, n, generator=g).to(dev, torch.bfloat16)
        for name, recipe in (("bf16", None), ("current", CURRENT), ("delayed", DELAYED)):
            layer = te.Linear(k, n, params_dtype=torch.bfloat16, device=dev)
            # host: the launches asynchronous, the host's time when the GPU keeps up
            step, host, wall = timed_steps(layer, x, dy, recipe, 3, 10, sync)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(3):
                    step()
                sync()
            lines.append(f"\n== {m}x{k}x{n} {name}: host {host * 1e3:.3f} ms/step (launches), wall {wall * 1e3:.3f} "
                         "ms/step ==")
            sort = ("self_device_time_total" if cuda else "self_cpu_time_total")
            try:
                table = prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60)
            except Exception:  # noqa: BLE001 - an older torch names it self_cuda_time_total
                table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18,
                                                  max_name_column_width=60)
            lines.append(table)
            with open(a.out, "w") as f:
                f.write("\n".join(lines))
            print(lines[-2], flush=True)


if __name__ == "__main__":
    main()
