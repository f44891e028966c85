import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# ---- JAX on a small CPU machine -----------------------------------------------------------------------------------
# The JAX tests spend most of their time in XLA's CPU compiler (the models are tiny; hundreds of small programs are
# compiled). Two settings, set here before jax starts and inherited by the subprocesses that tests start:
# * LLVM at -O0 (XLA's codegen optimisation level): compiles take about half as long. The HLO and its fusion are
#   unchanged; only the vectorisation of loops differs, which can change the order of float additions in reductions
#   (last-bit differences, as on a CPU with another vector width). The numerics tests must tolerate that anyway.
# * a persistent compilation cache in a fresh directory for this session: identical programs compiled by different
#   tests (new jit objects, example scripts in subprocesses) are compiled once.
# Set FP8KIT_TEST_XLA_DEFAULTS=1 to run with XLA's defaults instead.
_JAX_CACHE = None
if os.environ.get("FP8KIT_TEST_XLA_DEFAULTS") != "1":
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _JAX_CACHE = tempfile.mkdtemp(prefix="fp8kit-tests-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        if "jax" in sys.modules:  # imported before this file (a plugin): its config has read the environment already
            import jax

            jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
    if _JAX_CACHE:
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ---- multi-process checks (tests/dist_launch.py) ------------------------------------------------------------------

def _selected_checks(session, fixture):
    """The `check` parameters of the selected tests that use `fixture`, in collection order, the rule violations
    (tests/dist_workers_rules.py: errors on purpose) last."""
    checks = []
    for item in session.items:
        check = item.callspec.params.get("check") if hasattr(item, "callspec") else None
        if check and fixture in item.fixturenames and check not in checks:
            checks.append(check)
    # rule checks after the others (they break collectives on purpose); rule_peer_stops ends the processes: last
    return sorted(checks, key=lambda c: (c.startswith("rule_"), c == "rule_peer_stops"))


@pytest.fixture(scope="session")
def two_rank_run(request):
    """Every selected 2-rank check of the session, on one set of 2 local gloo processes (see dist_launch.py)."""
    from dist_launch import launch_checks

    return launch_checks(2, _selected_checks(request.session, "two_rank_run"))


@pytest.fixture(scope="session")
def four_rank_run(request):
    from dist_launch import launch_checks

    return launch_checks(4, _selected_checks(request.session, "four_rank_run"))


@pytest.fixture
def one_thread():
    """One intra-op thread and fp8kit's CPU kernels off: the conditions under which large 16-bit tensors take the
    table cast (CPU)."""
    import torch  # here: the JAX settings above come first

    from fp8kit.pytorch import cpu_kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with cpu_kernels.switched(False):
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_cpu_kernels():
    """fp8kit's CPU kernels off (fp8kit.pytorch.cpu_kernels): the torch operations' path."""
    from fp8kit.pytorch import cpu_kernels

    with cpu_kernels.switched(False):
        yield
