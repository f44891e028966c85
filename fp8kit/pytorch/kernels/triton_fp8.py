"""Triton kernels for the FP8 cast (+ transpose, amax, bias gradient), the amax and the delayed-scaling update
(SPEC sections 1, 3, 5).

Only kernels live here; the host code that validates, allocates and launches is `fp8kit.pytorch.kernels.cast_ops`
and `.update_ops`. This file imports nothing from fp8kit: `fp8kit.pytorch.kernels.kernel_module` loads it twice
under different module names, once with Triton's interpreter off (CUDA tensors) and once with it on (CPU tensors),
because `triton.jit` decides between compiling and interpreting when it decorates a function.

Numerics follow `fp8kit.pytorch.cast` bit for bit: `y = float32(x) * scale`, clamp to +-fp8_max keeping NaN, convert
with round-to-nearest-even; a NaN is written as 0x7F whatever its sign (a GPU's `x * scale` makes every NaN the
positive canonical one; `block_cast.positive_nan_`). Divisions use `tl.math.div_rn` (IEEE division; Triton's `/`
on float32 may be approximate on GPUs).

Control flow: the cast and amax kernels have none that depends on data. Every program runs the same instructions
(the scale writes of program 0 are masked stores, not branches) and max-accumulates its tile's amax with exactly one
atomic, so no barrier Triton inserts can be reached by some warps of a CTA and not others. The update kernels loop
over bounds that are kernel arguments (uniform across the CTA).
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
SCALE_MIN = tl.constexpr(2.0 ** -63)  # fp8kit.recipe.SCALE_MIN


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


# Reductions go through `tl.reduce` with Triton's own combiners, which the interpreter recognises and runs in NumPy;
# `tl.max`/`tl.sum` themselves (jit functions of triton.language.standard) cannot run in the interpreter when Triton
# was imported before TRITON_INTERPRET was set. Triton's combiners were decorated when Triton was imported: a
# compiled variant cannot call them if that happened in interpreter mode. Then, or if they are missing, ours are used
# (correct everywhere, slow in the interpreter).
_INTERPRETED = not isinstance(_max_combine, triton.runtime.JITFunction)


def _combiner(name, ours):
    theirs = getattr(tl.standard, name, None)
    if theirs is None or not (_INTERPRETED or isinstance(theirs, triton.runtime.JITFunction)):
        return ours
    return theirs


_MAX = _combiner("_elementwise_max", _max_combine)
_SUM = _combiner("_sum_combine", _add_combine)


@triton.jit
def _tile_max(v, axis: tl.constexpr):
    return tl.reduce(v, axis, _MAX)


@triton.jit
def _tile_sum(v, axis: tl.constexpr):
    return tl.reduce(v, axis, _SUM)


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
def _nan_free_abs(x):
    ax = tl.abs(x)
    return tl.where(ax == ax, ax, 0.0)


@triton.jit
def _accumulate_amax(amax_bits_ptr, tile_amax):
    """Max-accumulate a tile's amax (>= 0, never NaN) into the float32 whose int32 view is `amax_bits_ptr`: ONE
    atomic per program, unconditional. For non-negative floats the int32 order of the bit patterns is the float
    order, and every stored value with the sign bit set (a negative number, -0.0, a negative NaN) is below them and
    gets replaced, as `torch.fmax` would. A positive NaN already stored is kept: fp8kit's staging rows never hold one
    (casts accumulate NaN-free amaxes, the update clears row 0), and `cast_ops` documents it."""
    tl.atomic_max(amax_bits_ptr, tile_amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _cast_scale(scale_ptr, amax_bits_ptr, eps, scaled_max, SCALE_FROM_AMAX: tl.constexpr, POW2: tl.constexpr):
    """The scale of this cast: `scale_ptr[0]`, or the current-scaling scale of the amax whose float32 bits are at
    `amax_bits_ptr[0]` (the amax kernel's int32 output, read as is: no float view on the host) (`max(amax, eps)`,
    `scaled_max / amax`, 1 when that amax is 0, inf or NaN)."""
    if SCALE_FROM_AMAX:
        a = tl.load(amax_bits_ptr).to(tl.float32, bitcast=True)
        a = tl.where(a < eps, eps, a)  # clamp_min; a NaN stays NaN
        s = _scale_rule(a, scaled_max, 1.0, POW2)
    else:
        s = tl.load(scale_ptr)
    return s


@triton.jit
def _write_scales(pid, s, scale_out_ptr, scale_inv_ptr, WRITE_SCALE: tl.constexpr, WRITE_SCALE_INV: tl.constexpr):
    """Program 0 stores the scale and `float32(1 / scale)` (masked stores: every program runs the same code)."""
    first = pid == 0
    if WRITE_SCALE:
        tl.store(scale_out_ptr, s, mask=first)
    if WRITE_SCALE_INV:
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.where(s == s, 1.0, 1.0), s), mask=first)


@triton.jit
def _quantize_bits(x, s, FP8_MAX: tl.constexpr, E4M3: tl.constexpr):
    """FP8 bytes (uint8) of `saturate(x * s)` for float32 `x`, round-to-nearest-even, NaN as 0x7F."""
    y = x * s
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    y = tl.where(y < -FP8_MAX, -FP8_MAX, y)  # comparisons are False for NaN: NaN stays NaN
    if E4M3:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
    bits = q.to(tl.uint8, bitcast=True)
    return tl.where(y != y, 0x7F, bits).to(tl.uint8)  # a GPU's multiply makes every NaN the positive one


@triton.jit
def cast_flat_kernel(x_ptr, q_ptr, scale_ptr, amax_bits_ptr, scale_out_ptr, scale_inv_ptr,
                     numel, scaled_max, eps,
                     FP8_MAX: tl.constexpr, E4M3: tl.constexpr, AMAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr,
                     POW2: tl.constexpr, WRITE_SCALE: tl.constexpr, WRITE_SCALE_INV: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Cast BLOCK consecutive elements of the flat `x` to FP8 bytes at `q_ptr` (uint8, same layout). The grid is 1-D
    (`cdiv(numel, BLOCK)` programs on the x axis, which takes 2**31 - 1). With AMAX the block's NaN-ignoring max|x|
    is max-accumulated into the float32 whose int32 view is `amax_bits_ptr`; see `_cast_scale` and
    `_write_scales` for the scale."""
    pid = tl.program_id(0)
    s = _cast_scale(scale_ptr, amax_bits_ptr, eps, scaled_max, SCALE_FROM_AMAX, POW2)
    _write_scales(pid, s, scale_out_ptr, scale_inv_ptr, WRITE_SCALE, WRITE_SCALE_INV)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        _accumulate_amax(amax_bits_ptr, _tile_max(_nan_free_abs(x), 0))
    tl.store(q_ptr + offs, _quantize_bits(x, s, FP8_MAX, E4M3), mask=mask)


