"""Host side of the cast kernels: checks, allocation and launches (Triton is reached at the first launch).

Every function gives the same bytes as the torch path (`fp8kit.pytorch.cast`); docs/kernels.md lists the launches
and the bytes each one moves.

Staging slots (`amax_out`): the tensor's amax is max-accumulated into it with one int32 atomic max per tile, which
equals `torch.fmax(amax_out, amax)` for every value `amax_out` can hold except a positive NaN (kept as NaN).
fp8kit's staging rows never hold NaN: casts record NaN-free amaxes and the update clears row 0 of used slots.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..cast import scale_from_amax
from .launch import cdiv, check_input, check_scalar, fp8_info, launch

CAST_BLOCK = 64  # cast+transpose tiles are CAST_BLOCK x CAST_BLOCK (not tuned on hardware yet)
FLAT_BLOCK = 4096  # elements per program of the flat cast and the amax (not tuned on hardware yet)
SUM_BLOCK_T, SUM_BLOCK_N = 16, 128  # the bias-gradient column sum


def _check_out(t, x, name, where) -> None:
    if t is not None:
        check_scalar(t, x, name, where)
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous")


def _run(x, m, n, fp8_dtype, *, scale=None, amax_buf=None, amax_bits=None, with_amax=False, scale_out=None,
         scale_inv_out=None, scaled_max=0.0, eps=0.0, power_2=False, transpose=False, dbias=False):
    """Allocate the outputs and launch one cast pass over `x` ([m, n] row-major). Returns (data, data_t, dbias) with
    the FP8 bytes as uint8 (the kernels write bytes; `_typed` gives the public functions' float8 views).
    `amax_bits`: `amax_buf` seen as int32 (the atomic max's operand), made here when not given."""
    fp8_max, e4m3 = fp8_info(fp8_dtype, "kernels")
    dev = x.device
    q = torch.empty(x.shape, dtype=torch.uint8, device=dev)
    data_t = torch.empty((n, m), dtype=torch.uint8, device=dev) if transpose else None
    grad = None
    if x.numel() == 0:
        if dbias:
            grad = torch.zeros((n,), dtype=x.dtype, device=dev)
        return q, data_t, grad
    if amax_buf is not None and amax_bits is None:
        amax_bits = amax_buf.view(torch.int32)
    dummy = q  # stands for the pointers a variant does not use
    common = (scale if scale is not None else dummy,
              amax_bits if amax_bits is not None else dummy,
              scale_out if scale_out is not None else dummy,
              scale_inv_out if scale_inv_out is not None else dummy)
    flags = dict(FP8_MAX=fp8_max, E4M3=e4m3, AMAX=with_amax, SCALE_FROM_AMAX=scale is None, POW2=bool(power_2),
                 WRITE_SCALE=scale_out is not None, WRITE_SCALE_INV=scale_inv_out is not None)
    writes = tuple(t for t in (q, data_t) if t is not None)
    if not (transpose or dbias):
        launch("cast_flat_kernel", (cdiv(x.numel(), FLAT_BLOCK),), dev,
               (x, q) + common + (x.numel(), float(scaled_max), float(eps)), dict(flags, BLOCK=FLAT_BLOCK),
               reads=(x,), writes=writes)
        return q, data_t, grad
    tiles_m, tiles_n = cdiv(m, CAST_BLOCK), cdiv(n, CAST_BLOCK)
    partial = torch.empty((tiles_m, n), dtype=torch.float32, device=dev) if dbias else None
    launch("cast_transpose_kernel", (tiles_m * tiles_n,), dev,
           (x, q, data_t if transpose else dummy) + common
           + (partial if dbias else dummy, m, n, tiles_n, float(scaled_max), float(eps)),
           dict(flags, TRANSPOSE=bool(transpose), DBIAS=bool(dbias), BLOCK_M=CAST_BLOCK, BLOCK_N=CAST_BLOCK),
           reads=(x,), writes=writes)
    if dbias:
        grad = torch.empty((n,), dtype=x.dtype, device=dev)
        launch("column_sum_kernel", (cdiv(n, SUM_BLOCK_N),), dev, (partial, grad, tiles_m, n),
               dict(BLOCK_T=SUM_BLOCK_T, BLOCK_N=SUM_BLOCK_N), reads=(partial,), writes=(grad,))
    return q, data_t, grad


def _typed(data, data_t, fp8_dtype, raw: bool):
    """The kernels' uint8 bytes as the public functions return them: float8 views, or the bytes with `raw`."""
    if raw:
        return data, data_t
    return data.view(fp8_dtype), (data_t.view(fp8_dtype) if data_t is not None else None)


def _reciprocal_into(scale_inv_out, scale) -> None:
    if scale_inv_out is not None:
        scale_inv_out.copy_(torch.reciprocal(scale).reshape(scale_inv_out.shape))


def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False,
              amax_out: Optional[torch.Tensor] = None, scale_inv_out: Optional[torch.Tensor] = None, *,
              raw: bool = False, amax_bits: Optional[torch.Tensor] = None):
    """Delayed-scaling cast in ONE kernel launch that reads `x` once.

    Takes `x` (float32/bfloat16/float16, contiguous, any shape; seen as [M, N] = [prod(shape[:-1]), shape[-1]]),
    `scale` (float32, one element, on x's device; read in the kernel, no host sync), the FP8 dtype, `transpose`,
    `amax_out` (optional float32 one-element tensor, e.g. the staging slot `state.staging(slot)`: the
    tensor's amax is max-accumulated into it, see the module docstring) and `scale_inv_out` (optional float32
    one-element tensor that gets `float32(1 / scale)`).
    Returns `(data, data_t, amax)`: FP8 `data` with x's shape, `data_t` [N, M] contiguous or None, and the amax
    tensor: `amax_out` when given (then it holds the accumulated value), else a fresh 0-d float32 with max|x|.
    Without `amax_out` the fresh buffer is zero-filled first (one `torch.zeros`).
    `raw=True` gives `data` / `data_t` as their uint8 bytes (no view operations: the quantizers' storages hold
    bytes); `amax_bits`, `amax_out` seen as int32 when the caller keeps that view (else made here).
    """
    where = "kernels.cast_amax"
    m, n = check_input(x, where)
    fp8_info(fp8_dtype, where)
    check_scalar(scale, x, "scale", where)
    _check_out(amax_out, x, "amax_out", where)
    _check_out(scale_inv_out, x, "scale_inv_out", where)
    amax_buf = amax_out if amax_out is not None else torch.zeros((), dtype=torch.float32, device=x.device)
    data, data_t, _ = _run(x, m, n, fp8_dtype, scale=scale, amax_buf=amax_buf,
                           amax_bits=amax_bits if amax_out is not None else None, with_amax=True,
                           scale_inv_out=scale_inv_out, transpose=transpose)
    if x.numel() == 0:
        if amax_out is not None:
            amax_out.copy_(torch.fmax(amax_out, torch.zeros_like(amax_out)))
        _reciprocal_into(scale_inv_out, scale)
    return (*_typed(data, data_t, fp8_dtype, raw), amax_buf)


def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False,
         scale_inv_out: Optional[torch.Tensor] = None):
    """Cast (+ transpose) with a known scale, no amax: one kernel launch.

    Takes the same `x`, `scale`, `fp8_dtype`, `transpose`, `scale_inv_out` as `cast_amax`.
    Returns `(data, data_t)`: FP8 `data` with x's shape and `data_t` [N, M] contiguous or None.
    """
    where = "kernels.cast"
    m, n = check_input(x, where)
    fp8_info(fp8_dtype, where)
    check_scalar(scale, x, "scale", where)
    _check_out(scale_inv_out, x, "scale_inv_out", where)
    data, data_t, _ = _run(x, m, n, fp8_dtype, scale=scale, scale_inv_out=scale_inv_out, transpose=transpose)
    if x.numel() == 0:
        _reciprocal_into(scale_inv_out, scale)
    return _typed(data, data_t, fp8_dtype, False)


def cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        amax_out: Optional[torch.Tensor] = None, scale_inv_out: Optional[torch.Tensor] = None):
    """Delayed scaling for a GEMM operand that is also needed transposed (x for wgrad, W for dgrad): ONE pass that
    reads `x` once and writes the FP8 bytes, the FP8 bytes of the transpose and the amax (into `amax_out`, the
    staging slot, when given).

    Takes what `cast_amax` takes. Returns `(data, data_t, scale_inv)`: `data` with x's shape, `data_t` [N, M]
    contiguous (`data_t == data.reshape(M, N).t()`), `scale_inv` a float32 one-element tensor (`scale_inv_out`
    when given, else a fresh 0-d one). Launches: 1 (+1 zero-fill without `amax_out`).
    """
    if scale_inv_out is None and isinstance(x, torch.Tensor):
        scale_inv_out = torch.empty((), dtype=torch.float32, device=x.device)
    data, data_t, _ = cast_amax(x, scale, fp8_dtype, True, amax_out, scale_inv_out)
    return data, data_t, scale_inv_out


def cast_transpose_dbias(dy: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                         amax_out: Optional[torch.Tensor] = None, scale_inv_out: Optional[torch.Tensor] = None, *,
                         raw: bool = False, amax_bits: Optional[torch.Tensor] = None):
    """Delayed scaling for grad_output, fused as Transformer Engine's bgrad+quantize: ONE pass over `dy` writes the
    FP8 bytes, their transpose (for wgrad), the amax (into `amax_out` when given) and per-tile column sums; a small
    second kernel adds the sums up into the bias gradient.

    Takes `dy` (float32/bfloat16/float16, contiguous, [..., N]) and the rest as `cast_amax`.
    Returns `(data, data_t, scale_inv, dbias)`: as `cast_transpose_amax`, plus `dbias` [N] in dy's dtype, the sum of
    dy over all leading dimensions accumulated in float32 (per 64-row tile, then over tiles in order: the same
    result on every run). Launches: 2 (+1 zero-fill without `amax_out`).
    """
    where = "kernels.cast_transpose_dbias"
    m, n = check_input(dy, where)
    fp8_info(fp8_dtype, where)
    check_scalar(scale, dy, "scale", where)
    _check_out(amax_out, dy, "amax_out", where)
    _check_out(scale_inv_out, dy, "scale_inv_out", where)
    if scale_inv_out is None:
        scale_inv_out = torch.empty((), dtype=torch.float32, device=dy.device)
    amax_buf = amax_out if amax_out is not None else torch.zeros((), dtype=torch.float32, device=dy.device)
    data, data_t, dbias = _run(dy, m, n, fp8_dtype, scale=scale, amax_buf=amax_buf,
                               amax_bits=amax_bits if amax_out is not None else None, with_amax=True,
                               scale_inv_out=scale_inv_out, transpose=True, dbias=True)
    if dy.numel() == 0:
        if amax_out is not None:
            amax_out.copy_(torch.fmax(amax_out, torch.zeros_like(amax_out)))
        _reciprocal_into(scale_inv_out, scale)
    return (*_typed(data, data_t, fp8_dtype, raw), scale_inv_out, dbias)


