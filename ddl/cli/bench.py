"""``ddl bench``: nccl-tests-style allreduce benchmark of ddl against MPI_Allreduce and gloo.

    mpiexec -n 8 ddl bench topologies/emulated-2rack.yaml --bytes 8:64MiB --peers mpi,gloo
    mpiexec -n 8 ddl bench topologies/dgx-h100.yaml --device gpu --peers nccl,mpi
    ddl bench topologies/emulated-2rack.yaml                 # launches mpiexec -n 8 itself
    ddl bench topologies/emulated-2rack.yaml --emulate --bytes 64MiB --iters 3 --peers mpi,gloo --json

Where it runs:

* under ``mpiexec`` (PMI variables set): every rank runs the benchmark (:mod:`ddl.bench`);
* ``--emulate``: re-launches itself as ``ddl emulate run FILE -- <python> -m ddl bench FILE <same
  options>``, so the ranks run on the emulated cluster (needs root);
* otherwise, when the topology has more than one rank: re-launches itself with ``mpiexec -n <ranks>``
  on this machine (and says so).
"""
import os
import signal
import subprocess
import sys

from ..errors import Error
from . import INTERRUPT_SAID_OUTSIDE, say_if_interrupted

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def register(subparsers):
    p = subparsers.add_parser(
        "bench", help="benchmark allreduce: ddl against MPI_Allreduce and gloo (nccl-tests style)",
        description="Allreduce benchmark in the style of nccl-tests: for each size, time ddl (auto and "
                    "any --algorithms) and the peers (--peers mpi,gloo) on the same buffers, check "
                    "every result exactly, and report time, algbw, busbw and #wrong, with ddl's "
                    "predicted time and the lower bound. Run it under mpiexec, or alone (it launches "
                    "mpiexec itself), or with --emulate on the emulated cluster of FILE. "
                    "Exit status 1 when a result is wrong, 2 on a usage error.")
    p.add_argument("file", nargs="?", metavar="FILE",
                   help="topology file (default: $DDL_TOPOLOGY; under mpiexec without one, a flat topology)")
    p.add_argument("-b", "--bytes", default="64MiB", metavar="SIZES",
                   help="sizes: 64MiB, a list 8,1MiB,64MiB or a range MIN:MAX[:FACTOR] such as 8:64MiB "
                        "(powers of two) (default 64MiB)")
    p.add_argument("-e", "--max-bytes", default=None, metavar="SIZE",
                   help="with a single --bytes: the end of the range (nccl-tests -b/-e/-f)")
    p.add_argument("-f", "--factor", default=None, metavar="F",
                   help="multiplication step of ranges (default 2)")
    p.add_argument("-n", "--iters", default="5", metavar="N", help="timed iterations per size (default 5)")
    p.add_argument("-w", "--warmup", default="1", metavar="N",
                   help="untimed iterations per size and implementation (default 1)")
    p.add_argument("--dtype", default="float32", metavar="TYPE",
                   help="float32 (default), float64, int32 or int64")
    p.add_argument("--op", default="sum", metavar="OP", help="sum (default), max or min")
    p.add_argument("--algorithms", default="auto", metavar="LIST",
                   help="ddl algorithms besides auto, comma-separated (ring, halving-doubling, "
                        "recursive-doubling, double-binary-tree, hierarchical, ...)")
    p.add_argument("--peers", default="mpi", metavar="LIST",
                   help="peers to compare with: mpi, gloo, nccl (with --device gpu), a list such as "
                        "mpi,gloo, or none (default mpi)")
    p.add_argument("--device", default="cpu", metavar="cpu|gpu",
                   help="where the buffers live: cpu (numpy, default) or gpu (CuPy on each rank's GPU: "
                        "ddl's device executor, NCCL and MPI on device buffers)")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write bus bandwidth against size, one line per implementation")
    p.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                   help="always show progress on stderr (default: only for runs longer than a few seconds)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   help="never show progress")
    p.add_argument("--emulate", action="store_true",
                   help="run on the emulated cluster of FILE (ddl emulate run; needs root)")
    p.add_argument("--scale", default=None, metavar="F",
                   help="the network runs at F times FILE's link bandwidths: with --emulate the emulator "
                        "builds it so (ddl emulate run --scale F); inside `ddl emulate run --scale F` "
                        "pass the same F. ddl plans, predicts and bounds for the scaled network")
    p.add_argument("--mtu", default=None, metavar="N",
                   help="with --emulate: frame size of the emulated links (ddl emulate run --mtu N; "
                        "default 1500)")
    p.add_argument("--links", action="store_true",
                   help="with --emulate (or inside ddl emulate run): the bytes each emulated link carried "
                        "per iteration, for every implementation, beside the data ddl's schedule planned "
                        "there (read from the links' tc counters)")
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="record when every message of ddl's timed calls was posted and arrived, on every "
                        "rank, and write it as a Chrome trace (open it in https://ui.perfetto.dev or "
                        "chrome://tracing); the table says when the agreement ended, when the first and "
                        "last message between hosts arrived and when the call ended")
    p.add_argument("--no-rate-check", action="store_true",
                   help="with --emulate: skip the emulator's point-to-point rate self-check")
    p.add_argument("--nranks", default=None, metavar="N",
                   help="without FILE and outside mpiexec: ranks to launch on a flat topology")
    p.set_defaults(func=cmd_bench)


