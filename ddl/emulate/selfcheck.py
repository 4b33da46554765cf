"""Prove that an emulated cluster carries MPI traffic at the shaped rates.

A wrong transport (UCX or libfabric's shm provider moving "inter-host" data through shared memory), a
missing qdisc or a misplaced rank all look like success until the numbers are wrong, so before trusting
a measurement we time one point-to-point transfer per link class with a small mpi4py program run inside
the cluster:

* **same host** - two ranks in one namespace (shared memory or loopback): reported, not judged;
* **same switch** - two hosts on one bridge: bounded by the two NICs;
* **across switches** - two hosts on different bridges: bounded by the slowest link on the path.

A judged class must come within :data:`TOLERANCE` of the bandwidth the topology file gives (links are shaped
to deliver it as TCP goodput), else :class:`ddl.Error` names the class. Waiting ranks sleep between polls instead of spinning, so on a
machine with few cores the ranks under test get the CPU.
"""
import json
import sys
import time
from dataclasses import dataclass

from ..errors import Error
from ..units import format_bandwidth
from . import launch

TOLERANCE = 0.15
SAME_HOST, SAME_SWITCH, ACROSS = "same host", "same switch", "across switches"
TARGET_SECONDS = 0.6          # duration of one timed transfer at the expected rate
MIN_BYTES, MAX_BYTES, SAME_HOST_BYTES = 4 << 20, 256 << 20, 64 << 20
REPEATS = 2                   # best of: the first transfer of a pair may still be in TCP slow start
SLOW_CHECK_SECONDS = 20       # a self-check expected to take longer says so first


@dataclass(frozen=True)
class LinkCheck:
    """One measured class: ``expected`` is None for the unjudged same-host class (bytes/s)."""
    cls: str
    src: str
    dst: str
    nbytes: int
    measured: float
    expected: float = None

    @property
    def ok(self):
        return self.expected is None or abs(self.measured / self.expected - 1) <= TOLERANCE

    def line(self):
        """One report line: class, pair, measured rate and, if judged, the expectation and verdict."""
        text = f"{self.cls:16s} {self.src} -> {self.dst}: {format_bandwidth(self.measured)}"
        if self.expected is None:
            return text + " (not shaped)"
        verdict = "ok" if self.ok else f"OFF by more than {TOLERANCE:.0%}"
        return text + f", expected {format_bandwidth(self.expected)} ({self.measured / self.expected:.0%}) {verdict}"

    def problem(self):
        """Why a failed class failed, in one clause for the error message."""
        return (f"{self.cls} ({self.src} -> {self.dst}) measured {format_bandwidth(self.measured)}, "
                f"expected {format_bandwidth(self.expected)} +- {TOLERANCE:.0%}")


def choose_pairs(plan, hosts_with_ranks=None):
    """(class, src host, dst host) to time: one pair per link class present and per distinct rate the
    file gives that class's routes (hosts whose NICs differ each get theirs checked), among hosts that
    run ranks if possible."""
    pool = [h for h in plan.hosts if hosts_with_ranks is None or h.id in hosts_with_ranks] or list(plan.hosts)
    pairs = []
    if any(len(h.ranks) > 1 for h in pool):
        h = next(h for h in pool if len(h.ranks) > 1)
        pairs.append((SAME_HOST, h.id, h.id))
    for cls, same in ((SAME_SWITCH, True), (ACROSS, False)):
        by_rate = {}
        for a in pool:
            for b in pool:
                if a.index < b.index and (a.switch == b.switch) == same:
                    by_rate.setdefault(plan.path_rate(a.id, b.id), (a.id, b.id))
        pairs += [(cls, *by_rate[rate]) for rate in sorted(by_rate)]
    return pairs


def _job(plan, pairs):
    """Placement (host per job rank, each host's ranks contiguous) and the tests in job-rank terms."""
    slots = {}
    for _, src, dst in pairs:
        slots[src] = max(slots.get(src, 1), 2 if src == dst else 1)
        slots.setdefault(dst, 1)
    placement = [h for h, n in slots.items() for _ in range(n)]
    first = {h: placement.index(h) for h in slots}
    tests = []
    for cls, src, dst in pairs:
        expected = None if src == dst else plan.path_rate(src, dst)
        nbytes = SAME_HOST_BYTES if expected is None else \
            int(min(MAX_BYTES, max(MIN_BYTES, expected * TARGET_SECONDS)))
        tests.append({"cls": cls, "src": first[src], "dst": first[dst] + (src == dst),
                      "bytes": nbytes, "expected": expected})
    return placement, tests


