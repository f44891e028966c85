"""Host time per module call (`fp8kit bench --overhead`): fp8kit's modules against their torch equivalents, tiny
shapes, one thread, on the tensor path.

On a GPU every torch operation a module issues costs about a kernel launch on the host; when the host is slower than
the GPU, the GPU waits. This benchmark measures that host cost where it can be measured without a GPU: on the CPU,
with shapes so small (16 tokens, hidden 64) that the arithmetic is negligible, and on the tensor path
(`fp8kit.pytorch.host.tensor_path()`, the torch operations a GPU runs, with no host synchronisation of fp8kit's own),
so the figure is Python plus dispatch. The CPU GEMM emulation (which a GPU replaces by `torch._scaled_mm`) is part
of it.

Each variant is a stack of `modules` identical modules; forward (inside autocast, its exit included) and backward are
timed separately, per module call, in interleaved rounds (the variant order rotates every round), and the reported
figure is the median over rounds. Times are the CPU time of the benchmarking thread (`time.thread_time`): on a shared
machine the time the OS gives to other processes is not counted, while everything this thread runs (Python,
dispatch, the tiny kernels, garbage collection) is. Ratios are against the torch equivalent measured in the same
rounds:

  Linear           torch.nn.Linear
  LayerNormLinear  torch.nn.LayerNorm + torch.nn.Linear
  LayerNormMLP     torch.nn.LayerNorm + Linear + GELU + Linear
  TransformerLayer torch.nn.TransformerEncoderLayer (pre-norm, GELU, causal mask, no dropout)

On the CPU, Linear is also timed on the host path ("host path" rows: the CPU's default, where the casts are fp8kit's
CPU kernels and the scale arithmetic is Python floats), which is what a CPU user's small model pays. On CUDA, Linear
is also timed with the Triton kernels off ("no kernels" rows): the launches' host cost against the operations they
replace.

Also timed: the autocast exit (the batched delayed-scaling update) after 10, 200 and 1,000 Linear modules ran, which
should not grow with the number of modules. And counted (`fp8kit.bench_ops`): the operations one Linear step
dispatches on the accelerator path (meta tensors, fp8kit's Triton kernels on and off) and on the CPU tensor path.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

import fp8kit.pytorch as te
from fp8kit.bench_floor import FloorLinear
from fp8kit.bench_ops import linear_op_counts
from fp8kit.pytorch import host, kernels
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer")
RECIPES = {"current": Float8CurrentScaling, "delayed": DelayedScaling}
EXIT_MODULES = (10, 200, 1000)
FLOOR = "ops only, current"  # fp8kit.bench_floor: current scaling's operations with nothing around them


def _te_module(kind: str, hidden: int, heads: int) -> torch.nn.Module:
    if kind == "Linear":
        return te.Linear(hidden, hidden)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(hidden, hidden)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(hidden, 4 * hidden)
    return te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0, attention_dropout=0.0)


class _TorchLayer(torch.nn.Module):
    """torch.nn.TransformerEncoderLayer called as te.TransformerLayer is (causal self-attention)."""

    def __init__(self, hidden: int, heads: int, tokens: int):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu",
                                                      norm_first=True)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(tokens))

    def forward(self, x):
        return self.layer(x, src_mask=self.mask, is_causal=True)


def _torch_module(kind: str, hidden: int, heads: int, tokens: int) -> torch.nn.Module:
    nn = torch.nn
    if kind == "Linear":
        return nn.Linear(hidden, hidden)
    if kind == "LayerNormLinear":
        return nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden))
    if kind == "LayerNormMLP":
        return nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                             nn.Linear(4 * hidden, hidden))
    return _TorchLayer(hidden, heads, tokens)


def _input(kind: str, tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = (tokens, 1, hidden) if kind == "TransformerLayer" else (tokens, hidden)  # te: [seq, batch, hidden]
    return torch.randn(*shape, generator=g).to(device).requires_grad_()


def _step(stack: torch.nn.Module, x: torch.Tensor, recipe) -> Callable[[], tuple]:
    """A step returning (forward seconds, backward seconds) of host time. On a GPU the device work is waited for
    before the step (outside the timed parts), so that a full launch queue never blocks the host inside them, and
    the clock is the wall clock: autograd runs a CUDA backward on its own device thread, whose CPU time the
    calling thread's clock would not see (the launches are asynchronous, so the wall time of the tiny step is the
    host's time)."""
    cuda = x.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time

    def step():
        sync()
        t0 = clock()
        if recipe is None:
            y = stack(x)
        else:
            with te.autocast(recipe=recipe):
                y = stack(x)
        loss = y.sum()
        t1 = clock()
        loss.backward()
        return t1 - t0, clock() - t1
    return step


