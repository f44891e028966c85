"""One training run of the demo GPT under one precision: "bf16", or an FP8 recipe on top of bf16.

Precision: the parameters and the optimizer state are float32 (master weights); the forward and backward passes
run under `torch.autocast(device, dtype=torch.bfloat16)` in every run. The "bf16" run stops there; the FP8 runs
add `fp8kit.pytorch.autocast(recipe=...)`, which makes every fp8kit Linear cast its bf16 operands to FP8 for its
three GEMMs. Embeddings, LayerNorms, attention (softmax included) and the output head are the same in all runs.

Every run starts from the same seed, hence the same initial weights, and sees the same batches in the same order.

With `TrainConfig.compile` the forward and loss of a training step run as one `torch.compile(fullgraph=True)` graph
(`forward_loss`): both autocasts are entered inside the compiled function, so fp8kit's delayed-scaling updates are
part of the graph. Its backward is compiled by AOT autograd; gradient clipping, the optimizer step and the
evaluations stay eager. A run starts from fresh torch.compile caches (`torch._dynamo.reset()`), so it compiles on
its first step (bf16, current scaling) or first two (delayed scaling: the first call registers the FP8 states);
those steps are timed apart (`compile_s`) and left out of `tokens_per_s`. After each compiled step the backward
amaxes it recorded are applied (`te.apply_pending_updates()`), so the FP8 states are those of the eager run at every
step. FP8 statistics are off: they count casts in Python, which a compiled graph cannot.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import torch

import fp8kit.pytorch as te
from fp8kit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

from .data import Batches, Corpus
from .model import GPT, GPTConfig
from .progress import Progress
from .te_model import build_model

RECIPES = {
    "bf16": None,
    "current": Float8CurrentScaling(fp8_format=Format.HYBRID),
    # The settings of Transformer Engine's own examples: a short history and its max.
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    # Block-scaled recipes, at Transformer Engine's defaults.
    "mxfp8": MXFP8BlockScaling(),
    "block": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
    # NVFP4 with one of its three components turned off, for an ablation.
    "nvfp4-nosr": NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4-norht": NVFP4BlockScaling(disable_rht=True),
    "nvfp4-no2d": NVFP4BlockScaling(disable_2d_quantization=True),
}
DEFAULT_RECIPES = ("bf16", "current", "delayed")
TRACKED_LAYER = "blocks.0.mlp.fc"  # whose delayed-scaling state is recorded at every step


@dataclass
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 250
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_batches: int = 8
    seed: int = 0
    device: str = "cpu"
    stats: bool = True
    compile: bool = False  # forward + loss under torch.compile(fullgraph=True); see the module docstring
    compile_backend: str = "inductor"
    arch: str = "plain"  # the model: "plain" (fp8kit Linears) or "te" (te.TransformerLayer blocks), see te_model.py

    def as_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.as_dict()
        return d


def precision(device_type: str, recipe) -> contextlib.ExitStack:
    """bf16 autocast, plus fp8kit's autocast with `recipe` unless it is None."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
    if recipe is not None:
        stack.enter_context(te.autocast(enabled=True, recipe=recipe))
    return stack


def forward_loss(model: torch.nn.Module, device_type: str, recipe):
    """`fn(x, y) -> loss`: the model's forward and loss in the run's precision (bf16 autocast, plus fp8kit's
    autocast with `recipe` unless it is None); both contexts are inside `fn`, so it compiles as one graph."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            if recipe is None:
                return model(x, y)[1]
            with te.autocast(enabled=True, recipe=recipe):
                return model(x, y)[1]
    return fn


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model: GPT, batches: Batches, n: int, device: torch.device, recipe) -> float:
    """Mean loss over the batches `0..n-1` of `batches` (a fixed set), in the run's precision."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(n):
        x, y = batches.get(i, device)
        with precision(device.type, recipe):
            _, loss = model(x, y)
        total += loss.item()
    model.train(was_training)
    return total / n


