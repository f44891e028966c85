"""`fp8kit bench --compile --quick`: rows for every variant in both modes, ratios recomputed from the same run's
medians (compiled against the compiled bf16 baseline, eager against the eager one, compiled against eager), compile
counts and times reported apart; the CLI flags. No timing is asserted.

Both workloads compile with the "eager" backend (dynamo only): the cost of these tests is tracing fp8kit's Python,
which the report's structure does not depend on; the demo GPT's step is the slow case."""

import json
import statistics

import pytest
import torch._dynamo

from fp8kit import bench_compile
from fp8kit.cli import build_parser, main

SHAPE = (16, 32, 16)
VARIANTS = ["torch bf16", "fp8kit current", "fp8kit delayed"]
PEER = "torchao Float8Linear"


@pytest.fixture(scope="module")
def report():
    torch._dynamo.reset()
    return bench_compile.run_compile_bench("cpu", quick=True, rounds=2, shapes=[SHAPE], backend="eager",
                                           workloads=("linear",))


def check_rows(rows, skipped, rounds):
    by = {(r["variant"], r["mode"]): r for r in rows}
    for kind in VARIANTS:
        assert (kind, "eager") in by and (kind, "compiled") in by, kind
    for mode in ("eager", "compiled"):  # torchao: measured or skipped with a note, per mode
        assert ((PEER, mode) in by) != (PEER in skipped or f"{mode} {PEER}" in skipped)
    for (kind, mode), r in by.items():
        assert len(r["samples_ms"]) == rounds and all(s > 0 for s in r["samples_ms"])
        assert r["median_ms"] == statistics.median(r["samples_ms"]) > 0
        assert r["vs_bf16"] == r["median_ms"] / by[("torch bf16", mode)]["median_ms"]
        if mode == "compiled":
            assert r["vs_eager"] == r["median_ms"] / by[(kind, "eager")]["median_ms"]
            assert r["graphs"] >= 1 and r["compile_s"] >= 0 and r["warmup_calls"] >= 3
            assert r["graphs_compiled_while_timing"] == 0
        else:
            assert r["vs_eager"] is None and "compile_s" not in r
    # the delayed recipe's cold start: the first call registers the FP8 states, the second compiles again
    graphs = {kind: by[(kind, "compiled")]["graphs"] for kind in VARIANTS}
    assert graphs["fp8kit delayed"] == graphs["fp8kit current"] + 1 == graphs["torch bf16"] + 1
    return by


def test_linear_rows(report):
    assert report["compile"] is True and report["backend"] == "eager" and report["gpt_step"] == []
    by = check_rows(report["linear"], report["skipped"], 2)
    m, k, n = SHAPE
    for r in by.values():
        assert r["shape"] == list(SHAPE)
        assert r["tflops"] == pytest.approx(6 * m * k * n / (r["median_ms"] * 1e-3) / 1e12)
    text = bench_compile.format_compile_report(report)
    assert "16x32x16" in text and "compile s" in text and "emulated_mm" in text
    for kind, r in by.items():
        if kind[1] == "compiled":
            line = next(line for line in text.splitlines() if line.startswith("16x32x16") and kind[0] in line)
            assert f"{r['vs_bf16']:.2f}x" in line and f"{r['vs_eager']:.2f}x" in line


def test_flags_parse():
    args = build_parser().parse_args(["bench", "--compile", "--quick", "--compile-backend", "aot_eager"])
    assert args.compile and args.quick and args.compile_backend == "aot_eager"
    args = build_parser().parse_args(["bench"])
    assert not args.compile and args.compile_backend == "inductor"
    args = build_parser().parse_args(["demo", "--compile"])
    assert args.compile and args.compile_backend == "inductor"
    with pytest.raises(ValueError, match="backend must be one of"):
        bench_compile.run_compile_bench(backend="cudagraphs")


def test_cli_writes_the_report(report, tmp_path, capsys, monkeypatch):
    """`fp8kit bench --compile` passes its options through, prints the report and writes it as JSON (the report of
    the fixture stands in for a second run)."""
    calls = []
    monkeypatch.setattr(bench_compile, "run_compile_bench", lambda *a, **k: calls.append(a) or report)
    path = tmp_path / "bench.json"
    assert main(["bench", "--compile", "--quick", "--rounds", "2", "--shape", "16x32x16", "--compile-backend",
                 "eager", "--device", "cpu", "--json", str(path)]) == 0
    assert calls == [("cpu", True, 2, [SHAPE], "eager")]
    assert capsys.readouterr().out.strip() == bench_compile.format_compile_report(report)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))


@pytest.mark.slow
def test_gpt_step_rows():
    """The demo GPT's training step (one small layer): the same rows, and tokens/s from the batch's tokens."""
    torch._dynamo.reset()
    data = bench_compile.run_compile_bench("cpu", quick=True, rounds=2, backend="eager", workloads=("gpt",))
    assert data["gpt_config"] == bench_compile.QUICK_GPT_CONFIG and data["linear"] == []
    by = check_rows(data["gpt_step"], data["skipped"], 2)
    tokens = data["gpt_config"]["batch_size"] * data["gpt_config"]["block_size"]
    for r in by.values():
        assert r["tokens_per_s"] == pytest.approx(tokens / (r["median_ms"] * 1e-3))
    text = bench_compile.format_compile_report(data)
    assert "demo GPT training step" in text and "FP8 / bf16 time, demo GPT step" in text
