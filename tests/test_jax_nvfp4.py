"""NVFP4BlockScaling in fp8kit.jax: the cast against the NumPy + ml_dtypes reference (tests/reference.py) and against
fp8kit.pytorch's NVFP4 quantizers, the random Hadamard transform against float64, stochastic rounding (unbiased,
deterministic for a key), the GEMM against PyTorch's and the reference, and the dense layer's forward and
backward against float64 GEMMs of reference-quantized operands. Shapes stay small: few compiles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import fp8kit.jax as te
from fp8kit.jax import hadamard as jh
from fp8kit.jax import nvfp4_cast as jc
from fp8kit.jax.nvfp4_dense import _spec
from fp8kit.jax.nvfp4_gemm import NVFP4Operand, nvfp4_gemm, nvfp4_operand
from fp8kit.jax.scaling_modes import ScalingMode, scaling_mode_of
from fp8kit.recipe import NVFP4BlockScaling, QParams
from tests import reference as ref

BF16 = ml_dtypes.bfloat16
_cast_jit = jax.jit(jc.nvfp4_cast, static_argnums=1)


def _finite_bf16_patterns(rng, exclude_above: float = np.inf) -> np.ndarray:
    """Every finite bf16 bit pattern below `exclude_above` in magnitude, shuffled, repeated to 512 x 128."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(BF16).astype(np.float32)
    keep = np.isfinite(values) & (np.abs(values) < exclude_above)
    picked = rng.permutation(bits[keep])
    return np.resize(picked, 512 * 128).view(BF16).reshape(512, 128)


def _cases():
    rng = np.random.default_rng(0)
    finite = _finite_bf16_patterns(rng)
    special = finite.copy()
    special[3, :40] = np.nan  # NaN elements are ignored by the amaxes and give code 0
    special[7, 5] = -np.inf  # an infinite amax: global scale 1
    mixed = (rng.standard_normal((512, 128)) * np.exp2(rng.integers(-40, 40, (512, 1)))
             * np.exp2(rng.integers(-6, 6, (1, 128)))).astype(BF16)
    mixed[16:32] = 0  # zero blocks
    mixed[40, :16] = -0.0
    # a tensor amax below 2^-114: the global decode scale and some `s * D` are float32 subnormals
    tiny = _finite_bf16_patterns(rng, exclude_above=2.0 ** -116)
    tinier = _finite_bf16_patterns(rng, exclude_above=2.0 ** -126)  # subnormals only
    huge = mixed.astype(np.float32) * np.float32(2.0 ** 60)
    huge[0, 0] = 3.3e38
    return {"finite": finite, "special": special, "mixed": mixed, "tiny": tiny, "subnormal": tinier,
            "huge": huge.astype(BF16)}


CASES = _cases()


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_cast_equals_reference(case, two_d):
    x = CASES[case]
    data, scales, amax = _cast_jit(jnp.asarray(x), two_d)
    want_data, want_scales, want_amax = ref.nvfp4_quantize(x.astype(np.float32), two_d)
    assert np.float32(amax).view(np.uint32) == np.float32(want_amax).view(np.uint32)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(data), want_data)
    if case == "mixed":
        assert len(np.unique(want_scales)) > 50 and len(np.unique(want_data)) > 100  # the case exercises much


