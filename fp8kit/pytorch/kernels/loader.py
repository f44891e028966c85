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


def kernel_module(interpret: bool):
    """The kernel module `triton_fp8`, loaded with Triton's interpreter on (`interpret=True`, for CPU tensors) or
    off (compiled, for CUDA tensors), whatever `TRITON_INTERPRET` says now. Each variant is loaded once."""
    interpret = bool(interpret)
    with _lock:
        mod = _modules.get(interpret)
        if mod is not None:
            return mod
        name = f"{__package__}._triton_fp8_{'interpreted' if interpret else 'compiled'}"
        path = os.path.join(os.path.dirname(__file__), "triton_fp8.py")
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
        _modules[interpret] = mod
        return mod