def _medians(steps: Dict[str, Callable[[], tuple]], rounds: int, per_round: int) -> Dict[str, tuple]:
    names = list(steps)
    for step in steps.values():  # first calls: registration, quantizers, caches
        for _ in range(3):
            step()
    fwd: Dict[str, List[float]] = {n: [] for n in names}
    bwd: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            f = b = 0.0
            for _ in range(per_round):
                df, db = steps[name]()
                f, b = f + df, b + db
            fwd[name].append(f / per_round)
            bwd[name].append(b / per_round)
    return {n: (statistics.median(fwd[n]), statistics.median(bwd[n])) for n in names}


def _within(scope: Callable, step: Callable[[], tuple]) -> Callable[[], tuple]:
    """`step` run inside the context manager `scope()` each time."""
    def run():
        with scope():
            return step()
    return run


def bench_modules(kinds=KINDS, modules: int = 24, tokens: int = 16, hidden: int = 64, heads: int = 4,
                  rounds: int = 9, per_round: int = 3, log=None, device="cpu",
                  kernels_off_rows: Optional[bool] = None) -> List[dict]:
    """Rows {module, variant, forward_us, backward_us, ratio_*}: per module call, medians over interleaved rounds.
    `kernels_off_rows` (default: on CUDA) adds Linear rows with the Triton kernels off, in the same rounds: the
    host cost of the launches against that of the torch operations they replace. On CPU tensors Linear also gets
    rows on the host path (the CPU's default path, `host.host_path`), whatever path the caller chose."""
    rows = []
    device = torch.device(device)
    if kernels_off_rows is None:
        kernels_off_rows = device.type == "cuda"
    extra = {"no kernels": lambda: kernels.enabled_as(False)} if kernels_off_rows else {}  # Linear's extra rows
    if device.type == "cpu":
        extra["host path"] = host.host_path
    for kind in kinds:
        if log:
            log(f"overhead: {kind}")
        torch.manual_seed(0)
        x = _input(kind, tokens, hidden, device)
        steps = {"torch": _step(torch.nn.Sequential(*[_torch_module(kind, hidden, heads, tokens)
                                                      for _ in range(modules)]).to(device), x, None)}
        for name, recipe_cls in RECIPES.items():
            stack = torch.nn.Sequential(*[_te_module(kind, hidden, heads) for _ in range(modules)]).to(device)
            steps[f"fp8kit {name}"] = _step(stack, x, recipe_cls())
            for label, scope in (extra.items() if kind == "Linear" else ()):
                stack = torch.nn.Sequential(*[_te_module(kind, hidden, heads) for _ in range(modules)]).to(device)
                steps[f"{name}, {label}"] = _within(scope, _step(stack, x, recipe_cls()))
        if kind == "Linear" and device.type == "cpu":  # current scaling's operations, without fp8kit around them
            steps[FLOOR] = _step(torch.nn.Sequential(*[FloorLinear(hidden, hidden) for _ in range(modules)]), x, None)
        medians = _medians(steps, rounds, per_round)
        base_f, base_b = medians["torch"]
        for name, (f, b) in medians.items():
            rows.append({"module": kind, "variant": name, "forward_us": f / modules * 1e6,
                         "backward_us": b / modules * 1e6, "ratio_forward": f / base_f, "ratio_backward": b / base_b,
                         "ratio_total": (f + b) / (base_f + base_b)})
    return rows


EXIT_RECIPES = {"current": Float8CurrentScaling(), "delayed, history 16": DelayedScaling(amax_history_len=16),
                "delayed, history 1024": DelayedScaling(amax_history_len=1024)}


