"""Plan and run one allreduce with ddl, check the result, time it.

    mpiexec -n 8 python -m mpi4py examples/allreduce_hello.py [topology.yaml] [--size 4MiB] [--trace t.json]

Topology: the file given, else the one $DDL_TOPOLOGY names (``ddl emulate run`` sets it), else
topologies/emulated-2rack.yaml when its rank count matches the number of processes, else a flat
topology (every rank on one switch).
"""
import argparse
import contextlib
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli import check_output_file
from ddl.cli.argtypes import MPIParser, at_least, fail, size
from ddl.trace import MessageTrace, chrome_trace, gather
from ddl.units import counted, format_seconds, format_size

HERE = os.path.dirname(os.path.abspath(__file__))


def pick_topology(path, size):
    path = path or os.environ.get("DDL_TOPOLOGY")
    if path:
        return path
    zoo = os.path.join(HERE, "..", "topologies", "emulated-2rack.yaml")
    if os.path.exists(zoo):
        from ddl.topology import Topology
        if Topology.load(zoo).nranks == size:
            return zoo
    return None


def float32_bytes(text):
    """--size: whole float32 elements, at least one (a size it would round is refused, not rounded)."""
    nbytes = size(text)
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number of float32 elements (4 bytes each): "
                                         f"give a multiple of 4 bytes, at least 4")
    return nbytes


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
    messages = sum(op.kind == "send" for program in sched.programs for op in program)
    print(f"  plan: {sched.algorithm} ({counted(sched.nchunks, 'chunk')}, {counted(messages, 'message')} "
          f"between ranks)")
    if comm.size > 1:
        plan = comm.explain(nbytes)
        print(f"  predicted {format_seconds(plan.predicted_seconds)} on the modelled fabric "
              f"(lower bound {format_seconds(plan.bound_seconds)}): {plan.reason}")


def write_trace(world, traced, path):
    """Every rank's traced events to rank 0, on its clock, written there as a Chrome trace."""
    events = gather(world, traced.take())
    hosts = world.gather(MPI.Get_processor_name())
    if events is not None:
        with open(path, "w") as f:
            json.dump(chrome_trace(events, hosts), f)
        print(f"  trace of the timed calls written to {path}")


def main():
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology", nargs="?", default=None,
                    help="topology file (default: $DDL_TOPOLOGY, else topologies/emulated-2rack.yaml when its "
                         "rank count is the job's, else every rank on one switch)")
    ap.add_argument("--size", type=float32_bytes, default="4MiB",
                    help="bytes of float32 per rank (default 4MiB)")
    ap.add_argument("--iters", type=at_least(1), default=5,       # the best and median need one call
                    help="timed calls, after one untimed (default 5)")
    ap.add_argument("--trace", default=None, metavar="FILE.json",
                    help="write when every message of the timed calls was posted and arrived, on every rank, "
                         "as a Chrome trace (open it in https://ui.perfetto.dev)")
    args = ap.parse_args()
    if args.trace:
        try:
            check_output_file("--trace", args.trace, "trace.json")
        except ddl.Error as exc:
            fail(exc)

    world = MPI.COMM_WORLD
    try:
        comm = ddl.Communicator(world, topology=pick_topology(args.topology, world.size))
    except ddl.Error as exc:
        fail(exc)
    nbytes = args.size
    count = nbytes // 4
    try:
        send = np.arange(count, dtype=np.float32) % 1024 + comm.rank
        recv = np.empty_like(send)
        allocated = True
    except MemoryError:
        allocated = False
    if not world.allreduce(allocated, op=MPI.LAND):      # every rank stops, not only the one that failed
        fail(f"--size {format_size(nbytes)}: a rank has not enough memory for its buffers")
    if comm.rank == 0:
        topo = comm.topology.name if comm.topology is not None else "single rank"
        print(f"ddl allreduce of {format_size(nbytes)} float32 on {counted(comm.size, 'rank')}, topology {topo}")
        describe(comm, nbytes)

    traced = MessageTrace(comm) if args.trace else None
    comm.Allreduce(send, recv, op=ddl.SUM)      # untimed: plans, scratch buffers, MPI's connections
    times = []
    for i in range(args.iters):
        world.Barrier()
        t0 = time.perf_counter()
        with traced.recording(f"allreduce #{i + 1}") if traced else contextlib.nullcontext():
            comm.Allreduce(send, recv, op=ddl.SUM)
        times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if traced:
        write_trace(world, traced, args.trace)
    expected = (np.arange(count, dtype=np.float64) % 1024) * comm.size + comm.size * (comm.size - 1) / 2
    ok = bool(np.array_equal(recv, expected.astype(np.float32)))
    all_ok = world.allreduce(ok, op=MPI.LAND)
    if comm.rank == 0:
        best = min(times)
        print(f"  result check: {'OK' if all_ok else 'WRONG'}")
        print(f"  time: best {format_seconds(best)}, median {format_seconds(statistics.median(times))} "
              f"({nbytes / best / 1e6:.1f} MB/s algorithm bandwidth)")
    comm.Free()
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
