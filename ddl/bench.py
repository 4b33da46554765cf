"""The ``ddl bench`` engine: nccl-tests-style allreduce benchmark of ddl against its peers.

It runs inside every MPI rank (``mpiexec -n 8 ddl bench FILE``; the CLI in :mod:`ddl.cli.bench`
launches that itself when needed). Implementations:

* ``ddl`` -- :class:`ddl.Communicator` with ``algorithm="auto"``; ``ddl:NAME`` with a fixed algorithm
  (``--algorithms ring,hierarchical``);
* ``mpi`` -- the MPI library's ``MPI_Allreduce`` through mpi4py's ``comm.Allreduce``;
* ``gloo`` -- ``torch.distributed.all_reduce`` with the gloo backend, when torch is installed;
* ``nccl`` -- with ``--device gpu`` (buffers on the GPU, :mod:`ddl.gpu.bench`): NCCL's own allreduce.

``--device gpu`` puts the send and receive buffers on each rank's GPU (CuPy); ddl then runs its device
executor, ``mpi`` gets the device buffers when the MPI library is CUDA-aware and host copies otherwise,
and a timed call lasts until the device has finished.

Method. Every implementation uses the same send and receive buffers for a size. The send buffer holds
a deterministic pattern of small integers (``(7 * (i % 251) + 13 * rank) % 251``), so every partial sum
is exact in any order and ``#wrong`` (elements of the result that differ from the expected one, summed
over ranks, checked after the last iteration) is exact. Before each iteration the receive buffer is
poisoned (NaN, or -1 for integers) outside the timed region, then every rank passes an MPI barrier and
times the call; an iteration's time is the maximum over ranks (an MPI allreduce with MAX) and a row
reports the median over iterations. Iterations of the implementations alternate (ddl, mpi, gloo, ddl,
...), so slow drifts of a shared machine affect them alike. For ddl rows the row also carries the
planner's prediction for the schedule that ran (simulated at that size) and the lower bound.

Links (``--links``, on an emulated cluster): rank 0 reads the byte counters of every emulated link's
shaper just before and just after each timed iteration (:mod:`ddl.emulate.counters`), so every row
also says how many bytes its implementation put on each link per iteration, and a ddl row how much
data its schedule was planned to put there: where the time goes, link by link.

Trace (``--trace FILE``): every rank records when each message of ddl's timed calls was posted and when
it arrived (:mod:`ddl.trace`); rank 0 writes them as a Chrome trace and adds, under each size's rows,
when the agreement ended, the first and last message between hosts arrived and the call ended.
"""
import functools
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .bench_report import format_row, link_lines, plot, print_summary, table_header, trace_lines, widths_for
from .cli import check_output_file
from .cli.argtypes import comma_separated
from .errors import Error, PlanError
from .planner import FLAT_BANDWIDTH
from .settings import named_by_env
from .units import counted, format_size, parse_size

DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("sum", "max", "min")
PEERS = ("mpi", "gloo", "nccl")
DEVICES = ("cpu", "gpu")
PATTERN_PERIOD = 251  # prime, so a chunk landing at a wrong offset shows up as wrong elements
MAX_SIZES = 64


@dataclass
class Options:
    """What to run; built (and validated) by :func:`options`."""

    topology: object = None          # path of a topology file, or None (flat, from the MPI size)
    sizes: list = field(default_factory=lambda: [64 << 20])
    iters: int = 5
    warmup: int = 1
    dtype: str = "float32"
    op: str = "sum"
    algorithms: list = field(default_factory=lambda: ["auto"])
    peers: list = field(default_factory=lambda: ["mpi"])
    json: bool = False
    plot: object = None
    progress: object = None          # None: automatic (runs longer than a few seconds), True, False
    scale: object = None             # the network runs at scale x the file's link bandwidths (emulation)
    device: str = "cpu"              # where the buffers live: cpu (numpy) or gpu (CuPy)
    links: bool = False              # bytes on every emulated link per iteration (tc counters), and planned
    trace: object = None             # path of the Chrome trace of ddl's messages (rank 0 writes it), or None


