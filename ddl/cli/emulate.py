"""``ddl emulate``: bring a topology file to life on this machine and run MPI programs on it.

* ``ddl emulate up FILE`` builds the cluster (a namespace per host, a bridge per switch, shaped veths),
  checks the link rates, records it under /run/ddl-emulate/<name>-<hash>/ and prints how to enter each host;
* ``ddl emulate down FILE`` (or the cluster's name) ends its processes and removes it;
* ``ddl emulate list`` shows the clusters that are up (or recorded): their namespaces, hosts, link
  rates, who is using them and what runs in their hosts;
* ``ddl emulate run FILE [--no-check] -- CMD...`` builds, checks, runs CMD under ``mpiexec`` with ranks
  placed as the file's ``ranks`` say, and always tears down: on success, error, Ctrl-C, SIGTERM or
  SIGHUP. The exit status is CMD's (128 + N when ended by signal N). On a cluster that ``up`` left up
  it runs CMD there and leaves the cluster up (holding it meanwhile: ``down`` is refused until it ends).

Needs root, iproute2 (ip, tc), util-linux (unshare, nsenter) and the mpiexec of MPICH (the mpich
wheel), Open MPI or Intel MPI. Links faster than this machine can push (tens of Gbit/s) cannot be
emulated as such: ``--scale 0.001`` shrinks every bandwidth by the same factor, which keeps the
topology's bottlenecks where they are.
"""
import argparse
import functools
import math
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from ..errors import Error
from ..launcher import INTEL_MPI, MPICH, OPEN_MPI
from ..units import format_bandwidth
from . import INTERRUPT_SAID_OUTSIDE, say_if_interrupted


