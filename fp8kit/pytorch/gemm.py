"""The one place that multiplies FP8 tensors.

`gemm(a, b)` dispatches on the operands' storage type through a table of GEMM rules (`register_gemm_rule`): a
recipe family with its own storage (block scales, ...) adds its rule there, and the modules call `gemm` alone.
Per-tensor FP8 (`Float8TensorStorage`, and Float8Tensor) has `per_tensor_gemm`: `a @ b` for `a` `[M, K]` and `b`
`[K, N]` (any strides), accumulating in float32 and scaling by `a.scale_inv * b.scale_inv`. Three paths, chosen by
the device and the formats:

- CPU tensors: emulated (FP8 values are exact in float32 and bf16; float32 products and sums; scaled once).
- Any other device (CUDA; `meta` in the tests): `torch._scaled_mm` (cuBLASLt), which wants `a` row-major and `b`
  column-major, both FP8, and K and N multiples of 16. A Float8TensorStorage that carries `_transpose` (the transposed
  bytes the fused cast kernels write) gives the column-major operand without a copy; otherwise the operand is copied
  into the layout. K and N that are not multiples of 16 are zero-padded (exact: zeros add nothing), which costs a
  copy of the padded operands and of the output; a warning says so once per shape.
- E5M2 x E5M2 (pure E5M2 recipes; cuBLASLt has no such kernel, and Transformer Engine refuses it): both operands
  are widened to float32 on their device and multiplied there (`widened_gemm`), no host sync.

Nothing here reads a device value on the host.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import torch

from . import host
from .class_table import ClassTable
from .tensor.storage import Float8TensorStorage

_ALIGN = 16  # cuBLASLt FP8: K and N multiples of 16
_warned_shapes: set = set()


def check_cuda_shape(leading: int, in_features: int, out_features: int) -> list:
    """What an FP8 Linear of this shape costs on an accelerator: the list of dimensions `gemm` zero-pads to a
    multiple of 16 (empty when none). It no longer raises: every shape runs (see the module docstring). `leading`
    (the product of the leading dimensions) is padded only where it is the inner dimension of the wgrad GEMM."""
    padded = []
    if leading % _ALIGN:
        padded.append(f"the product of the leading dimensions ({leading}; wgrad)")
    if in_features % _ALIGN:
        padded.append(f"in_features ({in_features})")
    if out_features % _ALIGN:
        padded.append(f"out_features ({out_features})")
    return padded


GemmRule = Callable[[Any, Any, torch.dtype, Optional[torch.Tensor], bool], torch.Tensor]

_RULES = ClassTable("GEMM rule")  # storage class -> GemmRule


def register_gemm_rule(storage_class: type, rule: GemmRule) -> None:
    """Make `rule(a, b, out_dtype, bias, use_fast_accum)` the GEMM of operands stored as `storage_class` (or a
    subclass without a rule of its own): how their scales meet in the product, on every device. A recipe family
    with its own storage (block scales, ...) registers one; both operands of a GEMM must share the rule."""
    if not isinstance(storage_class, type):
        raise TypeError(f"register_gemm_rule: expected a storage class, got {storage_class!r}")
    if not callable(rule):
        raise TypeError(f"register_gemm_rule: rule must be callable, got {rule!r}")
    _RULES.register(storage_class, rule)


def gemm_rule(storage_type: type) -> GemmRule:
    """The rule of operands of `storage_type`: its own, else its nearest registered base class's."""
    return _RULES.lookup(storage_type)


def gemm(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
         use_fast_accum: bool = False) -> torch.Tensor:
    """`a @ b` (+ bias) in `out_dtype` for quantized operands a `[M, K]`, b `[K, N]`, by the GEMM rule of their
    storage type (`register_gemm_rule`; per-tensor FP8 `Float8TensorStorage`: `per_tensor_gemm`)."""
    rule = _RULES[type(a)]  # one dict access (class_table.py)
    if type(b) is not type(a) and _RULES[type(b)] is not rule:
        raise TypeError(f"fp8kit gemm: operands of types {type(a).__name__} and {type(b).__name__} have different "
                        "GEMM rules (one recipe's operands per GEMM)")
    return rule(a, b, out_dtype, bias, use_fast_accum)


