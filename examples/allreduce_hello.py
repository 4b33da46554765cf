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
from ddl.units import format_seconds, format_size, parse_size

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology", nargs="?", default=None)
    ap.add_argument("--size", default="4MiB", help="message size (default 4MiB)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    comm = ddl.Communicator(world, topology=pick_topology(args.topology, world.size))
    nbytes = parse_size(args.size)
    count = max(1, nbytes // 4)
    if comm.rank == 0:
        topo = comm.topology.name if comm.topology is not None else "single rank"
        print(f"ddl allreduce of {format_size(count * 4)} float32 on {comm.size} ranks, topology {topo}")
        sched = comm.plan(count * 4)
        print(f"  plan: {sched.algorithm} ({sched.nchunks} chunks, {sched.nops} point-to-point ops)")
        if comm.size > 1:
            plan = comm.explain(count * 4)
            print(f"  predicted {format_seconds(plan.predicted_seconds)} on the modelled fabric "
                  f"(lower bound {format_seconds(plan.bound_seconds)}): {plan.reason}")

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
