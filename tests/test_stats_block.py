"""Numerics statistics of the block-scaled recipes (MXFP8, Float8 block scaling, NVFP4) against an independent
NumPy/ml_dtypes quantization (tests/reference.py): saturated = codes at +-max of the element format, underflow =
non-zero inputs whose code is +-0, counted on the rowwise data."""

import math

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.block_recipes import block_quantizers
from fp8kit.pytorch.nvfp4_recipe import nvfp4_role_quantizers
from fp8kit.pytorch.stats import RoleStats
from fp8kit.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

import reference as ref

ROLES = ("input", "weight", "grad_output")
# Per recipe: for each role, (format, reference quantizer of a 2-D float32 array -> element values without scale).
MX_2D = MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True)
NVFP4_NOSR = NVFP4BlockScaling(disable_stochastic_rounding=True)


def _mx(fmt, block):
    return fmt, lambda x: ref.fp8_values(ref.mxfp8_quantize(x, fmt, block)[0], fmt)


def _f8block(fmt, tile):
    return fmt, lambda x: ref.fp8_values(ref.float8_block_quantize(x, fmt, tile, power_2=True)[0], fmt)


def _nvfp4(two_d):
    return "e2m1", lambda x: ref.nvfp4_values(ref.nvfp4_quantize(x, two_d=two_d)[0])


CASES = {
    "mxfp8": (MXFP8BlockScaling(), [_mx("e4m3", (1, 32))] * 3),
    "mxfp8_hybrid_2d": (MX_2D, [_mx("e4m3", (1, 32)), _mx("e4m3", (32, 32)), _mx("e5m2", (1, 32))]),
    "block": (Float8BlockScaling(), [_f8block("e4m3", (1, 128)), _f8block("e4m3", (128, 128)),
                                     _f8block("e4m3", (1, 128))]),
    "nvfp4_nosr": (NVFP4_NOSR, [_nvfp4(False), _nvfp4(True), _nvfp4(False)]),
}
FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}


def wide_range(shape, seed, low=-8.0, high=4.0, zeros=0.1):
    """Log-uniform magnitudes with random signs and some exact zeros: inside a block the small values underflow
    and the block's largest ones reach the top of the format."""
    g = np.random.default_rng(seed)
    x = 10.0 ** g.uniform(low, high, shape) * g.choice([-1.0, 1.0], shape)
    x[g.random(shape) < zeros] = 0.0
    return x.astype(np.float32)


def expected(xs, fmt, quantize):
    n = nonzero = flushed = at_max = 0
    for x in xs:
        values = quantize(x)
        n += x.size
        nonzero += int(np.count_nonzero(x))
        flushed += int(np.sum((x != 0) & (values == 0)))
        at_max += int(np.sum(np.abs(values) == FORMAT_MAX[fmt]))
    return {"amax": float(max(ref.amax(x) for x in xs)), "saturated": at_max / n, "underflow": flushed / nonzero,
            "numel": n, "casts": len(xs)}


def assert_row(row, want, fmt):
    assert row["fp8_dtype"] == fmt
    assert math.isnan(row["scale"])  # one scale per block: no single value
    for key in ("amax", "numel", "casts"):
        assert row[key] == want[key], key
    assert row["saturated"] == pytest.approx(want["saturated"], rel=1e-12, abs=0)
    assert row["underflow"] == pytest.approx(want["underflow"], rel=1e-12, abs=0)


def role_quantizers(recipe):
    return nvfp4_role_quantizers(recipe) if isinstance(recipe, NVFP4BlockScaling) else block_quantizers(recipe)


@pytest.mark.parametrize("case", list(CASES))
def test_role_stats_of_block_casts_match_reference(case):
    recipe, per_role = CASES[case]
    saturated = []
    for role, quantizer, (fmt, quantize) in zip(ROLES, role_quantizers(recipe), per_role):
        xs = [wide_range((64, 256), seed) for seed in (1, 2)]
        rs = quantizer.stats = RoleStats()
        for x in xs:
            quantizer.quantize(torch.from_numpy(x))
        want = expected(xs, fmt, quantize)
        assert 0 < want["underflow"] < 1, role
        saturated.append(want["saturated"])
        assert_row(rs.row(), want, fmt)
    assert max(saturated) > 0  # the top of the format is exercised too (rare for a 32x32 MXFP8 block)


@pytest.mark.parametrize("case", list(CASES))
def test_linear_rows_under_block_recipes(case):
    recipe, per_role = CASES[case]
    layer = te.Linear(64, 32)
    g = np.random.default_rng(5)
    w = (g.standard_normal((32, 64)) * 0.05).astype(np.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    te.enable_stats(layer)
    x, dy = wide_range((32, 64), 11), wide_range((32, 32), 12, low=-12, high=0)
    xt = torch.from_numpy(x).requires_grad_()
    with te.autocast(recipe=recipe):
        y = layer(xt)
    y.backward(torch.from_numpy(dy))
    rows = {r["role"]: r for r in te.stats(layer)}
    assert set(rows) == set(ROLES)
    for role, data, (fmt, quantize) in zip(ROLES, (x, w, dy), per_role):
        assert_row(rows[role], expected([data], fmt, quantize), fmt)


def test_block_stats_do_not_change_the_numbers():
    torch.manual_seed(0)
    layer = te.Linear(64, 64)
    x = torch.randn(32, 64)
    outs = []
    for on in (False, True):
        if on:
            te.enable_stats(layer)
        xt = x.clone().requires_grad_()
        with te.autocast(recipe=NVFP4_NOSR):
            y = layer(xt)
        y.square().sum().backward()
        outs.append((y.detach(), xt.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_format_change_between_recipes_starts_a_new_window():
    x = torch.from_numpy(wide_range((32, 64), 3))
    rs = RoleStats()
    mx = block_quantizers(MXFP8BlockScaling())[0]
    fp4 = nvfp4_role_quantizers(NVFP4_NOSR)[0]
    mx.stats = fp4.stats = rs
    mx.quantize(x)
    fp4.quantize(x)
    assert_row(rs.row(), expected([x.numpy()], "e2m1", CASES["nvfp4_nosr"][1][0][1]), "e2m1")
