"""`fp8kit bench --quick`: the report's structure and its arithmetic (ratios of the same run's medians, FLOP
counts, GB/s); peers that are not importable are skipped with a note. No timing is asserted."""

import json
import statistics

import pytest
import torch

from fp8kit import bench
from fp8kit.cli import main

SHAPES = [(16, 64, 64), (32, 48, 16), (32, 64, 32)]


@pytest.fixture(scope="module")
def report():
    return bench.run_bench("cpu", quick=True, rounds=2, shapes=SHAPES)


def test_linear_rows(report):
    names = {"torch bf16", "fp8kit current", "fp8kit delayed", "fp8kit current+stats", "fp8kit delayed+stats"}
    for shape in SHAPES:
        rows = {r["variant"]: r for r in report["linear"] if tuple(r["shape"]) == shape}
        assert names <= set(rows)
        base = rows["torch bf16"]["median_ms"]
        for r in rows.values():
            assert len(r["samples_ms"]) == 2 and r["median_ms"] == statistics.median(r["samples_ms"])
            assert r["vs_torch_bf16"] == r["median_ms"] / base
            m, k, n = shape
            assert r["tflops"] == pytest.approx(6 * m * k * n / (r["median_ms"] * 1e-3) / 1e12)


def test_block_recipes_run_where_the_shape_suits_them(report):
    """Float8 block scaling at every shape; MXFP8 and NVFP4 where M, K, N are multiples of 32, else a note."""
    for shape in SHAPES:
        measured = {r["variant"] for r in report["linear"] if tuple(r["shape"]) == shape}
        assert "fp8kit block" in measured
        suits = all(d % 32 == 0 for d in shape)
        for name in ("fp8kit mxfp8", "fp8kit nvfp4"):
            note = report["skipped"].get(f"{name} at {'x'.join(map(str, shape))}")
            assert (name in measured) == suits and (note is None) == suits
            assert suits or "multiples of 32" in note


def test_peers_are_run_or_skipped_with_a_note(report):
    measured = {r["variant"] for r in report["linear"]}
    for peer in ("torchao Float8Linear", "transformer_engine", "fp8kit current+triton", "fp8kit delayed+triton"):
        # skipped everywhere (not importable, cannot run) or at some shapes (too slow to time there)
        skipped = peer in report["skipped"] or any(k.startswith(f"{peer} at ") for k in report["skipped"])
        assert (peer in measured) or skipped
        assert not (peer in measured and peer in report["skipped"])
    for note in report["skipped"].values():
        assert note


def test_a_too_slow_variant_is_noted_not_timed(monkeypatch):
    import fp8kit.bench as fb

    monkeypatch.setattr(fb, "MAX_STEP_S", 0.0)
    monkeypatch.setattr(fb, "VARIANTS", fb.VARIANTS[:2])
    monkeypatch.setattr(fb, "BLOCK_VARIANTS", fb.BLOCK_VARIANTS[:1])
    monkeypatch.setattr(fb, "PEERS", [])
    rows, skipped = fb.bench_linear([(32, 32, 32)], torch.device("cpu"), 1, 1.0)
    assert {r["variant"] for r in rows} == {name for name, _ in fb.VARIANTS[:2]}
    assert "not timed" in skipped[f"{fb.BLOCK_VARIANTS[0][0]} at 32x32x32"]


def test_stats_cost_and_quantize(report):
    costs = report["stats_cost"]
    assert {(tuple(c["shape"]), c["recipe"]) for c in costs} == {(s, r) for s in SHAPES for r in ("current",
                                                                                                  "delayed")}
    for c in costs:
        assert c["ratio"] == c["on_ms"] / c["off_ms"]
    cases = {q["case"]: q for q in report["quantize"]}
    assert len(cases) == 3  # no Triton rows without CUDA
    copy = cases.pop("device copy (bf16 clone)")
    assert copy["gb_per_s"] == pytest.approx(copy["numel"] * 4 / (copy["median_ms"] * 1e-3) / 1e9)
    assert copy["vs_copy"] == pytest.approx(1.0)
    for q in cases.values():
        assert q["gb_per_s"] == pytest.approx(q["numel"] * 3 / (q["median_ms"] * 1e-3) / 1e9)
        assert q["vs_copy"] == pytest.approx(q["gb_per_s"] / copy["gb_per_s"])
    text = bench.format_report(report)
    assert "16x64x64" in text and "GB/s" in text and "emulated" in text


def test_cli_bench_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--rounds", "1", "--shape", "16x32x16", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Linear forward+backward" in out
    data = json.loads(path.read_text())
    assert {tuple(r["shape"]) for r in data["linear"]} == {(16, 32, 16)}
    assert data["quick"] is True and data["rounds"] == 1


def test_cpu_description_names_the_model_and_the_native_bf16_flags(tmp_path):
    from fp8kit.bench_common import device_description

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx512f avx512_bf16 amx_tile "
                    "amx_bf16\n\nprocessor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu\n")
    text = device_description(torch.device("cpu"), str(info))
    assert text == f"{torch.get_num_threads()} threads, Example CPU 9000, avx512_bf16 amx_bf16 amx_tile"
    info.write_text("model name\t: Plain CPU\nflags\t\t: fpu avx2\n")
    assert device_description(torch.device("cpu"), str(info)).endswith("Plain CPU, no native BF16 flags")
    assert "threads" in device_description(torch.device("cpu"), str(tmp_path / "missing"))
