/* fp8kit's CPU kernels: the FP8 cast, its widened GEMM operand, the amax and the widening of FP8 bytes, each in
 * one vectorised pass over memory. Compiled on first use by fp8kit/pytorch/cpu_kernels/__init__.py with the
 * system C compiler (-O3 -march=native -ffp-contract=off, never -ffast-math) and called through ctypes; without a
 * compiler fp8kit uses torch operations for the same results.
 *
 * The cast is `saturate(float32(x) * scale)` rounded to nearest even, a NaN giving 0x7F whatever its sign: the
 * same bytes as fp8kit's torch path and tests/reference.py (tests/test_cpu_kernels.py checks every bf16 and fp16
 * bit pattern at many scales). Per element, without branches:
 *   y = float32(x) * scale (one IEEE float32 multiply; -ffp-contract=off keeps it from fusing with the add below)
 *   a = min(|y|, max); a normal FP8 value rounds its float32 mantissa to 3 (E4M3) or 2 (E5M2) bits, to nearest
 *   even, by integer addition on the bits; a subnormal one (a < the smallest normal) by `(a + M) - M`, with M the
 *   power of two whose float32 ulp is the format's subnormal step (2^14 for E4M3's 2^-9, 2^7 for E5M2's 2^-16):
 *   the float32 addition rounds to nearest even, and the integer difference of `a + M` and M is the subnormal code
 *   (the step count; the count at the smallest normal is that normal's code). The rounded value has at most 3
 *   mantissa bits and an exponent bf16 holds, so its upper 16 bits are the value as bf16 exactly.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The interface version: fp8kit/pytorch/cpu_kernels/__init__.py declares the functions for this one and refuses a
 * library of another (a signature read wrongly would write through garbage pointers). */
int fp8kit_abi(void) { return 4; }

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Whether this thread's floating-point mode flushes subnormals (torch.set_flush_denormal(True): MXCSR's DAZ/FTZ
 * on x86): the cast needs subnormal arithmetic, so it refuses (-1) and the caller uses torch. */
static int denormals_flushed(void) {
    volatile float tiny = 0x1p-140f;
    return tiny * 1.0f == 0.0f;
}

/* The formats' constants: largest finite, smallest normal, M (above), mantissa bits, exponent bias. */
typedef struct { float max, min_normal, magic; uint32_t mbits, bias; } format_t;
static const format_t E4M3 = {448.0f, 0x1p-6f, 0x1p14f, 3, 7};
static const format_t E5M2 = {57344.0f, 0x1p-14f, 0x1p7f, 2, 15};

/* All ones where `c` holds, else 0: selections by masks, which compilers vectorise for any vector width (ternary
 * operators on mixed widths stay branches without AVX-512's mask registers). */
