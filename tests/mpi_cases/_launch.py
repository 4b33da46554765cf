"""Launching the MPI case scripts from pytest: real processes under ``mpiexec``."""
import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ddl.errors import Error
from ddl.launcher import find_mpiexec, local_command

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent
try:
    MPIEXEC = find_mpiexec()        # the one ddl itself would start jobs with
except Error:
    MPIEXEC = None
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
_CACHE = None
_RANK_VARIABLES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_", "OMPI_FIRST_RANKS", "MPI_LOCAL")


def mpi_command(n):
    """The argv prefix that starts ``n`` ranks on this machine (skips the test without an mpiexec)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    return local_command(n, MPIEXEC)


def job_env(**extra):
    """This environment for a job of its own: without the variables that make a process an MPI rank
    (were pytest itself under mpiexec) and without ``DDL_TOPOLOGY``; settings for the launcher, such as
    Open MPI's ``OMPI_ALLOW_RUN_AS_ROOT`` or ``OMPI_MCA_*``, stay."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_RANK_VARIABLES) and k != "DDL_TOPOLOGY"}
    env.update(extra)
    return env


_LAUNCHER_REPORT = re.compile(r"^-{40,}\n.*?^-{40,}\n|^\[[^\]\n]*\] PMIX ERROR: .*\n", re.M | re.S)


def without_launcher_report(text):
    """A job's output without what the launcher adds on its own: Open MPI's ``mpiexec`` says in a
    frame of dashes that a rank exited with a nonzero status (MPICH's says nothing), and PMIx may
    complain of ranks that have gone. What is left is what the ranks said."""
    return _LAUNCHER_REPORT.sub("", text)


def plan_cache():
    """One plan cache for the whole pytest session: the first launch plans, later ones reuse."""
    global _CACHE
    if _CACHE is None:
        _CACHE = tempfile.mkdtemp(prefix="ddl-test-plans-")
        atexit.register(shutil.rmtree, _CACHE, True)
    return _CACHE


def run_mpi(n, script, *args, timeout=120, mpi4py_main=True, env=None):
    """Run ``script`` on ``n`` ranks; returns (returncode, combined output, seconds)."""
    path = script if os.path.isabs(script) else str(CASES / script) if (CASES / script).exists() else str(ROOT / script)
    cmd = [*mpi_command(n), sys.executable] + (["-m", "mpi4py"] if mpi4py_main else []) + [path, *map(str, args)]
    full_env = job_env(DDL_CACHE_DIR=plan_cache(), PYTHONUNBUFFERED="1", **(env or {}))
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
