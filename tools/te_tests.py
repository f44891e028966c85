"""Run Transformer Engine's own PyTorch tests against fp8kit and count what passes.

    python tools/te_tests.py --te /work/te --out results/ [--sample 4] [--timeout 20] [--files test_recipe.py ...]
                             [--block]

The selected test files of a TE checkout (tests/pytorch) and the helpers they import are copied into a temporary
directory, changed only by the mechanical rewrite rules below, and run with pytest (one process per file, the
code under test taken from --pythonpath, default this repository). The output directory gets summary.md (counts
per file, failures grouped by cause), one <file>.md per test file (each failing case with its first error line),
and results.json (every case). No TE code is part of this repository: the files are read from the checkout given.

Rewrite rules (regular expressions, applied in this order to every copied file):
  Imports
    I1  `transformer_engine.common.recipe`   -> `fp8kit.recipe`
    I2  `transformer_engine.common`          -> `fp8kit`   (`from transformer_engine.common import recipe`)
    I3  `transformer_engine.pytorch.module`  -> `fp8kit.pytorch.modules`   (fp8kit's name for the package)
    I4  `transformer_engine.pytorch`         -> `fp8kit.pytorch`
    I5  `transformer_engine` (whole word)    -> `fp8kit`
        `transformer_engine_torch` (TE's C++ extension, `tex`) is left as it is; see Placeholders.
  CUDA -> CPU
    C1  the string literals "cuda", 'cuda', "cuda:N"                       -> "cpu"
    C2  `.cuda()`                                                          -> `.cpu()`
    C3  `torch.cuda.X` for X in synchronize, current_stream, stream, Stream, Event, current_device, device_count
                                                                           -> `torch.cpu.X`
    C4  `torch.cuda.X` for X in manual_seed, manual_seed_all, get_rng_state, set_rng_state -> `torch.X`
    C5  `torch.cuda.get_device_capability()` and `get_device_compute_capability()` -> `(0, 0)`
        (a CPU has no compute capability; cases gated on a GPU generation take their "no GPU" branch)
    C6  `.is_cuda` -> `.is_cpu` (device assertions: the tensors now live on the CPU)
  Every other `torch.cuda.*` call (CUDA graphs, memory statistics) is left as it is: on a CPU it raises, and the case
  is reported as out of scope (GPU-only).

Placeholders (tools/te_tests_plugin.py, the conftest.py of the run): a module the tests import that fp8kit lacks
(`fp8kit.pytorch.quantization`, ...) becomes a placeholder module, and a name the tests use that an fp8kit module
lacks is answered by a placeholder, so that a missing name fails only the cases that use it. Using a placeholder
(calling it, iterating it, subclassing it, isinstance against it) raises `MissingName` (a failure, in scope), or,
out of scope, `TEInternal` for the internals listed in INTERNAL_MODULES and `BlockRecipe` for names of the block
recipes (MXFP8Quantizer, ...). `tex.DType` (TE's C++ enum, which TE re-exports as `te.DType`) is given as
`fp8kit.pytorch.DType` (TEX_ALIASES). Two kinds of placeholder act instead of raising: calling a
block recipe class (MXFP8BlockScaling, ...) gives a placeholder recipe whose cases are not run (out of scope), and
`FP8GlobalStateManager.reset()` does nothing (TE's tests call it to clear TE's process-global FP8 state between
cases; fp8kit keeps none of that kind). Two test-support helpers that the tests use only to initialise weights,
`init_method_normal(sigma)` and `scaled_init_method_normal(sigma, num_layers)` (from TE's pytorch.utils), are given
plugin versions when fp8kit lacks them (normal initialisation with std sigma, and sigma / sqrt(2 * num_layers)).

Scope: counted apart from the in-scope cases are the cases of the block recipes (a block-recipe placeholder among
the parameters, or MXFP8/NVFP4/block scaling in the test id or in a skip reason), cases that raise `TEInternal`,
cases whose error says that CUDA is absent (GPU-only torch calls, torch's "dummy base class" CUDA classes), and cases
that fp8kit refuses with a NotImplementedError naming a block recipe (a block-recipe feature not built).

`--block` puts the block recipes in scope: their cases are run and counted like the others, a missing block-recipe
name is a MissingName, and fp8kit's NotImplementedError naming a block recipe and TE's skips naming one are counted
in scope (failed, skipped). Without it the scope is as above.

Files in subfolders of tests/pytorch (`nvfp4/test_nvfp4_gemm_exact.py`) are copied to the same subfolder; with every
selected file come the modules next to it that it imports (`nvfp4_utils.py`, `test_float8_current_scaling_exact.py`).

Sampling: `--sample N` keeps at most N in-scope cases of each test function: the first N by a hash of the test id,
so the choice is deterministic and spread over the parameter product. Cases on TE's large model configs (126m: 12
layers, 2048 tokens) are taken only when a function has fewer than N other cases, and then at most
`--sample-large` of them. `--timeout S` fails a case after S seconds (reported as "timeout"); a case stuck inside
one long torch call is stopped at 2S + 5 s by ending its pytest process, and the file goes on in a new process that
skips the cases already recorded.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

DEFAULT_FILES = ["test_sanity.py", "test_numerics.py", "test_grouped_linear.py", "test_quantized_tensor.py",
                 "test_cuda_graphs.py", "test_recipe.py", "test_fused_optimizer.py"]
HELPERS = ["utils.py", "references"]  # copied (and rewritten) when present; test files import them

IMPORT_RULES = [
    ("I1", r"\btransformer_engine\.common\.recipe\b", "fp8kit.recipe"),
    ("I2", r"\btransformer_engine\.common\b", "fp8kit"),
    ("I3", r"\btransformer_engine\.pytorch\.module\b", "fp8kit.pytorch.modules"),
    ("I4", r"\btransformer_engine\.pytorch\b", "fp8kit.pytorch"),
    ("I5", r"\btransformer_engine\b", "fp8kit"),
]
_TO_CPU = "synchronize|current_stream|stream|Stream|Event|current_device|device_count"
_TO_TORCH = "manual_seed_all|manual_seed|get_rng_state|set_rng_state"
CUDA_RULES = [
    ("C1", r"""(["'])cuda(:\d+)?\1""", r'"cpu"'),
    ("C2", r"\.cuda\(\)", ".cpu()"),
    ("C3", rf"\btorch\.cuda\.({_TO_CPU})\b", r"torch.cpu.\1"),
    ("C4", rf"\btorch\.cuda\.({_TO_TORCH})\b", r"torch.\1"),
    ("C5", r"\b(?:torch\.cuda\.get_device_capability|get_device_compute_capability)\(\)", "(0, 0)"),
    ("C6", r"\.is_cuda\b", ".is_cpu"),
]
RULES = IMPORT_RULES + CUDA_RULES

