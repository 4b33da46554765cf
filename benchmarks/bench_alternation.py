"""Does what ran before a ddl allreduce change its time? ddl after ddl, after idle, after MPI_Allreduce.

    ddl emulate run topologies/emulated-2rack.yaml -- python benchmarks/bench_alternation.py [--bytes 64MiB]
        [--cycles 4] [--idle 8]

``ddl bench`` alternates its implementations' calls, so each ddl call there follows one of MPI's (or
gloo's). Each cycle here times, after a barrier each: a ddl call after ``--idle`` seconds of nothing,
an MPI_Allreduce, a ddl call right after it, and a ddl call right after that one. The table gives
each kind's median and every call (slowest rank), and ddl's speed-up over MPI_Allreduce in the same
job, and checks ddl's last result. Same buffers, float32 sum, one untimed call of each first.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, fail, size
from ddl.units import format_seconds, format_size


def timed(world, fn):
    world.Barrier()
    t0 = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv=None):
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=size, default="64MiB", help="per-rank input size (default 64MiB)")
    ap.add_argument("--cycles", type=at_least(1), default=4, help="cycles of four timed calls (default 4)")
    ap.add_argument("--idle", type=float, default=8.0, help="seconds of nothing before a cycle (default 8)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        comm = ddl.Communicator(world)      # env DDL_TOPOLOGY names the topology (ddl emulate run sets it)
    except ddl.Error as exc:
        fail(exc)
    x = np.arange(max(1, args.bytes // 4), dtype=np.float32) % 1024 + comm.rank
    out = np.empty_like(x)
    mine = lambda: comm.Allreduce(x, out, op=ddl.SUM)      # noqa: E731
    theirs = lambda: world.Allreduce(x, out, op=MPI.SUM)   # noqa: E731
    mine(), theirs()
    times = {"ddl after idle": [], "MPI_Allreduce": [], "ddl after MPI": [], "ddl after ddl": []}
    for _ in range(args.cycles):
        world.Barrier()
        time.sleep(args.idle)
        for kind, fn in zip(times, (mine, theirs, mine, mine)):
            times[kind].append(timed(world, fn))
    expected = ((np.arange(x.size, dtype=np.float64) % 1024) * world.size
                + world.size * (world.size - 1) / 2).astype(np.float32)
    correct = world.allreduce(bool(np.array_equal(out, expected)), op=MPI.LAND)   # the last call: ddl's
    if world.rank == 0:
        mpi = statistics.median(times["MPI_Allreduce"])
        print(f"{world.size} ranks, {format_size(x.nbytes)} per rank, {args.cycles} cycles, "
              f"{args.idle:g} s idle before each")
        print(f"{'calls':<16} {'median':>9} {'MPI / it':>9}  every call")
        for kind, ts in times.items():
            med = statistics.median(ts)
            print(f"{kind:<16} {format_seconds(med):>9} {mpi / med:>8.2f}x  "
                  + " ".join(format_seconds(t) for t in ts))
        print(f"result check: {'OK' if correct else 'WRONG'}")
    comm.Free()


if __name__ == "__main__":
    main()
