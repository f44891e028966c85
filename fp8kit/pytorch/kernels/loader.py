"""Loading the Triton kernel module `triton_fp8` (compiled or interpreted) and reading `TRITON_INTERPRET`.

The bottom of the kernels package: `launch.py` and the package's `__init__` import it; it imports neither.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

TRUE_VALUES = ("1", "true", "yes", "on")
_modules: dict = {}
_lock = threading.Lock()


def interpreter_on() -> bool:
    """Whether `TRITON_INTERPRET` is set to a true value in the environment (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_VALUES


KERNEL_FILES = ("triton_fp8", "triton_block_gemm")


def kernel_module(interpret: bool, file: str = "triton_fp8"):
    """The kernel module `file` (one of KERNEL_FILES: `triton_fp8`, the casts and updates; `triton_block_gemm`),
    loaded with Triton's interpreter on (`interpret=True`, for CPU tensors) or off (compiled, for CUDA tensors),
    whatever `TRITON_INTERPRET` says now. Each variant is loaded once."""
    interpret = bool(interpret)
    if file not in KERNEL_FILES:
        raise ValueError(f"kernel_module: unknown kernel file {file!r} (one of {KERNEL_FILES})")
    with _lock:
        mod = _modules.get((interpret, file))
        if mod is not None:
            return mod
        name = f"{__package__}._{file}_{'interpreted' if interpret else 'compiled'}"
        path = os.path.join(os.path.dirname(__file__), f"{file}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"  # read by triton.jit when it decorates
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        _modules[(interpret, file)] = mod
        return mod
