"""ddl.Communicator.Allreduce against mpi4py's comm.Allreduce (MPI_Allreduce), same run, same buffers.

    mpiexec -n 8 python benchmarks/bench_overhead.py [--sizes 8,64MiB] [--iters 1000,20]
            [--check always] [--topology FILE] [--algorithm auto] [--profile] [--board]
            [--api buffer|functional]

Each size runs at least ``--rounds`` rounds (more where a block of ``--block`` calls leaves calls over;
fewer only where a size has fewer calls than rounds); a round times a block of back-to-back ddl calls, then a block of
MPI calls (each block after a barrier; a call's time is the block time over its length, maximum over
ranks). Alternating matters on a shared or oversubscribed machine: load that comes and goes hits both
sides alike. The table shows medians over rounds and the ratio ddl / MPI, and the CPU time a call
costs each rank (``time.process_time``, the mean over ranks): where ranks outnumber cores, a call
takes about ranks x CPU / cores, whatever waits for what. Targets: 8 B within 3x, 64 MiB within 1.3x. ``--profile`` runs ddl's
first-size loop under cProfile on rank 0 and prints the top functions.

``--board`` (ranks of one host, sizes up to the inline limit) times a third side in every round: the
floor under ddl's inline path. It is the same exchange through ddl's shared-memory board (wait for
the slot, post the input, wait until every rank has posted, reduce the rows in rank order, mark the
slot done) without anything around it: no API layers, no signature check, no stall watchdog, no books.
What ddl's call costs above it is its Python machinery; what the board costs above MPI is the
exchange itself. It reaches into ddl's internals: a measurement, not an API.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, fail, list_of, numeric_dtype, size
from ddl.units import counted, format_size


def main(argv=None):
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=list_of(size), default="8,64MiB",
                    help="comma-separated message sizes (e.g. 8,1MiB,64MiB)")
    ap.add_argument("--iters", type=list_of(at_least(1), unique=False), default="1000,20",
                    help="calls per size and side (one value, or one per size)")
    ap.add_argument("--dtype", type=numeric_dtype, default="float32")
    ap.add_argument("--topology", default=None)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--check", default="always", choices=("always", "new", "off"))
    ap.add_argument("--rounds", type=at_least(1), default=10,
                    help="alternating ddl/MPI blocks per size, at least (default 10)")
    ap.add_argument("--block", type=at_least(1), default=50, help="calls per timed block, at most (default 50)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--api", default="buffer", choices=("buffer", "functional"),
                    help="ddl's side: comm.Allreduce(send, recv) (buffer, default) or comm.allreduce(send), "
                         "which returns a new array (functional, as Horovod's allreduce)")
    ap.add_argument("--board", action="store_true",
                    help="also time a bare exchange through ddl's shared-memory board (see above)")
    args = ap.parse_args(argv)
    sizes, iters, dtype = args.sizes, args.iters, args.dtype
    if len(iters) > len(sizes):
        ap.error(f"--iters gives {counted(len(iters), 'value')} for {counted(len(sizes), 'size')}")
    iters = iters + [iters[-1]] * (len(sizes) - len(iters))

    world = MPI.COMM_WORLD
    try:
        comm = ddl.Communicator(world, topology=args.topology, algorithm=args.algorithm, check=args.check)
    except ddl.Error as exc:     # a topology file missing or for another rank count, an unknown algorithm
        fail(exc)
    board = comm._engine.board if args.board else None
    if args.board and (board is None or max(sizes) > comm.inline_bytes or args.check == "off"):
        fail(ddl.Error(f"--board needs every rank on one host (the shared-memory board), sizes of at most "
                       f"{format_size(comm.inline_bytes)} (the inline limit on {world.size} ranks) and "
                       f"a check on"))
    rows = []
    for nbytes, n_it in zip(sizes, iters):
        count = max(1, nbytes // dtype.itemsize)
        send = np.full(count, world.rank + 1, dtype)
        recv_d = np.empty_like(send)
        recv_m = np.empty_like(send)
        if args.api == "functional":
            def ddl_side():
                recv_d[...] = comm.allreduce(send, op=ddl.SUM)
        else:
            def ddl_side():
                comm.Allreduce(send, recv_d, op=ddl.SUM)
        for _ in range(3):  # warm-up: plans, scratch, MPI connections, page faults
            ddl_side()
            world.Allreduce(send, recv_m, op=MPI.SUM)
        if not np.array_equal(recv_d, recv_m):
            raise SystemExit("ddl and MPI results differ")
        if args.api == "functional":      # time the call itself, without the copy that checked it
            def ddl_side():
                comm.allreduce(send, op=ddl.SUM)
        # blocks of back-to-back calls (a training loop's view; a barrier before every single call would
        # mostly measure how unevenly ranks leave the barrier on an oversubscribed node), alternating
        sides = [ddl_side, lambda: world.Allreduce(send, recv_m, op=MPI.SUM)]
        if board is not None:
            recv_b = np.empty_like(send)
            signature = np.zeros(board.sigs.shape[-1], np.int64)
            sides.append(lambda: _bare_board(comm, board, signature, send, recv_b))
            sides[2]()
            if not np.array_equal(recv_b, recv_m):
                raise SystemExit("the bare board's and MPI's results differ")
        block = max(1, min(args.block, n_it // args.rounds))
        rounds = max(1, n_it // block)
        t = np.zeros((len(sides), rounds))
        cpu = np.zeros((len(sides), rounds))
        for i in range(rounds):
            for j, fn in enumerate(sides):
                world.Barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(block):
                    fn()
                t[j, i] = (time.perf_counter() - t0) / block
                cpu[j, i] = (time.process_time() - c0) / block
        world.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        world.Allreduce(MPI.IN_PLACE, cpu, op=MPI.SUM)
        cpu /= world.size
        n_it = rounds * block
        nbytes = count * dtype.itemsize
        sched = comm.plan(nbytes)
        inline = nbytes <= comm.inline_bytes   # reduced from the shared-memory board, no schedule
        rows.append((nbytes, n_it, np.median(t[0]), np.median(t[1]), np.percentile(t[0], 90),
                     np.percentile(t[1], 90), "inline" if inline else sched.algorithm, "-" if inline else sched.nchunks,
                     np.median(cpu[0]), np.median(cpu[1]),
                     (np.median(t[2]), np.median(cpu[2])) if board is not None else None))
    if args.profile:
        import cProfile
        import pstats
        send = np.ones(max(1, sizes[0] // dtype.itemsize), dtype)
        recv = np.empty_like(send)
        prof = cProfile.Profile() if world.rank == 0 else None
        if prof:
            prof.enable()
        for _ in range(iters[0]):
            comm.Allreduce(send, recv, op=ddl.SUM)
        if prof:
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    if world.rank == 0:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        api = "allreduce (functional)" if args.api == "functional" else "Allreduce"
        print(f"ddl {api} vs MPI_Allreduce ({MPI.Get_library_version().splitlines()[0].strip()}); "
              f"{world.size} ranks, {os.cpu_count()} cores, load {load:.1f}; dtype {dtype}; check={args.check} "
              f"(agreement: {comm.agreement}); topology {comm.topology.name if comm.topology is not None else '-'}")
        print(f"{'size':>9} {'iters':>5} {'algorithm':>17} {'chunks':>6} {'ddl median':>11} {'MPI median':>11} "
              f"{'ddl p90':>10} {'MPI p90':>10} {'ddl/MPI':>8} {'ddl CPU':>10} {'MPI CPU':>10}"
              + (f" {'board':>10} {'board/MPI':>9} {'board CPU':>10}" if board is not None else ""))
        for nbytes, n_it, td, tm, td9, tm9, alg, k, cd, cm, bare in rows:
            print(f"{format_size(nbytes):>9} {n_it:>5} {alg:>17} {k:>6} {_fmt(td):>11} {_fmt(tm):>11} "
                  f"{_fmt(td9):>10} {_fmt(tm9):>10} {td / tm:>8.2f} {_fmt(cd):>10} {_fmt(cm):>10}"
                  + (f" {_fmt(bare[0]):>10} {bare[0] / tm:>9.2f} {_fmt(bare[1]):>10}" if bare else ""))
    comm.Free()


def _bare_board(comm, board, signature, send, recv):
    """One allreduce (SUM) as a bare exchange through ``board`` (see the module docstring). It takes the
    communicator's next sequence number, as a ddl call does, so ddl's own calls go on after it."""
    seq = comm._seq
    comm._seq = seq + 1
    while not board.can_post(seq, send.nbytes):    # every rank is done with this data slot's last use
        os.sched_yield()
    board.post(seq, signature, send)
    while not board.ready(seq):
        os.sched_yield()
    rows = board.posted(seq, send.size, send.dtype)
    np.add(rows[0], rows[1], out=recv)
    for row in rows[2:]:
        np.add(recv, row, out=recv)
    board.finish(seq)


def _fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


if __name__ == "__main__":
    main()
