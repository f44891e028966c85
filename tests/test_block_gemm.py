"""Block-scaled GEMM emulation: bit for bit against the reference order built on the reference quantization
(tests/reference.py), and within the float32-accumulation error bound of float64 math on the dequantized operands."""

import numpy as np
import pytest
import torch
from block_helpers import to_np32

from fp8kit.pytorch.block_gemm import block_gemm, block_operand, fma32
from fp8kit.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

import reference as ref

U = 2.0 ** -24  # float32 unit roundoff


def test_fma32_rounds_once():
    rng = np.random.default_rng(0)
    n = 1500
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -20)).astype(np.float32)
    c[::3] = rng.standard_normal(n)[::3].astype(np.float32)
    # ties: a*b = 1 + 2^-11 + 2^-24 exactly; a separate multiply and add would lose the 2^-24
    a[:2], b[:2], c[:2] = np.float32(1 + 2.0 ** -12), np.float32(1 + 2.0 ** -12), np.float32([-1.0, 0.0])
    got = fma32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    np.testing.assert_array_equal(got, ref.fma_f32(a, b, c))
    assert got[0] == np.float32(2.0 ** -11 + 2.0 ** -24)


def _operand_ref(x: np.ndarray, family: str, transpose: bool, two_d: bool, fmt: str = "e4m3"):
    """(FP8 values float64 (rows, K), scales float32 (rows, nb), block, one_d) from the reference quantization of the
    float32 array x (M, K): the operand X, or X^T with `transpose` (quantized along the other dim)."""
    if family == "mxfp8":
        block = (32, 32) if two_d else ((32, 1) if transpose else (1, 32))
        q, code = ref.mxfp8_quantize(x, fmt, block)
        s = ref.e8m0_value(code)
        s = np.repeat(s, 32, axis=0) if two_d else s
        s = np.repeat(s, 32, axis=1) if two_d and transpose else s
        if transpose:
            q, s = q.T, (s.T if not two_d else s.T[:, ::32])
        return ref.fp8_values(q, fmt), s, 32, True
    xt = np.ascontiguousarray(x.T) if transpose else x
    tile = (128, 128) if two_d else (1, 128)
    q, s = ref.float8_block_quantize(xt, fmt, tile, power_2=family == "block_pow2")
    if two_d:
        s = np.repeat(s, 128, axis=0)[: xt.shape[0]]
    return ref.fp8_values(q, fmt), s, 128, not two_d


def _quantizer(family: str, two_d: bool, fmt=torch.float8_e4m3fn):
    if family == "mxfp8":
        return MXFP8Quantizer(fmt, with_2d_quantization=two_d)
    return Float8BlockQuantizer(fmt, rowwise=True, columnwise=True, block_scaling_dim=2 if two_d else 1,
                                force_pow_2_scales=family == "block_pow2")


CASES = [  # (family, x is 2-D scaled, w is 2-D scaled)
    ("mxfp8", False, False), ("mxfp8", False, True), ("block_pow2", False, True), ("block_f32", False, True),
    ("block_f32", False, False), ("block_f32", True, True), ("block_f32", True, False),
]


@pytest.mark.parametrize("family,x2d,w2d", CASES)
def test_linear_gemms_bit_exact_with_reference(family, x2d, w2d):
    """fprop (x w^T), dgrad (dy w) and wgrad (dy^T x), each against the reference order on reference operands."""
    g = torch.Generator().manual_seed(1)
    m, k, n = 32, 320 if family == "mxfp8" else 300, 64
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16) * 1e-4
    qx, qw, qdy = _quantizer(family, x2d)(x), _quantizer(family, w2d)(w), _quantizer(family, False)(dy)
    xn, wn, dyn = to_np32(x), to_np32(w), to_np32(dy)
    for a, ta, an, a2, b, tb, bn, b2 in ((qx, False, xn, x2d, qw, False, wn, w2d),
                                        (qdy, False, dyn, False, qw, True, wn, w2d),
                                        (qdy, True, dyn, False, qx, True, xn, x2d)):
        got = block_gemm(a, b, transpose_a=ta, transpose_b=tb)
        qa, sa, block, a1 = _operand_ref(an, family, ta, a2)
        qb, sb, _, b1 = _operand_ref(bn, family, tb, b2)
        np.testing.assert_array_equal(block_operand(a, ta).values.numpy(), qa)
        np.testing.assert_array_equal(block_operand(a, ta).scales.numpy(), sa)
        np.testing.assert_array_equal(got.numpy(), ref.block_gemm(qa, sa, qb, sb, block, a1, b1))


