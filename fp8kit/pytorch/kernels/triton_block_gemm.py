"""Triton kernel of the block-scaled GEMMs (docs/numerics.md, "Block-scaled GEMMs" and NVFP4's GEMM): the host side
is `fp8kit.pytorch.kernels.block_gemm_ops`. Imports nothing from fp8kit (`kernel_module` loads it compiled and
interpreted, as `triton_fp8`).

One program owns a (BM, BN) tile of `y = A @ B^T` and keeps it in registers across the K blocks, in increasing
order, so the sequential float32 rounding of the rule costs no pass over memory:
- F64 (MXFP8, Float8 block): `P = float32(dot(A_j, B_j))` with float64 operands and accumulator (exact for E4M3
  products, as the rule's float64 sum; the dot's own order otherwise), then the scales meet it as the rule says with
  a hardware fused multiply-add (`tl.fma`, rounds once): MODE 0 `fma(P * sa, sb, y)` (A's scale first), MODE 1
  `fma(P * sb, sa, y)`, MODE 2 `fma(P, sa * sb, y)`.
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
                      F64: tl.constexpr, DOT64: tl.constexpr = False):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # int64 offsets: tensors past 2^31 elements
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, KC)
    in_m = rm < M
    in_n = rn < N
    y = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for j in range(0, NB):
        if F64 and DOT64:  # the block's exact sum on float64 MMAs (sm_90): any order gives the exact sum
            p = tl.full((BM, BN), 0.0, dtype=tl.float64)
            for c in range(0, BLOCK, KC):
                k = (j * BLOCK + c + rk).to(tl.int64)
                in_k = k < K
                a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                            mask=in_m[:, None] & in_k[None, :], other=0.0)
                b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                            mask=in_k[:, None] & in_n[None, :], other=0.0)
                p = tl.dot(a.to(tl.float64), b.to(tl.float64), p, out_dtype=tl.float64)
        elif F64:
            # the block's exact sum: one float64 rank-1 update per K column (see the module docstring's bit budget)
            p = tl.full((BM, BN), 0.0, dtype=tl.float64)
            for c in range(0, BLOCK, KC):
                for i in tl.static_range(KC):  # KC columns unrolled per step (KC divides BLOCK)
                    k = tl.cast(j * BLOCK + c + i, tl.int64)  # int64 offsets (a plain int in the interpreter)
                    # `rm * 0 + k`: the K test as a vector (the interpreter refuses a scalar in a mask)
                    a = tl.load(a_ptr + rm * stride_am + k * stride_ak, mask=in_m & (rm * 0 + k < K), other=0.0)
                    b = tl.load(b_ptr + rn * stride_bn + k * stride_bk, mask=in_n & (rn * 0 + k < K), other=0.0)
                    p += a.to(tl.float64)[:, None] * b.to(tl.float64)[None, :]
        else:
            p = tl.full((BM, BN), 0.0, dtype=tl.float32)
            for c in range(0, BLOCK, KC):  # the block in slices of KC along K
                k = (j * BLOCK + c + rk).to(tl.int64)
                in_k = (k < K) & (c + rk < BLOCK)
                a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                            mask=in_m[:, None] & in_k[None, :], other=0.0)
                b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                            mask=in_k[:, None] & in_n[None, :], other=0.0)
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
