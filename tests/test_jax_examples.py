"""The JAX examples in examples/ run (as subprocesses, side by side) and print what they promise."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["jax_current_scaling.py", "jax_delayed_scaling.py", "jax_delayed_scaling_distributed.py"]


@pytest.mark.slow
def test_jax_examples_run():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    # the distributed example sets its own device count; other flags (tests/conftest.py) stay
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    procs = {
        name: subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", name)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in EXAMPLES
    }
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, f"{name} failed:\n{stdout}\n{stderr}"
        out[name] = stdout

    error = float(re.search(r"relative error of the FP8 output=([\d.]+)%", out["jax_current_scaling.py"]).group(1))
    assert 0.01 < error < 10.0

    # delayed scaling: the x scale follows the growing activations, 448 / amax of the window
    lines = re.findall(r"x amax=([\d.]+)\s+x scale=([\d.]+)", out["jax_delayed_scaling.py"])
    assert len(lines) == 5
    amaxes = [float(a) for a, _ in lines]
    scales = [float(s) for _, s in lines]
    assert amaxes == sorted(amaxes) and scales == sorted(scales, reverse=True)
    assert abs(scales[-1] - 448.0 / amaxes[-1]) < 1e-3 * scales[-1]

    assert "identical scales on all 4 devices" in out["jax_delayed_scaling_distributed.py"]
