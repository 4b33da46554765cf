"""Small collectives: ddl against the MPI library's own, every collective, same run, same buffers.

    mpiexec -n 8 python benchmarks/bench_small.py [--bytes 8] [--iters 2000] [--rounds 10] [--inflight 16]

Per-rank input of ``--bytes`` (float32). Each round times a block of back-to-back ddl calls, then a
block of MPI calls (after a barrier each; a call's time is the block time over its length, maximum over
ranks); the table shows medians over rounds. On one node with ``algorithm="auto"`` these sizes take
ddl's inline path (see ``Communicator.inline_bytes``); ``DDL_INLINE_BYTES=0`` shows the schedules.

The last two rows post ``--inflight`` nonblocking allreduces at once, then wait for them all (a
gradient hook's pattern, as in examples/torch_hook.py): ``Iallreduce`` into buffers, and the
functional ``iallreduce``, which returns new arrays; MPI's side is ``Iallreduce`` and ``Waitall``.
Their times are per such round, not per call.
"""
import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, fail, size
from ddl.units import format_size


def timed(world, fn, calls):
    world.Barrier()
    t0 = MPI.Wtime()
    for _ in range(calls):
        fn()
    return world.allreduce((MPI.Wtime() - t0) / calls, op=MPI.MAX)


def main(argv=None):
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=size, default="8", help="per-rank input size (default 8)")
    ap.add_argument("--iters", type=at_least(1), default=2000, help="calls per collective and side (default 2000)")
    ap.add_argument("--rounds", type=at_least(1), default=10, help="alternating ddl/MPI blocks (default 10)")
    ap.add_argument("--inflight", type=at_least(1), default=16,
                    help="nonblocking allreduces in flight at once in the last two rows (default 16)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        comm = ddl.Communicator(world)      # env DDL_TOPOLOGY may name a topology file
    except ddl.Error as exc:
        fail(exc)
    p = world.size
    n = max(1, args.bytes // 4)
    x = np.ones(n, np.float32)
    out, big, gathered = np.empty(n, np.float32), np.ones(n * p, np.float32), np.empty(n * p, np.float32)
    cases = {
        "Allreduce": (lambda: comm.Allreduce(x, out), lambda: world.Allreduce(x, out)),
        "Bcast": (lambda: comm.Bcast(out, root=0), lambda: world.Bcast(out, root=0)),
        "Allgather": (lambda: comm.Allgather(x, gathered), lambda: world.Allgather(x, gathered)),
        "Reduce_scatter_block": (lambda: comm.Reduce_scatter_block(big, out),
                                 lambda: world.Reduce_scatter_block(big, out)),
    }
    k = args.inflight
    xs = [np.full(n, world.rank + j, np.float32) for j in range(k)]
    outs = [np.empty(n, np.float32) for _ in range(k)]

    def mpi_inflight():
        MPI.Request.Waitall([world.Iallreduce(a, o) for a, o in zip(xs, outs)])

    def ddl_inflight():
        for req in [comm.Iallreduce(a, o) for a, o in zip(xs, outs)]:
            req.Wait()

    def ddl_functional_inflight():
        return [req.wait() for req in [comm.iallreduce(a) for a in xs]]

    want = [world.allreduce(a) for a in xs]
    ddl_inflight()
    if not all(np.array_equal(o, w) for o, w in zip(outs, want)) or \
            not all(np.array_equal(o, w) for o, w in zip(ddl_functional_inflight(), want)):
        raise SystemExit("ddl's and MPI's in-flight results differ")
    block = max(1, args.iters // args.rounds)
    per_block = {name: block for name in cases}           # calls per timed block
    cases[f"Iallreduce x{k} in flight"] = (ddl_inflight, mpi_inflight)
    cases[f"iallreduce x{k} (functional)"] = (ddl_functional_inflight, mpi_inflight)
    rows = []
    for name, (mine, theirs) in cases.items():
        calls = per_block.get(name, max(1, block // k))    # (an in-flight round makes k calls)
        for _ in range(max(2, 20 * calls // block)):
            mine(), theirs()
        t = np.array([(timed(world, mine, calls), timed(world, theirs, calls)) for _ in range(args.rounds)])
        rows.append((name, np.median(t[:, 0]), np.median(t[:, 1])))
    if world.rank == 0:
        path = "inline" if n * 4 <= comm.inline_bytes else "schedule"
        print(f"{p} ranks, {format_size(n * 4)} per rank ({path}; inline_bytes {comm.inline_bytes}), "
              f"{args.rounds} rounds of {block} calls")
        print(f"{'collective':<28} {'ddl':>9} {'MPI':>9} {'ddl/MPI':>8}")
        for name, a, m in rows:
            print(f"{name:<28} {a * 1e6:>7.0f}us {m * 1e6:>7.0f}us {a / m:>8.2f}")
    comm.Free()


if __name__ == "__main__":
    main()
