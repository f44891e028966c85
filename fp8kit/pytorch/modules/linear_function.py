"""The FP8 linear transformation as one autograd Function, shared by every module that multiplies by a weight
(Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, the attention projections).

The three GEMMs of `y = x @ W.T + b`, for x `[M, K]`, W `[N, K]`, dy `[M, N]`:

  fprop  y  = x  @ W.T    x: the input quantizer, W: the weight quantizer          E4M3 under HYBRID
  dgrad  dx = dy @ W      dy: the grad_output quantizer, W: the FP8 weight          dy E5M2 under HYBRID
  wgrad  dW = dy.T @ x    dy and the FP8 input saved by the forward pass

Each accumulates in float32 and produces the input's dtype. The forward pass saves the FP8 input and the FP8
weight, not the high-precision ones, unless a GEMM that needs them runs in high precision (`override_linear_precision`,
`backward_override`) or `save_original_input` asks for the original input. The bias gradient is `dy.sum(0)` in high
precision.

Tensor parallelism (`plan.tp`; the sequence is the FIRST input dimension):

  column  W [out/tp, in]   fprop: x (gathered along the sequence with SP, as FP8 bytes) -> y [.., out/tp]
                           dgrad: partial dx all-reduced, or reduce-scattered along the sequence with SP
  row     W [out, in/tp]   fprop: partial y all-reduced, or reduce-scattered along the sequence with SP; + bias
                           dgrad/wgrad: with SP, dy gathered along the sequence as FP8 bytes; bias grad all-reduced

Weight-gradient options (Transformer Engine's): `fuse_wgrad_accumulation` adds dW, computed in float32, into
`weight.main_grad` in place (overwriting it on the first microbatch); `delay_wgrad_compute` keeps what the wgrad GEMM
needs in a `WeightGradStore`, and the module's `backward_dw()` runs it later.
"""

from __future__ import annotations

import collections
from typing import Callable, Deque, Optional

import torch
import torch.nn.functional as F

from ..cpu_kernels import pool
from ..distributed import all_gather_fp8, all_reduce_sum, gather_along_first_dim, reduce_scatter_along_first_dim
from ..gemm import gemm
from ..quantized_tensor import QuantizedTensorStorage
from ..tensor.storage import Float8TensorStorage

__all__ = ["LinearPlan", "WeightGradStore", "fp8_linear"]


class WeightGradStore:
    """The weight-gradient computations a backward left for later (`delay_wgrad_compute=True`), oldest first."""

    def __init__(self):
        self._pending: Deque[Callable[[], None]] = collections.deque()

    def put(self, compute: Callable[[], None]) -> None:
        self._pending.append(compute)

    def pop(self) -> Optional[Callable[[], None]]:
        return self._pending.popleft() if self._pending else None

    def __len__(self) -> int:
        return len(self._pending)

    def __deepcopy__(self, memo):
        return WeightGradStore()


class LinearPlan:
    """What one FP8 GEMM of a module call decided.

    input_q, weight_q, grad_q: the quantizers of x, W and dy (None when nothing runs in FP8).
    fp8: (fprop, dgrad, wgrad): which GEMMs run in FP8.
    calibrate: record amaxes, compute in high precision.
    weight_fp8: a cached FP8 weight to use (`is_first_microbatch=False`, a recompute); set to the weight the forward
      cast otherwise, so the module can cache it.
    step, track_backward: the autocast step whose backward update waits for this GEMM's backward.
    tp: a distributed.TensorParallel, or None.
    fast_accum: (fprop, dgrad, wgrad): FP8 GEMMs that may use the tensor cores' fast accumulation on CUDA.
    backward_override: None, "high_precision" (dgrad and wgrad on the original operands) or "dequantized" (on the
      dequantized FP8 operands of the forward).
    save_original_input: keep x, not its FP8 cast, for wgrad (which then casts it again; current scaling only).
    weight_param: the weight Parameter (where `fuse_wgrad_accumulation` and `delay_wgrad_compute` put dW).
    fuse_wgrad: add dW, in float32, into `weight_param.main_grad` and return no weight gradient.
    overwrite_main_grad: write dW into main_grad instead of adding (the first microbatch).
    wgrad_store: a WeightGradStore that receives the wgrad computation (`delay_wgrad_compute`), or None.
    """

    __slots__ = ("input_q", "weight_q", "grad_q", "fp8", "calibrate", "weight_fp8", "step", "track_backward", "tp",
                 "fast_accum", "backward_override", "save_original_input", "weight_param", "fuse_wgrad",
                 "overwrite_main_grad", "wgrad_store")

    def __init__(self, input_q, weight_q, grad_q, fp8, calibrate=False, weight_fp8=None, step=None,
                 track_backward=False, tp=None):
        self.input_q, self.weight_q, self.grad_q = input_q, weight_q, grad_q
        self.fp8 = fp8
        self.calibrate = calibrate
        self.weight_fp8: Optional[Float8TensorStorage] = weight_fp8
        self.step, self.track_backward = step, track_backward
        self.tp = tp
        self.fast_accum = (True, False, False)
        self.backward_override = None
        self.save_original_input = False
        self.weight_param = None
        self.fuse_wgrad = False
        self.overwrite_main_grad = False
        self.wgrad_store = None