INTERNAL_MODULES = ["transformer_engine_torch", "fp8kit.pytorch.cpp_extensions",
                    # queries for TE's grouped-GEMM kernel path, and that module's autograd function
                    "fp8kit.pytorch.modules.grouped_linear.is_module_grouped_tensor_path_supported",
                    "fp8kit.pytorch.modules.is_module_grouped_tensor_path_supported",
                    "fp8kit.pytorch.modules.grouped_linear._GroupedLinear",
                    "fp8kit.pytorch.attention.dot_product_attention.utils",
                    "fp8kit.pytorch.attention.dot_product_attention._attention_backends",
                    "fp8kit.pytorch.tensor.grouped_tensor", "fp8kit.pytorch.modules._split_quantization",
                    # TE's second, operation-based API (te.ops): out of scope for fp8kit (docs/pytorch.md)
                    "fp8kit.pytorch.ops"]
BLOCK_RECIPES = ["MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"]
BLOCK_PATTERN = r"mxfp8|nvfp4|fp4|block_?scaling|blockwise|fp8_block"
GPU_ONLY_PATTERN = (r"Torch not compiled with CUDA|CUDA driver|No CUDA GPUs|Found no NVIDIA driver|"
                    r"cuda.*not available|CUDA is not available|no CUDA|device='cuda'|CUDA error|"
                    r"Tried to instantiate dummy base class|"  # torch's CUDA classes in a build without CUDA
                    r"\b0 active drivers\b")  # Triton kernels (TE's reference GEMM) with no GPU driver
