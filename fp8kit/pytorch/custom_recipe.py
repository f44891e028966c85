"""`CustomRecipe(qfactory=...)` as a recipe family of fp8kit's modules (docs/architecture.md, "Adding a recipe"):
the quantizers come from the user's factory and the GEMMs from the quantizer's `qgemm`, as in Transformer Engine
(quantization.py `CustomRecipeState`, custom_recipes/gemm.py `custom_gemm`).

- Quantizers: `qfactory(QuantizerRole(module_type, tensor_type, name))` for the tensor types "input", "weight" and
  "grad_output" of each GEMM (module_type "grouped_linear" for GroupedLinear, else "linear"; name the module's
  `name` attribute, else ""). A factory may return a custom quantizer (one with a `qgemm` method, e.g.
  `fp8kit.pytorch.custom_recipes.reference_nvfp4.NVFP4QuantizerRef`) or one of fp8kit's block-scaled quantizers
  (MXFP8Quantizer, Float8BlockQuantizer, NVFP4Quantizer, which then run as under their own recipe). Anything else
  (a QuantizerRequest, a per-tensor quantizer, None) is refused with NotImplementedError / TypeError naming it.
- GEMMs of custom operands: `qgemm` of the first operand's quantizer (else the second's), with TE's operands:
  fprop `x @ w^T` from the rowwise data of x and w (and the fused bias, which a quantizer may refuse), dgrad
  `dy @ w` from dy's rowwise data and w's columnwise data (`data_t`), wgrad `dy^T @ x` from both columnwise data.
- The plan: float32 accumulation and the recipe's `backward_override`, as the block recipes.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ..recipe import CustomRecipe
from .block_families import block_plan
from .block_recipes import RoleQuantizer
from .custom_recipes.gemm import GEMMType, MMParams
from .gemm import register_gemm_rule
from .quantization import QuantizerRequest, QuantizerRole
from .recipe_families import register_recipe_family
from .tensor.block_storage import BlockQuantizer

__all__ = ["CustomOperand", "TransposedCustomOperand", "custom_gemm_rule"]

_TENSOR_TYPES = ("input", "weight", "grad_output")


class CustomOperand:
    """A custom quantizer's result (`qresult`: TE's storage fields `data`, `scale`, `data_t`, `scale_t`, ...) as
    an operand of fp8kit's GEMM call path: `transposed()`, `saved_form()` / `from_saved`."""

    scale_inv_value = None
    _saved_shell = None  # set by saved_form: a copy of the result without its data tensors

    def __init__(self, qresult):
        self.qresult = qresult

    def transposed(self) -> "TransposedCustomOperand":
        return TransposedCustomOperand(self)

    def saved_form(self):
        """The tensors of a copy of the result (its `prepare_for_saving`): the result itself stays whole (a cached
        weight is used again)."""
        tensors, self._saved_shell = copy.copy(self.qresult).prepare_for_saving()
        return tuple(tensors)

    @property
    def from_saved(self):
        return _Restore(self._saved_shell)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.qresult.dequantize(dtype=dtype)


class _Restore:
    """Rebuilds the operand from the saved tensors (then the unused scale_inv value); holds only the shell."""

    __slots__ = ("shell",)

    def __init__(self, shell):
        self.shell = shell

    def __call__(self, *saved):
        obj = copy.copy(self.shell)
        obj.restore_from_saved(list(saved))
        return CustomOperand(obj)


class TransposedCustomOperand:
    """The transpose of a custom operand in a GEMM (the GEMM reads its columnwise data)."""

    __slots__ = ("operand",)

    def __init__(self, operand: CustomOperand):
        self.operand = operand


class _CustomRoleQuantizer(RoleQuantizer):
    """A role whose quantizer is a custom one: quantizes with `quantize_impl` (rowwise, and columnwise when a
    backward may read it, as RoleQuantizer) and wraps the result."""

    def __init__(self, quantizer):
        quantizer.internal = True
        self.quantizer = quantizer
        self.fp8_dtype = getattr(quantizer, "fp8_torch_dtype", torch.uint8)
        self.stats = None

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> CustomOperand:
        q = self.quantizer
        columnwise = bool(transpose) or torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1
        q.set_usage(rowwise=True, columnwise=columnwise)
        return CustomOperand(q.quantize_impl(x))


