"""GPU check (issue 26, item 3): the FP8 casts against device-copy bandwidth, current and delayed scaling, with and
without the transpose output, Triton kernels on and off; and the kernels' bytes against the torch path's.

GB/s counts the fewest bytes a cast must move: the input read once, each FP8 output written once (the transpose
output adds one byte per element). The copy row counts its read and its write. `vs_copy` is the cast's GB/s over
the copy's, the issue's target being >= 0.8.

    python3 tools/gpu/check_casts.py --device cuda --out $OUT/casts.json
    python3 tools/gpu/check_casts.py --device cpu --out /tmp/casts.json     # logic only (small, torch path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from fp8kit.bench_common import Timer  # noqa: E402
from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.pytorch.cast import amax as torch_amax  # noqa: E402
from fp8kit.pytorch.cast import cast_1d  # noqa: E402
from fp8kit.pytorch.quantizer import CurrentQuantizer, bias_grad, with_transpose  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _median_ms(fn, device, reps, rounds=7):
    run = Timer(device)
    fn()
    fn()
    return statistics.median(run(fn, reps) for _ in range(rounds))


def _graph_median_ms(fn, reps, rounds=7):
    """The device time of `fn` without the host's launch cost: `reps` calls captured in one CUDA graph, replays timed
    with events (None when the capture fails)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:  # noqa: BLE001
        return None
    graph.replay()
    run = Timer(torch.device("cuda"))
    return statistics.median(run(graph.replay, 1) / reps for _ in range(rounds))


def _torch_delayed(x, scale, stage, transpose):
    torch.fmax(stage, torch_amax(x), out=stage)
    q = cast_1d(x, scale, E4M3)
    return with_transpose(q) if transpose else q


def _cases(x, device, use_kernels):
    """name -> (fn, output bytes per element, a function returning the outputs to compare)."""
    scale = torch.tensor([448.0 / 6.0], device=device)
    stage = torch.zeros(1, device=device)
    cur = CurrentQuantizer(E4M3)
    out = {}
    if use_kernels:
        for t in (False, True):
            out[f"current{'+T' if t else ''}"] = (
                lambda t=t: kernels.current_cast(x, E4M3, transpose=t, raw=True), 1 + t,
                lambda t=t: kernels.current_cast(x, E4M3, transpose=t, raw=True)[:2])
            out[f"delayed{'+T' if t else ''}"] = (
                lambda t=t: kernels.cast_amax(x, scale, E4M3, transpose=t, amax_out=stage, raw=True), 1 + t,
                lambda t=t: kernels.cast_amax(x, scale, E4M3, transpose=t, amax_out=stage, raw=True)[:2])
        out["current+T+dbias"] = (lambda: kernels.current_cast_transpose_dbias(x, E4M3, raw=True), 2,
                                  lambda: kernels.current_cast_transpose_dbias(x, E4M3, raw=True)[:2])
        out["delayed+T+dbias"] = (lambda: kernels.cast_transpose_dbias(x, scale, E4M3, amax_out=stage, raw=True), 2,
                                  lambda: kernels.cast_transpose_dbias(x, scale, E4M3, amax_out=stage, raw=True)[:2])
    else:
        for t in (False, True):
            out[f"current{'+T' if t else ''}"] = (lambda t=t: cur.quantize(x, transpose=t), 1 + t,
                                                  lambda t=t: _bytes(cur.quantize(x, transpose=t)))
            out[f"delayed{'+T' if t else ''}"] = (lambda t=t: _torch_delayed(x, scale, stage, t), 1 + t,
                                                  lambda t=t: _bytes(_torch_delayed(x, scale, stage, t)))
        out["current+T+dbias"] = (lambda: (cur.quantize(x, transpose=True), bias_grad(x)), 2, None)
    return out


def _bytes(q):
    return q._data, q._transpose


