"""FusedSGD: Transformer Engine's SGD optimizer (`transformer_engine.pytorch.optimizers.FusedSGD`) with its signature
and the update of `torch.optim.SGD` (momentum buffer initialised to the first gradient, as both do).

"Fused" means one `torch._fused_sgd_` call per parameter group, device and dtype (two when some parameters start
their momentum buffer in this step). The update is computed in float32 and rounded once into the parameter and its
momentum buffer (both in the parameter's dtype), as Transformer Engine's multi-tensor kernel does: float32 parameters
take exactly the values `torch.optim.SGD(fused=True)` gives; bf16 / fp16 ones are stepped through float32 copies
(torch's own CPU kernel at bf16 computes `lr * grad` in bf16 and leaves most small updates unapplied).
Like Transformer Engine's FusedSGD it has no master weights, so it does not update FP8 parameters: a Float8Tensor
parameter raises a TypeError (use `FusedAdam(master_weights=True)`), never a silent skip. Unlike Transformer Engine's,
it updates bf16 parameters too.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import torch
from torch.optim.optimizer import required

from ..quantized_tensor import QuantizedTensor
from .common import KeepsOptions, check_number, deprecated_set_grad_none, describe, local_tensor, zero_grad_set_to_none

__all__ = ["FusedSGD"]


class FusedSGD(KeepsOptions, torch.optim.Optimizer):
    """SGD with momentum, dampening, weight decay (L2) and Nesterov momentum.

    FusedSGD(params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
    wd_after_momentum=False, materialize_master_grads=True, set_grad_none=None)

    `wd_after_momentum=True` (Transformer Engine's kernel option) raises NotImplementedError;
    `materialize_master_grads` only concerns apex's AMP master parameters and is accepted and unused.
    """

    _OPTIONS = ("wd_after_momentum", "materialize_master_grads", "set_grad_none")

    def __init__(self, params: Iterable, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: Optional[bool] = None):
        if lr is required:
            raise TypeError("FusedSGD: lr is required")
        if wd_after_momentum:
            raise NotImplementedError("FusedSGD: wd_after_momentum=True is not implemented; weight decay is applied "
                                      "to the gradient before momentum, as torch.optim.SGD does")
        self.wd_after_momentum = False
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = deprecated_set_grad_none("FusedSGD", set_grad_none)
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then the hyper-parameters and the parameters' kinds are checked."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_number("FusedSGD", "lr", group["lr"], 0.0)
        momentum = check_number("FusedSGD", "momentum", group["momentum"], 0.0)
        dampening = check_number("FusedSGD", "dampening", group["dampening"], -float("inf"))
        check_number("FusedSGD", "weight_decay", group["weight_decay"], 0.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"FusedSGD: nesterov must be a bool, got {group['nesterov']!r}")
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError(f"FusedSGD: Nesterov momentum requires a momentum and zero dampening, got "
                             f"momentum={group['momentum']!r}, dampening={group['dampening']!r}")
        for p in group["params"]:
            local = local_tensor(p)
            if isinstance(local, QuantizedTensor):
                raise TypeError(f"FusedSGD: parameter ({describe(p)}) is quantized; FusedSGD keeps no master "
                                "weights, so FP8 updates would be lost to rounding: use "
                                "FusedAdam(master_weights=True)")
            if local.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                raise TypeError(f"FusedSGD: parameter ({describe(p)}) has dtype {local.dtype}")

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset the gradients; set_to_none defaults to True."""
        super().zero_grad(set_to_none=zero_grad_set_to_none("FusedSGD", self.set_grad_none, set_to_none))

    @torch.no_grad()
    def step(self, closure=None):
        """One SGD step for every parameter with a gradient; returns `closure()` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = float(group["momentum"])
            # (device, dtype, first step of the momentum buffer) -> [params, grads, buffers]
            launches = defaultdict(lambda: ([], [], []))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"FusedSGD does not support sparse gradients (parameter {describe(p)})")
                local, grad = local_tensor(p), local_tensor(p.grad)
                state = self.state[p]
                first = momentum != 0 and "momentum_buffer" not in state
                if first:
                    state["momentum_buffer"] = torch.empty_like(grad)
                params, grads, bufs = launches[(local.device, local.dtype, first)]
                params.append(local)
                grads.append(grad)
                if momentum != 0:
                    bufs.append(local_tensor(state["momentum_buffer"]))
            for (_, dtype, first), (params, grads, bufs) in launches.items():
                narrow = dtype in (torch.bfloat16, torch.float16)
                if narrow:  # float32 copies, rounded once back into the parameters and the momentum buffers
                    work, grads, work_bufs = ([t.float() for t in ts] for ts in (params, grads, bufs))
                else:
                    work, work_bufs = params, bufs
                torch._fused_sgd_(work, grads, work_bufs, weight_decay=float(group["weight_decay"]),
                                  momentum=momentum, lr=float(group["lr"]), dampening=float(group["dampening"]),
                                  nesterov=group["nesterov"], maximize=False, is_first_step=first)
                if narrow:
                    torch._foreach_copy_(params, work)
                    if bufs:
                        torch._foreach_copy_(bufs, work_bufs)
        return loss