# ---- argument parsing: pure, so every rank raises the same Error (but for the files options() checks) ---
def parse_sizes(spec, max_bytes=None, factor=None):
    """Sizes in bytes from ``--bytes`` / ``--max-bytes`` / ``--factor``.

    ``spec`` is a comma-separated list of sizes (``8,1MiB,64MiB``) and ranges ``MIN:MAX`` or
    ``MIN:MAX:FACTOR`` (``8:64MiB`` = 8, 16, 32, ... 64 MiB). With ``max_bytes``, a single size is
    the start of the range up to it (nccl-tests' ``-b``/``-e``/``-f``). ``factor`` (default 2) is the
    step of ranges that give none.
    """
    if factor is not None:
        factor = _parse_int(factor, "--factor", minimum=2)
    items = [s.strip() for s in str(spec).split(",")]
    if not all(items):
        raise Error(f"--bytes {spec!r}: empty size in the list; write e.g. 8,1MiB or 8:64MiB")
    if max_bytes is not None:
        if len(items) != 1 or ":" in items[0]:
            raise Error("--max-bytes needs a single starting size in --bytes (e.g. --bytes 8 --max-bytes 64MiB)")
        if ":" in str(max_bytes):
            raise Error(f"--max-bytes {max_bytes!r}: one size, the end of the range; give the step with "
                        f"--factor (e.g. --bytes 8 --max-bytes 64MiB --factor 4)")
        items = [f"{items[0]}:{max_bytes}"]
    if factor is not None and not any(item.count(":") == 1 for item in items):
        raise Error(f"--factor {factor} is the step of a range MIN:MAX, and --bytes {spec!r} has no such "
                    f"range: write one (e.g. --bytes 8:64MiB --factor {factor}), or leave --factor out")
    sizes = []
    for item in items:
        parts = item.split(":")
        if len(parts) == 1:
            sizes.append(_size(parts[0], "--bytes"))
            if sizes[-1] <= 0:
                raise Error(f"--bytes {item!r}: nothing to measure; sizes start at one element (e.g. 4 for float32)")
            continue
        if len(parts) not in (2, 3):
            raise Error(f"--bytes {item!r}: a range is MIN:MAX or MIN:MAX:FACTOR, e.g. 8:64MiB or 8:64MiB:4")
        lo, hi = _size(parts[0], "--bytes"), _size(parts[1], "--bytes")
        step = _parse_int(parts[2], "--bytes range factor", minimum=2) if len(parts) == 3 else (factor or 2)
        if lo <= 0:
            raise Error(f"--bytes {item!r}: a range must start above 0 bytes")
        if hi < lo:
            raise Error(f"--bytes {item!r}: the range ends ({format_size(hi)}) below its start ({format_size(lo)})")
        n = lo
        while n <= hi:
            sizes.append(n)
            n *= step
    out = []
    for n in sizes:
        if n not in out:
            out.append(n)
    if len(out) > MAX_SIZES:
        raise Error(f"--bytes {spec!r} gives {len(out)} sizes; at most {MAX_SIZES} (use a larger --factor)")
    return out


def element_counts(sizes, itemsize):
    """Element counts of ``sizes`` (bytes), each rounded down to whole elements, as nccl-tests does;
    sizes below one element and repeats are left out (``1,3`` of float32 would be one 4 B row twice)."""
    out = []
    for n in sizes:
        count = n // itemsize
        if count and count not in out:
            out.append(count)
    return out


def check_sizes(sizes, dtype, device="cpu", ranks_here=1):
    """Refuse sizes that cannot run, before anything is printed: every size below one element of
    ``dtype``, or, for host buffers, a largest size whose three buffers per rank (send, receive,
    expected) would not fit in this machine's memory with ``ranks_here`` ranks on it (option checking
    knows of one; :func:`measure` checks again with the ranks that share the machine)."""
    itemsize = np.dtype(dtype).itemsize
    counts = element_counts(sizes, itemsize)
    if not counts:
        raise Error(f"--bytes: every size is below one {dtype} element ({itemsize} B)")
    if device != "cpu":
        return
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    nbytes = max(counts) * itemsize
    need = 3 * nbytes * ranks_here
    if need > have:
        raise Error(f"{format_size(nbytes)} per buffer needs about {format_size(need)} of memory on one machine "
                    f"(3 buffers per rank{f', {ranks_here} ranks' if ranks_here > 1 else ''}), more than "
                    f"its {format_size(have)}: give a smaller --bytes")


def _size(text, what):
    try:
        n = parse_size(text.strip())
    except ValueError as exc:
        raise Error(f"{what}: {exc}") from None
    return n


