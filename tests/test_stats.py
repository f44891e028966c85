"""FP8 numerics statistics (fp8kit.pytorch.stats) against an independent NumPy/ml_dtypes computation."""

import csv
import io

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.stats import STATS_COLUMNS, RoleStats
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

import reference as ref

FMT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def wide_range(shape, seed, low=-8.0, high=4.0, zeros=0.1):
    """Log-uniform magnitudes over 10^low..10^high with random signs and some exact zeros: both ends of the FP8
    range get hit (saturation at scale 1, underflow of the tiny ones)."""
    g = np.random.default_rng(seed)
    x = 10.0 ** g.uniform(low, high, shape) * g.choice([-1.0, 1.0], shape)
    x[g.random(shape) < zeros] = 0.0
    return x.astype(np.float32)


def expected(xs, fmt, scales):
    """What the statistics of casting each x of `xs` with the matching scale must be (reference cast)."""
    fp8_max = ref.FP8[fmt][1]
    n = nonzero = flushed = at_max = 0
    for x, s in zip(xs, scales):
        q, inv = ref.cast(x, fmt, s)
        values = ref.dequantize(q, fmt, 1.0)  # the FP8 values themselves
        n += x.size
        nonzero += int(np.count_nonzero(x))
        flushed += int(np.sum((x != 0) & (values == 0)))
        at_max += int(np.sum(np.abs(values) == fp8_max))
    return {"amax": float(max(ref.amax(x) for x in xs)), "scale": float(np.float32(scales[-1])),
            "saturated": at_max / n, "underflow": flushed / nonzero, "numel": n, "casts": len(xs)}


def assert_row(row, want, fmt):
    assert row["fp8_dtype"] == fmt
    for key in ("amax", "scale", "numel", "casts"):
        assert row[key] == want[key], key
    assert row["saturated"] == pytest.approx(want["saturated"], rel=1e-12, abs=0)
    assert row["underflow"] == pytest.approx(want["underflow"], rel=1e-12, abs=0)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [1.0, 0.01, 3.0e4])
def test_role_stats_record_matches_reference(fp8_dtype, scale):
    xs = [wide_range((33, 17), seed) for seed in (1, 2)]
    xs[1][0, :3] = [np.nan, np.inf, -np.inf]  # NaN is neither zero nor max; +-inf saturate
    xs[1][1, :2] = [-1e-30, 1e-30]  # flushed to -0 and +0
    rs = RoleStats()
    for x in xs:
        q = te.quantize(torch.from_numpy(x), fp8_dtype, scale)
        rs.record(torch.from_numpy(x), q, torch.tensor(scale, dtype=torch.float32))
    want = expected(xs, FMT[fp8_dtype], [scale, scale])
    assert 0 < want["saturated"] < 1 and 0 < want["underflow"] < 1  # the data exercises both ends
    assert_row(rs.row(), want, FMT[fp8_dtype])


def run_linear(layer, recipe, x, dy):
    xt = torch.from_numpy(x).requires_grad_()
    with te.autocast(recipe=recipe):
        y = layer(xt)
    y.backward(torch.from_numpy(dy))


def make_layer(seed, k=48, n=32):
    layer = te.Linear(k, n)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(wide_range((n, k), seed, low=-6, high=1)))
    return layer


def test_linear_current_scaling_rows():
    recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)
    layer = make_layer(10)
    assert te.enable_stats(layer) == 1
    x, dy = wide_range((64, 48), 11), wide_range((64, 32), 12, low=-12, high=2)
    run_linear(layer, recipe, x, dy)
    rows = {r["role"]: r for r in te.stats(layer)}
    assert set(rows) == {"input", "weight", "grad_output"}
    assert all(r["module"] == "" for r in rows.values())
    w = layer.weight.detach().numpy()
    for role, data, fmt in (("input", x, "e4m3"), ("weight", w, "e4m3"), ("grad_output", dy, "e5m2")):
        scale = ref.current_scale(ref.amax(data), ref.FP8[fmt][1])
        assert_row(rows[role], expected([data], fmt, [scale]), fmt)