class DelayedTrace:
    """The newest amax and the scale of one module's delayed-scaling slots, after every step."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = module, name
        self.rows: Dict[str, List[float]] = {k: [] for k in (
            "amax_input", "amax_weight", "amax_grad_output", "scale_input", "scale_weight", "scale_grad_output")}

    def record(self) -> None:
        fwd, bwd = self.module.fp8_meta["scaling_fwd"], self.module.fp8_meta["scaling_bwd"]
        if fwd is None or bwd is None:
            return
        # The newest past amax is the last history row (the staging row 0 is empty after an update).
        values = torch.cat([fwd.amax_history[-1, :2], bwd.amax_history[-1, :1], fwd.scale[:2], bwd.scale[:1]])
        for key, v in zip(self.rows, values.tolist()):
            self.rows[key].append(v)

    def as_dict(self) -> dict:
        return {"module": self.name, "history_len": self.module.fp8_meta["scaling_fwd"].history_len, **self.rows}


def train_one(name: str, corpus: Corpus, cfg: TrainConfig, progress: bool = True) -> dict:
    """Train from scratch with the precision `name` (a key of RECIPES); returns the run's result dict."""
    recipe = RECIPES[name]
    device = torch.device(cfg.device)
    wall_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.arch).to(device)
    optimizer = make_optimizer(model, cfg)
    train_batches = Batches(corpus.train, cfg.batch_size, cfg.model.block_size, cfg.seed)
    # Fixed evaluation sets, disjoint in seed from the training order.
    eval_train = Batches(corpus.train, cfg.batch_size, cfg.model.block_size, cfg.seed + 7_777)
    eval_val = Batches(corpus.val, cfg.batch_size, cfg.model.block_size, cfg.seed + 7_777)
    stats_on = cfg.stats and recipe is not None and not cfg.compile
    step_loss = forward_loss(model, device.type, recipe)
    if cfg.compile:
        torch._dynamo.reset()  # this run's own compiles (and none of an earlier run's cache entries)
        step_loss = torch.compile(step_loss, fullgraph=True, backend=cfg.compile_backend, dynamic=False)
    compile_steps = min(2 if cfg.compile else 0, cfg.steps - 1)  # timed apart: they compile
    step_times: List[float] = []
    if stats_on:
        te.enable_stats(model)
    tracked = getattr(model, "tracked_layer", TRACKED_LAYER)
    trace = DelayedTrace(model.get_submodule(tracked), tracked) if isinstance(recipe, DelayedScaling) else None
    curves = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    bar = Progress(cfg.steps, name, enabled=progress)
    tokens_per_step = cfg.batch_size * cfg.model.block_size
    train_time = 0.0
    try:
        for step in range(cfg.steps):
            x, y = train_batches.get(step, device)
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg)
            loss = step_loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cfg.compile and recipe is not None:
                te.apply_pending_updates()  # the backward amaxes of the compiled step, as eager applies them
            loss_value = loss.item()  # synchronizes, so the timing below is complete on CUDA too
            step_times.append(time.perf_counter() - t0)
            if step >= compile_steps:
                train_time += step_times[-1]
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"{name}: the training loss became {loss_value} at step {step}")
            curves["step"].append(step)
            curves["train_loss"].append(loss_value)
            if trace is not None:
                trace.record()
            last = step == cfg.steps - 1
            if (step + 1) % cfg.eval_interval == 0 and not last:
                curves["val_step"].append(step + 1)
                curves["val_loss"].append(evaluate(model, eval_val, cfg.eval_batches, device, recipe))
                if stats_on:
                    te.reset_stats(model)  # report the training steps after the last evaluation only
            timed = step + 1 - compile_steps
            bar.update(step + 1, f"loss {loss_value:.3f}" + (f"  {tokens_per_step * timed / max(train_time, 1e-9):,.0f}"
                                                              " tokens/s" if timed > 0 else "  compiling"))
    finally:
        bar.close()
    stats_rows = te.stats(model) if stats_on else []
    final_val = evaluate(model, eval_val, cfg.eval_batches, device, recipe)
    curves["val_step"].append(cfg.steps)
    curves["val_loss"].append(final_val)
    result = {
        "recipe": name,
        "recipe_repr": repr(recipe) if recipe is not None else "torch.autocast(bfloat16)",
        "final_train_loss": evaluate(model, eval_train, cfg.eval_batches, device, recipe),
        "final_val_loss": final_val,
        "tokens_per_s": tokens_per_step * (cfg.steps - compile_steps) / train_time,
        "train_s": sum(step_times),
        "wall_s": time.perf_counter() - wall_start,
        "steps": cfg.steps,
        "curves": curves,
        "stats": stats_rows,
    }
    if cfg.compile:  # the compiling steps less as many steady ones (the median of the others)
        steady = statistics.median(step_times[compile_steps:])
        result["compile_s"] = max(0.0, sum(step_times[:compile_steps]) - compile_steps * steady)
    if trace is not None:
        result["delayed_trace"] = trace.as_dict()
    return result