# fp8kit's refusal of a block-recipe feature (NotImplementedError naming the recipe): out of scope as block recipe
BLOCK_REFUSAL_PATTERN = r"\b(?:MXFP8BlockScaling|Float8BlockScaling|NVFP4BlockScaling)\b"
NOOPS = ["FP8GlobalStateManager.reset"]
TEX_ALIASES = {"DType": "fp8kit.pytorch.DType"}  # TE re-exports tex.DType as te.DType
LARGE_PATTERN = r"\b126m\b"  # TE's 12-layer, 2048-token model configs: minutes per case on a CPU


def rewrite(text: str) -> tuple[str, Counter]:
    """The rewritten source and how often each rule fired."""
    fired = Counter()
    for name, pattern, replacement in RULES:
        text, n = re.subn(pattern, replacement, text)
        fired[name] += n
    return text, fired


def _analyse(sources: list[str]) -> tuple[list[str], list[str]]:
    """The fp8kit module paths the sources import and every name they import or take as an attribute."""
    modules, names = set(), set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp8kit"):
                modules.add(node.module)
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                modules.update(a.name for a in node.names if a.name.startswith("fp8kit"))
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
    return sorted(modules), sorted(names)


def sibling_imports(path: Path) -> list[Path]:
    """The modules next to `path` that it imports by plain name (`from nvfp4_utils import ...`), transitively."""
    found, todo = [], [path]
    while todo:
        try:
            tree = ast.parse(todo.pop().read_text())
        except (SyntaxError, OSError):
            continue
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                sibling = path.parent / (name.split(".")[0] + ".py")
                if sibling.exists() and sibling != path and sibling not in found:
                    found.append(sibling)
                    todo.append(sibling)
    return found


def prepare(te_root: Path, files: list[str], work: Path, block: bool = False) -> dict:
    """Copy and rewrite the test files and helpers into `work`; return the rules' counts per file."""
    src = te_root / "tests" / "pytorch"
    fired, sources = {}, []
    targets = [src / f for f in files] + [src / h for h in HELPERS if (src / h).exists()]
    targets += [s for f in files for s in sibling_imports(src / f) if s not in targets]
    for path in targets:
        paths = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for p in paths:
            rel = p.relative_to(src)
            out = work / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            text, counts = rewrite(p.read_text())
            out.write_text(text)
            fired[str(rel)] = dict(counts)
            sources.append(text)
    modules, names = _analyse(sources)
    modules = [m for m in modules if not (work / (m.split(".")[0] + ".py")).exists()]
    config = {"imported_modules": modules, "used_names": names, "internal_modules": INTERNAL_MODULES,
              "block_recipes": BLOCK_RECIPES, "block_pattern": BLOCK_PATTERN, "gpu_only_pattern": GPU_ONLY_PATTERN,
              "block_refusal_pattern": BLOCK_REFUSAL_PATTERN,
              "noops": NOOPS, "large_pattern": LARGE_PATTERN, "tex_aliases": TEX_ALIASES, "block_in_scope": block}
    (work / "te_harness.json").write_text(json.dumps(config, indent=1))
    shutil.copy(Path(__file__).with_name("te_tests_plugin.py"), work / "conftest.py")
    (work / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return fired


HARD_TIMEOUT_EXIT = 3  # te_tests_plugin.py: a case was stopped; the rest of the file runs in a new process


def run_file(work: Path, name: str, args, report: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), args.pythonpath]),
               OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), PYTHONDONTWRITEBYTECODE="1")
    done = work / (name + ".done")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rN", "--no-header", name,
           f"--te-sample={args.sample}", f"--te-sample-large={args.sample_large}", f"--te-timeout={args.timeout}",
           f"--te-report={report}", f"--te-done={done}"] + (["-k", args.k] if args.k else [])
    start, restarts = time.monotonic(), 0
    while True:
        left = args.file_timeout - (time.monotonic() - start)
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=max(left, 1))
            tail, rc = proc.stdout[-3000:] + proc.stderr[-2000:], proc.returncode
        except subprocess.TimeoutExpired as err:
            tail, rc = f"file timed out after {args.file_timeout} s\n{(err.stdout or b'')[-2000:]!r}", "timeout"
        if rc != HARD_TIMEOUT_EXIT or restarts >= args.max_restarts:
            break
        restarts += 1  # resume after the stopped case: skip every case already recorded
        _, cases = load(report)
        done.write_text("\n".join(c["nodeid"] for c in cases) + "\n")
    return {"file": name, "rc": rc, "seconds": round(time.monotonic() - start, 1), "tail": tail,
            "restarts": restarts}


