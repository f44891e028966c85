"""`fp8kit bench --compile`: FP8 against bf16, eager and under torch.compile, side by side in one run.

Two workloads, each timed as `fp8kit bench` times Linear (fp8kit/bench.py: interleaved rounds, the order rotating
every round, medians over rounds, ratios of medians from the same rounds):

- Linear forward + backward with bf16 operands at the bench's shapes: torch.nn.Linear (bf16), fp8kit Linear under
  current and delayed scaling, and torchao's Float8Linear when it imports. Compiled: the forward with
  `torch.compile(fullgraph=True, dynamic=False)`, fp8kit's autocast inside the compiled function; its backward is
  compiled by AOT autograd.
- The demo GPT's training step (fp8kit/demo, the `tiny` preset; `--quick`: one small layer) on a fixed batch:
  forward and loss under `torch.autocast(bfloat16)` (and, for FP8, fp8kit's autocast), backward, the demo's AdamW
  step, `zero_grad`. Compiled: the forward + loss with fullgraph=True, both autocasts inside the compiled function;
  the backward by AOT autograd; the optimizer step compiled apart (`torch.compile(opt.step)`: torch's optimizers
  break graphs on purpose). The bf16 baseline and torchao's variant use the same model and initial weights with
  torch.nn.Linear layers in place of fp8kit's.

Every variant runs eager and compiled (separate modules, so the FP8 states are not shared). Ratios: each variant
against torch bf16 of the same mode (eager / eager, compiled / compiled) and compiled against eager of the same
variant. Compile time is excluded from the timings: each compiled variant is warmed up until a call compiles
nothing new (at least 3 calls; the delayed recipe's first compiled call registers the FP8 states, so its cold
start is 2 compiles), and its compile time is the warm-up's time less as many steady calls (the backend's one-time
start is taken first, on a trivial function, and reported apart). The report counts the graphs compiled and
inductor's FX-graph cache hits (a warm cache makes compiling much faster; set TORCHINDUCTOR_CACHE_DIR to an empty
directory for cold compiles), and notes any compile during the timed rounds.

On a CPU fp8kit's FP8 GEMMs are emulated by the custom operator `torch.ops.fp8kit.emulated_mm`, which inductor
cannot look into; what inductor can fuse are the casts, scales and amaxes around it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import fp8kit
import fp8kit.pytorch as te
from fp8kit.bench_common import CURRENT, DELAYED, Timer, _data, device_description, interleaved, run_settings

__all__ = ["run_compile_bench", "format_compile_report", "GPT_CONFIG", "QUICK_GPT_CONFIG", "QUICK_SHAPES",
           "BACKENDS"]

QUICK_SHAPES = [(16, 64, 64)]
# The demo's tiny preset (fp8kit.cli.PRESETS["tiny"]) and a one-layer model for --quick.
GPT_CONFIG = dict(n_layer=4, n_embd=128, n_head=4, block_size=64, batch_size=32)
QUICK_GPT_CONFIG = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4)
BACKENDS = ("inductor", "aot_eager", "eager")
BASELINE = "torch bf16"
KINDS = [BASELINE, "fp8kit current", "fp8kit delayed", "torchao Float8Linear"]
RECIPES = {"fp8kit current": CURRENT, "fp8kit delayed": DELAYED}
PEER = "torchao Float8Linear"  # skipped with a note when it does not import or cannot run here
MODES = ("eager", "compiled")
MAX_WARMUP_CALLS = 8


def _counters() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compile(fn, backend: str, fullgraph: bool = True):
    return torch.compile(fn, fullgraph=fullgraph, backend=backend, dynamic=False)


def _float8_linear(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"))


# ---- Linear forward + backward ----------------------------------------------------------------------------------

def _linear_step(kind: str, shape, device: torch.device, compiled: bool, backend: str) -> Callable[[], None]:
    x, dy = _data(shape, device)
    if kind in RECIPES:
        layer = te.Linear(shape[1], shape[2], device=device, params_dtype=torch.bfloat16)
        recipe = RECIPES[kind]

        def forward(inp):
            with te.autocast(recipe=recipe):
                return layer(inp)
    else:
        forward = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[2], device=device, dtype=torch.bfloat16))
        if kind == PEER:
            forward = _float8_linear(forward, device)
    if compiled:
        forward = _compile(forward, backend)

    def step():
        forward(x).backward(dy)
    return step


# ---- the demo GPT's training step -------------------------------------------------------------------------------

def _torch_linears(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every fp8kit Linear replaced by a torch.nn.Linear holding the same parameters."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, te.Linear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device=child.weight.device, dtype=child.weight.dtype)
                plain.weight = child.weight
                if child.bias is not None:
                    plain.bias = child.bias
                setattr(module, child_name, plain)
    return model


def _gpt_step(kind: str, cfg: dict, device: torch.device, compiled: bool, backend: str) -> Callable[[], None]:
    from fp8kit.demo.model import GPT, GPTConfig
    from fp8kit.demo.train import TrainConfig, make_optimizer

    gpt_cfg = GPTConfig(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"],
                        block_size=cfg["block_size"])
    torch.manual_seed(0)
    model = GPT(gpt_cfg).to(device)
    if kind not in RECIPES:
        model = _torch_linears(model)
        if kind == PEER:
            model = _float8_linear(model, device)
    recipe = RECIPES.get(kind)
    optimizer = make_optimizer(model, TrainConfig(model=gpt_cfg, lr=1e-4))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, gpt_cfg.vocab_size, (cfg["batch_size"], gpt_cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def forward_loss(idx, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if recipe is None:
                return model(idx, targets)[1]
            with te.autocast(enabled=True, recipe=recipe):
                return model(idx, targets)[1]
    opt_step = optimizer.step
    if compiled:
        forward_loss = _compile(forward_loss, backend)
        opt_step = _compile(optimizer.step, backend, fullgraph=False)

    def step():
        forward_loss(x, y).backward()
        opt_step()
        optimizer.zero_grad(set_to_none=True)
    return step


# ---- warm-up, compile time, timing --------------------------------------------------------------------------------

def _warm_up(step: Callable[[], None], device: torch.device, compiled: bool) -> dict:
    """Call `step` until it compiles nothing new (compiled) or twice (eager); the compile time and counts."""
    before = _counters()
    times = []
    while True:
        graphs = _counters()["graphs"]
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        settled = _counters()["graphs"] == graphs
        if not compiled and len(times) >= 2:
            break
        if compiled and ((len(times) >= 3 and settled) or len(times) >= MAX_WARMUP_CALLS):
            break
    after = _counters()
    out = {"warmup_calls": len(times), "warmup_s": sum(times)}
    if compiled:
        out.update({"compile_s": max(0.0, sum(times) - len(times) * times[-1]),
                    **{k: after[k] - before[k] for k in after}})
    return out


def _measure(builders: Dict[Tuple[str, str], Callable[[], Callable[[], None]]], device: torch.device, rounds: int,
             target_ms: float, skipped: Dict[str, str], log: Callable[[str], None]) -> List[dict]:
    """Build, warm up and time side by side the steps `builders` makes ({(kind, mode): builder}); rows with
    ratios against torch bf16 of the same mode and against the eager step of the same kind."""
    steps, warm = {}, {}
    for (kind, mode), build in builders.items():
        name = f"{mode} {kind}"
        if kind == PEER and (kind in skipped or name in skipped):
            continue
        try:
            steps[(kind, mode)] = build()
            warm[(kind, mode)] = _warm_up(steps[(kind, mode)], device, mode == "compiled")
            if mode == "compiled":
                log(f"  {name}: {warm[(kind, mode)]['graphs']} graphs, {warm[(kind, mode)]['compile_s']:.1f} s")
        except Exception as e:
            if kind != PEER:  # fp8kit and the baseline must run: errors propagate
                raise
            steps.pop((kind, mode), None)
            why = f"not importable ({e.name or e})" if isinstance(e, ImportError) else \
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            skipped[kind if isinstance(e, ImportError) else name] = why
    graphs = _counters()["graphs"]
    log(f"  timing {len(steps)} steps in {rounds} rounds")
    samples, iters = interleaved(steps, Timer(device), rounds, target_ms)
    recompiled = _counters()["graphs"] - graphs
    medians = {key: statistics.median(s) for key, s in samples.items()}
    rows = []
    for (kind, mode), ms in medians.items():
        base, eager = medians.get((BASELINE, mode)), medians.get((kind, "eager"))
        rows.append({"variant": kind, "mode": mode, "median_ms": ms,
                     "vs_bf16": ms / base if base is not None else None,
                     "vs_eager": ms / eager if eager is not None and mode == "compiled" else None,
                     "samples_ms": samples[(kind, mode)], "iters_per_sample": iters[(kind, mode)],
                     "graphs_compiled_while_timing": recompiled, **warm[(kind, mode)]})
    return rows


def run_compile_bench(device: str = "cpu", quick: bool = False, rounds: Optional[int] = None,
                      shapes: Optional[List[Tuple[int, int, int]]] = None, backend: str = "inductor",
                      gpt: Optional[dict] = None, workloads: Sequence[str] = ("linear", "gpt"),
                      log: Optional[Callable[[str], None]] = None) -> dict:
    """Run the workloads ("linear", "gpt"); returns the report dict (what `fp8kit bench --compile --json`
    writes). `gpt`: the model and batch (keys of GPT_CONFIG), default GPT_CONFIG (QUICK_GPT_CONFIG with quick).
    `log`: called with a line at each stage (the command prints them on stderr)."""
    log = log or (lambda line: None)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    dev, rounds, target_ms, shapes = run_settings(device, quick, rounds, shapes, QUICK_SHAPES)
    gpt = dict(gpt or (QUICK_GPT_CONFIG if quick else GPT_CONFIG))
    skipped: Dict[str, str] = {}
    linear, started = [], time.perf_counter()
    torch._dynamo.reset()
    trivial, ones = _compile(lambda t: t * 2 + 1, backend), torch.ones(8, device=dev)
    startup = _warm_up(lambda: trivial(ones), dev, True)
    # Every variant traces the same functions; one step (shape or model) at a time in dynamo's caches.
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        for shape in shapes if "linear" in workloads else []:
            torch._dynamo.reset()
            log(f"Linear {'x'.join(map(str, shape))}:")
            builders = {(kind, mode): (lambda k=kind, m=mode: _linear_step(k, shape, dev, m == "compiled", backend))
                        for mode in MODES for kind in KINDS}
            for row in _measure(builders, dev, rounds, target_ms, skipped, log):
                m, k, n = shape
                row.update(shape=list(shape), tflops=6.0 * m * k * n / (row["median_ms"] * 1e-3) / 1e12)
                linear.append(row)
        gpt_rows = []
        if "gpt" in workloads:
            torch._dynamo.reset()
            log("demo GPT training step:")
            builders = {(kind, mode): (lambda k=kind, m=mode: _gpt_step(k, gpt, dev, m == "compiled", backend))
                        for mode in MODES for kind in KINDS}
            gpt_rows = _measure(builders, dev, rounds, target_ms, skipped, log)
        torch._dynamo.reset()
    tokens = gpt["batch_size"] * gpt["block_size"]
    for row in gpt_rows:
        row["tokens_per_s"] = tokens / (row["median_ms"] * 1e-3)
    return {
        "compile": True,
        "backend": backend,
        "fp8kit_version": fp8kit.__version__,
        "torch_version": torch.__version__,
        "device": dev.type,
        "device_name": device_description(dev),
        "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
        "quick": quick,
        "linear": linear,
        "gpt_config": gpt,
        "gpt_step": gpt_rows,
        "skipped": skipped,
        "startup_s": startup["compile_s"],  # the backend's one-time start (a trivial function compiled first)
        "total_s": time.perf_counter() - started,
    }


def _ratio(value: Optional[float]) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _pairs(rows: List[dict]) -> List[Tuple[str, Optional[dict], Optional[dict]]]:
    """(variant, eager row, compiled row) in KINDS order."""
    by = {(r["variant"], r["mode"]): r for r in rows}
    return [(k, by.get((k, "eager")), by.get((k, "compiled"))) for k in KINDS
            if (k, "eager") in by or (k, "compiled") in by]


def _ms(row: Optional[dict], key: str = "median_ms", fmt: str = "{:.3f}") -> str:
    return fmt.format(row[key]) if row is not None and row.get(key) is not None else "-"


def _table(groups: List[Tuple[str, List[dict]]], label: str) -> List[str]:
    """One line per (group, variant): eager and compiled medians and ratios; `groups` is [(first column, rows)]."""
    lines = [f"{label:<16} {'variant':<22} {'eager ms':>9} {'vs bf16':>8} {'compiled ms':>11} {'vs bf16':>8} "
             f"{'vs eager':>8} {'compile s':>9}"]
    for first, rows in groups:
        for kind, e, c in _pairs(rows):
            lines.append(f"{first:<16} {kind:<22} {_ms(e):>9} {_ratio(e and e['vs_bf16']):>8} {_ms(c):>11} "
                         f"{_ratio(c and c['vs_bf16']):>8} {_ratio(c and c['vs_eager']):>8} "
                         f"{_ms(c, 'compile_s', '{:.1f}'):>9}")
    return lines


def _by_shape(rows: List[dict]) -> List[Tuple[str, List[dict]]]:
    shapes = dict.fromkeys(tuple(r["shape"]) for r in rows)
    return [("x".join(map(str, s)), [r for r in rows if tuple(r["shape"]) == s]) for s in shapes]


def format_compile_report(report: dict) -> str:
    lines = [f"fp8kit {report['fp8kit_version']} bench --compile on {report['device']} ({report['device_name']}), "
             f"torch {report['torch_version']}, backend {report['backend']}, median of {report['rounds']} "
             f"interleaved rounds, {report['date']}"]
    if report["device"] == "cpu":
        lines.append("CPU: fp8kit's FP8 GEMMs are emulated (torch.ops.fp8kit.emulated_mm, opaque to inductor); "
                     "compiling can fuse the casts, scales and amaxes around them")
    lines.append("vs bf16: against torch bf16 of the same mode (eager / eager, compiled / compiled); vs eager: "
                 "compiled / eager of the variant; compile s: cold start, excluded from the timings")
    lines += ["", "Linear forward+backward, bf16 operands (compiled: forward with fullgraph=True, backward by AOT "
                  "autograd)"]
    lines += _table(_by_shape(report["linear"]), "shape MxKxN")
    g = report["gpt_config"]
    if report["gpt_step"]:
        lines += ["", f"demo GPT training step ({g['n_layer']} layers, n_embd {g['n_embd']}, {g['n_head']} heads, "
                      f"batch {g['batch_size']}x{g['block_size']} tokens): forward, loss, backward, AdamW step",
                  "(compiled: forward + loss with fullgraph=True, backward by AOT autograd, torch.compile(opt.step))"]
        lines += _table([("GPT step", report["gpt_step"])], "")
        lines.append("tokens/s: " + ", ".join(f"{r['mode']} {r['variant']} {r['tokens_per_s']:,.0f}"
                                              for r in report["gpt_step"]))
        summary = []
        for kind, e, c in _pairs(report["gpt_step"]):
            if kind != BASELINE and e and c:
                verdict = "lower" if c["vs_bf16"] < e["vs_bf16"] else "not lower"
                summary.append(f"  {kind}: eager {e['vs_bf16']:.2f}x eager bf16, compiled {c['vs_bf16']:.2f}x "
                               f"compiled bf16 ({verdict} when compiled)")
        if summary:
            lines += ["", "FP8 / bf16 time, demo GPT step:"] + summary
    lines += ["", "Compiling (cold start of each compiled variant: graphs compiled, inductor FX-graph cache hits / "
                  f"misses, seconds; before them the backend's one-time start: {report['startup_s']:.1f} s)"]
    for label, rows in _by_shape(report["linear"]) + [("GPT step", report["gpt_step"])]:
        for r in rows:
            if r["mode"] == "compiled":
                lines.append(f"  {label:<16} {r['variant']:<22} {r['graphs']:>3} graphs  cache {r['cache_hits']:>3} "
                             f"hit {r['cache_misses']:>3} miss  {r['compile_s']:>7.1f} s")
    timing_compiles = {r["graphs_compiled_while_timing"] for r in report["linear"] + report["gpt_step"]}
    if timing_compiles != {0}:
        lines.append("note: graphs were compiled during the timed rounds (a recompile); those timings include it")
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines.append(f"total {report['total_s']:.0f} s")
    return "\n".join(lines)
