"""Independent reference for fp8kit's numerics, written with NumPy and ml_dtypes only.

Nothing here imports torch or jax: the frontends are checked against these functions, bit for bit.
Conventions (SPEC sections 1, 3 and 5): q = saturate(float32(x) * scale) rounded to nearest even in FP8;
scale_inv = float32(1 / scale); amax ignores NaN.
"""

from __future__ import annotations

from typing import Callable, Optional

import ml_dtypes
import numpy as np

FP8 = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}
FLT_MAX = np.float32(np.finfo(np.float32).max)
# smallest scale ever used: 2**-63, so that the product of two reciprocals (a GEMM's alpha) stays finite
SCALE_MIN = np.float32(2.0 ** -63)


def amax(x: np.ndarray) -> np.float32:
    """max |x| over non-NaN elements, as float32; 0 for an empty or all-NaN array."""
    a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
    a = a[~np.isnan(a)]
    return np.float32(a.max()) if a.size else np.float32(0.0)


def cast(x: np.ndarray, fmt: str, scale: float) -> tuple[np.ndarray, np.float32]:
    """Quantize: returns (FP8 bytes as uint8 with x's shape, scale_inv)."""
    dtype, fp8_max = FP8[fmt]
    s = np.float32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.asarray(x, dtype=np.float32) * s
    nan = np.isnan(y)
    y = np.where(nan, 0, np.clip(y, -fp8_max, fp8_max)).astype(np.float32)
    q = y.astype(dtype).view(np.uint8)  # ml_dtypes rounds to nearest even
    # a NaN: 0x7F whatever its sign (a GPU multiply returns the positive canonical NaN, as measured on an H100)
    return np.where(nan, np.uint8(0x7F), q).astype(np.uint8), np.float32(np.float32(1.0) / s)


def dequantize(q_bytes: np.ndarray, fmt: str, scale_inv: float) -> np.ndarray:
    dtype, _ = FP8[fmt]
    return q_bytes.view(dtype).astype(np.float32) * np.float32(scale_inv)


def round_down_pow2(scale: np.float32) -> np.float32:
    """Clear the 23 mantissa bits."""
    bits = np.array(scale, dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)
    return np.float32(bits.view(np.float32)[()])


def clamp_scale(s: np.float32) -> np.float32:
    """Computed scales live in [SCALE_MIN, FLT_MAX]: an infinite one becomes FLT_MAX, a tiny one SCALE_MIN."""
    return np.float32(min(max(np.float32(s), SCALE_MIN), FLT_MAX))


def scaled_max(fp8_max: float, margin: float) -> np.float32:
    """`fp8_max * 2**-margin` as Transformer Engine computes it in float32 (`fp8_max * powf(2, -margin)`)."""
    return np.float32(np.float32(fp8_max) * np.float32(2.0 ** -float(np.float32(margin))))


def current_scale(amax_value: float, fp8_max: float, epsilon: float = 0.0, power_2: bool = False) -> np.float32:
    """SPEC section 3: the scale current scaling uses for a tensor with this amax."""
    a = max(np.float32(amax_value), np.float32(epsilon))
    if a == 0 or not np.isfinite(a):
        return np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore", under="ignore"):
        s = clamp_scale(np.float32(fp8_max) / np.float32(a))
    return round_down_pow2(s) if power_2 else np.float32(s)


def current_cast(x: np.ndarray, fmt: str, epsilon: float = 0.0, power_2: bool = False):
    scale = current_scale(amax(x), FP8[fmt][1], epsilon, power_2)
    return cast(x, fmt, scale)