def amax(x: torch.Tensor) -> torch.Tensor:
    """`max |x|` over the non-NaN elements of `x` (float32/bfloat16/float16, contiguous, any shape) as a 0-d
    float32 tensor (0 for an empty or all-NaN tensor). One zero-fill plus one kernel launch."""
    check_input(x, "kernels.amax")
    return _amax_bits(x).view(torch.float32)


def _amax_bits(x: torch.Tensor) -> torch.Tensor:
    """`amax`'s launch: the amax's float32 bits as a 0-d int32 tensor (what the current-scaling cast kernels read;
    the float32 view is made only where one is asked for)."""
    bits = torch.zeros((), dtype=torch.int32, device=x.device)  # 0 is the bits of +0.0
    if x.numel():
        launch("amax_kernel", (cdiv(x.numel(), FLAT_BLOCK),), x.device, (x, bits, x.numel()),
               dict(BLOCK=FLAT_BLOCK), reads=(x,))
    return bits


def _current(x, fp8_dtype, amax_epsilon, power_2, transpose, group, dbias, where, raw=False, with_scale=True,
             with_amax=True):
    m, n = check_input(x, where)
    fp8_max, _ = fp8_info(fp8_dtype, where)
    eps = float(amax_epsilon)
    if not (eps >= 0 and eps != float("inf")):
        raise ValueError(f"{where}: amax_epsilon must be finite and >= 0, got {amax_epsilon!r}")
    bits = _amax_bits(x)
    a = bits.view(torch.float32) if (with_amax or group is not None or x.numel() == 0) else None
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    scale = torch.empty((), dtype=torch.float32, device=x.device) if with_scale else None
    # raw: scale_inv `[1]`, the storages' shape (no reshape later)
    scale_inv = torch.empty((1,) if raw else (), dtype=torch.float32, device=x.device)
    data, data_t, grad = _run(x, m, n, fp8_dtype, amax_bits=bits, scale_out=scale,
                              scale_inv_out=scale_inv, scaled_max=fp8_max, eps=eps, power_2=power_2,
                              transpose=transpose, dbias=dbias)
    if x.numel() == 0:
        clamped = torch.clamp_min(a, eps) if eps > 0 else a
        empty_scale = scale_from_amax(clamped, fp8_max, torch.ones_like(a), power_2)
        if scale is not None:
            scale.copy_(empty_scale)
        scale_inv.copy_(torch.reciprocal(empty_scale).reshape(scale_inv.shape))
    return (*_typed(data, data_t, fp8_dtype, raw), scale, scale_inv, a if with_amax else None, grad)


