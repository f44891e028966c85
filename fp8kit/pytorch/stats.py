"""Numerics statistics of the FP8 casts inside modules, cheap enough to leave on during training.

For each module and tensor role (`input`, `weight`, `grad_output`) a `RoleStats` accumulates, over every cast since
the last reset:

  amax        max |x| of the high-precision tensors that were cast (NaN ignored)
  scale       the scale of the most recent cast (`q = saturate(x * scale)`); NaN under block scaling (one per block)
  saturated   fraction of elements whose FP8 value is +-max (clipped by the saturation step, or rounded to max)
  underflow   fraction of the NON-ZERO elements of x whose FP8 value is zero (they were flushed by the cast)

Block-scaled recipes (MXFP8, Float8 block scaling, NVFP4) are counted on the rowwise data the quantizer produced
(the layout the forward GEMM and dgrad read; the columnwise copy has other blocks, and under NVFP4 the Hadamard
transform): saturated = elements whose code is +-max of the element format (E4M3 448, E5M2 57344, E2M1 6), in
units of their block's scale; underflow = non-zero x whose code is +-0.

Everything is accumulated on the tensors' device without a host synchronization (per cast: a count of the non-zeros
of x, a 256-bin histogram of the FP8 bytes and a few scalar operations); `stats()` synchronizes once per row. On the
CPU host path the CPU kernels (fp8kit.pytorch.cpu_kernels) count instead, into Python numbers: the four edge codes
in one vectorised pass over the cast's codes (or their bf16 values, so that a grad_output's deferred bytes stay
unmade) and the non-zeros of x in one more (`RoleStats.record_host`).

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
import math
import os
import struct
from typing import Dict, Iterable, List, Optional, Union

import torch

from . import cpu_kernels
from .cast import amax
from .tensor.storage import Float8TensorStorage

__all__ = ["RoleStats", "ModuleStats", "enable_stats", "disable_stats", "stats", "reset_stats", "stats_to_csv",
           "format_stats", "STATS_COLUMNS"]

ROLES = ("input", "weight", "grad_output")
STATS_COLUMNS = ("module", "role", "fp8_dtype", "casts", "numel", "amax", "scale", "saturated", "underflow")

# Per element format: (the codes of +0, -0, +max, -max). FP8 bytes: E4M3 0.1111.110 = 448, E5M2 0.11110.11 =
# 57344, sign bit 0x80. E2M1 nibbles (NVFP4, two per byte): 0.11.1 = 6, sign bit 0x8.
_EDGE_CODES = {"e4m3": (0x00, 0x80, 0x7E, 0xFE), "e5m2": (0x00, 0x80, 0x7B, 0xFB), "e2m1": (0x0, 0x8, 0x7, 0xF)}
_DTYPE_NAME = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
# The same codes' values as bf16 bits (the CPU GEMM operand a cast may hold instead of its bytes): +0, -0, +max, -max
_EDGE_VALUE_BITS = {name: tuple(struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in (0.0, -0.0, m, -m))
                    for name, m in (("e4m3", 448.0), ("e5m2", 57344.0))}


class RoleStats:
    """Running statistics of one tensor role of one module (see the module docstring).

    Device tensors (created at the first cast, on the cast's device): `amax_value` float32 0-d, `scale_value`
    float32 0-d, `nonzero` int64 0-d (non-zero elements of the x's), `codes` int64 `[256]` (how often each byte of
    the quantized data was produced: an FP8 code, or two E2M1 codes for NVFP4). Python ints: `casts`, `numel`;
    `fp8_dtype` the element format's name ("e4m3", "e5m2", "e2m1"). Casts counted on the CPU host path by the CPU
    kernels (`record_host`) accumulate in `host` instead, as Python numbers: [+0, -0, +max, -max codes, all codes,
    non-zero x, amax, scale]; `host_last` says which of the two recorded the most recent cast (its scale is shown).
    """

    __slots__ = ("amax_value", "scale_value", "nonzero", "codes", "casts", "numel", "fp8_dtype", "host", "host_last")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.amax_value: Optional[torch.Tensor] = None
        self.scale_value: Optional[torch.Tensor] = None
        self.nonzero: Optional[torch.Tensor] = None
        self.codes: Optional[torch.Tensor] = None
        self.casts = 0
        self.numel = 0
        self.fp8_dtype: Optional[str] = None
        self.host: Optional[list] = None
        self.host_last = False

    def record(self, x: torch.Tensor, q: Float8TensorStorage, scale: torch.Tensor,
               amax_value: Optional[torch.Tensor] = None) -> None:
        """Account one cast of `x` (high precision) into `q` with the float32 `scale` (one element).

        `amax_value` is `amax(x)` when the caller already has it (delayed scaling computes it anyway)."""
        self._record(x, q._data, _DTYPE_NAME[q.fp8_dtype], scale.reshape(()), amax_value)

    def record_host(self, x: torch.Tensor, q: Float8TensorStorage, scale: float, amax_value: float) -> None:
        """`record` on the CPU host path, `scale` and `amax_value` as floats: counted by the CPU kernels where they
        take x and q (one vectorised pass over q's codes, or over their bf16 values when the cast made those, so
        that a grad_output's deferred bytes stay unmade; one over x for its non-zeros), else by `record`."""
        fmt = _DTYPE_NAME.get(q.fp8_dtype)
        values = q._values
        by_values = values is not None and values.dtype == torch.bfloat16 and values.is_contiguous()
        if not (fmt is not None and cpu_kernels.takes(x) and (by_values or q._data.is_contiguous())):
            self.record(x, q, torch.scalar_tensor(scale, dtype=torch.float32),
                        torch.scalar_tensor(amax_value, dtype=torch.float32))
            return
        if self.fp8_dtype is not None and self.fp8_dtype != fmt:
            self.reset()
        if by_values:
            edges = cpu_kernels.count4(values.view(torch.uint16), _EDGE_VALUE_BITS[fmt])
        else:
            edges = cpu_kernels.count4(q._data, _EDGE_CODES[fmt])
        host = self.host if self.host is not None else [0, 0, 0, 0, 0, 0, 0.0, 1.0]
        for k in range(4):
            host[k] += edges[k]
        host[4] += x.numel()
        host[5] += cpu_kernels.count_nonzero(x)
        if amax_value > host[6]:
            host[6] = amax_value
        host[7] = scale
        self.host, self.host_last = host, True
        self.casts += 1
        self.numel += x.numel()
        self.fp8_dtype = fmt

    def record_block(self, x: torch.Tensor, q) -> None:
        """Account one block-scaled cast of `x` into `q` (an MXFP8, Float8 block or NVFP4 storage with rowwise
        data); the scale column becomes NaN (there is one scale per block)."""
        if q._rowwise_data is None:
            raise ValueError(f"{type(q).__name__}: block statistics count the rowwise data, which was not made")
        fmt = "e2m1" if getattr(q, "_fp4_dtype", None) is not None else _DTYPE_NAME[q.fp8_dtype]
        nan = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
        self._record(x, q._rowwise_data, fmt, nan, None)

    def _record(self, x: torch.Tensor, data: torch.Tensor, fmt: str, scale: torch.Tensor,
                amax_value: Optional[torch.Tensor]) -> None:
        if self.fp8_dtype is not None and self.fp8_dtype != fmt:
            self.reset()  # the recipe changed the format: counts of different bit patterns do not mix
        if amax_value is None:
            amax_value = amax(x)
        # One pass over the quantized bytes: a histogram of the 256 bit patterns (cheaper than separate compares).
        codes = torch.bincount(data.reshape(-1), minlength=256)
        if self.codes is None or self.codes.device != codes.device:
            self.amax_value = torch.zeros((), dtype=torch.float32, device=codes.device)
            self.scale_value = torch.ones((), dtype=torch.float32, device=codes.device)
            self.nonzero = torch.zeros((), dtype=torch.int64, device=codes.device)
            self.codes = torch.zeros(256, dtype=torch.int64, device=codes.device)
        self.codes.add_(codes)
        self.nonzero.add_(torch.count_nonzero(x))
        torch.fmax(self.amax_value, amax_value.float(), out=self.amax_value)
        self.scale_value.copy_(scale)  # a copy now: delayed scaling updates its scale in place later
        self.host_last = False
        self.casts += 1
        self.numel += x.numel()
        self.fp8_dtype = fmt

    def row(self) -> Optional[Dict[str, object]]:
        """A dict with the STATS_COLUMNS other than `module` and `role` (None before the first cast)."""
        if self.casts == 0:
            return None
        counts = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, math.nan, math.nan]
        if self.codes is not None:
            codes = self.codes
            if self.fp8_dtype == "e2m1":  # byte = high nibble * 16 + low nibble: count each nibble's codes
                by_nibble = codes.view(16, 16)
                codes = by_nibble.sum(0) + by_nibble.sum(1)
            picked = codes[list(_EDGE_CODES[self.fp8_dtype])]  # +0, -0, +max, -max
            values = torch.cat([picked.double(), codes.sum().double()[None], self.nonzero.double()[None],
                                self.amax_value.double()[None], self.scale_value.double()[None]])
            counts = values.tolist()  # one synchronization
        if self.host is not None:
            counts = [a + b for a, b in zip(counts[:6], self.host[:6])] + [
                max(counts[6], self.host[6]) if counts[6] == counts[6] else self.host[6],  # NaN: no tensor casts
                self.host[7] if self.host_last or counts[7] != counts[7] else counts[7]]
        pos_zero, neg_zero, pos_max, neg_max, n_codes, nonzero_x, amax_value, scale = counts
        zeros_q, saturated = pos_zero + neg_zero, pos_max + neg_max
        nonzero_q = n_codes - zeros_q
        return {
            "fp8_dtype": self.fp8_dtype,
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