def selfcheck(cluster, topo=None, timeout=None, out=None):
    """Measure each link class; print the report to ``out``; raise :class:`ddl.Error` if one is off."""
    plan = cluster.plan
    pairs = choose_pairs(plan, set(topo.hosts) if topo is not None else None)
    if not pairs:
        return []
    placement, tests = _job(plan, pairs)
    seconds = REPEATS * sum(t["bytes"] / (t["expected"] or 1e9) for t in tests)
    if seconds > SLOW_CHECK_SECONDS:   # slow links: say why nothing seems to happen, and how to skip it
        print(f"  (the transfers take about {seconds:.0f} s at these rates; --no-check skips the self-check)",
              file=out or sys.stdout, flush=True)
    budget = timeout or 30 + 3 * seconds
    res = launch.run(cluster, [sys.executable, "-m", __name__, json.dumps(tests)], placement,
                     timeout=budget, capture=True)
    results = _parse(res, tests, placement)
    for r in results:
        print("  " + r.line(), file=out or sys.stdout)
    bad = [r for r in results if not r.ok]
    if bad:
        hint = ("faster than the shaping: is MPI bypassing the emulated NICs (shared memory)?"
                if any(r.measured > r.expected for r in bad) else
                "slower than the shaping: this machine may not carry that rate (try --scale)")
        raise Error("emulated links are off: " + "; ".join(r.problem() for r in bad) + f" ({hint})")
    return results


def _parse(res, tests, placement):
    lines = [ln for ln in (res.stdout or "").splitlines() if ln.startswith("DDL-SELFCHECK ")]
    if res.returncode != 0 or not lines:
        tail = "\n".join(((res.stdout or "") + (res.stderr or "")).strip().splitlines()[-15:])
        raise Error(f"self-check MPI job failed (exit {res.returncode}):\n{tail}")
    rates = json.loads(lines[-1].split(" ", 1)[1])
    return [LinkCheck(t["cls"], placement[t["src"]], placement[t["dst"]], t["bytes"], rate, t["expected"])
            for t, rate in zip(tests, rates)]


# ----------------------------------------------------------------------------------------------------
# The MPI side: ``python -m ddl.emulate.selfcheck TESTS_JSON`` on every rank of the check job
# ----------------------------------------------------------------------------------------------------

def _wait(req, nap=2e-4):
    """Complete a request without spinning: the ranks not under test must leave the CPU alone."""
    while not req.Test():
        time.sleep(nap)


def _check_placement(comm):
    import os
    import socket
    wanted = os.environ.get("DDL_EMULATED_HOSTS", "").split(",")
    here = socket.gethostname()
    if comm.rank < len(wanted) and wanted[comm.rank] and wanted[comm.rank] != here:
        launch.abort_job(comm, f"rank {comm.rank} runs on {here}, expected {wanted[comm.rank]}", 3)


def _transfer(comm, test, buf, ack):
    """Time ``test['bytes']`` from src to dst, until dst's one-byte acknowledgement is back at src."""
    src, dst = test["src"], test["dst"]
    if comm.rank == src:
        t0 = time.perf_counter()
        _wait(comm.Isend(buf, dst, tag=1))
        _wait(comm.Irecv(ack, dst, tag=2))
        return time.perf_counter() - t0
    if comm.rank == dst:
        _wait(comm.Irecv(buf, src, tag=1))
        _wait(comm.Isend(ack, src, tag=2))
    return None


def worker(tests):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    _check_placement(comm)
    ack = np.zeros(1, np.uint8)
    rates = []
    for test in tests:
        buf = np.ones(test["bytes"], np.uint8)
        _transfer(comm, {**test, "bytes": 1 << 16}, buf[:1 << 16], ack)   # connect, warm up
        best = None
        for _ in range(REPEATS):
            _wait(comm.Ibarrier())
            t = _transfer(comm, test, buf, ack)
            best = t if best is None or (t is not None and t < best) else best
        rate = test["bytes"] / best if best else 0.0
        # only the sender knows the time: it reports to rank 0, everyone else sleeps meanwhile
        rates.append(_gather_rate(comm, test["src"], rate))
        del buf
    if comm.rank == 0:
        print("DDL-SELFCHECK " + json.dumps(rates), flush=True)
    _wait(comm.Ibarrier())


def _gather_rate(comm, src, rate):
    import numpy as np
    value = np.array([rate if comm.rank == src else 0.0])
    total = np.zeros(1)
    _wait(comm.Iallreduce(value, total))
    return float(total[0])


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
