"""Stall watchdog: a rank that sleeps past stall_timeout is named in a StallError on the others.

    mpiexec -n N python tests/mpi_cases/stall.py     (N >= 2)

Scenario 1 (agreement phase): the last rank sleeps before calling Allreduce.
Scenario 2 (data phase, check="off"): the last rank starts Iallreduce, then sleeps without driving it.
Scenario 3 (polling): the last rank sleeps before calling; the others poll ``Test`` with a short
computation between polls, longer than 0.5 s but under half the stall warning: that time counts.
In scenarios 1 and 3 the last rank arrives after the others gave up: it raises StallError too, naming them
(on the shared-memory board it once agreed with the rows they had abandoned, and computed a result alone).
Scenario 4 (a local failure): a reduction raises on the last rank (simulated): that error is its call's,
its communicator refuses further calls, and the others' StallError says it failed in it.
Scenarios 5 and 6 (Free): the last rank frees where the others call Allreduce, or frees after they
gave up on it; see :func:`freeing`.
Scenario 7 (a post that must wait): the last rank posts as many nonblocking calls as the board has
payload slots (each with more data than a small slot holds) and sleeps without driving them; the others
post one more, which cannot start until the last rank is done with the first slot, and wait: its
StallError names the rank holding the slot.
Scenario 8 (a late wait): every rank posts an Iallreduce; the last one sleeps past the others' stall
timeout before it waits. Once it learns that they gave up, its wait and its next call end at once (they
once waited a whole stall_timeout each, and the next call's message called the others stuck).
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


def scenario(k, check, sleeper_action, others=None, warn=WARN, timeout=TIMEOUT):
    comm = ddl.Communicator(WORLD, stall_warning=warn, stall_timeout=timeout, check=check)
    buf = np.ones(64, np.float32)
    t0 = time.monotonic()
    try:
        if RANK == last:
            sleeper_action(comm, buf)
        elif others is not None:
            others(comm, buf)
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


def poll_with_compute(comm, buf):
    req = comm.Iallreduce(ddl.IN_PLACE, buf)
    while not req.Test():
        time.sleep(0.6)                # "compute" between polls: over 0.5 s, under half the warning


def sleep_longer_then_call(comm, buf):
    time.sleep(2 * SLEEP)
    comm.Allreduce(ddl.IN_PLACE, buf)


def failing_reduction(comm, buf):
    import ddl.executor as executor
    real = executor._combine

    def fail(ufunc, views):
        raise RuntimeError("simulated failure of a reduction")
    executor._combine = fail
    big = np.ones(1 << 19, np.float32)       # above the inline limit: the schedule runs, with reductions
    try:
        comm.Allreduce(ddl.IN_PLACE, big)
    except RuntimeError as exc:
        print(f"FAILED4 rank {RANK}: {exc}", flush=True)
    finally:
        executor._combine = real
    t0 = time.monotonic()
    try:
        comm.Allreduce(ddl.IN_PLACE, buf)
    except ddl.Error as exc:
        print(f"REFUSED4 rank {RANK} after {time.monotonic() - t0:.1f}s: {exc}", flush=True)


def late_wait(comm, buf):
    big = np.ones(1 << 19, np.float32)       # above the inline limit: the others wait for this rank's messages
    req = comm.Iallreduce(ddl.IN_PLACE, big)
    time.sleep(SLEEP)
    for what, call in (("wait", req.Wait), ("next", lambda: comm.Allreduce(ddl.IN_PLACE, buf))):
        said(f"LATE8 rank {RANK} {what}", call)
    raise ddl.StallError("(the late rank's outcome is in its LATE8 lines)")


def said(line, call):
    """Run ``call`` and print ``<line> ok``, or ``<line> after <s>s: <error type>: <error>``."""
    t0 = time.monotonic()
    try:
        call()
        print(f"{line} ok", flush=True)
    except ddl.Error as exc:
        print(f"{line} after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: {exc}", flush=True)


def post_then_sleep(comm, buf, calls=None):
    from ddl.agreement import ShmBoard
    if calls is None:
        calls = ShmBoard.PAYLOAD_DEPTH
    else:
        time.sleep(0.5)                # the last rank posts first: it finishes none of its calls before it sleeps
    n = ShmBoard.small_limit(SIZE) // 4 + 1        # float32: beyond a small slot, so a payload slot each
    reqs = [comm.Iallreduce(ddl.IN_PLACE, np.ones(n, np.float32)) for _ in range(calls)]
    if calls == ShmBoard.PAYLOAD_DEPTH:
        time.sleep(SLEEP)
    ddl.Request.Waitall(reqs)


def post_one_more(comm, buf):
    from ddl.agreement import ShmBoard
    post_then_sleep(comm, buf, ShmBoard.PAYLOAD_DEPTH + 1)


def freeing(k, last_sleeps):
    """Free is collective: the last rank calls it where the others call Allreduce (scenario 5), or only
    after sleeping past the stall timeout that ended the others' Allreduce (scenario 6); the others then
    call Allreduce again and Free. No rank may hang in MPI's frees (the last one once did, for ever), nor
    wait for the one that left: each says what it got."""
    comm = ddl.Communicator(WORLD, stall_warning=WARN, stall_timeout=TIMEOUT)

    def allreduce():
        comm.Allreduce(ddl.IN_PLACE, np.ones(64, np.float32))
    for what, call in (("call", allreduce), ("again", allreduce), ("free", comm.Free)):
        if RANK == last and what in ("call", "again"):
            if last_sleeps and what == "call":
                time.sleep(SLEEP)
            continue
        said(f"FREE{k} rank {RANK} {what}", call)
    WORLD.Barrier()


# one call first, on every rank: a job's first collective imports the planner and plans, which under a loaded
# machine took seconds that scenario 1's timings (its StallError before the sleeper wakes) would count
warm = ddl.Communicator(WORLD)
warm.Allreduce(ddl.IN_PLACE, np.ones(64, np.float32))
warm.Free()
scenario(1, "always", sleep_then_call)
scenario(2, "off", start_then_sleep)
scenario(3, "always", sleep_longer_then_call, poll_with_compute, warn=1.5, timeout=2.5)
scenario(4, "always", failing_reduction, lambda comm, buf: comm.Allreduce(ddl.IN_PLACE, np.ones(1 << 19, np.float32)))
scenario(7, "always", post_then_sleep, post_one_more)
scenario(8, "always", late_wait, lambda comm, buf: comm.Iallreduce(ddl.IN_PLACE, np.ones(1 << 19, np.float32)).Wait())
freeing(5, last_sleeps=False)
freeing(6, last_sleeps=True)
WORLD.Barrier()
if RANK == 0:
    print("DONE", flush=True)
