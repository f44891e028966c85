"""Block-scaled recipes in fp8kit.jax (MXFP8BlockScaling, Float8BlockScaling): casts against the NumPy + ml_dtypes
reference and against fp8kit.pytorch's quantizers, the block GEMM against float64 math, and the dense layer's
forward and backward against float64 GEMMs of reference-quantized operands. Shapes stay small: few compiles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import fp8kit.jax as te
from fp8kit.jax import block_cast as jbc
from fp8kit.jax.block_dense import _specs
from fp8kit.jax.block_gemm import BlockSpec, block_gemm, block_operand
from fp8kit.jax.scaling_modes import ScalingMode, block_kind, scaling_mode_of
from fp8kit.pytorch.block_recipes import block_quantizers
from fp8kit.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, QParams
from tests import reference as ref

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FMT = {jnp.dtype(E4M3): "e4m3", jnp.dtype(E5M2): "e5m2"}
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _bytes(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _all_bf16(rows: int = 1152, cols: int = 128) -> np.ndarray:
    """Every bf16 bit pattern twice: in order (blocks of neighbouring magnitudes) and shuffled (blocks mixing the
    whole range, NaN and inf included), then special blocks: zeros, all NaN, +-inf, subnormals only, one huge value
    among tiny ones."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    shuffled = np.random.default_rng(0).permutation(bits)
    x = np.concatenate([bits, shuffled]).view(ml_dtypes.bfloat16).astype(np.float32).reshape(-1, cols)
    special = np.zeros((rows - x.shape[0], cols), np.float32)
    special[32:64] = np.nan
    special[64:96, ::7] = np.inf
    special[64:96, 3::7] = -np.inf
    special[96:] = np.arange(1, 128).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)[
        np.arange((rows - x.shape[0] - 96) * cols) % 127].reshape(-1, cols)
    special[96:, 5] = 3.0e38
    with np.errstate(invalid="ignore"):
        return np.concatenate([x, special]).astype(ml_dtypes.bfloat16)


X_ALL = _all_bf16()


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block", [(1, 32), (32, 1), (32, 32)])
def test_mxfp8_cast_equals_reference_for_all_bf16(fp8, block):
    data, code = jax.jit(jbc.mxfp8_cast, static_argnums=(1, 2, 3))(jnp.asarray(X_ALL), fp8, *block)
    want_bytes, want_code = ref.mxfp8_quantize(X_ALL.astype(np.float32), FMT[jnp.dtype(fp8)], block)
    np.testing.assert_array_equal(np.asarray(code), want_code)
    np.testing.assert_array_equal(_bytes(data), want_bytes)


@pytest.mark.parametrize("fp8,two_d,power_2,eps", [(E4M3, False, True, 0.0), (E5M2, False, False, 0.0),
                                                    (E4M3, True, False, 1e-3), (E4M3, False, False, 2.0 ** -140)])
def test_float8_block_cast_equals_reference_for_all_bf16(fp8, two_d, power_2, eps):
    x = X_ALL[:, :100]  # 1x128 blocks shorter than 128 along K, edge 128x128 blocks
    data, scale_inv = jax.jit(jbc.float8_block_cast, static_argnums=(1, 2, 3, 4))(jnp.asarray(x), fp8, two_d,
                                                                                   power_2, eps)
    want_bytes, want_inv = ref.float8_block_quantize(x.astype(np.float32), FMT[jnp.dtype(fp8)],
                                                     (128, 128) if two_d else (1, 128), power_2, eps, BF16_MAX)
    np.testing.assert_array_equal(np.asarray(scale_inv).view(np.uint32), want_inv.view(np.uint32))
    np.testing.assert_array_equal(_bytes(data), want_bytes)


