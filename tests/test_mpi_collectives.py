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


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin ranks to")
@pytest.mark.parametrize("pinned, oversubscribed", [("own", False), ("shared", True)])
def test_ranks_pinned_each_to_a_cpu_of_its_own_are_not_oversubscribed(pinned, oversubscribed):
    """Intel MPI's and Open MPI's launchers pin every rank to one core: each rank then sees a single
    CPU, but the node is oversubscribed only where the ranks' CPUs together are fewer than the ranks."""
    out = run_ok(2, "pinned.py", pinned, env={"DDL_OVERSUBSCRIBED": ""})
    said = re.findall(r"RESULT rank (\d) on \[(\d+)\]: oversubscribed (True|False)", out)
    assert sorted(r for r, _, _ in said) == ["0", "1"], out[-2000:]
    assert len({cpu for _, cpu, _ in said}) == (2 if pinned == "own" else 1)
    assert {flag for _, _, flag in said} == {str(oversubscribed)}


def test_paced_sends_to_node_peers_change_no_result():
    """Told that ranks 2k and 2k+1 share a node, the executor paces their sends to each other
    (tests/mpi_cases/node_pacing.py): every result stays bitwise what it is unpaced, and tree-packing
    and hierarchical really hold sends back."""
    out = run_ok(4, "node_pacing.py", "compare")
    held = {name: int(n) for name, n in re.findall(r"RESULT ([\w-]+): (\d+) sends held", out)}
    assert set(held) == {"tree-packing", "ring", "hierarchical"}, out[-3000:]
    assert held["tree-packing"] > 0 and held["hierarchical"] > 0
    assert re.search(r"RESULT node-pacing: \d+ checks passed on 4 ranks \(3 results bitwise", out)


def test_held_sends_are_released_when_a_collective_stops_progressing():
    """A schedule whose paced sends wait on each other across two ranks completes; with the release
    turned off, the same call stalls (so the release is what completes it)."""
    out = run_ok(2, "node_pacing.py", "crossed")
    assert re.search(r"RESULT crossed done in \d", out) and "node-pacing crossed: 6 checks passed" in out
    out = run_ok(2, "node_pacing.py", "crossed-unreleased", timeout=120)
    assert len(re.findall(r"RESULT rank \d stalled", out)) == 2, out[-3000:]


@pytest.mark.parametrize("n", [2, 5])
def test_repeated_small_allreduce_takes_the_quick_lane_and_gives_way(n):
    """A repeated blocking Allreduce on the same small arrays skips the general path
    (tests/mpi_cases/quick_lane.py): the same results, bit for bit, AVG's division included; and an
    Iallreduce in flight (here or on another communicator), a trace, check='new', a pinned schedule,
    a read-only recvbuf, float16 AVG and sizes above the inline limit each send it down the general
    path. The functional allreduce (a new array every call) has a lane per dtype, shape and op, and
    returns what it did (a float for a float, a shaped array for an array). Differing signatures
    (counts; shapes of the same count) still raise MismatchError on every rank, and a rank that
    never calls is named in a StallError. Small nonblocking calls in flight take the board's small
    slots: two dozen at once never wait for a slot; every inline collective at a small slot's edge,
    all in flight together, gives MPI's result."""
    out = run_ok(n, "quick_lane.py", timeout=180)
    m = re.search(r"RESULT quick-lane: (\d+) checks passed on (\d+) ranks \((\d+) results bitwise", out)
    assert m, out[-3000:]
    assert int(m.group(2)) == n and int(m.group(1)) > 70 * n and int(m.group(3)) == 23
