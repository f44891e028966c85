"""Triton kernels for the FP8 cast, the amax and the delayed-scaling update (SPEC sections 1, 3, 5).

Only kernels live here; the host code that validates, allocates and launches is `fp8kit.pytorch.kernels.ops`.
This file imports nothing from fp8kit: `fp8kit.pytorch.kernels.kernel_module` loads it twice under different module
names, once with Triton's interpreter off (CUDA tensors) and once with it on (CPU tensors), because `triton.jit`
decides between compiling and interpreting when it decorates a function.

Numerics follow `fp8kit.pytorch.cast` bit for bit: `y = float32(x) * scale`, clamp to +-fp8_max keeping NaN, convert
with round-to-nearest-even; a NaN is written as the byte torch writes (0x7F, with the sign bit of `y`). Divisions
use `tl.math.div_rn` (IEEE division; Triton's `/` on float32 may be approximate on GPUs).
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
SCALE_MIN = tl.constexpr(2.0 ** -63)  # fp8kit.recipe.SCALE_MIN


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


# Reductions go through `tl.reduce` with Triton's own max combiner, which the interpreter recognises and runs in
# NumPy; `tl.max` itself (a jit function of triton.language.standard) cannot run in the interpreter when Triton was
# imported before TRITON_INTERPRET was set. Triton's combiner was decorated when Triton was imported: a compiled
# variant cannot call it if that happened in interpreter mode. Then, or if it is missing, our combiner is used
# (correct everywhere, slow in the interpreter).
_INTERPRETED = not isinstance(_max_combine, triton.runtime.JITFunction)
_MAX = getattr(tl.standard, "_elementwise_max", None)
if _MAX is None or not (_INTERPRETED or isinstance(_MAX, triton.runtime.JITFunction)):
    _MAX = _max_combine


@triton.jit
def _tile_max(v, axis: tl.constexpr):
    return tl.reduce(v, axis, _MAX)


@triton.jit
def _round_down_pow2(s):
    """Clear the 23 mantissa bits of float32 `s` (normal and positive, as `_scale_rule` makes it)."""
    return (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _scale_rule(a, scaled_max, fallback, POW2: tl.constexpr):
    """`scaled_max / a` (IEEE float32) where `a` is finite and > 0, else `fallback`; the quotient is clamped to
    [SCALE_MIN, FLT_MAX]; optionally rounded down to a power of two. Elementwise, like `cast.scale_from_amax`."""
    s = tl.math.div_rn(tl.where(a == a, scaled_max, scaled_max), a)  # scaled_max in a's shape
    s = tl.where(s > FLT_MAX, FLT_MAX, s)
    s = tl.where(s < SCALE_MIN, SCALE_MIN, s)  # NaN compares false and is masked below
    if POW2:
        s = _round_down_pow2(s)
    ok = (a > 0.0) & (a <= FLT_MAX)  # False for NaN
    return tl.where(ok, s, fallback)


@triton.jit
def _fmax_bits(old_bits, v):
    """Bits of `fmax(float(old_bits), v)` for a non-NaN `v`: a NaN already stored is replaced."""
    old = old_bits.to(tl.float32, bitcast=True)
    new = tl.where(old != old, v, tl.maximum(old, v))
    return new.to(tl.int32, bitcast=True)


@triton.jit
def _fmax_accumulate(ptr, bits_ptr, v):
    """NaN-ignoring max-accumulate of the scalar `v` (not NaN, >= 0) into the float32 at `ptr` (`bits_ptr`: the
    same address as int32), like `torch.fmax`.

    A volatile read first: the stored value only grows while the kernel runs (NaN is replaced once, then it is
    a number), so a read that is not below `v` means nothing to do. A stored number below `v` takes `atomic_max`;
    a stored NaN (which `atomic_max` would keep) takes a compare-and-swap loop.
    """
    old = tl.load(bits_ptr, volatile=True)
    old_f = old.to(tl.float32, bitcast=True)
    if old_f != old_f:
        new = _fmax_bits(old, v)
        while new != old:
            prev = tl.atomic_cas(bits_ptr, old, new)
            old = tl.where(prev == old, new, prev)  # success: done; failure: retry against what is there now
            new = _fmax_bits(old, v)
    elif v > old_f:
        tl.atomic_max(ptr, v)


@triton.jit
def _nan_free_abs(x):
    ax = tl.abs(x)
    return tl.where(ax == ax, ax, 0.0)


@triton.jit
def cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, amax_bits_ptr, scale_out_ptr, scale_inv_ptr,
                M, N, scaled_max, eps,
                FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr, AMAX: tl.constexpr,
                SCALE_FROM_AMAX: tl.constexpr, POW2: tl.constexpr, WRITE_SCALE: tl.constexpr,
                WRITE_SCALE_INV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cast one [BLOCK_M, BLOCK_N] tile of the row-major [M, N] `x` to FP8 bytes at `q_ptr` (uint8 [M, N]) and,
    with TRANSPOSE, at `qt_ptr` (uint8 [N, M]).

    The scale is `scale_ptr[0]`, or with SCALE_FROM_AMAX the current-scaling scale of `amax_ptr[0]`
    (`max(amax, eps)`, `scaled_max / amax`, 1 when that amax is 0, inf or NaN). With AMAX the tile's NaN-ignoring
    max|x| is max-accumulated (fmax) into the float32 at `amax_ptr` (int32 view: `amax_bits_ptr`). Program (0, 0)
    writes the scale to `scale_out_ptr` (WRITE_SCALE) and `float32(1 / scale)` to `scale_inv_ptr` (WRITE_SCALE_INV).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SCALE_FROM_AMAX:
        a = tl.load(amax_ptr)
        a = tl.where(a < eps, eps, a)  # clamp_min; a NaN stays NaN
        s = _scale_rule(a, scaled_max, 1.0, POW2)
    else:
        s = tl.load(scale_ptr)
    if WRITE_SCALE or WRITE_SCALE_INV:
        if (pid_m == 0) & (pid_n == 0):
            if WRITE_SCALE:
                tl.store(scale_out_ptr, s)
            if WRITE_SCALE_INV:
                tl.store(scale_inv_ptr, tl.math.div_rn(tl.where(s == s, 1.0, 1.0), s))
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        _fmax_accumulate(amax_ptr, amax_bits_ptr, _tile_max(_tile_max(_nan_free_abs(x), 1), 0))
    y = x * s
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    y = tl.where(y < -FP8_MAX, -FP8_MAX, y)  # comparisons are False for NaN: NaN stays NaN
    if E4M3:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
    bits = q.to(tl.uint8, bitcast=True)
    nan_bits = tl.where(y.to(tl.int32, bitcast=True) < 0, 0xFF, 0x7F).to(tl.uint8)
    bits = tl.where(y != y, nan_bits, bits)
    tl.store(q_ptr + offs, bits, mask=mask)
    if TRANSPOSE:
        offs_t = rn.to(tl.int64)[:, None] * M + rm[None, :]
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        tl.store(qt_ptr + offs_t, tl.trans(bits), mask=mask_t)


@triton.jit
def amax_kernel(x_ptr, out_ptr, out_bits_ptr, numel, BLOCK: tl.constexpr):
    """Max-accumulate the NaN-ignoring max|x| of one BLOCK of the flat `x` into the float32 `out_ptr[0]` (zeroed by
    the caller; `out_bits_ptr` is its int32 view)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    _fmax_accumulate(out_ptr, out_bits_ptr, _tile_max(_nan_free_abs(x), 0))


