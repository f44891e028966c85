"""Transformer Engine's FP8 primer (per-tensor cells) and its quantized_model_init example, ported with only the
imports renamed, CUDA moved to the CPU and the sizes shrunk (examples/te_fp8_primer.py,
examples/te_quantized_model_init.py). The primer's outputs are checked against tests/reference.py (NumPy + ml_dtypes)
and float64, as the notebook describes them."""

import importlib.util
import pathlib
import re

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te

import reference as ref
from linear_helpers import assert_gemm_close, np32

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"fp8kit_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cast_to_representable_is_the_reference_cast():
    primer = load("te_fp8_primer")
    x = torch.randn(16, 32) * 3
    for fmt, scale in (("e4m3", 1.0), ("e5m2", 4.0)):
        got = primer.cast_to_representable(x, scale=scale, fp8_format=fmt)
        q, inv = ref.cast(np32(x), fmt, scale)
        assert np.array_equal(np32(got), ref.dequantize(q, fmt, inv))


def test_fp8_primer(capsys):
    primer = load("te_fp8_primer")
    out = primer.main()
    printed = capsys.readouterr().out
    assert printed.count("tensor(") == 4  # cells 12, 13, 15 and 17 display their tensors
    out_fp8, out_fp32, representable = out["out_fp8"], out["out_fp32"], out["out_fp32_representable"]
    # "relatively close, but different": the FP8 forward against the float32 one
    error = ((out_fp8 - out_fp32).norm() / out_fp32.norm()).item()
    assert 0 < error < 0.05, error
    # "This time the difference is really small": with FP8-representable inputs and weights (the first delayed-scaling
    # step casts with scale 1) the two agree to float32 accumulation
    gap = (out_fp8 - representable).abs().max().item()
    assert gap <= 1e-5 * out_fp32.abs().max().item() and gap < (out_fp8 - out_fp32).abs().max().item() / 100
    # and the FP8 output is the GEMM of the reference-cast operands (float64)
    torch.manual_seed(12345)  # cell 7's weights and input, rebuilt
    layer = te.Linear(256, 256, bias=True)
    inp = torch.rand((256, 256))
    x_q, x_inv = ref.cast(np32(inp), "e4m3", 1.0)
    a = ref.dequantize(x_q, "e4m3", x_inv).astype(np.float64)
    w_q, w_inv = ref.cast(np32(layer.weight), "e4m3", 1.0)
    b = ref.dequantize(w_q, "e4m3", w_inv).astype(np.float64).T
    assert_gemm_close(out_fp8 - layer.bias.detach(), a @ b, a, b, 2.0 ** -24)


@pytest.mark.skipif(not hasattr(te, "TransformerLayer"),
                    reason="TE's quantized_model_init example builds te.TransformerLayer, which fp8kit does not have "
                           "on this branch yet")
def test_quantized_model_init_example(capsys):
    load("te_quantized_model_init").main()
    printed = capsys.readouterr().out
    assert "All assertions passed!" in printed
    losses = [float(v) for v in re.findall(r"Step \d+: loss = ([0-9.]+)", printed)]
    assert len(losses) == 5 and losses[-1] < losses[0]
