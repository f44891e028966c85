"""The examples run as scripts and print what they promise."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run(name):
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_delayed_scaling_example():
    out = run("pytorch_delayed_scaling.py")
    assert "forward scale:" in out
    scales = eval(out.split("forward scale:")[1].splitlines()[0])
    assert scales[0] != 1.0 and scales[1] != 1.0 and scales[2] == 1.0  # input and weight calibrated


def test_current_scaling_example():
    out = run("pytorch_current_scaling.py")
    error = float(out.rsplit(":", 1)[1])
    assert 0 < error < 0.06


@pytest.mark.parametrize("name", ["quickstart.py"])
def test_other_examples_run(name):
    assert "relative error" in run(name)
