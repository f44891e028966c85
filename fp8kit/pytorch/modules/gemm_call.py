"""One GEMM of a module with several (LayerNormMLP, GroupedLinear), computed exactly as `Linear` computes its own:
`torch.nn.functional.linear` when nothing runs in FP8 and nothing is split, else `fp8_linear` on the 2-D view of the
input (torch.autocast's dtype applied to the operands first), with the plan's tensor-parallel collectives. A fused
module built from these calls gives the numbers of the same `Linear`s called one after the other."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .base import FP8Call
from .linear_function import LinearPlan, fp8_linear
from .setup import check_operands

__all__ = ["linear_call", "track_gemm_backwards"]


def linear_call(where: str, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                plan: Optional[LinearPlan], in_features: int) -> torch.Tensor:
    """`inp @ weight.T + bias` for `inp` `[..., in_features]`; `plan` None: torch.nn.functional.linear."""
    if plan is None:
        return F.linear(inp, weight, bias)
    autocast_on = torch.is_autocast_enabled(inp.device.type)
    inp, weight, bias = check_operands(where, inp, weight, bias, in_features, autocast_on)
    tp = plan.tp
    if tp is not None and tp.sequence_parallel:
        if inp.dim() < 2:
            raise ValueError(f"{where}(sequence_parallel=True): the input needs a sequence dimension first, got "
                             f"shape {tuple(inp.shape)}")
        if tp.mode == "row" and inp.shape[0] % tp.size:
            raise ValueError(f"{where}(sequence_parallel=True): the sequence dimension ({inp.shape[0]}) of the "
                             f"row-parallel GEMM's input must be divisible by the tensor-parallel size {tp.size}")
    leading = inp.shape[:-1]
    x = inp.reshape(math.prod(leading), in_features)
    if autocast_on:  # the operands are cast already; the GEMMs pick their dtypes
        with torch.autocast(x.device.type, enabled=False):
            y = fp8_linear(x, weight, bias, plan)
    else:
        y = fp8_linear(x, weight, bias, plan)
    if tp is not None and tp.sequence_parallel:
        first = leading[0] * tp.size if tp.mode == "column" else leading[0] // tp.size
        leading = (first,) + tuple(leading[1:])
    return y.reshape(*leading, y.shape[-1])


def track_gemm_backwards(call: FP8Call, plans: Sequence[LinearPlan], operands: List[Sequence]) -> None:
    """Make every GEMM whose backward will run report to the step's backward update (`operands[g]`: the leaf tensors
    GEMM g's backward depends on; its autograd node runs when one of them requires grad)."""
    runs = [any(t is not None and t.requires_grad for t in group) for group in operands]
    for plan, run in zip(plans, runs):
        plan.track_backward = call.track_backward and run
    if call.track_backward:
        call.count_gemm_backwards(sum(runs))
