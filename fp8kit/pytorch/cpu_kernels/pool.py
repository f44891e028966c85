"""Reuse of the CPU kernels' large temporaries: the widened GEMM operands (bf16 values) that live for one GEMM or one
backward pass.

A fresh multi-megabyte CPU tensor costs page faults when first written (glibc returns freed large blocks to the
system, and a training step allocates and frees several per Linear call: x's values in the forward, dy's values
and x's re-widened values in the backward). The Linear Function hands such a tensor back (`recycle`) once its GEMMs
are done; it is kept only when nothing else refers to it: no other Python reference, no C++ holder (autograd, a
view's base), no other tensor on its storage (a view, a NumPy array). `empty` hands a kept tensor of the same shape
and dtype out again; the kernels overwrite every element. Bounded: two per shape, 256 MiB in all.
"""

from __future__ import annotations

import sys
import threading
from typing import Dict, List, Tuple

import torch

__all__ = ["empty", "recycle", "clear", "unshared"]

MIN_BYTES = 1 << 20  # smaller blocks come from the allocator's free lists without page faults
MAX_PER_SHAPE = 2
MAX_BYTES = 256 << 20

_free: Dict[Tuple, List[torch.Tensor]] = {}
_held = [0]
_lock = threading.Lock()


def _key(shape, dtype: torch.dtype) -> Tuple:
    return tuple(shape), dtype, torch.is_inference_mode_enabled()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor: a recycled one of this shape and dtype if there is one."""
    found = _free.get(_key(shape, dtype))
    if found:
        with _lock:
            if found:
                t = found.pop()
                _held[0] -= t.nbytes
                return t
    return torch.empty(shape, dtype=dtype)


def references(obj) -> int:
    """`sys.getrefcount` through one call. Compare only with a probe's count taken the same way from the same frame,
    both held by local names made there: what a name shows depends on the process's state (after torch.compile has
    run, a local shows one more reference; after a torch.compile error, a frame's arguments show one more than its
    locals: measured on torch 2.13)."""
    return sys.getrefcount(obj)


def unshared(t: torch.Tensor) -> bool:
    """Whether nothing outside Python holds `t`: no C++ holder of its TensorImpl (autograd, a view's base) and no
    other tensor or array on its storage (any device)."""
    return (t._use_count() == 1 and t._base is None
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)


def recycle(*owners) -> None:
    """Take the widened values (`_values`) off these storages (None and plain tensors are skipped) and keep those
    nothing else refers to for `empty`. The storages stay usable: a later `values()` widens again."""
    if torch.compiler.is_compiling():
        return
    probe = baseline = None
    for owner in owners:
        t = None if isinstance(owner, torch.Tensor) else getattr(owner, "_values", None)
        if not isinstance(t, torch.Tensor) or t.nbytes < MIN_BYTES or t.device.type != "cpu" or not t.is_contiguous():
            continue
        if probe is None:
            # what `references` gives for an object held by one local name of this frame, measured here and now
            # (a constant would keep nothing after torch.compile has run)
            probe = object()
            baseline = references(probe)
        owner._values = None
        if references(t) > baseline or not unshared(t):
            continue
        key = (tuple(t.shape), t.dtype, t.is_inference())
        with _lock:
            kept = _free.setdefault(key, [])
            if len(kept) < MAX_PER_SHAPE and _held[0] + t.nbytes <= MAX_BYTES:
                kept.append(t)
                _held[0] += t.nbytes


def clear() -> None:
    """Drop every kept tensor."""
    with _lock:
        _free.clear()
        _held[0] = 0