@pytest.mark.parametrize("family,x2d,w2d", CASES)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_within_float32_accumulation_bound(family, x2d, w2d, fmt):
    """|y - y64| <= (nb + 4) u sum_k |a_k b_k|: one rounding for the block's partial sum, one for its scaling, one
    per accumulation step (nb of them), plus slack; y64 is float64 math on the dequantized operands."""
    g = torch.Generator().manual_seed(2)
    m, k, n = 64, 640, 96
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 3)
    w = torch.randn(n, k, generator=g)
    qx, qw = _quantizer(family, x2d, fmt)(x), _quantizer(family, w2d, fmt)(w)
    A, B = block_operand(qx), block_operand(qw)
    deq = [(o.values.double() * o.scales.double().repeat_interleave(o.block, 1)[:, :k]) for o in (A, B)]
    y64 = deq[0] @ deq[1].T
    bound = (k // A.block + 4) * U * (deq[0].abs() @ deq[1].abs().T) + 1e-40
    y = block_gemm(qx, qw).double()
    assert torch.all((y - y64).abs() <= bound)
    assert not torch.equal(y, y64.float().double()) or family == "mxfp8", "the test must see rounding"


def test_bias_accumulate_and_dtypes():
    x, w = torch.randn(32, 256), torch.randn(64, 256)
    q = MXFP8Quantizer(torch.float8_e4m3fn)
    qx, qw = q(x), q(w)
    y = block_gemm(qx, qw)
    bias = torch.randn(64)
    assert torch.equal(block_gemm(qx, qw, bias=bias), y + bias)
    assert torch.equal(block_gemm(qx, qw, bias=bias, out_dtype=torch.bfloat16), (y + bias).to(torch.bfloat16))
    out = torch.randn(32, 64, dtype=torch.bfloat16)
    want = out + y.to(torch.bfloat16)
    got = block_gemm(qx, qw, out=out, accumulate=True, out_dtype=torch.bfloat16)
    assert got is out and torch.equal(out, want)


def test_errors():
    x = torch.randn(128, 256)
    mx = MXFP8Quantizer(torch.float8_e4m3fn)(x)
    fb = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False)(x)
    with pytest.raises(TypeError, match="different block formats"):
        block_gemm(mx, fb)
    fb1 = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False, block_scaling_dim=1)(x)
    with pytest.raises(ValueError, match="no columnwise data"):  # 1x128 blocks: the other layout's differ
        block_gemm(fb1, fb1, transpose_b=True)
    # 128x128 blocks: the columnwise layout is made from the rowwise one (as Transformer Engine does), the bytes of
    # quantizing with both layouts
    both = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True)(x)
    assert torch.equal(block_gemm(fb, fb, transpose_a=True, transpose_b=True),
                       block_gemm(both, both, transpose_a=True, transpose_b=True))
    assert torch.equal(fb._columnwise_data, both._columnwise_data)
    assert torch.equal(fb._columnwise_scale_inv, both._columnwise_scale_inv)
    with pytest.raises(ValueError, match="contraction dims differ"):
        block_gemm(mx, mx, transpose_b=True)
    with pytest.raises(TypeError, match="MXFP8 or Float8 block"):
        block_gemm(x, mx)
    with pytest.raises(ValueError, match="needs out"):
        block_gemm(mx, mx, accumulate=True)


def test_module_gemm_rule_layouts():
    """`block_gemm_rule(a, b)` is `a @ b` with `.transposed()` views, as Linear's fprop, dgrad and wgrad call it."""
    from fp8kit.pytorch.block_recipes import block_gemm_rule

    g = torch.Generator().manual_seed(4)
    x, w, dy = torch.randn(64, 256, generator=g), torch.randn(96, 256, generator=g), torch.randn(64, 96, generator=g)
    for quantizer in (MXFP8Quantizer(torch.float8_e4m3fn),
                      Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)):
        qx, qw, qdy = quantizer(x), quantizer(w), quantizer(dy)
        y = block_gemm_rule(qx, qw.transposed(), torch.float32)
        dx = block_gemm_rule(qdy, qw.saved_form()[0], torch.bfloat16)
        dw = block_gemm_rule(qdy.transposed(), qx, torch.float32)
        assert y.shape == (64, 96) and dx.shape == (64, 256) and dw.shape == (96, 256) and dx.dtype == torch.bfloat16
        assert torch.equal(y, block_gemm(qx, qw))
        assert torch.equal(dx, block_gemm(qdy, qw, transpose_b=True, out_dtype=torch.bfloat16))
        assert torch.equal(dw, block_gemm(qdy, qx, transpose_a=True, transpose_b=True))
        assert torch.equal(qdy.transposed().dequantize(), qdy.dequantize().t())
        assert qw.transposed().transposed() is qw


