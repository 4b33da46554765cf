"""Plan and run one allreduce with ddl, check the result, time it.

    mpiexec -n 8 python -m mpi4py examples/allreduce_hello.py [topology.yaml] [--size 4MiB]

Topology: the file given, else topologies/emulated-2rack.yaml when its rank count matches the number
of processes, else a flat topology (every rank on one switch).
"""
import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, fail, size
from ddl.units import format_seconds, format_size

HERE = os.path.dirname(os.path.abspath(__file__))


def pick_topology(path, size):
    if path:
        return path
    zoo = os.path.join(HERE, "..", "topologies", "emulated-2rack.yaml")
    if os.path.exists(zoo):
        from ddl.topology import Topology
        if Topology.load(zoo).nranks == size:
            return zoo
    return None


def iterations(text):
    """--iters: the timings' best and median need one call at least."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def describe(comm, nbytes):
    """What runs for an allreduce of ``nbytes``, said by rank 0: small inputs ride on the shared-memory
    agreement board (every rank posts its input and sums all of them: no messages, no schedule), up to
    ``comm.inline_bytes`` (0 where that path is off); larger ones run the planned schedule."""
    if nbytes <= comm.inline_bytes:
        print(f"  path: inline on the shared-memory agreement board (inputs up to {format_size(comm.inline_bytes)} "
              f"per rank; env DDL_INLINE_BYTES): each rank reads every input and sums them, no point-to-point "
              f"messages and no schedule")
        return
    sched = comm.plan(nbytes)
    print(f"  plan: {sched.algorithm} ({sched.nchunks} chunks, {sched.nops} point-to-point ops)")
    if comm.size > 1:
        plan = comm.explain(nbytes)
        print(f"  predicted {format_seconds(plan.predicted_seconds)} on the modelled fabric "
              f"(lower bound {format_seconds(plan.bound_seconds)}): {plan.reason}")


def main():
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology", nargs="?", default=None)
    ap.add_argument("--size", type=size, default="4MiB", help="message size (default 4MiB)")
    ap.add_argument("--iters", type=iterations, default=5, help="timed calls (default 5)")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    try:
        comm = ddl.Communicator(world, topology=pick_topology(args.topology, world.size))
    except ddl.Error as exc:
        fail(exc)
    nbytes = args.size
    count = max(1, nbytes // 4)
    if comm.rank == 0:
        topo = comm.topology.name if comm.topology is not None else "single rank"
        print(f"ddl allreduce of {format_size(count * 4)} float32 on {comm.size} ranks, topology {topo}")
        describe(comm, count * 4)

    send = np.arange(count, dtype=np.float32) % 1024 + comm.rank
    recv = np.empty_like(send)
    times = []
    for _ in range(args.iters):
        world.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(send, recv, op=ddl.SUM)
        times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    expected = (np.arange(count, dtype=np.float64) % 1024) * comm.size + comm.size * (comm.size - 1) / 2
    ok = bool(np.array_equal(recv, expected.astype(np.float32)))
    all_ok = world.allreduce(ok, op=MPI.LAND)
    if comm.rank == 0:
        best = min(times)
        print(f"  result check: {'OK' if all_ok else 'WRONG'}")
        print(f"  time: best {format_seconds(best)}, median {format_seconds(sorted(times)[len(times) // 2])} "
              f"({count * 4 / best / 1e6:.1f} MB/s algorithm bandwidth)")
    comm.Free()
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
