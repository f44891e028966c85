"""Quantizers: how one tensor role (input, weight, grad_output) of one module is cast under a recipe."""

from __future__ import annotations

import torch

from .cast import FP8_MAX, amax, cast, current_scale
from .state import ScalingState
from .tensor import Float8Tensor


class DelayedQuantizer:
    """Casts with the slot's current scale and max-accumulates the tensor's amax into the staging row."""

    __slots__ = ("state", "slot", "fp8_dtype", "stats")

    def __init__(self, state: ScalingState, slot: int, fp8_dtype: torch.dtype):
        self.state, self.slot, self.fp8_dtype = state, slot, fp8_dtype
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        a = amax(x)
        self.state.record(self.slot, a)
        scale = self.state.scale[self.slot]
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale, a)
        return q

    def observe(self, x: torch.Tensor) -> None:
        """Calibration: record the amax without casting."""
        self.state.record(self.slot, amax(x))


class CurrentQuantizer:
    """Casts with `fp8_max / amax(x)` computed from the tensor itself (all-reduced over `group` if given)."""

    __slots__ = ("fp8_dtype", "amax_epsilon", "power_2", "group", "stats")

    def __init__(self, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0, power_2: bool = False, group=None):
        self.fp8_dtype, self.amax_epsilon, self.power_2, self.group = fp8_dtype, amax_epsilon, power_2, group
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        scale = current_scale(x, FP8_MAX[self.fp8_dtype], self.amax_epsilon, self.power_2, self.group)
        q = cast(x, scale, self.fp8_dtype)
        if self.stats is not None:
            self.stats.record(x, q, scale)
        return q

    def observe(self, x: torch.Tensor) -> None:
        pass