def test_float32_input_uses_float32_max_for_an_infinite_quotient():
    x = np.full((2, 128), 1e-39, np.float32)  # subnormal amax: fp8_max / amax overflows
    _, inv = jbc.float8_block_cast(jnp.asarray(x), E4M3, False, False, 0.0)
    _, want = ref.float8_block_quantize(x, "e4m3", (1, 128), False, 0.0, float(np.finfo(np.float32).max))
    np.testing.assert_array_equal(np.asarray(inv).view(np.uint32), want.view(np.uint32))


def test_mxfp8_refuses_dims_not_multiple_of_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        jbc.mxfp8_cast(jnp.ones((32, 48)), E4M3, 1, 32)


# ---- the same recipe gives the same bytes in PyTorch and JAX --------------------------------------------------

RECIPES = [
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True), id="mxfp8-hybrid-2d"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(Float8BlockScaling(fp8_format=Format.HYBRID, use_f32_scales=True, x_block_scaling_dim=2,
                                    w_block_scaling_dim=1, fp8_quant_fwd_inp=QParams(amax_epsilon=1e-2)),
                 id="block-hybrid-f32-2dx"),
]


_operand_jit = jax.jit(block_operand, static_argnums=(1, 2))


def _torch_operand(storage, transpose: bool):
    """(FP8 bytes, float32 scale_inv per (row, K block)) of a PyTorch block storage as an operand, contraction last."""
    from fp8kit.pytorch.block_gemm import block_operand as torch_operand

    op = torch_operand(storage, transpose)
    dtype = storage.fp8_dtype
    return op.values.to(dtype).view(torch.uint8).numpy(), op.scales.numpy()


@pytest.mark.parametrize("recipe", RECIPES)
def test_pytorch_and_jax_give_the_same_bytes_and_scales(recipe):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((96, 160)) * np.exp2(rng.integers(-20, 20, (96, 1)))).astype(ml_dtypes.bfloat16)
    x[5, :40] = np.nan
    if block_kind(recipe) == "mxfp8":
        x = x[:, :128]
    xt = torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    for role, (tq, spec) in enumerate(zip(block_quantizers(recipe), _specs(recipe, block_kind(recipe)))):
        tq.quantizer.set_usage(rowwise=True, columnwise=True)
        storage = tq.quantizer.quantize_impl(xt)
        for transpose in (False, True):
            want_bytes, want_scales = _torch_operand(storage, transpose)
            op = _operand_jit(jnp.asarray(x), spec, transpose)
            np.testing.assert_array_equal(_bytes(op.values), want_bytes, err_msg=f"role {role} T={transpose}")
            np.testing.assert_array_equal(np.asarray(op.scale_inv).view(np.uint32), want_scales.view(np.uint32),
                                          err_msg=f"role {role} T={transpose}")


# ---- the GEMM ----------------------------------------------------------------------------------------------------

def _deq(op, block: int) -> np.ndarray:
    values = np.asarray(op.values.astype(jnp.float32), np.float64)
    s = np.repeat(np.asarray(op.scale_inv, np.float64), block, axis=1)[:, : values.shape[1]]
    return values * s


