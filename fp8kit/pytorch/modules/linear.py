"""fp8kit's Linear: a drop-in for torch.nn.Linear whose three GEMMs run in FP8 inside `autocast`.

The three GEMMs of `y = x @ W.T + b`, for x `[M, K]`, W `[N, K]`, dy `[M, N]`:

  fprop  y  = x  @ W.T    x: input slot (forward 0), W: weight slot (forward 1)      E4M3 under HYBRID
  dgrad  dx = dy @ W      dy: grad_output slot (backward 0), W: the FP8 weight        dy E5M2 under HYBRID
  wgrad  dW = dy.T @ x    dy and the FP8 input saved by the forward pass

Each accumulates in float32 and produces the input's dtype. The forward pass saves the FP8 input and the FP8
weight, not the high-precision ones, unless a GEMM that needs them is overridden to high precision. The bias
gradient is `dy.sum(0)` in high precision.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...recipe import DelayedScaling
from ..autocast import current_frame
from ..cast import fp8_dtype_of
from ..gemm import check_cuda_shape, gemm
from ..quantizer import CurrentQuantizer, DelayedQuantizer
from ..tensor import Float8Tensor
from .base import FP8StateMixin


class _Plan:
    """What one forward call decided: quantizers per role, which GEMMs run in FP8, bookkeeping hooks."""

    __slots__ = ("input_q", "weight_q", "grad_q", "fp8", "calibrate", "weight_fp8", "step", "track_backward")

    def __init__(self, input_q, weight_q, grad_q, fp8, calibrate, weight_fp8, step, track_backward):
        self.input_q, self.weight_q, self.grad_q = input_q, weight_q, grad_q
        self.fp8 = fp8  # (fprop, dgrad, wgrad)
        self.calibrate = calibrate
        self.weight_fp8: Optional[Float8Tensor] = weight_fp8
        self.step, self.track_backward = step, track_backward


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: _Plan):
        fprop, dgrad, wgrad = plan.fp8
        x_fp8 = w_fp8 = None
        if plan.calibrate:
            plan.input_q.observe(x)
            plan.weight_q.observe(weight)
        if fprop or wgrad:
            x_fp8 = plan.input_q.quantize(x)
        if fprop or dgrad:
            if plan.weight_fp8 is None:
                plan.weight_fp8 = plan.weight_q.quantize(weight)
            w_fp8 = plan.weight_fp8
        if fprop:
            y = gemm(x_fp8, w_fp8.t(), x.dtype, bias, use_fast_accum=True)
        else:
            y = F.linear(x, weight, bias)
        # Save FP8 operands where the backward GEMM is FP8, high-precision ones only where it is not.
        ctx.save_for_backward(
            x_fp8.data if wgrad else x,
            x_fp8.scale_inv if wgrad else None,
            w_fp8.data if dgrad else weight,
            w_fp8.scale_inv if dgrad else None,
        )
        ctx.plan = plan
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan = ctx.plan
        _, dgrad, wgrad = plan.fp8
        x_saved, x_inv, w_saved, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.contiguous()
        if plan.calibrate:
            plan.grad_q.observe(dy)
        dy_fp8 = plan.grad_q.quantize(dy) if (dgrad or wgrad) else None
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if dgrad:
                dx = gemm(dy_fp8, Float8Tensor(w_saved, w_inv), x_dtype)
            else:
                dx = dy @ w_saved
        if ctx.needs_input_grad[1]:
            if wgrad:
                dw = gemm(dy_fp8.t(), Float8Tensor(x_saved, x_inv), w_dtype)
            else:
                dw = dy.t() @ x_saved
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        if plan.track_backward:
            plan.step.backward_done()
        return dx, dw, db, None


class Linear(FP8StateMixin, torch.nn.Linear):
    """`y = x @ weight.T + bias`, with FP8 GEMMs inside `fp8kit.pytorch.autocast`.

    A drop-in for torch.nn.Linear: same parameter names (`weight` `[out_features, in_features]`, `bias`
    `[out_features]`), same initialisation, same state_dict keys for them, and exactly torch.nn.Linear's behaviour
    outside an enabled autocast. Inputs have any leading dimensions: `[..., in_features] -> [..., out_features]`.

    Args:
      in_features, out_features, bias: as torch.nn.Linear.
      params_dtype: dtype of the parameters (default: torch's default dtype); `dtype` is accepted as an alias.
      device: where the parameters live (default: torch's default device, not CUDA as in Transformer Engine).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None, *, dtype: Optional[torch.dtype] = None):
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"Linear: params_dtype={params_dtype} and dtype={dtype} disagree")
        torch.nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device,
                                 dtype=params_dtype if params_dtype is not None else dtype)
        self._init_fp8_meta(num_gemms=1)
        self._weight_fp8: Optional[Float8Tensor] = None
        self.fp8_stats = None  # a fp8kit.pytorch.stats.ModuleStats while fp8kit.pytorch.enable_stats is on

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """`inp` `[..., in_features]`. `is_first_microbatch`: None casts the weight at every call; True casts it
        and caches the FP8 weight; False reuses that cache (gradient accumulation over microbatches)."""
        frame = current_frame()
        if frame is None or not (frame.enabled or frame.records_amax):
            return F.linear(inp, self.weight, self.bias)
        inp, weight, bias = self._operands(inp)
        leading = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        recipe = frame.recipe
        fp8 = tuple(frame.enabled and not o for o in recipe.override_linear_precision)
        if x.is_cuda and any(fp8):
            check_cuda_shape(x.shape[0], self.in_features, self.out_features)
        input_q, weight_q, grad_q = self._quantizers(frame, weight.device)
        if self.fp8_stats is not None:
            self.fp8_stats.attach(input_q, weight_q, grad_q)
        cached = self._cached_weight(is_first_microbatch, frame.enabled, weight_q.fp8_dtype)
        needs_backward = torch.is_grad_enabled() and (
            inp.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        track = frame.records_amax and needs_backward
        if frame.records_amax:
            frame.step.forward_called(frame.key, needs_backward)
        plan = _Plan(input_q, weight_q, grad_q, fp8, not frame.enabled, cached, frame.step, track)
        with torch.autocast(x.device.type, enabled=False):
            y = _LinearFunction.apply(x, weight, bias, plan)
        if is_first_microbatch is not None and frame.enabled:
            self._weight_fp8 = plan.weight_fp8
        return y.reshape(*leading, self.out_features)

    def _operands(self, inp: torch.Tensor):
        if not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
            raise TypeError(f"Linear: input must be a floating tensor, got {getattr(inp, 'dtype', type(inp))}")
        if inp.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"Linear: input of shape {tuple(inp.shape)} does not end with in_features={self.in_features}")
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(inp.device.type):
            dtype = torch.get_autocast_dtype(inp.device.type)
            inp, weight = inp.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if inp.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            raise TypeError(
                f"Linear: input dtype {inp.dtype} does not match weight dtype {weight.dtype}"
                + (f" and bias dtype {bias.dtype}" if bias is not None else "")
                + "; cast the input or the module, or run under torch.autocast")
        if inp.device != weight.device:
            raise ValueError(f"Linear: input is on {inp.device} but the weight is on {weight.device}")
        return inp, weight, bias

    def _quantizers(self, frame, device):
        recipe = frame.recipe
        fmt = recipe.fp8_format.value
        fwd_dtype, bwd_dtype = fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd)
        if isinstance(recipe, DelayedScaling):
            fwd, bwd = self.fp8_states(frame, device)
            return DelayedQuantizer(fwd, 0, fwd_dtype), DelayedQuantizer(fwd, 1, fwd_dtype), \
                DelayedQuantizer(bwd, 0, bwd_dtype)
        eps, pow2 = recipe.amax_epsilon, recipe.use_power_2_scales
        return CurrentQuantizer(fwd_dtype, eps, pow2), CurrentQuantizer(fwd_dtype, eps, pow2), \
            CurrentQuantizer(bwd_dtype, eps, pow2)

    def _cached_weight(self, is_first_microbatch, enabled: bool, fp8_dtype) -> Optional[Float8Tensor]:
        cache = self._weight_fp8
        if is_first_microbatch is False and enabled and cache is not None and cache.fp8_dtype == fp8_dtype \
                and cache.data.device == self.weight.device:
            return cache
        return None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dtype={self.weight.dtype}"
