"""`fp8kit bench --overhead`: the report's arithmetic and the command line (its speed is not tested here)."""

from __future__ import annotations

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit import cli
from fp8kit.bench_floor import FloorLinear
from fp8kit.bench_overhead import FLOOR, bench_exit, format_overhead_report, run_overhead_bench
from fp8kit.pytorch import host
from fp8kit.recipe import Float8CurrentScaling


def test_quick_report_is_consistent():
    threads = torch.get_num_threads()
    report = run_overhead_bench(quick=True, rounds=1)
    assert torch.get_num_threads() == threads  # restored
    rows = {r["variant"]: r for r in report["modules"]}
    assert set(rows) == {"torch", "fp8kit current", "fp8kit delayed", FLOOR, "current, host path",
                         "delayed, host path"}
    base = rows["torch"]
    for row in rows.values():
        assert row["forward_us"] > 0 and row["backward_us"] > 0
        assert row["ratio_forward"] == pytest.approx(row["forward_us"] / base["forward_us"])
        total = (row["forward_us"] + row["backward_us"]) / (base["forward_us"] + base["backward_us"])
        assert row["ratio_total"] == pytest.approx(total)
    assert {(r["recipe"], r["modules"]) for r in report["exit"]} >= {("current", 10), ("delayed, history 16", 50)}
    text = format_overhead_report(report)
    assert "LayerNorm" not in text and "fp8kit delayed" in text and "first alloc" in text


def test_exit_rows():
    """One row per recipe and module count, each a positive time."""
    with host.tensor_path():
        rows = bench_exit((3,), rounds=1)
    assert [r["modules"] for r in rows] == [3, 3, 3] and all(r["exit_us"] > 0 for r in rows)


def test_overhead_excludes_the_other_modes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--overhead", "--compile"])
    assert "--overhead" in capsys.readouterr().err


def test_linear_op_counts_rows():
    """`fp8kit bench --overhead` counts one Linear step's operations on both paths: torch's own count is the same
    on meta and CPU tensors, fp8kit's casts show up as more operations, and only the kernel rows launch kernels."""
    from fp8kit.bench_ops import linear_op_counts

    rows = {(r["path"], r["variant"]): r for r in linear_op_counts()}
    torch_ops = rows[("accelerator", "torch")]["ops"]
    assert torch_ops == rows[("cpu tensor path", "torch")]["ops"] > 0
    for (path, variant), row in rows.items():
        if variant != "torch":
            assert row["ops"] + row["launches"] > torch_ops, (path, variant, row)
        assert (row["launches"] > 0) == variant.endswith("kernels on"), (path, variant, row)
    text = format_overhead_report({"modules": [], "exit": [], "ops": list(rows.values())})
    assert "fp8kit current, kernels on" in text and "cpu tensor path" in text


@pytest.mark.parametrize("m,k,n", [(16, 64, 64), (40, 96, 48)])
def test_floor_runs_the_same_computation_as_fp8kit(m, k, n):
    """The floor row's module gives te.Linear's outputs and gradients under Float8CurrentScaling on the tensor path,
    bit for bit (so its time is the time of the same work), with NaN-free and NaN-holding gradients alike."""
    torch.manual_seed(m)
    lin, floor = te.Linear(k, n), FloorLinear(k, n)
    with torch.no_grad():
        floor.weight.copy_(lin.weight)
        floor.bias.copy_(torch.randn(n))
        lin.bias.copy_(floor.bias)
    x = torch.randn(m, k) * 3
    for g in (torch.randn(m, n), torch.randn(m, n).index_fill_(0, torch.tensor([1]), float("nan"))):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        lin.zero_grad()
        floor.zero_grad()
        with host.tensor_path():
            with te.autocast(recipe=Float8CurrentScaling()):
                y1 = lin(x1)
            y1.backward(g)
        y2 = floor(x2)
        y2.backward(g)
        pairs = ((y1, y2), (x1.grad, x2.grad), (lin.weight.grad, floor.weight.grad), (lin.bias.grad, floor.bias.grad))
        for a, b in pairs:
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_floor_dispatches_the_operations_of_fp8kit():
    """The floor row times the operations fp8kit's current-scaling Linear step dispatches on the CPU tensor path:
    the same operations, but for the transposed views fp8kit's storages make (two `t`) and the zero the floor's
    backward GEMMs start from (one `zeros`). A change of fp8kit's operations must be made in the floor too."""
    from collections import Counter

    from fp8kit.bench_ops import DispatchCounter

    x, dy = torch.randn(16, 64, requires_grad=True), torch.randn(16, 64)
    lin, floor = te.Linear(64, 64), FloorLinear(64, 64)

    def fp8kit_step():
        with te.autocast(recipe=Float8CurrentScaling()):
            y = lin(x)
        y.backward(dy)

    counts = []
    with host.tensor_path():
        for step in (fp8kit_step, lambda: floor(x).backward(dy)):
            for _ in range(3):
                step()
            with DispatchCounter() as counter:
                step()
            counts.append(Counter(counter.ops))
    ours, floors = counts
    assert ours - floors == Counter({"t": 2}) and floors - ours == Counter({"zeros": 1}), (ours, floors)


def test_kernels_off_rows_run_with_the_kernels_off(monkeypatch):
    """The rows that compare the Triton kernels' launches with the torch operations (on CUDA by default) run their
    steps with the kernels off and put the setting back."""
    from fp8kit import bench_overhead
    from fp8kit.pytorch import kernels

    seen = []
    real = bench_overhead._step

    def spying_step(stack, x, recipe):
        step = real(stack, x, recipe)

        def run():
            seen.append(kernels._enabled)
            return step()
        return run

    monkeypatch.setattr(bench_overhead, "_step", spying_step)
    before = kernels._enabled
    with host.tensor_path():
        rows = bench_overhead.bench_modules(("Linear",), modules=2, rounds=1, per_round=1, kernels_off_rows=True)
    variants = [r["variant"] for r in rows]
    assert "current, no kernels" in variants and "delayed, no kernels" in variants
    assert all(r["forward_us"] > 0 for r in rows)
    assert False in seen and kernels._enabled is before


def test_host_path_rows_run_on_the_host_path(monkeypatch):
    """On CPU tensors the Linear rows labelled "host path" run on the CPU's default path even inside the report's
    `tensor_path()`, and the other fp8kit rows stay on the tensor path."""
    from fp8kit import bench_overhead

    seen = {}
    real = bench_overhead._step

    def spying_step(stack, x, recipe):
        step = real(stack, x, recipe)

        def run():
            seen.setdefault(id(stack), set()).add(host.active(x.device))
            return step()
        return run

    monkeypatch.setattr(bench_overhead, "_step", spying_step)
    with host.tensor_path():
        rows = bench_overhead.bench_modules(("Linear",), modules=1, rounds=1, per_round=1)
        assert not host.active(torch.device("cpu"))  # the scope is back
    assert [r["variant"] for r in rows if "host path" in r["variant"]] == ["current, host path", "delayed, host path"]
    assert sorted(map(sorted, seen.values())) == [[False]] * 4 + [[True]] * 2  # torch, floor, 2 tensor, 2 host
    with host.tensor_path():  # off CUDA, not by default
        plain = bench_overhead.bench_modules(("Linear",), modules=1, rounds=1, per_round=1)
    assert not any("no kernels" in r["variant"] for r in plain)