def test_encode_factor_with_subnormal_decode_scales_is_ieee():
    """f = min(1 / float32(s * D), float32 max) for every E4M3 scale s and decode scales D from subnormal to
    large (XLA:CPU flushes subnormals: the JAX code rounds s * D with integers), against NumPy's IEEE float32."""
    s = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = s[np.isfinite(s) & ~np.signbit(s)]  # the block scales are non-negative
    d = np.concatenate([np.array([1, 2, 3, 0x7FFFFF, 0x400001, 0x123456], np.uint32).view(np.float32),
                        np.float32(1) / np.float32([3.4e38, 2.0 ** 127, 1e38, 2.0 ** 126 * 1.37, 1e37]),
                        np.float32([1e-30, 3.7e-9, 1.0, 0.3, 2.0 ** 100])]).astype(np.float32)
    ss, dd = np.meshgrid(s, d)
    with np.errstate(over="ignore", divide="ignore"):
        want = np.minimum(np.float32(1) / (ss * dd), np.finfo(np.float32).max)
    got = np.asarray(jax.jit(jc._encode_factor)(jnp.asarray(ss), jnp.asarray(dd)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_cast_of_float32_input_and_the_worked_example():
    row = np.array([10, -3.3, 0.7, 0.05, 2.5, -1.25, 0, 4.9, 1, -0.6, 3, 0.2, -7.1, 6, 0.9, 1.6] + [0.5] * 16,
                   np.float32)
    x = np.tile(row, (16, 1))
    data, scales, amax = _cast_jit(jnp.asarray(x), False)
    assert np.asarray(data)[0, :8].tolist() == [0xC7, 0x01, 0x93, 0x50, 0x91, 0x04, 0x6E, 0x21]  # docs/numerics.md
    assert np.asarray(scales)[0].tolist() == [0x7E, 0x5B] and float(amax) == 10.0
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 32)) * np.exp2(rng.integers(-20, 20, (16, 32)))).astype(np.float32)
    got = _cast_jit(jnp.asarray(x), True)
    want = ref.nvfp4_quantize(x, True)
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_cast_refuses_dims_not_multiple_of_16():
    with pytest.raises(ValueError, match="divisible by 16"):
        jc.nvfp4_cast(jnp.ones((16, 24)))


# ---- random Hadamard transform ------------------------------------------------------------------------------

def test_rht_matrix_is_transformer_engines():
    m = jh.rht_matrix()
    np.testing.assert_array_equal(m.astype(np.float64), ref.rht_matrix64())
    np.testing.assert_array_equal(m.astype(np.float64) @ m.T.astype(np.float64), np.eye(16))  # orthogonal
    from fp8kit.pytorch.hadamard import rht_matrix, sign_mask

    np.testing.assert_array_equal(rht_matrix().float().numpy(), m)
    assert sign_mask() == sum(1 << i for i, s in enumerate(jh.WGRAD_SIGNS) if s < 0) == 0xD7E8


def test_rht_against_float64_and_its_inverse():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((32, 64)) * np.exp2(rng.integers(-30, 30, (32, 64)))).astype(np.float32)
    x[0, :16] = [1.0, -1.0] * 8  # cancellation
    y = np.asarray(jax.jit(jh.rht)(jnp.asarray(x)))
    m64 = ref.rht_matrix64()
    want = (x.astype(np.float64).reshape(-1, 16) @ m64).astype(np.float32).reshape(x.shape)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))  # the float64 sum, rounded once
    back = (y.astype(np.float64).reshape(-1, 16) @ m64.T).reshape(x.shape)
    mag = (np.abs(y.astype(np.float64)).reshape(-1, 16) @ np.abs(m64.T)).reshape(x.shape)
    np.testing.assert_array_less(np.abs(back - x), 2.0 ** -24 * mag + 1e-45)  # the inverse recovers x
    xb = x.astype(BF16)
    yb = np.asarray(jax.jit(jh.rht)(jnp.asarray(xb)))
    np.testing.assert_array_equal(yb.view(np.uint16), ref.rht_bf16(xb).view(np.uint16))
    from fp8kit.pytorch.hadamard import rht as torch_rht

    tb = torch_rht(torch.from_numpy(xb.view(np.uint16).astype(np.int16)).view(torch.bfloat16))
    np.testing.assert_array_equal(yb.view(np.uint16), tb.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(ValueError, match="multiple of 16"):
        jh.rht(jnp.ones((4, 8)))


# ---- stochastic rounding ------------------------------------------------------------------------------------

def test_stochastic_rounding_bytes_equal_the_reference_for_the_same_draws():
    x = CASES["mixed"][:64]
    rand = jax.random.uniform(jax.random.key(3), x.shape, jnp.float32)
    data, scales, _ = _cast_jit(jnp.asarray(x), False, rand)
    want_data, want_scales, _ = ref.nvfp4_quantize(x.astype(np.float32), False, np.asarray(rand))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(data), want_data)


