"""GPU check (issue items 5 and 6): CUDA graphs and torch.compile with fp8kit modules, bit-identical to eager, and
simple step timings.

Checks (each in its own try/except; the JSON file is rewritten after each one):

- graphs_<recipe> (recipe: current = Float8CurrentScaling, delayed = DelayedScaling): two identical stacks of
  te.TransformerLayer (same seed, parameters checked equal), one made into a graph with te.make_graphed_callables
  (CUDA graphs on CUDA; on a CPU fp8kit's fallback, torch.compile with aot_eager). Checks that warm-up and capture
  leave the FP8 states as they were, then trains both side by side for a few steps on fresh inputs whose magnitude
  changes (the scales move), and compares bit for bit (torch.equal) after every step: outputs, input gradients,
  parameter gradients, and every FP8 scaling state (amax history, scale, counter). Mismatches record the max abs
  diff. Under current scaling a control checks that two eager steps on the same input agree (a non-deterministic
  kernel would show there, not as a graph bug). Deterministic algorithms are on (warn_only) for the whole check.
  Then times one training step (forward + backward, synchronized, median) eager against graphed.
- graphs_bf16_reference: the same eager stack without FP8 (no autocast), timed.
- compile_<recipe>: two identical small nets (te.Linear -> ReLU -> te.Linear, bf16 parameters), one under
  torch.compile(fullgraph=True, backend inductor, dynamic=False) with te.autocast inside the compiled function, trained
  side by side (no optimizer: inductor sums the bias gradients in its own order, so those are compared with a
  tolerance of one rounding of their dtype, everything else bit for bit) after te.apply_pending_updates(); graph
  breaks fail fullgraph; the compile counter per step is recorded. Then times the eager and compiled FP8 step and
  records the compile time (the first compiled steps' time less as many steady steps).
- compile_bf16_reference: the same net of torch.nn.Linear without FP8, eager and compiled, timed.

Run: python3 tools/gpu/check_graphs_compile.py --device cuda --out OUT.json [--budget 150]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

T0 = time.perf_counter()
RESULT = {"meta": {}, "checks": {}}


# ---- helpers ----------------------------------------------------------------------------------------------------

def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def write(path):
    RESULT["meta"]["elapsed_s"] = round(time.perf_counter() - T0, 2)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    os.replace(tmp, path)


def make_recipe(name):
    if name == "delayed":
        return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    return Float8CurrentScaling(fp8_format=Format.HYBRID)


def recipe_text(recipe):
    if isinstance(recipe, DelayedScaling):
        return (f"DelayedScaling(format={recipe.fp8_format.name}, amax_history_len={recipe.amax_history_len}, "
                f"amax_compute_algo={recipe.amax_compute_algo})")
    return f"{type(recipe).__name__}(format={recipe.fp8_format.name})"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def states(model):
    """[(label, tensor clone)] for every FP8 scaling state of the model (as tests/test_graph.py collects them)."""
    out = []
    for mname, m in model.named_modules():
        meta = getattr(m, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for name in ("scaling_fwd", "scaling_bwd"):
            s = meta.get(name)
            if s is not None:
                for attr in ("amax_history", "scale", "count"):
                    out.append((f"{mname}.{name}.{attr}", getattr(s, attr).detach().clone()))
    return out


def diff(a, b):
    """(bit-equal, max abs diff as a float or None when equal / shapes differ)."""
    if a is None or b is None:
        return (a is None and b is None), None if (a is None and b is None) else "one is None"
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if torch.equal(a, b):
        return True, None
    d = (a.double() - b.double()).abs()
    if bool(torch.isnan(d).any()):
        return False, f"NaN in {int(torch.isnan(a).sum())} / {int(torch.isnan(b).sum())} elements (a / b)"
    return False, float(d.max())


def compare_many(pairs, close=None):
    """pairs: [(label, a, b)]. Returns {"equal": bool, "n": int, "mismatches": {label: maxdiff} (first 8)}.
    close(label) -> rtol or None: those labels pass within that relative tolerance (recorded apart)."""
    mism, within = {}, {}
    for label, a, b in pairs:
        eq, d = diff(a, b)
        if eq:
            continue
        rtol = close(label) if close else None
        if rtol is not None and isinstance(d, float):
            ok = bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=0))
            if ok:
                within[label] = d
                continue
        mism[label] = d
    out = {"equal": not mism, "n": len(pairs), "mismatches": dict(list(mism.items())[:8]),
           "n_mismatches": len(mism)}
    if within:
        out["within_tolerance"] = dict(list(within.items())[:8])
    return out


def time_step(step, dev, warmup, iters):
    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4), "iters": iters,
            "warmup": warmup}


def tb():
    return "".join(traceback.format_exc().splitlines(True)[-80:])


# ---- A. CUDA graphs of a TransformerLayer stack -------------------------------------------------------------------

def build_stack(cfg, dev, seed=0):
    torch.manual_seed(seed)
    layers = [te.TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], hidden_dropout=0.0,
                                  attention_dropout=0.0, params_dtype=cfg["dtype"], device=dev, layer_number=i + 1)
              for i in range(cfg["layers"])]
    return torch.nn.Sequential(*layers)


def compare_step(rec, eager, other, close=None) -> None:
    """Fill `rec` with the comparisons of one step: `eager` and `other` are (output, input grad, model); the
    parameter gradients may be `close` (a label -> rtol or None) instead of equal."""
    (y_e, dx_e, m_e), (y_o, dx_o, m_o) = eager, other
    rec["output"] = compare_many([("out", y_e, y_o)])
    rec["input_grad"] = compare_many([("dx", dx_e, dx_o)])
    rec["param_grads"] = compare_many([(n, p.grad, q.grad) for (n, p), q in
                                       zip(m_e.named_parameters(), m_o.parameters())], close=close)
    s_e, s_o = states(m_e), states(m_o)
    rec["states"] = compare_many([(la, a, b) for (la, a), (_, b) in zip(s_e, s_o)])
    rec["states"]["count_same"] = len(s_e) == len(s_o)
    rec["n_state_tensors"] = len(s_e)
    rec["ok"] = all(rec[k]["equal"] for k in ("output", "input_grad", "param_grads", "states")) \
        and rec["states"]["count_same"]


def identical_pair(build):
    a, b = build(), build()
    if not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())):
        b.load_state_dict(a.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), "models differ at the start"
    return a, b


def train_step(model, x, dy, recipe):
    """One forward + backward under autocast (recipe None: no FP8); returns (output, input grad)."""
    x = x.detach().clone().requires_grad_()
    if recipe is None:
        y = model(x)
    else:
        with te.autocast(recipe=recipe):
            y = model(x)
    y.backward(dy)
    return y.detach(), x.grad


def check_graphs(recipe_name, cfg, dev, args, remaining):
    recipe = make_recipe(recipe_name)
    out = {"config": {k: str(v) for k, v in cfg.items()}, "recipe": recipe_text(recipe)}
    det = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fills in the timed steps
    out["deterministic_algorithms"] = "on (warn_only, fill_uninitialized_memory off), eager and graphed alike"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager, graphed = identical_pair(lambda: build_stack(cfg, dev))
            shape = (cfg["seq"], cfg["batch"], cfg["hidden"])
            gen = torch.Generator(device=dev).manual_seed(1)

            def rand(scale=1.0):
                return torch.randn(shape, device=dev, dtype=cfg["dtype"], generator=gen) * scale

            if recipe_name == "current":  # control: is an eager step repeatable on this device?
                x, dy = rand(), rand()
                y1, dx1 = train_step(eager, x, dy, recipe)
                g1 = [p.grad.clone() for p in eager.parameters()]
                eager.zero_grad(set_to_none=True)
                y2, dx2 = train_step(eager, x, dy, recipe)
                g2 = [p.grad.clone() for p in eager.parameters()]
                eager.zero_grad(set_to_none=True)
                ctl = compare_many([("out", y1, y2), ("dx", dx1, dx2)] +
                                   [(f"grad{i}", a, b) for i, (a, b) in enumerate(zip(g1, g2))])
                out["control_eager_repeat"] = ctl
                del y1, dx1, g1, y2, dx2, g2

            # one eager step of both first: the graphed model starts from a trained state (FP8 states exist),
            # which warm-up and capture must leave as it is (tests/test_graph.py)
            x0, dy0 = rand(), rand()
            for m in (eager, graphed):
                train_step(m, x0, dy0, recipe)
                m.zero_grad(set_to_none=True)
            before = states(graphed)
            t = time.perf_counter()
            sample = torch.randn(shape, device=dev, dtype=cfg["dtype"], requires_grad=True)
            graphed = te.make_graphed_callables(graphed, (sample,), enabled=True, recipe=recipe,
                                                num_warmup_iters=3)
            sync(dev)
            out["make_graphed_callables_s"] = round(time.perf_counter() - t, 3)
            out["graph_kind"] = "cuda graphs" if dev.type == "cuda" else "torch.compile aot_eager (CPU fallback)"
            after = states(graphed)
            out["capture_left_states_unchanged"] = compare_many(
                [(la, a, b) for (la, a), (_, b) in zip(before, after)])
            out["capture_left_states_unchanged"]["count_same"] = len(before) == len(after)

            steps, all_ok = [], True
            for i in range(args.steps):
                scale = 10.0 ** (i % 3 - 1)  # magnitudes change: the scales move
                x, dy = rand(scale), rand()
                y_e, dx_e = train_step(eager, x, dy, recipe)
                t = time.perf_counter()
                y_g, dx_g = train_step(graphed, x, dy, recipe)
                sync(dev)
                tg = time.perf_counter() - t
                rec = {"step": i, "input_scale": scale, "graphed_step_s": round(tg, 4)}
                compare_step(rec, (y_e, dx_e, eager), (y_g, dx_g, graphed))
                all_ok &= rec["ok"]
                steps.append(rec)
                eager.zero_grad(set_to_none=True)
                graphed.zero_grad(set_to_none=True)
            out["steps"] = steps
            out["bit_identical_all_steps"] = all_ok
            cap = out["capture_left_states_unchanged"]
            out["ok"] = all_ok and cap["equal"] and cap["count_same"]

            # timing: eager FP8 step vs graphed FP8 step
            iters = args.iters if remaining() > 30 else max(3, args.iters // 4)
            x, dy = rand(), rand()
            timing = {}
            for name, model in (("eager_fp8", eager), ("graphed_fp8", graphed)):
                def step(model=model):
                    train_step(model, x, dy, recipe)
                    model.zero_grad(set_to_none=True)
                timing[name] = time_step(step, dev, args.warmup, iters)
            timing["graphed_speedup_vs_eager"] = round(timing["eager_fp8"]["median_ms"] /
                                                       timing["graphed_fp8"]["median_ms"], 3)
            out["timing"] = timing
    finally:
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    return out


def check_graphs_bf16(cfg, dev, args, remaining):
    model = build_stack(cfg, dev)
    shape = (cfg["seq"], cfg["batch"], cfg["hidden"])
    x = torch.randn(shape, device=dev, dtype=cfg["dtype"])
    dy = torch.randn(shape, device=dev, dtype=cfg["dtype"])

    def step():
        train_step(model, x, dy, None)
        model.zero_grad(set_to_none=True)

    iters = args.iters if remaining() > 20 else max(3, args.iters // 4)
    return {"ok": True, "config": {k: str(v) for k, v in cfg.items()},
            "timing": {"eager_bf16": time_step(step, dev, args.warmup, iters)}}


# ---- B. torch.compile ---------------------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """te.Linear -> ReLU -> te.Linear (exact under every backend: inductor keeps ReLU exact), or torch.nn.Linear."""

    def __init__(self, hidden, dev, dtype, plain=False):
        super().__init__()
        lin = (lambda i, o: torch.nn.Linear(i, o, device=dev, dtype=dtype)) if plain else \
            (lambda i, o: te.Linear(i, o, params_dtype=dtype, device=dev))
        self.a, self.b = lin(hidden, hidden), lin(hidden, hidden)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make_net(hidden, dev, dtype, plain=False):
    torch.manual_seed(0)
    return Net(hidden, dev, dtype, plain)


def bias_rtol(dtype):
    """One rounding of the parameters' dtype: inductor sums bias gradients over rows in its own order."""
    return {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 2.0 ** -21)


