"""Helpers shared by the scripts that tests/test_mpi_*.py run under mpiexec."""
import hashlib
import os
import sys

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None


class Checker:
    """Counts checks; the first failure prints and aborts the whole job (non-zero exit)."""

    def __init__(self):
        self.count = 0
        self.digests = []

    def ok(self, cond, msg):
        self.count += 1
        if not cond:
            self.fail(msg)

    def fail(self, msg):
        sys.stdout.write(f"FAIL rank {RANK}: {msg}\n")
        sys.stdout.flush()
        WORLD.Abort(1)

    def same_everywhere(self, label, array):
        """Record a result that must be bitwise identical on every rank (compared in finish())."""
        self.digests.append((label, hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8).tobytes(),
                                                    digest_size=12).hexdigest()))

    def finish(self, name, note=""):
        table = WORLD.gather(self.digests, root=0)
        if RANK == 0:
            ref = table[0]
            for r, mine in enumerate(table):
                if len(mine) != len(ref):
                    self.fail(f"rank {r} recorded {len(mine)} results, rank 0 {len(ref)}")
                for (la, da), (lb, db) in zip(ref, mine):
                    if la != lb or da != db:
                        self.fail(f"result {la!r} differs between rank 0 and rank {r} (not bitwise identical)")
            self.count += sum(len(t) for t in table)
        total = WORLD.reduce(self.count, root=0)
        if RANK == 0:
            print(f"RESULT {name}: {total} checks passed on {SIZE} ranks "
                  f"({len(self.digests)} results bitwise identical across ranks) {note}", flush=True)


def two_host_topology(n):
    """n cpu ranks on two hosts (sizes ceil(n/2), floor(n/2)) behind one switch."""
    if n == 1:
        return None
    return hosts_topology([(n + 1) // 2, n // 2], name=f"two-host-{n}")


def hosts_topology(sizes, name=None, bandwidths=None):
    """cpu ranks on hosts of ``sizes`` ranks behind one switch, numbered host by host; each host's link
    to the switch at ``bandwidths[h]`` (default 1 GB/s)."""
    from ddl.topology import Topology
    bandwidths = bandwidths or ["1 GB/s"] * len(sizes)
    nodes = [{"id": "sw", "kind": "switch"}] + [{"id": f"h{h}", "kind": "host"} for h in range(len(sizes))]
    links = [{"a": f"h{h}", "b": "sw", "bandwidth": bw, "latency": "10 us"} for h, bw in enumerate(bandwidths)]
    ranks = []
    for h, size in enumerate(sizes):
        for r in range(len(ranks), len(ranks) + size):
            nodes.append({"id": f"h{h}/cpu{r}", "kind": "cpu"})
            links.append({"a": f"h{h}/cpu{r}", "b": f"h{h}", "bandwidth": "10 GB/s", "latency": "1 us"})
            ranks.append(f"h{h}/cpu{r}")
    name = name or f"hosts-{'-'.join(map(str, sizes))}"
    return Topology.from_dict({"name": name, "nodes": nodes, "links": links, "ranks": ranks})


def env_int(name, default):
    return int(os.environ.get(name, default))