def test_stochastic_rounding_is_unbiased_and_deterministic_for_a_key():
    """E[round(v)] = v: the mean of N = 4000 draws per value lies within 5 standard deviations of v (sd from the
    exact Bernoulli variance (v - lo)(hi - v) / N); each check fails by chance with probability < 6e-7, all 64
    together < 4e-5."""
    v = np.concatenate([np.linspace(-6, 6, 48), [0.1, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 5.9, -0.3, -1.75, -2.2,
                                                -3.9, -4.5, 0.01, 0.49, 1.99]]).astype(np.float32)
    n = 4000
    codes = jax.jit(jc.e2m1_codes)
    draws = jax.random.uniform(jax.random.key(4), (n, v.size), jnp.float32)
    vals = np.asarray(jc.e2m1_decode(codes(jnp.broadcast_to(jnp.asarray(v), (n, v.size)), draws)), np.float64)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    a = np.abs(v.astype(np.float64))
    lo = grid[np.searchsorted(grid, a, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, a, side="right"), 7)]
    assert np.all(np.isin(np.abs(vals), grid)) and np.all((np.abs(vals) == lo) | (np.abs(vals) == hi))
    sd = np.sqrt((a - lo) * (hi - a) / n)
    np.testing.assert_array_less(np.abs(vals.mean(0) - v), 5 * sd + 1e-12)
    assert np.all(vals.std(0)[(a - lo) * (hi - a) > 0] > 0)  # it did round both ways
    # the same key gives the same bytes; another key other bytes
    x = jnp.asarray(CASES["mixed"][:64])
    spec = _spec(QParams(stochastic_rounding=True))
    op = jax.jit(nvfp4_operand, static_argnums=(1, 2))
    first, again = op(x, spec, False, jax.random.key(5)), op(x, spec, False, jax.random.key(5))
    other = op(x, spec, False, jax.random.key(6))
    np.testing.assert_array_equal(np.asarray(first.data), np.asarray(again.data))
    assert not np.array_equal(np.asarray(first.data), np.asarray(other.data))
    with pytest.raises(ValueError, match="PRNG key"):
        op(x, spec, False)


# ---- the same bytes as fp8kit.pytorch ----------------------------------------------------------------------

def _torch_bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)


def _torch_quantizers(recipe):
    from fp8kit.pytorch.nvfp4_recipe import nvfp4_role_quantizers

    return [rq.quantizer for rq in nvfp4_role_quantizers(recipe)]


def _torch_operand(storage, columnwise: bool) -> NVFP4Operand:
    m, k = storage.shape if not columnwise else storage.shape[::-1]
    data = (storage._columnwise_data if columnwise else storage._rowwise_data).reshape(m, k // 2)
    amax = storage._amax_columnwise if columnwise else storage._amax_rowwise
    return NVFP4Operand(jnp.asarray(data.numpy()), jnp.asarray(storage.block_scales(columnwise).numpy()),
                        jnp.asarray(amax.numpy()[0]))


ROLE_RECIPES = [
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="default"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True, fp4_quant_fwd_inp=QParams(
        random_hadamard_transform=True, fp4_2d_quantization=True)), id="rht-2d"),
]


@pytest.mark.parametrize("recipe", ROLE_RECIPES)
def test_pytorch_and_jax_give_the_same_bytes_scales_and_amaxes(recipe):
    x = CASES["mixed"][:96, :64].copy()
    x[5, :20] = np.nan
    op = jax.jit(nvfp4_operand, static_argnums=(1, 2))
    specs = [_spec(q) for q in (recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad)]
    for role, (tq, spec) in enumerate(zip(_torch_quantizers(recipe), specs)):
        storage = tq.quantize_impl(_torch_bf16(x))
        for columnwise in (False, True):
            want = _torch_operand(storage, columnwise)
            got = op(jnp.asarray(x), spec, columnwise)
            for g, w, name in zip(got, want, ("data", "scales", "amax")):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"role {role} {name} "
                                                                                    f"columnwise={columnwise}")


