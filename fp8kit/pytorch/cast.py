"""The FP8 cast and the scale rules, as pure functions on tensors.

One convention everywhere: `q = saturate(float32(x) * scale)` rounded to nearest even, `x ~= q * scale_inv`,
`scale_inv = float32(1 / scale)`.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..recipe import FLT_MAX, SCALE_MIN
from . import cpu_kernels, host
from .block_cast import positive_nan_
from .tensor import lookup
from .tensor.deferred import DeferredBytesStorage
from .tensor.storage import Float8TensorStorage, widen

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The largest float32 that torch's float32 -> FP8 conversion (round to nearest even) takes to the largest finite FP8
# value without a clamp: the midpoint between max and the next step (480 for E4M3, 65536 = inf for E5M2) where it
# rounds to the even neighbour, max (E4M3's 464), else the float32 below it (E5M2's midpoint 61440 rounds to inf).
# Up to these the conversion without a clamp is the saturating cast (tests/test_cast_cpu.py checks every float32
# from max up to them against tests/reference.py). torch 2.13 also saturates E4M3 above 464; older versions give
# NaN there, so the bound does not rely on it.
UNCLAMPED_MAX = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0 - 2.0 ** -8}
_DTYPE_OF_NAME = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max_of(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype. While torch.compile traces: a literal (torch.finfo folds to one),
    since with dynamic=True dynamo makes floats read from module globals symbolic, and autograd.Function bodies
    cannot take symbolic floats from outside (torch 2.13)."""
    if torch.compiler.is_compiling():
        return float(torch.finfo(fp8_dtype).max)
    return FP8_MAX[fp8_dtype]


