"""Numerics statistics of the FP8 casts inside modules, cheap enough to leave on during training.

For each module and tensor role (`input`, `weight`, `grad_output`) a `RoleStats` accumulates, over every cast since
the last reset:

  amax        max |x| of the high-precision tensors that were cast (NaN ignored)
  scale       the scale of the most recent cast (`q = saturate(x * scale)`)
  saturated   fraction of elements whose FP8 value is +-max (clipped by the saturation step, or rounded to max)
  underflow   fraction of the NON-ZERO elements of x whose FP8 value is zero (they were flushed by the cast)

Everything is accumulated on the tensors' device without a host synchronization (per cast: a count of the non-zeros
of x, a 256-bin histogram of the FP8 bytes and a few scalar operations); `stats()` synchronizes once per row.

    import fp8kit.pytorch as te
    te.enable_stats(model)            # every fp8kit module in `model` starts recording
    ...train...
    rows = te.stats(model, reset=True)  # list of dicts, one per (module, role) that was cast
    te.stats_to_csv(rows, "stats.csv")

A module takes part when it has an `fp8_stats` attribute (None when off), which it hands to its quantizers
(`fp8kit.pytorch.Linear` does). With stats off nothing is computed: the quantizers test one attribute for None.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Dict, Iterable, List, Optional, Union

import torch

from .cast import amax
from .tensor.storage import Float8TensorStorage

__all__ = ["RoleStats", "ModuleStats", "enable_stats", "disable_stats", "stats", "reset_stats", "stats_to_csv",
           "format_stats", "STATS_COLUMNS"]

ROLES = ("input", "weight", "grad_output")
STATS_COLUMNS = ("module", "role", "fp8_dtype", "casts", "numel", "amax", "scale", "saturated", "underflow")

# The bit pattern of +max (-max has the sign bit 0x80 set too): E4M3 0.1111.110 = 448, E5M2 0.11110.11 = 57344.
_MAX_BITS = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}
_DTYPE_NAME = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


class RoleStats:
    """Running statistics of one tensor role of one module (see the module docstring).

    Device tensors (created at the first cast, on the cast's device): `amax_value` float32 0-d, `scale_value`
    float32 0-d, `nonzero` int64 0-d (non-zero elements of the x's), `codes` int64 `[256]` (how often each FP8 bit
    pattern was produced). Python ints: `casts`, `numel`.
    """

    __slots__ = ("amax_value", "scale_value", "nonzero", "codes", "casts", "numel", "fp8_dtype")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.amax_value: Optional[torch.Tensor] = None
        self.scale_value: Optional[torch.Tensor] = None
        self.nonzero: Optional[torch.Tensor] = None
        self.codes: Optional[torch.Tensor] = None
        self.casts = 0
        self.numel = 0
        self.fp8_dtype: Optional[torch.dtype] = None

    def record(self, x: torch.Tensor, q: Float8TensorStorage, scale: torch.Tensor,
               amax_value: Optional[torch.Tensor] = None) -> None:
        """Account one cast of `x` (high precision) into `q` with the float32 `scale` (one element).

        `amax_value` is `amax(x)` when the caller already has it (delayed scaling computes it anyway)."""
        if self.fp8_dtype is not None and self.fp8_dtype != q.fp8_dtype:
            self.reset()  # the recipe changed the format: counts of different bit patterns do not mix
        if amax_value is None:
            amax_value = amax(x)
        # One pass over the FP8 bytes: a histogram of the 256 bit patterns (cheaper than separate compares).
        codes = torch.bincount(q._data.reshape(-1), minlength=256)
        if self.codes is None or self.codes.device != codes.device:
            self.amax_value = torch.zeros((), dtype=torch.float32, device=codes.device)
            self.scale_value = torch.ones((), dtype=torch.float32, device=codes.device)
            self.nonzero = torch.zeros((), dtype=torch.int64, device=codes.device)
            self.codes = torch.zeros(256, dtype=torch.int64, device=codes.device)
        self.codes.add_(codes)
        self.nonzero.add_(torch.count_nonzero(x))
        torch.fmax(self.amax_value, amax_value.float(), out=self.amax_value)
        self.scale_value.copy_(scale.reshape(()))  # a copy now: delayed scaling updates its scale in place later
        self.casts += 1
        self.numel += x.numel()
        self.fp8_dtype = q.fp8_dtype

    def row(self) -> Optional[Dict[str, object]]:
        """A dict with the STATS_COLUMNS other than `module` and `role` (None before the first cast)."""
        if self.casts == 0:
            return None
        top = _MAX_BITS[self.fp8_dtype]
        picked = self.codes[[0x00, 0x80, top, top | 0x80]]  # +0, -0, +max, -max
        values = torch.cat([picked.double(), self.nonzero.double()[None], self.amax_value.double()[None],
                            self.scale_value.double()[None]])
        pos_zero, neg_zero, pos_max, neg_max, nonzero_x, amax_value, scale = values.tolist()  # one synchronization
        zeros_q, saturated = pos_zero + neg_zero, pos_max + neg_max
        nonzero_q = self.numel - zeros_q
        return {
            "fp8_dtype": _DTYPE_NAME[self.fp8_dtype],
            "casts": self.casts,
            "numel": self.numel,
            "amax": amax_value,
            "scale": scale,
            "saturated": saturated / self.numel if self.numel else 0.0,
            # q != 0 implies x != 0 (NaN stays NaN), so the flushed elements are the difference of the counts.
            "underflow": (nonzero_x - nonzero_q) / nonzero_x if nonzero_x else 0.0,
        }


class ModuleStats:
    """The RoleStats of one module, per GEMM: `.input`, `.weight`, `.grad_output` are GEMM 0's; `roles(names)`
    lists every (name, RoleStats), GEMM k's roles named `<names[k]>.<role>` in modules with several GEMMs."""

    __slots__ = ("gemms",)

    def __init__(self):
        self.gemms = {}

    def _of(self, gemm: int):
        found = self.gemms.get(gemm)
        if found is None:
            found = self.gemms[gemm] = tuple(RoleStats() for _ in ROLES)
        return found

    @property
    def input(self) -> RoleStats:
        return self._of(0)[0]

    @property
    def weight(self) -> RoleStats:
        return self._of(0)[1]

    @property
    def grad_output(self) -> RoleStats:
        return self._of(0)[2]

    def attach(self, input_q, weight_q, grad_q, gemm: int = 0) -> None:
        """Hand the role recorders of GEMM `gemm` to the quantizers of one forward call."""
        input_q.stats, weight_q.stats, grad_q.stats = self._of(gemm)

    def roles(self, names=None):
        """(role name, RoleStats) of every GEMM that recorded, in GEMM order."""
        out = []
        for gemm in sorted(self.gemms):
            prefix = ""
            if names is not None and len(names) > 1:
                prefix = f"{names[gemm]}." if gemm < len(names) else f"gemm{gemm}."
            out += [(prefix + role, stats) for role, stats in zip(ROLES, self.gemms[gemm])]
        return out

    def reset(self) -> None:
        for found in self.gemms.values():
            for stats in found:
                stats.reset()


def _supporting_modules(model: torch.nn.Module):
    for name, module in model.named_modules():
        if hasattr(module, "fp8_stats"):
            yield name, module


def enable_stats(model: torch.nn.Module) -> int:
    """Start recording in every fp8kit module of `model` (modules already recording keep their numbers).
    Returns how many modules record."""
    n = 0
    for _, module in _supporting_modules(model):
        if module.fp8_stats is None:
            module.fp8_stats = ModuleStats()
        n += 1
    return n


def disable_stats(model: torch.nn.Module) -> List[Dict[str, object]]:
    """Stop recording in every module of `model`; returns the rows recorded until now (as `stats(model)`)."""
    rows = stats(model)
    for _, module in _supporting_modules(model):
        module.fp8_stats = None
    return rows


def reset_stats(model: torch.nn.Module) -> None:
    """Zero the statistics of every recording module of `model`."""
    for _, module in _supporting_modules(model):
        if module.fp8_stats is not None:
            module.fp8_stats.reset()


def stats(model: torch.nn.Module, reset: bool = False) -> List[Dict[str, object]]:
    """The statistics since the last reset: one dict per (module, role) with at least one cast, keys
    STATS_COLUMNS (`module` is the name in `model.named_modules()`, "" for `model` itself). Synchronizes once
    per row. With `reset=True` the statistics are zeroed after reading (a window per call)."""
    rows = []
    for name, module in _supporting_modules(model):
        recorder = module.fp8_stats
        if recorder is None:
            continue
        for role, recorded in recorder.roles(getattr(module, "fp8_gemm_names", None)):
            row = recorded.row()
            if row is not None:
                rows.append({"module": name, "role": role, **row})
        if reset:
            recorder.reset()
    return rows


def _rows_of(source: Union[torch.nn.Module, Iterable[Dict[str, object]]]) -> List[Dict[str, object]]:
    return stats(source) if isinstance(source, torch.nn.Module) else list(source)


def stats_to_csv(source: Union[torch.nn.Module, Iterable[Dict[str, object]]],
                 path: Union[str, os.PathLike, io.TextIOBase]) -> None:
    """Write rows (or `stats(model)` of a model) as CSV with the header STATS_COLUMNS (extra keys kept after
    them). `path` is a file name or an open text file."""
    rows = _rows_of(source)
    columns = list(STATS_COLUMNS) + sorted({k for r in rows for k in r} - set(STATS_COLUMNS))
    if isinstance(path, (str, os.PathLike)):
        with open(path, "w", newline="") as f:
            _write_csv(f, columns, rows)
    else:
        _write_csv(path, columns, rows)


def _write_csv(f, columns, rows) -> None:
    writer = csv.DictWriter(f, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)


def format_stats(source: Union[torch.nn.Module, Iterable[Dict[str, object]]]) -> str:
    """A fixed-width table of the rows, for printing."""
    rows = _rows_of(source)
    width = max([len("module")] + [len(str(r["module"])) for r in rows])
    lines = [f"{'module':<{width}}  {'role':<11} {'fmt':<4} {'amax':>10} {'scale':>10} {'saturated':>10} "
             f"{'underflow':>10}"]
    for r in rows:
        lines.append(f"{r['module']:<{width}}  {r['role']:<11} {r['fp8_dtype']:<4} {r['amax']:>10.4g} "
                     f"{r['scale']:>10.4g} {r['saturated']:>10.3%} {r['underflow']:>10.3%}")
    return "\n".join(lines)