def _parse_int(text, what, minimum=0):
    try:
        value = int(str(text).strip())
    except ValueError:
        raise Error(f"{what} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise Error(f"{what} must be at least {minimum}, got {value}")
    return value


def parse_names(text, choices, what):
    """Comma-separated names from ``choices``, in any case (order kept, duplicates dropped); ``none``
    alone, or nothing, is []. An empty entry (``mpi,``) or ``none`` beside names is refused: a typo
    that would otherwise change what runs without a word."""
    try:
        items = [name.lower() for name in comma_separated(text)]
    except ValueError as exc:
        raise Error(f"{what}: {exc}") from None
    if items in ([], ["none"]):
        return []
    if "none" in items:
        raise Error(f"{what}: 'none' stands alone; give none or names from {', '.join(choices)}")
    for name in items:
        if name not in choices:
            raise Error(f"{what}: unknown name {name!r}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(items))


def options(topology=None, bytes="64MiB", max_bytes=None, factor=None, iters="5", warmup="1",
            dtype="float32", op="sum", algorithms="auto", peers="mpi", json=False, plot=None,
            progress=None, scale=None, device="cpu", links=False, trace=None, writes_plot=True):
    """Validated :class:`Options` from command-line strings; raises :class:`ddl.Error`.

    The topology file is checked here, on every rank (every rank loads it); the plot and trace paths
    only where ``writes_plot`` (rank 0 of a job: the only rank that writes them, in its own working
    folder). Under MPI those checks can differ between ranks, so a job's ranks :func:`agree` on the
    outcome.
    """
    from .planner import algorithm_names

    dtype, op, device = (str(value).strip().lower() for value in (dtype, op, device))  # as --peers: any case
    if dtype not in DTYPES:
        raise Error(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if op not in OPS:
        raise Error(f"--op {op!r} is not supported; choose one of {', '.join(OPS)}")
    if device not in DEVICES:
        raise Error(f"--device {device!r}: choose cpu or gpu")
    peer_names = parse_names(peers, PEERS, "--peers")
    if device == "cpu" and "nccl" in peer_names:
        raise Error("--peers nccl compares GPU buffers: add --device gpu (or leave nccl out)")
    if device == "gpu" and "gloo" in peer_names:
        raise Error("--peers gloo runs on host buffers: with --device gpu compare with mpi,nccl")
    algos = ["auto"] + [a for a in parse_names(algorithms, ("auto", *algorithm_names()), "--algorithms")
                        if a != "auto"]
    sizes = parse_sizes(bytes, max_bytes, factor)
    check_sizes(sizes, dtype, device)
    if topology is not None:
        topology = os.path.abspath(topology)
        if os.path.isdir(topology):
            raise Error(f"{topology} is a folder: name a topology file in it (YAML or JSON)")
        if not os.path.isfile(topology):
            raise Error(f"{topology}: no such topology file")
    if plot is not None:
        if writes_plot:
            check_plot_path(plot)       # as given: os.path.abspath('') would be the current folder
        plot = os.path.abspath(plot)
    if trace is not None:
        if device == "gpu":
            raise Error("--trace follows the messages of ddl's host executor: it is not available with "
                        "--device gpu")
        if writes_plot:
            check_output_file("--trace", trace, "trace.json")
        trace = os.path.abspath(trace)
    if scale is not None:
        try:
            scale = float(scale)
        except ValueError:
            raise Error(f"--scale must be a number, got {scale!r}") from None
        if not (scale > 0 and math.isfinite(scale)):
            raise Error(f"--scale must be a positive number, got {scale}")
        if topology is None:
            raise Error("--scale needs a topology FILE (it scales that file's links)")
    return Options(topology=topology, sizes=sizes,
                   iters=_parse_int(iters, "--iters", minimum=1),
                   warmup=_parse_int(warmup, "--warmup", minimum=0), dtype=dtype, op=op,
                   algorithms=algos, peers=peer_names, json=bool(json), plot=plot, progress=progress,
                   scale=None if scale in (None, 1.0) else scale, device=device, links=bool(links),
                   trace=trace)


def scaled_topology(topo, scale):
    """``topo`` with every network link (neither end a rank) at ``scale`` times its bandwidth.

    What ``ddl emulate run --scale F`` builds: it shapes host-switch and switch-switch links and leaves
    links inside a host (shared memory) and the reduction speed as they are.
    """
    from .topology import Topology
    from .units import parse_bandwidth

    if not scale or scale == 1.0:
        return topo
    data = topo.to_dict()
    ranks = set(topo.ranks)
    for link in data["links"]:
        if link["a"] not in ranks and link["b"] not in ranks:
            link["bandwidth"] = parse_bandwidth(link["bandwidth"]) * scale
    data["name"] = f"{topo.name}@{scale:g}"
    return Topology.from_dict(data, source=topo.source)


def check_plot_path(path):
    """Fail before a long run, not after it: a file that can be written, in a format matplotlib knows."""
    check_output_file("--plot", path, "bench.png")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in ("png", "pdf", "svg", "jpg", "jpeg"):
        raise Error(f"--plot {path}: write a .png, .pdf, .svg or .jpg file")


# ---- errors a job's ranks agree on ---------------------------------------------------------------------
class JobError(Error):
    """An error every rank of the job knows of (see :func:`agree`), so that none waits for the others.

    ``speaks`` is True on one rank only, the first that met it: that rank says it, the others exit
    with the same status and say nothing, so the job prints it once.
    """

    def __init__(self, message, speaks):
        super().__init__(message)
        self.speaks = speaks


def agree(world, check):
    """``check()`` on every rank of ``world``, then one allgather, so that an :class:`Error` that only
    some ranks meet (a file one host lacks, a working folder that differs) stops every rank alike.

    Returns what ``check`` returned when no rank raised; else raises :class:`JobError` on every rank,
    with the message of the first rank that raised. ``check`` must not communicate unless it raises
    on every rank alike: a rank that raised early would not be there to answer.
    """
    try:
        value, problem = check(), None
    except Error as exc:
        value, problem = None, str(exc)
    for rank, message in enumerate(world.allgather(problem)):
        if message is not None:
            raise JobError(message, speaks=rank == world.rank)
    return value


# ---- buffers and the expected result -------------------------------------------------------------------
def pattern(count, rank, dtype):
    """Rank ``rank``'s send buffer: small non-negative integers with period :data:`PATTERN_PERIOD`."""
    period = (7 * np.arange(PATTERN_PERIOD, dtype=np.int64) + 13 * rank) % PATTERN_PERIOD
    return np.resize(period.astype(dtype), count)


def expected(count, nranks, dtype, op):
    """The exact allreduce of every rank's :func:`pattern`."""
    periods = np.stack([(7 * np.arange(PATTERN_PERIOD, dtype=np.int64) + 13 * r) % PATTERN_PERIOD
                        for r in range(nranks)])
    reduce = {"sum": periods.sum, "max": periods.max, "min": periods.min}[op]
    return np.resize(reduce(axis=0).astype(dtype), count)


def poison(buf):
    buf.fill(np.nan if buf.dtype.kind == "f" else -1)


class HostMemory:
    """Where the benchmark's buffers live: host memory (numpy). :class:`ddl.gpu.bench.DeviceMemory`
    is the GPU one; the benchmark loop only talks to these methods."""

    name = "cpu"
    label = "host memory"

    def upload(self, host):
        return host

    def empty_like(self, a):
        return np.empty_like(a)

    def download(self, a, out=None):
        if out is None:
            return a
        np.copyto(out, a)
        return out

    def upload_into(self, dst, host):
        np.copyto(dst, host)

    def poison(self, a):
        poison(a)

    def sync(self):
        pass

    def mpi_staging(self):
        return False

    def attach(self, comm):
        pass


def make_memory(device, world):
    """The memory of ``--device`` (collective: on the GPU every rank picks its device)."""
    if device == "gpu":
        from .gpu.bench import DeviceMemory
        return DeviceMemory(world)
    return HostMemory()


# ---- implementations -----------------------------------------------------------------------------------
class Skip(Exception):
    """This implementation cannot run here (the reason is the message); the others go on."""


class DdlImpl:
    kind = "ddl"

    def __init__(self, world, topo, algorithm, memory):
        import ddl
        self.algorithm = algorithm
        self.name = "ddl" if algorithm == "auto" else f"ddl:{algorithm}"
        self.comm = ddl.Communicator(world, topology=topo, algorithm=algorithm)
        memory.attach(self.comm)
        self.memory = memory
        self.op = {"sum": ddl.SUM, "max": ddl.MAX, "min": ddl.MIN}
        self.schedule = None
        self.path = ""                 # what ran when no schedule did: "local" (1 rank) or "inline"

    def prepare_size(self, nbytes):
        """Plan outside the timed region; raises Skip when the algorithm cannot plan this size."""
        self.schedule = None
        if self.comm.size == 1:
            self.path = "local"
            return
        if self.memory.name == "cpu" and nbytes <= self.comm.inline_bytes:
            self.path = "inline"       # reduced from the shared-memory agreement board: no schedule runs
            return
        self.path = ""
        try:
            self.schedule = self.comm.plan(nbytes)
        except PlanError as exc:       # said beside the implementation's name: the algorithm's once
            raise Skip(str(exc).removeprefix(f"{self.algorithm}: ")) from None

    def prepare(self, send, recv):
        self.memory.poison(recv)

    def call(self, send, recv, op):
        self.comm.Allreduce(send, recv, op=self.op[op])

    def close(self):
        self.comm.Free()


class MpiImpl:
    """The MPI library's allreduce. On device buffers without a CUDA-aware MPI it is handed host
    copies (down, allreduce, up, all timed): what a framework without CUDA-aware MPI has to do."""

    kind = "peer"
    name = "mpi"

    def __init__(self, world, memory):
        from mpi4py import MPI
        self.comm = world.Dup()
        self.op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self.library = " ".join(MPI.Get_library_version().splitlines()[0].split()).replace("Version: ", "")
        self.memory = memory
        self.staged = bool(world.allreduce(int(memory.mpi_staging()), op=MPI.MAX))
        if memory.name == "gpu":
            self.library += ", host-staged" if self.staged else ", CUDA-aware"
        self._host = None

    def prepare_size(self, nbytes):
        self._host = None

    def prepare(self, send, recv):
        self.memory.poison(recv)

    def call(self, send, recv, op):
        if not self.staged:
            self.comm.Allreduce(send, recv, op=self.op[op])
            return
        if self._host is None:         # host copies, made at the first call of a size
            hsend = self.memory.download(send)
            self._host = (hsend, np.empty_like(hsend))
        else:
            self.memory.download(send, out=self._host[0])
        hsend, hrecv = self._host
        self.comm.Allreduce(hsend, hrecv, op=self.op[op])
        self.memory.upload_into(recv, hrecv)

    def close(self):
        self.comm.Free()


class GlooImpl:
    """torch.distributed with the gloo backend; all_reduce is in place, so recv gets a copy of send
    (outside the timed region) and is reduced in place."""

    kind = "peer"
    name = "gloo"

    def __init__(self, world):
        import datetime

        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns about namespaced host names
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)  # ranks share the machine's cores; gloo has its own threads
        addr, port, ifname = _rendezvous(world)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=world.rank,
                                world_size=world.size, timeout=datetime.timedelta(minutes=30))
        self.op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self.library = f"torch {torch.__version__} gloo ({addr}:{port}{', ' + ifname if ifname else ''})"
        self._tensor = None

    def prepare_size(self, nbytes):
        self._tensor = None

    def prepare(self, send, recv):
        np.copyto(recv, send)
        if self._tensor is None or self._tensor.data_ptr() != recv.ctypes.data:
            self._tensor = self.torch.from_numpy(recv)

    def call(self, send, recv, op):
        self.dist.all_reduce(self._tensor, op=self.op[op])

    def close(self):
        try:
            self.dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at exit
            pass


def torch_problem():
    """None when torch imports, else why not (one line)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch cannot be imported ({exc}); pip install torch"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def _interface_address(ifname):
    """IPv4 address of a local interface (Linux), or None."""
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def _rendezvous(world):
    """(address, port, socket interface) for gloo, chosen by rank 0 and broadcast.

    MASTER_ADDR / MASTER_PORT / GLOO_SOCKET_IFNAME from the environment win. Inside ``ddl emulate``
    rank 0's ``eth0`` address (host 0, 198.18.0.10) and ``eth0``; one machine: 127.0.0.1 and ``lo``;
    several machines: rank 0's host name.
    """
    from mpi4py import MPI
    names = world.allgather(MPI.Get_processor_name())
    choice = None
    if world.rank == 0:
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        addr = os.environ.get("MASTER_ADDR")
        if os.environ.get("DDL_EMULATED_CLUSTER") and _interface_address("eth0"):
            addr = addr or _interface_address("eth0")
            ifname = ifname or "eth0"
        elif len(set(names)) == 1:
            addr = addr or "127.0.0.1"
            ifname = ifname or "lo"
        else:
            addr = addr or socket.gethostbyname(socket.gethostname())
        port = os.environ.get("MASTER_PORT")
        if not port:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
                port = s.getsockname()[1]
        choice = (addr, int(port), ifname)
    return world.bcast(choice, root=0)


# ---- progress --------------------------------------------------------------------------------------------
class Progress:
    """A progress line on stderr (rank 0): shown once the run has lasted ``after`` seconds.

    On a terminal a bar redrawn in place; otherwise (mpiexec pipes stderr) a line every ``every`` s.
    """

    def __init__(self, total, enabled=None, stream=None, after=3.0, every=10.0):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.after, self.every = after, every
        self.t0 = time.monotonic()
        self.last = None
        self.drawn = False

    def step(self, amount, what):
        self.done += amount
        if self.enabled is False:
            return
        now = time.monotonic()
        elapsed = now - self.t0
        if self.enabled is None and elapsed < self.after:
            return
        if self.last is not None and now - self.last < (0.2 if self.tty else self.every):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        left = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        text = f"{frac * 100:3.0f}% {what}, {elapsed:.0f} s elapsed, ~{left:.0f} s left"
        if self.tty:
            width = 24
            bar = "#" * int(frac * width) + "." * (width - int(frac * width))
            self.stream.write(f"\r\x1b[Kddl bench [{bar}] {text}")
            self.drawn = True
        else:
            self.stream.write(f"ddl bench: {text}\n")
        self.stream.flush()

    def clear(self):
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False


# ---- the run ---------------------------------------------------------------------------------------------
def run(opts, world=None, out=None, err=None):
    """Benchmark as ``opts`` says on every rank of ``world`` (default COMM_WORLD); rank 0 reports.

    Returns the exit status: 0, or 1 when some result was wrong (on every rank: rank 0 decides).
    :func:`measure` gives the rows themselves.
    """
    from mpi4py import MPI
    world = world or MPI.COMM_WORLD
    out = out or sys.stdout
    err = err or sys.stderr
    rows, notes, header = measure(opts, world, out=out, err=err)
    status, failure = 0, None
    if rows is not None:
        if opts.json:
            json.dump(rows, out, indent=2)
            out.write("\n")
        else:
            print_summary(rows, out, emulated=bool(os.environ.get("DDL_EMULATED_CLUSTER")),
                          topology_file=opts.topology, mpi_library=MPI.Get_library_version())
        out.flush()
        status = 1 if any(r["wrong"] for r in rows) else 0
        if opts.plot:
            try:
                plot(rows, opts.plot, header["title"])
                print(f"ddl bench: plot written to {opts.plot}", file=err)
            except Error as exc:
                failure = str(exc)
    status, failure = world.bcast((status, failure), root=0)
    if failure:
        raise JobError(failure, speaks=world.rank == 0)  # on every rank, so that none waits for the others
    return status


def measure(opts, world=None, out=None, err=None, memory=None):
    """Run the benchmark; rank 0 returns ``(rows, notes, header)``, other ranks ``(None, None, None)``.

    Rank 0 prints the table (unless ``opts.json``) row by row to ``out`` and notes to ``err``.
    ``memory``: where the buffers live (default :func:`make_memory` of ``opts.device``).
    """
    from mpi4py import MPI

    world = world or MPI.COMM_WORLD
    rank, nranks = world.rank, world.size
    out = out or sys.stdout
    err = err or sys.stderr
    _same_options(opts, world)
    topo = agree(world, lambda: _load_topology(opts, nranks))
    ranks_here = _ranks_on_this_machine(world)
    dtype = np.dtype(opts.dtype)
    counts = element_counts(opts.sizes, dtype.itemsize)
    agree(world, lambda: check_sizes(opts.sizes, opts.dtype, opts.device, ranks_here))
    if topo is None and nranks > 1:
        from .planner import flat_topology
        model = flat_topology(nranks)
    else:
        model = topo
    lead = rank == 0
    notes = []

    def note(text):
        notes.append(text)
        if lead:
            print(f"ddl bench: {text}", file=err, flush=True)

    memory = memory or agree(world, lambda: make_memory(opts.device, world))
    impls = agree(world, lambda: [DdlImpl(world, topo, a, memory) for a in opts.algorithms])
    for peer in opts.peers:
        if peer == "mpi":
            impls.append(MpiImpl(world, memory))
        elif peer == "nccl":
            from .gpu.bench import NcclImpl
            try:
                impls.append(NcclImpl(world, memory))
            except Skip as exc:
                note(f"nccl skipped: {exc}")
        elif peer == "gloo":
            problems = [p for p in world.allgather(torch_problem()) if p]
            if problems:
                note(f"gloo skipped: {problems[0]}")
                continue
            impls.append(GlooImpl(world))

    meter = agree(world, lambda: _link_meter() if opts.links and lead else None)
    tracing = Tracing(world, impls) if opts.trace else None
    if len(counts) < len(opts.sizes):
        note(f"sizes are whole {dtype.name} elements ({dtype.itemsize} B): {len(opts.sizes) - len(counts)} of "
             f"the sizes asked for rounded down onto another or to nothing")
    header = _header(opts, topo, model, nranks, impls, memory)
    widths = widths_for([impl.name for impl in impls])
    if lead and not opts.json:
        for line in header["lines"]:
            print(line, file=out)
        for text in notes:
            print(f"# {text}", file=out)
        print(table_header(widths), file=out, flush=True)

    total = sum(c * dtype.itemsize for c in counts) * len(impls) * (opts.iters + opts.warmup)
    progress = Progress(total, opts.progress) if lead else None
    rows = []
    for count in counts:
        nbytes = count * dtype.itemsize
        send = memory.upload(pattern(count, rank, dtype))
        recv = memory.empty_like(send)
        want = expected(count, nranks, dtype, opts.op)
        active, skipped = [], []
        for impl in impls:
            try:
                impl.prepare_size(nbytes)
                active.append(impl)
            except Skip as exc:
                skipped.append((impl.name, exc))
                if opts.json:          # else said under the size's rows of the table
                    note(f"{impl.name} skipped at {format_size(nbytes)}: {exc}")
        times = {impl.name: [] for impl in active}
        wrong = {}
        for impl in active:
            for _ in range(opts.warmup):
                _timed(impl, world, send, recv, opts.op, memory)
                if progress:
                    progress.step(nbytes, f"{format_size(nbytes)} {impl.name} warm-up")
        if meter:
            meter.clear()
        for it in range(opts.iters):
            for impl in active:
                call = functools.partial(_timed, impl, world, send, recv, opts.op, memory)
                if tracing:
                    call = tracing.recorded(impl, (impl.name, nbytes, it), call)
                times[impl.name].append(meter.around(impl.name, call) if meter else call())
                if it == opts.iters - 1:
                    mine = int(np.count_nonzero(memory.download(recv) != want))
                    wrong[impl.name] = world.allreduce(mine, op=MPI.SUM)
                if progress:
                    progress.step(nbytes, f"{format_size(nbytes)} {impl.name} iteration {it + 1}/{opts.iters}")
        moments = tracing.gather() if tracing else {}
        predictions = _predictions(active, model, nbytes) if lead and model is not None else {}
        bound = predictions.pop("__bound__", None)
        if not lead:
            continue
        for impl in active:
            row = _row(impl, nbytes, count, opts, nranks, times[impl.name], wrong[impl.name], bound,
                       predictions.get(impl.name), topo)
            if meter:
                row.update(_link_fields(meter, impl, model, nbytes))
            if tracing and impl.name in tracing.traces:
                row["trace"] = trace_medians(moments, impl.name, nbytes)
            rows.append(row)
            if not opts.json:
                if progress:
                    progress.clear()
                print(format_row(row, widths), file=out, flush=True)
        if meter and not opts.json:
            for line in link_lines(rows[len(rows) - len(active):]):
                print(line, file=out, flush=True)
        if tracing and not opts.json:
            for line in trace_lines(rows[len(rows) - len(active):]):
                print(line, file=out, flush=True)
        for name, why in skipped:
            if not opts.json:
                print(f"# {format_size(nbytes)} {name}: skipped: {why}", file=out)
    if progress:
        progress.clear()
    if tracing:
        tracing.close()
        failure = tracing.write(opts.trace, err) if lead else None
        failure = world.bcast(failure, root=0)
        if failure:
            raise JobError(failure, speaks=lead)
    for impl in impls:
        impl.close()
    if not lead:
        return None, None, None
    return rows, notes, header


def _link_meter():
    """Rank 0's :class:`~ddl.emulate.counters.Meter` of the emulated cluster it runs in (``--links``),
    read once here so that a cluster it cannot read stops the job before it measures."""
    from .emulate import counters
    links = counters.shaped_links(counters.current_cluster())
    counters.read(links)
    return counters.Meter(links)


def _link_fields(meter, impl, model, nbytes):
    """A row's ``link_bytes`` (measured, per iteration) and, for a schedule of ddl's,
    ``link_bytes_planned`` (the data its schedule puts on each link: from the simulation that
    :func:`_predictions` ran, which the schedule remembers)."""
    from .emulate import counters
    from .simulate import simulate
    fields = {"link_bytes": meter.per_call(impl.name)}
    if impl.kind == "ddl" and impl.schedule is not None and model is not None:
        totals = simulate(model, impl.schedule, nbytes).link_bytes
        fields["link_bytes_planned"] = counters.planned(model, meter.links, totals)
    return fields


class Tracing:
    """``--trace``: ddl's timed calls recorded on every rank (:mod:`ddl.trace`), gathered on rank 0 after
    each size, on rank 0's clock, and written there as one Chrome trace. A label is ``(implementation,
    bytes, iteration)``. Creating it is collective over ``world`` (host names, clock offsets)."""

    def __init__(self, world, impls):
        from mpi4py import MPI

        from . import trace
        self.world = world
        self.traces = {impl.name: trace.MessageTrace(impl.comm) for impl in impls if impl.kind == "ddl"}
        self.hosts = world.allgather(MPI.Get_processor_name())
        self.offsets = trace.clock_offsets(world)
        self.events = [[] for _ in range(world.size)]    # (rank 0's) everything gathered, aligned

    def recorded(self, impl, label, call):
        """``call`` with ``impl``'s messages recorded under ``label`` (``call`` itself if not traced)."""
        traced = self.traces.get(impl.name)
        if traced is None:
            return call

        def run():
            with traced.recording(label):
                return call()
        return run

    def gather(self):
        """Every rank's events since the last gather to rank 0 (collective); rank 0 gets their
        :func:`ddl.trace.summary`, the other ranks ``{}``."""
        from . import trace
        mine = [event for traced in self.traces.values() for event in traced.take()]
        got = trace.gather(self.world, mine, self.offsets)
        if got is None:
            return {}
        for kept, new in zip(self.events, got):
            kept.extend(new)
        return trace.summary(got, self.hosts)

    def write(self, path, err):
        """Rank 0: write the Chrome trace to ``path``; None, or what went wrong (one line)."""
        from . import trace
        from .schedule import write_file
        document = trace.chrome_trace(self.events, self.hosts, name_of=_trace_name)
        try:
            write_file(path, json.dumps(document))
        except OSError as exc:
            return f"--trace {path}: cannot write the trace ({exc.strerror or exc})"
        print(f"ddl bench: trace written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)",
              file=err, flush=True)
        return None

    def close(self):
        for traced in self.traces.values():
            traced.close()


