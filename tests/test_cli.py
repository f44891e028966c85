"""The `fp8kit` command: help for every subcommand, one-line usage errors with status 2, the entry point."""

import pathlib
import subprocess
import sys

import pytest

from fp8kit.cli import build_parser, main

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fp8kit")
    if argv[0] == "demo":
        for option in ("--steps", "--recipes", "--device", "--out", "--seed", "--size", "--n-layer", "--n-embd",
                       "--n-head", "--block-size", "--batch-size", "--compile", "--compile-backend"):
            assert option in out
    if argv[0] == "bench":
        assert "--quick" in out and "--json" in out and "--compile" in out and "--compile-backend" in out


BAD = [
    ([], "fp8kit: error: the following arguments are required: COMMAND"),
    (["frobnicate"], "fp8kit: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["demo", "--steps", "0"], "fp8kit demo: error: argument --steps: expected a positive integer, got '0'"),
    (["demo", "--steps", "ten"], "fp8kit demo: error: argument --steps: expected a positive integer"),
    (["demo", "--recipes", "bf16,fp4"], "fp8kit demo: error: argument --recipes: expected a comma list"),
    (["demo", "--recipes", "bf16,bf16"], "fp8kit demo: error: argument --recipes: a recipe is listed twice"),
    (["demo", "--recipes", "bf16,nvfp4", "--n-embd", "48", "--n-head", "4"],
     "fp8kit demo: error: nvfp4 quantizes blocks of 32 (MXFP8) or 16 values"),
    (["demo", "--recipes", "mxfp8", "--batch-size", "3", "--block-size", "10"],
     "fp8kit demo: error: mxfp8 quantizes blocks"),
    (["demo", "--size", "huge"], "fp8kit demo: error: argument --size: invalid choice: 'huge'"),
    (["demo", "--n-embd", "30", "--n-head", "4"], "fp8kit demo: error: n_embd (30) must be a multiple of n_head"),
    (["demo", "--device", "tpu"], "fp8kit demo: error: argument --device:"),
    (["demo", "--lr", "-1"], "fp8kit demo: error: argument --lr: expected a positive number"),
    (["demo", "--corpus", "/nonexistent/dir"], "fp8kit demo: error: argument --corpus:"),
    (["demo", "--unknown"], "fp8kit: error: unrecognized arguments: --unknown"),
    (["bench", "--shape", "1x2"], "fp8kit bench: error: argument --shape: expected MxKxN"),
    (["bench", "--rounds", "0"], "fp8kit bench: error: argument --rounds: expected a positive integer"),
    (["bench", "--compile", "--memory"], "fp8kit bench: error: argument --compile: not allowed with argument --memory"),
    (["bench", "--compile-backend", "tvm"], "fp8kit bench: error: argument --compile-backend: invalid choice: 'tvm'"),
    (["demo", "--compile-backend", "tvm"], "fp8kit demo: error: argument --compile-backend: invalid choice: 'tvm'"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_arguments_give_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(message), captured.err


def test_python_dash_m_runs_the_same_command():
    result = subprocess.run([sys.executable, "-m", "fp8kit", "demo", "--steps", "-3"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "fp8kit demo: error: argument --steps: expected a positive integer, got '-3'"
    result = subprocess.run([sys.executable, "-m", "fp8kit", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("fp8kit ")


@pytest.mark.skipif(tomllib is None, reason="needs tomllib (Python 3.11+)")
def test_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["fp8kit"] == "fp8kit.cli:main"
    assert "matplotlib" in " ".join(project["optional-dependencies"]["demo"])


def test_every_subcommand_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"demo", "bench"}
    for name, subparser in sub.choices.items():
        for action in subparser._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_demo_recipe_names_are_the_demos_recipes():
    from fp8kit.cli import DEFAULT_RECIPES, RECIPE_NAMES
    from fp8kit.demo.train import RECIPES

    assert RECIPE_NAMES == tuple(RECIPES)
    assert set(DEFAULT_RECIPES) <= set(RECIPE_NAMES)