@triton.jit
def cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_bits_ptr, scale_out_ptr, scale_inv_ptr,
                          dbias_ptr, M, N, tiles_n, scaled_max, eps,
                          FP8_MAX: tl.constexpr, E4M3: tl.constexpr, AMAX: tl.constexpr,
                          SCALE_FROM_AMAX: tl.constexpr, POW2: tl.constexpr, WRITE_SCALE: tl.constexpr,
                          WRITE_SCALE_INV: tl.constexpr, TRANSPOSE: tl.constexpr, DBIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cast one [BLOCK_M, BLOCK_N] tile of the row-major [M, N] `x` to FP8 bytes at `q_ptr` (uint8 [M, N]) and, with
    TRANSPOSE, at `qt_ptr` (uint8 [N, M]), reading the tile once.

    The grid is 1-D: program `pid` takes tile row `pid // tiles_n` and tile column `pid % tiles_n`. With DBIAS the
    tile's column sums of float32(x) go to row `pid // tiles_n` of the float32 `[cdiv(M, BLOCK_M), N]` partials at
    `dbias_ptr` (`column_sum_kernel` adds them up in a fixed order: deterministic, no float atomics). AMAX, the scale
    and the scale writes as in `cast_flat_kernel`.
    """
    pid = tl.program_id(0)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    s = _cast_scale(scale_ptr, amax_bits_ptr, eps, scaled_max, SCALE_FROM_AMAX, POW2)
    _write_scales(pid, s, scale_out_ptr, scale_inv_ptr, WRITE_SCALE, WRITE_SCALE_INV)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        _accumulate_amax(amax_bits_ptr, _tile_max(_tile_max(_nan_free_abs(x), 1), 0))
    if DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * N + rn, _tile_sum(x, 0), mask=rn < N)
    bits = _quantize_bits(x, s, FP8_MAX, E4M3)
    tl.store(q_ptr + offs, bits, mask=mask)
    if TRANSPOSE:
        offs_t = rn.to(tl.int64)[:, None] * M + rm[None, :]
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        tl.store(qt_ptr + offs_t, tl.trans(bits), mask=mask_t)


@triton.jit
def column_sum_kernel(p_ptr, out_ptr, T, N, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """`out[n] = sum_t p[t, n]` for the float32 row-major [T, N] partials, accumulated in float32 in a fixed order
    and stored in out's dtype (round to nearest even)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.where(cmask, 0.0, 0.0)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        m2 = (rows[:, None] < T) & cmask[None, :]
        v = tl.load(p_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m2, other=0.0)
        acc += _tile_sum(v, 0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def amax_kernel(x_ptr, out_bits_ptr, numel, BLOCK: tl.constexpr):
    """Max-accumulate the NaN-ignoring max|x| of one BLOCK of the flat `x` into the float32 whose int32 view is
    `out_bits_ptr` (zeroed by the caller)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    _accumulate_amax(out_bits_ptr, _tile_max(_nan_free_abs(x), 0))


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
def update_states_kernel(histories, scales, widths, flags, L, scaled_max,
                         MOST_RECENT: tl.constexpr, POW2: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """The update of state `program_id(0)` of up to CHUNK states, in place. The states come as kernel arguments
    (no table in device memory, so no host-to-device copy): tuples of CHUNK int64 addresses of each state's
    float32 [L, n] history and [n] scale, CHUNK widths n, and CHUNK recompute flags (0 or 1). The program picks
    its entries with selects on its program id, which is uniform across the CTA."""
    k = tl.program_id(0)
    h_addr = histories[0]
    s_addr = scales[0]
    n = widths[0]
    flag = flags[0]
    for i in tl.static_range(1, CHUNK):
        pick = k == i
        h_addr = tl.where(pick, histories[i], h_addr)
        s_addr = tl.where(pick, scales[i], s_addr)
        n = tl.where(pick, widths[i], n)
        flag = tl.where(pick, flags[i], flag)
    h_ptr = h_addr.to(tl.pointer_type(tl.float32))
    s_ptr = s_addr.to(tl.pointer_type(tl.float32))
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        recompute = (cols * 0 + flag) != 0  # a vector: the interpreter mistypes scalar & vector bools
        _update_columns(h_ptr, s_ptr, cols, cols < n, n, L, recompute, scaled_max, MOST_RECENT, POW2, BLOCK_L)
