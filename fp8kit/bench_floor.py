"""The floor of `fp8kit bench --overhead`'s Linear rows: the operations fp8kit's current-scaling Linear runs on the
tensor path, with nothing around them.

`FloorLinear` is a torch.nn.Linear whose forward and backward are one small autograd Function that issues exactly
the torch operations of fp8kit's steady-state current-scaling Linear call on the CPU tensor path (the amax, the
scale rule, the cast, the exact widening of the FP8 values for the emulated GEMM, the GEMMs with alpha read from
memory, the bias gradient) and nothing else: no autocast frame, no plan, no quantizer or storage objects, no
recompute record, no checks. Its outputs and gradients equal te.Linear's bit for bit (tests/test_bench_overhead.py).
Its host time is what those operations cost on the machine; fp8kit's time above it is fp8kit's own Python, and
its time above torch.nn.Linear's is what the operations cost (on a CPU: the FP8 conversions and reductions
themselves, which on a GPU are asynchronous kernels).
"""

from __future__ import annotations

import math

import torch

from fp8kit.pytorch.block_cast import positive_nan_
from fp8kit.pytorch.tensor.storage import WIDEN_BY_TABLE_MIN_NUMEL
from fp8kit.recipe import FLT_MAX, SCALE_MIN, f32

__all__ = ["FloorLinear"]

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {_E4M3: 448.0, _E5M2: 57344.0}
_CODES = {}


def _codes(fp8_dtype: torch.dtype) -> torch.Tensor:
    found = _CODES.get(fp8_dtype)
    if found is None:
        found = _CODES[fp8_dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    return found


def _cast(x: torch.Tensor, fp8_dtype: torch.dtype, c: torch.Tensor):
    """(uint8 bytes, FP8-typed bytes, scale_inv `[1]`) of a current-scaling cast of float32 `x`."""
    clean = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
    if x.device.type == "cpu":
        a = clean.abs_().amax()
    else:
        a = torch.linalg.vector_norm(clean, math.inf, dtype=torch.float32)
    scale = torch.div(torch.addcdiv(c, a, a, value=0), a)
    scale.clamp_(SCALE_MIN, FLT_MAX)
    scale.nan_to_num_(nan=1.0)
    y = torch.mul(x, scale)
    positive_nan_(y.clamp_(-_MAX[fp8_dtype], _MAX[fp8_dtype]))  # on a CPU: NaN made positive, as on a GPU
    q = y.to(fp8_dtype)
    return q.view(torch.uint8), q, torch.reciprocal(scale)


def _widen(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if raw.device.type == "cpu" and raw.numel() >= WIDEN_BY_TABLE_MIN_NUMEL:
        return torch.take(_codes(q.dtype), raw.to(torch.int64))
    return q.to(torch.float32)


def _value(t: torch.Tensor) -> float:
    return t.tolist()[0]


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, c, c_grad):
        x_raw, x_q, x_inv = _cast(x, _E4M3, c)
        w_raw, w_q, w_inv = _cast(weight, _E4M3, c)
        w_values = _widen(w_raw, w_q)
        alpha = f32(_value(x_inv) * _value(w_inv))
        y = torch.addmm(bias, _widen(x_raw, x_q), w_values.t(), alpha=alpha)
        ctx.save_for_backward(x_q, x_inv, w_values, w_inv, c_grad)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_q, x_inv, w_values, w_inv, c_grad = ctx.saved_tensors
        dy = dy.contiguous()
        d_raw, d_q, d_inv = _cast(dy, _E5M2, c_grad)
        d_values = _widen(d_raw, d_q)
        d = _value(d_inv)
        zero = torch.zeros((), dtype=torch.float32)
        dx = torch.addmm(zero, d_values, w_values, beta=0, alpha=f32(d * _value(w_inv)))
        dw = torch.addmm(zero, d_values.t(), _widen(x_q.view(torch.uint8), x_q), beta=0,
                         alpha=f32(d * _value(x_inv)))
        return dx, dw, dy.sum(0), None, None


class FloorLinear(torch.nn.Linear):
    """torch.nn.Linear (float32, with bias, 2-D inputs) computed as fp8kit's Linear under Float8CurrentScaling() on
    the tensor path: inputs and weights in E4M3, gradients in E5M2 (the default HYBRID format)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.register_buffer("_c", torch.full((1,), _MAX[_E4M3]), persistent=False)
        self.register_buffer("_c_grad", torch.full((1,), _MAX[_E5M2]), persistent=False)

    def forward(self, x):
        return _Floor.apply(x, self.weight, self.bias, self._c, self._c_grad)