def bench_exit(counts=EXIT_MODULES, rounds: int = 9, log=None, device="cpu") -> List[dict]:
    """Rows {recipe, modules, exit_us}: the outermost autocast exit after `modules` Linear(16, 16) ran (the
    modules of earlier rows collected first, so that each row's key holds its own modules only)."""
    rows = []
    x = torch.randn(16, 16, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    for name, recipe in EXIT_RECIPES.items():
        for n in counts:
            if log:
                log(f"overhead: autocast exit, {name}, {n} modules")
            layers = None
            gc.collect()
            layers = [te.Linear(16, 16, device=device) for _ in range(n)]
            # The first allocation after the forward pass pays the C allocator's deferred work on the forward's
            # freed temporaries (glibc consolidates its free lists at the next larger request): it grows with the
            # number of modules that ran, whoever allocates. One allocation before the timer takes it (reported).
            times, primes = [], []
            for r in range(rounds + 2):
                ctx = te.autocast(recipe=recipe)
                ctx.__enter__()
                ys = [layer(x) for layer in layers]
                sync()
                t0 = time.thread_time()
                torch.empty(1 << 14)  # see below
                t1 = time.thread_time()
                ctx.__exit__(None, None, None)
                if r >= 2:  # the first exits place the states into the flat buffers
                    times.append(time.thread_time() - t1)
                    primes.append(t1 - t0)
                torch.stack([y.sum() for y in ys]).sum().backward()
            rows.append({"recipe": name, "modules": n, "exit_us": statistics.median(times) * 1e6,
                         "first_allocation_us": statistics.median(primes) * 1e6})
    return rows


def run_overhead_bench(quick: bool = False, rounds: Optional[int] = None, log=None, device="cpu") -> dict:
    """The whole report (one thread, tensor path; the thread count is restored afterwards). On a CUDA `device` the
    modules and inputs live there: the host time is then Python, dispatch and kernel launches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with host.tensor_path():
            if quick:
                modules = bench_modules(("Linear",), modules=4, rounds=rounds or 3, per_round=1, log=log,
                                        device=device)
                exits = bench_exit((10, 50), rounds=rounds or 3, log=log, device=device)
            else:
                modules = bench_modules(rounds=rounds or 9, log=log, device=device)
                exits = bench_exit(rounds=rounds or 9, log=log, device=device)
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "path": "tensor", "device": str(device), "modules": modules, "exit": exits,
            "ops": linear_op_counts()}


def format_overhead_report(report: dict) -> str:
    clock = "wall time, launches asynchronous" if report.get("device", "cpu").startswith("cuda") else \
        "thread CPU time"
    lines = [f"Host time per module call (us of {clock}; one thread, tensor path, tensors on "
             f"{report.get('device', 'cpu')}; median of interleaved rounds)",
             f"{'module':17s} {'variant':20s} {'forward':>9s} {'backward':>9s} {'fwd x':>6s} {'bwd x':>6s} "
             f"{'total x':>7s}"]
    for row in report["modules"]:
        lines.append(f"{row['module']:17s} {row['variant']:20s} {row['forward_us']:9.1f} {row['backward_us']:9.1f} "
                     f"{row['ratio_forward']:6.2f} {row['ratio_backward']:6.2f} {row['ratio_total']:7.2f}")
    lines.append("")
    lines.append("autocast exit (batched update) after N Linear modules ran (us)")
    lines.append(f"{'recipe':22s} {'modules':>8s} {'exit us':>9s} {'first alloc us':>15s}")
    for row in report["exit"]:
        lines.append(f"{row['recipe']:22s} {row['modules']:8d} {row['exit_us']:9.1f} "
                     f"{row['first_allocation_us']:15.1f}")
    if report.get("ops"):
        lines.append("")
        lines.append("operations one Linear(64, 64) forward + backward dispatches (16 tokens; aten operations + kernel "
                     "launches; each costs the host about a launch on a GPU; delayed: the step's two batched updates "
                     "included, which a model of many modules pays once)")
        lines.append(f"{'path':17s} {'variant':30s} {'ops':>5s} {'launches':>9s} {'x torch':>8s}")
        base = {row["path"]: row["ops"] for row in report["ops"] if row["variant"] == "torch"}
        for row in report["ops"]:
            total = row["ops"] + row["launches"]
            lines.append(f"{row['path']:17s} {row['variant']:30s} {row['ops']:5d} {row['launches']:9d} "
                         f"{total / base[row['path']]:8.2f}")
    lines.append("x: fp8kit's time over the torch equivalent's in the same rounds (forward includes the autocast exit)")
    lines.append(f"{FLOOR}: the torch operations of fp8kit's current-scaling Linear call alone (fp8kit/bench_floor.py: "
                 "the same outputs and gradients); fp8kit above it is fp8kit's own Python, it above torch is what "
                 "the operations cost on this device")
    lines.append("first alloc: the first allocation after the forward pass (the C allocator's deferred work on the "
                 "forward's freed temporaries), taken before the exit's timer")
    return "\n".join(lines)