@pytest.mark.parametrize("spec_a,spec_b,k", [
    (BlockSpec(True, E4M3), BlockSpec(True, E5M2), 96),
    (BlockSpec(False, E4M3, power_2=False), BlockSpec(False, E4M3, two_d=True, power_2=False), 200),
])
def test_block_gemm_against_float64_on_dequantized_operands(spec_a, spec_b, k):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, k)) * np.exp2(rng.integers(-8, 8, (1, k)))
    b = rng.standard_normal((32, k))
    qa, qb = block_operand(jnp.asarray(a, jnp.float32), spec_a), block_operand(jnp.asarray(b, jnp.float32), spec_b)
    y = np.asarray(jax.jit(block_gemm, static_argnums=(2, 3))(qa, qb, spec_a, spec_b))
    da, db = _deq(qa, spec_a.block), _deq(qb, spec_b.block)
    want = da @ db.T
    bound = 2.0 ** -22 * (np.abs(da) @ np.abs(db).T) * (k // spec_a.block + 2)
    assert np.all(np.abs(y - want) <= bound)
    assert np.abs(want).max() > 0


# ---- dense forward and backward ----------------------------------------------------------------------------------

def _ref_q(x: np.ndarray, recipe, role: int, along_rows: bool) -> np.ndarray:
    """Reference-quantized, dequantized float64 `x` (2-D) for role 0 (x), 1 (kernel), 2 (grad), blocks along its
    last dim (or along its rows with `along_rows`); the recipe's formats, block dims and scale options."""
    fmt = recipe.fp8_format.value
    name = (fmt.fwd, fmt.fwd, fmt.bwd)[role]
    if block_kind(recipe) == "mxfp8":
        two_d = role == 1 and recipe.enable_2d_quantization
        block = (32, 32) if two_d else ((32, 1) if along_rows else (1, 32))
        q, code = ref.mxfp8_quantize(x, name, block)
        s = np.repeat(np.repeat(ref.e8m0_value(code).astype(np.float64), block[0], 0), block[1], 1)
        return ref.fp8_values(q, name) * s
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
    qp = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)[role]
    xx = x.T if (along_rows and dims[role] == 1) else x
    tile = (128, 128) if dims[role] == 2 else (1, 128)
    f32_max = float(np.finfo(np.float32).max)
    q, inv = ref.float8_block_quantize(xx, name, tile, qp.power_2_scale, qp.amax_epsilon, f32_max)
    s = np.repeat(np.repeat(inv.astype(np.float64), tile[0], 0), 128, 1)[: xx.shape[0], : xx.shape[1]]
    out = ref.fp8_values(q, name) * s
    return out.T if xx is not x else out


@pytest.mark.parametrize("recipe,shape", [
    pytest.param(MXFP8BlockScaling(), (64, 64, 96), id="mxfp8"),
    pytest.param(MXFP8BlockScaling(enable_2d_quantization=True, fp8_format=Format.HYBRID), (32, 96, 64),
                 id="mxfp8-2d-hybrid"),
    pytest.param(Float8BlockScaling(), (64, 160, 96), id="block"),
])
def test_dense_forward_backward_against_reference_quantized_float64(recipe, shape):
    m, k, n = shape
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32)
    kernel = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)

    def f(x, kernel, bias):
        with te.autocast(enabled=True, recipe=recipe):
            return te.dense(x, kernel, bias)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias))
    dx, dk, db = vjp(jnp.asarray(dy))
    xq, wq = _ref_q(x, recipe, 0, False), _ref_q(kernel.T, recipe, 1, False)
    gq = _ref_q(dy, recipe, 2, False)
    kq_col = _ref_q(kernel.T, recipe, 1, True)  # W's blocks along its rows (out): the kernel along N
    x_col, g_col = _ref_q(x, recipe, 0, True), _ref_q(dy, recipe, 2, True)
    checks = [(y, xq @ wq.T + bias, np.abs(xq) @ np.abs(wq).T + np.abs(bias)),
              (dx, gq @ kq_col, np.abs(gq) @ np.abs(kq_col)),
              (dk, x_col.T @ g_col, np.abs(x_col).T @ np.abs(g_col))]
    for got, want, mag in checks:
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), 2.0 ** -20 * mag + 1e-30)
    np.testing.assert_array_less(np.abs(np.asarray(db, np.float64) - dy.astype(np.float64).sum(0)),
                                 2.0 ** -20 * np.abs(dy).sum(0))
    assert not np.allclose(np.asarray(y), x @ kernel + bias, rtol=1e-4)  # FP8 ran: not the float32 GEMM


def test_dense_refuses_state_and_mxfp8_dims():
    with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
        with pytest.raises(ValueError, match="multiples of 32"):
            te.dense(jnp.ones((8, 32)), jnp.ones((32, 32)))
        with pytest.raises(ValueError, match="no scaling state"):
            te.dense(jnp.ones((32, 32)), jnp.ones((32, 32)), quantizer_set={"x_scale": jnp.ones(1)})


