"""Shared by the LayerNormMLP tests: the activations written again from Transformer Engine's formulas (independently
of fp8kit/pytorch/modules/activation.py), and the same MLP built from fp8kit's separate modules."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te

GATED = ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")
ALL = ("gelu", "qgelu", "relu", "srelu", "silu") + GATED


def _gate_fn(name):
    base = {"glu": "sigmoid", "geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
            "swiglu": "silu"}
    return base.get(name, name)


def _torch_elementwise(name, x):
    if name == "gelu":
        return F.gelu(x, approximate="tanh")
    if name == "qgelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "relu":
        return F.relu(x)
    if name == "srelu":
        return F.relu(x) ** 2
    if name == "silu":
        return F.silu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    raise KeyError(name)


def torch_activation(name, x, limit=7.0, alpha=1.702, offset=1.0):
    """The activation in float32 for 16-bit inputs, rounded to x's dtype; gated ones gate with the FIRST half."""
    xc = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    if name not in GATED:
        return _torch_elementwise(name, xc).to(x.dtype)
    a, b = torch.chunk(xc, 2, dim=-1)  # (slicing would give the same values but +0.0 for some -0.0 gradients)
    if name == "clamped_swiglu":
        a = torch.clamp(a, max=limit)
        return (a * torch.sigmoid(alpha * a) * (torch.clamp(b, min=-limit, max=limit) + offset)).to(x.dtype)
    return (_torch_elementwise(_gate_fn(name), a) * b).to(x.dtype)


def te_formula64(name, x, limit=7.0, alpha=1.702, offset=1.0):
    """Transformer Engine's formulas (common/util/math.h, gated kernels) in float64 NumPy."""
    x = np.asarray(x, dtype=np.float64)

    def one(n, v):
        if n == "gelu":
            return v * (0.5 + 0.5 * np.tanh(v * (0.79788456 + 0.03567741 * v * v)))
        if n == "qgelu":
            return v / (1.0 + np.exp(-1.702 * v))
        if n == "relu":
            return np.maximum(v, 0.0)
        if n == "srelu":
            return np.where(v > 0, v * v, 0.0)
        if n == "silu":
            return v / (1.0 + np.exp(-v))
        if n == "sigmoid":
            return 1.0 / (1.0 + np.exp(-v))
        raise KeyError(n)

    if name not in GATED:
        return one(name, x)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    if name == "clamped_swiglu":
        a = np.minimum(a, limit)
        return a / (1.0 + np.exp(-alpha * a)) * (np.clip(b, -limit, limit) + offset)
    return one(_gate_fn(name), a) * b


class Composition(torch.nn.Module):
    """norm -> te.Linear -> activation -> te.Linear, with the parameters of a LayerNormMLP copied over."""

    def __init__(self, mlp):
        super().__init__()
        dtype = mlp.fc1_weight.dtype
        norm_cls = te.LayerNorm if mlp.normalization == "LayerNorm" else te.RMSNorm
        self.norm = norm_cls(mlp.hidden_size, eps=mlp.eps, zero_centered_gamma=mlp.zero_centered_gamma,
                             params_dtype=dtype)
        bias = mlp.fc1_bias is not None
        self.fc1 = te.Linear(mlp.hidden_size, mlp.fc1_weight.shape[0], bias=bias, params_dtype=dtype)
        self.fc2 = te.Linear(mlp.fc2_weight.shape[1], mlp.hidden_size, bias=bias, params_dtype=dtype,
                             return_bias=mlp.return_bias)
        self.name, self.params = mlp.activation, mlp.activation_params
        with torch.no_grad():
            self.norm.weight.copy_(mlp.layer_norm_weight)
            if mlp.layer_norm_bias is not None:
                self.norm.bias.copy_(mlp.layer_norm_bias)
            self.fc1.weight.copy_(mlp.fc1_weight)
            self.fc2.weight.copy_(mlp.fc2_weight)
            if bias:
                self.fc1.bias.copy_(mlp.fc1_bias)
                self.fc2.bias.copy_(mlp.fc2_bias)

    def forward(self, x, is_first_microbatch=None):
        params = self.params or {}
        kw = {k: params[k] for k in ("limit", "alpha")} if params else {}
        if params:
            kw["offset"] = params["glu_linear_offset"]
        h = self.fc1(self.norm(x), is_first_microbatch=is_first_microbatch)
        return self.fc2(torch_activation(self.name, h, **kw), is_first_microbatch=is_first_microbatch)

    def fused_grads(self):
        """The gradients in LayerNormMLP's parameter order."""
        grads = [self.norm.weight.grad]
        if hasattr(self.norm, "bias"):
            grads.append(self.norm.bias.grad)
        grads.append(self.fc1.weight.grad)
        if self.fc1.bias is not None:
            grads.append(self.fc1.bias.grad)
        grads.append(self.fc2.weight.grad)
        if self.fc2.bias is not None:
            grads.append(self.fc2.bias.grad)
        return grads

    def fused_states(self):
        """fc1's and fc2's FP8 states laid out as LayerNormMLP's: (fwd history, fwd scale, bwd history, bwd scale)."""
        out = []
        for name in ("scaling_fwd", "scaling_bwd"):
            a, b = self.fc1.fp8_meta[name], self.fc2.fp8_meta[name]
            out += [torch.cat([a.amax_history, b.amax_history], dim=1), torch.cat([a.scale, b.scale])]
        return out


def mlp_states(mlp):
    out = []
    for name in ("scaling_fwd", "scaling_bwd"):
        s = mlp.fp8_meta[name]
        out += [s.amax_history.clone(), s.scale.clone()]
    return out
