"""Launching the Triton kernels: the kernel module for a device, the device guard, launch observers, and the
argument checks the host functions share. Imports torch only.

Meta tensors: a launch on the `meta` device validates and allocates like any other but runs nothing (meta tensors
have no data). That is how the tests walk the accelerator path on a CPU (tests/test_cuda_path.py).
"""

from __future__ import annotations

import contextlib
from typing import List, NamedTuple, Sequence, Tuple

import torch

from .loader import interpreter_on, kernel_module

FP8_INFO = {torch.float8_e4m3fn: (448.0, True), torch.float8_e5m2: (57344.0, False)}  # dtype: (max, is E4M3)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Launch(NamedTuple):
    """One kernel launch as `observe_launches` records it: the kernel's name, its grid, the device, and the tensors
    it reads and writes (full tensors, as the host function passed them)."""

    kernel: str
    grid: Tuple[int, ...]
    device: torch.device
    reads: Tuple[torch.Tensor, ...]
    writes: Tuple[torch.Tensor, ...]


_observers: List[list] = []
_NO_SWITCH = contextlib.nullcontext()


@contextlib.contextmanager
def observe_launches():
    """Record every kernel launch made in this scope (on any device, meta included); yields the list of `Launch`
    records, which grows as kernels are launched."""
    records: list = []
    _observers.append(records)
    try:
        yield records
    finally:
        _observers.remove(records)


def module_for(device: torch.device, file: str = "triton_fp8"):
    """The kernel module `file` that runs on `device`: compiled for CUDA, interpreted for CPU (needs
    TRITON_INTERPRET=1)."""
    if device.type == "cuda":
        return kernel_module(False, file)
    if device.type == "cpu":
        if not interpreter_on():
            raise RuntimeError("fp8kit Triton kernels run on CPU tensors only in Triton's interpreter: set "
                               "TRITON_INTERPRET=1")
        return kernel_module(True, file)
    raise RuntimeError(f"fp8kit Triton kernels: unsupported device {device}")


_CAPABILITY: dict = {}  # CUDA device index -> compute capability (asked once)


def cuda_capability(device: torch.device) -> tuple:
    """The compute capability (major, minor) of CUDA `device` (the current device when it has no index), asked of
    torch once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _CAPABILITY.get(index)
    if found is None:
        found = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return found


_KERNELS: dict = {}  # (file, kernel name) -> the compiled Triton function for CUDA (looked up once)


def _kernel(device: torch.device, file: str, kernel: str):
    if device.type != "cuda":  # the interpreter's module: looked up each time (TRITON_INTERPRET is read then)
        return getattr(module_for(device, file), kernel)
    key = (file, kernel)
    fn = _KERNELS.get(key)
    if fn is None:
        fn = _KERNELS[key] = getattr(module_for(device, file), kernel)
    return fn


def _context(device: torch.device):
    """CUDA: make `device` current for the launch (Triton launches on the current device and its current stream),
    unless it is already (the usual case: no device switch, no context manager to enter). CPU: the interpreter
    computes in NumPy, which warns on the divisions by 0 and overflows the kernels handle."""
    if device.type == "cuda":
        if device.index is None or device.index == torch.cuda.current_device():
            return _NO_SWITCH
        return torch.cuda.device(device)
    if device.type == "cpu":
        import numpy as np

        return np.errstate(divide="ignore", over="ignore", invalid="ignore")
    return contextlib.nullcontext()


def launch(kernel: str, grid: Tuple[int, ...], device: torch.device, args: Sequence, constexprs: dict,
           reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = (), file: str = "triton_fp8") -> None:
    """Launch `kernel` (a name in the kernel module `file`) on `grid` with `args` and `constexprs`, on `device` (made
    current for the launch). `reads`/`writes` name the large tensors it touches, for `observe_launches`. On the
    meta device nothing runs."""
    if _observers:
        record = Launch(kernel, tuple(grid), device, tuple(reads), tuple(writes))
        for records in _observers:
            records.append(record)
    if device.type == "meta":
        return
    fn = _kernel(device, file, kernel)
    if device.type == "cpu":  # the interpreter reads tensors through NumPy, which refuses ones that require grad
        args = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
    with _context(device):
        fn[tuple(grid)](*args, **constexprs)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for non-negative ints."""
    return -(-a // b)


def check_input(x, where: str) -> Tuple[int, int]:
    """(M, N) of `x` seen as a row-major 2-D [prod(shape[:-1]), shape[-1]] (a 0-d tensor is [1, 1]); TypeError or
    ValueError naming the problem for anything the kernels cannot take."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{where}: x must be a float32/bfloat16/float16 tensor, got dtype {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{where}: x must be contiguous, got shape {tuple(x.shape)} with strides {x.stride()}")
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


def check_scalar(t, x: torch.Tensor, name: str, where: str) -> None:
    """`t` must be a float32 tensor with one element on x's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a float32 tensor with one element on {x.device}, got "
                        f"{type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device != x.device:
        raise TypeError(f"{where}: {name} must be a float32 tensor with one element on {x.device}, got dtype "
                        f"{t.dtype}, shape {tuple(t.shape)} on {t.device}")


def fp8_info(fp8_dtype, where: str) -> Tuple[float, bool]:
    """(fp8_max, is_e4m3) of an FP8 dtype, or a TypeError naming it."""
    if fp8_dtype not in FP8_INFO:
        raise TypeError(f"{where}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    return FP8_INFO[fp8_dtype]