def test_gemm_equals_pytorch_and_the_reference_bit_for_bit():
    from fp8kit.pytorch.nvfp4_gemm import nvfp4_gemm as torch_gemm

    rng = np.random.default_rng(7)
    a = (rng.standard_normal((64, 128)) * np.exp2(rng.integers(-12, 12, (1, 128)))).astype(np.float32)
    b = (rng.standard_normal((32, 128)) * np.exp2(rng.integers(-12, 12, (32, 1)))).astype(np.float32)
    tq = _torch_quantizers(NVFP4BlockScaling(disable_stochastic_rounding=True))
    sa, sb = tq[0].quantize_impl(torch.from_numpy(a)), tq[1].quantize_impl(torch.from_numpy(b))
    want = torch_gemm(sa, sb).numpy()
    oa, ob = _torch_operand(sa, False), _torch_operand(sb, False)
    got = np.asarray(jax.jit(nvfp4_gemm)(oa, ob))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    r = ref.nvfp4_gemm(np.asarray(oa.data), np.asarray(oa.scales), np.asarray(oa.amax), np.asarray(ob.data),
                       np.asarray(ob.scales), np.asarray(ob.amax))
    np.testing.assert_array_equal(got.view(np.uint32), r.view(np.uint32))
    # and the JAX operands of the same inputs are the same operands
    spec = [_spec(q) for q in (QParams(random_hadamard_transform=True), QParams(fp4_2d_quantization=True))]
    op = jax.jit(nvfp4_operand, static_argnums=(1, 2))
    ja, jb = op(jnp.asarray(a), spec[0], False), op(jnp.asarray(b), spec[1], False)
    for g, w in zip(ja + jb, oa + ob):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    k16 = NVFP4Operand(jnp.zeros((16, 8), jnp.uint8), jnp.zeros((16, 1), jnp.uint8), jnp.float32(1))
    with pytest.raises(ValueError, match="K divisible by 32"):
        nvfp4_gemm(k16, k16)


# ---- dense forward and backward ---------------------------------------------------------------------------

def _deq(x: np.ndarray, q: QParams, columnwise: bool) -> np.ndarray:
    """float64 reference-quantized operand: x (rowwise) or its transpose (columnwise, transformed with the role's
    RHT in float64 rounded to float32), dequantized as the GEMM scales it: e2m1 * e4m3 * amax / 2688."""
    t = x.T if columnwise else x
    if columnwise and q.random_hadamard_transform:
        t = (t.astype(np.float64).reshape(-1, 16) @ ref.rht_matrix64()).astype(np.float32).reshape(t.shape)
    data, scales, amax = ref.nvfp4_quantize(t, q.fp4_2d_quantization)
    s = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64).repeat(16, axis=1)
    return ref.nvfp4_values(data) * s * (np.float64(amax) / 2688.0)


def _dense_vjp(recipe, x, kernel, bias, dy, key=None):
    def f(x, kernel, bias):
        with te.autocast(enabled=True, recipe=recipe):
            return te.dense(x, kernel, bias, quantizer_set=None if key is None else {"sr_rng": key})

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias))
    return (y,) + vjp(jnp.asarray(dy))


def _operands(shape, seed=8):
    m, k, n = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32), (rng.standard_normal((k, n)) * 0.1).astype(np.float32),
            rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32))


def test_dense_forward_backward_against_reference_quantized_float64():
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    x, kernel, bias, dy = _operands((64, 96, 32))
    y, dx, dk, db = _dense_vjp(recipe, x, kernel, bias, dy)
    qi, qw, qg = recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad
    xq, wq, gq = _deq(x, qi, False), _deq(kernel.T, qw, False), _deq(dy, qg, False)
    kq, x_col, g_col = _deq(kernel, qw, False), _deq(x, qi, True), _deq(dy, qg, True)
    checks = [(y, xq @ wq.T + bias, np.abs(xq) @ np.abs(wq).T + np.abs(bias), x @ kernel + bias),
              (dx, gq @ kq.T, np.abs(gq) @ np.abs(kq).T, dy @ kernel.T),
              (dk, x_col @ g_col.T, np.abs(x_col) @ np.abs(g_col).T, x.T @ dy)]
    for got, want, mag, exact in checks:
        got = np.asarray(got, np.float64)
        np.testing.assert_array_less(np.abs(got - want), 2.0 ** -19 * mag + 1e-30)
        err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 0.01 < err < 0.25  # NVFP4 ran (not the float32 GEMM), and it is near the float64 product
    np.testing.assert_array_less(np.abs(np.asarray(db, np.float64) - dy.astype(np.float64).sum(0)),
                                 2.0 ** -20 * np.abs(dy).sum(0))


