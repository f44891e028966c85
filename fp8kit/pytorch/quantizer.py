"""Quantizers: how one tensor role (input, weight, grad_output) of one module is cast under a recipe."""

from __future__ import annotations

import math

import torch

from . import host, kernels
from .cast import FP8_MAX, amax, cast, cast_host, current_scale
from .state import ScalingState
from .tensor import Float8Tensor


class DelayedQuantizer:
    """Casts with the slot's current scale and max-accumulates the tensor's amax into the staging row."""

    __slots__ = ("state", "slot", "fp8_dtype", "stats")

    def __init__(self, state: ScalingState, slot: int, fp8_dtype: torch.dtype):
        self.state, self.slot, self.fp8_dtype = state, slot, fp8_dtype
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if host.active(x.device):
            a = host.amax(x)
            self.state.record(self.slot, a)
            scale = float(self.state.host_views()[1][self.slot])
            q = cast_host(x, scale, self.fp8_dtype, a)
            if self.stats is not None:
                self.stats.record(x, q, torch.scalar_tensor(scale, dtype=torch.float32),
                                  torch.scalar_tensor(a, dtype=torch.float32))
            return q
        if self.stats is None and kernels.use_for(x):  # one fused pass: FP8 bytes, amax into the staging slot
            inv = torch.empty((), dtype=torch.float32, device=x.device)
            data, _, _ = kernels.cast_amax(x.detach(), self.state.scale[self.slot], self.fp8_dtype,
                                           amax_out=self.state.amax_history[0, self.slot], scale_inv_out=inv)
            return Float8Tensor(data, inv, x.dtype)
        a = amax(x)
        self.state.record(self.slot, a)
        scale = self.state.scale[self.slot]
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale, a)
        return q

    def observe(self, x: torch.Tensor) -> None:
        """Calibration: record the amax without casting."""
        self.state.record(self.slot, host.amax(x) if host.active(x.device) else amax(x))


class FixedScaleQuantizer:
    """Casts with a given scale and records nothing: a recompute repeating a delayed-scaling cast
    (fp8kit.pytorch.recompute). `scale` is a float32 value as a Python float, or a 0-d float32 tensor."""

    __slots__ = ("scale", "fp8_dtype", "stats")

    def __init__(self, scale, fp8_dtype: torch.dtype):
        self.scale, self.fp8_dtype, self.stats = scale, fp8_dtype, None

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if isinstance(self.scale, float):
            return cast_host(x, self.scale, self.fp8_dtype, math.inf)  # amax unknown: always clamp
        return cast(x, self.scale, self.fp8_dtype)

    def observe(self, x: torch.Tensor) -> None:
        pass


class CurrentQuantizer:
    """Casts with `fp8_max / amax(x)` computed from the tensor itself (all-reduced over `group` if given)."""

    __slots__ = ("fp8_dtype", "amax_epsilon", "power_2", "group", "stats")

    def __init__(self, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0, power_2: bool = False, group=None):
        self.fp8_dtype, self.amax_epsilon, self.power_2, self.group = fp8_dtype, amax_epsilon, power_2, group
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if self.group is None and host.active(x.device):
            a = host.amax(x)
            scale = host.current_scale(a, FP8_MAX[self.fp8_dtype], self.amax_epsilon, self.power_2)
            q = cast_host(x, scale, self.fp8_dtype, a)
            if self.stats is not None:
                self.stats.record(x, q, torch.scalar_tensor(scale, dtype=torch.float32),
                                  torch.scalar_tensor(a, dtype=torch.float32))
            return q
        if kernels.use_for(x):  # an amax pass, then a cast pass that computes the scale itself
            data, _, scale, inv, _ = kernels.current_cast(x.detach(), self.fp8_dtype, self.amax_epsilon,
                                                          self.power_2, group=self.group)
            q = Float8Tensor(data, inv, x.dtype)
            if self.stats is not None:
                self.stats.record(x, q, scale)
            return q
        scale = current_scale(x, FP8_MAX[self.fp8_dtype], self.amax_epsilon, self.power_2, self.group)
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale)
        return q

    def observe(self, x: torch.Tensor) -> None:
        pass
