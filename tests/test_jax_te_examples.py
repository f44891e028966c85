"""TE's JAX getting-started guide (examples/te_jax_getting_started.py) runs all its steps, and flax's lm1b model
(examples/flax_lm1b.py) trains in FP8 when only its `nn` namespace changes (issues 17 and 18)."""

import csv
import os
import re
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")
import flax.linen  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8kit.jax as te  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import flax_lm1b  # noqa: E402


@pytest.mark.slow
def test_getting_started_guide_runs_every_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "te_jax_getting_started.py")], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    labels = re.findall(r"^(\w+): mean time [\d.]+ ms$", result.stdout, re.M)
    assert labels == ["baseline", "te_unfused", "te_unfused_attn", "te_unfused_fp8", "te_fused_fp8",
                      "te_transformer_layer"]
    with open(tmp_path / "getting_started_jax_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["Implementation"] for r in rows][-1] == "TE TransformerLayer + FP8" and len(rows) == 6
    difference = float(re.search(r"relative difference ([\d.]+)", result.stdout).group(1))
    assert 1e-3 < difference < 0.1  # FP8, but close to high precision


@pytest.mark.slow
def test_lm1b_model_swaps_its_dense_layers_by_namespace():
    """The same model code under flax.linen and fp8_linen(): identical parameters from the same key, and the FP8
    model owns FP8 state for every Dense (fp8_metas) and attention projection (_overwrite_with_gradient)."""
    config = flax_lm1b.TransformerConfig(emb_dim=32, qkv_dim=32, mlp_dim=64, num_layers=1, max_len=16)
    tokens = jnp.asarray(flax_lm1b.markov_data(0, 1, 2, 16)[0][0])
    high = flax_lm1b.build_lm(flax.linen)(config).init(jax.random.PRNGKey(0), tokens)
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        fp8 = flax_lm1b.build_lm(flax_lm1b.fp8_linen())(config).init(jax.random.PRNGKey(0), tokens)
    assert set(high) == {"params"} and set(fp8) == {"params", "fp8_metas", "_overwrite_with_gradient"}
    assert jax.tree.structure(fp8["params"]) == jax.tree.structure(high["params"])
    for a, b in zip(jax.tree.leaves(fp8["params"]), jax.tree.leaves(high["params"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    block = fp8["fp8_metas"]["encoderdecoderblock_0"]["MlpBlock_0"]
    assert set(block) == {"Dense_0", "Dense_1"} and "x_scale" in block["Dense_0"]  # flax's names: te_flax.Dense
    attention = fp8["_overwrite_with_gradient"]["encoderdecoderblock_0"]["MultiHeadDotProductAttention_0"]
    assert set(attention) == {"query", "key", "value", "out"}
    assert set(fp8["fp8_metas"]) == {"encoderdecoderblock_0", "logitdense"}


@pytest.mark.slow
def test_lm1b_trains_in_fp8_like_high_precision():
    config = flax_lm1b.TransformerConfig(emb_dim=64, qkv_dim=64, mlp_dim=128, num_layers=1)
    kw = dict(steps=40, config=config, batch=8, length=32)
    high, high_eval, _, _ = flax_lm1b.train(flax.linen, fp8=False, **kw)
    fp8, fp8_eval, _, variables = flax_lm1b.train(flax_lm1b.fp8_linen(), fp8=True, **kw)
    assert np.mean(high[-5:]) < high[0] - 0.2  # it learns
    assert abs(np.mean(fp8[-5:]) - np.mean(high[-5:])) < 0.05 and abs(fp8_eval - high_eval) < 0.05
    scales = [float(s[0]) for path, s in jax.tree_util.tree_leaves_with_path(variables["fp8_metas"])
              if jax.tree_util.keystr(path).endswith("x_scale']")]
    assert scales and all(s != 1.0 for s in scales)  # the FP8 state was updated through the wrapped optimizer
