"""`fp8kit bench --memory`: the memory of a small GPT (fp8kit.demo's model) trained with FP8 weights
(`quantized_model_init`) against bf16 weights, both with FP8 compute and `FusedAdam(master_weights=True)`.

What is measured, per variant:
- Parameters, gradients, optimizer states: bytes of the tensors themselves, counted exactly (a Float8Tensor counts its
  FP8 bytes, its float32 scale_inv and its transposed bytes when it has them).
- Saved for backward: bytes of the distinct tensors autograd saves in one forward (`saved_tensors_hooks`).
- Step peak: the most memory live at any moment of one training step (forward, backward, optimizer step,
  zero_grad). On a GPU: `torch.cuda.max_memory_allocated()` (everything allocated on the device). On a CPU: the
  parameters, optimizer states and batch live before the step (counted as above), plus the largest excess of the
  bytes the CPU allocator handed out over those it took back during the step, from torch's profiler memory
  timeline (`profile_memory=True`; every allocation and free, attributed by the profiler). CPU numbers include what
  the FP8 emulation allocates (FP8 operands widened to bf16 / float32 for the GEMMs), which a GPU does not.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

import fp8kit
import fp8kit.pytorch as te
from fp8kit.demo.model import GPT, GPTConfig
from fp8kit.pytorch.fp8_weights import default_dtype as _default_dtype
from fp8kit.pytorch.tensor.float8_tensor import Float8Tensor
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

__all__ = ["tensor_bytes", "cpu_peak_excess", "measure", "run_memory_bench", "format_memory_report", "CONFIG",
           "QUICK_CONFIG"]

CONFIG = dict(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_embd=256, batch=8)
QUICK_CONFIG = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=64, batch=2)
VARIANTS = {  # name: (FP8 weights?, recipe)
    "bf16 weights": (False, Float8CurrentScaling()),
    "FP8 weights (current)": (True, Float8CurrentScaling()),
    "FP8 weights (delayed)": (True, DelayedScaling(amax_history_len=16)),
}


def tensor_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes a tensor holds: FP8 bytes + scale_inv (+ transpose) for a Float8Tensor, numel * element size else."""
    if t is None:
        return 0
    if isinstance(t, Float8Tensor):
        return sum(x.numel() * x.element_size() for x in (t._data, t.scale_inv, t._transpose) if x is not None)
    return t.numel() * t.element_size()


def _build(fp8_weights: bool, recipe, cfg: dict, device: torch.device):
    torch.manual_seed(0)
    gpt_cfg = GPTConfig(**{k: v for k, v in cfg.items() if k != "batch"})
    with _default_dtype(torch.bfloat16), torch.device(device), \
            te.quantized_model_init(enabled=fp8_weights, recipe=recipe):
        model = GPT(gpt_cfg)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    return model, opt


def _step(model, opt, recipe, idx, targets) -> None:
    with te.autocast(recipe=recipe):
        _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _saved_and_grad_bytes(model, recipe, idx, targets):
    """(bytes of the distinct tensors saved for backward in one forward, bytes of the gradients it produces)."""
    seen: Dict[tuple, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            inner = t._data if isinstance(t, Float8Tensor) else t
            seen[(inner.untyped_storage().data_ptr(), inner.dtype, tuple(inner.shape))] = tensor_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), te.autocast(recipe=recipe):
        _, loss = model(idx, targets)
    loss.backward()
    grads = sum(tensor_bytes(p.grad) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), grads


