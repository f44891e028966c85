"""The block-scaled recipe families as fp8kit's modules use them: per-role quantizers (input, weight, grad_output)
built from a recipe, and the GEMM rule of block-scaled operands.

- `block_quantizers(recipe)`: the (input, weight, grad_output) `RoleQuantizer`s of an `MXFP8BlockScaling` or
  `Float8BlockScaling` recipe (read by attribute, so any object with the recipe's fields works), with Transformer
  Engine's choices: MXFP8 uses the forward format for input and weight and the backward one for grad_output, and
  32x32 blocks for weights with `enable_2d_quantization`; Float8 block scaling takes each role's block dim and
  QParams (`power_2_scale`, `amax_epsilon`).
- `block_gemm_rule(a, b, out_dtype, bias, use_fast_accum)`: `a @ b` for operands that are block-scaled tensors or
  their `.transposed()` views, by `fp8kit.pytorch.block_gemm` (float32 accumulation per K-block pair).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .block_gemm import block_gemm
from .tensor.block_storage import BlockScaledStorage, TransposedBlockOperand
from .tensor.float8_blockwise_tensor import Float8BlockQuantizer
from .tensor.mxfp8_tensor import MXFP8Quantizer

__all__ = ["RoleQuantizer", "block_quantizers", "block_gemm_rule", "weight_parameter_quantizer"]

_FORMAT_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class RoleQuantizer:
    """One tensor role of a module's GEMM under a block recipe: `quantize(x, transpose)` gives a block-scaled
    storage with the rowwise layout, plus the columnwise one when a backward may read the transpose (`transpose`,
    or grad enabled, or inside a backward pass): unlike per-tensor FP8, the columnwise layout cannot be made later
    from the rowwise bytes. `quantize_dbias(dy)` adds the bias gradient; `observe` does nothing (block scales need
    no calibration)."""

    __slots__ = ("quantizer", "fp8_dtype", "stats")
    # Under sequence parallelism the tensor is all-gathered in high precision and quantized after: every block is
    # then the full tensor's (a local block along the split dim could straddle ranks), as Transformer Engine does
    # for Float8 block scaling.
    gather_values = True

    def __init__(self, quantizer):
        quantizer.internal = True
        self.quantizer = quantizer
        self.fp8_dtype = quantizer.fp8_torch_dtype
        self.stats = None  # optional fp8kit.pytorch.stats.RoleStats, set by the module when stats are on

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> BlockScaledStorage:
        q = self.quantizer
        columnwise = bool(transpose) or torch.is_grad_enabled() or _may_be_backward()
        if q.columnwise_usage is not columnwise or not q.rowwise_usage:  # (a traced graph cannot set them)
            q.set_usage(rowwise=True, columnwise=columnwise)
        out = q.quantize_impl(x)
        if self.stats is not None:
            self.stats.record_block(x, out)
        return out

    def quantize_dbias(self, dy: torch.Tensor) -> Tuple[BlockScaledStorage, torch.Tensor]:
        n = dy.shape[-1] if dy.dim() else 1
        return self.quantize(dy, transpose=True), dy.reshape(-1, n).sum(0)

    def observe(self, x: torch.Tensor) -> None:
        pass


def weight_parameter_quantizer(role: RoleQuantizer):
    """A copy of `role`'s quantizer that makes torch.Tensor subclasses (not internal storages) with both layouts:
    what a weight parameter created under `quantized_model_init` holds."""
    q = role.quantizer.copy()
    q.internal = False
    q.set_usage(rowwise=True, columnwise=True)
    return q


def _may_be_backward() -> bool:
    """Inside a backward pass, or traced by torch.compile (which traces the forward and the backward of an
    autograd Function alike, and cannot trace the engine's task id): the columnwise layout may be read."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1


def _formats(recipe) -> Tuple[torch.dtype, torch.dtype]:
    fmt = recipe.fp8_format.value
    return _FORMAT_DTYPES[fmt.fwd], _FORMAT_DTYPES[fmt.bwd]


def block_quantizers(recipe) -> Tuple[RoleQuantizer, RoleQuantizer, RoleQuantizer]:
    """(input, weight, grad_output) quantizers of a Linear-like GEMM under `recipe` (see the module docstring)."""
    fwd, bwd = _formats(recipe)
    if hasattr(recipe, "w_block_scaling_dim"):  # Float8BlockScaling
        roles = ((fwd, recipe.fp8_quant_fwd_inp, recipe.x_block_scaling_dim),
                 (fwd, recipe.fp8_quant_fwd_weight, recipe.w_block_scaling_dim),
                 (bwd, recipe.fp8_quant_bwd_grad, recipe.grad_block_scaling_dim))
        return tuple(RoleQuantizer(Float8BlockQuantizer(dtype, rowwise=True, columnwise=True,
                                                        amax_epsilon=q.amax_epsilon,
                                                        force_pow_2_scales=q.power_2_scale, block_scaling_dim=dim))
                     for dtype, q, dim in roles)
    two_d = bool(getattr(recipe, "enable_2d_quantization", False))
    return (RoleQuantizer(MXFP8Quantizer(fwd)), RoleQuantizer(MXFP8Quantizer(fwd, with_2d_quantization=two_d)),
            RoleQuantizer(MXFP8Quantizer(bwd)))


def _unwrap(t) -> Tuple[BlockScaledStorage, bool]:
    if isinstance(t, TransposedBlockOperand):
        return t.storage, True
    return t, False


def block_gemm_rule(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                    use_fast_accum: bool = False) -> torch.Tensor:
    """`a @ b` (+ bias) in `out_dtype` for a (M, K) and b (K, N), each a block-scaled tensor flattened to 2-D or its
    `.transposed()` view. The contraction runs over blocked dims only: A's rows come from `a`'s rowwise layout (its
    columnwise one when `a` is a transposed view), B's columns from `b`'s columnwise layout (its rowwise one when `b`
    is a transposed view). `use_fast_accum` does not change the emulation (float32 accumulation always)."""
    a_storage, a_t = _unwrap(a)
    b_storage, b_t = _unwrap(b)
    return block_gemm(a_storage, b_storage, transpose_a=a_t, transpose_b=not b_t, out_dtype=out_dtype, bias=bias)