@pytest.mark.parametrize("case", ["randn", "wide", "tiny", "e5m2"])
def test_fast_paths_equal_fused_multiply_add(case):
    """The CPU's plain float32 adds (power-of-two scales in range: F32) and the float64 math stored to float32
    (power-of-two scales, any range: F64, the accelerator's path) give the emulated FMA's numbers; out of range (tiny
    scales) the CPU GEMM does not take F32."""
    from block_helpers import wide_range

    from fp8kit.pytorch import block_gemm as bg

    g = torch.Generator().manual_seed(6)
    x = {"randn": lambda: torch.randn(64, 256, generator=g), "wide": lambda: wide_range((64, 256), torch.float32, 2),
         "tiny": lambda: torch.randn(64, 256, generator=g) * 1e-36, "e5m2": lambda: torch.randn(64, 256, generator=g)}
    fmt = torch.float8_e5m2 if case == "e5m2" else torch.float8_e4m3fn
    w = torch.randn(32, 256, generator=g)
    for q in (MXFP8Quantizer(fmt), Float8BlockQuantizer(fmt, rowwise=True, columnwise=True, block_scaling_dim=1),
              MXFP8Quantizer(fmt, with_2d_quantization=True)):
        qx, qw, qd = q(x[case]()), q(w), q(torch.randn(64, 128, generator=g))
        for A, B in ((block_operand(qx), block_operand(qw)), (block_operand(qx, True), block_operand(qd, True))):
            assert A.pow2 and B.pow2
            if case != "wide":  # wide: some blocks out of range, F32 is not exact there
                assert bg._fast_is_exact(A, B) == (case != "tiny")
            fused = bg._accumulate(A, B, bg.FMA)
            torch.testing.assert_close(bg._accumulate(A, B, bg.F64), fused, rtol=0, atol=0, equal_nan=True)
            if bg._fast_is_exact(A, B):
                torch.testing.assert_close(bg._accumulate(A, B, bg.F32), fused, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(block_gemm(qx, qw), bg._accumulate(block_operand(qx), block_operand(qw), bg.FMA),
                                   rtol=0, atol=0, equal_nan=True)


def test_mode_per_operand_pair():
    """F64 only where step 2's second scale is a power of two by construction: MXFP8, Float8 block with
    `force_pow_2_scales` (the 1-D operand's scale comes first, so a 2-D operand's decides); else the FMA."""
    from fp8kit.pytorch import block_gemm as bg

    x = torch.randn(64, 256)
    q1 = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    q1f = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1,
                               force_pow_2_scales=False)
    q2f = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2,
                               force_pow_2_scales=False)
    p1, f1, f2 = block_operand(q1(x)), block_operand(q1f(x)), block_operand(q2f(x))
    assert (p1.pow2, f1.pow2, f2.pow2) == (True, False, False)
    assert bg.accumulate_mode(p1, p1, False) == bg.F64
    assert bg.accumulate_mode(p1, f1, False) == bg.FMA  # B's scale is s2
    assert bg.accumulate_mode(f1, p1, False) == bg.F64  # A's scale multiplies first
    assert bg.accumulate_mode(f2, p1, False) == bg.FMA  # 2-D A: B's scale first, A's is s2
    assert bg.accumulate_mode(f1, f1, True) == bg.FMA  # float32 scales: not powers of two


def test_no_host_reads_off_the_cpu():
    """Quantizers, dequantize and the GEMM run on the `meta` device, where any read of a value on the host raises:
    the code CUDA runs has no host synchronisation."""
    x = torch.randn(64, 256, device="meta", dtype=torch.bfloat16)
    for q in (MXFP8Quantizer(torch.float8_e4m3fn, with_2d_quantization=True),
              Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2),
              Float8BlockQuantizer(torch.float8_e5m2, rowwise=True, columnwise=True, block_scaling_dim=1,
                                   force_pow_2_scales=False)):
        t = q(x)
        q.update_quantized(x, t, noop_flag=torch.zeros(1, device="meta"))
        assert t.dequantize().shape == x.shape
        y = block_gemm(t, t, transpose_a=True, transpose_b=True, bias=torch.zeros(256, device="meta"))
        assert y.shape == (256, 256) and y.device.type == "meta"