def register(subparsers):
    parser = subparsers.add_parser(
        "emulate", help="emulate a topology with network namespaces and run MPI programs on it",
        description="Emulate a cluster on this machine: hosts become network namespaces, switches "
                    "bridges, links tc-shaped veth pairs (bandwidth only: no latency emulation). "
                    "Needs root.")
    sub = parser.add_subparsers(dest="emulate_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: _usage(parser))

    p = sub.add_parser("up", help="build the emulated cluster and leave it up",
                       description="Build the cluster of FILE, check its link rates and record it "
                                   "so that `ddl emulate down FILE` can remove it. Interrupted (Ctrl-C, "
                                   "SIGTERM, SIGHUP), it removes what it built.")
    _common(p)
    p.set_defaults(func=_ending_on_signals(cmd_up))

    p = sub.add_parser("down", help="remove an emulated cluster",
                       usage="%(prog)s [-h] (FILE | --all)",
                       description="End the processes of the cluster built from FILE (or named NAME) "
                                   "and remove its namespaces; with --all, of every cluster that "
                                   "`ddl emulate list` shows.")
    p.add_argument("file", metavar="FILE", nargs="?", help="topology file, or the cluster's name")
    p.add_argument("--all", action="store_true",
                   help="every emulated cluster on this machine (one that another process is building, "
                        "running a job on or taking down is left to it, and said)")
    p.set_defaults(func=_ending_on_signals(cmd_down))

    p = sub.add_parser("list", help="show the emulated clusters that are up",
                       description="Show every emulated cluster recorded on this machine: its namespaces, "
                                   "hosts, switches and link rates, whether it is up, which process is "
                                   "building it, running a job on it or taking it down, and what runs in "
                                   "its hosts. It only reads, so it never disturbs a run.")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("run", help="build, check, run CMD under mpiexec, tear down",
                       usage="%(prog)s [OPTIONS] FILE [OPTIONS] [--] CMD...",
                       description="Build the cluster of FILE, check its link rates, run CMD on every "
                                   "rank under mpiexec (rank i on the host of ranks[i]), then tear the "
                                   "cluster down whatever happens. A cluster that `ddl emulate up` left up "
                                   "is used as it is and left up. Exit status: CMD's (128 + N if ended "
                                   "by signal N). CMD sees DDL_TOPOLOGY (the file) and DDL_EMULATED_HOSTS.",
                       epilog="The options above may also follow FILE: they are read up to `--` or to "
                              "the first word that is not one of them, and CMD is the rest, so in "
                              "`run FILE --scale 0.5 python x.py --scale 2` the first --scale is ddl's "
                              "and the second x.py's. Any other option there is refused: words for "
                              "mpiexec, or a CMD that starts with an option, go after `--`.")
    _common(p)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop CMD after S seconds (default: no limit)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the MPI program and its arguments")
    p.set_defaults(func=_ending_on_signals(cmd_run))


def _common(p):
    p.add_argument("file", metavar="FILE", help="topology file (.yaml, .yml or .json)")
    p.add_argument("--no-check", action="store_true", help="skip the point-to-point rate self-check")
    p.add_argument("--scale", type=float, default=1.0, metavar="F",
                   help="multiply every bandwidth by F (e.g. 0.001 for 100 Gbit/s fabrics)")
    p.add_argument("--mtu", default=1500, metavar="N",
                   help="frame size of every emulated link (default 1500; 9000 = jumbo frames, less "
                        "kernel work per byte)")


def _usage(parser):
    parser.print_help()
    return 2


def _load(path):
    from ..topology import Topology
    return Topology.load(path)


def _ending_on_signals(command):
    """Run ``command`` with SIGTERM and SIGHUP raising KeyboardInterrupt as Ctrl-C does, so a cluster
    being built, run or removed is torn down for them too; exit then with 128 + the signal's number,
    as a shell reports a process ended by it (143 for SIGTERM; Ctrl-C's 130 is the caller's).

    Once torn down, the process only has to exit, so Ctrl-C, SIGTERM and SIGHUP are ignored from then
    on: one more (a Ctrl-C pressed again, or one that lands while the interpreter shuts down and has
    put the default actions back) would otherwise end it by that signal instead of the status that
    says what happened."""
    @functools.wraps(command)
    def run(args):
        with signals_as_interrupt() as caught:
            try:
                return command(args)
            except KeyboardInterrupt:
                if caught.signum is None:
                    raise
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, *signals_as_interrupt.SIGNALS):
                signal.signal(s, signal.SIG_IGN)
        say_if_interrupted(128 + caught.signum)
        return 128 + caught.signum
    return run


def cmd_up(args):
    """Build, check and describe the cluster; whatever fails on the way (a launcher ddl cannot use, the
    self-check, an interrupt, a reader that has gone) takes down what was built: ``up`` leaves a
    cluster up only when it says so."""
    from ..emulate import launch
    from ..emulate.netns import Cluster
    topo = _load(args.file)
    launch.find_launcher()          # another MPI's mpiexec, or none: said before anything is built
    cluster = Cluster.create(topo, scale=args.scale, mtu=args.mtu)
    try:
        _describe(cluster, sys.stdout)
        if not args.no_check:
            _check(cluster, topo, sys.stdout)
        job = launch.mpiexec_argv(cluster, ["CMD"], launch.rank_hosts(topo),
                                  env={"DDL_TOPOLOGY": os.path.abspath(args.file)})
        print(f"run an MPI job on it (ranks placed as the file says; CMD: your program and its arguments):\n"
              f"  ddl emulate run {shlex.quote(args.file)} -- CMD\n"
              f"or with mpiexec itself:\n"
              f"  {shlex.join(job)}")
        print(f"cluster {topo.name!r} is up; remove it with: ddl emulate down {shlex.quote(args.file)}")
        sys.stdout.flush()
    except BaseException:
        cluster.down()
        raise
    return 0


