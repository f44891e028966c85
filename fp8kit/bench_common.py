"""What the benchmarks and the command line share: the default shapes and recipes, the timer, interleaved rounds,
the fixed data of a Linear step, and the parsing of `--device` and positive integers.

`fp8kit.cli`, `fp8kit.bench` and `fp8kit.bench_compile` import this module; it imports none of them.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fp8kit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

SHAPES = [(16, 64, 64), (1024, 512, 512), (4096, 1024, 1024)]
BASELINE = "torch bf16"
CURRENT = Float8CurrentScaling(fp8_format=Format.HYBRID)
DELAYED = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
MXFP8 = MXFP8BlockScaling()
BLOCK = Float8BlockScaling()
NVFP4 = NVFP4BlockScaling()


# CPU flags that say whether bf16 matrix products run natively (AVX-512 BF16 dot products, AMX tiles)
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def device_description(dev: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """What the reports print as the device: the GPU's name, or for a CPU the thread count, the model name and the
    native-BF16 flags present (from `cpuinfo` where it exists, else `platform.processor()`), as `lscpu` shows
    them."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    model, flags = platform.processor() or "unknown CPU", set()
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    native = [flag for flag in _BF16_FLAGS if flag in flags]
    return f"{torch.get_num_threads()} threads, {model}, " + (" ".join(native) if native else "no native BF16 flags")


def cpu_kernels_state() -> str:
    """Whether fp8kit's CPU kernels (fp8kit.pytorch.cpu_kernels) run the host path's casts, for the reports."""
    from fp8kit.pytorch import cpu_kernels

    return "on" if cpu_kernels.available() else f"off ({cpu_kernels.reason() or 'switched off'})"


class Timer:
    """Times `fn` run `iters` times: CUDA events on a GPU, perf_counter elsewhere. Returns ms per iteration."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None], iters: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters


def _data(shape, device):
    m, k, n = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
    return x, dy


def _iterations(fn, timer: Timer, target_ms: float) -> int:
    once = timer(fn, 1)
    return max(1, min(1000, int(target_ms / max(once, 1e-3))))


def interleaved(steps: Dict[str, Callable[[], None]], timer: Timer, rounds: int,
                target_ms: float) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Time every step in `rounds` interleaved rounds (the order rotates every round), each sample a batch of
    about `target_ms` of iterations. Returns (ms per iteration of every sample, iterations per sample) by name."""
    names = list(steps)
    iters = {n: _iterations(steps[n], timer, target_ms) for n in names}
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            samples[n].append(timer(steps[n], iters[n]))
    return samples, iters


def positive_int(text: str) -> int:
    """A command-line positive integer (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def device_argument(parser: argparse.ArgumentParser, text: str) -> str:
    """`--device` as a torch device string ("auto" resolved); a bad or unavailable device is a usage error."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"argument --device: unknown device {text!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected auto, cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {text} requested but CUDA is not available")
    return str(device)


def run_settings(device: str, quick: bool, rounds: Optional[int], shapes: Optional[Sequence[Tuple[int, int, int]]],
                 quick_shapes: Sequence[Tuple[int, int, int]]):
    """(torch.device, rounds, target ms per sample, shapes) of a run: "auto" resolved, 3 rounds of 2 ms samples
    with `quick` (else 9 of 40 ms), the given shapes or the defaults."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rounds = rounds or (3 if quick else 9)
    target_ms = 2.0 if quick else 40.0
    return torch.device(device), rounds, target_ms, list(shapes or (quick_shapes if quick else SHAPES))
