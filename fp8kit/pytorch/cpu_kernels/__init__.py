"""fp8kit's CPU kernels: the FP8 cast (bytes and the bf16 GEMM operand in one pass), the NaN-aware amax and the
widening of FP8 bytes, as vectorised C loops (fp8_cpu.c).

They are compiled once per machine, on first use, by the system C compiler (`$CC`, else `cc`) into
`$FP8KIT_CACHE_DIR` (default `~/.cache/fp8kit`, under `$XDG_CACHE_HOME` when set), named by a hash of the source,
the compiler, its flags and the CPU's feature flags, and called through ctypes (which releases the GIL). Nothing is
built at install time. Without a compiler, or with `FP8KIT_CPU_KERNELS=0`, `available()` is False and fp8kit uses
torch operations, which give the same bytes and values (docs/numerics.md, "The cast on a CPU"); `reason()` says why.
Only the CPU host path uses them (fp8kit.pytorch.host): the tensor path keeps the operation sequence a GPU runs.

The callers check shapes, dtypes and contiguity; these functions take contiguous CPU tensors as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from . import pool

__all__ = ["available", "takes", "reason", "switched", "cast", "cast_amax", "absmax", "widen", "count4",
           "count_nonzero", "delayed_update"]

ENV = "FP8KIT_CPU_KERNELS"
SOURCE = Path(__file__).with_name("fp8_cpu.c")
# -ffp-contract=off: the cast's multiply must round before the additions that follow it (no FMA); never
# -ffast-math, which would fold `(a + M) - M`.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")

_state: dict = {"lib": None, "tried": False, "reason": "", "on": True}
_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_INPUT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_P, _N, _F = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float


MIN_NUMEL = 1 << 10  # below this a call costs about what torch's few operations on the tensor cost


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels take `x`: a contiguous bf16, fp16 or float32 CPU tensor of at least MIN_NUMEL elements,
    the kernels available. The one test the host path's casts, amaxes and statistics make."""
    return x.dtype in _INPUT and x.numel() >= MIN_NUMEL and x.is_cpu and x.is_contiguous() \
        and _state["on"] and (_state["lib"] is not None or _library() is not None)


def available() -> bool:
    """Whether the kernels are built, loaded and switched on (builds them on the first call)."""
    return _state["on"] and _library() is not None


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """The kernels on or off in this scope (tests and benchmarks compare both paths; off: torch operations)."""
    old, _state["on"] = _state["on"], on
    try:
        yield
    finally:
        _state["on"] = old


def reason() -> str:
    """Why the kernels are unavailable ('' when they are, or before the first `available()`)."""
    return _state["reason"]


def _library():
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
            _state["reason"] = f"{ENV}=0"
        else:
            try:
                _state["lib"] = _declare(ctypes.CDLL(str(_build())))
            except _NoCompiler as error:  # expected on machines without one: documented, no warning
                _state["reason"] = str(error)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _state["reason"] = f"the CPU kernels could not be built or loaded: {error}"
                warnings.warn(f"fp8kit: {_state['reason']}; the CPU casts run as torch operations instead (the same "
                              f"results, slower). {ENV}=0 turns the kernels off.", RuntimeWarning, stacklevel=2)
    return _state["lib"]