def test_backward_override_dequantized():
    """dgrad and wgrad in float32 from the forward's NVFP4 operands, dequantized (no key needed: dy is not cast)."""
    recipe = NVFP4BlockScaling(backward_override="dequantized")
    x, kernel, bias, dy = _operands((32, 64, 32), seed=12)
    _, dx, dk, _ = _dense_vjp(recipe, x, kernel, bias, dy)
    xq, kq = _deq(x, recipe.fp4_quant_fwd_inp, False), _deq(kernel.T, recipe.fp4_quant_fwd_weight, False).T
    for got, want, mag in ((dx, dy @ kq.T, np.abs(dy) @ np.abs(kq).T), (dk, xq.T @ dy, np.abs(xq).T @ np.abs(dy))):
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), 2.0 ** -19 * mag)


def test_dense_stochastic_rounding_needs_a_key_and_is_deterministic_for_it():
    recipe = NVFP4BlockScaling()
    x, kernel, bias, dy = _operands((32, 64, 32), seed=9)
    with te.autocast(enabled=True, recipe=recipe):
        with pytest.raises(ValueError, match="sr_rng"):
            te.dense(jnp.asarray(x), jnp.asarray(kernel))
    first = _dense_vjp(recipe, x, kernel, bias, dy, jax.random.key(10))
    again = _dense_vjp(recipe, x, kernel, bias, dy, jax.random.key(10))
    other = _dense_vjp(recipe, x, kernel, bias, dy, jax.random.key(11))
    rtn = _dense_vjp(NVFP4BlockScaling(disable_stochastic_rounding=True), x, kernel, bias, dy)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(rtn[0]))  # the forward rounds to nearest
    for i in (1, 2):  # dgrad and wgrad read the stochastically rounded gradient
        assert not np.array_equal(np.asarray(first[i]), np.asarray(other[i]))
        exact = (dy @ kernel.T, x.T @ dy)[i - 1]
        assert np.linalg.norm(np.asarray(first[i]) - exact) < 0.3 * np.linalg.norm(exact)


def test_dense_refuses_bad_dims_options_and_quantizer_sets():
    with te.autocast(enabled=True, recipe=NVFP4BlockScaling(disable_stochastic_rounding=True)):
        with pytest.raises(ValueError, match="multiples of 32"):
            te.dense(jnp.ones((16, 32)), jnp.ones((32, 32)))
        with pytest.raises(ValueError, match="sr_rng"):
            te.dense(jnp.ones((32, 32)), jnp.ones((32, 32)), quantizer_set={"x_scale": jnp.ones(1)})
    with te.autocast(enabled=True, recipe=NVFP4BlockScaling(nvfp4_4over6="all")):
        with pytest.raises(NotImplementedError, match="nvfp4_4over6"):
            te.dense(jnp.ones((32, 32)), jnp.ones((32, 32)))


def test_scaling_mode_names():
    assert scaling_mode_of(NVFP4BlockScaling()) is ScalingMode.NVFP4_1D_SCALING
    assert scaling_mode_of(NVFP4BlockScaling(), "kernel") is ScalingMode.NVFP4_2D_SCALING
    assert scaling_mode_of(NVFP4BlockScaling(disable_2d_quantization=True), "kernel") is ScalingMode.NVFP4_1D_SCALING
    assert ScalingMode.NVFP4_1D_SCALING.value == 4 and ScalingMode.NVFP4_2D_SCALING.is_nvfp4_scaling
    with pytest.raises(ValueError, match="tensor_source"):
        scaling_mode_of(NVFP4BlockScaling(), "weight")


@pytest.mark.slow
def test_flax_layernorm_mlp_trains_under_nvfp4():
    from fp8kit.jax.flax import LayerNormMLP

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 64))
    layer = LayerNormMLP(intermediate_dim=64, activations=("gelu", "linear"), use_bias=True)
    recipe = NVFP4BlockScaling()
    with te.autocast(enabled=True, recipe=recipe):
        params = layer.init(jax.random.PRNGKey(1), x)

    def loss(p, rngs):
        return jnp.mean(layer.apply(p, x, rngs=rngs)[0] ** 2)

    g_hp = jax.grad(loss)(params, {})
    with te.autocast(enabled=True, recipe=recipe):
        with pytest.raises(ValueError, match="sr_rng"):
            jax.grad(loss)(params, {})
        g = jax.grad(loss)(params, {"sr_rng": jax.random.PRNGKey(2)})
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_hp)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a))
        assert np.linalg.norm(a - b) <= 0.5 * np.linalg.norm(b)  # NVFP4 (4-bit) gradients near the float32 ones
        assert not np.array_equal(a, b) or not np.any(b)
