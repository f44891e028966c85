"""Every fenced `python` and `bash` block of README.md and docs/*.md.

Python blocks run (those of one file in order, in one namespace, in a temporary directory) unless they are listed
in FRAGMENTS with the reason they cannot run as written; fragments must still compile. Shell commands are checked
without running them (`fp8kit ...` parses with the real argument parser, files named on the line exist, pip
extras are declared, pytest markers exist), and the cheap ones in RUN also run. The README's two set-up commands
are checked to use separate environments, and .ci/run to run the README's test command.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from fp8kit.cli import build_parser

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = pathlib.Path(__file__).parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SHELL = {"bash", "sh", "shell", "console"}

# (file, start of the block's first line) -> why it cannot run as written. Keep it short: a block that can run, should.
FRAGMENTS = {
    ("docs/distributed.md", "import fp8kit.pytorch as te"):
        "needs an initialised process group (`group`), a `model` and an input `x`",
    ("docs/distributed.md", "model = DistributedDataParallel(model)"): "needs torch.distributed and a `model`",
    ("docs/kernels.md", "# forward"): "Linear's GEMM code paraphrased (needs the layer's `plan`, `x`, `weight`, `dy`)",
    ("docs/jax.md", "recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)"):
        "continues the first block and uses `jax`, `jnp` without importing them",
    ("docs/jax.md", "recipe = DelayedScaling(amax_history_len=1024, amax_compute_algo=\"max\")"):
        "a training step that needs `key`, `x`, `loss_fn` and an optax `optimizer`",
    ("docs/jax.md", "grad_fn = jax.jit(te.deferred_update()(jax.grad(loss_fn)))"):
        "needs `loss_fn`, `variables` and `microbatches`",
    ("docs/jax.md", "mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2)"):
        "needs 4 JAX devices and a `model`, `x` (tests/test_jax_mesh_transformer.py runs it)",
    ("docs/pytorch.md", "with te.quantized_model_init(enabled=True"): "needs the reader's `build_model()`",
    ("docs/pytorch.md", "with te.quantized_model_init(recipe=recipe"):
        "needs torch.distributed with a device mesh, `build_model()`, `rank`, `world_size` (tests/test_fsdp_fp8.py)",
}
# Shell commands cheap enough to run here (seconds).
RUN = {"fp8kit bench --quick"}
# Shell commands whose first word is not fp8kit/python/pip/pytest and that are checked only for the files they name.
PLACEHOLDER_FILES = {"train.py"}  # docs/kernels.md: "FP8KIT_TRITON=1 python train.py", the reader's own script


def blocks():
    """(file, line, language, code) of every fenced block with a language."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            start, lang = i + 1, m.group(1)
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if lang:
                found.append((str(path.relative_to(ROOT)), start + 1, lang, "\n".join(lines[start:i])))
            i += 1
    return found


def first_line(code):
    return next(line for line in code.splitlines() if line.strip())


def fragment(file, code):
    """The FRAGMENTS reason for this block, or None."""
    return next((why for (f, start), why in FRAGMENTS.items() if f == file and first_line(code).startswith(start)),
                None)


PYTHON = [b for b in blocks() if b[2] == "python"]
COMMANDS = [(f, n, cmd) for f, n, lang, code in blocks() if lang in SHELL
            for cmd in (re.sub(r"(^|\s)#.*$", "", line).strip() for line in code.splitlines()) if cmd]


def test_the_blocks_are_found():
    files = {f for f, *_ in PYTHON}
    assert {"README.md", "docs/pytorch.md", "docs/stats.md", "docs/integrations.md"} <= files
    assert any("fp8kit demo" in c for _, _, c in COMMANDS)
    stale = [key for key in FRAGMENTS if not any(fragment(f, code) == FRAGMENTS[key] for f, _, _, code in PYTHON)]
    assert not stale, f"FRAGMENTS entries that match no block: {stale}"


FILES = sorted({f for f, *_ in PYTHON})


@pytest.mark.parametrize("file", FILES)
def test_python_blocks(file, tmp_path, monkeypatch):
    """The file's blocks run in order in one namespace, as a reader would paste them one after the other."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    namespace = {"__name__": "__main__"}
    skipped = []
    try:
        for f, line, _, code in PYTHON:
            if f != file:
                continue
            compiled = compile(code, f"{file}:{line}", "exec")  # fragments too must at least be valid Python
            reason = fragment(file, code)
            if reason:
                skipped.append(f"{file}:{line}: {reason}")
                continue
            exec(compiled, namespace)
    finally:
        torch.set_num_threads(threads)
    if skipped:
        pytest.skip("ran the others; fragments: " + "; ".join(skipped))


def commands_of(cmd):
    """The simple commands of a line (split at && and ;), as argv lists without VAR=value prefixes."""
    out = []
    for part in re.split(r"&&|;", cmd):
        argv = shlex.split(part)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def extras():
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("file,line,cmd", COMMANDS, ids=[f"{f}:{n}:{c[:40]}" for f, n, c in COMMANDS])
def test_shell_command(file, line, cmd):
    for argv in commands_of(cmd):
        word = argv[0]
        if word == "fp8kit":
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit as e:
                pytest.fail(f"{file}:{line}: `{' '.join(argv)}` does not parse (exit {e.code})")
        elif word in ("python", "python3") and argv[1:2] != ["-m"]:
            script = argv[1]
            assert script in PLACEHOLDER_FILES or (ROOT / script).is_file(), f"{file}:{line}: no {script}"
        elif word == "pip" and tomllib is not None:
            for spec in argv[2:]:
                m = re.match(r"^\.?\[([\w,]+)\]$", spec.replace('"', ""))
                if m:
                    assert set(m.group(1).split(",")) <= extras(), f"{file}:{line}: undeclared extra in {spec}"
        elif word == "pytest" and "-m" in argv:
            marker = argv[argv.index("-m") + 1]
            assert re.search(rf"^\s+{marker}:", (ROOT / "pytest.ini").read_text(), re.M), marker
    if cmd in RUN:
        env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{file}:{line}: `{cmd}` failed:\n{result.stderr[-2000:]}"


def readme_setup():
    """The README's fenced bash commands: the demo's set-up, then the tests'."""
    return [cmd for f, _, cmd in COMMANDS if f == "README.md"]


def test_readme_set_ups_use_separate_environments():
    demo, tests = readme_setup()
    venvs = [re.search(r"python -m venv (\S+)", cmd).group(1) for cmd in (demo, tests)]
    assert venvs[0] != venvs[1], "the second set-up would reuse the first one's environment"
    for cmd, venv in zip((demo, tests), venvs):
        assert f". {venv}/bin/activate" in cmd
        assert re.match(r"^\.venv(/|$)", venv), f"{venv} is not covered by .gitignore's .venv/"
    assert "fp8kit demo" in demo and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    _, tests = readme_setup()
    assert tests in script.splitlines()