def cmd_down(args):
    from ..emulate.netns import TEARDOWN_TOOLS, Cluster, check_can_emulate, state_dir_for
    if args.file is None and not args.all:
        raise Error("which cluster? give its topology file or its name (`ddl emulate list` shows them), "
                    "or --all for every one")
    if args.file is not None and args.all:
        raise Error(f"give {args.file} or --all, not both")
    check_can_emulate(TEARDOWN_TOOLS)
    if args.all:
        return _down_all()
    name = _cluster_name(args.file)
    state = state_dir_for(name)
    if not (state / "state.json").exists():
        raise Error(f"no emulated cluster {name!r} is up (nothing recorded in {state})")
    Cluster.load(state).down()
    print(f"cluster {name!r} is down")
    return 0


def _down_all():
    """``ddl emulate down --all``: every recorded cluster, one after the other; one that cannot be taken
    down (another process holds it, or a damaged record) is said on stderr and the others still go.
    Exit status 1 when any is left."""
    from ..emulate.netns import STATE_ROOT, Cluster, recorded_clusters
    found = recorded_clusters()
    if not found:
        print(f"no emulated cluster is up (none is recorded in {STATE_ROOT})")
        return 0
    left = 0
    for record in found:
        if record.plan is None:
            left += 1
            why = (f"being recorded by pid {record.holder}" if record.holder is not None else
                   f"its record cannot be read; remove the folder {record.folder}")
            print(f"ddl emulate down: left {record.folder.name}: {why}", file=sys.stderr)
            continue
        try:
            Cluster(record.plan, record.folder).down()    # (its record, read once by recorded_clusters)
        except Error as exc:
            left += 1
            print(f"ddl emulate down: left {record.plan.name!r}: {exc}", file=sys.stderr)
        else:
            print(f"cluster {record.plan.name!r} is down")
    return 1 if left else 0


def cmd_list(args):
    from ..emulate.netns import STATE_ROOT, recorded_clusters
    found = recorded_clusters()
    if not found:
        print(f"no emulated cluster is up (none is recorded in {STATE_ROOT})")
        return 0
    rows = [("cluster", "namespaces", "hosts", "switches", "links", "MTU", "state", "processes in its hosts")]
    rows += [_listed(r, os.geteuid() == 0) for r in found]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    named = [r.plan.name for r in found if r.plan is not None]
    if named:
        print(f"take one down with: ddl emulate down CLUSTER (e.g. ddl emulate down {shlex.quote(named[0])})")
    return 0


def _listed(record, root):
    """The row of ``ddl emulate list`` for one recorded cluster (``root``: whether the processes in
    its hosts could all be seen)."""
    held = f", held by pid {record.holder} (a build, a job or a teardown)" if record.holder is not None else ""
    plan = record.plan
    if plan is None:
        state = (f"being recorded{held}" if record.holder is not None else
                 f"unreadable record: remove the folder {record.folder}")
        return (record.folder.name, "-", "-", "-", "-", "-", state, "-")
    rates = [r for h in plan.hosts if h.switch for r in (h.rate_out, h.rate_in)]
    rates += [r for u in plan.uplinks for r in (u.rate_ab, u.rate_ba)]
    links = "-" if not rates else format_bandwidth(min(rates)) if min(rates) == max(rates) else \
        f"{format_bandwidth(min(rates))} to {format_bandwidth(max(rates))}"
    if record.gone:
        state, running = "gone: its namespaces no longer exist (`down` removes the record)", "-"
    else:
        state = "up" if not record.missing else \
            f"up in part: {', '.join(record.missing)} gone (`down` removes the rest)"
        running = (f"{len(record.pids)} (pids {', '.join(map(str, record.pids[:8]))}"
                   f"{' ...' if len(record.pids) > 8 else ''})" if record.pids else "none")
        if not root:
            running += " (not root: only your own are seen)"
    return (plan.name, f"{plan.tag}-*", str(len(plan.hosts)), str(len(plan.bridges)), links, str(plan.mtu),
            state + held, running)


