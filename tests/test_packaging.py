"""`python -m build` makes a wheel and an sdist that pass `twine check --strict`, hold every module of the package,
and install and work without the source tree (a smoke test in a fresh interpreter)."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import fp8kit

ROOT = pathlib.Path(__file__).parents[1]
SMOKE = """
import importlib.metadata, os, sys, torch
target = sys.argv[1]
import fp8kit, fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling
assert os.path.dirname(fp8kit.__file__).startswith(target), fp8kit.__file__
import fp8kit.cli, fp8kit.demo, fp8kit.integrations
(dist,) = importlib.metadata.distributions(name="fp8kit", path=[target])
assert dist.version == fp8kit.__version__ and dist.metadata["License-Expression"] == "Apache-2.0"
assert dist.entry_points.select(group="console_scripts")["fp8kit"].value == "fp8kit.cli:main"
torch.manual_seed(0)
layer, x = te.Linear(64, 32), torch.randn(16, 64)
with te.autocast(recipe=DelayedScaling()):
    y = layer(x)
error = ((y - (x @ layer.weight.T + layer.bias)).norm() / y.norm()).item()
assert 0 < error < 0.1, error
from fp8kit.pytorch import cpu_kernels
assert cpu_kernels.SOURCE.is_file() and str(cpu_kernels.SOURCE).startswith(target)  # shipped with the package
print("smoke ok", fp8kit.__version__)
"""


def run(*args, **kwargs):
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, args))}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """Built from a copy of the sources, so the checkout gets no build/ or egg-info."""
    pytest.importorskip("build")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fp8kit", src / "fp8kit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == len(sdists) == 1
    return wheels[0], sdists[0]


def test_twine_check(dist):
    pytest.importorskip("twine")
    out = run(sys.executable, "-m", "twine", "check", "--strict", *dist)
    assert out.count("PASSED") == 2


def test_wheel_holds_every_module(dist):
    wheel, _ = dist
    assert wheel.name == f"fp8kit-{fp8kit.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for ext in ("py", "c") for p in (ROOT / "fp8kit").rglob(f"*.{ext}")}
    assert sources <= names, sorted(sources - names)
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"fp8kit-{fp8kit.__version__}.dist-info/METADATA").decode()
    assert "Classifier: Programming Language :: Python :: 3" in metadata
    assert "Description-Content-Type: text/markdown" in metadata


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installs_and_runs_without_the_sources(dist, kind, tmp_path):
    """pip installs the artifact (the sdist through a wheel built from it) into an empty directory, without
    dependencies (torch and numpy come from this environment); a fresh interpreter outside the checkout imports it
    from there and trains a step in FP8."""
    artifact = dist[0] if kind == "wheel" else dist[1]
    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
        "--target", target, artifact)
    assert (target / "bin" / "fp8kit").is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = run(sys.executable, "-c", SMOKE, target, cwd=tmp_path, env=env)
    assert out.strip() == f"smoke ok {fp8kit.__version__}"