def fp8_dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a recipe format name ("e4m3" or "e5m2")."""
    return _DTYPE_OF_NAME[name]


def amax(x: torch.Tensor) -> torch.Tensor:
    """`max |x|` over the non-NaN elements as a 0-d float32 tensor (0 for an empty or all-NaN tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if not host.active(x.device):  # accelerators (and CPU tensors inside host.tensor_path(), as the tests run it)
        return _device_amax(x)
    lo, hi = torch.aminmax(x)
    a = torch.maximum(hi, -lo).float()  # NaN if x holds a NaN
    if not torch.isnan(a):
        return a
    return torch.where(torch.isnan(x), 0, x.abs()).amax().float()


CPU_ABS_AMAX_MIN_NUMEL = 1 << 10  # below this, bf16/fp16 CPU tensors reduce faster by the norm (one operation)


def _device_amax(x: torch.Tensor) -> torch.Tensor:
    """`amax` on accelerators, without a host sync: NaN becomes 0 (infinities kept), then one max|.| reduction in
    float32 (exact: every value of x is a float32 value). Two kernels (eager torch has no NaN-ignoring max); the
    Triton kernels (fp8kit.pytorch.kernels) need one."""
    clean = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
    if clean.device.type == "cpu" and (clean.dtype == torch.float32 or clean.numel() >= CPU_ABS_AMAX_MIN_NUMEL):
        # torch's CPU infinity norm is a slow loop (8x |.| then max at 64k elements); max is exact in any dtype
        a = clean.abs_().amax()
        return a if a.dtype == torch.float32 else a.float()
    if clean.dtype == torch.float64:
        return torch.linalg.vector_norm(clean, math.inf).float()
    return torch.linalg.vector_norm(clean, math.inf, dtype=torch.float32)


POW2_BITS = 0x7F800000  # the exponent bits of a float32


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Clear the 23 mantissa bits of float32 scales (normal and positive, as `scale_from_amax` makes them)."""
    return (scale.view(torch.int32) & POW2_BITS).view(torch.float32)


def scale_from_amax(
    amax_value: torch.Tensor, scaled_max: float, fallback: torch.Tensor, power_2: bool = False
) -> torch.Tensor:
    """`scaled_max / amax` in float32 where amax is finite and > 0, else `fallback`; the quotient is clamped to
    [SCALE_MIN, FLT_MAX] (an infinite one becomes FLT_MAX); optionally rounded down to a power of two. Works
    elementwise on any shape."""
    scale = scale_quotient(amax_value, torch.full_like(amax_value, scaled_max), power_2)
    return torch.where((amax_value > 0) & (amax_value < math.inf), scale, fallback)  # finite, > 0 (not NaN)


def scale_quotient(amax_value: torch.Tensor, numerator: torch.Tensor, power_2: bool = False,
                   out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """`numerator / amax` (numerator: float32 holding the scaled max, broadcasting against the amax) as one true
    float32 division, clamped to [SCALE_MIN, FLT_MAX], optionally rounded down to a power of two: the scale of
    every finite amax > 0 (meaningless elsewhere: NaN stays NaN). `out`: a float32 tensor of the
    result's shape and its int32 view, written in place (the rounding too)."""
    if out is None:
        scale = torch.div(numerator, amax_value)  # true float32 division (Tensor.__rtruediv__ would round twice)
    else:
        scale = torch.div(numerator, amax_value, out=out[0])
    if torch.compiler.is_compiling():  # literals, not module globals (see fp8_max_of)
        scale = scale.clamp_(2.0 ** -63, float(torch.finfo(torch.float32).max))
    else:
        scale = scale.clamp_(SCALE_MIN, FLT_MAX)
    if not power_2:
        return scale
    if out is None:
        return round_down_pow2(scale)
    out[1].bitwise_and_(POW2_BITS)
    return scale


def current_scale(
    x: torch.Tensor,
    fp8_max: float,
    amax_epsilon: float = 0.0,
    power_2: bool = False,
    group=None,
) -> torch.Tensor:
    """The current-scaling scale of `x` (SPEC section 3), with the amax all-reduced (MAX) over `group` if given."""
    a = amax(x)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    if amax_epsilon > 0:
        a = torch.clamp_min(a, amax_epsilon)
    return scale_from_amax(a, fp8_max, torch.ones_like(a), power_2)


def current_scale_1d(x: torch.Tensor, fp8_max: float, amax_epsilon: float = 0.0,
                     power_2: bool = False, group=None) -> torch.Tensor:
    """`current_scale` on the eager tensor path (not traced) as a float32 `[1]` tensor (what `cast_1d` takes), in
    fewer operations, with the same values: `fp8_max + 0 * a / a` (one `addcdiv` on a kept `[1]` constant) is fp8_max
    where the amax is finite and > 0 and NaN where it is 0 or inf (the amax is never NaN here), so dividing it by the
    amax gives the rule's quotient, rounded once, or NaN exactly where the rule keeps 1."""
    a = _device_amax(x) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    if group is not None:
        import torch.distributed as dist

        a = a.reshape(1)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    if amax_epsilon > 0:
        a = torch.clamp_min(a, amax_epsilon)
    scale = torch.div(torch.addcdiv(_fp8_max_1d(fp8_max, a.device), a, a, value=0), a)
    scale.clamp_(SCALE_MIN, FLT_MAX)
    scale.nan_to_num_(nan=1.0)
    return round_down_pow2(scale) if power_2 else scale


_FP8_MAX_1D: dict = {}


def _fp8_max_1d(fp8_max: float, device: torch.device) -> torch.Tensor:
    """A float32 `[1]` tensor holding `fp8_max` on `device`, made once (read only)."""
    key = (fp8_max, device)
    found = _FP8_MAX_1D.get(key)
    if found is None:
        with torch.inference_mode(False):
            found = _FP8_MAX_1D[key] = torch.full((1,), fp8_max, dtype=torch.float32, device=device)
    return found


def cast_1d(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> Float8TensorStorage:
    """`cast` on the eager tensor path for `x` of at least one dimension and a float32 `[1]` scale (a view made once):
    one multiply promotes x to float32, one clamp saturates, one conversion rounds (on a CPU one more operation makes
    NaN positive, as a GPU's multiply does: `positive_nan_`); scale_inv is its reciprocal."""
    fp8_max = FP8_MAX[fp8_dtype]  # eager only (see fp8_max_of)
    y = torch.mul(x if x.dtype != torch.float64 else x.float(), scale)
    positive_nan_(y.clamp_(-fp8_max, fp8_max))
    return Float8TensorStorage.trusted(y.to(fp8_dtype), torch.reciprocal(scale), x.dtype)


def cast_to_fp8(x: torch.Tensor, scale: Union[torch.Tensor, float], fp8_dtype: torch.dtype,
                saturate: bool = True, nan_free: bool = False) -> torch.Tensor:
    """The FP8 bytes of `saturate(float32(x) * scale)`; `scale` is a float32 tensor with one element or a float
    holding a float32 value. `saturate=False` skips the clamp, for callers that know no product exceeds fp8_max.
    A NaN gives 0x7F whatever its sign, as on a GPU (`positive_nan_`; skipped for a `nan_free` x)."""
    fp8_max = fp8_max_of(fp8_dtype)
    if not host.active(x.device) and x.dtype in (torch.bfloat16, torch.float16) and isinstance(scale, torch.Tensor):
        # Accelerators: one multiply kernel reads x and writes the float32 product (a one-element 1-d scale takes
        # part in type promotion, a 0-d one would not), instead of a float32 copy of x multiplied in place.
        y = torch.mul(x, scale.reshape(1)).reshape(x.shape)
    else:
        # x.float() first: a 0-d float32 scale would not promote a bf16 tensor to float32.
        y = x.float().mul_(scale) if x.dtype != torch.float32 else x * scale
    if saturate:
        y.clamp_(-fp8_max, fp8_max)  # clamp keeps NaN
    if not nan_free:
        positive_nan_(y)
    return y.to(fp8_dtype)


def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> Float8TensorStorage:
    """Quantize with a known float32 scale (no validation; the hot path)."""
    return Float8TensorStorage(data=cast_to_fp8(x, scale, fp8_dtype), fp8_scale_inv=torch.reciprocal(scale.reshape(1)),
                               fake_dtype=x.dtype)


def cast_host(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, amax_value: float,
              nan_free: bool = False, defer_bytes: bool = False, values: bool = True) -> Float8TensorStorage:
    """`cast` on the CPU fast path (fp8kit.pytorch.host): `scale` a float32 value as a Python float and
    `amax_value` the tensor's NaN-ignoring amax. Bytes and scale_inv equal `cast`'s. `nan_free`: the caller knows
    x holds no NaN (`host.amax_nan`), so the saturated bytes hold no NaN or inf code either, which the CPU GEMM's
    widening then need not check. `defer_bytes`: where the table cast gives the widened values (a large bf16 x),
    make the bytes only when first read (`tensor.deferred`; the backward's grad_output, which the GEMMs read as
    values only); x must not be modified in place until then. `values=False`: no GEMM follows (the quantize API), so
    the table cast gathers the bytes only."""
    if cpu_kernels.takes(x):
        done = _cast_native(x, scale, fp8_dtype, nan_free, defer_bytes, values)
        if done is not None:
            return done[0]
    widened = None
    if x.dtype in _TABLE_DTYPES and x.numel() >= TABLE_MIN_NUMEL and torch.get_num_threads() == 1:
        if defer_bytes and x.dtype == torch.bfloat16 and not x.is_inference():
            return _deferred_cast_by_table(x, scale, fp8_dtype, nan_free)
        data, widened = _cast_by_table(x, scale, fp8_dtype, values)
    else:
        # Products are monotonic in |x|: when the largest is one torch's conversion rounds to at most ±max, no
        # element needs the clamp (UNCLAMPED_MAX; current scaling's `amax * (max / amax)` can exceed max by an ulp).
        in_range = host.f32(amax_value * scale) <= UNCLAMPED_MAX[fp8_dtype]
        data = cast_to_fp8(x, scale, fp8_dtype, saturate=not in_range, nan_free=nan_free)
    # scale_inv is made from the float when asked
    q = Float8TensorStorage(data=data, fake_dtype=x.dtype, scale_inv_value=host.reciprocal(scale))
    q._codes_finite = nan_free
    q._values = widened
    return q


# Large 16-bit CPU tensors are cast through a table. The FP8 byte of `saturate(float32(x) * scale)` depends only on
# x's 16 bits once the scale is fixed, so `cast_to_fp8` applied to all 65536 bit patterns of x's dtype gives a table
# that one gather maps x through (tensor.lookup): the same bytes, since the table is the cast itself. A bf16 x gets,
# from the same gather, the FP8 values widened to bf16 (the CPU GEMM's operand, `Float8TensorStorage.values`), so
# x is read once and nothing is converted twice. Below TABLE_MIN_NUMEL elements, making the tables costs more than
# it saves. Only with one intra-op thread: the gather runs on one thread, while torch's conversions and elementwise
# operations split across threads and win with two or more (docs/performance.md).
TABLE_MIN_NUMEL = 1 << 17
_TABLE_DTYPES = (torch.bfloat16, torch.float16)
_PATTERNS: dict = {}  # dtype -> (its 65536 bit patterns as that dtype, the indices of the NaN ones, their bytes)


def _patterns(dtype: torch.dtype):
    found = _PATTERNS.get(dtype)
    if found is None:
        with torch.inference_mode(False):
            patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(dtype)
            nan_index = torch.isnan(patterns).nonzero().view(-1)
            nan_bytes = torch.full(nan_index.shape, 0x7F, dtype=torch.uint8)  # whatever the sign (positive_nan_)
        found = _PATTERNS[dtype] = (patterns, nan_index, nan_bytes)
    return found


def _tables(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, values: bool = True):
    """(the byte table as uint8, the widened-value table as int16 or None) of x's dtype for this scale and format
    (the latter for a bf16 x when `values`)."""
    patterns, nan_index, nan_bytes = _patterns(x.dtype)
    table = cast_to_fp8(patterns, scale, fp8_dtype)
    # NaN is the byte 0x7F in both formats, as on a GPU (`positive_nan_`; tests/reference.py), put in explicitly:
    # torch's own CPU conversion gives either sign depending on where the element falls in its vector loop
    table.view(torch.uint8).index_put_((nan_index,), nan_bytes)
    wide = None
    if x.dtype == torch.bfloat16 and values:
        # only the NaN patterns have NaN codes (the cast saturates): widen the rest by bits, then put NaN back
        wide = widen(table, torch.bfloat16, codes_finite=True).view(torch.int16)
        wide.index_put_((nan_index,), nan_bytes.to(torch.int16) << 8 | 0xC0)  # 0x7FC0: the positive NaN
    return table.view(torch.uint8), wide


def _cast_by_table(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, values: bool = True):
    """(`cast_to_fp8(x, scale, fp8_dtype)`, its values widened to bf16 (a bf16 x, when `values`) or None) for a
    bf16/fp16 CPU tensor, by 65536-entry tables (see above)."""
    table, wide = _tables(x, scale, fp8_dtype, values)
    data = torch.empty(x.shape, dtype=fp8_dtype)
    tables, outs = [table], [data.view(torch.uint8).view(-1)]
    widened = None
    if wide is not None:
        widened = torch.empty(x.shape, dtype=torch.bfloat16)
        tables.append(wide)
        outs.append(widened.view(torch.int16).view(-1))
    lookup.gather(x.reshape(-1).view(torch.uint16), tables, outs)
    return data, widened


def _deferred_cast_by_table(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype,
                            nan_free: bool) -> DeferredBytesStorage:
    """`_cast_by_table` of a bf16 x with the bytes left for their first read (`DeferredBytesStorage`): the values
    now, the bytes later from the same table and codes, unless x was modified in place in between (an error)."""
    table, wide = _tables(x, scale, fp8_dtype)
    codes = x.reshape(-1).view(torch.uint16)
    values = torch.empty(x.shape, dtype=torch.bfloat16)
    lookup.gather(codes, [wide], [values.view(torch.int16).view(-1)])
    version, shape = codes._version, x.shape

    def make_bytes() -> torch.Tensor:
        if codes._version != version:
            raise RuntimeError("fp8kit: the tensor an FP8 grad_output was cast from was modified in place before "
                               "its FP8 bytes were read (the CPU cast makes them on first read)")
        data = torch.empty(shape, dtype=torch.uint8)
        lookup.gather(codes, [table], [data.view(-1)])
        return data

    return DeferredBytesStorage.make(shape, fp8_dtype, values, make_bytes, x.dtype, host.reciprocal(scale),
                                     nan_free)


# With fp8kit's CPU kernels (fp8kit.pytorch.cpu_kernels: a C loop compiled on first use), one vectorised pass reads x
# and writes the bytes and, for a bf16 x, the values widened to bf16: the same bytes and values as the table and
# torch paths (tests/test_cpu_kernels.py, every bf16 and fp16 pattern), about 3x faster than the table's gather.
def _cast_native(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, nan_free: bool, defer_bytes: bool,
                 values: bool, track: bool = False):
    """`cast_host` by the CPU kernels for a contiguous x: (the storage, with `track` x's (amax, NaN-free) from the
    same pass, else None), or None where they refuse (subnormals flushed)."""
    want_values = values and x.dtype == torch.bfloat16
    run = cpu_kernels.cast_amax if track else cpu_kernels.cast
    inv = host.reciprocal(scale)
    if defer_bytes and want_values and not x.is_inference():
        widened = cpu_kernels.pool.empty(x.shape, torch.bfloat16)
        seen = run(x, scale, fp8_dtype, None, widened)
        if not seen:
            return None
        version = x._version

        def make_bytes() -> torch.Tensor:
            if x._version != version:
                raise RuntimeError("fp8kit: the tensor an FP8 grad_output was cast from was modified in place "
                                   "before its FP8 bytes were read (the CPU cast makes them on first read)")
            data = torch.empty(x.shape, dtype=torch.uint8)
            if not cpu_kernels.cast(x, scale, fp8_dtype, data, None):  # subnormals flushed since: torch's cast
                data = cast_to_fp8(x, scale, fp8_dtype).view(torch.uint8)
            return data

        finite = seen[1] if track else nan_free
        return DeferredBytesStorage.make(x.shape, fp8_dtype, widened, make_bytes, x.dtype, inv, finite), \
            (seen if track else None)
    data = torch.empty(x.shape, dtype=torch.uint8)
    widened = cpu_kernels.pool.empty(x.shape, torch.bfloat16) if want_values else None
    seen = run(x, scale, fp8_dtype, data, widened)
    if not seen:
        return None
    q = Float8TensorStorage.from_bytes(data, fp8_dtype, None, x.dtype, scale_inv_value=inv)
    q._codes_finite = seen[1] if track else nan_free
    q._values = widened
    return q, (seen if track else None)


def cast_host_recording(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype,
                        defer_bytes: bool = False) -> Optional[Tuple[Float8TensorStorage, float, bool]]:
    """Delayed scaling's host-path cast with the amax it records, in one pass where the CPU kernels take x: (the
    storage `cast_host` makes, `host.amax_nan(x)`), or None (then take the amax and `cast_host` apart)."""
    if cpu_kernels.takes(x):
        done = _cast_native(x, scale, fp8_dtype, False, defer_bytes, True, track=True)
        if done is not None:
            q, (a, nan_free) = done
            return q, a, nan_free
    return None