class DelayedState:
    """SPEC sections 4 and 5 for one `[L, n]` history, one column at a time, in float32 scalars."""

    def __init__(self, length: int, n: int, fp8_max: float, margin: float = 0, algo="max", scale_algo=None,
                 interval: int = 1, power_2: bool = False, recipe=None):
        self.history = np.zeros((length, n), dtype=np.float32)
        self.scale = np.ones(n, dtype=np.float32)
        self.fp8_max, self.margin, self.algo, self.scale_algo = fp8_max, margin, algo, scale_algo
        self.interval, self.power_2, self.updates = interval, power_2, 0
        self.recipe = recipe  # passed on to a callable scale_algo, as the library passes its recipe

    def record(self, slot: int, value: float) -> None:
        """A cast of a tensor with this amax: max-accumulate into the staging row."""
        self.history[0, slot] = max(self.history[0, slot], np.float32(value))

    def _rolled(self, col: np.ndarray) -> np.ndarray:
        if len(col) == 1:
            return np.zeros(1, dtype=np.float32)
        return np.concatenate([[0.0], col[2:], [col[0]]]).astype(np.float32)

    def _new_scale(self, a: np.float32, old: np.float32) -> np.float32:
        if not (np.isfinite(a) and a > 0):
            return old
        with np.errstate(over="ignore", divide="ignore", under="ignore"):
            s = clamp_scale(scaled_max(self.fp8_max, self.margin) / np.float32(a))
        return round_down_pow2(s) if self.power_2 else s

    def update(self, reduce: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
        """One update; `reduce` maps the staging row to the reduced one (max over ranks).

        `interval` counts the updates this state takes part in: those where a slot was used (staging != 0; NaN
        counts as used), or every update with callables (the history always rolls then)."""
        if reduce is not None:
            self.history[0] = reduce(self.history[0].copy())
        callables = callable(self.algo) or self.scale_algo is not None
        if not callables and not np.any(self.history[0] != 0):
            return
        recompute = self.updates % self.interval == 0
        self.updates += 1
        if callables:
            self._update_callable(recompute)
            return
        for j in range(self.history.shape[1]):
            col = self.history[:, j]
            last = col[0]
            if last == 0:
                continue
            if self.algo == "most_recent":
                a = last
            else:
                vals = np.append(col[1:], last)
                vals = vals[~np.isnan(vals)]
                a = np.float32(vals.max()) if vals.size else np.float32(np.nan)
            if recompute:
                self.scale[j] = self._new_scale(a, self.scale[j])
            self.history[:, j] = self._rolled(col)

    def _update_callable(self, recompute: bool) -> None:
        h = self.history
        if callable(self.algo):
            a = np.asarray(self.algo(h.copy()), dtype=np.float32)
        elif self.algo == "most_recent":
            a = h[0].copy()
        else:
            a = np.fmax.reduce(h, axis=0).astype(np.float32)
        for j in range(h.shape[1]):
            h[:, j] = self._rolled(h[:, j])
        if not recompute:
            return
        if self.scale_algo is not None:
            self.scale = np.asarray(self.scale_algo(a, self.scale.copy(), self.fp8_max, self.recipe), dtype=np.float32)
        else:
            self.scale = np.array([self._new_scale(a[j], self.scale[j]) for j in range(len(a))], dtype=np.float32)


# ---- block-scaled formats (SPEC section 12; docs/numerics.md) ---------------------------------------------------
# Written from the rules, not from fp8kit: the E8M0 exponent as the ceiling of log2 (np.frexp), the power-of-two
# block scale as 2^floor(log2) (np.frexp), values decoded with ml_dtypes.float8_e8m0fnu.

E8M0 = ml_dtypes.float8_e8m0fnu


def fp8_bytes(y: np.ndarray, fmt: str) -> np.ndarray:
    """FP8 bytes of the float32 array `y`: saturate to +-max (inf included), round to nearest even; a NaN becomes
    0x7F whatever its sign (a GPU's product is the positive canonical NaN; ml_dtypes would write 0x7E for E5M2 and
    keep the sign)."""
    dtype, fp8_max = FP8[fmt]
    y = np.asarray(y, dtype=np.float32)
    nan = np.isnan(y)
    q = np.clip(np.where(nan, 0, y), -fp8_max, fp8_max).astype(np.float32).astype(dtype).view(np.uint8)
    return np.where(nan, np.uint8(0x7F), q).astype(np.uint8)


def block_amax(tiles: np.ndarray, axes) -> np.ndarray:
    """max |x| per block over `axes`, NaN ignored (an all-NaN block has amax 0)."""
    a = np.abs(np.asarray(tiles, dtype=np.float32))
    return np.where(np.isnan(a), 0, a).max(axis=axes).astype(np.float32)


def e8m0_scale(amax: np.ndarray, fmt: str) -> np.ndarray:
    """MXFP8 scale bytes: v = float32(amax * float32(1 / fp8_max)); the smallest e in [0, 254] with
    2^(e - 127) >= v (v = 0 -> 0, inf -> 254 saturated, NaN -> 255)."""
    fp8_max = FP8[fmt][1]
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.asarray(amax, dtype=np.float32) * np.float32(1.0 / fp8_max)
    mant, ex = np.frexp(np.where(np.isfinite(v) & (v > 0), v, 1.0).astype(np.float64))
    ceil_log2 = np.where(mant == 0.5, ex - 1, ex)
    code = np.clip(ceil_log2 + 127, 0, 254)
    code = np.where(v == 0, 0, code)
    code = np.where(np.isinf(v), 254, code)
    code = np.where(np.isnan(v), 255, code)
    return code.astype(np.uint8)


def e8m0_value(code: np.ndarray) -> np.ndarray:
    """The value of E8M0 bytes (2^(code - 127); 255 is NaN), through ml_dtypes."""
    return np.asarray(code, dtype=np.uint8).view(E8M0).astype(np.float32)


def mxfp8_quantize(x: np.ndarray, fmt: str, block: tuple) -> tuple:
    """MXFP8 of the 2-D float32 array `x` with `block` = (1, 32), (32, 1) or (32, 32): (FP8 bytes, E8M0 bytes per
    block). Each element is multiplied in float32 by 2^(127 - code), then cast."""
    m, k = x.shape
    br, bk = block
    tiles = np.asarray(x, dtype=np.float32).reshape(m // br, br, k // bk, bk)
    code = e8m0_scale(block_amax(tiles, (1, 3)), fmt)
    factor = (2.0 ** (127.0 - code.astype(np.float64))).astype(np.float32)  # exact: 2^-127 .. 2^127
    with np.errstate(over="ignore", invalid="ignore"):
        y = tiles * factor[:, None, :, None]
    return fp8_bytes(y, fmt).reshape(m, k), code


def block_scale(amax: np.ndarray, fmt: str, power_2: bool, epsilon: float, value_for_inf: float) -> tuple:
    """Float8 block scaling: (scale, scale_inv) per block. amax floored at float32(epsilon); scale = float32(fp8_max
    / amax), an infinite quotient becomes `value_for_inf`; power_2 rounds it down to 2^floor(log2); amax 0, inf or
    NaN -> 1; scale_inv = float32(1 / scale)."""
    fp8_max = FP8[fmt][1]
    a = np.maximum(np.asarray(amax, dtype=np.float32), np.float32(epsilon))
    bad = (a == 0) | ~np.isfinite(a)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = np.float32(fp8_max) / np.where(bad, np.float32(1), a)
    s = np.where(np.isinf(s), np.float32(value_for_inf), s).astype(np.float32)
    if power_2:
        mant, ex = np.frexp(s.astype(np.float64))
        s = np.ldexp(1.0, ex - 1).astype(np.float32)
    s = np.where(bad, np.float32(1), s).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        return s, (np.float32(1) / s).astype(np.float32)


def float8_block_quantize(x: np.ndarray, fmt: str, tile: tuple, power_2: bool = True, epsilon: float = 0.0,
                          value_for_inf: float = float(np.finfo(np.float32).max)) -> tuple:
    """Float8 block scaling of the 2-D float32 array `x` with `tile` (1, 128) or (128, 128), edge blocks shorter:
    (FP8 bytes (M, K), scale_inv per block (ceil(M / tile[0]), ceil(K / 128)))."""
    m, k = x.shape
    tm, tk = tile
    mb, kb = -(-m // tm), -(-k // tk)
    padded = np.zeros((mb * tm, kb * tk), dtype=np.float32)
    padded[:m, :k] = x
    tiles = padded.reshape(mb, tm, kb, tk)
    scale, scale_inv = block_scale(block_amax(tiles, (1, 3)), fmt, power_2, epsilon, value_for_inf)
    with np.errstate(over="ignore", invalid="ignore"):
        y = tiles * scale[:, None, :, None]
    return fp8_bytes(y, fmt).reshape(mb * tm, kb * tk)[:m, :k], scale_inv


def fp8_values(q_bytes: np.ndarray, fmt: str) -> np.ndarray:
    """The float64 values of FP8 bytes."""
    return np.asarray(q_bytes, dtype=np.uint8).view(FP8[fmt][0]).astype(np.float64)


def round_f32(v) -> np.float32:
    """The exact rational `v` (a fractions.Fraction) rounded to float32, to nearest, ties to even."""
    from fractions import Fraction

    f = np.float32(float(v))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]

    def key(c):
        return abs(Fraction(float(c)) - v), int(np.array(c, dtype=np.float32).view(np.uint32)) & 1

    return np.float32(min(cands, key=key))


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, elementwise, rounded once: where the float64 sum of the (exact) float64 product
    and c is exact (its TwoSum error is 0) that sum is rounded to float32; elsewhere the exact value is built with
    fractions and rounded."""
    from fractions import Fraction

    a, b, c = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(c, np.float32))
    p = a.astype(np.float64) * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    out = s.astype(np.float32)
    for i in zip(*np.nonzero(err != 0)):
        out[i] = round_f32(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
    return out


def block_gemm(qa: np.ndarray, sa: np.ndarray, qb: np.ndarray, sb: np.ndarray, block: int, a_1d: bool = True,
               b_1d: bool = True) -> np.ndarray:
    """A @ B^T in the order docs/numerics.md writes down: FP8 values qa (M, K) and qb (N, K) as float64, float32
    scales per (row, K block) sa (M, nb) and sb (N, nb); per K block j: P = float32(exact float64 sum),
    then y = fma(P * s1, s2, y) (s1 the 1-D operand's scale, A's first) or y = fma(P, sa * sb, y) for 2-D x 2-D."""
    m, k = qa.shape
    y = np.zeros((m, qb.shape[0]), dtype=np.float32)
    for j in range(-(-k // block)):
        blk = slice(j * block, (j + 1) * block)
        p = (qa[:, blk] @ qb[:, blk].T).astype(np.float32)
        a_s, b_s = sa[:, j, None].astype(np.float32), sb[None, :, j].astype(np.float32)
        if not a_1d and not b_1d:
            y = fma_f32(p, a_s * b_s, y)
        elif not a_1d:
            y = fma_f32(p * b_s, a_s, y)
        else:
            y = fma_f32(p * a_s, b_s, y)
    return y


# ---- NVFP4 (docs/numerics.md, "NVFP4"): E2M1 values through ml_dtypes.float4_e2m1fn, E4M3 block scales through
# ml_dtypes.float8_e4m3fn, float32 arithmetic in NumPy. Packed: element 2i in the low nibble of byte i.

F32_MAX = np.float32(np.finfo(np.float32).max)
NVFP4_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def nvfp4_global_scale(amax_value) -> np.float32:
    """float32(2688 / amax); float32 max for an overflow; 1 for amax 0 or a zero quotient."""
    a = np.float32(amax_value)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = np.float32(2688.0) / a
    if np.isnan(s) or s > F32_MAX:
        s = F32_MAX
    return np.float32(1.0) if (a == 0 or s == 0) else np.float32(s)


def nvfp4_quantize(x: np.ndarray, two_d: bool = False, rand: Optional[np.ndarray] = None,
                   row_scaled: bool = False) -> tuple:
    """(packed bytes (M, K/2), E4M3 scale bytes (M, K/16), amax float32) of the 2-D `x` (its values as float32).
    `rand` (uniform [0, 1) of x's shape): stochastic rounding, up when rand < (|v| - lo) / (hi - lo).
    `row_scaled`: the global scale of each row from that row's amax (amax then float32 (M,))."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if row_scaled:
        a = np.array([amax(r) for r in x], dtype=np.float32).reshape(m)
        s_enc = np.array([nvfp4_global_scale(v) for v in a], dtype=np.float32).reshape(m, 1)
    else:
        a = np.float32(amax(x)) if x.size else np.float32(0)
        s_enc = nvfp4_global_scale(a)
    s_dec = (np.float32(1.0) / s_enc).astype(np.float32)
    ax = np.where(np.isnan(x), np.float32(0), np.abs(x))
    if two_d:
        bmax = ax.reshape(m // 16, 16, k // 16, 16).max(axis=(1, 3)).repeat(16, axis=0)
    else:
        bmax = ax.reshape(m, k // 16, 16).max(axis=2)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        dec = np.minimum(bmax * (s_enc * np.float32(1.0 / 6.0)), np.float32(448.0))
        dec8 = dec.astype(ml_dtypes.float8_e4m3fn)
        f = np.float32(1.0) / (dec8.astype(np.float32) * s_dec)
    f = np.where(f > F32_MAX, F32_MAX, f).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf * f and 0 * max
        v = np.clip(x.reshape(m, k // 16, 16) * f[:, :, None], np.float32(-6), np.float32(6)).reshape(m, k)
    if rand is None:
        codes = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    else:
        grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
        mag = np.abs(v)
        lo = np.searchsorted(grid, mag, side="right") - 1
        hi = np.minimum(lo + 1, 7)
        step = np.where(hi > lo, grid[hi] - grid[np.clip(lo, 0, 7)], np.float32(1))
        up = (hi > lo) & (rand < (mag - grid[np.clip(lo, 0, 7)]) / step)
        codes = (np.clip(lo, 0, 7) + up).astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    codes = np.where(np.isnan(v), np.uint8(0), codes).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, dec8.view(np.uint8), a


def nvfp4_values(packed: np.ndarray) -> np.ndarray:
    """float64 E2M1 values of packed bytes (M, K/2) -> (M, K)."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def rht_matrix64() -> np.ndarray:
    """diag(signs) @ H16 / 4 in float64, H16 by Sylvester's construction (np.kron)."""
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return np.array(NVFP4_SIGNS, dtype=np.float64)[:, None] * h / 4.0


def rht_bf16(xt: np.ndarray) -> np.ndarray:
    """The transform of each 16 values along the last dim, float64 sums rounded to float32, then to bfloat16."""
    y = np.asarray(xt, np.float64).reshape(-1, 16) @ rht_matrix64()
    return y.astype(np.float32).astype(ml_dtypes.bfloat16).reshape(np.shape(xt))


def nvfp4_gemm(qa: np.ndarray, sa: np.ndarray, amax_a, qb: np.ndarray, sb: np.ndarray, amax_b) -> np.ndarray:
    """A @ B^T from packed NVFP4 operands (rows, K/2) with E4M3 scale bytes (rows, K/16): per 16-wide K block in
    order, y += (sa * sb) * P (float32; P the exact block dot product), then alpha * y with alpha =
    float32(amax_a * amax_b) / (36 * 448 * 448)."""
    va, vb = nvfp4_values(qa), nvfp4_values(qb)
    fa = np.asarray(sa, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    fb = np.asarray(sb, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    y = np.zeros((va.shape[0], vb.shape[0]), dtype=np.float32)
    for j in range(va.shape[1] // 16):
        blk = slice(16 * j, 16 * (j + 1))
        p = (va[:, blk] @ vb[:, blk].T).astype(np.float32)
        y = y + np.outer(fa[:, j], fb[:, j]).astype(np.float32) * p
    divisor = np.float32(6.0 * 6.0 * 448.0 * 448.0)
    amax_a, amax_b = np.asarray(amax_a, np.float32).reshape(-1), np.asarray(amax_b, np.float32).reshape(-1)
    if amax_a.size == 1 and amax_b.size == 1:
        alpha = np.float32(amax_a[0] * amax_b[0]) / divisor
        return (alpha * y).astype(np.float32)
    # row-scaled: unit global scales in the GEMM, then the output rows (A's amaxes) and columns (B's) in float32
    y = (y * (np.float32(1.0) / divisor)).astype(np.float32)
    if amax_a.size == 1 or amax_b.size == 1:
        return (y * (amax_a.reshape(-1, 1) * amax_b.reshape(1, -1))).astype(np.float32)
    return ((y * amax_a.reshape(-1, 1)).astype(np.float32) * amax_b.reshape(1, -1)).astype(np.float32)


def bf16_of(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (ml_dtypes, nearest even)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