def cpu_peak_excess(fn) -> int:
    """The largest excess of bytes the CPU allocator handed out over bytes it took back while `fn()` ran (torch
    profiler's memory timeline: every allocation and free)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    timeline = prof._memory_profile().timeline  # (time, action, (key, version), bytes), in time order
    current = peak = 0
    for _, action, _, size in timeline:
        if action.name == "CREATE":
            current += size
        elif action.name == "DESTROY":
            current -= size
        peak = max(peak, current)
    return peak


def measure(name: str, cfg: dict, device: torch.device) -> dict:
    """One variant's row (bytes)."""
    fp8_weights, recipe = VARIANTS[name]
    model, opt = _build(fp8_weights, recipe, cfg, device)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["block_size"]), generator=g).to(device)
    targets = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["block_size"]), generator=g).to(device)
    for _ in range(2):  # optimizer states and FP8 states exist from here on
        _step(model, opt, recipe, idx, targets)
    linear_weights = [m.weight for m in model.modules() if isinstance(m, te.Linear)]
    linear_ids = {id(p) for p in linear_weights}
    row = {
        "variant": name,
        "linear_weight_bytes": sum(tensor_bytes(p) for p in linear_weights),
        "other_param_bytes": sum(tensor_bytes(p) for p in model.parameters() if id(p) not in linear_ids),
        "optimizer_state_bytes": sum(tensor_bytes(v) for s in opt.state.values() for v in s.values()
                                     if isinstance(v, torch.Tensor)),
    }
    row["saved_for_backward_bytes"], row["grad_bytes"] = _saved_and_grad_bytes(model, recipe, idx, targets)
    row["param_bytes"] = row["linear_weight_bytes"] + row["other_param_bytes"]
    persistent = row["param_bytes"] + row["optimizer_state_bytes"] + tensor_bytes(idx) + tensor_bytes(targets)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, opt, recipe, idx, targets)
        torch.cuda.synchronize(device)
        row["step_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["method"] = "torch.cuda.max_memory_allocated"
    else:
        row["step_peak_bytes"] = persistent + cpu_peak_excess(lambda: _step(model, opt, recipe, idx, targets))
        row["method"] = "persistent bytes + torch.profiler memory timeline"
    return row


def run_memory_bench(device: str = "cpu", quick: bool = False, variants: Optional[List[str]] = None) -> dict:
    """The variants (all by default; the first is the baseline, "bf16 weights"); returns the report dict (what
    `--json` writes)."""
    dev = torch.device(device)
    cfg = QUICK_CONFIG if quick else CONFIG
    names = list(VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names or names[0] != "bf16 weights":
        raise ValueError(f"variants must start with 'bf16 weights' and name only {list(VARIANTS)}, got {variants!r}")
    rows: List[dict] = [measure(name, cfg, dev) for name in names]
    base = rows[0]
    for r in rows:
        for key in ("linear_weight_bytes", "param_bytes", "step_peak_bytes"):
            r[key.replace("_bytes", "_vs_bf16")] = r[key] / base[key]
    return {"fp8kit_version": fp8kit.__version__, "torch_version": torch.__version__, "device": dev.type,
            "config": cfg, "rows": rows}


def format_memory_report(report: dict) -> str:
    cfg = report["config"]
    mib = 1 << 20
    lines = [f"fp8kit {report['fp8kit_version']} memory on {report['device']}, torch {report['torch_version']}: GPT "
             f"{cfg['n_layer']} layers, n_embd {cfg['n_embd']}, block {cfg['block_size']}, vocab {cfg['vocab_size']}, "
             f"batch {cfg['batch']}; FP8 compute and FusedAdam(master_weights=True) in every variant", "",
             f"{'variant':<24} {'Linear W':>10} {'params':>10} {'grads':>10} {'opt state':>10} {'saved':>10} "
             f"{'step peak':>10} {'W vs bf16':>9} {'peak vs bf16':>12}  (MiB)"]
    for r in report["rows"]:
        lines.append(f"{r['variant']:<24} {r['linear_weight_bytes'] / mib:>10.3f} {r['param_bytes'] / mib:>10.3f} "
                     f"{r['grad_bytes'] / mib:>10.3f} {r['optimizer_state_bytes'] / mib:>10.3f} "
                     f"{r['saved_for_backward_bytes'] / mib:>10.3f} {r['step_peak_bytes'] / mib:>10.3f} "
                     f"{r['linear_weight_vs_bf16']:>8.3f}x {r['step_peak_vs_bf16']:>11.3f}x")
    lines.append(f"step peak: {report['rows'][0]['method']}")
    return "\n".join(lines)