def current_cast(x: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0, power_2: bool = False,
                 transpose: bool = False, group=None, *, raw: bool = False, with_scale: bool = True,
                 with_amax: bool = True):
    """Current scaling (SPEC section 3): the amax pass, an optional all-reduce (MAX) of the amax over `group`, then
    one cast pass that computes the scale in the kernel from the amax and writes it with its inverse.

    Takes `x` as in `cast_amax`, the FP8 dtype, `amax_epsilon` (finite, >= 0), `power_2`, `transpose`, and a
    torch.distributed process group or None.
    Returns `(data, data_t, scale, scale_inv, amax)`; the last three are 0-d float32 tensors (amax after the
    reduction, before the epsilon). Two kernel launches (plus the amax zero-fill).
    `raw=True`: `data` / `data_t` as uint8 bytes and `scale_inv` of shape `[1]` (what the quantizers' storages
    hold, with no view operations). `with_scale=False`: the scale is not written (None is returned for it; the
    quantizers need only `scale_inv`), one allocation less; `with_amax=False`: None for the amax (no float32 view of
    the amax kernel's int32 output).
    """
    data, data_t, scale, scale_inv, a, _ = _current(x, fp8_dtype, amax_epsilon, power_2, transpose, group, False,
                                                    "kernels.current_cast", raw, with_scale, with_amax)
    return data, data_t, scale, scale_inv, a


def current_cast_transpose_dbias(dy: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0,
                                 power_2: bool = False, group=None, *, raw: bool = False, with_scale: bool = True,
                                 with_amax: bool = True):
    """Current scaling for grad_output: the amax pass (+ all-reduce over `group`), then one pass that writes the FP8
    bytes, their transpose and the bias-gradient partial sums, and the column-sum kernel.

    Returns `(data, data_t, scale, scale_inv, amax, dbias)` (see `current_cast` and `cast_transpose_dbias`).
    Launches: 3 (plus the amax zero-fill). `raw`, `with_scale` and `with_amax` as in `current_cast`.
    """
    return _current(dy, fp8_dtype, amax_epsilon, power_2, True, group, True, "kernels.current_cast_transpose_dbias",
                    raw, with_scale, with_amax)