def _cluster_name(arg):
    """The topology's name when ``arg`` is a readable file, else ``arg`` itself (a cluster name)."""
    from ..emulate.netns import state_dir_for
    if Path(arg).is_file():
        return _load(arg).name
    if state_dir_for(arg).exists():       # a name, even one that looks like a path
        return arg
    if Path(arg).exists():
        raise Error(f"{arg} is a folder, not a topology file; give the file the cluster was built from, "
                    f"or the cluster's name")
    if "/" in arg or arg.lower().endswith((".yaml", ".yml", ".json")):
        raise Error(f"{arg}: no such file; give the topology file the cluster was built from, or the "
                    f"cluster's name")
    return arg


def cmd_run(args):
    from ..emulate import launch
    from ..emulate.netns import Cluster
    cmd = _split_command(args)
    if cmd is None:                 # --help among the options after FILE
        args._parser.print_help()
        return 0
    if not cmd:
        raise Error("nothing to run: give the command after --, e.g. "
                    "ddl emulate run FILE -- python train.py")
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        raise Error(f"--timeout must be a positive number of seconds, got {args.timeout:g} "
                    "(leave it out for no limit)")
    _refuse_launcher_options(cmd, launch.find_launcher()[1])
    topo = _load(args.file)
    with Cluster.create(topo, scale=args.scale, mtu=args.mtu, reuse=True) as cluster:
        if cluster.borrowed:
            print(f"ddl emulate: cluster {topo.name!r} is already up ({cluster.plan.tag}): running on it "
                  f"and leaving it up (remove it with: ddl emulate down {args.file})", file=sys.stderr)
        if not args.no_check:
            _check(cluster, topo, sys.stderr)
        env = {"DDL_TOPOLOGY": os.path.abspath(args.file), INTERRUPT_SAID_OUTSIDE: "1"}
        try:
            res = launch.run(cluster, cmd, launch.rank_hosts(topo), env=env, timeout=args.timeout)
        except launch.JobTimedOut as exc:
            print(f"ddl: {exc}", file=sys.stderr)
            return TIMED_OUT
    # mpiexec ended by signal N (Popen says -N): 128 + N, as a shell says it
    return 128 - res.returncode if res.returncode < 0 else res.returncode


TIMED_OUT = 124
"""Exit status of ``run`` when ``--timeout`` stopped CMD: timeout(1)'s, not a user error's 2."""

# mpiexec options that ddl sets itself for the emulated cluster, per launcher: given again after --,
# hydra fails with "duplicate setting" far from the cause, and Open MPI would place the ranks elsewhere
_HYDRA_OPTIONS = ("-n", "-np", "-hosts", "-host", "-f", "-hostfile", "-machinefile", "-launcher",
                  "-launcher-exec", "-localhost", "-iface", "-ppn", "-rr")
_LAUNCHER_OPTIONS = {
    MPICH: _HYDRA_OPTIONS,
    INTEL_MPI: _HYDRA_OPTIONS,
    OPEN_MPI: ("-n", "-np", "--n", "--np", "-c", "-H", "--host", "-host", "--hostfile", "-hostfile",
               "--machinefile", "-machinefile", "--map-by", "-map-by", "--rankfile", "--bind-to", "-bind-to"),
}
# words that take values, so that the refusal reads past them to the program: (word, values)
_HYDRA_VALUED = {"-genv": 2, "-env": 2, "-genvlist": 1, "-envlist": 1, "-wdir": 1}
_VALUED = {
    MPICH: _HYDRA_VALUED,
    INTEL_MPI: _HYDRA_VALUED,
    OPEN_MPI: {"--mca": 2, "-mca": 2, "--prtemca": 2, "--pmixmca": 2, "-x": 1, "--wdir": 1, "-wdir": 1},
}


def _refuse_launcher_options(cmd, launcher=MPICH):
    """Refuse, in one line, mpiexec words before CMD's program that would clash with ddl's own."""
    refused, valued = _LAUNCHER_OPTIONS[launcher], _VALUED[launcher]
    i = 0
    while i < len(cmd) and cmd[i].startswith("-"):
        word = cmd[i].split("=", 1)[0]
        if word in refused:
            raise Error(f"{cmd[i]} is set by ddl emulate run itself (the file's ranks fix the rank count "
                        f"and their hosts); leave it out, other mpiexec options may go after --")
        i += 1 + valued.get(word, 0)