def per_tensor_gemm(
    a: Float8TensorStorage,
    b: Float8TensorStorage,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """The GEMM rule of per-tensor FP8 (`Float8TensorStorage`, delayed and current scaling):
    `(a @ b) * a.scale_inv * b.scale_inv (+ bias)` in `out_dtype`; a `[M, K]`, b `[K, N]`."""
    if a.device.type == "cpu":  # `device`, not `_data.device`: a DeferredBytesStorage makes no bytes for it
        if torch.compiler.is_compiling():  # the same code, as one opaque operation (it reads alpha on the host)
            return torch.ops.fp8kit.emulated_mm(a.fp8_view(), a.scale_inv, b.fp8_view(), b.scale_inv, bias, out_dtype)
        return emulated(a, b, out_dtype, bias)
    if a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2:
        return widened_gemm(a, b, out_dtype, bias)
    return scaled_mm(a, b, out_dtype, bias, use_fast_accum)


def _check_shapes(a: Float8TensorStorage, b: Float8TensorStorage, where: str):
    if a._data.dim() != 2 or b._data.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{where}: expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a._data.device != b._data.device:
        raise ValueError(f"{where}: operands on different devices: {a._data.device} and {b._data.device}")
    return a.shape[0], a.shape[1], b.shape[1]


def widened_gemm(a: Float8TensorStorage, b: Float8TensorStorage, out_dtype: torch.dtype,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The FP8 GEMM on the operands' device by widening both to float32 (exact for every FP8 value, also under
    TF32) and `torch.mm`; the product of the two `scale_inv` (float32) scales the float32 result, then the bias is
    added and the result rounded once to `out_dtype`. Any formats, any shapes and layouts; no host sync."""
    _check_shapes(a, b, "widened_gemm")
    out = torch.mm(a.values(torch.float32), b.values(torch.float32))
    out.mul_(a.scale_inv.reshape(()) * b.scale_inv.reshape(()))
    if bias is not None:
        out.add_(bias)
    return _as_dtype(out, out_dtype)


def _as_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out` in `dtype`: the result itself when it is already, not an identity `.to()` of it (torch 2.11's dynamo sent
    an autograd Function's output gradient to such an intermediate, and the backward got zeros: docs/pytorch.md,
    "torch.compile and CUDA graphs")."""
    return out if out.dtype == dtype else out.to(dtype)


def _is_row_major(t: torch.Tensor) -> bool:
    """Contiguous 2-D FP8 bytes starting at a 16-byte boundary of their allocation (what cuBLASLt takes as is).
    Under torch.compile contiguity alone: the compiler's `_scaled_mm` lowering places its operands itself, and the
    storage offset of a traced tensor is not a value to branch on."""
    if torch.compiler.is_compiling():
        return t.is_contiguous()
    return t.is_contiguous() and t.storage_offset() % _ALIGN == 0


def _is_col_major(t: torch.Tensor) -> bool:
    """`t.t()` passes `_is_row_major`, read from the strides (no transposed view made)."""
    if t.dim() != 2 or t.stride(0) != 1 or t.stride(1) != max(t.shape[0], 1):
        return False
    return torch.compiler.is_compiling() or t.storage_offset() % _ALIGN == 0


def _col_major_source(b: Float8TensorStorage) -> torch.Tensor:
    """`b._data.t()` as a contiguous (row-major [N, K]) tensor: `b._transpose` as is, or `b._data` when it is a
    transposed view of one, else a copy."""
    t = b.transpose_view()
    if t is not None:
        return t
    bt = b.fp8_view().t()
    return bt if _is_row_major(bt) else bt.contiguous()


def _padded(t: torch.Tensor, cols: int, rows: int) -> torch.Tensor:
    """Row-major `t` with `cols` zero columns and `rows` zero rows appended (the FP8 bytes as uint8)."""
    if not (cols or rows):
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, cols, 0, rows)).view(t.dtype)


def _warn_padding(m: int, k: int, n: int, pad_k: int, pad_n: int) -> None:
    key = (k, n, bool(pad_k), bool(pad_n))
    if key in _warned_shapes:
        return
    _warned_shapes.add(key)
    dims = ([f"K={k} -> {k + pad_k}"] if pad_k else []) + ([f"N={n} -> {n + pad_n}"] if pad_n else [])
    warnings.warn(f"fp8kit: FP8 GEMM [{m}, {k}] x [{k}, {n}] is zero-padded ({', '.join(dims)}) to the multiples "
                  "of 16 cuBLASLt needs: exact, but it copies the padded operands and the output on every call. "
                  "Sizes that are multiples of 16 avoid it.", stacklevel=3)


