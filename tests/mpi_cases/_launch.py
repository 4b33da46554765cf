"""Launching the MPI case scripts from pytest: real processes under ``mpiexec``."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent
MPIEXEC = shutil.which("mpiexec")
_CACHE = None


def plan_cache():
    """One plan cache for the whole pytest session: the first launch plans, later ones reuse."""
    global _CACHE
    if _CACHE is None:
        _CACHE = tempfile.mkdtemp(prefix="ddl-test-plans-")
        atexit.register(shutil.rmtree, _CACHE, True)
    return _CACHE


def run_mpi(n, script, *args, timeout=120, mpi4py_main=True, env=None):
    """Run ``script`` on ``n`` ranks; returns (returncode, combined output, seconds)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    path = script if os.path.isabs(script) else str(CASES / script) if (CASES / script).exists() else str(ROOT / script)
    cmd = [MPIEXEC, "-n", str(n), sys.executable] + (["-m", "mpi4py"] if mpi4py_main else []) + [path, *map(str, args)]
    full_env = dict(os.environ, DDL_CACHE_DIR=plan_cache(), PYTHONUNBUFFERED="1")
    full_env.pop("DDL_TOPOLOGY", None)
    full_env.update(env or {})
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (hang?); output:\n{out[-4000:]}")
    return proc.returncode, proc.stdout, time.monotonic() - t0


def run_ok(n, script, *args, **kw):
    rc, out, secs = run_mpi(n, script, *args, **kw)
    assert rc == 0, f"{script} on {n} ranks exited with {rc}:\n{out[-6000:]}"
    return out
