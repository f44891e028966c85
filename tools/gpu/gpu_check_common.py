"""What the GPU check scripts share: the repository on sys.path, tracebacks for the JSON, device synchronisation,
bitwise comparison of tensors and of quantized tensors' fields, and a timed Linear step."""

from __future__ import annotations

import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

FIELDS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv", "_amax_rowwise",
          "_amax_columnwise", "_data", "_scale_inv", "_transpose")


def _tb() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-40:])


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of t's bytes on the CPU (bitwise comparison, NaN == NaN of the same pattern)."""
    t = t.detach().contiguous().cpu()
    if t.dtype.is_floating_point or t.dtype.itemsize == 1:
        size = t.element_size()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    return t


def _fields(q) -> dict:
    out = {}
    for name in FIELDS:
        v = getattr(q, name, None)
        if isinstance(v, torch.Tensor):
            out[name] = v
    return out


def compare_fields(a, b) -> list:
    """Mismatches between the tensor fields of quantized tensors a (CPU) and b (device), bit for bit."""
    fa, fb = _fields(a), _fields(b)
    bad = []
    if sorted(fa) != sorted(fb):
        bad.append({"fields": [sorted(fa), sorted(fb)]})
    if not fa:
        bad.append({"fields": "no tensor fields found"})
    for name in sorted(set(fa) & set(fb)):
        x, y = _bits(fa[name]), _bits(fb[name])
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append({"field": name, "shape": [list(x.shape), list(y.shape)], "dtype": [str(x.dtype), str(y.dtype)]})
            continue
        if not torch.equal(x, y):
            diff = (x != y).nonzero()
            first = tuple(diff[0].tolist())
            bad.append({"field": name, "n_diff": int(diff.shape[0]), "numel": x.numel(), "first_index": list(first),
                        "cpu_bits": int(x[first]), "dev_bits": int(y[first])})
    return bad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else num


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(_bits(a), _bits(b)))


def timed_steps(layer, x, dy, recipe, warmup: int, iters: int, sync):
    """A Linear training step (autocast with `recipe`, or none for None; forward, backward) as a function, run
    `warmup` times, then `iters` times timed: (step, host seconds per step with the launches asynchronous, wall
    seconds per step)."""
    import time

    import fp8kit.pytorch as te

    def step():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.backward(dy)

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    host = (time.perf_counter() - t0) / iters
    sync()
    return step, host, (time.perf_counter() - t0) / iters
