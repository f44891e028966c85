"""fp8kit's Linear: a drop-in for torch.nn.Linear whose three GEMMs run in FP8 inside `autocast`.

The three GEMMs of `y = x @ W.T + b`, for x `[M, K]`, W `[N, K]`, dy `[M, N]`:

  fprop  y  = x  @ W.T    x: input slot (forward 0), W: weight slot (forward 1)      E4M3 under HYBRID
  dgrad  dx = dy @ W      dy: grad_output slot (backward 0), W: the FP8 weight        dy E5M2 under HYBRID
  wgrad  dW = dy.T @ x    dy and the FP8 input saved by the forward pass

Each accumulates in float32 and produces the input's dtype. The forward pass saves the FP8 input and the FP8
weight, not the high-precision ones, unless a GEMM that needs them is overridden to high precision. The bias
gradient is `dy.sum(0)` in high precision.

Tensor parallelism (`parallel_mode`, `tp_group`, `sequence_parallel`; the sequence is the FIRST input dimension):

  column  W [out/tp, in]   fprop: x (gathered along the sequence with SP, as FP8 bytes) -> y [.., out/tp]
                           dgrad: partial dx all-reduced, or reduce-scattered along the sequence with SP
  row     W [out, in/tp]   fprop: partial y all-reduced, or reduce-scattered along the sequence with SP; + bias
                           dgrad/wgrad: with SP, dy gathered along the sequence as FP8 bytes; bias grad all-reduced
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ...recipe import DelayedScaling
from ..distributed import (
    all_gather_fp8,
    all_reduce_sum,
    check_shared_scales,
    gather_along_first_dim,
    reduce_scatter_along_first_dim,
    tensor_parallel,
)
from ..gemm import check_cuda_shape, gemm
from ..tensor import Float8Tensor
from .base import FP8StateMixin


class _Plan:
    """What one forward call decided: quantizers per role, which GEMMs run in FP8, bookkeeping hooks."""

    __slots__ = ("input_q", "weight_q", "grad_q", "fp8", "calibrate", "weight_fp8", "step", "track_backward", "tp")

    def __init__(self, input_q, weight_q, grad_q, fp8, calibrate, weight_fp8, step, track_backward, tp=None):
        self.input_q, self.weight_q, self.grad_q = input_q, weight_q, grad_q
        self.fp8 = fp8  # (fprop, dgrad, wgrad)
        self.calibrate = calibrate
        self.weight_fp8: Optional[Float8Tensor] = weight_fp8
        self.step, self.track_backward = step, track_backward
        self.tp = tp  # a distributed.TensorParallel, or None


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: _Plan):
        fprop, dgrad, wgrad = plan.fp8
        tp = plan.tp
        gather = tp is not None and tp.gathers_input
        row = tp is not None and tp.mode == "row"
        x_fp8 = w_fp8 = None
        if plan.calibrate:
            plan.input_q.observe(x)
            plan.weight_q.observe(weight)
        if fprop or wgrad:
            x_fp8 = plan.input_q.quantize(x)
            if gather:  # quantized all-gather: every rank cast with the same scale, FP8 bytes on the wire
                x_fp8 = all_gather_fp8(x_fp8, tp.group)
        if gather and not (fprop and wgrad):
            x = gather_along_first_dim(x, tp.group)
        if fprop or dgrad:
            if plan.weight_fp8 is None:
                plan.weight_fp8 = plan.weight_q.quantize(weight)
            w_fp8 = plan.weight_fp8
        fused_bias = None if row else bias  # row parallel: the bias is added once, after the reduction
        if fprop:
            y = gemm(x_fp8, w_fp8.t(), x.dtype, fused_bias, use_fast_accum=True)
        else:
            y = F.linear(x, weight, fused_bias)
        if row:
            y = reduce_scatter_along_first_dim(y, tp.group) if tp.sequence_parallel else all_reduce_sum(y, tp.group)
            if bias is not None:
                y = y + bias
        # Save FP8 operands where the backward GEMM is FP8, high-precision ones only where it is not.
        ctx.save_for_backward(
            x_fp8.data if wgrad else x,
            x_fp8._scale_inv if wgrad else None,
            w_fp8.data if dgrad else weight,
            w_fp8._scale_inv if dgrad else None,
        )
        ctx.plan = plan
        ctx.inv_values = (x_fp8.scale_inv_value if wgrad else None, w_fp8.scale_inv_value if dgrad else None)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan = ctx.plan
        if torch.is_grad_enabled() and any(plan.fp8[1:]):
            raise RuntimeError(
                "fp8kit: a backward with create_graph=True (double backward, e.g. a gradient penalty) reached an FP8 "
                "Linear: FP8 GEMMs have no second-order gradients. Run the part of the model you differentiate "
                "twice outside fp8kit.pytorch.autocast (or with override_linear_precision=(False, True, True)).")
        tp = plan.tp
        gather = tp is not None and tp.gathers_grad_output
        _, dgrad, wgrad = plan.fp8
        x_saved, x_inv, w_saved, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.contiguous()
        if plan.calibrate:
            plan.grad_q.observe(dy)
        dy_fp8 = plan.grad_q.quantize(dy) if (dgrad or wgrad) else None
        dy_local = dy
        if gather:  # row parallel with SP: dy arrives split along the sequence
            if dy_fp8 is not None:
                dy_fp8 = all_gather_fp8(dy_fp8, tp.group)
            if not (dgrad and wgrad):
                dy = gather_along_first_dim(dy, tp.group)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if dgrad:
                dx = gemm(dy_fp8, Float8Tensor(w_saved, w_inv, None, ctx.inv_values[1]), x_dtype)
            else:
                dx = dy @ w_saved
            if tp is not None and tp.mode == "column":  # partial sums over the output shards
                dx = reduce_scatter_along_first_dim(dx, tp.group) if tp.sequence_parallel \
                    else all_reduce_sum(dx, tp.group)
        if ctx.needs_input_grad[1]:
            if wgrad:
                dw = gemm(dy_fp8.t(), Float8Tensor(x_saved, x_inv, None, ctx.inv_values[0]), w_dtype)
            else:
                dw = dy.t() @ x_saved
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy_local.sum(0)
            if gather:
                db = all_reduce_sum(db, tp.group)
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
      parallel_mode: None, "column" (weight `[out_features / tp, in_features]`, output `[..., out_features / tp]`)
        or "row" (weight `[out_features, in_features / tp]`, input `[..., in_features / tp]`); keyword only.
      tp_group: the tensor-parallel process group (tp = its size). None means no tensor parallelism, as in
        Transformer Engine. `in_features` and `out_features` stay the full sizes; shards are initialised with the
        full layer's bounds, from each rank's RNG (`distributed.shard_linear_parameters` loads full weights).
      sequence_parallel: the activations outside the layer are split along their FIRST dimension (the sequence,
        `[s, b, h]`): a column layer all-gathers its input (as FP8 bytes under FP8), a row layer reduce-scatters its
        output. See docs/distributed.md.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None, *, dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, tp_group=None, sequence_parallel: bool = False):
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"Linear: params_dtype={params_dtype} and dtype={dtype} disagree")
        tp = tensor_parallel(parallel_mode, tp_group, sequence_parallel)
        local_in, local_out = in_features, out_features
        if tp is not None:
            split = out_features if tp.mode == "column" else in_features
            if split % tp.size:
                name = "out_features" if tp.mode == "column" else "in_features"
                raise ValueError(f"Linear: {name}={split} is not divisible by the tensor-parallel size {tp.size}")
            local_out, local_in = (local_out // tp.size, local_in) if tp.mode == "column" \
                else (local_out, local_in // tp.size)
        torch.nn.Linear.__init__(self, local_in, local_out, bias=bias, device=device,
                                 dtype=params_dtype if params_dtype is not None else dtype)
        self.in_features, self.out_features = in_features, out_features  # full sizes, as Transformer Engine
        self._local_in_features = local_in
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        self.tensor_parallel = tp
        self.tp_size = 1 if tp is None else tp.size
        if tp is not None and tp.mode == "row":
            self.reset_parameters()  # again, now with the full layer's fan-in
        self._fp8_label = (f"Linear(in_features={in_features}, out_features={out_features}, bias={bias}"
                           + (f", parallel_mode={parallel_mode}, tp_size={self.tp_size}, "
                              f"sequence_parallel={sequence_parallel}" if parallel_mode else "") + ")")
        self._init_fp8_meta(num_gemms=1)
        self._weight_fp8: Optional[Float8Tensor] = None
        self.fp8_stats = None  # a fp8kit.pytorch.stats.ModuleStats while fp8kit.pytorch.enable_stats is on

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """`inp` `[..., in_features]`. `is_first_microbatch`: None casts the weight at every call; True casts it
        and caches the FP8 weight; False reuses that cache (gradient accumulation over microbatches)."""
        tp = self.tensor_parallel
        call = self.begin_fp8_call((inp, self.weight, self.bias), self.weight.device)
        if call is None:
            if tp is None:
                return F.linear(inp, self.weight, self.bias)
            return self._forward_high_precision(inp)
        frame = call.frame
        autocast_on = torch.is_autocast_enabled(inp.device.type)
        inp, weight, bias = self._operands(inp, autocast_on)
        leading = inp.shape[:-1]
        x = inp.reshape(math.prod(leading), self._local_in_features)
        fp8 = call.fp8
        if x.is_cuda and any(fp8):
            rows = x.shape[0] * (tp.size if tp is not None and tp.gathers_input else 1)
            check_cuda_shape(rows, weight.shape[1], weight.shape[0])
        if tp is not None and isinstance(frame.recipe, DelayedScaling) and (
                (tp.gathers_input and (fp8[0] or fp8[2])) or (tp.gathers_grad_output and (fp8[1] or fp8[2]))):
            check_shared_scales(frame, tp)
        input_q, weight_q, grad_q = call.quantizers(0)
        if self.fp8_stats is not None and not call.replay:
            self.fp8_stats.attach(input_q, weight_q, grad_q)
        if call.replay:
            cached = call.cached_weight(0)
        else:
            cached = self._cached_weight(is_first_microbatch, frame.enabled, weight_q.fp8_dtype)
            if cached is not None:
                call.reused_weight(0, cached)
        plan = _Plan(input_q, weight_q, grad_q, fp8, call.calibrate, cached, call.step, call.track_backward, tp)
        if autocast_on:  # the operands are cast already; the GEMMs pick their dtypes
            with torch.autocast(x.device.type, enabled=False):
                y = _LinearFunction.apply(x, weight, bias, plan)
        else:
            y = _LinearFunction.apply(x, weight, bias, plan)
        if is_first_microbatch is not None and frame.enabled and not call.replay:
            self._weight_fp8 = plan.weight_fp8
        if tp is not None:
            return y.reshape(*self._output_leading(leading), y.shape[-1])
        return y.reshape(*leading, self.out_features)

    @property
    def tp_group(self):
        """The tensor-parallel process group, or None."""
        return None if self.tensor_parallel is None else self.tensor_parallel.group

    def _forward_high_precision(self, inp: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel layer outside FP8: the same collectives around high-precision GEMMs."""
        inp, weight, bias = self._operands(inp)
        leading = inp.shape[:-1]
        plan = _Plan(None, None, None, (False, False, False), False, None, None, False, self.tensor_parallel)
        with torch.autocast(inp.device.type, enabled=False):
            y = _LinearFunction.apply(inp.reshape(math.prod(leading), self._local_in_features), weight, bias, plan)
        return y.reshape(*self._output_leading(leading), y.shape[-1])

    def _output_leading(self, leading) -> tuple:
        tp = self.tensor_parallel
        if not tp.sequence_parallel:
            return tuple(leading)
        first = leading[0] * tp.size if tp.mode == "column" else leading[0] // tp.size
        return (first,) + tuple(leading[1:])

    def reset_parameters(self) -> None:
        """torch.nn.Linear's initialisation; a row-parallel shard uses the full layer's fan-in (`in_features`)."""
        tp = getattr(self, "tensor_parallel", None)
        if tp is None or tp.mode != "row":
            return super().reset_parameters()
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) of nn.Linear, for the full fan-in
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _operands(self, inp: torch.Tensor, autocast_on: Optional[bool] = None):
        if not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
            raise TypeError(f"Linear: input must be a floating tensor, got {getattr(inp, 'dtype', type(inp))}")
        if inp.shape[-1:] != (self._local_in_features,):
            local = "" if self._local_in_features == self.in_features else " / tp_size (row parallel)"
            raise ValueError(f"Linear: input of shape {tuple(inp.shape)} does not end with "
                             f"in_features{local}={self._local_in_features}")
        tp = self.tensor_parallel
        if tp is not None and tp.sequence_parallel:
            if inp.dim() < 2:
                raise ValueError("Linear(sequence_parallel=True): the input needs a sequence dimension first, "
                                 f"got shape {tuple(inp.shape)}")
            if tp.mode == "row" and inp.shape[0] % tp.size:
                raise ValueError(f"Linear(parallel_mode='row', sequence_parallel=True): the sequence dimension "
                                 f"({inp.shape[0]}) must be divisible by the tensor-parallel size {tp.size}")
        weight, bias = self.weight, self.bias
        if autocast_on is None:
            autocast_on = torch.is_autocast_enabled(inp.device.type)
        if autocast_on:
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

    def current_scaling_groups(self):
        """Every tensor split over the tensor-parallel group (gathered ones included) is cast with the amax of the
        whole tensor, so the FP8 bytes equal a single-process run's; replicated tensors need no reduction."""
        tp = self.tensor_parallel
        if tp is None:
            return None, None, None
        column, sp, group = tp.mode == "column", tp.sequence_parallel, tp.group
        return group if (sp or not column) else None, group, group if (sp or column) else None

    def _cached_weight(self, is_first_microbatch, enabled: bool, fp8_dtype) -> Optional[Float8Tensor]:
        cache = self._weight_fp8
        if is_first_microbatch is False and enabled and cache is not None and cache.fp8_dtype == fp8_dtype \
                and cache.data.device == self.weight.device:
            return cache
        return None

    def extra_repr(self) -> str:
        extra = f", parallel_mode={self.parallel_mode}, tp_size={self.tp_size}, " \
            f"sequence_parallel={self.sequence_parallel}" if self.parallel_mode else ""
        return super().extra_repr() + f", dtype={self.weight.dtype}" + extra
