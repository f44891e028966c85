"""`fp8kit demo`: train the demo GPT once per precision and report (table, results.json, figures)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import List, Optional, TextIO

import torch

import fp8kit
from fp8kit.pytorch import stats_to_csv

from . import plots
from .data import Corpus, load_corpus
from .te_model import build_model
from .train import TrainConfig, train_one


def results_table(runs: List[dict]) -> str:
    """Final losses, throughput and wall time per run; losses relative to the bf16 run when there is one."""
    base = next((r for r in runs if r["recipe"] == "bf16"), None)
    w = max([8] + [len(r["recipe"]) for r in runs])
    lines = [f"{'recipe':<{w}} {'train loss':>10} {'val loss':>9} {'vs bf16':>8} {'tokens/s':>10} {'wall s':>7}"]
    for r in runs:
        rel = "" if base is None or r is base else f"{r['final_val_loss'] / base['final_val_loss'] - 1:+.2%}"
        lines.append(f"{r['recipe']:<{w}} {r['final_train_loss']:>10.4f} {r['final_val_loss']:>9.4f} {rel:>8} "
                     f"{r['tokens_per_s']:>10,.0f} {r['wall_s']:>7.1f}")
    return "\n".join(lines)


def stats_summary(rows: List[dict]) -> str:
    """Per tensor role: the amax range over modules, and the module with the most saturation / underflow."""
    lines = [f"  {'role':<11} {'fmt':<4} {'amax min..max':>19} {'max saturated':>28} {'max underflow':>28}"]
    for role in ("input", "weight", "grad_output"):
        sel = [r for r in rows if r["role"].split(".")[-1] == role]  # LayerNormMLP's roles are "fc1.input", ...
        if not sel:
            continue
        sat = max(sel, key=lambda r: r["saturated"])
        und = max(sel, key=lambda r: r["underflow"])
        amaxes = [r["amax"] for r in sel]
        lines.append(f"  {role:<11} {sel[0]['fp8_dtype']:<4} {min(amaxes):>9.3g}..{max(amaxes):<9.3g} "
                     f"{sat['saturated']:>8.3%} {sat['module']:<19} {und['underflow']:>8.3%} {und['module']:<19}")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)  # never leave a half-written results.json behind


def run_demo(cfg: TrainConfig, recipes: List[str], out: str, corpus: Optional[Corpus] = None,
             progress: bool = True, stream: Optional[TextIO] = None) -> dict:
    """Train once per name in `recipes` and write `out/results.json` (after every run), `out/loss.png`,
    `out/delayed_scaling.png` and `out/stats_<recipe>.csv`. Returns the results dict. A KeyboardInterrupt
    propagates after the finished runs are on disk."""
    os.makedirs(out, exist_ok=True)
    if corpus is None:
        corpus = load_corpus()
    stream = stream if stream is not None else sys.stdout
    say = lambda *a: print(*a, file=stream, flush=True)
    n_params = build_model(cfg.model, cfg.arch).num_params()
    blocks = " of te.TransformerLayer blocks" if cfg.arch == "te" else ""
    say(f"fp8kit demo: GPT{blocks} {cfg.model.n_layer} layers, n_embd {cfg.model.n_embd}, {cfg.model.n_head} heads, "
        f"block {cfg.model.block_size}, batch {cfg.batch_size} ({n_params / 1e6:.2f}M parameters), "
        f"{cfg.steps} steps on {cfg.device}")
    say(f"corpus: {corpus.describe()}")
    if cfg.compile:
        say(f"torch.compile (backend {cfg.compile_backend}): forward + loss as one fullgraph graph per run, backward "
            f"by AOT autograd, optimizer eager; the compiling steps are left out of tokens/s"
            + ("; FP8 statistics off (they count casts in Python)" if cfg.stats else ""))
    results = {
        "fp8kit_version": fp8kit.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": cfg.device,
        "device_name": _device_name(cfg.device),
        "threads": torch.get_num_threads(),
        "config": cfg.as_dict(),
        "corpus": {"source": corpus.source, "files": corpus.files, "chars": corpus.chars, "sha256": corpus.sha256},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "complete": False,
        "runs": [],
    }
    json_path = os.path.join(out, "results.json")
    _write_json(json_path, results)
    try:
        for name in recipes:
            run = train_one(name, corpus, cfg, progress=progress)
            results["runs"].append(run)
            _write_json(json_path, results)
            compiled = f" (compiling {run['compile_s']:.1f} s)" if "compile_s" in run else ""
            say(f"{name}: train loss {run['final_train_loss']:.4f}, val loss {run['final_val_loss']:.4f}, "
                f"{run['tokens_per_s']:,.0f} tokens/s, {run['wall_s']:.1f} s{compiled}")
            if run["stats"]:
                csv_path = os.path.join(out, f"stats_{name}.csv")
                stats_to_csv(run["stats"], csv_path)
                say(f"  FP8 statistics of the last {cfg.steps % cfg.eval_interval or cfg.eval_interval} steps "
                    f"(all modules: {csv_path}):")
                say(stats_summary(run["stats"]))
    finally:
        _finish(results, cfg, out, say)
    results["complete"] = True
    _write_json(json_path, results)
    return results


def _finish(results: dict, cfg: TrainConfig, out: str, say) -> None:
    runs = results["runs"]
    if not runs:
        return
    say("")
    say(results_table(runs))
    if not plots.matplotlib_available():
        say("matplotlib is not installed: no figures (pip install matplotlib, or fp8kit[demo])")
        return
    title = (f"GPT {cfg.model.n_layer}x{cfg.model.n_embd}, {cfg.steps} steps, batch {cfg.batch_size}x"
             f"{cfg.model.block_size}, {results['device']}")
    written = [plots.plot_losses(runs, os.path.join(out, "loss.png"), title)]
    for run in runs:
        if "delayed_trace" in run:
            written.append(plots.plot_delayed_trace(run["delayed_trace"], os.path.join(out, "delayed_scaling.png")))
    say("wrote " + ", ".join([os.path.join(out, "results.json")] + written))
