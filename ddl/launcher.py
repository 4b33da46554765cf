"""Which ``mpiexec`` ddl starts its own jobs with, and how to ask it for ranks on this machine.

Why
===
``ddl bench``, ``ddl topo probe``, the demo and the test suite start MPI jobs themselves, on this machine, often
with more ranks than it has cores. The launchers disagree on that: MPICH's hydra (and Intel MPI's)
starts any number of ranks, Open MPI's refuses more ranks than cores unless told ``--map-by
:OVERSUBSCRIBE``. ddl runs under whichever MPI mpi4py loaded (the ``mpich`` wheel by default, a
cluster's own otherwise: README, "Another MPI"), so it finds the launcher beside the Python it runs
(a virtual environment's MPI wheel), else on ``PATH``, and asks it which MPI it belongs to.
"""
import functools
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import Error

MPICH, OPEN_MPI, INTEL_MPI, UNKNOWN = "MPICH", "Open MPI", "Intel MPI", "unknown"

_SIGNATURES = (("(Open MPI)", OPEN_MPI), ("Intel(R) MPI", INTEL_MPI), ("HYDRA", MPICH))
"""What each launcher's ``--version`` says first (Intel MPI's hydra says HYDRA too: checked before)."""


def find_mpiexec():
    """The ``mpiexec`` beside this Python (an MPI wheel in its environment), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    path = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not path:
        raise Error("mpiexec not found: install an MPI (pip install mpich mpi4py), or put your "
                    "cluster's mpiexec on PATH")
    return path


@functools.lru_cache(maxsize=None)
def flavor(mpiexec):
    """Which MPI ``mpiexec`` belongs to: :data:`MPICH`, :data:`OPEN_MPI`, :data:`INTEL_MPI` or
    :data:`UNKNOWN` (from its ``--version``)."""
    try:
        said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    text = said.stdout + said.stderr
    return next((name for mark, name in _SIGNATURES if mark in text), UNKNOWN)


def local_command(nranks, mpiexec=None):
    """The argv that starts ``nranks`` ranks of a program on this machine (append the program):
    as many as asked, whatever the core count."""
    mpiexec = mpiexec or find_mpiexec()
    extra = ["--map-by", ":OVERSUBSCRIBE"] if flavor(mpiexec) == OPEN_MPI else []
    return [mpiexec, "-n", str(nranks), *extra]