def _trace_name(label):
    impl, nbytes, it = label
    return f"{impl} {format_size(nbytes)} #{it + 1}"


TRACE_MOMENTS = ("agreement", "first_message", "last_message", "end")


def trace_medians(moments, impl, nbytes):
    """The ``trace`` field of a ddl row: each moment of :func:`ddl.trace.summary` (seconds after the
    call began), the median over the row's iterations that had it, or None; and ``between``."""
    mine = [m for (name, size, _it), m in moments.items() if name == impl and size == nbytes]
    out = {}
    for key in TRACE_MOMENTS:
        seen = [m[key] for m in mine if m[key] is not None]
        out[key] = statistics.median(seen) if seen else None
    out["between"] = mine[0]["between"] if mine else "ranks"
    return out


# the options that decide what every rank sends, with their command-line names
_SHARED_OPTIONS = {"sizes": "--bytes", "iters": "--iters", "warmup": "--warmup", "dtype": "--dtype", "op": "--op",
                   "algorithms": "--algorithms", "peers": "--peers", "device": "--device", "scale": "--scale",
                   "links": "--links"}


def _same_options(opts, world):
    """Every rank was given the same options (an MPMD launch can give each its own): else one
    :class:`JobError` naming them, said once, instead of a mismatch in the first collective that every
    rank would report."""
    table = world.allgather({name: getattr(opts, name) for name in _SHARED_OPTIONS})
    differ = [name for name in _SHARED_OPTIONS if any(row[name] != table[0][name] for row in table)]
    if not differ:
        return

    def shown(name, value):
        if name == "sizes":
            return ",".join(format_size(n).replace(" ", "") for n in value)
        return ",".join(value) if isinstance(value, list) else str(value)
    groups = {}
    for r, row in enumerate(table):
        groups.setdefault(tuple(shown(n, row[n]) for n in differ), []).append(r)
    from .agreement import format_ranks
    parts = [f"{format_ranks(ranks)}: " + " ".join(f"{_SHARED_OPTIONS[n]} {v}" for n, v in zip(differ, values))
             for values, ranks in groups.items()]
    raise JobError(f"the ranks were given different options ({'; '.join(parts)}); give every rank the same "
                   f"command line", speaks=world.rank == 0)


