"""What fp8kit's optimizers share: the local tensor of an FSDP2 (DTensor) parameter, the gradient to read, the
check of hyper-parameters, and one fused call per device."""

from __future__ import annotations

import math
import sys
import warnings
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..quantized_tensor import QuantizedTensor

__all__ = ["local_tensor", "wrap_like", "parameter_gradient", "check_number", "by_device", "describe"]


def _dtensor_type():
    # no import: a DTensor can only exist once torch.distributed.tensor is loaded (importing it costs seconds)
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: `t._local_tensor` for a DTensor (an FSDP2 parameter), else `t` itself."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t._local_tensor
    return t


def wrap_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (shaped like the local tensor of `param`) as a DTensor with `param`'s mesh and placements when `param`
    is a DTensor (so that distributed checkpointing sees sharded optimizer states), else `value` itself."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(param, dtensor):
        return dtensor.from_local(value, device_mesh=param.device_mesh, placements=param.placements,
                                  shape=param.size(), stride=param.stride())
    return value


def parameter_gradient(p: torch.Tensor, decoupled: bool) -> Optional[torch.Tensor]:
    """The local gradient of `p` (`p.decoupled_grad` when `decoupled`, else `p.grad`), or None."""
    grad = getattr(p, "decoupled_grad", None) if decoupled else p.grad
    if grad is None:
        return None
    if grad.is_sparse:
        raise RuntimeError(f"fp8kit optimizers do not support sparse gradients (parameter {describe(p)})")
    return local_tensor(grad)


def check_number(where: str, name: str, value, low: float, high: float = math.inf, high_open: bool = False) -> float:
    """`float(value)`, after checking that it is a finite number in [low, high] (or [low, high) if `high_open`)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: {name} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {value!r}")
    v = float(value)
    ok = low <= v and (v < high if high_open else v <= high) and math.isfinite(v)
    if not ok:
        bound = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"{where}: {name} must be a finite number in {bound}, got {value!r}")
    return v


def describe(p: torch.Tensor) -> str:
    local = local_tensor(p)
    kind = type(local).__name__ if isinstance(local, QuantizedTensor) else str(local.dtype)
    return f"{kind} of shape {tuple(p.shape)}"


def by_device(rows: Iterable[Tuple[torch.Tensor, ...]]) -> Dict[torch.device, List[List[torch.Tensor]]]:
    """Rows of tensors (one row per parameter) grouped by the device of their first tensor, as columns."""
    out: Dict[torch.device, List[List[torch.Tensor]]] = defaultdict(list)
    for row in rows:
        cols = out[row[0].device]
        if not cols:
            cols.extend([] for _ in row)
        for col, t in zip(cols, row):
            col.append(t)
    return out


class KeepsOptions:
    """Mixed into an Optimizer whose options live as attributes named in `_OPTIONS`: torch's
    `Optimizer.__getstate__` keeps only defaults, state and param_groups, so pickles and deep copies add them."""

    _OPTIONS: Tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._OPTIONS})
        return state


def deprecated_set_grad_none(kind: str, set_grad_none: Optional[bool]) -> Optional[bool]:
    """Transformer Engine's constructor argument `set_grad_none`, deprecated there with this warning."""
    if set_grad_none is not None:
        warnings.warn(f"set_grad_none kwarg in {kind} constructor is deprecated. Use set_to_none kwarg in "
                      "zero_grad instead.", DeprecationWarning, stacklevel=3)
    return set_grad_none


def zero_grad_set_to_none(kind: str, set_grad_none: Optional[bool], set_to_none: Optional[bool]) -> bool:
    """What `zero_grad(set_to_none)` does: the constructor's `set_grad_none` wins (a conflicting argument is an
    error, as in Transformer Engine); default True."""
    if set_grad_none is not None:
        if set_to_none is not None and set_to_none != set_grad_none:
            raise ValueError(f"Called zero_grad with set_to_none={set_to_none}, but {kind} was initialized "
                             f"with set_grad_none={set_grad_none}")
        set_to_none = set_grad_none
    return True if set_to_none is None else set_to_none