def under_mpi():
    """True when started by an MPI launcher (checked without initialising MPI)."""
    return any(k in os.environ for k in _MPI_ENV)


def cmd_bench(args):
    """``ddl bench``: under mpiexec, this rank's part of the job (:func:`_in_job`); otherwise check the
    options and launch the ranks (or, for a single rank, run here)."""
    if under_mpi():
        return _in_job(args)
    opts, file = _options(args)
    if args.emulate:
        return _relaunch_emulated(opts, args.no_rate_check, args.mtu)
    n = _ranks_to_launch(args, file)
    if n > 1:
        return _relaunch_mpiexec(opts, n)
    from .. import bench
    return bench.run(opts)


def _in_job(args):
    """One rank of an MPI job; every rank exits with the same status, and no rank is left waiting.

    Each rank checks the options on its own host, in its own working folder, so the ranks can disagree
    (a topology file one host lacks): they agree on the outcome first. An error the ranks agreed on
    (:class:`ddl.bench.JobError`) is said once, by the first rank that met it, and every rank exits
    with status 2. Anything else met here (an interrupt, an error of this rank alone, a bug) may
    leave the others waiting for this rank inside an MPI call, where no Python exception reaches
    them: :func:`_abort` ends the whole job.
    """
    from .. import bench

    def work(world):
        opts, _file = bench.agree(world, lambda: _options(args, writes_plot=world.rank == 0))
        return bench.run(opts, world)
    return as_rank(work)


def as_rank(work):
    """``work(MPI.COMM_WORLD)``'s exit status on this rank, with the errors handled as
    :func:`_in_job` says: one that every rank agreed on exits 2 (said by one rank), anything else
    ends the whole job."""
    from mpi4py import MPI

    from ..bench import JobError
    world = MPI.COMM_WORLD
    try:
        return work(world)
    except JobError as exc:
        if exc.speaks:
            raise
        return 2
    except BaseException as exc:
        if world.size == 1:
            raise
        _abort(world, exc)


def _options(args, writes_plot=True):
    from .. import bench

    file = args.file or os.environ.get("DDL_TOPOLOGY") or None
    opts = bench.options(topology=file, bytes=args.bytes, max_bytes=args.max_bytes, factor=args.factor,
                         iters=args.iters, warmup=args.warmup, dtype=args.dtype, op=args.op,
                         algorithms=args.algorithms, peers=args.peers, json=args.json, plot=args.plot,
                         progress=args.progress, scale=args.scale, device=args.device, links=args.links,
                         trace=args.trace, writes_plot=writes_plot)
    if args.links and not args.emulate and not os.environ.get("DDL_EMULATED_CLUSTER"):
        raise Error("--links reads the counters of emulated links: add --emulate (or run inside `ddl emulate "
                    "run FILE -- ...`)")
    if args.no_rate_check and not args.emulate:
        raise Error("--no-rate-check applies to --emulate only")
    if args.mtu is not None:
        if not args.emulate:
            raise Error("--mtu applies to --emulate only (the emulator sets the links' frame size)")
        from ..emulate.netns import check_mtu
        args.mtu = check_mtu(args.mtu)
    if args.emulate and not file:
        raise Error("--emulate needs a topology FILE, whose hosts it builds (and whose ranks fix the rank "
                    "count)")
    if args.nranks is not None and (file or under_mpi() or args.emulate):
        source = " (from DDL_TOPOLOGY)" if file and not args.file else ""
        raise Error(f"--nranks is for runs without a topology file{source} outside mpiexec "
                    "(the topology, or mpiexec -n, fixes the rank count)")
    if args.emulate:
        if under_mpi():
            raise Error("--emulate starts its own MPI job on the emulated cluster: run `ddl bench FILE "
                        "--emulate` without mpiexec")
    return opts, file


def _ranks_to_launch(args, file):
    """Outside mpiexec: the ranks of the topology file, else ``--nranks`` (default 1)."""
    from .. import bench

    if file:
        from ..topology import Topology
        return Topology.load(file).nranks
    return bench._parse_int(args.nranks, "--nranks", minimum=1) if args.nranks is not None else 1