def _load_topology(opts, nranks):
    """This rank's topology of ``opts`` (None without a file), scaled, for a job of ``nranks`` ranks.
    Each rank reads the file on its own host, so the ranks :func:`agree` on the outcome."""
    from .topology import Topology

    if not opts.topology:
        return None
    topo = Topology.load(opts.topology)
    if opts.scale:
        topo = scaled_topology(topo, opts.scale)
    if topo.nranks != nranks:
        where = ", ".join(filter(None, (opts.topology, named_by_env(opts.topology))))
        raise Error(f"topology {topo.name!r} ({where}) has {counted(topo.nranks, 'rank')} but this MPI job has "
                    f"{nranks}: run `mpiexec -n {topo.nranks} ddl bench ...`, or `ddl bench FILE` alone "
                    f"and it launches mpiexec itself")
    return topo


def _ranks_on_this_machine(world):
    """How many ranks of ``world`` share this rank's machine (and its memory)."""
    from mpi4py import MPI
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.size
    finally:
        local.Free()


def _timed(impl, world, send, recv, op, memory):
    """One iteration: prepare, barrier, time the call (until the device, if any, is done); the
    slowest rank's time."""
    from mpi4py import MPI
    impl.prepare(send, recv)
    memory.sync()
    world.Barrier()
    t0 = time.perf_counter()
    impl.call(send, recv, op)
    memory.sync()
    dt = time.perf_counter() - t0
    return world.allreduce(dt, op=MPI.MAX)


