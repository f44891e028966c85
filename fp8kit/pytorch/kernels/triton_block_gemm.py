"""Triton kernel of the block-scaled GEMMs (docs/numerics.md, "Block-scaled GEMMs" and NVFP4's GEMM): the host side
is `fp8kit.pytorch.kernels.block_gemm_ops`. Imports nothing from fp8kit (`kernel_module` loads it compiled and
interpreted, as `triton_fp8`).

One program owns a (BM, BN) tile of `y = A @ B^T` and keeps it in registers across the K blocks, in increasing
order, so the sequential float32 rounding of the rule costs no pass over memory:
- F64 (MXFP8, Float8 block): `P = float32(S)` where S is the block's sum of products of the FP8 values in float64,
  then the scales meet it as the rule says with a hardware fused multiply-add (`tl.fma`, rounds once): MODE 0
  `fma(P * sa, sb, y)` (A's scale first), MODE 1 `fma(P * sb, sa, y)`, MODE 2 `fma(P, sa * sb, y)`. S is formed
  either way the host chooses (DOT64), the same number when S is exact:
  - DOT64 (sm_90): `tl.dot` of float64 operands into a float64 accumulator (`out_dtype=tl.float64`: Triton 3.6
    refuses a float64 accumulator without it), the fp64 MMA (`mma.sync...f64`): about 40 TFLOP/s on an H200;
  - otherwise (sm_100, where Triton 3.6 cannot lower a float64 dot; sm_89): one float64 rank-1 update per K
    column, `p += a[:, None] * b[None, :]` (`fma.rn.f64`), compiled for any target, slow (0.15-1.8 TFLOP/s).
  Bit budget of S: an E4M3 value is an integer below 2^18 times 2^-9 (448 < 2^9, subnormal step 2^-9), an E5M2
  value one below 2^32 times 2^-16 (57344 < 2^16, step 2^-16). A product is an integer times 2^-(sum of steps) of
  at most 36 bits (E4M3 x E4M3), 50 (E5M2 x E4M3) or 64 (E5M2 x E5M2), and a block's partial sums add log2(block)
  bits (5 for MXFP8's 32, 7 for Float8 block's 128): E4M3 x E4M3 needs 36 + 7 = 43 <= 53 bits, so every partial
  sum is exact in float64 and S does not depend on the order (MMA, rank-1, the torch path's BLAS). Blocks with an
  E5M2 operand are exact only when their products span at most 53 - log2(block) bits (wide-range data may not:
  then S depends on the order, on every path).
- not F64 (NVFP4, MODE 3): A and B come pre-scaled (E2M1 times its E4M3 block scale: 6 significant bits at most,
  exact in TF32), so the TF32 dot of a block is `(sa * sb) * P` exactly whatever the order and the accumulator's
  width; `y = fma(Q, 1, y)` adds it with one rounding (an fma, not `y + Q`: Triton may fold an add of a dot into the
  dot's accumulator, whose rounding is the tensor core's).
"""

import triton
import triton.language as tl


@triton.jit
def block_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, y_ptr, M, N, K, NB,
                      stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_saj, stride_sbn, stride_sbj,
                      BLOCK: tl.constexpr, KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
                      F64: tl.constexpr, DOT64: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # int64 offsets: tensors past 2^31 elements
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, KC)
    in_m = rm < M
    in_n = rn < N
    y = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for j in range(0, NB):
        if F64 and not DOT64:  # the block's exact sum as float64 rank-1 updates, one per K column
            p = tl.full((BM, BN), 0.0, dtype=tl.float64)
            for c in range(0, BLOCK, KC):
                for i in tl.static_range(KC):  # KC columns unrolled per step (KC divides BLOCK)
                    k = tl.cast(j * BLOCK + c + i, tl.int64)  # int64 offsets (a plain int in the interpreter)
                    # `rm * 0 + k`: the K test as a vector (the interpreter refuses a scalar in a mask)
                    a = tl.load(a_ptr + rm * stride_am + k * stride_ak, mask=in_m & (rm * 0 + k < K), other=0.0)
                    b = tl.load(b_ptr + rn * stride_bn + k * stride_bk, mask=in_n & (rn * 0 + k < K), other=0.0)
                    p += a.to(tl.float64)[:, None] * b.to(tl.float64)[None, :]
        else:
            p = tl.full((BM, BN), 0.0, dtype=tl.float64 if F64 else tl.float32)
            for c in range(0, BLOCK, KC):  # the block in slices of KC along K
                k = (j * BLOCK + c + rk).to(tl.int64)
                in_k = (k < K) & (c + rk < BLOCK)
                a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                            mask=in_m[:, None] & in_k[None, :], other=0.0)
                b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                            mask=in_k[:, None] & in_n[None, :], other=0.0)
                if F64:  # the float64 MMA; out_dtype named: Triton 3.6 takes float32 otherwise and refuses the acc
                    p = tl.dot(a.to(tl.float64), b.to(tl.float64), p, out_dtype=tl.float64)
                else:
                    p = tl.dot(a, b, p, input_precision="tf32")  # inputs of 6 significant bits: exact in TF32
        if F64:
            p = p.to(tl.float32)
            sa = tl.load(sa_ptr + rm * stride_sam + j * stride_saj, mask=in_m, other=1.0)
            sb = tl.load(sb_ptr + rn * stride_sbn + j * stride_sbj, mask=in_n, other=1.0)
            if MODE == 0:
                y = tl.fma(p * sa[:, None], sb[None, :], y)
            elif MODE == 1:
                y = tl.fma(p * sb[None, :], sa[:, None], y)
            else:
                y = tl.fma(p, sa[:, None] * sb[None, :], y)
        else:
            y = tl.fma(p, 1.0, y)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=in_m[:, None] & in_n[None, :])