static inline uint32_t mask_of(int c) { return 0u - (uint32_t)c; }
static inline uint32_t select(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

/* One element: the FP8 byte of `v * scale` in *code and its value's bf16 bits in *half. */
static inline __attribute__((always_inline)) void cast_one(float v, float scale, format_t f, uint8_t *code,
                                                           uint16_t *half) {
    float y = v * scale;
    uint32_t yb = bits_of(y), sign = yb & 0x80000000u;
    int32_t mag_in = (int32_t)(yb & 0x7FFFFFFFu); /* |y| as bits: non-negative values order as their bits */
    uint32_t nan = mask_of(mag_in > 0x7F800000);
    int32_t top = (int32_t)bits_of(f.max);
    uint32_t ab = (uint32_t)(mag_in < top ? mag_in : top), drop = 23 - f.mbits; /* saturated (NaN: replaced) */
    uint32_t rn = (ab + ((1u << (drop - 1)) - 1) + ((ab >> drop) & 1)) & ~((1u << drop) - 1);
    float s = float_of(ab) + f.magic;
    uint32_t sub = mask_of((int32_t)ab < (int32_t)bits_of(f.min_normal));
    uint32_t mag = select(sub, bits_of(s) - bits_of(f.magic), (rn >> drop) - ((127u - f.bias) << f.mbits));
    uint32_t r = select(sub, bits_of(s - f.magic), rn);
    *code = (uint8_t)select(nan, 0x7F, mag | (sign >> 24));
    *half = (uint16_t)select(nan, 0x7FC0, (r | sign) >> 16);
}

/* The loops, one per set of outputs (so that each vectorises without per-element tests): `ob` the bytes, `ov`
 * the values as bf16 bits; with `amax` also the largest magnitude of x over its non-NaN elements, as bits (a
 * non-negative IEEE value orders as its bits), and in `*nan` whether x holds a NaN (delayed scaling: the cast and
 * the amax in one pass). `MAG` is x[i]'s magnitude bits as int32, `INF` the infinity's. */
#define CAST_LOOPS(LOAD, FMT, TRACK, MAG, INF)                                                                     \
    if (ob && ov) {                                                                                                \
        for (size_t i = 0; i < n; i++) {                                                                           \
            cast_one(LOAD, scale, FMT, &code, &half);                                                              \
            ob[i] = code;                                                                                          \
            ov[i] = half;                                                                                          \
            TRACK(MAG, INF)                                                                                        \
        }                                                                                                          \
    } else if (ob) {                                                                                               \
        for (size_t i = 0; i < n; i++) {                                                                           \
            cast_one(LOAD, scale, FMT, &code, &half);                                                              \
            ob[i] = code;                                                                                          \
            TRACK(MAG, INF)                                                                                        \
        }                                                                                                          \
    } else {                                                                                                       \
        for (size_t i = 0; i < n; i++) {                                                                           \
            cast_one(LOAD, scale, FMT, &code, &half);                                                              \
            ov[i] = half;                                                                                          \
            TRACK(MAG, INF)                                                                                        \
        }                                                                                                          \
    }

#define NO_TRACK(MAG, INF)
#define TRACK_AMAX(MAG, INF)                                                                                       \
    {                                                                                                              \
        int32_t a = (MAG);                                                                                         \
        hi = hi > a ? hi : a;                                                                                      \
        a = a > (INF) ? 0 : a;                                                                                     \
        top = top > a ? top : a;                                                                                   \
    }

#define DEFINE_CAST(NAME, T, LOAD, FMT, MAG, INF)                                                                  \
    int NAME(const T *restrict x, size_t n, float scale, uint8_t *restrict ob, uint16_t *restrict ov,             \
             uint64_t *restrict amax, int *restrict nan) {                                                         \
        if (denormals_flushed())                                                                                   \
            return -1;                                                                                             \
        uint8_t code;                                                                                              \
        uint16_t half;                                                                                             \
        if (amax) {                                                                                                \
            int32_t top = 0, hi = 0;                                                                               \
            CAST_LOOPS(LOAD, FMT, TRACK_AMAX, MAG, INF)                                                            \
            *amax = (uint64_t)top;                                                                                 \
            *nan = hi > (INF);                                                                                     \
        } else {                                                                                                   \
            CAST_LOOPS(LOAD, FMT, NO_TRACK, MAG, INF)                                                              \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

#define LOAD_BF16 float_of((uint32_t)x[i] << 16)
#define LOAD_F32 x[i]
#define MAG16 ((int32_t)(x[i] & 0x7FFFu))
#define MAG32 ((int32_t)(bits_of(x[i]) & 0x7FFFFFFFu))
DEFINE_CAST(fp8kit_cast_bf16_e4m3, uint16_t, LOAD_BF16, E4M3, MAG16, 0x7F80)
DEFINE_CAST(fp8kit_cast_bf16_e5m2, uint16_t, LOAD_BF16, E5M2, MAG16, 0x7F80)
DEFINE_CAST(fp8kit_cast_f32_e4m3, float, LOAD_F32, E4M3, MAG32, 0x7F800000)
DEFINE_CAST(fp8kit_cast_f32_e5m2, float, LOAD_F32, E5M2, MAG32, 0x7F800000)

/* fp16 to float32 by bits (vectorises where a conversion instruction may be missing): the magnitude's bits moved
 * into float32's fields and multiplied by 2^(127 - 15), exactly (subnormals become normal); inf and NaN keep
 * float32's all-ones exponent. */
static inline __attribute__((always_inline)) float f16_value(uint16_t h) {
    uint32_t m = (uint32_t)(h & 0x7FFFu) << 13;
    uint32_t v = select(mask_of(m >= (0x7C00u << 13)), m | 0x7F800000u, bits_of(float_of(m) * 0x1p112f));
    return float_of(v | ((uint32_t)(h & 0x8000u) << 16));
}
#define LOAD_F16 f16_value(x[i])
DEFINE_CAST(fp8kit_cast_f16_e4m3, uint16_t, LOAD_F16, E4M3, MAG16, 0x7C00)
DEFINE_CAST(fp8kit_cast_f16_e5m2, uint16_t, LOAD_F16, E5M2, MAG16, 0x7C00)

#define MAX_OF(a, b) ((a) > (b) ? (a) : (b))

/* max |x| over the non-NaN elements, on the bits: a non-negative IEEE value orders as its bits. Returns the bits
 * of that magnitude; `*nan` says whether a NaN was seen. `ABS` the magnitude mask, `INF` the infinity's bits. */
#define DEFINE_ABSMAX(NAME, T, IT, ABS, INF)                                                                       \
    uint64_t NAME(const T *restrict x, size_t n, int *nan) {                                                       \
        IT m = 0, hi = 0;                                                                                          \
        for (size_t i = 0; i < n; i++) {                                                                           \
            IT a = (IT)(x[i] & (ABS));                                                                             \
            hi = MAX_OF(hi, a);                                                                                    \
            IT b = a > (INF) ? 0 : a;                                                                              \
            m = MAX_OF(m, b);                                                                                      \
        }                                                                                                          \
        *nan = hi > (INF);                                                                                         \
        return (uint64_t)m;                                                                                        \
    }

DEFINE_ABSMAX(fp8kit_absmax_bf16, uint16_t, int32_t, 0x7FFF, 0x7F80)
DEFINE_ABSMAX(fp8kit_absmax_f16, uint16_t, int32_t, 0x7FFF, 0x7C00)
DEFINE_ABSMAX(fp8kit_absmax_f32, uint32_t, int64_t, 0x7FFFFFFFu, 0x7F800000)

/* FP8 bytes widened to bf16 bits (`ov16`) or float32 bits (`ov32`), by integer arithmetic on the fields (the
 * exponent rebiased), a subnormal code's value as `float(mantissa) * step` (exact; no subnormal float32 operand,
 * which costs a microcode assist per element on many x86 cores). NaN and inf codes have no such form: returns the
 * largest magnitude code seen, and the caller widens otherwise when it is one of them. */
#define DEFINE_WIDEN(NAME, MBITS, BIAS, STEP)                                                                      \
    int32_t NAME(const int8_t *restrict b, size_t n, uint16_t *restrict ov16, uint32_t *restrict ov32) {           \
        int32_t top = 0;                                                                                           \
        for (size_t i = 0; i < n; i++) {                                                                           \
            int32_t c = b[i];                                                                                      \
            top = MAX_OF(top, c & 0x7F);                                                                           \
            uint32_t u = (uint32_t)c, e = (u & 0x7Fu) >> MBITS, m = u & ((1u << MBITS) - 1);                       \
            uint32_t normal = ((e + (127u - BIAS)) << 23) | (m << (23 - MBITS));                                   \
            uint32_t v = select(mask_of(e == 0), bits_of((float)(int32_t)m * (STEP)), normal) | (u & 0x80000000u); \
            if (ov16)                                                                                              \
                ov16[i] = (uint16_t)(v >> 16);                                                                     \
            else                                                                                                   \
                ov32[i] = v;                                                                                       \
        }                                                                                                          \
        return top;                                                                                                \
    }

DEFINE_WIDEN(fp8kit_widen_e4m3, 3, 7, 0x1p-9f)
DEFINE_WIDEN(fp8kit_widen_e5m2, 2, 15, 0x1p-16f)

/* Statistics (fp8kit.pytorch.stats): how many of n codes equal each of c[0..3] (FP8 bytes, or their bf16 values'
 * bits), added to out[0..3]; and how many elements of x are non-zero (NaN counts, -0 does not). Counted in 32-bit
 * lanes over blocks that cannot overflow them. */
#define COUNT_BLOCK ((size_t)1 << 30)
#define DEFINE_COUNT4(NAME, T)                                                                                     \
    void NAME(const T *restrict x, size_t n, const T *restrict c, uint64_t *restrict out) {                        \
        const T c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];                                                        \
        for (size_t start = 0; start < n; start += COUNT_BLOCK) {                                                  \
            size_t end = n - start < COUNT_BLOCK ? n : start + COUNT_BLOCK;                                        \
            uint32_t k0 = 0, k1 = 0, k2 = 0, k3 = 0;                                                               \
            for (size_t i = start; i < end; i++) {                                                                 \
                T v = x[i];                                                                                        \
                k0 += v == c0;                                                                                     \
                k1 += v == c1;                                                                                     \
                k2 += v == c2;                                                                                     \
                k3 += v == c3;                                                                                     \
            }                                                                                                      \
            out[0] += k0;                                                                                          \
            out[1] += k1;                                                                                          \
            out[2] += k2;                                                                                          \
            out[3] += k3;                                                                                          \
        }                                                                                                          \
    }

DEFINE_COUNT4(fp8kit_count4_u8, uint8_t)
DEFINE_COUNT4(fp8kit_count4_u16, uint16_t)

#define DEFINE_NONZERO(NAME, T, ABS)                                                                               \
    uint64_t NAME(const T *restrict x, size_t n) {                                                                 \
        uint64_t total = 0;                                                                                        \
        for (size_t start = 0; start < n; start += COUNT_BLOCK) {                                                  \
            size_t end = n - start < COUNT_BLOCK ? n : start + COUNT_BLOCK;                                        \
            uint32_t k = 0;                                                                                        \
            for (size_t i = start; i < end; i++)                                                                   \
                k += (x[i] & (ABS)) != 0;                                                                          \
            total += k;                                                                                            \
        }                                                                                                          \
        return total;                                                                                              \
    }

DEFINE_NONZERO(fp8kit_nonzero_16, uint16_t, 0x7FFFu)
DEFINE_NONZERO(fp8kit_nonzero_32, uint32_t, 0x7FFFFFFFu)

/* Delayed scaling's update of a flat block's used columns on the host path, in place, in one pass over the history
 * (the NumPy sequence it replaces makes five): `h` is the history [rows, cols] with row stride `ld` (row 0 the
 * staging row of this step), `scale` [cols]. A column is used when its staging value is not 0 (NaN counts, -0 does
 * not). Its amax is the staging value ("most_recent") or the NaN-ignoring maximum of the whole column (an all-NaN
 * column gives -inf here and NaN in NumPy: neither is > 0, so the scale stays either way). Where the column is used,
 * the amax is finite and > 0 and `recompute` (or NULL) allows it, the scale becomes float32(clamp(scaled_max / amax,
 * scale_min, scale_max)) computed in double (power_2: its mantissa cleared); used columns roll: row 0 becomes 0, rows
 * 1 .. rows-2 take rows 2 .., the last row takes the staging value. Unused columns are left as they are.
 * Returns 0, or -1 (nothing written) where subnormals are flushed or memory is short: the caller uses NumPy then. */
int fp8kit_delayed_update(float *restrict h, size_t rows, size_t cols, size_t ld, float *restrict scale,
                          const uint8_t *restrict recompute, int most_recent, double scaled_max, double scale_min,
                          double scale_max, int power_2) {
    if (denormals_flushed())
        return -1;
    if (rows == 0 || cols == 0)
        return 0;
    float *staging = malloc(2 * cols * sizeof(float));
    uint32_t *used = malloc(cols * sizeof(uint32_t));
    if (!staging || !used) {
        free(staging);
        free(used);
        return -1;
    }
    float *amax = staging + cols;
    for (size_t c = 0; c < cols; c++) {
        float v = h[c];
        staging[c] = v;
        used[c] = mask_of(v != 0.0f);
        amax[c] = most_recent ? v : -__builtin_inff();
    }
    for (size_t r = 0; r < rows; r++) {
        const float *row = h + r * ld;
        if (!most_recent)
            for (size_t c = 0; c < cols; c++)
                amax[c] = row[c] > amax[c] ? row[c] : amax[c];  /* NaN compares false: skipped */
        if (r >= 2) {
            uint32_t *dst = (uint32_t *)(h + (r - 1) * ld);
            const uint32_t *src = (const uint32_t *)row;
            for (size_t c = 0; c < cols; c++)
                dst[c] = select(used[c], src[c], dst[c]);
        }
    }
    if (rows >= 2) {
        uint32_t *last = (uint32_t *)(h + (rows - 1) * ld);
        for (size_t c = 0; c < cols; c++)
            last[c] = select(used[c], bits_of(staging[c]), last[c]);
    }
    uint32_t *first = (uint32_t *)h;
    for (size_t c = 0; c < cols; c++)
        first[c] = select(used[c], 0u, first[c]);
    for (size_t c = 0; c < cols; c++) {
        float a = amax[c];
        if (used[c] && a > 0.0f && a < __builtin_inff() && (!recompute || recompute[c])) {
            double q = scaled_max / (double)a;
            q = q < scale_min ? scale_min : (q > scale_max ? scale_max : q);
            float f = (float)q;
            scale[c] = power_2 ? float_of(bits_of(f) & 0x7F800000u) : f;
        }
    }
    free(staging);
    free(used);
    return 0;
}