def gather_values(quantizer) -> bool:
    """Whether a tensor this quantizer casts is all-gathered in high precision and quantized after (block-scaled
    recipes: the full tensor's blocks, as one process would quantize them), not gathered as FP8 bytes."""
    return getattr(quantizer, "gather_values", False)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: LinearPlan) -> torch.Tensor:
    """`x @ weight.T + bias` for x `[M, K]` with the GEMMs `plan` asks for (see the module docstring).

    Eager, with no functorch transform active, the Function is applied as `torch.autograd.Function.apply` does in
    that case (its operands' dead functorch wrappers unwrapped, then the C++ apply), without its generic argument
    handling (every GEMM call pays it); traced or under a transform, through `apply` itself."""
    if _UNWRAP is None or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return _LinearFunction.apply(x, weight, bias, plan)
    return _APPLY(_UNWRAP(x), _UNWRAP(weight), None if bias is None else _UNWRAP(bias), plan)


def _weight_operand(plan: LinearPlan, rebuild, saved: tuple, inv_value):
    """The FP8 weight for dgrad: the forward's storage itself when it still holds the saved bytes (no saved-tensor
    hook replaced them), so that the CPU GEMM's widened values made in the forward serve again; else rebuilt from
    `saved` (the tensors of its `saved_form`). Traced by torch.compile it is always rebuilt: the identity of a
    tensor saved inside the traced forward cannot be compared with one made outside it (an FP8 weight parameter)."""
    forward = plan.weight_fp8
    first = saved[0]
    holds = getattr(forward, "holds", None)  # (a storage class without it: always rebuilt)
    if holds is not None and not torch.compiler.is_compiling() and holds(first):
        return forward
    return rebuild(*saved, inv_value)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: LinearPlan):
        fprop, dgrad, wgrad = plan.fp8
        mode = plan.backward_override
        tp = plan.tp
        gather = tp is not None and tp.gathers_input
        row = tp is not None and tp.mode == "row"
        x_fp8 = w_fp8 = None
        if plan.calibrate:
            plan.input_q.observe(x)
            plan.weight_q.observe(weight)
        keep_x_fp8 = wgrad and not plan.save_original_input
        if gather and (gather_values(plan.input_q) or not (fprop or keep_x_fp8)):
            x = gather_along_first_dim(x, tp.group)  # block scales: the full tensor is quantized after the gather
            gather = False
        if fprop or keep_x_fp8:
            # on accelerators the cast also writes the transpose wgrad reads (one pass with the kernels)
            x_fp8 = plan.input_q.quantize(x, transpose=keep_x_fp8 and not gather)
            if gather:  # quantized all-gather: every rank cast with the same scale, FP8 bytes on the wire
                x_fp8 = all_gather_fp8(x_fp8, tp.group)
        if gather and not (fprop and keep_x_fp8):
            x = gather_along_first_dim(x, tp.group)
        if fprop or dgrad:
            w_fp8 = plan.weight_fp8
            if w_fp8 is None:
                w_fp8 = plan.weight_q.quantize(weight, transpose=dgrad)
                if not torch.compiler.is_compiling():  # kept for is_first_microbatch (a compiled graph cannot)
                    plan.weight_fp8 = w_fp8
        fused_bias = None if row else bias  # row parallel: the bias is added once, after the reduction
        if fprop:
            y = gemm(x_fp8, w_fp8.transposed(), x.dtype, fused_bias, use_fast_accum=plan.fast_accum[0])
            pool.recycle(x_fp8)  # its widened values (CPU) served this GEMM only: the saved form is its bytes
        else:
            y = F.linear(x, weight, fused_bias)
        if row:
            y = reduce_scatter_along_first_dim(y, tp.group) if tp.sequence_parallel else all_reduce_sum(y, tp.group)
            if bias is not None:
                y = y + bias
        # Save FP8 operands where the backward uses them, high-precision ones only where it must.
        x_as_fp8 = keep_x_fp8 or (mode == "dequantized" and fprop and not plan.save_original_input)
        w_as_fp8 = dgrad or (mode == "dequantized" and fprop)
        # An FP8 operand is saved in the form its storage class gives (saved_form: a tuple of tensors) and rebuilt
        # by it (from_saved): the GEMMs of each recipe family read their own storage.
        x_saved = x_fp8.saved_form() if x_as_fp8 else (x, None)
        w_saved = w_fp8.saved_form() if w_as_fp8 else (weight, None)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.x_count = len(x_saved)
        ctx.plan = plan
        ctx.as_fp8 = (x_as_fp8, w_as_fp8)
        ctx.rebuild = (x_fp8.from_saved if x_as_fp8 else None, w_fp8.from_saved if w_as_fp8 else None)
        ctx.inv_values = (x_fp8.scale_inv_value if x_as_fp8 else None, w_fp8.scale_inv_value if w_as_fp8 else None)
        ctx.x_codes_finite = x_as_fp8 and getattr(x_fp8, "_codes_finite", False)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan = ctx.plan
        _, dgrad, wgrad = plan.fp8
        if torch.is_grad_enabled() and (dgrad or wgrad):
            raise RuntimeError(
                "fp8kit: a backward with create_graph=True (double backward, e.g. a gradient penalty) reached an FP8 "
                "GEMM: FP8 GEMMs have no second-order gradients. Run the part of the model you differentiate "
                "twice outside fp8kit.pytorch.autocast (or with override_linear_precision=(False, True, True)).")
        tp = plan.tp
        gather = tp is not None and tp.gathers_grad_output
        saved = ctx.saved_tensors
        x_saved, w_saved = saved[:ctx.x_count], saved[ctx.x_count:]
        x_as_fp8, w_as_fp8 = ctx.as_fp8
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.contiguous()
        if plan.calibrate:
            plan.grad_q.observe(dy)
        db = dy_fp8 = None
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        dy_local = dy
        gathered = gather and (gather_values(plan.grad_q) or not (dgrad or wgrad))
        if gathered:  # block scales: the full dy is quantized after the gather (the bias gradient from local rows)
            dy = gather_along_first_dim(dy, tp.group)
        gather_fp8 = gather and not gathered
        if want_db and (dgrad or wgrad) and not gathered:  # the bias gradient from the same pass over dy
            dy_fp8, db = plan.grad_q.quantize_dbias(dy)
        elif dgrad or wgrad:
            dy_fp8 = plan.grad_q.quantize(dy, transpose=wgrad and not gather_fp8)
        if gather_fp8:  # row parallel with SP: dy arrives split along the sequence
            dy_fp8 = all_gather_fp8(dy_fp8, tp.group)
            if not (dgrad and wgrad):
                dy = gather_along_first_dim(dy, tp.group)
        dx = dw = x_operand = None
        if ctx.needs_input_grad[0]:
            if dgrad:
                dx = gemm(dy_fp8, _weight_operand(plan, ctx.rebuild[1], w_saved, ctx.inv_values[1]), x_dtype,
                          use_fast_accum=plan.fast_accum[1])
            else:
                w = ctx.rebuild[1](*w_saved, ctx.inv_values[1]).dequantize(dtype=dy.dtype) if w_as_fp8 \
                    else w_saved[0]
                dx = dy @ w
            if tp is not None and tp.mode == "column":  # partial sums over the output shards
                dx = reduce_scatter_along_first_dim(dx, tp.group) if tp.sequence_parallel \
                    else all_reduce_sum(dx, tp.group)
        if ctx.needs_input_grad[1]:
            if x_as_fp8:
                x_operand = ctx.rebuild[0](*x_saved, ctx.inv_values[0])
                if ctx.x_codes_finite:  # the forward's cast saw no NaN: the widening needs no check
                    x_operand._codes_finite = True
            elif wgrad:  # save_original_input: cast the original input again (current scaling repeats its bytes)
                x_operand = plan.input_q.quantize(x_saved[0])
            else:
                x_operand = x_saved[0]
            dw = _weight_grad(plan, dy_fp8 if wgrad else dy, x_operand, wgrad, w_dtype)
        if want_db:
            if db is None:
                db = dy_local.sum(0)
            if gather:
                db = all_reduce_sum(db, tp.group)
        if plan.wgrad_store is None:  # the CPU GEMMs' widened operands (a deferred wgrad still needs them)
            pool.recycle(dy_fp8, x_operand)
        if plan.track_backward and not torch.compiler.is_compiling():
            plan.step.backward_done()
        return dx, dw, db, None