def compile_side_by_side(recipe, ccfg, dev, args, backend):
    """Eager and compiled copies of the net trained side by side (no optimizer), compared after every step."""
    import torch._dynamo.testing

    hidden, tokens, dtype = ccfg["hidden"], ccfg["tokens"], ccfg["dtype"]
    eager, comp = identical_pair(lambda: make_net(hidden, dev, dtype))
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)

    def fwd_e(x):
        with te.autocast(recipe=recipe):
            return eager(x)

    def fwd_inner(x):
        with te.autocast(recipe=recipe):
            return comp(x)

    fwd_c = torch.compile(fwd_inner, fullgraph=True, backend=counter, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(1)

    def rand(scale=1.0):
        return torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=gen) * scale

    steps, all_ok, first_steps = [], True, []
    warm_x, warm_dy = rand(), rand()  # one eager step for both first: torch < 2.12 cannot trace the state's setup
    for fn in (fwd_e, fwd_inner):
        run_net(fn, warm_x, warm_dy)
    te.apply_pending_updates()
    eager.zero_grad(set_to_none=True)
    comp.zero_grad(set_to_none=True)
    for i in range(args.steps):
        scale = 10.0 ** (i % 3 - 1)  # magnitudes change: the scales move
        x, dy = rand(scale), rand()
        y_e, dx_e = run_net(fwd_e, x, dy)
        sync(dev)
        t = time.perf_counter()
        y_c, dx_c = run_net(fwd_c, x, dy)
        sync(dev)
        first_steps.append(time.perf_counter() - t)
        te.apply_pending_updates()  # a compiled step leaves its backward update pending
        rec = {"step": i, "input_scale": scale, "compiled_step_s": round(first_steps[-1], 4),
               "frame_count": counter.frame_count}
        compare_step(rec, (y_e, dx_e, eager), (y_c, dx_c, comp),
                     close=lambda label: bias_rtol(dtype) if label.endswith("bias") else None)
        all_ok &= rec["ok"]
        steps.append(rec)
        eager.zero_grad(set_to_none=True)
        comp.zero_grad(set_to_none=True)
    frames = [s["frame_count"] for s in steps]
    res = {"steps": steps, "bit_identical_all_steps": all_ok, "frame_count_per_step": frames,
           "no_recompile_after_step_2": len(set(frames[2:])) <= 1}
    return res, (eager, comp, fwd_e, fwd_c, rand, first_steps, counter)


