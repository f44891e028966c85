"""`fp8kit bench --overhead`: the report's arithmetic and the command line (its speed is not tested here)."""

from __future__ import annotations

import pytest
import torch

from fp8kit import cli
from fp8kit.bench_overhead import bench_exit, format_overhead_report, run_overhead_bench
from fp8kit.pytorch import host


def test_quick_report_is_consistent():
    threads = torch.get_num_threads()
    report = run_overhead_bench(quick=True, rounds=1)
    assert torch.get_num_threads() == threads  # restored
    rows = {r["variant"]: r for r in report["modules"]}
    assert set(rows) == {"torch", "fp8kit current", "fp8kit delayed"}
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