class _NoCompiler(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("FP8KIT_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8kit"


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise _NoCompiler("no C compiler found (set CC, or install cc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
    name = f"fp8_cpu-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"fp8kit-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        if (folder / name).exists():
            return folder / name
        try:  # an unwritable cache directory: the temporary directory instead
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no writable directory for the CPU kernels ({_cache_dir()} nor the temporary directory)")
    target = folder / name
    errors = []
    for extra in (("-march=native",), ()):  # tuned for this CPU where the compiler knows it
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        run = subprocess.run([compiler, *FLAGS, *extra, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                             timeout=120)
        if run.returncode == 0:
            os.replace(tmp, target)  # atomic: processes building at once each install a whole library
            return target
        os.unlink(tmp)
        errors.append(run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"])
    raise RuntimeError(f"{compiler} failed: {errors}")


ABI = 4  # fp8_cpu.c's fp8kit_abi(): the signatures declared below


def _declare(lib):
    lib.fp8kit_abi.argtypes, lib.fp8kit_abi.restype = [], ctypes.c_int
    if lib.fp8kit_abi() != ABI:
        raise RuntimeError(f"the built library has interface {lib.fp8kit_abi()}, this fp8kit expects {ABI}")
    for fp8_dtype, fmt in _FORMAT.items():
        for dtype, src in _INPUT.items():
            fn = _CAST[(dtype, fp8_dtype)] = getattr(lib, f"fp8kit_cast_{src}_{fmt}")
            fn.argtypes, fn.restype = [_P, _N, _F, _P, _P, _P, _P], ctypes.c_int
        fn = _WIDEN[fp8_dtype] = getattr(lib, f"fp8kit_widen_{fmt}")
        fn.argtypes, fn.restype = [_P, _N, _P, _P], ctypes.c_int32
    for dtype, src in _INPUT.items():
        fn = _ABSMAX[dtype] = getattr(lib, f"fp8kit_absmax_{src}")
        fn.argtypes, fn.restype = [_P, _N, ctypes.POINTER(ctypes.c_int)], ctypes.c_uint64
    for width in ("u8", "u16"):
        getattr(lib, f"fp8kit_count4_{width}").argtypes = [_P, _N, _P, _P]
        getattr(lib, f"fp8kit_count4_{width}").restype = None
    for width in ("16", "32"):
        getattr(lib, f"fp8kit_nonzero_{width}").argtypes = [_P, _N]
        getattr(lib, f"fp8kit_nonzero_{width}").restype = ctypes.c_uint64
    lib.fp8kit_delayed_update.argtypes = [_P, _N, _N, _N, _P, _P, ctypes.c_int, ctypes.c_double, ctypes.c_double,
                                          ctypes.c_double, ctypes.c_int]
    lib.fp8kit_delayed_update.restype = ctypes.c_int
    return lib


# Large tensors are split across torch's intra-op thread count: a chunk per thread, the first on the calling thread,
# the others on a pool of Python threads (ctypes releases the GIL while the C loop runs). Below this many elements
# per chunk the hand-off costs more than the loop.
PARALLEL_MIN_CHUNK = 1 << 17
_SPLIT_MIN = 2 * PARALLEL_MIN_CHUNK  # below this one chunk whatever the thread count: the call made directly
_pool: dict = {"executor": None, "pid": None, "size": 0}
_CAST: dict = {}  # (input dtype, fp8 dtype) -> the declared C function (filled when the library loads)
_WIDEN: dict = {}  # fp8 dtype -> ...
_ABSMAX: dict = {}  # input dtype -> ...
_UNTRACKED = ((0, 0),)  # `_cast`'s parts without `track`


def _chunks(n: int):
    """(start, count) chunks of n elements, one per thread (starts aligned to 64 elements)."""
    k = min(torch.get_num_threads(), n // PARALLEL_MIN_CHUNK)
    if k <= 1:
        return [(0, n)]
    step = ((n + k - 1) // k + 63) // 64 * 64
    return [(start, min(step, n - start)) for start in range(0, n, step)]


def _run(calls):
    """Results of the zero-argument `calls`, the first run here, the others on the pool."""
    if len(calls) == 1:
        return [calls[0]()]
    executor = _pool["executor"]
    if executor is None or _pool["pid"] != os.getpid() or _pool["size"] < len(calls) - 1:
        from concurrent.futures import ThreadPoolExecutor  # a fork's child makes its own (threads do not fork)

        executor = ThreadPoolExecutor(max_workers=len(calls) - 1, thread_name_prefix="fp8kit-cpu")
        _pool.update(executor=executor, pid=os.getpid(), size=len(calls) - 1)
    futures = [executor.submit(call) for call in calls[1:]]
    first = calls[0]()
    return [first] + [f.result() for f in futures]


def _ptr(t: Optional[torch.Tensor], start: int):
    return None if t is None else t.data_ptr() + start * t.element_size()


def _base(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def cast(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, data: Optional[torch.Tensor],
         values: Optional[torch.Tensor]) -> bool:
    """Writes the FP8 bytes of `saturate(float32(x) * scale)` (a NaN: 0x7F) into `data` (uint8) and/or their values
    as bf16 into `values`, for a contiguous bf16, fp16 or float32 CPU x; `scale` a float32 value as a float. False
    (nothing written) where subnormals are flushed (`torch.set_flush_denormal(True)`): use torch then."""
    return _cast(x, scale, fp8_dtype, data, values, False) is not None


def cast_amax(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, data: Optional[torch.Tensor],
              values: Optional[torch.Tensor]) -> Optional[Tuple[float, bool]]:
    """`cast`, and in the same pass `absmax(x)` (the amax delayed scaling records); None where `cast` is False."""
    parts = _cast(x, scale, fp8_dtype, data, values, True)
    return None if parts is None else _amax_of(x.dtype, parts)


def _cast(x, scale, fp8_dtype, data, values, track: bool):
    """The chunks' (amax bits, NaN seen) (zeros without `track`), or None when the kernel refused."""
    fn = _CAST[(x.dtype, fp8_dtype)]
    n = x.numel()
    if n < _SPLIT_MIN:  # one chunk, on this thread: the kernel checks the thread's mode before it writes anything
        if not track:
            return None if fn(x.data_ptr(), n, scale, _base(data), _base(values), None, None) else _UNTRACKED
        bits, nan = ctypes.c_uint64(0), ctypes.c_int(0)
        rc = fn(x.data_ptr(), n, scale, _base(data), _base(values), ctypes.byref(bits), ctypes.byref(nan))
        return None if rc else [(bits.value, nan.value)]
    if fn(None, 0, scale, None, None, None, None) != 0:  # subnormals flushed on this thread (the pool's may differ)
        return None

    def part(start: int, count: int):
        bits, nan = ctypes.c_uint64(0), ctypes.c_int(0)
        rc = fn(_ptr(x, start), count, scale, _ptr(data, start), _ptr(values, start),
                ctypes.byref(bits) if track else None, ctypes.byref(nan) if track else None)
        return rc, bits.value, nan.value

    parts = _run([lambda start=start, count=count: part(start, count) for start, count in _chunks(x.numel())])
    return None if any(rc for rc, _, _ in parts) else [(bits, nan) for _, bits, nan in parts]


_U32, _F32, _U16, _F16 = struct.Struct("<I"), struct.Struct("<f"), struct.Struct("<H"), struct.Struct("<e")


def _amax_of(dtype: torch.dtype, parts) -> Tuple[float, bool]:
    """(the amax as a float, no NaN seen) from the chunks' (magnitude bits, NaN seen)."""
    if len(parts) == 1:
        bits, nan = parts[0]
    else:
        bits, nan = max(b for b, _ in parts), any(n for _, n in parts)
    if dtype == torch.bfloat16:
        value = _F32.unpack(_U32.pack(bits << 16))[0]
    elif dtype == torch.float16:
        value = _F16.unpack(_U16.pack(bits))[0]
    else:
        value = _F32.unpack(_U32.pack(bits))[0]
    return value, not nan


def absmax(x: torch.Tensor) -> Tuple[float, bool]:
    """(max |x| over the non-NaN elements as a float, whether x holds no NaN) for a contiguous bf16, fp16 or float32
    CPU tensor."""
    fn = _ABSMAX[x.dtype]
    n = x.numel()
    if n < _SPLIT_MIN:
        nan = ctypes.c_int(0)
        return _amax_of(x.dtype, [(fn(x.data_ptr(), n, ctypes.byref(nan)), nan.value)])

    def part(start: int, count: int):
        nan = ctypes.c_int(0)
        return fn(_ptr(x, start), count, ctypes.byref(nan)), nan.value

    return _amax_of(x.dtype, _run([lambda start=start, count=count: part(start, count)
                                   for start, count in _chunks(x.numel())]))


_SPECIAL = {"e4m3": 0x7F, "e5m2": 0x7C}  # the smallest magnitude code that is NaN or inf


def widen(raw: torch.Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The values of contiguous uint8 FP8 bytes as bf16 or float32 (a new contiguous tensor of raw's shape), or
    None where they hold a NaN or inf code (use torch then). Exact with subnormals flushed too (no subnormal
    operand)."""
    fn = _WIDEN[fp8_dtype]
    out = pool.empty(raw.shape, dtype)
    half, wide = (out, None) if dtype == torch.bfloat16 else (None, out)
    n = raw.numel()
    if n < _SPLIT_MIN:
        top = fn(raw.data_ptr(), n, _base(half), _base(wide))
    else:
        top = max(_run([lambda start=start, count=count: fn(_ptr(raw, start), count, _ptr(half, start),
                                                            _ptr(wide, start))
                        for start, count in _chunks(n)]))
    return out if 0 <= top < _SPECIAL[_FORMAT[fp8_dtype]] else None


def count4(codes: torch.Tensor, targets) -> list:
    """How many elements of the contiguous uint8 or 16-bit CPU tensor `codes` equal each of the four `targets`
    (ints, the same width), as a list of four ints."""
    width = "u8" if codes.element_size() == 1 else "u16"
    fn = getattr(_state["lib"], f"fp8kit_count4_{width}")
    c = ((ctypes.c_uint8 * 4) if width == "u8" else (ctypes.c_uint16 * 4))(*targets)

    def part(start: int, count: int):
        out = (ctypes.c_uint64 * 4)()
        fn(_ptr(codes, start), count, ctypes.addressof(c), ctypes.addressof(out))
        return list(out)

    parts = _run([lambda start=start, count=count: part(start, count) for start, count in _chunks(codes.numel())])
    return [sum(p[k] for p in parts) for k in range(4)]


def count_nonzero(x: torch.Tensor) -> int:
    """`torch.count_nonzero(x)` of a contiguous bf16, fp16 or float32 CPU tensor (NaN counts, -0 does not)."""
    fn = getattr(_state["lib"], f"fp8kit_nonzero_{8 * x.element_size()}")
    return sum(_run([lambda start=start, count=count: fn(_ptr(x, start), count)
                     for start, count in _chunks(x.numel())]))


def delayed_update(history, scale, recompute, most_recent: bool, scaled_max: float, scale_min: float,
                   scale_max: float, power_2: bool) -> bool:
    """Delayed scaling's update of float32 NumPy arrays in place, in one pass over the history (fp8_cpu.c's
    `fp8kit_delayed_update`, the rule of `host.compute_update`): `history` [rows, cols] with unit column stride,
    `scale` [cols] contiguous, `recompute` None or a contiguous bool [cols]. False (nothing written) where the kernel
    refuses (subnormals flushed, no memory) or the arrays are laid out otherwise: use NumPy then."""
    if history.dtype != np.float32 or scale.dtype != np.float32 or history.ndim != 2 \
            or history.strides[1] != 4 or history.strides[0] % 4 or not scale.flags.c_contiguous \
            or scale.shape != history.shape[1:] \
            or (recompute is not None and (recompute.dtype != np.bool_ or not recompute.flags.c_contiguous
                                           or recompute.shape != scale.shape)):
        return False
    rows, cols = history.shape
    return _state["lib"].fp8kit_delayed_update(
        history.ctypes.data, rows, cols, history.strides[0] // 4, scale.ctypes.data,
        None if recompute is None else recompute.ctypes.data, int(most_recent), scaled_max, scale_min, scale_max,
        int(power_2)) == 0
