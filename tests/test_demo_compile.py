"""`fp8kit demo --compile`: with the aot_eager backend (the graphs run by torch's own kernels) the compiled runs give
the eager runs' losses bit for bit: every training loss, every validation loss, the final losses and, under delayed
scaling, every step's amaxes and scales. (inductor generates its own float32 reductions, so its losses agree only
within rounding; not tested here: its cold compile of the model takes minutes on a small CPU.)"""

import json

import pytest
import torch._dynamo

from fp8kit.cli import main

SMALL = ["--steps", "6", "--eval-interval", "3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size",
         "16", "--batch-size", "4", "--max-chars", "20000", "--no-progress"]


def run(tmp_path, name, recipes, *extra):
    out = tmp_path / name
    assert main(["demo", "--recipes", recipes, "--out", str(out), *SMALL, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def compare(tmp_path, recipes, capsys):
    eager = run(tmp_path, "eager", recipes)
    torch._dynamo.reset()
    compiled = run(tmp_path, "compiled", recipes, "--compile", "--compile-backend", "aot_eager")
    assert "torch.compile (backend aot_eager)" in capsys.readouterr().out
    assert compiled["config"]["compile"] is True and compiled["config"]["compile_backend"] == "aot_eager"
    assert eager["config"]["compile"] is False
    for e, c in zip(eager["runs"], compiled["runs"], strict=True):
        assert c["recipe"] == e["recipe"]
        assert c["curves"] == e["curves"]  # training and validation losses, bit for bit
        assert (c["final_train_loss"], c["final_val_loss"]) == (e["final_train_loss"], e["final_val_loss"])
        assert c["compile_s"] > 0 and c["tokens_per_s"] > 0 and "compile_s" not in e
        assert c["stats"] == []  # statistics count casts in Python: off when compiled
        if "delayed_trace" in e:
            assert c["delayed_trace"] == e["delayed_trace"]
    return eager, compiled


def test_compiled_demo_gives_the_eager_losses(tmp_path, capsys):
    eager, _ = compare(tmp_path, "current", capsys)
    assert eager["runs"][0]["stats"]  # the eager run kept its statistics


@pytest.mark.slow
def test_compiled_demo_gives_the_eager_losses_bf16_and_delayed(tmp_path, capsys):
    """Delayed scaling: two compiles (the first call registers the FP8 states), updates inside the graph."""
    compare(tmp_path, "bf16,delayed", capsys)
