"""Fused Triton kernels for the FP8 cast (+ transpose, amax, bias gradient) and the delayed-scaling update
(docs/kernels.md).

The kernels compute the same bytes as the torch path in `fp8kit.pytorch.cast` and `fp8kit.pytorch.state` (checked on
an H100: `pytest -m cuda`). They are ON by default for CUDA tensors (compute capability 8.9 or newer, Triton
importable) and off elsewhere. `FP8KIT_TRITON=0` (or `set_enabled(False)`) turns them off; `FP8KIT_TRITON=1` (or
`set_enabled(True)`) turns them on for every device where they are `available` (also the meta device and, with
`TRITON_INTERPRET=1`, CPU tensors). Dispatch goes through `on_for(device)`.

Triton is imported lazily: importing this package needs only torch. CUDA tensors run compiled kernels (compute
capability 8.9 or newer); CPU tensors run the same kernels in Triton's interpreter when `TRITON_INTERPRET=1` is set
(slow; meant for tests); meta tensors get their outputs allocated and nothing run (shape checks on a CPU). The
compiled and interpreted variants are separate module objects (`kernel_module`), so both can be used in one process.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from .cast_ops import (
    amax,
    cast,
    cast_amax,
    cast_transpose_amax,
    cast_transpose_dbias,
    current_cast,
    current_cast_transpose_dbias,
)
from .launch import Launch, cuda_capability, observe_launches
from .loader import TRUE_VALUES, interpreter_on, kernel_module
from .update_ops import update, update_tensors

__all__ = ["enabled", "set_enabled", "enabled_as", "refresh", "available", "use_for", "interpreter_on", "kernel_module",
           "cast_amax", "cast", "cast_transpose_amax", "cast_transpose_dbias", "amax", "current_cast",
           "current_cast_transpose_dbias",
           "update", "update_tensors", "observe_launches", "Launch", "on_for", "opted_in"]

_enabled: Optional[bool] = None  # None: follow FP8KIT_TRITON
_triton_ok: Optional[bool] = None


FALSE_VALUES = ("0", "false", "no", "off")


def _setting() -> Optional[bool]:
    """True / False when set (`set_enabled`, else `FP8KIT_TRITON`), None for the default (CUDA tensors only)."""
    if _enabled is not None:
        return _enabled
    value = os.environ.get("FP8KIT_TRITON", "").strip().lower()
    return True if value in TRUE_VALUES else False if value in FALSE_VALUES else None


def enabled() -> bool:
    """Whether fp8kit may use the Triton kernels: `set_enabled(...)` if called, else `FP8KIT_TRITON` ("1", "true",
    "yes", "on" / "0", "false", "no", "off"). Default True, for CUDA tensors only (`on_for`)."""
    return _setting() is not False


def set_enabled(flag: Optional[bool]) -> None:
    """Turn the kernels on (True: every device where `available`) or off (False); None goes back to reading
    `FP8KIT_TRITON` (unset: CUDA tensors only)."""
    global _enabled
    _enabled = None if flag is None else bool(flag)
    refresh()


def use_for(x: torch.Tensor) -> bool:
    """Whether the quantizers should cast `x` with the kernels: enabled, available on its device, and a
    contiguous tensor of a supported dtype. `enabled()` as of the last `refresh()` (the outermost autocast entry
    calls it), so that a cast reads no environment variable."""
    return _enabled_now[0] is not False and x.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and x.is_contiguous() and on_for(x.device)


def opted_in() -> bool:
    """Whether the kernels were turned on explicitly (`FP8KIT_TRITON=1` or `set_enabled(True)`) as of the last
    `refresh()`: the switch of kernels that have not run on a GPU yet (the block GEMMs), which the CUDA default does
    not turn on."""
    return _enabled_now[0] is True


def on_for(device) -> bool:
    """Whether the kernels run for tensors of `device` now: the setting as of the last `refresh()` (default: CUDA
    devices only) and `available(device)`; never while torch.compile traces (the compiler fuses the torch path's
    operations itself, and a launch's device context is not traceable)."""
    setting = _enabled_now[0]
    if setting is False:
        return False
    if type(device) is not torch.device:
        device = torch.device(device)
    if setting is not True and device.type != "cuda":  # the default: CUDA tensors only
        return False
    return not torch.compiler.is_compiling() and available(device)


@contextlib.contextmanager
def enabled_as(flag: bool) -> Iterator[None]:
    """`set_enabled(flag)` in a scope; the setting before it (a flag, or following `FP8KIT_TRITON`) comes back."""
    before = _enabled
    set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(before)


_enabled_now: list = [None]  # _setting() when refresh() ran last


def refresh() -> None:
    """Take the setting now for the casts of the coming step (`use_for`, `on_for`)."""
    _enabled_now[0] = _setting()


def _triton_importable() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_ok = True
        except Exception:  # ImportError, or a broken install
            _triton_ok = False
    return _triton_ok


def available(device) -> bool:
    """Whether the kernels can run on tensors of `device` (a torch.device or string): Triton importable, and
    either a CUDA device of compute capability >= 8.9 (native FP8 conversions), or a CPU device with
    `TRITON_INTERPRET=1` set. Always True for the meta device, where a launch allocates its outputs and runs
    nothing (no Triton needed)."""
    device = torch.device(device)
    if device.type == "meta":
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        return cuda_capability(device) >= (8, 9) and _triton_importable()
    if device.type == "cpu":
        return interpreter_on() and _triton_importable()
    return False


refresh()
