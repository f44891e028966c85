"""GPU check (issue 26, item 4): host time per module call with the tensors on the GPU (fp8kit/bench_overhead.py's
measurement, device argument), and the same on the host CPU's tensor path, written as JSON.

    python3 tools/gpu/overhead.py --device cuda --out $OUT/overhead.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from fp8kit.bench_overhead import bench_exit, bench_modules, format_overhead_report  # noqa: E402
from fp8kit.pytorch import host  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    report = {"torch": torch.__version__, "runs": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for device, kinds in ((a.device, ("Linear", "LayerNormMLP", "TransformerLayer")), ("cpu", ("Linear",))):
        t0 = time.time()
        with host.tensor_path():
            modules = bench_modules(kinds, rounds=a.rounds, per_round=2, device=device,
                                    log=lambda line: print(line, flush=True))
            exits = bench_exit((10, 200, 1000), rounds=a.rounds, device=device) if device != "cpu" else []
        run = {"device": device, "modules": modules, "exit": exits, "seconds": time.time() - t0}
        report["runs"].append(run)
        print(format_overhead_report(run), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