def _abort(world, exc):
    """Say ``exc`` in one line (a traceback for a bug), then MPI_Abort every rank of ``world``: with
    status 130 for an interrupt (as a shell reports SIGINT), 2 for a user error, 1 for a bug."""
    if isinstance(exc, KeyboardInterrupt):       # said by the ddl command that launched the job, if one did
        text, status = None if os.environ.get(INTERRUPT_SAID_OUTSIDE) else "ddl: interrupted", 130
    elif isinstance(exc, Error):
        text, status = f"ddl: error: {exc}", 2
    else:
        import traceback
        text, status = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(), 1
    from ..emulate.launch import abort_job
    abort_job(world, text, status)


def forward_argv(opts):
    """The options of ``opts`` as ``ddl bench`` arguments (sizes spelled out; paths absolute)."""
    argv = ([opts.topology] if opts.topology else []) + [
        "--bytes", ",".join(str(n) for n in opts.sizes), "--iters", str(opts.iters),
        "--warmup", str(opts.warmup), "--dtype", opts.dtype, "--op", opts.op,
        "--algorithms", ",".join(opts.algorithms), "--peers", ",".join(opts.peers) or "none",
        "--device", opts.device]
    if opts.json:
        argv.append("--json")
    if opts.links:
        argv.append("--links")
    if opts.plot:
        argv += ["--plot", opts.plot]
    if opts.trace:
        argv += ["--trace", opts.trace]
    if opts.scale is not None:
        argv += ["--scale", repr(opts.scale)]
    if opts.progress is not None:
        argv.append("--progress" if opts.progress else "--no-progress")
    return argv


def _relaunch_mpiexec(opts, n):
    from ..launcher import local_command
    cmd = [*local_command(n), sys.executable, "-m", "ddl", "bench", *forward_argv(opts)]
    print(f"ddl bench: not under mpiexec: launching {n} ranks on this machine: "
          f"mpiexec -n {n} {os.path.basename(sys.executable)} -m ddl bench ... "
          f"(use --emulate for the emulated cluster)", file=sys.stderr, flush=True)
    return _child(cmd)


def _relaunch_emulated(opts, no_rate_check, mtu=None):
    scale = opts.scale
    cmd = [sys.executable, "-m", "ddl", "emulate", "run", opts.topology]
    if scale is not None:
        cmd += ["--scale", repr(scale)]
    if mtu is not None:
        cmd += ["--mtu", str(mtu)]
    if no_rate_check:
        cmd.append("--no-check")
    cmd += ["--", sys.executable, "-m", "ddl", "bench", *forward_argv(opts)]
    from ..emulate.netns import check_can_emulate, plan_network
    from ..topology import Topology
    check_can_emulate()                                    # refused before the banner, not after it
    plan_network(Topology.load(opts.topology), "ddl-check", scale=1.0 if scale is None else scale)
    print(f"ddl bench: running on the emulated cluster: ddl emulate run {opts.topology}"
          f"{f' --scale {scale:g}' if scale is not None else ''} -- python -m ddl bench ...",
          file=sys.stderr, flush=True)
    return _child(cmd)


CHILD_GRACE = 60.0
"""Seconds a relaunched job gets to end once this process is interrupted: enough for ``ddl emulate run``
to tear its cluster down (a few seconds), bounded so that a hung job cannot hold this process."""


def _child(cmd):
    """Run ``cmd`` (mpiexec, or ``ddl emulate run``) and return its exit status, as a shell gives it.

    Ending this process ends the job, and lets it finish: an ``emulate run`` left running keeps its
    cluster up, one killed while tearing down leaves half of it. SIGTERM and SIGHUP are passed on to it,
    Ctrl-C (which the terminal sends it too) is followed by SIGTERM; either way it gets CHILD_GRACE
    seconds before it is killed, and this process then ends as the signal says (143 for SIGTERM).
    The job's ddl processes say nothing of an interrupt: this one says it, once, after they ended.
    """
    from ..emulate.launch import stop
    from .emulate import signals_as_interrupt
    proc = subprocess.Popen(cmd, env={**os.environ, INTERRUPT_SAID_OUTSIDE: "1"})
    caught = signals_as_interrupt()
    try:
        with caught:
            status = proc.wait()
        status = 128 - status if status < 0 else status   # killed by signal N: 128 + N, as a shell says
    except KeyboardInterrupt:
        if not stop(proc, caught.signum or signal.SIGTERM, CHILD_GRACE):
            print(f"ddl bench: the launched job did not end {CHILD_GRACE:.0f} s after the signal and was "
                  "killed (an emulated cluster may be left up: remove it with `ddl emulate down FILE`)",
                  file=sys.stderr, flush=True)
        status = 128 + (caught.signum or signal.SIGINT)
    say_if_interrupted(status)          # the job's processes leave that to this one
    return status