def _role_quantizer(q, role: QuantizerRole):
    if callable(getattr(q, "qgemm", None)):
        return _CustomRoleQuantizer(q)
    if isinstance(q, BlockQuantizer):
        return RoleQuantizer(q.copy())
    if isinstance(q, QuantizerRequest):
        raise NotImplementedError(f"CustomRecipe: qfactory({role}) returned {type(q).__name__}; quantizer requests "
                                  "(library-managed state) are not implemented in fp8kit.pytorch")
    raise TypeError(f"CustomRecipe: qfactory({role}) must return a custom quantizer (with qgemm) or a block-scaled "
                    f"quantizer (MXFP8Quantizer, Float8BlockQuantizer, NVFP4Quantizer), got {q!r}")


def _module_type(module) -> str:
    return "grouped_linear" if "GroupedLinear" in type(module).__name__ else "linear"


def _quantizers(call, gemm: int):
    recipe, module = call.frame.recipe, call.module
    name = getattr(module, "name", None)
    name = name if isinstance(name, str) else ""
    roles = [QuantizerRole(_module_type(module), t, name) for t in _TENSOR_TYPES]
    return tuple(_role_quantizer(recipe.qfactory(role), role) for role in roles)


def _quantizer_of(*operands):
    for op in operands:
        q = getattr(op.qresult, "_quantizer", None)
        if q is not None:
            return q
    raise ValueError("custom recipe GEMM: no quantizer found on the operands")


def custom_gemm_rule(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                     use_fast_accum: bool = False) -> torch.Tensor:
    """`a @ b` for custom operands (a (M, K), b (K, N), each a CustomOperand or its transposed view) by the
    quantizer's `qgemm`: fprop (b transposed), dgrad (neither), wgrad (a transposed); see the module docstring."""
    a_t, b_t = isinstance(a, TransposedCustomOperand), isinstance(b, TransposedCustomOperand)
    a_op, b_op = (a.operand if a_t else a), (b.operand if b_t else b)
    if not isinstance(a_op, CustomOperand) or not isinstance(b_op, CustomOperand):
        raise TypeError(f"custom recipe GEMM: both operands must come from custom quantizers, got "
                        f"{type(a_op).__name__} and {type(b_op).__name__}")
    qa, qb = a_op.qresult, b_op.qresult
    params = MMParams(out_dtype=out_dtype, use_split_accumulator=not use_fast_accum)
    quantizer = _quantizer_of(a_op, b_op)
    if not a_t and b_t:
        args, kind = (qa.data, qb.data, qa.scale, qb.scale, bias), GEMMType.FPROP
    elif not a_t and not b_t:
        args, kind = (qa.data, qb.data_t, qa.scale, qb.scale_t, None), GEMMType.DGRAD
    elif a_t and not b_t:
        args, kind = (qa.data_t, qb.data_t, qa.scale_t, qb.scale_t, None), GEMMType.WGRAD
    else:
        raise ValueError("custom recipe GEMM: A^T @ B^T is not a GEMM of a Linear")
    if kind is not GEMMType.FPROP and bias is not None:
        raise ValueError(f"custom recipe GEMM: a bias in a {kind.value} GEMM")
    if any(t is None for t in args[:4]):
        raise ValueError(f"custom recipe {kind.value} GEMM: an operand lacks the data it needs (rowwise data for "
                         "fprop, columnwise data_t for the backward)")
    qx, qw, sx, sw, fused_bias = args
    return quantizer.qgemm(qx, qw, params, out_dtype, sx, sw, fused_bias, gemm_type=kind, qresult_x=qa,
                           qresult_w=qb)


register_gemm_rule(CustomOperand, custom_gemm_rule)
register_gemm_rule(TransposedCustomOperand, custom_gemm_rule)
register_recipe_family(CustomRecipe, _quantizers, block_plan)