def _u8(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()


def run(device, numels, budget, out_path, dtypes):
    t_start = time.time()
    report = {"device": str(device), "torch": torch.__version__, "rows": [], "equal": [], "errors": []}
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)
        try:
            import triton
            report["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            report["triton"] = f"not importable: {e}"
    report["kernels_available"] = kernels.available(device)

    def save():
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)

    for numel in numels:
        rows_n = 8192 if numel >= 8192 * 1024 else 256
        shape = (rows_n, numel // rows_n)
        for dtype in dtypes:
            if time.time() - t_start > budget:
                report["errors"].append(f"budget spent before {shape} {dtype}")
                save()
                return report
            g = torch.Generator().manual_seed(numel)
            x = (torch.randn(shape, generator=g) * 3.0).to(device, dtype)
            reps = 20 if device.type == "cuda" else 2
            copy_ms = _median_ms(lambda: x.clone(), device, reps)
            copy_gbs = 2 * x.numel() * x.element_size() / (copy_ms * 1e-3) / 1e9
            copy_graph_ms = _graph_median_ms(lambda: x.clone(), reps) if device.type == "cuda" else None
            copy_graph_gbs = copy_gbs if copy_graph_ms is None else \
                2 * x.numel() * x.element_size() / (copy_graph_ms * 1e-3) / 1e9
            report["rows"].append({"shape": list(shape), "dtype": str(dtype), "case": "copy", "path": "-",
                                   "ms": copy_ms, "gb_per_s": copy_gbs, "vs_copy": 1.0})
            print(f"{shape} {dtype} copy {copy_ms:.3f} ms {copy_gbs:.0f} GB/s", flush=True)
            results = {}
            for path, on in (("torch", False), ("triton", True)):
                if on and not kernels.available(device):
                    report["errors"].append(f"triton path not available on {device}")
                    continue
                with kernels.enabled_as(on):
                    for name, (fn, out_bytes, outputs) in _cases(x, device, on).items():
                        try:
                            ms = _median_ms(fn, device, reps)
                            moved = x.numel() * (x.element_size() + out_bytes)
                            gbs = moved / (ms * 1e-3) / 1e9
                            row = {"shape": list(shape), "dtype": str(dtype), "case": name, "path": path, "ms": ms,
                                   "gb_per_s": gbs, "vs_copy": gbs / copy_gbs}
                            graph_ms = _graph_median_ms(fn, reps) if device.type == "cuda" else None
                            if graph_ms is not None:  # the kernels alone (no host launch cost)
                                row["graph_ms"] = graph_ms
                                row["graph_vs_copy"] = moved / (graph_ms * 1e-3) / 1e9 / copy_graph_gbs
                            report["rows"].append(row)
                            graphed = f" graphed {row['graph_vs_copy']:5.2f}x" if graph_ms is not None else ""
                            print(f"{shape} {dtype} {path:6s} {name:16s} {ms:8.3f} ms {gbs:7.0f} GB/s "
                                  f"{gbs / copy_gbs:5.2f}x copy{graphed}", flush=True)
                            if outputs is not None and name in ("current", "current+T"):
                                results[(path, name)] = [None if t is None else t.clone() for t in outputs()]
                        except Exception:  # noqa: BLE001
                            report["errors"].append(f"{path} {name} {shape} {dtype}: "
                                                    + traceback.format_exc()[-1500:])
                            print(f"ERROR {path} {name}: {traceback.format_exc()[-400:]}", flush=True)
                save()
            for name in ("current", "current+T"):
                a, b = results.get(("torch", name)), results.get(("triton", name))
                if a is None or b is None:
                    continue
                ref = _u8(a[0])
                mism = int((ref != _u8(b[0])).sum())
                if b[1] is not None:  # the transpose: against the torch path's, or its data transposed (CPU)
                    mism += int((_u8(a[1] if a[1] is not None else ref.t()) != _u8(b[1])).sum())
                report["equal"].append({"shape": list(shape), "dtype": str(dtype), "case": name,
                                        "bytes_equal": mism == 0, "mismatched_bytes": mism})
                print(f"{shape} {dtype} {name}: triton bytes == torch path bytes: {mism == 0} ({mism} differ)",
                      flush=True)
            save()
    report["seconds"] = time.time() - t_start
    save()
    return report


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=60.0)
    a = p.parse_args()
    device = torch.device(a.device)
    numels = [1 << 26, 1 << 24] if device.type == "cuda" else [1 << 16]
    run(device, numels, a.budget, a.out, (torch.bfloat16, torch.float32))


if __name__ == "__main__":
    main()