def load(report: Path) -> tuple[dict, list[dict]]:
    collection, cases = {"collect_errors": []}, []
    if report.exists():
        for line in report.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "collection":
                collection.update(record)
            elif record["kind"] == "collect_error":
                collection["collect_errors"].append(record)
            else:
                cases.append(record)
    return collection, cases


def cause(line: str) -> str:
    """A failure's cause: exception type and the start of its message, numbers and quoted names masked."""
    line = re.sub(r"0x[0-9a-f]+", "0x…", line or "")
    line = re.sub(r"(?<![A-Za-z_\d.])\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
    return line[:110]


def count(cases: list[dict]) -> Counter:
    c = Counter()
    for case in cases:
        key = case["outcome"] if case["scope"] == "in" else "out_of_scope"
        if key in ("failed", "error") and (case["line"] or "").startswith("MissingName"):
            key = "missing"
        c[key] += 1
    return c


COLUMNS = ["passed", "failed", "missing", "error", "timeout", "skipped"]


def write_results(out: Path, per_file: dict, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Transformer Engine's PyTorch tests on fp8kit ({meta['label']})", "",
             f"Made by `{meta['command']}` on {meta['date']}, {meta['machine']}; fp8kit at {meta['code']}.",
             "Counts are of the cases run (in scope, sampled): at most "
             f"{meta['sample'] or 'all'} per test function, {meta['timeout']} s per case. " +
             ("block recipes in scope (--block); " if meta.get("block") else "") +
             "\"block\" = cases of the block recipes not run; \"out\" = cases that reached a TE internal or a "
             "GPU-only call; \"skipped\" = TE's own skips. See docs/te_tests.md.", "",
             "\"missing\" = failures because fp8kit lacks a name the test uses (MissingName); \"failed\" = the "
             "other failures of the test body, \"error\" = failures in fixtures. pass % = passed / (passed + "
             "failed + missing + error + timeout).", "",
             "| file | collected | block | in scope | run | passed | failed | missing | error | timeout | skipped "
             "| out | pass % | s |", "|---" * 14 + "|"]
    totals, causes = Counter(), defaultdict(list)
    for name, (info, collection, cases) in per_file.items():
        c = count(cases)
        ran = sum(c[k] for k in COLUMNS[:-1])
        row = {"collected": collection.get("collected", 0), "block": collection.get("out_of_scope_block", 0),
               "in scope": collection.get("in_scope", 0), "run": len(cases), **{k: c[k] for k in COLUMNS},
               "out": c["out_of_scope"]}
        totals.update(row)
        rate = f"{100 * c['passed'] / ran:.0f}" if ran else "-"
        status = f" (collection error: {collection['collect_errors'][0]['line']})" if collection["collect_errors"] \
            else ("" if "collected" in collection else f" (no collection: rc {info['rc']})")
        lines.append(f"| {name}{status} | " + " | ".join(str(v) for v in row.values()) + f" | {rate} | "
                     f"{info['seconds']} |")
        for case in cases:
            if case["scope"] == "in" and case["outcome"] in ("failed", "error", "timeout"):
                causes[cause(case["line"])].append((name, case["nodeid"]))
        _write_file_report(out, name, info, collection, cases)
    ran = sum(totals[k] for k in COLUMNS[:-1])
    rate = f"{100 * totals['passed'] / ran:.0f}" if ran else "-"
    lines.append("| **total** | " + " | ".join(str(totals[k]) for k in
                 ["collected", "block", "in scope", "run", *COLUMNS, "out"]) + f" | {rate} | |")
    lines += ["", "## In-scope failures by cause (exception type and message start, numbers masked)", "",
              "| cases | cause | files | example |", "|---|---|---|---|"]
    for key, members in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        files = ", ".join(sorted(Counter(f for f, _ in members)))
        example = members[0][1].replace("|", "\\|")
        lines.append(f"| {len(members)} | `{key.replace('|', '/')}` | {files} | `{example}` |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    everything = {name: {"run": info, "collection": collection, "cases": cases}
                  for name, (info, collection, cases) in per_file.items()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "files": everything}, indent=1))