def _split_command(args):
    """CMD, with ddl's options written after FILE applied (argparse leaves them in ``args.cmd``).

    They are read up to ``--`` or to the first word that is none of them, as ``env`` and ``timeout``
    read theirs: ``run FILE --scale 0.5 hostname`` scales, ``run FILE prog --scale 2`` passes
    ``--scale 2`` to prog. An unknown option there is refused rather than handed to mpiexec (which
    would take ``--scal 0.5`` for its own and fail far from the typo); mpiexec's go after ``--``.
    """
    typed = getattr(args, "argv", [])
    if "--" in typed and typed[typed.index("--") + 1:] == args.cmd:
        return _without_dashes(args.cmd)    # `run FILE -- CMD`: argparse took the `--`; the rest is CMD
    late = argparse.ArgumentParser(prog="ddl emulate run", add_help=False, exit_on_error=False)
    late.add_argument("-h", "--help", action="store_true")
    late.add_argument("--no-check", action="store_true", default=args.no_check)
    late.add_argument("--scale", type=float, default=args.scale)
    late.add_argument("--mtu", default=args.mtu)
    late.add_argument("--timeout", type=float, default=args.timeout)
    late.add_argument("cmd", nargs=argparse.REMAINDER)
    try:
        opts, unknown = late.parse_known_args(args.cmd)
    except argparse.ArgumentError as exc:
        raise Error(str(exc)) from None
    if unknown:
        raise Error(f"unknown option {unknown[0]} before the command: ddl emulate run takes --no-check, "
                    "--scale, --mtu and --timeout there; put options meant for mpiexec or the command "
                    "after --, e.g. ddl emulate run FILE -- CMD ...")
    if opts.help:
        return None
    cmd = _without_dashes(_without_dashes(opts.cmd))     # the `--` argparse kept, then a second one
    vars(args).update({k: v for k, v in vars(opts).items() if k not in ("cmd", "help")})
    return cmd


def _without_dashes(cmd):
    """CMD without a second `--` (``run FILE -- -- CMD``): no mpiexec takes one before a program."""
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _check(cluster, topo, out):
    from ..emulate.selfcheck import selfcheck
    print("self-check (point-to-point rate per link class):", file=out)
    selfcheck(cluster, topo, out=out)


def _describe(cluster, out):
    plan = cluster.plan
    print(f"emulated cluster {plan.name!r} ({plan.tag}): {len(plan.hosts)} hosts, "
          f"{len(plan.bridges)} switches, {len(plan.uplinks)} switch links, MTU {plan.mtu}", file=out)
    for h in plan.hosts:
        link = (f"{h.switch}, out {format_bandwidth(h.rate_out)} / in {format_bandwidth(h.rate_in)}"
                if h.switch else "no switch")
        print(f"  {h.id}: {h.address} hostname {h.hostname}, ranks {list(h.ranks)}, {link}", file=out)
    for u in plan.uplinks:
        print(f"  {u.a} -> {u.b}: {format_bandwidth(u.rate_ab)}, back {format_bandwidth(u.rate_ba)}",
              file=out)
    if plan.hosts:
        enter = " ".join(cluster.host_argv(plan.hosts[0].id, ["CMD"]))
        print(f"  run CMD on {plan.hosts[0].id}: {enter}", file=out)


class signals_as_interrupt:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt, so teardown runs as it does for Ctrl-C; ``signum``
    says which came (None: none did). A plain KeyboardInterrupt, not a subclass: subprocess bounds its
    waits on the way out for exactly that type, and waits without limit for any other. Only the main
    thread can set signal handlers; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.signum = None
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, self._raise) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)
        return False

    def _raise(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt(f"signal {signum}")