def _predictions(impls, model, nbytes):
    """Simulated time of the schedule each ddl implementation ran, and the lower bound (rank 0)."""
    from .bounds import lower_bound
    from .simulate import simulate

    out = {"__bound__": lower_bound(model, "allreduce", nbytes).seconds}
    for impl in impls:
        if impl.kind == "ddl" and impl.schedule is not None:
            out[impl.name] = (impl.schedule.algorithm, simulate(model, impl.schedule, nbytes).seconds)
    return out


def _row(impl, nbytes, count, opts, nranks, times, wrong, bound, prediction, topo):
    from .bounds import algbw, busbw
    seconds = statistics.median(times)
    row = {
        "impl": impl.name,
        "algorithm": (prediction[0] if prediction else impl.path) if impl.kind == "ddl"
        else getattr(impl, "library", impl.name),
        "collective": "allreduce",
        "bytes": nbytes,
        "count": count,
        "dtype": opts.dtype,
        "op": opts.op,
        "nranks": nranks,
        "topology": topo.name if topo is not None else None,
        "seconds": seconds,
        "times": times,
        "min_seconds": min(times),
        "max_seconds": max(times),
        "algbw": _finite(algbw(nbytes, seconds)),
        "busbw": _finite(busbw("allreduce", nbytes, seconds, nranks)) if nranks > 1 else 0.0,
        "wrong": wrong,
        "correct": wrong == 0,
        "predicted_seconds": prediction[1] if prediction else None,
        "bound_seconds": bound,
    }
    return row


