"""FusedAdam: Transformer Engine's Adam/AdamW optimizer (`transformer_engine.pytorch.optimizers.FusedAdam`) with its
signature and semantics, for plain and FP8 (Float8Tensor) parameters, on CPUs and GPUs.

"Fused" here means one `torch._fused_adamw_` (or `torch._fused_adam_`) call per parameter group and device, on
float32 tensors: the parameters that are float32, and the float32 master copies of the others. So the master weights
take exactly the values `torch.optim.AdamW(fused=True)` (or `Adam`) would give the same float32 tensors; Transformer
Engine's CUDA kernel orders its float32 operations a little differently, so the two agree to float32 rounding, not bit
for bit.

- Float8Tensor parameters (from `quantized_model_init`) need `master_weights=True`. Each step updates the float32
  master and quantizes it into the parameter with the parameter's quantizer (`param.quantize_(master)`): delayed
  scaling casts with the module state's current scale and records the amax, as Transformer Engine's fused FP8 Adam
  kernel does; current scaling casts with the master's own amax (all-reduced over the FSDP2 mesh for a sharded
  parameter, see fp8kit.pytorch.fsdp).
- bf16 / fp16 parameters: with `master_weights=True` a float32 master is kept and rounded into the parameter after each
  step; without, the step runs on a float32 copy of the parameter (the moments are float32 either way).
- float32 parameters are updated in place (they are their own master).
- FSDP2 parameters (DTensors) are updated through their local shards; the states are DTensors with the same
  placements, so `torch.distributed.checkpoint` sees them sharded.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Iterable, Optional

import torch

from ..quantized_tensor import QuantizedTensor
from ..tensor.float8_tensor import Float8Tensor
from .common import (
    KeepsOptions,
    by_device,
    check_number,
    deprecated_set_grad_none,
    describe,
    local_tensor,
    parameter_gradient,
    wrap_like,
    zero_grad_set_to_none,
)

__all__ = ["FusedAdam"]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
# the options kept as attributes (torch's Optimizer.__getstate__ keeps only defaults, state and param_groups)
_OPTIONS = ("adam_w_mode", "capturable", "master_weights", "master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
            "use_decoupled_grad", "store_param_remainders", "set_grad_none")


class FusedAdam(KeepsOptions, torch.optim.Optimizer):
    """Adam / AdamW with Transformer Engine's options (see the module docstring).

    FusedAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
    bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
    master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
    use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None)

    adam_w_mode: True is AdamW (decoupled weight decay), False Adam with L2 regularisation.
    bias_correction: divide the moments by `1 - beta**step` (True) or not.
    master_weights: keep float32 master copies of the non-float32 parameters (required for Float8Tensor ones); a
      master starts from `param.get_high_precision_init_val()` when the parameter has one (quantized_model_init with
      preserve_high_precision_init_val=True), else from the parameter's (dequantized) value.
    use_decoupled_grad: read gradients from `param.decoupled_grad` instead of `param.grad`.
    Not implemented (raise NotImplementedError naming the option): amsgrad, capturable, non-float32
    master_weight_dtype / exp_avg_dtype / exp_avg_sq_dtype, store_param_remainders with master weights, and a
    `grad_scaler` passed to `step`.
    """

    _OPTIONS = _OPTIONS

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise NotImplementedError("FusedAdam: amsgrad=True is not supported (nor is it by Transformer Engine's "
                                      "FusedAdam); use torch.optim.AdamW(amsgrad=True)")
        if capturable:
            raise NotImplementedError("FusedAdam: capturable=True (CUDA graph capture) is not implemented in fp8kit")
        if master_weights and master_weight_dtype != torch.float32:
            raise NotImplementedError(f"FusedAdam: master_weight_dtype={master_weight_dtype} is not implemented; "
                                      "fp8kit keeps float32 master weights")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype != torch.float32:
                raise NotImplementedError(f"FusedAdam: {name}={dtype} is not implemented; fp8kit keeps float32 "
                                          "moments")
        if store_param_remainders and master_weights:
            raise NotImplementedError("FusedAdam: store_param_remainders=True is not implemented; fp8kit keeps "
                                      "whole float32 master weights")
        for name, flag in (("bias_correction", bias_correction), ("adam_w_mode", adam_w_mode),
                           ("master_weights", master_weights), ("use_decoupled_grad", use_decoupled_grad)):
            if not isinstance(flag, bool):
                raise TypeError(f"FusedAdam: {name} must be a bool, got {flag!r}")
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = master_weights
        self.master_weight_dtype = torch.float32
        self.exp_avg_dtype = self.exp_avg_sq_dtype = torch.float32
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = False
        self.set_grad_none = deprecated_set_grad_none("FusedAdam", set_grad_none)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)

    # ---- parameters and groups ----

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then the hyper-parameters and the parameters' kinds are checked."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_number("FusedAdam", "lr", group["lr"], 0.0)
        check_number("FusedAdam", "eps", group["eps"], 0.0)
        check_number("FusedAdam", "weight_decay", group["weight_decay"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"FusedAdam: betas must be a pair of numbers, got {betas!r}")
        for i, b in enumerate(betas):
            check_number("FusedAdam", f"betas[{i}]", b, 0.0, 1.0, high_open=True)
        if not isinstance(group["bias_correction"], bool):
            raise TypeError(f"FusedAdam: bias_correction must be a bool, got {group['bias_correction']!r}")
        for p in group["params"]:
            self._check_param(p)
        group.setdefault("step", 0)  # present from the start, so that distributed checkpointing loads it

    def _check_param(self, p: torch.Tensor) -> None:
        local = local_tensor(p)
        if isinstance(local, QuantizedTensor):
            if not isinstance(local, Float8Tensor):
                raise TypeError(f"FusedAdam: parameter ({describe(p)}) is a {type(local).__name__}; fp8kit's "
                                "FusedAdam updates Float8Tensor and plain float32/bf16/fp16 parameters")
            if not self.master_weights:
                raise ValueError(f"FusedAdam: parameter ({describe(p)}) is a Float8Tensor, which needs "
                                 "master_weights=True (float32 master copies that each step quantizes into the "
                                 "parameter); without them the updates would be lost to FP8 rounding")
        elif local.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"FusedAdam: parameter ({describe(p)}) has dtype {local.dtype}; FusedAdam updates "
                            "float32, bf16, fp16 and Float8Tensor parameters")

    def _needs_master(self, local: torch.Tensor) -> bool:
        """A float32 master is kept for every parameter that is not a plain float32 tensor."""
        return self.master_weights and (isinstance(local, QuantizedTensor) or local.dtype != torch.float32)

    # ---- state (Transformer Engine's public methods) ----

    @torch.no_grad()
    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Create the states of `param`: zero moments and, when it needs one, the float32 master weight (from
        `get_high_precision_init_val()` when available, else the parameter's value)."""
        if store_param_remainders:
            raise NotImplementedError("FusedAdam.initialize_state: store_param_remainders=True is not implemented")
        local = local_tensor(param)
        state = self.state[param]
        zeros = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
        state["exp_avg"] = wrap_like(param, zeros)
        state["exp_avg_sq"] = wrap_like(param, zeros.clone())
        if self._needs_master(local):
            state["master_param"] = wrap_like(param, self._initial_master(param, local))

    @staticmethod
    def _initial_master(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        for holder in (local, param):
            getter = getattr(holder, "get_high_precision_init_val", None)
            value = getter() if callable(getter) else None
            if value is not None:
                if tuple(value.shape) != tuple(local.shape):
                    raise ValueError(f"FusedAdam: get_high_precision_init_val() of a parameter of local shape "
                                     f"{tuple(local.shape)} has shape {tuple(value.shape)}")
                return value.detach().to(device=local.device, dtype=torch.float32, copy=True)
        if isinstance(local, QuantizedTensor):
            return local.dequantize_impl(torch.float32).clone()
        return local.detach().to(torch.float32, copy=True)

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        elif self._needs_master(local_tensor(param)) and "master_param" not in state:
            state["master_param"] = wrap_like(param, self._initial_master(param, local_tensor(param)))
        return state

    def get_unscaled_state(self, param: torch.Tensor, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """The float32 state `state_name` ('exp_avg', 'exp_avg_sq' or 'master_param') of `param` (its local part
        for an FSDP2 parameter). fp8kit keeps every state in float32, so nothing is unscaled."""
        self._check_state_name(state_name)
        state = self.state[param]
        if state_name not in state:
            raise KeyError(f"FusedAdam.get_unscaled_state: the parameter ({describe(param)}) has no {state_name!r} "
                           "state yet")
        return local_tensor(state[state_name])

    @torch.no_grad()
    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Set the state `state_name` of `param` from a high-precision tensor of the parameter's local shape (how
        Transformer Engine's FSDP2 example seeds the master weights from `get_high_precision_init_val()`)."""
        self._check_state_name(state_name)
        local = local_tensor(param)
        if state_name == "master_param" and not self._needs_master(local):
            raise ValueError(f"FusedAdam.set_scaled_state: the parameter ({describe(param)}) has no master weight "
                             f"(master_weights={self.master_weights}; a float32 parameter is its own master)")
        value = local_tensor(unscaled_state)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() \
                or isinstance(value, QuantizedTensor):
            raise TypeError(f"FusedAdam.set_scaled_state: {state_name} must be a float32/bf16/fp16 tensor, got "
                            f"{getattr(value, 'dtype', type(value))}")
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"FusedAdam.set_scaled_state: {state_name} of shape {tuple(value.shape)} does not match "
                             f"the parameter's local shape {tuple(local.shape)}")
        state = self._state_of(param)
        local_tensor(state[state_name]).copy_(value)

    @staticmethod
    def _check_state_name(name: str) -> None:
        if name not in _STATE_NAMES:
            raise ValueError(f"FusedAdam: state_name must be one of {_STATE_NAMES}, got {name!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then the float32 states are set again from `state_dict`: torch casts floating
        states to the parameter's dtype (bf16 for a bf16 or nominally-bf16 FP8 parameter), which would round the
        master weights and moments."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved_ids, params))
        for key, saved in state_dict["state"].items():
            param = id_map.get(key)
            if param is None:
                continue
            local = local_tensor(param)
            state = {}
            for name, value in saved.items():
                self._check_state_name(name)
                if name == "master_param" and not self._needs_master(local):
                    continue  # a float32 parameter is its own master (Transformer Engine keeps a copy it never reads)
                value = local_tensor(value)
                if tuple(value.shape) != tuple(local.shape):
                    raise ValueError(f"FusedAdam.load_state_dict: {name} of shape {tuple(value.shape)} does not "
                                     f"match the parameter's local shape {tuple(local.shape)}")
                state[name] = wrap_like(param, value.detach().to(device=local.device, dtype=torch.float32,
                                                                 copy=True))
            self.state[param] = state

    # ---- the step ----

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset the gradients (`decoupled_grad` with use_decoupled_grad); set_to_none defaults to True."""
        set_to_none = zero_grad_set_to_none("FusedAdam", self.set_grad_none, set_to_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Adam step for every parameter with a gradient; returns `closure()` when given."""
        if grad_scaler is not None:
            raise NotImplementedError("FusedAdam.step: grad_scaler is only used by Transformer Engine's capturable "
                                      "mode, which fp8kit does not implement; unscale the gradients first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # as Transformer Engine: one step counter per group, advanced even when the group is empty here
            group["step"] = group.get("step", 0) + 1
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        rows, write_back = [], []
        for p in group["params"]:
            grad = parameter_gradient(p, self.use_decoupled_grad)
            if grad is None:
                continue
            self._check_param(p)
            local = local_tensor(p)
            if tuple(grad.shape) != tuple(local.shape):
                raise ValueError(f"FusedAdam: the gradient of shape {tuple(grad.shape)} does not match its "
                                 f"parameter ({describe(p)})")
            state = self._state_of(p)
            if self._needs_master(local):
                work = local_tensor(state["master_param"])
                write_back.append((local, work))
            elif local.dtype != torch.float32:  # bf16 / fp16 without master weights: a float32 working copy
                work = local.float()
                write_back.append((local, work))
            else:
                work = local
            rows.append((work, grad if grad.dtype == torch.float32 else grad.float(),
                         local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])))
        if not rows:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        # the fused kernels always divide by 1 - beta**step; at step = inf both corrections are exactly 1
        step_value = float(group["step"]) if group["bias_correction"] else math.inf
        fused = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        for device, (params, grads, exp_avgs, exp_avg_sqs) in by_device(rows).items():
            steps = [torch.full((), step_value, dtype=torch.float32, device=device)] * len(params)
            fused(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                  weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False, maximize=False)
        for local, work in write_back:
            if isinstance(local, QuantizedTensor):
                local.quantize_(work)  # the parameter's quantizer: its recipe's scale, amax recorded or reduced
            else:
                local.copy_(work)
