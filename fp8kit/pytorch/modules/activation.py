"""The activation functions of Transformer Engine's MLPs, by name, as functions (shared by LayerNormMLP and the
attention / TransformerLayer modules).

Formulas (Transformer Engine's `transformer_engine/common/util/math.h` and its gated-activation kernels):

  gelu    x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) / 2     (the tanh approximation, not erf)
  qgelu   x * sigmoid(1.702 x)                                    ("quick GELU")
  relu    max(x, 0)
  srelu   max(x, 0)^2                                             (squared ReLU)
  silu    x * sigmoid(x)

The gated variants `glu` (sigmoid), `geglu`, `qgeglu`, `reglu`, `sreglu`, `swiglu` (silu) split the last dimension
in two halves `a, b = x[..., :n], x[..., n:]` and compute `act(a) * b`: Transformer Engine gates with the FIRST half
(torch.nn.functional.glu gates with the second). A layer feeding a gated activation therefore has twice the
outputs. `clamped_swiglu` (GPT-OSS) is `qgelu_alpha(min(a, limit)) * (clamp(b, -limit, limit) + glu_linear_offset)`
with `activation_params` `limit` (7.0), `alpha` (1.702), `glu_linear_offset` (1.0).

As in Transformer Engine's kernels, the function is computed in float32 for bfloat16 / float16 inputs (in the input's
dtype otherwise) and rounded once to the input's dtype. `activation` uses plain torch operations (autograd saves what
they save); `activation_saving_input` gives the same numbers, forward and backward, but saves only its input and
recomputes the function in the backward pass (once differentiable; plain operations under torch.compile).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "check_activation", "is_gated", "activation",
           "activation_saving_input"]


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x, alpha: float = 1.702):
    return x * torch.sigmoid(alpha * x)


def _srelu(x):
    return torch.square(F.relu(x))


_ELEMENTWISE: Dict[str, Callable] = {"gelu": _gelu, "qgelu": _qgelu, "relu": F.relu, "srelu": _srelu,
                                     "silu": F.silu}
_GATES: Dict[str, Callable] = {"glu": torch.sigmoid, "geglu": _gelu, "qgeglu": _qgelu, "reglu": F.relu,
                               "sreglu": _srelu, "swiglu": F.silu}
_CLAMPED_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}

GATED_ACTIVATIONS = tuple(_GATES) + ("clamped_swiglu",)
ACTIVATIONS = tuple(_ELEMENTWISE) + GATED_ACTIVATIONS


def is_gated(name: str) -> bool:
    """Whether activation `name` halves the last dimension (its input layer has twice the outputs)."""
    return name in GATED_ACTIVATIONS


def check_activation(where: str, name, params: Optional[dict] = None) -> dict:
    """Validate an activation name and its `activation_params`; returns the parameters to call it with."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {', '.join(ACTIVATIONS)}; got {name!r}")
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"{where}: activation_params must be a dict or None, got {params!r}")
    if name != "clamped_swiglu":
        if params:
            raise ValueError(f"{where}: activation {name!r} takes no activation_params, got {params!r}")
        return {}
    unknown = sorted(set(params or {}) - set(_CLAMPED_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown activation_params {unknown} for 'clamped_swiglu' (known: "
                         f"{', '.join(_CLAMPED_DEFAULTS)})")
    merged = dict(_CLAMPED_DEFAULTS, **(params or {}))
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{where}: activation_params[{key!r}] must be a number, got {value!r}")
    if merged["limit"] <= 0:
        raise ValueError(f"{where}: activation_params['limit'] must be > 0, got {merged['limit']!r}")
    return merged


def _compute(name: str, x: torch.Tensor, params: dict) -> torch.Tensor:
    """The function in the compute dtype (float32 for 16-bit inputs), rounded to x's dtype."""
    xc = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    if name in _ELEMENTWISE:
        y = _ELEMENTWISE[name](xc)
    else:
        if xc.shape[-1] % 2:
            raise ValueError(f"activation {name!r} splits the last dimension in two halves; got size {xc.shape[-1]}")
        a, b = xc.chunk(2, dim=-1)
        if name == "clamped_swiglu":
            limit = params["limit"]
            y = _qgelu(a.clamp(max=limit), params["alpha"]) * (b.clamp(-limit, limit) + params["glu_linear_offset"])
        else:
            y = _GATES[name](a) * b
    return y.to(x.dtype)


def activation(name: str, x: torch.Tensor, params: Optional[dict] = None) -> torch.Tensor:
    """Activation `name` of `x` with plain torch operations (any order of derivatives)."""
    return _compute(name, x, check_activation("activation", name, params))


def activation_saving_input(name: str, x: torch.Tensor, params: Optional[dict] = None) -> torch.Tensor:
    """`activation(name, x)`, bit for bit, forward and backward, saving only `x` for the backward pass (which
    recomputes the function): Transformer Engine's memory footprint for the activation."""
    params = check_activation("activation", name, params)
    # under torch.compile: plain operations (dynamo cannot trace the backward's autograd.grad; the compiled graph
    # decides itself what to save or recompute)
    if not (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
        return _compute(name, x, params)
    return _SavingInput.apply(x, name, params)


class _SavingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, params):
        ctx.name, ctx.params = name, params
        ctx.save_for_backward(x)
        return _compute(name, x, params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            y = _compute(ctx.name, leaf, ctx.params)
        (dx,) = torch.autograd.grad(y, leaf, dy)
        return dx, None, None