def _finite(x):
    return x if math.isfinite(x) else None


def _header(opts, topo, model, nranks, impls, memory):
    where = (f"topology {topo.name} ({opts.topology}"
             + (f", network links scaled by {opts.scale:g}" if opts.scale else "") + ")" if topo is not None
             else f"flat topology of {counted(nranks, 'rank')} (no topology file)")
    emulated = os.environ.get("DDL_EMULATED_CLUSTER")
    names = []
    for impl in impls:
        names.append(impl.name if impl.kind == "ddl" else f"{impl.name} ({impl.library})")
    lines = [f"# ddl bench: allreduce on {counted(nranks, 'rank')}, {where}"
             + (f", emulated cluster {emulated!r}" if emulated else ""),
             f"# {opts.dtype}, {opts.op}, buffers in {memory.label}; {counted(opts.iters, 'iteration')} "
             f"(+{opts.warmup} warm-up) per size and implementation; time = median over iterations of the "
             f"slowest rank (barrier before each)",
             f"# implementations: {', '.join(names)}",
             "# predicted: ddl's simulator for the schedule that ran; bound: lower bound for any algorithm of "
             "point-to-point transfers at " + ("the file's link rates" if topo is not None else
                                               f"a flat network's ({FLAT_BANDWIDTH} per rank; no topology file)")]
    title = f"allreduce {opts.dtype}, {counted(nranks, 'rank')}, " + (topo.name if topo is not None else "flat")
    return {"lines": lines, "title": title}