def scaled_mm(a: Float8TensorStorage, b: Float8TensorStorage, out_dtype: torch.dtype,
              bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """`a @ b` through `torch._scaled_mm` with per-tensor scales `a.scale_inv`, `b.scale_inv` (device tensors):
    `a` made row-major and `b` column-major (from `_transpose` when present, without a copy), K and N zero-padded to
    multiples of 16 when needed. A bias of `out_dtype` bf16/fp16 goes into the GEMM's epilogue; otherwise the GEMM
    gives float32, the bias is added to it and the sum rounded once to `out_dtype`."""
    m, k, n = _check_shapes(a, b, "scaled_mm")
    low = out_dtype in (torch.bfloat16, torch.float16)
    use_bias = bias is not None and bias.dtype == out_dtype and low  # in the epilogue, before the one rounding
    # Otherwise a float32 result, so that the bias is added before the one rounding to out_dtype
    mm_dtype = out_dtype if low and (bias is None or use_bias) else torch.float32
    if m == 0 or k == 0 or n == 0:  # nothing to multiply: zeros (+ bias), no cuBLASLt edge cases
        out = torch.zeros((m, n), dtype=mm_dtype, device=a._data.device)
        return (out + bias.to(mm_dtype) if bias is not None else out).to(out_dtype)
    pad_k, pad_n = (-k) % _ALIGN, (-n) % _ALIGN
    if pad_k or pad_n:
        _warn_padding(m, k, n, pad_k, pad_n)
    mat_a = a.fp8_view()
    mat_a = mat_a if _is_row_major(mat_a) else mat_a.contiguous()
    mat_a = _padded(mat_a, pad_k, 0)
    mat_b = b.column_major_view() if not (pad_k or pad_n) else None  # kept by the storage: no operation
    if mat_b is None or not _is_col_major(mat_b):
        mat_b = _padded(_col_major_source(b), pad_k, pad_n).t()  # column-major [K', N'], as cuBLASLt FP8 wants
    mm_bias = bias
    if use_bias and pad_n:
        mm_bias = torch.nn.functional.pad(bias, (0, pad_n))
    out = torch._scaled_mm(
        mat_a,
        mat_b,
        scale_a=a.scale_inv,  # [1]: one element is per-tensor scaling (torch checks numel() == 1)
        scale_b=b.scale_inv,
        bias=mm_bias if use_bias else None,
        out_dtype=mm_dtype,
        use_fast_accum=use_fast_accum,
    )
    if pad_n:
        out = out[:, :n]
    if bias is not None and not use_bias:
        out = out + bias.to(out.dtype)  # float32 + bias, rounded once below
    elif pad_n:
        out = out.contiguous()
    return _as_dtype(out, out_dtype)


def emulated(a: Float8TensorStorage, b: Float8TensorStorage, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The CPU GEMM: the FP8 values widened exactly, multiplied with float32 accumulation, scaled by
    `alpha = float32(a.scale_inv * b.scale_inv)` (read on the host: CPU tensors only) and rounded once; one formula
    on every CPU path (host floats or tensors, eager or compiled)."""
    a_inv = a.scale_inv_value
    if a_inv is None:
        a_inv = _cpu_value(a.scale_inv)
    b_inv = b.scale_inv_value
    if b_inv is None:
        b_inv = _cpu_value(b.scale_inv)
    alpha = host.f32(a_inv * b_inv)  # the float32 product (exact in float64, rounded once)
    if out_dtype == torch.bfloat16 and alpha != _INF and math.prod(a.shape) * b.shape[1] >= _BF16_GEMM_MIN_MACS:
        # FP8 values are exact in bf16; addmm applies alpha to the float32 accumulator and rounds once to bf16,
        # which is what the float32 path below gives, at the speed of a bf16 GEMM.
        base = bias if bias is not None else _ZERO_BF16
        return torch.addmm(base, a.values(torch.bfloat16), b.values(torch.bfloat16),
                           beta=1 if bias is not None else 0, alpha=alpha)
    base = bias.float() if bias is not None else _ZERO_F32
    out = torch.addmm(base, a.values(torch.float32), b.values(torch.float32), beta=1 if bias is not None else 0,
                      alpha=alpha)
    return _as_dtype(out, out_dtype)


def _cpu_value(t: torch.Tensor) -> float:
    """The one element of a CPU tensor as a Python float, read from memory (`tolist` dispatches no operation)."""
    value = t.tolist()
    while type(value) is list:
        value = value[0]
    return value


@torch.library.custom_op("fp8kit::emulated_mm", mutates_args=())
def _emulated_mm(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor, b_scale_inv: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """`emulated` as a torch operation (what compiled graphs call on CPU)."""
    return emulated(Float8TensorStorage(data=a_data, fp8_scale_inv=a_scale_inv),
                    Float8TensorStorage(data=b_data, fp8_scale_inv=b_scale_inv), out_dtype, bias)


@_emulated_mm.register_fake
def _(a_data, a_scale_inv, b_data, b_scale_inv, bias, out_dtype):
    return a_data.new_empty((a_data.shape[0], b_data.shape[1]), dtype=out_dtype)


# Below this many multiply-adds a float32 GEMM beats a bf16 one on CPUs (its fixed cost is lower).
_BF16_GEMM_MIN_MACS = 1 << 24
_ZERO_BF16 = torch.zeros((), dtype=torch.bfloat16)
_ZERO_F32 = torch.zeros((), dtype=torch.float32)
_INF = float("inf")

register_gemm_rule(Float8TensorStorage, per_tensor_gemm)  # Float8Tensor (a subclass) included
