"""Collectives run by real processes under mpiexec, checked against numpy (tests/mpi_cases/collectives.py)."""
import os
import platform
import re

import pytest

from mpi_cases._launch import run_ok


def _checks(out):
    m = re.search(r"RESULT collectives\[\w+\]: (\d+) checks passed on (\d+) ranks \((\d+) results bitwise", out)
    assert m, f"no RESULT line in output:\n{out[-3000:]}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize("n,mode", [(1, "full"), (2, "full"), (3, "quick"), (5, "quick"), (8, "quick")])
def test_collectives_match_numpy_and_are_bitwise_identical(n, mode):
    out = run_ok(n, "collectives.py", mode, timeout=300 if n == 8 else 180)
    checks, ranks, identical = _checks(out)
    assert ranks == n
    if n > 1:
        assert "agreement shared-memory" in out   # one node: the agreement goes through shared memory
    if n == 8 and os.cpu_count() < 8 and platform.machine() == "x86_64":
        assert "waiting doorbell" in out          # oversubscribed: waiting ranks sleep on futex doorbells
    assert checks > 1000 * n ** 0.5      # the matrix really ran
    assert identical > 100               # results compared bitwise across ranks


def test_late_posted_receives_and_mpi_agreement():
    """With a tiny early-posting limit, receives with dependencies are posted late (directly into place);
    and the agreement runs as MPI_Iallreduce instead of through shared memory."""
    out = run_ok(3, "collectives.py", "quick", env={"DDL_EARLY_LIMIT": "16", "DDL_AGREEMENT": "mpi"})
    assert _checks(out)[1] == 3 and "agreement mpi" in out