def _weight_grad(plan: LinearPlan, dy, x, fp8: bool, w_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """dW = dy.T @ x (FP8 or high precision), returned, or added into main_grad / left for backward_dw."""
    fuse = plan.fuse_wgrad
    out_dtype = torch.float32 if fuse else w_dtype

    def compute() -> torch.Tensor:
        if fp8:
            return gemm(dy.transposed(), x, out_dtype, use_fast_accum=plan.fast_accum[2])
        if isinstance(x, QuantizedTensorStorage):  # backward_override="dequantized"
            x_hp = x.dequantize(dtype=dy.dtype)
        else:
            x_hp = x
        if fuse and dy.dtype != torch.float32:  # into main_grad: float32 sums of the exact products, rounded once
            return dy.t().float() @ x_hp.float()
        return (dy.t() @ x_hp).to(out_dtype)

    if not fuse and plan.wgrad_store is None:
        return compute()
    param, overwrite = plan.weight_param, plan.overwrite_main_grad

    def apply() -> None:
        dw = compute()
        if fuse:
            main_grad = _main_grad(param)
            if overwrite or getattr(param, "overwrite_main_grad", False):
                main_grad.copy_(dw)
            else:
                main_grad.add_(dw)
        else:  # delayed: the gradient autograd would have accumulated into .grad
            dw = dw.to(param.dtype)
            param.grad = dw if param.grad is None else param.grad + dw

    if plan.wgrad_store is not None:
        plan.wgrad_store.put(apply)
        return None
    apply()
    if hasattr(param, "grad_added_to_main_grad"):  # Megatron's DDP: a dummy gradient, the real one is in main_grad
        param.grad_added_to_main_grad = True
        return torch.zeros_like(param)
    return None


_APPLY = super(torch.autograd.Function, _LinearFunction).apply  # what Function.apply ends in
_UNWRAP = getattr(torch._C._functorch, "unwrap_if_dead", None)  # absent: `apply` itself, every call


def _main_grad(param: torch.Tensor) -> torch.Tensor:
    """Where `fuse_wgrad_accumulation` puts dW, as Transformer Engine finds it: `param.get_main_grad()` for Megatron's
    FSDP parameters (which create the buffer lazily), else `param.main_grad`."""
    main_grad = param.get_main_grad() if hasattr(param, "__fsdp_param__") else getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("fp8kit: fuse_wgrad_accumulation=True needs weight.main_grad (a float32 buffer of the "
                           "weight's shape) before the backward")
    if main_grad.shape != param.shape:
        raise RuntimeError(f"fp8kit: weight.main_grad has shape {tuple(main_grad.shape)}, the weight "
                           f"{tuple(param.shape)}")
    return main_grad
