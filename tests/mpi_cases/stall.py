"""Stall watchdog: a rank that sleeps past stall_timeout is named in a StallError on the others.

    mpiexec -n N python tests/mpi_cases/stall.py     (N >= 2)

Scenario 1 (agreement phase): the last rank sleeps before calling Allreduce.
Scenario 2 (data phase, check="off"): the last rank starts Iallreduce, then sleeps without driving it.
Every rank prints one line per scenario: ``STALL<k> rank <r>: <message>`` (or ``NOSTALL<k>``).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import RANK, SIZE, WORLD  # noqa: E402

import ddl  # noqa: E402

WARN, TIMEOUT, SLEEP = 0.3, 1.0, 3.0
last = SIZE - 1


def scenario(k, check, sleeper_action):
    comm = ddl.Communicator(WORLD, stall_warning=WARN, stall_timeout=TIMEOUT, check=check)
    buf = np.ones(64, np.float32)
    t0 = time.monotonic()
    try:
        if RANK == last:
            sleeper_action(comm, buf)
        else:
            comm.Allreduce(ddl.IN_PLACE, buf)
        print(f"NOSTALL{k} rank {RANK}", flush=True)
    except ddl.StallError as exc:
        print(f"STALL{k} rank {RANK} after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
    WORLD.Barrier()


def sleep_then_call(comm, buf):
    time.sleep(SLEEP)
    comm.Allreduce(ddl.IN_PLACE, buf)


def start_then_sleep(comm, buf):
    req = comm.Iallreduce(ddl.IN_PLACE, buf)
    time.sleep(SLEEP)
    req.Wait()


scenario(1, "always", sleep_then_call)
scenario(2, "off", start_then_sleep)
WORLD.Barrier()
if RANK == 0:
    print("DONE", flush=True)