def run_net(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def check_compile(recipe_name, ccfg, dev, args, remaining):
    import torch._dynamo

    torch._dynamo.reset()
    recipe = make_recipe(recipe_name)
    hidden, tokens, dtype = ccfg["hidden"], ccfg["tokens"], ccfg["dtype"]
    out = {"config": {k: str(v) for k, v in ccfg.items()}, "recipe": recipe_text(recipe), "backend": args.backend,
           "bias_grad_rtol": bias_rtol(dtype), "model": "te.Linear -> relu -> te.Linear, no optimizer"}
    res, (eager, comp, fwd_e, fwd_c, rand, first_steps, counter) = compile_side_by_side(
        recipe, ccfg, dev, args, args.backend)
    out.update(res)
    out["ok"] = res["bit_identical_all_steps"] and res["no_recompile_after_step_2"]

    iters = args.iters if remaining() > 30 else max(3, args.iters // 4)
    x, dy = rand(), rand()
    timing = {}
    for name, fn, model in (("eager_fp8", fwd_e, eager), ("compiled_fp8", fwd_c, comp)):
        def step(fn=fn, model=model):
            run_net(fn, x, dy)
            model.zero_grad(set_to_none=True)
        timing[name] = time_step(step, dev, args.warmup, iters)
    steady = timing["compiled_fp8"]["median_ms"] / 1e3
    out["compile_s"] = round(sum(first_steps[:2]) - 2 * steady, 3)  # the cold start compiles up to twice
    out["compile_note"] = "first two compiled steps' wall time less two steady steps"
    timing["compiled_speedup_vs_eager"] = round(timing["eager_fp8"]["median_ms"] / steady / 1e3, 3)
    out["timing"] = timing
    if dev.type == "cuda":
        out["tflops_compiled_fp8"] = round(6 * tokens * hidden * hidden * 2 / steady / 1e12, 1)
    out["frame_count_after_timing"] = counter.frame_count

    # diagnosis of a mismatch (or --diagnose): the same steps under aot_eager (eager's aten ops, no codegen)
    if args.backend != "aot_eager" and (args.diagnose or not res["bit_identical_all_steps"]):
        if remaining() > 25:
            del eager, comp, fwd_e, fwd_c
            torch._dynamo.reset()
            t = time.perf_counter()
            diag, _ = compile_side_by_side(recipe, ccfg, dev, args, "aot_eager")
            bad = [s for s in diag["steps"] if not s["ok"]]
            out["diagnostic_aot_eager"] = {
                "bit_identical_all_steps": diag["bit_identical_all_steps"],
                "frame_count_per_step": diag["frame_count_per_step"],
                "first_bad_step": bad[0] if bad else None, "elapsed_s": round(time.perf_counter() - t, 2)}
        else:
            out["diagnostic_aot_eager"] = {"skipped": "budget"}
    return out


def check_compile_bf16(ccfg, dev, args, remaining):
    import torch._dynamo

    torch._dynamo.reset()
    hidden, tokens, dtype = ccfg["hidden"], ccfg["tokens"], ccfg["dtype"]
    eager, comp = make_net(hidden, dev, dtype, plain=True), make_net(hidden, dev, dtype, plain=True)
    fwd_c = torch.compile(comp, fullgraph=True, backend=args.backend, dynamic=False)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    dy = torch.randn(tokens, hidden, device=dev, dtype=dtype)

    def make(fn, model):
        def step():
            xx = x.detach().clone().requires_grad_()
            fn(xx).backward(dy)
            model.zero_grad(set_to_none=True)
        return step

    out = {"config": {k: str(v) for k, v in ccfg.items()}, "backend": args.backend}
    sc = make(fwd_c, comp)
    sync(dev)
    t = time.perf_counter()
    sc()
    sync(dev)
    first = time.perf_counter() - t
    iters = args.iters if remaining() > 20 else max(3, args.iters // 4)
    timing = {"eager_bf16": time_step(make(eager, eager), dev, args.warmup, iters),
              "compiled_bf16": time_step(sc, dev, args.warmup, iters)}
    out["compile_s"] = round(first - timing["compiled_bf16"]["median_ms"] / 1e3, 3)
    out["timing"] = timing
    if dev.type == "cuda":
        out["tflops_compiled_bf16"] = round(6 * tokens * hidden * hidden * 2 /
                                            (timing["compiled_bf16"]["median_ms"] / 1e3) / 1e12, 1)
    out["ok"] = True
    return out


# ---- main ---------------------------------------------------------------------------------------------------------

def summary_line(name, r):
    if r.get("skipped"):
        return f"{name}: SKIPPED ({r.get('reason')})"
    if "error" in r and not r.get("ok"):
        lines = [ln for ln in r['error'].strip().splitlines() if "Error" in ln or "Unsupported" in ln]
        return f"{name}: ERROR {(lines or r['error'].strip().splitlines())[-1][:300]}"
    parts = [f"{name}: {'OK' if r.get('ok') else 'FAIL'}"]
    if "bit_identical_all_steps" in r:
        parts.append(f"bit_identical={r['bit_identical_all_steps']}")
        bad = [s["step"] for s in r.get("steps", []) if not s["ok"]]
        if bad:
            first = next(s for s in r["steps"] if not s["ok"])
            mm = {k: first[k]["mismatches"] for k in ("output", "input_grad", "param_grads", "states")
                  if not first[k]["equal"]}
            parts.append(f"bad_steps={bad} first={json.dumps(mm, default=str)[:300]}")
    if "control_eager_repeat" in r:
        parts.append(f"eager_repeatable={r['control_eager_repeat']['equal']}")
    if "capture_left_states_unchanged" in r:
        parts.append(f"capture_states_unchanged={r['capture_left_states_unchanged']['equal']}")
    if "diagnostic_aot_eager" in r:
        parts.append(f"aot_eager_bit_identical={r['diagnostic_aot_eager'].get('bit_identical_all_steps')}")
    if "frame_count_per_step" in r:
        parts.append(f"frames={r['frame_count_per_step']}")
    if "compile_s" in r:
        parts.append(f"compile_s={r['compile_s']}")
    for k, v in r.get("timing", {}).items():
        parts.append(f"{k}={v['median_ms']}ms" if isinstance(v, dict) else f"{k}={v}")
    return " ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; later checks are skipped once spent")
    ap.add_argument("--steps", type=int, default=4, help="side-by-side training steps compared bit for bit")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 20 on cuda, 5 on cpu)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on cuda, 1 on cpu)")
    ap.add_argument("--layers", type=int, default=None, help="TransformerLayers in the graph stack (cuda: 4)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend for the compile checks")
    ap.add_argument("--diagnose", action="store_true",
                    help="also rerun the compile equality under aot_eager when inductor matched (it always does on a "
                         "mismatch, budget permitting)")
    ap.add_argument("--only", default="", help="comma-separated check names to run (default all)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    args.iters = args.iters or (20 if cuda else 5)
    args.warmup = args.warmup or (3 if cuda else 1)
    if cuda:
        gcfg = dict(layers=args.layers or 4, hidden=1024, ffn=4096, heads=16, seq=512, batch=2, dtype=torch.bfloat16)
        ccfg = dict(tokens=8192, hidden=4096, dtype=torch.bfloat16)
    else:
        gcfg = dict(layers=args.layers or 2, hidden=32, ffn=64, heads=2, seq=8, batch=2, dtype=torch.bfloat16)
        ccfg = dict(tokens=64, hidden=64, dtype=torch.bfloat16)

    meta = RESULT["meta"]
    meta.update(script="tools/gpu/check_graphs_compile.py", argv=sys.argv[1:], device=str(dev),
                torch=torch.__version__, python=platform.python_version(), budget_s=args.budget,
                started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        meta["triton"] = f"not importable: {type(e).__name__}"
    if cuda:
        meta["device_name"] = torch.cuda.get_device_name(dev)
        meta["capability"] = list(torch.cuda.get_device_capability(dev))
        meta["cuda"] = torch.version.cuda
    else:
        meta["device_name"] = platform.processor() or "cpu"
        meta["threads"] = torch.get_num_threads()
    write(args.out)

    def remaining():
        return args.budget - (time.perf_counter() - T0)

    checks = [
        ("graphs_current", lambda: check_graphs("current", gcfg, dev, args, remaining)),
        ("graphs_delayed", lambda: check_graphs("delayed", gcfg, dev, args, remaining)),
        ("graphs_bf16_reference", lambda: check_graphs_bf16(gcfg, dev, args, remaining)),
        ("compile_current", lambda: check_compile("current", ccfg, dev, args, remaining)),
        ("compile_delayed", lambda: check_compile("delayed", ccfg, dev, args, remaining)),
        ("compile_bf16_reference", lambda: check_compile_bf16(ccfg, dev, args, remaining)),
    ]
    only = {s for s in args.only.split(",") if s}
    for name, fn in checks:
        if only and name not in only:
            continue
        if remaining() <= 0:
            r = {"ok": False, "skipped": True, "reason": f"budget {args.budget}s spent"}
        else:
            t = time.perf_counter()
            try:
                r = fn()
            except Exception:  # noqa: BLE001
                r = {"ok": False, "error": tb()}
            r["elapsed_s"] = round(time.perf_counter() - t, 2)
            if cuda:
                r["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
                torch.cuda.reset_peak_memory_stats(dev)
        RESULT["checks"][name] = r
        write(args.out)
        log(summary_line(name, r))
        if cuda:
            torch.cuda.empty_cache()
    ok = [n for n, r in RESULT["checks"].items() if r.get("ok")]
    RESULT["summary"] = {"ok": ok, "not_ok": [n for n in RESULT["checks"] if n not in ok],
                         "total_s": round(time.perf_counter() - T0, 2)}
    write(args.out)
    log(f"done: {len(ok)}/{len(RESULT['checks'])} ok, {RESULT['summary']['total_s']}s -> {args.out}")


if __name__ == "__main__":
    main()
