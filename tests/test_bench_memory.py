"""`fp8kit bench --memory`: the CPU peak measurement against known allocations, the byte counts against the model's
shapes, and the comparison of FP8 weights with bf16 weights (what fp8kit/bench_memory.py's docstring says it
measures). No absolute size is hard-coded: expectations come from the GPT's configuration."""

import json

import torch

import fp8kit.pytorch as te
from fp8kit.bench_memory import QUICK_CONFIG, cpu_peak_excess, tensor_bytes
from fp8kit.cli import main


def test_cpu_peak_counts_allocations_and_frees():
    def work():
        a = torch.empty(1000, 1000)  # 4,000,000 bytes
        b = torch.empty(500, 1000)  # 2,000,000 bytes: 6,000,000 live
        del a
        c = torch.empty(250, 1000)  # 3,000,000 live
        return b.numel() + c.numel()

    assert cpu_peak_excess(work) == 6_000_000


def test_tensor_bytes():
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3)(torch.randn(6, 8, dtype=torch.bfloat16))
    assert tensor_bytes(q) == 48 + 4  # FP8 bytes and the float32 scale_inv
    assert tensor_bytes(torch.zeros(6, 8, dtype=torch.bfloat16)) == 96 and tensor_bytes(None) == 0


def test_cli_memory_report(tmp_path, capsys):
    path = tmp_path / "memory.json"
    assert main(["bench", "--memory", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    assert "step peak" in capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    bf16, fp8 = rows["bf16 weights"], rows["FP8 weights (current)"]
    c, layers = QUICK_CONFIG["n_embd"], QUICK_CONFIG["n_layer"]
    weights = layers * 12 * c * c  # qkv 3C*C, proj C*C, fc 4C*C, proj 4C*C per block
    assert bf16["linear_weight_bytes"] == 2 * weights
    assert fp8["linear_weight_bytes"] == weights + 4 * 4 * layers  # one byte each, a float32 scale_inv per weight
    assert fp8["other_param_bytes"] == bf16["other_param_bytes"]
    params = bf16["param_bytes"] // 2  # every parameter is bf16 in the baseline
    for r in (bf16, fp8):  # float32 master + two moments per parameter; bf16 gradients
        assert r["optimizer_state_bytes"] == 12 * params and r["grad_bytes"] == 2 * params
    # the same FP8 operands are saved (up to how the float32 scale_invs are shared)
    assert abs(fp8["saved_for_backward_bytes"] - bf16["saved_for_backward_bytes"]) <= 2 * 4 * 4 * layers
    assert fp8["step_peak_bytes"] < bf16["step_peak_bytes"]
    assert bf16["step_peak_bytes"] > bf16["param_bytes"] + bf16["optimizer_state_bytes"] + bf16["grad_bytes"]