@triton.jit
def _update_columns(h_ptr, s_ptr, cols, cmask, stride, L, recompute, scaled_max,
                    MOST_RECENT: tl.constexpr, POW2: tl.constexpr, BLOCK_L: tl.constexpr):
    """SPEC section 5 in place for the columns `cols` (mask `cmask`) of the row-major [L, stride] history at
    `h_ptr` and the scales at `s_ptr`. `recompute` (bool per column) gates the scale change.

    A column whose staging value (row 0) is not 0 rolls: rows 2..L-1 move up one row, row L-1 gets the staging
    value, row 0 becomes 0. The amax is the max over all rows with NaN read as 0 ("max") or the staging value
    ("most_recent"). Each tile is read before a barrier and shifted after it, so the in-place roll has no race.
    """
    last = tl.load(h_ptr + cols, mask=cmask, other=0.0)
    used = last != 0.0  # True for NaN, as in torch
    acc = tl.where(last == last, last, 0.0)
    for r0 in range(1, L, BLOCK_L):
        rows = r0 + tl.arange(0, BLOCK_L)
        m2 = (rows[:, None] < L) & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        v = tl.load(h_ptr + offs, mask=m2, other=0.0)
        acc = tl.maximum(acc, _tile_max(tl.where(v == v, v, 0.0), 0))
        tl.debug_barrier()
        tl.store(h_ptr + offs - stride, v, mask=m2 & (rows[:, None] >= 2) & used[None, :])
    tl.debug_barrier()
    if L > 1:
        tl.store(h_ptr + (L - 1) * stride + cols, last, mask=cmask & used)
    tl.store(h_ptr + cols, tl.where(used, 0.0, 0.0), mask=cmask & used)
    old = tl.load(s_ptr + cols, mask=cmask, other=1.0)
    if MOST_RECENT:
        a = last
    else:
        a = acc
    new = _scale_rule(a, scaled_max, old, POW2)
    tl.store(s_ptr + cols, new, mask=cmask & used & recompute)


@triton.jit
def update_kernel(h_ptr, s_ptr, recompute_ptr, N, L, scaled_max,
                  HAS_MASK: tl.constexpr, MOST_RECENT: tl.constexpr, POW2: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """The update of BLOCK_N columns of one row-major [L, N] history and [N] scale, in place. With HAS_MASK,
    `recompute_ptr` holds one int8 per column (nonzero: the scale may change)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_MASK:
        recompute = tl.load(recompute_ptr + cols, mask=cmask, other=0) != 0
    else:
        recompute = cmask
    _update_columns(h_ptr, s_ptr, cols, cmask, N, L, recompute, scaled_max, MOST_RECENT, POW2, BLOCK_L)


@triton.jit
def update_table_kernel(table_ptr, K, L, scaled_max,
                        MOST_RECENT: tl.constexpr, POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_L: tl.constexpr):
    """The update of state `program_id(0)` of K states, in place, from an int64 table `[4, K]`: the addresses of
    each state's [L, n] history and [n] scale (float32, contiguous), n, and the recompute flag (0 or 1)."""
    k = tl.program_id(0)
    h_ptr = tl.load(table_ptr + k).to(tl.pointer_type(tl.float32))
    s_ptr = tl.load(table_ptr + K + k).to(tl.pointer_type(tl.float32))
    n = tl.load(table_ptr + 2 * K + k)
    flag = tl.load(table_ptr + 3 * K + k)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        recompute = (cols * 0 + flag) != 0  # a vector: the interpreter mistypes scalar & vector bools
        _update_columns(h_ptr, s_ptr, cols, cols < n, n, L, recompute, scaled_max, MOST_RECENT, POW2, BLOCK_L)
