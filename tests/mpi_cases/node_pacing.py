"""Sends to ranks of the same node, paced (ddl.executor._pace_node_sends), under real MPI.

On one machine every rank is on one node, where nothing is paced; each communicator here is told
instead that ranks 2k and 2k+1 form a node (``_node_peers``), as on a cluster of two-rank hosts.

* ``compare``: tree-packing, ring and hierarchical allreduces give bitwise the results they give
  unpaced, and tree-packing's plans really hold sends back.
* ``crossed``: a verified two-rank schedule in which each rank's second paced send can only leave once
  the other rank's has (each first send is received late, behind the other's second): the held sends
  must be released when the collective stops progressing, and the allreduce completes;
  ``crossed-unreleased``: with that release turned off, the same call stalls (the test's premise).
"""
import sys
import time

import numpy as np

import ddl
from ddl.schedule import Op, Schedule
from _common import RANK, SIZE, WORLD, Checker, hosts_topology

chk = Checker()
mode = sys.argv[1]


def paced(comm):
    comm._node_peers = frozenset(r for r in range(SIZE) if r // 2 == RANK // 2) - {RANK}
    return comm


def allreduce(comm, x):
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    return y


if mode == "compare":
    topo = hosts_topology([2] * (SIZE // 2))
    x = np.random.default_rng(RANK).standard_normal(1 << 18).astype(np.float32)     # 1 MiB
    exact = WORLD.allreduce(x.astype(np.float64))
    for algorithm in ("tree-packing", "ring", "hierarchical"):
        with ddl.Communicator(WORLD, topology=topo, algorithm=algorithm) as plain, \
                paced(ddl.Communicator(WORLD, topology=topo, algorithm=algorithm)) as comm:
            want, got = allreduce(plain, x), allreduce(comm, x)
            chk.ok(got.tobytes() == want.tobytes(), f"{algorithm}: paced result differs from the unpaced one")
            chk.ok(np.allclose(got, exact, rtol=1e-4, atol=1e-4), f"{algorithm}: wrong sum")
            chk.same_everywhere(algorithm, got)
            held = WORLD.allreduce(sum(len(entry[0].held) for entry in comm._plans.values()))
            if RANK == 0:
                print(f"RESULT {algorithm}: {held} sends held", flush=True)
    chk.finish("node-pacing")
elif mode.startswith("crossed"):
    C, D = 0, 1
    crossed = Schedule("allreduce", 2, (1, 1), (
        (Op("send", C, 1), Op("send", D, 1), Op("reduce", C, 1), Op("recv", D, 1), Op("send", C, 1), Op("recv", D, 1)),
        (Op("send", D, 0), Op("send", C, 0), Op("reduce", D, 0), Op("recv", C, 0), Op("send", D, 0), Op("recv", C, 0))),
        algorithm="crossed")
    x = np.full(1 << 20, RANK + 1, dtype=np.float32)            # 2 MiB per chunk: no eager send
    if mode == "crossed-unreleased":
        import ddl.executor
        ddl.executor._RELEASE_HELD = float("inf")
        comm = paced(ddl.Communicator(WORLD, stall_warning=1, stall_timeout=2))
        comm.planner.pin(crossed)
        try:
            allreduce(comm, x)
            chk.fail("crossed: completed with held sends never released")
        except ddl.StallError as exc:
            print(f"RESULT rank {RANK} stalled: {str(exc).splitlines()[0][:100]}", flush=True)
        sys.exit(0)
    with paced(ddl.Communicator(WORLD, stall_warning=30, stall_timeout=60)) as comm:
        comm.planner.pin(crossed)
        t = time.perf_counter()
        y = allreduce(comm, x)
        seconds = time.perf_counter() - t
        chk.ok(np.all(y == 3), f"crossed: wrong sum {np.unique(y)}")
        held = len(next(iter(comm._plans.values()))[0].held)
        chk.ok(held == 1, f"crossed: {held} sends held, expected 1")
        chk.same_everywhere("crossed", y)
    if RANK == 0:
        print(f"RESULT crossed done in {seconds:.2f} s", flush=True)
    chk.finish("node-pacing crossed")