def _write_file_report(out: Path, name: str, info: dict, collection: dict, cases: list[dict]) -> None:
    lines = [f"# {name}", "", f"pytest exit status {info['rc']}, {info['seconds']} s.", ""]
    bad = [c for c in cases if c["scope"] == "in" and c["outcome"] in ("failed", "error", "timeout")]
    lines += [f"## In-scope failures ({len(bad)})", ""]
    for case in sorted(bad, key=lambda c: (cause(c["line"]), c["nodeid"])):
        lines.append(f"- `{case['nodeid']}` {case['outcome']}: {case['line']}")
    out_cases = [c for c in cases if c["scope"] == "out"]
    lines += ["", f"## Out of scope, reached while running ({len(out_cases)})", ""]
    lines += [f"- `{c['nodeid']}`: {c['reason']}" for c in out_cases]
    skipped = Counter(c["reason"] for c in cases if c["scope"] == "in" and c["outcome"] == "skipped")
    lines += ["", "## TE's own skips (reason: cases)", ""]
    lines += [f"- {n}: {reason}" for reason, n in skipped.most_common()]
    lines += ["", f"## Block-recipe cases not run ({collection.get('out_of_scope_block', 0)})", ""]
    lines += [f"- `{n}`" for n in collection.get("block_cases", [])[:200]]
    if "collected" not in collection or collection["collect_errors"]:
        lines += ["", "## pytest output (tail)", "", "```", info["tail"], "```"]
    (out / (name.removesuffix(".py").replace("/", "__") + ".md")).write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--te", default="/work/te", help="a Transformer Engine checkout")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--sample", type=int, default=3, help="cases kept per test function (0: all)")
    parser.add_argument("--sample-large", type=int, default=1,
                        help="of those, cases on TE's large model configs (126m) kept per test function")
    parser.add_argument("--timeout", type=float, default=15.0,
                        help="seconds per case (a case still inside one torch call at 2x+5 s stops its process)")
    parser.add_argument("--max-restarts", type=int, default=40, help="stopped cases per file before giving up")
    parser.add_argument("--file-timeout", type=float, default=900.0, help="seconds per test file")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the runs")
    parser.add_argument("--pythonpath", default=str(Path(__file__).resolve().parents[1]),
                        help="where fp8kit is imported from")
    parser.add_argument("--label", default="", help="a title for summary.md")
    parser.add_argument("-k", default=None, help="passed to pytest -k")
    parser.add_argument("--block", action="store_true",
                        help="run and count the block recipes' cases (MXFP8, Float8BlockScaling, NVFP4) in scope")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="te-tests-"))
    try:
        fired = prepare(Path(args.te), args.files, work, block=args.block)
        per_file = {}
        for name in args.files:
            report = work / (name + ".jsonl")
            info = run_file(work, name, args, report)
            collection, cases = load(report)
            per_file[name] = (info, collection, cases)
            c = count(cases)
            print(f"{name}: {dict(c)} in {info['seconds']} s", flush=True)
        git = subprocess.run(["git", "-C", args.pythonpath, "describe", "--always", "--dirty"],
                             capture_output=True, text=True).stdout.strip()
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        meta = {"label": args.label or out.name, "command": "python tools/te_tests.py " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{cpu}, {os.cpu_count()} "
                f"cores, OMP_NUM_THREADS={args.threads}", "code": f"{args.pythonpath} ({git})",
                "sample": args.sample, "timeout": args.timeout, "block": args.block, "rules_fired": fired}
        write_results(out, per_file, meta)
        print(f"wrote {out}/summary.md")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
