"""Quantizers: how one tensor role (input, weight, grad_output) of one module is cast under a recipe.

`quantize(x, transpose=True)` also gives the FP8 bytes of the transpose (`Float8TensorStorage._transpose`) on
accelerators, where the dgrad and wgrad GEMMs take a column-major operand from them; `quantize_dbias(dy)` adds the
bias gradient.
With the Triton kernels on, both are one pass over the tensor (docs/kernels.md).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from . import host, kernels
from .cast import (
    FP8_MAX,
    amax,
    cast,
    cast_1d,
    cast_host,
    cast_host_recording,
    current_scale,
    current_scale_1d,
    fp8_max_of,
)
from .state import ScalingState
from .tensor.storage import Float8TensorStorage


@torch.library.custom_op("fp8kit::scale_snapshot", mutates_args=())
def scale_snapshot(scale: torch.Tensor) -> torch.Tensor:
    """A copy of a delayed-scaling scale, as an operation the compiler keeps (torch.compile only). The scale is a
    view of a state that the same compiled forward updates in place (the autocast exit); inductor's partitioner
    recomputes cheap casts in the backward from their inputs, and recomputed from the updated scale a weight's FP8
    bytes no longer matched their saved `scale_inv` (the data gradient off by the scale's change, first step, found
    on a GPU run and reproduced by tools/gpu/sim_accelerator_compile.py). A custom operation is saved, not
    recomputed, so the backward reads the bytes' own scale."""
    return scale.clone()


@scale_snapshot.register_fake
def _scale_snapshot_fake(scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scale)


class DelayedQuantizer:
    """Casts with the slot's current scale and max-accumulates the tensor's amax into the staging row."""

    __slots__ = ("state", "slot", "fp8_dtype", "stats", "defer_bytes")

    def __init__(self, state: ScalingState, slot: int, fp8_dtype: torch.dtype, defer_bytes: bool = False):
        self.state, self.slot, self.fp8_dtype = state, slot, fp8_dtype
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on
        self.defer_bytes = defer_bytes  # see `cast_host`: the grad_output role, whose bytes the CPU GEMMs never read

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> Float8TensorStorage:
        """Cast `x`; with `transpose` (and x off the CPU) the result carries `data_t`."""
        if host.active(x.device):
            scale = float(self.state.host_views()[1][self.slot])
            done = cast_host_recording(x, scale, self.fp8_dtype, self.defer_bytes)  # cast and amax in one pass
            if done is None:
                a, nan_free = host.amax_nan(x)
                q = cast_host(x, scale, self.fp8_dtype, a, nan_free, self.defer_bytes)
            else:
                q, a, _ = done
            self.state.record(self.slot, a)
            if self.stats is not None:
                self.stats.record_host(x, q, scale, a)
            return q
        if self.stats is None and kernels.use_for(x):  # one fused pass: FP8 bytes (+ transpose), amax into the slot
            inv = torch.empty((1,), dtype=torch.float32, device=x.device)
            scale, stage = self.state.slot_views(self.slot)
            data, data_t, _ = kernels.cast_amax(x, scale, self.fp8_dtype, transpose=transpose, amax_out=stage,
                                                scale_inv_out=inv, raw=True,
                                                amax_bits=self.state.slot_bits(self.slot))
            return Float8TensorStorage.from_bytes(data, self.fp8_dtype, inv, x.dtype, data_t)
        if self.stats is None and x.dim() and not torch.compiler.is_compiling():
            # eager tensor path: the slot's scale and staging views made once; the amax max-accumulated in place
            scale, stage = self.state.slot_views(self.slot)
            torch.fmax(stage, amax(x), out=stage)
            q = cast_1d(x, scale, self.fp8_dtype)
            return with_transpose(q) if transpose else q
        a = amax(x)
        self.state.record(self.slot, a)
        scale = self.state.scale[self.slot]
        if torch.compiler.is_compiling():
            scale = scale_snapshot(scale)
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale, a)
        return with_transpose(q) if transpose else q

    def quantize_dbias(self, dy: torch.Tensor) -> Tuple[Float8TensorStorage, torch.Tensor]:
        """grad_output: the FP8 tensor (with `data_t` off the CPU) and the bias gradient (dy summed over its leading
        dimensions, in dy's dtype); with the kernels, one pass over dy (`kernels.cast_transpose_dbias`)."""
        if self.stats is None and kernels.use_for(dy):
            scale, stage = self.state.slot_views(self.slot)
            data, data_t, inv, dbias = kernels.cast_transpose_dbias(
                dy, scale, self.fp8_dtype, amax_out=stage,
                scale_inv_out=torch.empty((1,), dtype=torch.float32, device=dy.device), raw=True,
                amax_bits=self.state.slot_bits(self.slot))
            return Float8TensorStorage.from_bytes(data, self.fp8_dtype, inv, dy.dtype, data_t), dbias
        return self.quantize(dy, transpose=True), bias_grad(dy)

    def observe(self, x: torch.Tensor) -> None:
        """Calibration: record the amax without casting."""
        self.state.record(self.slot, host.amax(x) if host.active(x.device) else amax(x))