@pytest.mark.parametrize("recipe", [pytest.param(MXFP8BlockScaling(), id="mxfp8"),
                                    pytest.param(Float8BlockScaling(), id="block", marks=pytest.mark.slow)])
def test_flax_layernorm_mlp_trains_under_block_recipes(recipe):
    from fp8kit.jax.flax import LayerNormMLP

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 64))
    layer = LayerNormMLP(intermediate_dim=64, activations=("gelu", "linear"), use_bias=True)
    params = layer.init(jax.random.PRNGKey(1), x)

    def loss(p):
        return jnp.mean(layer.apply(p, x)[0] ** 2)

    g_hp = jax.grad(loss)(params)
    with te.autocast(enabled=True, recipe=recipe):
        g = jax.grad(loss)(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_hp)):
        assert np.all(np.isfinite(np.asarray(a)))
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b)  # FP8 gradients near the float32 ones
        assert not np.array_equal(a, b) or not np.any(b)


def test_scaling_mode_names():
    assert te.quantize.ScalingMode is ScalingMode
    assert scaling_mode_of(MXFP8BlockScaling()) is ScalingMode.MXFP8_1D_SCALING
    assert ScalingMode.MXFP8_1D_SCALING.value == 2 and ScalingMode.MXFP8_1D_SCALING.is_1d_block_scaling()
    assert scaling_mode_of(Float8BlockScaling()).is_block_scaling
    assert scaling_mode_of(None) is ScalingMode.NO_SCALING


@pytest.mark.parametrize("recipe", [pytest.param(MXFP8BlockScaling(), id="mxfp8"),
                                    pytest.param(Float8BlockScaling(), id="block")])
def test_block_gemm_equals_pytorch_bit_for_bit_for_e4m3_power_of_two_scales(recipe):
    """E4M3 x E4M3 block sums are exact-then-rounded in both frontends, and power-of-two scales make the scaling
    exact, so the bits match over a wide range of magnitudes."""
    from fp8kit.pytorch.block_gemm import block_gemm as torch_block_gemm

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 256)) * np.exp2(rng.integers(-12, 12, (1, 256)))).astype(np.float32)
    w = (rng.standard_normal((32, 256)) * np.exp2(rng.integers(-12, 12, (32, 1)))).astype(np.float32)
    tq = block_quantizers(recipe)
    spec = _specs(recipe, block_kind(recipe))
    for q in tq:
        q.quantizer.set_usage(rowwise=True, columnwise=False)
    want = torch_block_gemm(tq[0].quantizer.quantize_impl(torch.from_numpy(x)),
                            tq[1].quantizer.quantize_impl(torch.from_numpy(w))).numpy()
    ops = _operand_jit(jnp.asarray(x), spec[0], False), _operand_jit(jnp.asarray(w), spec[1], False)
    got = np.asarray(jax.jit(block_gemm, static_argnums=(2, 3))(*ops, spec[0], spec[1]))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override(override):
    rng = np.random.default_rng(5)
    x, kernel, dy = (rng.standard_normal(s).astype(np.float32) for s in ((32, 64), (64, 32), (32, 32)))
    recipe = MXFP8BlockScaling(backward_override=override)

    def f(x, kernel):
        with te.autocast(enabled=True, recipe=recipe):
            return te.dense(x, kernel)

    _, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(kernel))
    dx, dk = (np.asarray(g, np.float64) for g in vjp(jnp.asarray(dy)))
    if override == "high_precision":
        xs, ks = x.astype(np.float64), kernel.astype(np.float64)
    else:  # the forward's rowwise FP8 operands, dequantized
        xs, ks = _ref_q(x, recipe, 0, False), _ref_q(kernel.T, recipe, 1, False).T
    for got, want, mag in ((dx, dy @ ks.T, np.abs(dy) @ np.abs(ks).T), (dk, xs.T @ dy, np.abs(xs).T @ np.abs(dy))):
        np.testing.assert_array_less(np.abs(got - want), 2.0 ** -20 * mag)
