"""The launcher of the multi-process checks in tests/dist_workers.py (runs in the pytest process).

`launch(world_size, checks)` starts `world_size` copies of dist_workers.py (torchrun-like environment variables, a
free port on 127.0.0.1), each running the named checks in order, and returns every rank's results. A worker stops at
its first unexpected failure (later collectives could be misaligned); the launcher kills all workers at a hard
timeout. `launch_checks` starts the processes again for the checks after a failure.

The test files do not launch themselves: they use the session fixtures `two_rank_run` and `four_rank_run` of
tests/conftest.py, which start the processes once for every selected check of that world size in the session
(starting them costs seconds on a small machine; the checks themselves take fractions of one).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "dist_workers.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, checks, timeout: float = 90.0) -> dict:
    """Run `checks` on `world_size` local processes. Returns {"ranks": [per-rank {check: result}], "logs": [...],
    "seconds": wall time, "returncodes": [...]}; a result is {"ok": bool, "error": str, "seconds": float}."""
    out = tempfile.mkdtemp(prefix="fp8kit_dist_")
    port = _free_port()
    procs, logs = [], []
    start = time.time()
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank), LOCAL_RANK=str(rank), FP8KIT_TEST_OUT=out, OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, WORKERS, ",".join(checks)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(HERE)))
    first_exit = None
    while time.time() - start < timeout:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes):  # one rank failed: the others get a short grace period
            first_exit = first_exit or time.time()
            if time.time() - first_exit > 15:
                break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for log in logs:
        log.close()
    ranks, texts = [], []
    for rank in range(world_size):
        path = os.path.join(out, f"result{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {})
        texts.append(open(os.path.join(out, f"log{rank}.txt")).read())
    shutil.rmtree(out, ignore_errors=True)
    return {"ranks": ranks, "logs": texts, "seconds": time.time() - start,
            "returncodes": [p.returncode for p in procs]}


def launch_checks(world_size: int, checks, timeout_per_check: float = 15.0) -> dict:
    """`launch` once for all `checks` when they pass. A failure stops the workers, so the checks after it are launched
    again in new processes: every check still gets its own result. Returns {"by_check": {check: the run it ran in}},
    which `check_result` accepts like a run."""
    by_check, remaining = {}, list(checks)
    while remaining:
        run = launch(world_size, remaining, timeout=60.0 + timeout_per_check * len(remaining))
        got = [c for c in remaining if any(c in ranks for ranks in run["ranks"])]  # a prefix: results come in order
        if not got:  # nothing ran at all (the start failed, or the first check hung or crashed): no retry
            got = remaining
        for c in got:
            by_check[c] = run
        remaining = remaining[len(got):]
    return {"by_check": by_check}


def check_result(run: dict, check: str) -> None:
    """Assert that every rank ran `check` successfully, with the workers' output in the message if not."""
    if "by_check" in run:
        run = run["by_check"][check]
    problems = []
    for rank, results in enumerate(run["ranks"]):
        res = results.get(check)
        if res is None:
            problems.append(f"rank {rank}: no result (return code {run['returncodes'][rank]})\n"
                            + run["logs"][rank][-3000:])
        elif not res["ok"]:
            problems.append(f"rank {rank}: {res['error']}")
    assert not problems, f"check {check!r} failed:\n" + "\n".join(problems)
