"""pytest plugin for tools/te_tests.py: installed as conftest.py next to the ported Transformer Engine test files.

It does four things, all described in tools/te_tests.py's docstring:
1. Placeholders for names the ported tests import and fp8kit lacks (missing modules, missing attributes of fp8kit
   modules, TE's C++ extension `transformer_engine_torch`), so that one missing name fails the cases that use it
   instead of the whole file.
2. Sampling: `--te-sample N` keeps at most N cases of each test function (deterministic, spread over the
   parameter space by a hash of the test id).
3. Scope: cases of the block recipes (MXFP8, Float8BlockScaling, NVFP4) are not run (unless --block); cases that
   fail in TE internals (placeholders of `tex` and TE's C++ wrappers) or in GPU-only torch calls are reported as out
   of scope.
4. A per-case timeout (`--te-timeout S`, SIGALRM) and one JSON line per case in `--te-report FILE`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import signal
import sys
import threading
import types

import pytest
import torch

_CONFIG = json.load(open(os.path.join(os.path.dirname(__file__), "te_harness.json")))

# Module paths (after renaming) whose names are TE internals: C++ kernels and their wrappers, attention-backend
# selection, the grouped-GEMM storage. fp8kit has no equivalent on purpose; cases that reach them are out of scope.
_INTERNAL_PREFIXES = tuple(_CONFIG["internal_modules"])
# Placeholders that act instead of failing (see tools/te_tests.py, "Placeholders").
_BLOCK_RECIPES = set(_CONFIG["block_recipes"])
_NOOPS = set(_CONFIG["noops"])
# --block: the block recipes are in scope (their cases run, their missing names and refusals count as failures)
_BLOCK_IN_SCOPE = bool(_CONFIG.get("block_in_scope", False))


def _normal_init(std: float):
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=std)


# Test-support helpers: TE's tests use them only to build inputs. When fp8kit lacks them, the placeholder calls these
# (initialisation from N(0, sigma), and N(0, sigma / sqrt(2 * num_layers)) for the scaled variant).
_SUPPORT = {
    "init_method_normal": lambda sigma: _normal_init(sigma),
    "scaled_init_method_normal": lambda sigma, num_layers: _normal_init(sigma / math.sqrt(2.0 * num_layers)),
}
_BLOCK_WORDS = re.compile(_CONFIG["block_pattern"], re.IGNORECASE)
_GPU_ONLY = re.compile(_CONFIG["gpu_only_pattern"])
_BLOCK_REFUSAL = re.compile(_CONFIG["block_refusal_pattern"])
_LARGE = re.compile(_CONFIG["large_pattern"])
HARD_TIMEOUT_EXIT = 3  # the exit status of a run stopped by the watchdog (tools/te_tests.py resumes it)


_COLLECTING = [True]


class MissingName(Exception):
    """A name the TE tests use that fp8kit does not have (in scope: counted as a failure)."""


class TEInternal(Exception):
    """A TE internal (C++ kernel or its wrapper) with no fp8kit equivalent (out of scope)."""


class BlockRecipe(Exception):
    """A name of the block recipes (MXFP8, FP8 block scaling, NVFP4: out of scope)."""


class CaseTimeout(Exception):
    """The case ran longer than --te-timeout."""


def _internal(name: str) -> bool:
    return name.startswith(_INTERNAL_PREFIXES)


class Missing:
    """Stands for `name`, which fp8kit lacks. Attribute access gives another placeholder; calling raises, except
    for the block recipes (their instances mark a case out of scope) and the listed no-ops."""

    def __init__(self, name: str, instance: bool = False):
        object.__setattr__(self, "_te_name", name)
        object.__setattr__(self, "_te_instance", instance)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._te_name}.{attr}", self._te_instance)

    def __call__(self, *args, **kwargs):
        short = self._te_name.rsplit(".", 1)[-1]
        if short in _BLOCK_RECIPES and not self._te_instance and not _BLOCK_IN_SCOPE:
            return Missing(self._te_name + "()", instance=True)
        if any(self._te_name.endswith(n) for n in _NOOPS):
            return None
        if short in _SUPPORT and not self._te_instance:
            return _SUPPORT[short](*args, **kwargs)
        if _COLLECTING[0]:  # a module-level call (a parametrize list): fail the cases that use the result instead
            return Missing(self._te_name + "()", instance=True)
        self._fail()

    def _fail(self):
        te_name = self._te_name.replace("fp8kit.pytorch", "transformer_engine.pytorch")
        if _internal(self._te_name):
            raise TEInternal(f"TE internal {te_name}")
        if _BLOCK_WORDS.search(self._te_name.rsplit(".", 1)[-1]) and not _BLOCK_IN_SCOPE:
            raise BlockRecipe(f"block-recipe name {te_name}")
        raise MissingName(f"fp8kit has no {self._te_name}")

    def __instancecheck__(self, obj):  # isinstance(x, placeholder)
        self._fail()

    def __subclasscheck__(self, cls):
        self._fail()

    def __iter__(self):
        self._fail()

    def __getitem__(self, key):  # a missing mapping or enum (TE_DType[...])
        self._fail()

    def __mro_entries__(self, bases):
        self._fail()

    def __repr__(self):
        return f"<fp8kit lacks {self._te_name}>"


def _install_placeholders() -> None:
    """Missing modules become placeholder modules; fp8kit modules get a `__getattr__` answering the names the tests
    use and the module lacks."""
    names = set(_CONFIG["used_names"])
    for path in _CONFIG["imported_modules"]:
        try:
            importlib.import_module(path)
        except ImportError:
            _placeholder_module(path)
    for path, module in list(sys.modules.items()):
        if (path == "fp8kit" or path.startswith("fp8kit.")) and isinstance(module, types.ModuleType):
            _add_fallback(module, names)


def _placeholder_module(path: str) -> None:
    module = types.ModuleType(path)
    module.__file__ = None
    module.__path__ = []  # a package, so that submodules can be placeholders too
    module.__getattr__ = lambda attr, _p=path: _missing_attr(_p, attr)
    sys.modules[path] = module
    parent, _, child = path.rpartition(".")
    if parent:
        if parent not in sys.modules:
            try:
                importlib.import_module(parent)
            except ImportError:
                _placeholder_module(parent)
        parent_module = sys.modules[parent]
        if not isinstance(getattr(parent_module, child, None), types.ModuleType):
            try:
                setattr(parent_module, child, module)
            except (AttributeError, TypeError):
                pass


def _missing_attr(module_path: str, attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return Missing(f"{module_path}.{attr}")


def _add_fallback(module: types.ModuleType, names: set) -> None:
    previous = module.__dict__.get("__getattr__")
    if getattr(previous, "_te_fallback", False):
        return

    def fallback(attr, _module=module, _previous=previous):
        if _previous is not None:
            try:
                return _previous(attr)
            except AttributeError:
                pass
        if attr in names and not attr.startswith("__"):
            return Missing(f"{_module.__name__}.{attr}")
        raise AttributeError(f"module {_module.__name__!r} has no attribute {attr!r}")

    fallback._te_fallback = True
    module.__getattr__ = fallback


_install_placeholders()
sys.modules["transformer_engine_torch"] = types.ModuleType("transformer_engine_torch")
sys.modules["transformer_engine_torch"].__getattr__ = lambda attr: _missing_attr("transformer_engine_torch", attr)
for _name, _target in _CONFIG["tex_aliases"].items():  # TE's own re-exports of tex names, given fp8kit's
    _module, _, _attr = _target.rpartition(".")
    setattr(sys.modules["transformer_engine_torch"], _name, getattr(importlib.import_module(_module), _attr))


# ---- options, sampling, scope ---------------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--te-sample", type=int, default=0, help="keep at most N cases per test function (0: all)")
    parser.addoption("--te-timeout", type=float, default=0, help="seconds per case (0: none)")
    parser.addoption("--te-report", default=None, help="write one JSON line per case here")
    parser.addoption("--te-sample-large", type=int, default=1,
                     help="keep at most N cases per test function whose id names a large model config")
    parser.addoption("--te-done", default=None, help="a file of test ids already run (a resumed run skips them)")


def _placeholders(value, depth=0) -> list:
    """The placeholders among a parameter value (looking into lists, tuples and dicts); a block recipe that fp8kit
    has counts as the placeholder of its class."""
    if isinstance(value, Missing):
        return [value]
    if type(value).__name__ in _BLOCK_RECIPES and not _BLOCK_IN_SCOPE:
        return [Missing(type(value).__name__ + "()", instance=True)]
    if depth < 3 and isinstance(value, (list, tuple)):
        return [m for v in value for m in _placeholders(v, depth + 1)]
    if depth < 3 and isinstance(value, dict):
        return [m for v in value.values() for m in _placeholders(v, depth + 1)]
    return []


def _param_placeholders(item) -> list:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [m for v in params.values() for m in _placeholders(v)]


def _contains_block_recipe(value) -> bool:
    return any(m._te_name.rsplit(".", 1)[-1].rstrip("()") in _BLOCK_RECIPES for m in _placeholders(value))


def _block_reason(item) -> str | None:
    if _BLOCK_IN_SCOPE:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(_contains_block_recipe(v) for v in params.values()) or _BLOCK_WORDS.search(item.nodeid):
        return "out of scope: block recipe (MXFP8 / Float8BlockScaling / NVFP4)"
    return None


def _sample_key(nodeid: str) -> str:
    return hashlib.sha1(nodeid.encode()).hexdigest()


@pytest.hookimpl(trylast=True)  # after pytest's own -k / -m deselection: sample and count the selected cases
def pytest_collection_modifyitems(config, items):
    _COLLECTING[0] = False
    config._te_counts = {"collected": len(items)}
    out_of_scope, in_scope = [], []
    for item in items:
        reason = _block_reason(item)
        (out_of_scope if reason else in_scope).append((item, reason))
    groups = {}
    for item, _ in in_scope:
        groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    limit, large_limit = config.getoption("--te-sample"), config.getoption("--te-sample-large")
    keep = []
    for members in groups.values():
        if limit:
            members = sorted(members, key=lambda it: _sample_key(it.nodeid))
            small = [it for it in members if not _LARGE.search(it.nodeid)]
            large = [it for it in members if _LARGE.search(it.nodeid)]
            members = small[:limit] + large[:max(0, min(large_limit, limit - len(small)))]
        keep.extend(members)
    kept = set(id(it) for it in keep)
    config._te_counts.update(out_of_scope_block=len(out_of_scope), in_scope=len(in_scope), sampled=len(keep))
    done_file = config.getoption("--te-done")
    done = set(open(done_file).read().splitlines()) if done_file and os.path.exists(done_file) else set()
    items[:] = [it for it in items if id(it) in kept and it.nodeid not in done]
    if not done:  # the first run of this file
        _write(config, {"kind": "collection", **config._te_counts,
                        "block_cases": [it.nodeid for it, _ in out_of_scope]})


def _write(config, record) -> None:
    path = config.getoption("--te-report")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _on_alarm(signum, frame):
    raise CaseTimeout("case exceeded the per-case timeout")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    for placeholder in _param_placeholders(item):  # a parameter made at collection from a missing name
        placeholder._fail()


def pytest_collectreport(report):
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        error = next((ln[2:].strip() for ln in text if ln.startswith("E ")), text[-1] if text else "?")
        _write(_SESSION[0].config, {"kind": "collect_error", "nodeid": report.nodeid, "line": error[:300]})


_SESSION = [None]


def pytest_sessionstart(session):
    _SESSION[0] = session


def _hard_timeout(item, seconds):
    """A case stuck in one long torch call (SIGALRM waits for the next Python instruction): record it and end the
    process; the driver runs the rest of the file in a new one."""
    _write(item.config, {"kind": "case", "nodeid": item.nodeid, "outcome": "timeout", "scope": "in", "reason": None,
                         "line": f"CaseTimeout: still running after {seconds:.0f} s (stopped)", "duration": seconds})
    os._exit(HARD_TIMEOUT_EXIT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("--te-timeout")
    watchdog = None
    if seconds:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        watchdog = threading.Timer(2 * seconds + 5, _hard_timeout, args=(item, 2 * seconds + 5))
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    finally:
        if seconds:
            watchdog.cancel()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _first_line(excinfo) -> str:
    text = f"{excinfo.typename}: {excinfo.value}".strip()
    return text.splitlines()[0][:300] if text else excinfo.typename


def _out_of_scope(excinfo) -> str | None:
    if excinfo.errisinstance(TEInternal):
        return "out of scope: TE internal"
    if excinfo.errisinstance(BlockRecipe):
        return "out of scope: block recipe"
    message = str(excinfo.value)
    if excinfo.errisinstance(NotImplementedError) and _BLOCK_REFUSAL.search(message) and not _BLOCK_IN_SCOPE:
        return "out of scope: block recipe"
    if _GPU_ONLY.search(message):
        return "out of scope: GPU-only"
    return None


def _is_timeout(exc: BaseException) -> bool:
    """The case's error is the per-case timeout, also when a library caught it and raised its own error from it
    (torch.compile reports an alarm that fires while it compiles as BackendCompilerFailed / InternalTorchDynamoError,
    with the CaseTimeout as its cause or in its message)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CaseTimeout) or f"{CaseTimeout.__name__}: " in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "inner_exception", None)
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    record = getattr(item, "_te_record", None)
    if record is None:
        record = item._te_record = {"kind": "case", "nodeid": item.nodeid, "outcome": "passed", "scope": "in",
                                    "reason": None, "line": None, "duration": 0.0}
    record["duration"] += call.duration
    if call.excinfo is not None and report.outcome != "skipped" and record["outcome"] == "passed":
        scope = _out_of_scope(call.excinfo)
        line = _first_line(call.excinfo)
        if scope:
            record.update(outcome="skipped", scope="out", reason=f"{scope}: {line}")
            report.outcome = "skipped"
            report.longrepr = (str(item.path), 0, f"{scope}: {line}")
        else:
            timeout = _is_timeout(call.excinfo.value)
            kind = "timeout" if timeout else ("failed" if call.when == "call" else "error")
            record.update(outcome=kind, line=line, when=call.when)
    elif report.outcome == "skipped" and record["outcome"] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        block = _BLOCK_WORDS.search(reason or "") and not _BLOCK_IN_SCOPE
        record.update(outcome="skipped", scope="out" if block else "in", reason=reason)
    if call.when == "teardown":
        _write(item.config, record)