def test_linear_delayed_scaling_rows_over_two_steps():
    """Step 1 casts with scale 1, step 2 with the scales of the first update (reference DelayedState)."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    layer = make_layer(20)
    te.enable_stats(layer)
    w = layer.weight.detach().numpy()
    fwd = ref.DelayedState(4, 3, 448.0)
    bwd = ref.DelayedState(4, 2, 57344.0)
    xs, dys, scales_x, scales_w, scales_dy = [], [], [], [], []
    for step in range(2):
        x, dy = wide_range((64, 48), 30 + step), wide_range((64, 32), 40 + step, low=-12, high=6)
        scales_x.append(fwd.scale[0])
        scales_w.append(fwd.scale[1])
        scales_dy.append(bwd.scale[0])
        run_linear(layer, recipe, x, dy)
        fwd.record(0, ref.amax(x))
        fwd.record(1, ref.amax(w))
        bwd.record(0, ref.amax(dy))
        fwd.update()
        bwd.update()
        xs.append(x)
        dys.append(dy)
    assert scales_x[0] == 1 and scales_x[1] != 1  # the two steps really used different scales
    rows = {r["role"]: r for r in te.stats(layer)}
    assert_row(rows["input"], expected(xs, "e4m3", scales_x), "e4m3")
    assert_row(rows["weight"], expected([w, w], "e4m3", scales_w), "e4m3")
    assert_row(rows["grad_output"], expected(dys, "e5m2", scales_dy), "e5m2")


def test_names_reset_disable_and_off_by_default():
    recipe = Float8CurrentScaling()
    model = torch.nn.Sequential(te.Linear(16, 16), torch.nn.ReLU(), te.Linear(16, 16))
    x, dy = wide_range((8, 16), 1, -2, 1), wide_range((8, 16), 2, -2, 1)
    run_linear(model, recipe, x, dy)
    assert te.stats(model) == []  # off by default
    assert te.enable_stats(model) == 2
    run_linear(model, recipe, x, dy)
    rows = te.stats(model, reset=True)
    assert [(r["module"], r["role"]) for r in rows] == [
        (m, role) for m in ("0", "2") for role in ("input", "weight", "grad_output")]
    assert all(r["casts"] == 1 for r in rows)
    assert te.stats(model) == []  # reset=True emptied the window
    run_linear(model, recipe, x, dy)
    with torch.no_grad(), te.autocast(recipe=recipe):  # a forward only: no grad_output cast
        model(torch.from_numpy(x))
    casts = {(r["module"], r["role"]): r["casts"] for r in te.stats(model)}
    assert casts[("0", "input")] == 2 and casts[("0", "grad_output")] == 1
    model(torch.from_numpy(x))  # outside autocast: no casts, nothing recorded
    assert {(r["module"], r["role"]): r["casts"] for r in te.stats(model)} == casts
    te.reset_stats(model)
    assert te.stats(model) == []
    run_linear(model, recipe, x, dy)
    assert len(te.disable_stats(model)) == 6
    run_linear(model, recipe, x, dy)
    assert te.stats(model) == [] and model[0].fp8_stats is None


def test_stats_do_not_change_the_numbers():
    recipe = DelayedScaling(amax_history_len=3)
    outs = []
    for on in (False, True):
        torch.manual_seed(0)
        layer = te.Linear(32, 16)
        if on:
            te.enable_stats(layer)
        xt = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for _ in range(2):
            with te.autocast(recipe=recipe):
                y = layer(xt)
            y.square().sum().backward()
        outs.append((y.detach(), xt.grad, layer.weight.grad, layer.fp8_meta["scaling_fwd"].amax_history.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_csv_round_trip(tmp_path):
    layer = make_layer(5)
    te.enable_stats(layer)
    run_linear(layer, Float8CurrentScaling(), wide_range((16, 48), 6), wide_range((16, 32), 7))
    rows = te.stats(layer)
    path = tmp_path / "stats.csv"
    te.stats_to_csv(layer, path)
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert list(back[0]) == list(STATS_COLUMNS)
    assert len(back) == len(rows) == 3
    for got, want in zip(back, rows):
        assert got["role"] == want["role"] and int(got["casts"]) == want["casts"]
        for key in ("amax", "scale", "saturated", "underflow"):
            assert float(got[key]) == want[key]  # repr of a float round-trips exactly
    buffer = io.StringIO()
    te.stats_to_csv([dict(rows[0], step=7)], buffer)  # extra keys go after the standard columns
    assert buffer.getvalue().splitlines()[0] == ",".join(STATS_COLUMNS) + ",step"
    assert "grad_output" in te.format_stats(rows)


def test_a_format_change_starts_a_new_window():
    x = torch.from_numpy(wide_range((8, 8), 3))
    rs = RoleStats()
    one = torch.tensor(1.0)
    rs.record(x, te.quantize(x, torch.float8_e4m3fn, one), one)
    rs.record(x, te.quantize(x, torch.float8_e5m2, one), one)
    want = expected([x.numpy()], "e5m2", [1.0])
    assert_row(rs.row(), want, "e5m2")
