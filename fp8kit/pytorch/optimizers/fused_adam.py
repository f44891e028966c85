"""FusedAdam: Transformer Engine's Adam/AdamW optimizer (`transformer_engine.pytorch.optimizers.FusedAdam`) with its
signature and semantics, for plain and FP8 (Float8Tensor) parameters, on CPUs and GPUs.

"Fused" here means one `torch._fused_adamw_` (or `torch._fused_adam_`) call per parameter group and device, on
float32 tensors: the parameters that are float32, the float32 master copies of the others, and float32 values of the
moments. So the master weights take exactly the values `torch.optim.AdamW(fused=True)` (or `Adam`) would give the
same float32 tensors; Transformer Engine's CUDA kernel orders its float32 operations a little differently, so the two
agree to float32 rounding, not bit for bit.

- Quantized parameters (from `quantized_model_init`: Float8Tensor, or the block recipes' MXFP8Tensor,
  Float8BlockwiseQTensor, NVFP4Tensor) need `master_weights=True`. Each step updates the float32
  master and quantizes it into the parameter with the parameter's quantizer (`param.quantize_(master)`): delayed
  scaling casts with the module state's current scale and records the amax, as Transformer Engine's fused FP8 Adam
  kernel does; current scaling casts with the master's own amax (all-reduced over the FSDP2 mesh for a sharded
  parameter, see fp8kit.pytorch.fsdp).
- bf16 / fp16 parameters: with `master_weights=True` a float32 master is kept and rounded into the parameter after each
  step; without, the step runs on a float32 copy of the parameter (the moments are float32 either way).
- float32 parameters are updated in place (they are their own master).
- Narrower states (Transformer Engine's options, see adam_states.py): `exp_avg_dtype` / `exp_avg_sq_dtype` of bf16,
  fp16 (with a per-tensor scale) or uint8 (an E4M3 Float8Tensor), `master_weight_dtype=torch.float16` (scaled), and
  `store_param_remainders` (bf16 parameters whose float32 masters are rebuilt from the parameter and int16
  remainders). Each step unscales them to float32, steps, and stores them again rounded once; `state_dict()` holds
  them unscaled in float32 (the remainders as int16), as Transformer Engine's does.
- `capturable=True`: the learning rate and the step counter are tensors on the parameters' device (no host value is
  read in the step), and `step(grad_scaler=...)` unscales the gradients and skips the step on an inf/NaN gradient
  without a host synchronisation, as `torch.amp.GradScaler` asks of optimizers that support it.
- FSDP2 parameters (DTensors) are updated through their local shards; the states are DTensors with the same
  placements, so `torch.distributed.checkpoint` sees them sharded.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterable, Optional

import torch

from ..quantized_tensor import QuantizedTensor
from ..tensor.block_storage import BlockScaledTensorMixin
from ..tensor.float8_tensor import Float8Tensor
from . import adam_states
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
            "use_decoupled_grad", "store_param_remainders", "set_grad_none", "_scales")


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
    master_weight_dtype: float32 or float16 (scaled); exp_avg_dtype, exp_avg_sq_dtype: float32, float16 (scaled),
      bfloat16 or uint8 (FP8 E4M3, scaled); store_param_remainders: keep only int16 remainders as the float32 masters
      of bf16 parameters (with master_weights and float32 masters; no effect otherwise); capturable: see the module
      docstring (float32 masters, both moments float32 or both bf16, no FP8 parameters, no remainders, as in
      Transformer Engine).
    amsgrad raises NotImplementedError (nor does Transformer Engine's FusedAdam support it); a `grad_scaler` passed
    to `step` without capturable=True raises NotImplementedError (GradScaler unscales the gradients itself then).
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
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"FusedAdam: master_weight_dtype must be torch.float32 or torch.float16, got "
                             f"{master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in adam_states.MOMENT_DTYPES:
                raise ValueError(f"FusedAdam: {name} must be torch.float32, torch.float16, torch.bfloat16 or "
                                 f"torch.uint8 (FP8), got {dtype}")
        store_param_remainders = bool(store_param_remainders) and master_weights \
            and master_weight_dtype == torch.float32  # as Transformer Engine: no effect otherwise
        if capturable:
            if master_weights and master_weight_dtype != torch.float32:
                raise ValueError("FusedAdam(capturable=True) needs float32 master weights")
            if not (exp_avg_dtype == exp_avg_sq_dtype and exp_avg_dtype in (torch.float32, torch.bfloat16)):
                raise ValueError(f"FusedAdam(capturable=True) needs exp_avg_dtype and exp_avg_sq_dtype both "
                                 f"torch.float32 or both torch.bfloat16, got {exp_avg_dtype} and {exp_avg_sq_dtype}")
            if store_param_remainders:
                raise ValueError("FusedAdam(capturable=True) cannot store_param_remainders")
        for name, flag in (("bias_correction", bias_correction), ("adam_w_mode", adam_w_mode),
                           ("master_weights", master_weights), ("use_decoupled_grad", use_decoupled_grad)):
            if not isinstance(flag, bool):
                raise TypeError(f"FusedAdam: {name} must be a bool, got {flag!r}")
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = bool(capturable)
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders
        self._scales: dict = {}  # param -> {state name: float32 scale} of the float16 / uint8 states
        self._step_supports_amp_scaling = self.capturable  # GradScaler passes itself to step(grad_scaler=...)
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
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if self.capturable:  # a tensor on the parameters' device, as Transformer Engine's
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)
            group.setdefault("step", torch.zeros(1, dtype=torch.int32, device=device))
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
            if not isinstance(local, (Float8Tensor, BlockScaledTensorMixin)):
                raise TypeError(f"FusedAdam: parameter ({describe(p)}) is a {type(local).__name__}; fp8kit's "
                                "FusedAdam updates Float8Tensor, MXFP8Tensor, Float8BlockwiseQTensor, NVFP4Tensor "
                                "and plain float32/bf16/fp16 parameters")
            if not self.master_weights:
                raise ValueError(f"FusedAdam: parameter ({describe(p)}) is a {type(local).__name__}, which needs "
                                 "master_weights=True (float32 master copies that each step quantizes into the "
                                 "parameter); without them the updates would be lost to FP8 rounding")
        elif local.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"FusedAdam: parameter ({describe(p)}) has dtype {local.dtype}; FusedAdam updates "
                            "float32, bf16, fp16 and Float8Tensor parameters")

    def _needs_master(self, local: torch.Tensor) -> bool:
        """A float32 master is kept for every parameter that is not a plain float32 tensor."""
        return self.master_weights and (isinstance(local, QuantizedTensor) or local.dtype != torch.float32)

    # ---- state (Transformer Engine's public methods) ----

    def _remainders(self, local: torch.Tensor) -> bool:
        """bf16 parameters whose float32 masters are kept as int16 remainders (store_param_remainders)."""
        return self.store_param_remainders and not isinstance(local, QuantizedTensor) \
            and local.dtype == torch.bfloat16

    def _scale(self, param: torch.Tensor, name: str) -> Optional[torch.Tensor]:
        return self._scales.get(param, {}).get(name)

    @torch.no_grad()
    def _put(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Create or overwrite the state `name` of `param` from float32 values, stored in its dtype."""
        local, state = local_tensor(param), self.state[param]
        dtype = {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                 "master_param": self.master_weight_dtype}[name]
        if name in state:
            adam_states.store(local_tensor(state[name]), self._scale(param, name), value)
            return
        stored, scale = adam_states.new_state(dtype, local.shape, local.device, value)
        state[name] = wrap_like(param, stored)
        if scale is not None:
            self._scales.setdefault(param, {})[name] = scale

    @torch.no_grad()
    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Create the states of `param`: zero moments and, when it needs one, the master weight (from
        `get_high_precision_init_val()` when available, else the parameter's value; for a bf16 parameter with
        `store_param_remainders`, zero remainders: the master starts as the parameter)."""
        local = local_tensor(param)
        zeros = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
        for name in ("exp_avg", "exp_avg_sq"):
            self._put(param, name, zeros)
        if not self._needs_master(local):
            return
        if self._remainders(local) or (store_param_remainders and self.master_weights
                                       and not isinstance(local, QuantizedTensor) and local.dtype == torch.bfloat16):
            self.state[param]["master_param"] = wrap_like(param, torch.zeros(local.shape, dtype=torch.int16,
                                                                             device=local.device))
        else:
            self._put(param, "master_param", adam_states.initial_master(param, local))

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        elif self._needs_master(local_tensor(param)) and "master_param" not in state:
            self._put(param, "master_param", adam_states.initial_master(param, local_tensor(param)))
        return state

    def get_unscaled_state(self, param: torch.Tensor, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """The state `state_name` ('exp_avg', 'exp_avg_sq' or 'master_param') of `param` (its local part for an FSDP2
        parameter) in float32: the state itself when it is stored in float32, else its unscaled values; a bf16 state
        as it is with `skip_unscale`; the int16 remainders of a `store_param_remainders` master as they are (as in
        Transformer Engine)."""
        self._check_state_name(state_name)
        state = self.state[param]
        if state_name not in state:
            raise KeyError(f"FusedAdam.get_unscaled_state: the parameter ({describe(param)}) has no {state_name!r} "
                           "state yet")
        stored = local_tensor(state[state_name])
        if stored.dtype == torch.int16 or (skip_unscale and stored.dtype == torch.bfloat16):
            return stored
        return adam_states.unscaled(stored, self._scale(param, state_name))

    @torch.no_grad()
    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Set the state `state_name` of `param` from a high-precision tensor of the parameter's local shape (how
        Transformer Engine's FSDP2 example seeds the master weights from `get_high_precision_init_val()`), stored in
        the state's dtype; the master of a `store_param_remainders` parameter takes int16 remainders, or a float32
        master whose low 16 bits become them."""
        self._check_state_name(state_name)
        local = local_tensor(param)
        if state_name == "master_param" and not self._needs_master(local):
            raise ValueError(f"FusedAdam.set_scaled_state: the parameter ({describe(param)}) has no master weight "
                             f"(master_weights={self.master_weights}; a float32 parameter is its own master)")
        value = local_tensor(unscaled_state)
        remainders = state_name == "master_param" and self._remainders(local)
        if not isinstance(value, torch.Tensor) or isinstance(value, QuantizedTensor) \
                or not (value.is_floating_point() or (remainders and value.dtype == torch.int16)):
            raise TypeError(f"FusedAdam.set_scaled_state: {state_name} must be a float32/bf16/fp16 tensor"
                            + (" or int16 remainders" if remainders else "")
                            + f", got {getattr(value, 'dtype', type(value))}")
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"FusedAdam.set_scaled_state: {state_name} of shape {tuple(value.shape)} does not match "
                             f"the parameter's local shape {tuple(local.shape)}")
        state = self._state_of(param)
        value = value.to(local.device)
        if remainders:
            low = value if value.dtype == torch.int16 else adam_states.split_master(value.float().contiguous())[1]
            local_tensor(state[state_name]).copy_(low)
        else:
            self._put(param, state_name, value.float())

    @staticmethod
    def _check_state_name(name: str) -> None:
        if name not in _STATE_NAMES:
            raise ValueError(f"FusedAdam: state_name must be one of {_STATE_NAMES}, got {name!r}")

    def state_dict(self) -> dict:
        """torch's state_dict with every state unscaled to float32 (int16 remainders as they are), as Transformer
        Engine's: a checkpoint does not depend on the state dtypes."""
        out = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for index, saved in out["state"].items():
            param = params[index]
            out["state"][index] = {name: wrap_like(param, self.get_unscaled_state(param, name)) for name in saved}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then the states are set again from `state_dict` in their dtypes: torch casts
        floating states to the parameter's dtype (bf16 for a bf16 or nominally-bf16 FP8 parameter), which would round
        the master weights and moments."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved_ids, params))
        for key, saved in state_dict["state"].items():
            param = id_map.get(key)
            if param is None:
                continue
            local = local_tensor(param)
            for name in saved:
                self._check_state_name(name)
            self.state[param] = {}
            self._scales.pop(param, None)
            for name, value in saved.items():
                if name == "master_param" and not self._needs_master(local):
                    continue  # a float32 parameter is its own master (Transformer Engine keeps a copy it never reads)
                if name == "master_param" and self._remainders(local):
                    self.state[param][name] = wrap_like(param, torch.zeros(local.shape, dtype=torch.int16,
                                                                           device=local.device))
                self.set_scaled_state(param, name, value)

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
        """One Adam step for every parameter with a gradient; returns `closure()` when given. `grad_scaler` (a
        torch.amp.GradScaler, capturable=True only): unscale the gradients, skip the step where they hold inf/NaN."""
        if grad_scaler is not None and not self.capturable:
            raise NotImplementedError("FusedAdam.step: grad_scaler is only used in capturable mode (as in Transformer "
                                      "Engine); otherwise GradScaler unscales the gradients before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # as Transformer Engine: one step counter per group, advanced even when the group is empty here
            found_inf = grad_scale = None
            if self.capturable:  # in place: a captured graph keeps reading the same tensor
                step = group["step"]
                if grad_scaler is not None and group["params"]:
                    found_inf = grad_scaler._check_inf_per_device(self)[step.device]
                    grad_scale = grad_scaler._get_scale_async()
                    step.add_((found_inf == 0).to(step.dtype).reshape(step.shape))
                else:
                    step.add_(1)
            else:
                group["step"] = group.get("step", 0) + 1
            self._step_group(group, found_inf, grad_scale)
        return loss

    def _step_group(self, group: dict, found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> None:
        rows, updated = [], []
        for p in group["params"]:
            grad = parameter_gradient(p, self.use_decoupled_grad)
            if grad is None:
                continue
            self._check_param(p)
            local = local_tensor(p)
            if self.capturable and isinstance(local, QuantizedTensor):
                raise ValueError(f"FusedAdam(capturable=True): parameter ({describe(p)}) is quantized; its write-back "
                                 "after the step cannot be captured (as in Transformer Engine)")
            if tuple(grad.shape) != tuple(local.shape):
                raise ValueError(f"FusedAdam: the gradient of shape {tuple(grad.shape)} does not match its "
                                 f"parameter ({describe(p)})")
            state = self._state_of(p)
            moments = [self.get_unscaled_state(p, name) for name in ("exp_avg", "exp_avg_sq")]
            master = local_tensor(state["master_param"]) if self._needs_master(local) else None
            if master is not None and master.dtype == torch.int16:
                work = adam_states.join_master(local, master)
            elif master is not None:
                work = self.get_unscaled_state(p, "master_param")
            elif local.dtype != torch.float32:  # bf16 / fp16 without master weights: a float32 working copy
                work = local.float()
            else:
                work = local
            rows.append((work, grad if grad.dtype == torch.float32 else grad.float(), *moments))
            updated.append((p, local, master, work, moments))
        if not rows:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        lr = group["lr"] if isinstance(group["lr"], torch.Tensor) else float(group["lr"])
        fused = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        for device, (params, grads, exp_avgs, exp_avg_sqs) in by_device(rows).items():
            fused(params, grads, exp_avgs, exp_avg_sqs, [], adam_states.step_tensors(group, device, len(params)), lr=lr,
                  beta1=beta1, beta2=beta2, weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                  amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        for p, local, master, work, moments in updated:
            for name, value in zip(("exp_avg", "exp_avg_sq"), moments):
                adam_states.store(local_tensor(self.state[p][name]), self._scale(p, name), value)
            if master is not None and master.dtype == torch.int16:
                high, low = adam_states.split_master(work)
                local.view(torch.int16).copy_(high)
                master.copy_(low)
                continue
            if master is not None:
                adam_states.store(master, self._scale(p, "master_param"), work)
            if isinstance(local, QuantizedTensor):
                local.quantize_(work)  # the parameter's quantizer: its recipe's scale, amax recorded or reduced
            elif local is not work:
                local.copy_(work)
