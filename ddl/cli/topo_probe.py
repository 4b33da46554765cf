"""``ddl topo probe FILE``: measure the fabric a job runs on against its topology file (:mod:`ddl.probe`).

    mpiexec -n 16 -hosts node0:8,node1:8 ddl topo probe cluster.yaml
    ddl topo probe cluster.yaml                     # launches mpiexec -n <ranks> on this machine
    ddl emulate run cluster.yaml -- python -m ddl topo probe cluster.yaml
    ddl topo probe cluster.yaml --write measured.yaml  # and a copy with the measured figures

Exit status 0 when the fabric is as the file says, 1 when a measurement or the placement differs from
it, 2 on a usage error (a missing file, a job of the wrong size).
"""
import math
import os
import sys

from ..errors import Error
from ..units import counted
from . import check_output_file
from .argtypes import at_least, reported
from .bench import _child, as_rank, under_mpi


def add_parser(sub):
    p = sub.add_parser(
        "probe", help="measure the fabric under a job against its topology file",
        description="Measure what the fabric carries between the job's ranks and compare it with FILE: "
                    "the ranks' placement on machines, the bandwidth and latency of one rank pair per "
                    "class of route (same bottleneck bandwidth, latency and hops), one pair at a time, "
                    "then every host sending at once (which fills the links that hosts share), and each "
                    "host's reduction rate. Host buffers, MPI point-to-point. Run it under "
                    "mpiexec as the training job would be, or alone (it launches mpiexec on this "
                    "machine). Exit status 1 when the fabric differs from FILE, 2 on a usage error.")
    p.add_argument("file", nargs="?", metavar="FILE", help="topology file (default: $DDL_TOPOLOGY)")
    p.add_argument("--per-class", type=at_least(1), default=1, metavar="N",
                   help="rank pairs to measure per route class, each on hosts no earlier pair covered "
                        "where one is left (default 1; as many as there are hosts checks every NIC)")
    p.add_argument("--repeats", type=at_least(1), default=2, metavar="N",
                   help="timed transfers per pair; the best counts (default 2)")
    p.add_argument("--tolerance", type=reported(_tolerance), default=0.15, metavar="T",
                   help="how far a measurement may lie from the file, either way: 15%% or 0.15 (default)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--write", metavar="OUT", help="also write FILE with the figures that differed replaced by "
                                                  "the measured ones (links that bound a slow route, a shared "
                                                  "link, reduction rates) to OUT, YAML or .json; not where the "
                                                  "placement differs from FILE. The exit status still "
                                                  "judges FILE")
    p.set_defaults(func=cmd_probe)


def _tolerance(text):
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 10:
        raise ValueError(f"a fraction above 0 such as 0.15 or 15%, got {text!r}")
    return value


def _topology(args):
    file = args.file or os.environ.get("DDL_TOPOLOGY")
    if not file:
        raise Error("give the topology FILE to probe against (or set DDL_TOPOLOGY)")
    from ..topology import Topology
    return Topology.load(file)


def cmd_probe(args):
    if under_mpi():
        return _in_job(args)
    topo = _checked(_topology(args), None, args.write)   # before the ranks are launched
    from ..launcher import local_command
    n = topo.nranks
    argv = [topo.source, "--per-class", str(args.per_class), "--repeats", str(args.repeats),
            "--tolerance", repr(args.tolerance)] + (["--json"] if args.json else [])
    if args.write:
        argv += ["--write", args.write]
    print(f"ddl topo probe: not under mpiexec: launching {counted(n, 'rank')} on this machine "
          f"(for a cluster, run it under mpiexec with your job's host list)", file=sys.stderr, flush=True)
    return _child([*local_command(n), sys.executable, "-m", "ddl", "topo", "probe", *argv])


def _in_job(args):
    """One rank of the probe job: every rank agrees on the file first, then measures; rank 0 reports.
    Every rank exits with the report's status (see :func:`ddl.cli.bench.as_rank` for errors)."""
    from .. import probe
    from ..bench import agree

    def work(world):
        topo = agree(world, lambda: _checked(_topology(args), world.size, args.write if world.rank == 0 else None))
        classes = probe.pair_classes(topo, args.per_class)
        patterns = probe.host_patterns(topo)
        result = probe.measure(world, topo, classes, patterns, args.repeats)
        ok = None
        if world.rank == 0:
            machines, pairs, timed, reduces = result
            found = probe.findings(topo, classes, pairs, reduces, args.tolerance, patterns, timed)
            problems = probe.placement_problems(topo, machines)
            ok = probe.report(topo, classes, found, problems, sys.stdout, as_json=args.json)
            sys.stdout.flush()
        if args.write:
            agree(world, lambda: _write(topo, found, problems, args.write, sys.stderr if args.json else sys.stdout)
                  if world.rank == 0 else None)
        return 0 if world.bcast(ok, root=0) else 1
    return as_rank(work)


def _checked(topo, size, out=None):
    """``topo``, once the job's ``size`` (None: not launched yet) fits it and ``out`` (``--write``) can
    be written: refused before anything is measured, not after."""
    if size is not None and topo.nranks != size:
        raise Error(f"{topo.source} has {counted(topo.nranks, 'rank')} but the job has {size}: launch "
                    f"mpiexec -n {topo.nranks}")
    if out is not None:
        if topo.source and os.path.exists(out) and os.path.exists(topo.source) and os.path.samefile(out, topo.source):
            raise Error(f"--write {out} is the file being probed: give another path, so that the file "
                        f"measured against stays as it was")
        check_output_file("--write", out, "measured.yaml")
    return topo


def _write(topo, found, problems, out, stream):
    """Write the calibrated copy of ``topo`` to ``out`` (rank 0) and say what changed; nothing where
    the ranks were not placed as the file says (what was measured is then another layout's)."""
    from ..calibrate import calibrated
    from ..topology import Topology
    from ..topology_file import write

    if problems:
        print(f"# not written: {out}: the ranks ran otherwise than {topo.source} places them (placement, "
              f"above), so what was measured is not the fabric the file describes; launch them as its "
              f"ranks list says and probe again", file=stream)
        stream.flush()
        return
    data, changes, notes = calibrated(topo, found)
    Topology.from_dict(data, source=out)        # what is written loads
    try:
        write(data, out)
    except OSError as exc:
        raise Error(f"--write {out}: {exc.strerror or exc}") from None
    if changes:
        print(f"# wrote {out}: {topo.source} with {len(changes)} change{'' if len(changes) == 1 else 's'}:",
              file=stream)
    else:
        print(f"# wrote {out}: the figures of {topo.source}, none differed", file=stream)
    for line in changes + notes:
        print(f"#   {line}", file=stream)
    stream.flush()