class FixedScaleQuantizer:
    """Casts with a given scale and records nothing: a recompute repeating a delayed-scaling cast
    (fp8kit.pytorch.recompute). `scale` is a float32 value as a Python float, or a 0-d float32 tensor."""

    __slots__ = ("scale", "fp8_dtype", "stats")

    def __init__(self, scale, fp8_dtype: torch.dtype):
        self.scale, self.fp8_dtype, self.stats = scale, fp8_dtype, None

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> Float8TensorStorage:
        if isinstance(self.scale, float):
            return cast_host(x, self.scale, self.fp8_dtype, math.inf)  # amax unknown: always clamp
        q = cast(x, self.scale, self.fp8_dtype)
        return with_transpose(q) if transpose else q

    def observe(self, x: torch.Tensor) -> None:
        pass


class CurrentQuantizer:
    """Casts with `fp8_max / amax(x)` computed from the tensor itself (all-reduced over `group` if given)."""

    __slots__ = ("fp8_dtype", "amax_epsilon", "power_2", "group", "stats", "defer_bytes")

    def __init__(self, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0, power_2: bool = False, group=None,
                 defer_bytes: bool = False):
        self.fp8_dtype, self.amax_epsilon, self.power_2, self.group = fp8_dtype, amax_epsilon, power_2, group
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on
        self.defer_bytes = defer_bytes  # see `DelayedQuantizer`

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> Float8TensorStorage:
        """Cast `x`; with `transpose` (and x off the CPU) the result carries `data_t`."""
        if self.group is None and host.active(x.device):
            a, nan_free = host.amax_nan(x)
            scale = host.current_scale(a, FP8_MAX[self.fp8_dtype], self.amax_epsilon, self.power_2)
            q = cast_host(x, scale, self.fp8_dtype, a, nan_free, self.defer_bytes)
            if self.stats is not None:
                self.stats.record_host(x, q, scale, a)
            return q
        if kernels.use_for(x):  # an amax pass, then a cast pass that computes the scale itself
            data, data_t, scale, inv, _ = kernels.current_cast(x, self.fp8_dtype, self.amax_epsilon, self.power_2,
                                                               transpose=transpose, group=self.group, raw=True,
                                                               with_scale=self.stats is not None, with_amax=False)
            q = Float8TensorStorage.from_bytes(data, self.fp8_dtype, inv, x.dtype, data_t)
            if self.stats is not None:
                self.stats.record(x, q, scale)
            return q
        if self.stats is None and x.dim() and not torch.compiler.is_compiling():
            scale = current_scale_1d(x, FP8_MAX[self.fp8_dtype], self.amax_epsilon, self.power_2, self.group)
            q = cast_1d(x, scale, self.fp8_dtype)
            return with_transpose(q) if transpose else q
        scale = current_scale(x, fp8_max_of(self.fp8_dtype), self.amax_epsilon, self.power_2, self.group)
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale)
        return with_transpose(q) if transpose else q

    def quantize_dbias(self, dy: torch.Tensor) -> Tuple[Float8TensorStorage, torch.Tensor]:
        """As `DelayedQuantizer.quantize_dbias` (kernels: `kernels.current_cast_transpose_dbias`)."""
        if kernels.use_for(dy):
            data, data_t, scale, inv, _, dbias = kernels.current_cast_transpose_dbias(
                dy, self.fp8_dtype, self.amax_epsilon, self.power_2, group=self.group, raw=True,
                with_scale=self.stats is not None, with_amax=False)
            q = Float8TensorStorage.from_bytes(data, self.fp8_dtype, inv, dy.dtype, data_t)
            if self.stats is not None:
                self.stats.record(dy, q, scale)
            return q, dbias
        return self.quantize(dy, transpose=True), bias_grad(dy)

    def observe(self, x: torch.Tensor) -> None:
        pass


def with_transpose(q: Float8TensorStorage) -> Float8TensorStorage:
    """`q` with `_transpose` (a copy of the transposed bytes) when it lives off the CPU, where the GEMMs use it; CPU
    tensors are returned as they are (the emulated GEMM reads any layout)."""
    return q.with_transpose()


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """The bias gradient: `dy` summed over its leading dimensions, in dy's dtype."""
    if dy.dim() == 2:
        return dy.sum(0)
    n = dy.shape[-1] if dy.dim() else 1
    if n == 0:  # a layer without outputs: reshape(-1, 0) is ambiguous
        return dy.new_zeros(0)
    return dy.reshape(-1, n).sum(0)
