"""Time fp8kit's Linear (forward + backward) in FP8 against torch.nn.Linear in bf16 and peer libraries.

Each shape (M, K, N) is `x [M, K] @ W.T [K, N]` forward, then dgrad and wgrad: 3 * 2*M*K*N FLOPs. All variants
take bf16 operands. Variants of one shape are timed in interleaved rounds (the order rotates every round), each
round a batch of iterations, and the reported figure is the median over rounds; ratios are taken against torch
bf16 measured in the same rounds. CUDA times come from CUDA events, CPU times from `time.perf_counter`.
The block-scaled recipes (MXFP8, Float8 block scaling, NVFP4, at Transformer Engine's defaults) run at the shapes
they take (MXFP8 and NVFP4: M, K, N multiples of 32). Peers are imported lazily and skipped with a note when
missing: torchao's Float8Linear (dynamic scaling; its emulation mode off CUDA) and Transformer Engine's Linear (CUDA
only). Also measured: the quantize throughput
(GB/s counted as bytes read once plus bytes written) and the cost of `fp8kit.pytorch.enable_stats`.

On CPU fp8kit emulates the FP8 GEMMs (the FP8 values multiplied exactly in bf16 or float32, float32
accumulation), so CPU ratios measure the emulation, not FP8 hardware.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import fp8kit
import fp8kit.pytorch as te
from fp8kit.bench_common import (
    BASELINE,
    BLOCK,
    CURRENT,
    DELAYED,
    MXFP8,
    NVFP4,
    Timer,
    _data,
    _iterations,
    cpu_kernels_state,
    device_argument,
    device_description,
    interleaved,
    positive_int,
    run_settings,
)

QUICK_SHAPES = [(16, 64, 64), (128, 128, 128)]


# ---- variants: each builds a `step()` closure running forward + backward on fixed bf16 data ----------------------

def _torch_bf16(shape, device):
    x, dy = _data(shape, device)
    layer = torch.nn.Linear(shape[1], shape[2], device=device, dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)
    return step


def _fp8kit(recipe, with_stats: bool, triton: bool = False):
    def build(shape, device):
        from fp8kit.pytorch import kernels

        if triton and not kernels.available(device):
            raise RuntimeError("the Triton kernels need a CUDA device of compute capability >= 8.9 and triton")
        x, dy = _data(shape, device)
        layer = te.Linear(shape[1], shape[2], device=device, params_dtype=torch.bfloat16)
        if with_stats:
            te.enable_stats(layer)

        def step():  # kernels on (every device where available) or off, whatever the default
            kernels.set_enabled(triton)
            try:
                with te.autocast(recipe=recipe):
                    y = layer(x)
                y.backward(dy)
            finally:
                kernels.set_enabled(None)
        return step
    return build


def _torchao(shape, device):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x, dy = _data(shape, device)
    model = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[2], device=device, dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"))

    def step():
        model(x).backward(dy)
    return step


def _transformer_engine(shape, device):
    import transformer_engine.pytorch as te_nv
    from transformer_engine.common.recipe import DelayedScaling as NvDelayed
    from transformer_engine.common.recipe import Format as NvFormat

    if device.type != "cuda":
        raise RuntimeError("Transformer Engine runs on CUDA only")
    x, dy = _data(shape, device)
    layer = te_nv.Linear(shape[1], shape[2], params_dtype=torch.bfloat16, device=device)
    recipe = NvDelayed(fp8_format=NvFormat.HYBRID, amax_history_len=16, amax_compute_algo="max")

    def step():
        with te_nv.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
        y.backward(dy)
    return step


VARIANTS: List[Tuple[str, Callable]] = [
    (BASELINE, _torch_bf16),
    ("fp8kit current", _fp8kit(CURRENT, False)),
    ("fp8kit delayed", _fp8kit(DELAYED, False)),
    ("fp8kit current+stats", _fp8kit(CURRENT, True)),
    ("fp8kit delayed+stats", _fp8kit(DELAYED, True)),
]
PEERS: List[Tuple[str, Callable]] = [
    ("fp8kit current+triton", _fp8kit(CURRENT, False, triton=True)),  # opt-in kernels (docs/kernels.md)
    ("fp8kit delayed+triton", _fp8kit(DELAYED, False, triton=True)),
    ("torchao Float8Linear", _torchao),
    ("transformer_engine", _transformer_engine),
]
# The block-scaled recipes, and the multiple every dim (M, K, N) must be of for them: MXFP8 quantizes 32-element
# blocks along both layouts; NVFP4 16-element ones, and its GEMMs take K a multiple of 32 (the wgrad's K is M, the
# dgrad's is N). Float8 block scaling takes any shape (edge blocks are shorter). A shape off the multiple is skipped
# with a note.
BLOCK_VARIANTS: List[Tuple[str, Callable, int]] = [
    ("fp8kit mxfp8", _fp8kit(MXFP8, False), 32),
    ("fp8kit block", _fp8kit(BLOCK, False), 1),
    ("fp8kit nvfp4", _fp8kit(NVFP4, False), 32),
]
STATS_PAIRS = [("fp8kit current+stats", "fp8kit current"), ("fp8kit delayed+stats", "fp8kit delayed")]


def _build(shape, device, skipped: Dict[str, str], log=None) -> Dict[str, Callable[[], None]]:
    steps = {}
    log = log or (lambda line: None)
    for name, builder in VARIANTS:  # fp8kit and the baseline must run: errors propagate
        t0 = time.perf_counter()
        steps[name] = builder(shape, device)
        steps[name]()  # warm up
        log(f"bench {'x'.join(map(str, shape))}: {name} built and run once in {time.perf_counter() - t0:.2f} s")
    for name, builder, multiple in BLOCK_VARIANTS:  # they must run where the shape suits them
        if any(d % multiple for d in shape):
            skipped[f"{name} at {'x'.join(map(str, shape))}"] = f"needs M, K and N multiples of {multiple}"
            continue
        t0 = time.perf_counter()
        steps[name] = builder(shape, device)
        steps[name]()
        log(f"bench {'x'.join(map(str, shape))}: {name} built and run once in {time.perf_counter() - t0:.2f} s")
        _drop_if_too_slow(steps, name, shape, device, skipped)
    for name, builder in PEERS:
        if name in skipped:
            continue
        try:
            t0 = time.perf_counter()
            steps[name] = builder(shape, device)
            steps[name]()
            log(f"bench {'x'.join(map(str, shape))}: {name} built and run once in {time.perf_counter() - t0:.2f} s")
            _drop_if_too_slow(steps, name, shape, device, skipped)
        except ImportError as e:
            skipped[name] = f"not importable ({e.name or e})"
        except Exception as e:  # a peer that cannot run here: note it, keep going
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    return steps


MAX_STEP_S = 2.0  # a block-recipe or peer variant whose step takes longer is reported, not timed


def _drop_if_too_slow(steps, name, shape, device, skipped) -> None:
    """Drop a variant whose second step takes more than MAX_STEP_S (emulated block GEMMs at large shapes: their
    rounds would take minutes), noting its time in `skipped`."""
    seconds = Timer(device)(steps[name], 1) / 1e3
    if seconds > MAX_STEP_S:
        del steps[name]
        skipped[f"{name} at {'x'.join(map(str, shape))}"] = f"one step took {seconds:.1f} s (> {MAX_STEP_S} s): " \
            "not timed"


def bench_linear(shapes, device: torch.device, rounds: int, target_ms: float,
                 log=None) -> Tuple[List[dict], Dict[str, str]]:
    timer = Timer(device)
    skipped: Dict[str, str] = {}
    rows = []
    for shape in shapes:
        steps = _build(shape, device, skipped, log)
        names = list(steps)
        samples, iters = interleaved(steps, timer, rounds, target_ms)
        medians = {n: statistics.median(s) for n, s in samples.items()}
        flops = 6.0 * shape[0] * shape[1] * shape[2]
        for n in names:
            rows.append({
                "shape": list(shape), "variant": n, "median_ms": medians[n],
                "tflops": flops / (medians[n] * 1e-3) / 1e12,
                "vs_torch_bf16": medians[n] / medians[BASELINE] if BASELINE in medians else None,
                "samples_ms": samples[n], "iters_per_sample": iters[n],
            })
        del steps
    return rows, skipped


def stats_cost(linear_rows: List[dict]) -> List[dict]:
    """Time with statistics on / off for each recipe and shape (ratios of medians of the same rounds)."""
    by = {(tuple(r["shape"]), r["variant"]): r for r in linear_rows}
    out = []
    for on, off in STATS_PAIRS:
        for (shape, variant), row in by.items():
            if variant == on and (shape, off) in by:
                out.append({"shape": list(shape), "recipe": off.split()[-1], "off_ms": by[(shape, off)]["median_ms"],
                            "on_ms": row["median_ms"], "ratio": row["median_ms"] / by[(shape, off)]["median_ms"]})
    return out


def bench_quantize(numel: int, device: torch.device, rounds: int, target_ms: float) -> List[dict]:
    """fp8kit quantize of a bf16 vector: current scaling (amax + cast) and a known scale (cast only)."""
    timer = Timer(device)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    scale = torch.tensor(64.0, device=device)
    cases = {
        "current scaling (amax + cast)": lambda: te.quantize(x, torch.float8_e4m3fn),
        "known scale (cast only)": lambda: te.quantize(x, torch.float8_e4m3fn, scale),
    }
    from fp8kit.pytorch import kernels

    if device.type == "cuda" and kernels.available(device):
        state = torch.zeros((), device=device)
        cases["triton cast + amax (delayed)"] = lambda: kernels.cast_amax(x, scale, torch.float8_e4m3fn,
                                                                          amax_out=state)
        cases["triton amax, cast (current)"] = lambda: kernels.current_cast(x, torch.float8_e4m3fn)
    copy_case = "device copy (bf16 clone)"  # the bandwidth yardstick, counted as its own 2 + 2 bytes
    cases[copy_case] = lambda: x.clone()
    moved = numel * (x.element_size() + 1)  # bf16 read once, FP8 written
    rows = []
    iters = {n: _iterations(f, timer, target_ms) for n, f in cases.items()}
    samples = {n: [] for n in cases}
    for _ in range(rounds):
        for n, f in cases.items():
            samples[n].append(timer(f, iters[n]))
    copy_gbs = numel * 2 * x.element_size() / (statistics.median(samples[copy_case]) * 1e-3) / 1e9
    for n, s in samples.items():
        ms = statistics.median(s)
        gbs = (numel * 2 * x.element_size() if n == copy_case else moved) / (ms * 1e-3) / 1e9
        rows.append({"case": n, "numel": numel, "median_ms": ms, "gb_per_s": gbs, "vs_copy": gbs / copy_gbs})
    return rows


def format_report(report: dict) -> str:
    lines = [f"fp8kit {report['fp8kit_version']} bench on {report['device']} ({report['device_name']}), "
             f"torch {report['torch_version']}, median of {report['rounds']} interleaved rounds"]
    if report["device"] == "cpu":
        lines.append("CPU: fp8kit's FP8 GEMMs are emulated (FP8 values as bf16 or float32, float32 accumulation); "
                     f"CPU kernels {report.get('cpu_kernels') or 'unknown'}")
    lines += ["", "Linear forward+backward, bf16 operands",
              f"{'shape MxKxN':<16} {'variant':<22} {'ms':>9} {'TFLOP/s':>8} {'vs bf16':>8}"]
    for r in report["linear"]:
        shape = "x".join(map(str, r["shape"]))
        ratio = f"{r['vs_torch_bf16']:.2f}x" if r["vs_torch_bf16"] is not None else "-"
        lines.append(f"{shape:<16} {r['variant']:<22} {r['median_ms']:>9.3f} {r['tflops']:>8.3f} {ratio:>8}")
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines += ["", "Statistics (enable_stats) cost: time with / time without",
              f"{'shape MxKxN':<16} {'recipe':<8} {'off ms':>9} {'on ms':>9} {'ratio':>7}"]
    for r in report["stats_cost"]:
        lines.append(f"{'x'.join(map(str, r['shape'])):<16} {r['recipe']:<8} {r['off_ms']:>9.3f} {r['on_ms']:>9.3f} "
                     f"{r['ratio']:>6.2f}x")
    lines += ["", "Quantize a bf16 vector to E4M3 (GB/s = (2 + 1) bytes per element / time; the copy: 2 + 2)"]
    for r in report["quantize"]:
        lines.append(f"{r['case']:<30} {r['numel']:>11,} elements {r['median_ms']:>9.3f} ms {r['gb_per_s']:>8.2f} GB/s"
                     f" {r['vs_copy']:>6.2f}x copy")
    return "\n".join(lines)


def run_bench(device: str = "auto", quick: bool = False, rounds: Optional[int] = None,
              shapes: Optional[List[Tuple[int, int, int]]] = None, log=None) -> dict:
    """Run all the measurements; returns the report dict (what `--json` writes). `log`: a function given a line of
    progress (the command line prints it to stderr)."""
    dev, rounds, target_ms, shapes = run_settings(device, quick, rounds, shapes, QUICK_SHAPES)
    linear, skipped = bench_linear(shapes, dev, rounds, target_ms, log)
    numel = (1 << 16) if quick else ((1 << 26) if dev.type == "cuda" else (1 << 22))
    return {
        "fp8kit_version": fp8kit.__version__,
        "torch_version": torch.__version__,
        "device": dev.type,
        "device_name": device_description(dev),
        "cpu_kernels": cpu_kernels_state() if dev.type == "cpu" else None,
        "rounds": rounds,
        "quick": quick,
        "compile": False,
        "linear": linear,
        "skipped": skipped,
        "stats_cost": stats_cost(linear),
        "quantize": bench_quantize(numel, dev, rounds, target_ms),
    }


def _shape(text: str) -> Tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxKxN (e.g. 4096x1024x1024), got {text!r}") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"dimensions must be positive, got {text!r}")
    return m, k, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two small shapes, few rounds (seconds; for tests); "
                        "with --compile one shape and a one-layer GPT (compiling takes most of its time)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--rounds", type=positive_int, help="interleaved rounds per shape (default 9, --quick 3)")
    parser.add_argument("--shape", type=_shape, action="append", dest="shapes", metavar="MxKxN",
                        help="a shape to time instead of the defaults (repeatable)")
    parser.add_argument("--memory", action="store_true", help="instead of timing: parameter and training-step memory "
                        "of a small GPT with FP8 weights against bf16 weights (fp8kit/bench_memory.py)")
    parser.add_argument("--compile", action="store_true", help="instead: eager and torch.compile'd steps side by "
                        "side, FP8 against bf16 (Linear shapes and the demo GPT's training step; compile times "
                        "reported apart; fp8kit/bench_compile.py)")
    parser.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                        help="torch.compile backend for --compile (default: inductor)")
    parser.add_argument("--overhead", action="store_true", help="instead: host time per module call (forward, "
                        "backward, autocast exit for 10/200/1000 modules) against the torch equivalents, tiny "
                        "shapes, one thread, tensor path (fp8kit/bench_overhead.py)")
    parser.set_defaults(run=_run, subparser=parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.memory and args.compile:
        parser.error("argument --compile: not allowed with argument --memory")
    if args.overhead and (args.memory or args.compile):
        parser.error("argument --overhead: not allowed with --memory or --compile")
    if args.overhead:
        from fp8kit.bench_overhead import format_overhead_report, run_overhead_bench

        report = run_overhead_bench(args.quick, args.rounds, log=lambda line: print(line, file=sys.stderr, flush=True),
                                    device=device_argument(parser, args.device))
        print(format_overhead_report(report))
    elif args.compile:
        from fp8kit.bench_compile import format_compile_report, run_compile_bench

        report = run_compile_bench(device_argument(parser, args.device), args.quick, args.rounds, args.shapes,
                                   args.compile_backend, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_compile_report(report))
    elif args.memory:
        from fp8kit.bench_memory import format_memory_report, run_memory_bench

        report = run_memory_bench(device_argument(parser, args.device), args.quick)
        print(format_memory_report(report))
    else:
        report = run_bench(device_argument(parser, args.device), args.quick, args.rounds, args.shapes,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
