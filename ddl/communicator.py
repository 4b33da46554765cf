"""``ddl.Communicator``: topology-planned collectives with mpi4py's calling conventions.

Usage (run with ``mpiexec -n 8 python -m mpi4py train.py`` so that an uncaught exception on any rank
aborts the whole job instead of leaving the other ranks waiting)::

    from mpi4py import MPI
    import ddl
    comm = ddl.Communicator(MPI.COMM_WORLD, topology="topologies/dgx1-v100.yaml")
    comm.Allreduce(sendbuf, recvbuf, op=ddl.SUM)
    comm.Allreduce(ddl.IN_PLACE, grads, op=ddl.AVG)
    req = comm.Iallreduce(a, b); ...; req.Wait()
    comm.Reduce_scatter_block(sendbuf, recvbuf)     # sendbuf: size*n elements, recvbuf: n
    comm.Allgather(sendbuf, recvbuf)                # sendbuf: n, recvbuf: size*n
    comm.Bcast(buf, root=0)
    comm.plan(nbytes)                               # the Schedule that would run
    avg = comm.allreduce(array, op=ddl.AVG)         # functional, returns a new array
    outs = comm.grouped_allreduce([a, b, c])        # one fused collective per dtype

Semantics follow MPI/mpi4py: the same calls in the same order on every rank, buffers as mpi4py buffer
specs (see :mod:`ddl.buffers`), ``ddl.IN_PLACE`` (or ``MPI.IN_PLACE``) as the send buffer. Results are
bitwise identical on every rank and every run: the reduction order is a fixed function of the plan.

Safety nets (see :mod:`ddl.agreement` and :mod:`ddl.executor`): before its data moves, every collective
is checked across ranks (a mismatch raises :class:`ddl.MismatchError` on every rank, naming what
differs and where; through a shared-memory board when all ranks share a node, else one
``MPI_Iallreduce`` of a signature hash; a call one rank refuses for its arguments enters the check as a
refusal, so the others raise MismatchError at once instead of waiting for it); a collective that makes no progress for ``stall_warning``
seconds prints which ranks and steps it waits for, and after ``stall_timeout`` raises
:class:`ddl.StallError` naming them; a communicator that raised StallError refuses further calls.
A rank that dies: with ``python -m mpi4py`` its uncaught exception calls ``MPI_Abort`` and mpiexec
ends the job naming it; without, the survivors' watchdog raises StallError naming it ("no word from
rank 3").

Progress: one engine per communicator drives every in-flight collective whenever any ``Wait``/``Test``
runs (and the engines of the process's other ddl communicators, like MPI's progress), so ranks that
wait on different requests cannot deadlock. Waiting ranks sleep instead of spinning when the node is
oversubscribed (see :mod:`ddl.executor`).

Scratch: reductions receive into per-plan scratch buffers reused across calls (``ufunc(local,
scratch, out=local)``, no temporaries); ``Allreduce(sendbuf, recvbuf)`` reads ``sendbuf`` directly
(no copy into ``recvbuf`` first).

Reduce-scatter and allgather buffers: ``Allgather(sendbuf, recvbuf)`` runs in ``recvbuf`` directly
(the own block is read from ``sendbuf`` and copied into its place once); ``Reduce_scatter_block``
reads ``sendbuf`` without modifying it, reduces the blocks that are forwarded in a cached workspace
and the own block directly into ``recvbuf`` -- no copy of ``sendbuf`` is made. With ``IN_PLACE``,
``recvbuf`` holds ``size*n`` inputs, is used as the workspace (it is overwritten) and the result ends
in its first ``n`` elements, as in MPI.

Not thread safe: one thread at a time may be inside ddl (any of its communicators, see
:func:`_one_thread`); another that calls in meanwhile gets a :class:`ddl.Error` at once.
"""
import functools
import math
import os
import re
import threading
import weakref

import numpy as np

from .agreement import (CHECK_MODES, ShmBoard, Signature, announced, array_text, device_start, digest62,
                        format_ranks, grouped, refusal, shape_shown)
from .buffers import IN_PLACE, is_in_place, like_input, parse_buffer, torch_bfloat16
from .gpu import check_settings as check_gpu_settings
from .gpu.buffers import is_device_buffer
from .errors import Error, MismatchError, PlanError, StallError
from .executor import _ENGINES, SCRATCH_BYTES, CompiledPlan, Engine, Execution, in_flight_everywhere, plan_settings
from .ops import LOGICAL, SUM, check_op_dtype, divided, divides_first, finish_average, resolve_op
from .schedule import COLLECTIVES, Schedule, collective_name
from .settings import env_flag, env_float, env_int, env_word, named_by_env
from .units import counted, message_size, whole_number

__all__ = ["Communicator", "Request", "IN_PLACE"]

_DEFAULT_STALL_WARNING = 60.0
_DEFAULT_STALL_TIMEOUT = 300.0
_ARG_CACHE_BYTES = 1 << 20  # Allreduce argument cache: arrays up to this size
_MAX_PLANS = 256


_INSIDE = threading.RLock()     # held by the thread that is inside ddl's API (see _one_thread)


def _one_thread(entry):
    """Decorator of the API's entry points: a thread that calls into ddl while another one is inside it
    (a blocking collective, a Wait, a Test) gets a :class:`ddl.Error` at once, before anything is
    posted. The engines of one process drive each other's messages (:meth:`Engine.poll`), so two
    threads inside at once, on one communicator or on two, would corrupt their books: wrong results,
    different on every rank, or MPI errors. Calls from different threads one after the other are
    fine, and the thread inside may enter again (the entry points call each other)."""
    name = entry.__name__

    @functools.wraps(entry)
    def guarded(self, *args, **kwargs):
        if not _INSIDE.acquire(False):
            raise Error(f"{name} called from thread {threading.current_thread().name!r} while another thread "
                        f"is inside ddl: ddl is not thread safe (the communicators of a process drive each "
                        f"other's messages); call it from one thread at a time")
        try:
            return entry(self, *args, **kwargs)
        finally:
            _INSIDE.release()
    return guarded


class Request:
    """Handle of a nonblocking ddl collective (``Wait``, ``Test``; ``wait``/``test`` aliases).

    Waiting on any request drives every collective in flight on the communicator.
    """

    __slots__ = ("_ex", "_engine", "_result")

    def __init__(self, ex, engine, result=None):
        self._ex, self._engine, self._result = ex, engine, result

    @_one_thread
    def Wait(self, status=None):
        """Block until the collective completed (raising its error, if it failed); returns True.
        ``status`` (mpi4py's) is accepted and left as it is: a collective has no source or tag to report."""
        self._engine.wait(self._ex)
        return True

    @_one_thread
    def Test(self, status=None):
        """Drive progress once; True when the collective completed."""
        return self._engine.test(self._ex)

    @_one_thread
    def wait(self):
        """Block until completion; returns the result array for functional calls (else True)."""
        self._engine.wait(self._ex)
        return True if self._result is None else self._result()

    @_one_thread
    def test(self):
        return self._engine.test(self._ex)

    @property
    def done(self):
        return self._ex.done

    @staticmethod
    def Waitall(requests, statuses=None):
        """Wait for every request, then raise the first one's error (in the list's order), if any: as
        MPI_Waitall, none is left pending because an earlier one failed."""
        first = None
        for r in requests:
            try:
                r.Wait()
            except Exception as exc:
                first = exc if first is None else first
        if first is not None:
            raise first
        return True

    @staticmethod
    def Testall(requests, statuses=None):
        return all([r.Test() for r in requests])

    def __repr__(self):
        return f"<ddl.Request {self._ex.label} #{self._ex.seq} {'done' if self._ex.done else self._ex.state}>"


_LAYOUT_COLLECTIVE = {"allreduce": "allreduce", "allreduce_inplace": "allreduce",
                      "reduce_scatter": "reduce_scatter", "reduce_scatter_inplace": "reduce_scatter",
                      "allgather": "allgather", "allgather_inplace": "allgather", "broadcast": "broadcast"}
_NOTHING = np.empty(0, np.uint8)


def _execution(entry, seq, send, recv, check, inline, sig=None):
    """The :class:`Execution` of call ``seq`` of a compiled ``entry`` (see Communicator._compiled);
    ``sig``: its signature where it is not the entry's (a functional allreduce's, shaped)."""
    plan, base, finish, label, _ = entry
    sig = base if sig is None else sig
    ex = Execution(plan, seq, sig, check, label, send, recv, finish)
    ex.inline = inline
    ex.sig_hash = sig.hash(seq)
    ex.salt = sig.base
    return ex


class _RecentArgs:
    """A recent Allreduce's arguments (see Communicator._recent_args): the arrays themselves (so that
    their ids cannot be reused while cached) and weak references to them (so that numpy refuses to
    resize them), their dtypes then, the parsed arguments of ``Communicator._start``, and ``quick``
    where the call may take the quick lane (else None): ``(compiled entry, inline input, a memoryview
    of its bytes, one of the signature vector)``; a memoryview copies onto the board fastest."""

    __slots__ = ("sendbuf", "recvbuf", "op", "recv_dtype", "send_dtype", "args", "weak", "quick")

    def __init__(self, sendbuf, recvbuf, op, args, quick):
        in_place = args[1] is None
        self.sendbuf, self.recvbuf, self.op, self.args, self.quick = sendbuf, recvbuf, op, args, quick
        self.recv_dtype = recvbuf.dtype
        self.send_dtype = None if in_place else sendbuf.dtype
        self.weak = (weakref.ref(recvbuf), None if in_place else weakref.ref(sendbuf))


def _inline_input(layout, send, recv, count, itemsize, root, rank, size, limit):
    """What this rank posts on the agreement board when the collective goes inline (every rank
    decides alike: it is a function of the signature), or None when it runs its schedule. A rank
    that contributes nothing (a broadcast's non-roots) posts an empty array. See Engine._inline_result."""
    if layout == "broadcast":
        return (recv if rank == root else _NOTHING) if count * itemsize <= limit else None
    if layout.startswith("allgather"):
        n = count // size
        if n * itemsize > limit:
            return None
        return send if send is not None else recv[rank * n:(rank + 1) * n]
    if count * itemsize > limit:   # allreduce, reduce-scatter: the whole input
        return None
    return send if send is not None else recv


def _functional(array):
    """``(input, output, result)`` of the functional API: a C-ordered input array, a new output of its
    shape, and what returns the result (see :func:`_returned`). Element-wise, unlike the buffer API,
    which reduces memory as it lies: a Fortran-ordered array on one rank and a C-ordered one on
    another must still meet element by element."""
    arr = _numbers(array, "allreduce")
    out = np.empty(arr.shape, arr.dtype)
    return arr, out, lambda: _returned(out, array)


def _returned(out, given):
    """The functional API's result ``out`` (a numpy array) in the kind of ``given``: a Python scalar for
    a Python scalar, a numpy scalar of its dtype for a numpy scalar, a tensor for a tensor, else the
    array."""
    if isinstance(given, (bool, int, float, complex)):
        return out.item()
    if isinstance(given, np.generic):
        return out[()]
    return like_input(out, given)


def _array_list(arrays, most=8):
    """``2 arrays: float64[3], float32[2, 2]`` (dtypes and shapes, in order; the first ``most``)."""
    shown = ", ".join(array_text(a.dtype.name, a.shape) for a in arrays[:most])
    more = f", ... ({len(arrays) - most} more)" if len(arrays) > most else ""
    return f"{counted(len(arrays), 'array')}: {shown}{more}"


def _numbers(array, what):
    """``array`` as a C-ordered numpy array, or a :class:`ddl.Error` saying why it is none (a ragged
    list, say), rather than numpy's ValueError."""
    if is_in_place(array):
        raise Error(f"{what} takes the array itself and returns the result in a new one; IN_PLACE belongs to the "
                    f"buffer API (comm.Allreduce(ddl.IN_PLACE, buf) reduces into buf)")
    try:
        arr = torch_bfloat16(array, what)
        if arr is None:
            arr = np.asarray(array)
    except (TypeError, ValueError, RuntimeError) as exc:   # RuntimeError: torch's (a tensor that requires grad)
        raise Error(f"{what}: the argument cannot be read as an array of numbers ({exc})") from None
    if arr.dtype.hasobject:
        big = any(isinstance(x, int) and not -2 ** 63 <= x < 2 ** 63 for x in arr.reshape(-1)[:1000])
        raise Error(f"{what}: " + ("a Python int beyond int64's range (Python ints reduce as int64); pass an array "
                                   "of a dtype that holds the values, or floats" if big else
                                   "the argument holds objects that are not numbers (numpy reads it as dtype object)"))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")   # (ascontiguousarray makes 0-d 1-d)


_LABEL = {"allreduce": "Allreduce", "reduce_scatter": "Reduce_scatter_block", "allgather": "Allgather",
          "broadcast": "Bcast", "grouped_allreduce": "grouped_allreduce"}


# A host collective's entry: an exception before the call took its sequence number (any: a ddl.Error, or
# numpy's own on an argument it cannot read) is announced to the other ranks first (see
# Communicator._announce_refusal), so the call sequences stay in step; nested entries announce once.
_announced = functools.partial(announced, counter="_seq", refuse="_announce_refusal")


def _mpi_reason(exc):
    """The line of an MPI error that says why: MPICH's text is a stack of calls, the cause last
    (``MPIR_Get_contextid_sparse_group(567): Too many communicators (0/2048 free ...)``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r"^\w+\(\d+\)\.*:\s*", "", lines[-1]) if lines else str(exc)


class Communicator:
    """Collectives planned for a topology and executed with nonblocking MPI point-to-point.

    Parameters
    ----------
    comm:
        an mpi4py communicator (default ``MPI.COMM_WORLD``). ddl duplicates it (twice: data and
        error-path traffic), so its messages never match yours. Construction is collective.
    topology:
        a file path, a :class:`ddl.Topology`, or None for a flat topology (every rank on one switch).
        When omitted, the environment variable ``DDL_TOPOLOGY`` may name the file. Its rank count
        must equal the communicator size; all ranks must use the same topology (checked).
    algorithm:
        ``"auto"`` (the planner picks per collective and size), an algorithm name for every
        collective, or a dict ``{collective: name}``.
    check:
        ``"always"`` (default, env ``DDL_CHECK``), ``"new"`` or ``"off"``; see :mod:`ddl.agreement`.
    stall_warning, stall_timeout:
        seconds without progress before a warning on stderr / a :class:`ddl.StallError`. Defaults
        60 and 300, or env ``DDL_STALL_WARNING`` / ``DDL_STALL_TIMEOUT``. Settable later. Positive;
        ``math.inf`` turns it off.
    planner:
        optional object with ``schedule(collective, nbytes, algorithm=, root=)`` returning a
        :class:`~ddl.schedule.Schedule` (default :class:`ddl.planner.Planner` on the topology);
        schedules from it are verified once before use.
    """

    _UNSET = object()

    def __init__(self, comm=None, topology=_UNSET, *, algorithm="auto", check=None, stall_warning=None,
                 stall_timeout=None, planner=None):
        from mpi4py import MPI
        self._MPI = MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if isinstance(comm, Communicator):
            comm = comm.mpi_comm
        if not isinstance(comm, MPI.Comm):
            raise Error(f"comm must be an mpi4py communicator, got {comm!r}")
        if comm == MPI.COMM_NULL:
            raise Error("comm is a null communicator: MPI.COMM_NULL, or one that was freed")
        if comm.Is_inter():
            raise Error("ddl.Communicator needs an intracommunicator")
        self.mpi_comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        try:   # set-up errors of one rank (a file missing on its node) must not hang the others below
            stall, agreement, inline, scratch_bytes = self._configure(check, algorithm, stall_warning,
                                                                      stall_timeout, topology, planner)
        except Exception as exc:
            _all_set_up(comm, exc)
            raise
        _all_set_up(comm, None)

        made = []       # (created before any is used, so that running out of them leaks none)
        try:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED) if self.size > 1 else None
            made.append(node)
            self._pcomm = comm.Dup()
            made.append(self._pcomm)
            self._gcomm = comm.Dup()
        except MPI.Exception as exc:
            for c in made:
                if c is not None:
                    c.Free()
            raise Error(f"ddl.Communicator: MPI cannot create its private communicators ({_mpi_reason(exc)}): Free() the "
                        f"ddl.Communicators you no longer use (one that failed, or a `with` block left by an "
                        f"exception, keeps them: freeing is collective)") from None
        try:
            name = comm.Get_name() or "comm"
            self._pcomm.Set_name(f"ddl-data({name})")
            self._gcomm.Set_name(f"ddl-agree({name})")
        except Exception:  # pragma: no cover - names are cosmetic
            pass
        self._freed = False
        self._board = None
        local = node.Get_size() if node is not None else 1
        members = node.allgather((self.rank, _affinity())) if node is not None else [(self.rank, _affinity())]
        cores = len(set().union(*(cpus for _, cpus in members)))
        # ranks of this node, when the job spans several: the executor paces its sends to them (see
        # ddl.executor._pace_node_sends)
        self._node_peers = frozenset(r for r, _ in members if r != self.rank) if local < self.size else frozenset()
        if node is not None:
            node.Free()
        # the check runs through shared memory when every rank is on this node (see ddl.agreement)
        use_board = self.size > 1 and self.check == "always" and local == self.size and agreement != "mpi"
        self.agreement = "shared-memory" if use_board else ("mpi" if self.size > 1 else "none")
        # auto, with ddl's planner, on one node: the smallest collectives ride on the agreement board
        self._inline = {c: inline if use_board and planner is None and self._algorithm_of(c) == "auto" else 0
                        for c in _LABEL}
        self.inline_bytes = self._inline["allreduce"]
        self._agree_on_setup()
        if use_board:
            self._board = ShmBoard(self._pcomm)
        if self.oversubscribed is None:
            self.oversubscribed = local > cores
        self._engine = Engine(self._pcomm, self._gcomm, stall["stall_warning"], stall["stall_timeout"],
                              board=self._board, oversubscribed=self.oversubscribed, scratch_bytes=scratch_bytes)
        self._seq = 0
        self._plans = {}
        self._schedule_digests = {}
        self._seen = set()
        self._args = {}  # recent Allreduce arguments -> parsed (see _allreduce_start)
        self._functional_lanes = {}  # (dtype, shape, id(op)) -> the functional allreduce's quick lane
        self._shaped_sigs = {}  # (signature base, array shape) -> the functional allreduce's (see _shaped)
        self._device = None  # the device executor, created by the first collective on GPU buffers
        self.last_path = None  # "host", or the device path that ran last ("nccl", ...; see ddl.gpu)

    # ---- setup ----------------------------------------------------------------------------------
    @staticmethod
    def _algorithms(algorithm):
        if algorithm is None:
            algorithm = "auto"
        if isinstance(algorithm, str):
            return lambda coll: algorithm
        if isinstance(algorithm, dict):
            bad = [k for k in algorithm if k not in _LABEL]
            if bad:
                raise Error(f"algorithm dict keys must be collectives ({', '.join(_LABEL)}), got {bad}")
            return lambda coll: algorithm.get(coll, "auto")
        raise Error(f"algorithm must be a name or a dict {{collective: name}}, got {algorithm!r}")

    def _load_topology(self, topology):
        if topology is None:
            if self.size == 1:
                return None
            from .planner import flat_topology
            return flat_topology(self.size)
        if isinstance(topology, (str, os.PathLike)):
            from .topology import Topology
            return Topology.load(topology)
        if hasattr(topology, "fingerprint") and hasattr(topology, "nranks"):
            return topology
        raise Error(f"topology must be a file path, a ddl.Topology or None, got {type(topology).__name__}")

    def _configure(self, check, algorithm, stall_warning, stall_timeout, topology, planner):
        """This rank's own settings, checked (no communication): sets the attributes they give and returns
        ``(stall settings, agreement, inline limit, scratch budget)`` for the collective set-up."""
        if check is None:
            check = env_word("DDL_CHECK", "always", CHECK_MODES)
        elif check not in CHECK_MODES:
            raise Error(f"check must be one of {', '.join(CHECK_MODES)}, got {check!r}")
        self.oversubscribed = env_flag("DDL_OVERSUBSCRIBED", None)    # (None: counted below, in __init__)
        self.check = check
        self.algorithm = algorithm = "auto" if algorithm is None else algorithm
        self._algorithm_of = self._algorithms(algorithm)
        if self.size > 1 or planner is None:   # a name ddl does not know fails here, not at every call
            from .planner import check_algorithm
            for name in sorted(set(algorithm.values()) if isinstance(algorithm, dict) else {algorithm}):
                check_algorithm(name)
        stall = {}
        for name, given, default in (("stall_warning", stall_warning, _DEFAULT_STALL_WARNING),
                                     ("stall_timeout", stall_timeout, _DEFAULT_STALL_TIMEOUT)):
            env = f"DDL_{name.upper()}"
            stall[name] = (_seconds(name, given) if given is not None else
                           _seconds(name, env_float(env, default), f"env {env}"))

        if topology is Communicator._UNSET:
            topology = os.environ.get("DDL_TOPOLOGY") or None
        self.topology = self._load_topology(topology)
        if self.topology is not None and self.topology.nranks != self.size:
            source = getattr(self.topology, "source", None)
            where = f" ({', '.join(filter(None, (source, named_by_env(source))))})" if source else ""
            raise Error(f"topology {self.topology.name!r}{where} has {counted(self.topology.nranks, 'rank')} but "
                        f"the communicator has {counted(self.size, 'rank')}: use a topology whose ranks: list has "
                        f"one entry per process, or launch {counted(self.topology.nranks, 'process', 'processes')}")
        agreement = env_word("DDL_AGREEMENT", "auto", ("auto", "shm", "mpi"))
        limit = ShmBoard.inline_limit(self.size)
        inline = env_int("DDL_INLINE_BYTES", limit)
        if not 0 <= inline <= limit:
            raise Error(f"DDL_INLINE_BYTES must be between 0 and {limit} (min(1 MiB, 2 MiB / ranks)) "
                        f"on {self.size} ranks, got {inline}")
        scratch_bytes = env_int("DDL_SCRATCH_BYTES", SCRATCH_BYTES)
        if scratch_bytes < 0:
            raise Error(f"DDL_SCRATCH_BYTES must be zero or more bytes, got {scratch_bytes}")
        check_gpu_settings()   # read later, at the first device call: a typo fails here, GPUs or not
        plan_settings()        # read later, as plans are compiled: likewise
        self._planner = planner
        self._topology_digest = digest62(self.topology.fingerprint if self.topology is not None
                                         else f"flat-{self.size}")
        return stall, agreement, inline, scratch_bytes

    def _agree_on_setup(self):
        """All ranks must plan on the same topology with the same algorithm and check mode."""
        if self.size == 1:
            return
        h = digest62(self._topology_digest, repr(self.algorithm), self.check, self.agreement,
                     sorted(self._inline.items()))
        buf = np.array([h, -h, 0, 0], np.int64)
        self._pcomm.Allreduce(buf[:2], buf[2:], self._MPI.MAX)
        if buf[2] == -buf[3]:
            return
        mine = (self.topology.name if self.topology is not None else "flat",
                self.topology.fingerprint[:12] if self.topology is not None else "-", repr(self.algorithm),
                self.check, self.agreement, self.inline_bytes)
        table = self._gcomm.allgather(mine)
        groups = {}
        for r, sig in enumerate(table):
            groups.setdefault(sig, []).append(r)
        parts = [f"{format_ranks(rs)} {'uses' if len(rs) == 1 else 'use'} topology {t!r} (fingerprint {f}), "
                 f"algorithm={a}, check={c!r}, agreement {g} (env DDL_AGREEMENT), inline allreduce up "
                 f"to {i} bytes (env DDL_INLINE_BYTES; 0 with a custom planner)"
                 for (t, f, a, c, g, i), rs in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))]
        self._pcomm.Free()
        self._gcomm.Free()
        self._freed = True
        raise MismatchError("ranks created ddl.Communicator with different settings: " + "; ".join(parts))

    # ---- settings --------------------------------------------------------------------------------
    @property
    def stall_warning(self):
        return self._engine.stall_warning

    @stall_warning.setter
    def stall_warning(self, seconds):
        self._engine.stall_warning = _seconds("stall_warning", seconds)

    @property
    def stall_timeout(self):
        return self._engine.stall_timeout

    @stall_timeout.setter
    def stall_timeout(self, seconds):
        self._engine.stall_timeout = _seconds("stall_timeout", seconds)

    @property
    def planner(self):
        if self._planner is None:
            from .planner import Planner, flat_topology
            self._planner = Planner(self.topology if self.topology is not None else flat_topology(1))
        return self._planner

    # ---- planning --------------------------------------------------------------------------------
    def _schedule(self, collective, nbytes, root=0):
        if self.size == 1:
            sched = Schedule(collective, 1, (1,), ((),), root=0, algorithm="local")
        else:
            algorithm = self._algorithm_of(collective)
            # max(.., 1): the planner cannot rank algorithms on an empty message (all predict 0 s)
            sched = self.planner.schedule(collective, max(int(nbytes), 1), algorithm=algorithm, root=root)
        self._check_schedule(sched, collective, root)
        return sched

    def _check_schedule(self, sched, collective, root):
        """Once per schedule: it fits this call, is proven (foreign planners), and has a digest."""
        entry = self._schedule_digests.get(id(sched))
        if entry is not None and entry[0] is sched:
            return entry[1]
        if not isinstance(sched, Schedule):
            raise PlanError(f"planner returned {type(sched).__name__}, not a ddl Schedule")
        if sched.nranks != self.size or sched.collective != collective or (
                collective == "broadcast" and sched.root != root):
            raise PlanError(f"planner returned {sched!r} (root {sched.root}) for {collective} on "
                            f"{self.size} ranks (root {root})")
        from .planner import Planner
        if self.size > 1 and type(self.planner) is not Planner:
            from .verify import verify
            verify(sched)  # the built-in planner verifies; foreign ones (subclasses too) are proven here
        digest = digest62(sched.to_json())
        self._schedule_digests[id(sched)] = (sched, digest)
        return digest

    @staticmethod
    def _collective(name):
        """The planner's name of a collective given by it or by its method's (``"Bcast"``,
        ``"reduce_scatter_block"``), in any case; ddl.Error naming the choices for any other."""
        canonical = collective_name(name)
        if canonical not in COLLECTIVES:
            raise Error(f"collective must be one of {', '.join(COLLECTIVES)} (or a method's name: Allreduce, "
                        f"Reduce_scatter_block, Allgather, Bcast), got {name!r}")
        return canonical

    def plan(self, nbytes_or_buffer, collective="allreduce", root=0):
        """The :class:`~ddl.schedule.Schedule` that would run for this size (bytes) or buffer.

        (A collective whose per-rank input is at most :attr:`inline_bytes` runs on the shared-memory
        agreement board instead: every rank posts its input beside its signature and computes the
        result from all of them, reducing in rank order. ``inline_bytes`` is ``min(1 MiB, 2 MiB /
        ranks)`` (env ``DDL_INLINE_BYTES``, 0 turns it off) with ``algorithm="auto"`` and ddl's planner
        when all ranks share a node and the check is ``"always"``, else 0.)"""
        return self._schedule(self._collective(collective), _size_of(nbytes_or_buffer), root)

    def explain(self, nbytes_or_buffer, collective="allreduce", root=0):
        """The planner's full :class:`ddl.planner.Plan` (prediction, bound, alternatives; printed, a
        report) of what runs for this size (bytes) or buffer: a pinned schedule, or the plan held for
        its size class, is evaluated as it is."""
        planner = self.planner
        explain = getattr(planner, "explain", planner.plan)      # (a foreign planner may have plan() only)
        collective = self._collective(collective)
        return explain(collective, _size_of(nbytes_or_buffer), self._algorithm_of(collective), root)

    def _pinned(self, collective, root):
        """The schedule pinned on the planner for this call, or None (a foreign planner may not pin)."""
        pinned = getattr(self.planner, "pinned", None)
        return pinned(collective, root) if pinned is not None else None

    def _compiled(self, layout, count, dtype, op, root, sig_count):
        key = (layout, count, dtype, op, root)
        collective = _LAYOUT_COLLECTIVE[layout]
        pinned = self._pinned(collective, root)
        entry = self._plans.get(key)
        if entry is not None and (pinned is None or entry[0].schedule is pinned):
            return entry                         # (a schedule pinned since this was compiled replaces it)
        if op is not None:
            check_op_dtype(op, dtype)
        elif dtype.hasobject:
            raise Error("buffers of Python objects cannot be communicated; use a numeric dtype")
        sched = self._schedule(collective, count * dtype.itemsize, root)
        inline = self._inline[collective]      # (non-zero only with ddl's own planner)
        if pinned is not None:
            inline = 0                           # a pinned schedule runs at every size, the smallest too
        plan = CompiledPlan(sched, self.rank, count, dtype, layout, ufunc=op.ufunc if op is not None else None,
                            node_peers=self._node_peers)
        sig = Signature(collective, sig_count, dtype, op, root, self._check_schedule(sched, collective, root), self._topology_digest,
                        self.check)
        finish = self._finisher(layout, count, dtype, op)
        if len(self._plans) >= _MAX_PLANS:  # bounded: a plan keeps its scratch buffers
            del self._plans[next(iter(self._plans))]
        entry = self._plans[key] = (plan, sig, finish, _LABEL[collective] + f"({sig_count} x {dtype.name}"
                                    + (f", {op.name})" if op is not None else
                                       (f", root {root})" if collective == "broadcast" else ")")), inline)
        return entry

    def _finisher(self, layout, count, dtype, op):
        """What completes a collective's result in its output buffer once the schedule has run (an AVG's
        division, a reduce-scatter's block moved to the front...), called with that buffer; or None."""
        size, rank = self.size, self.rank
        average = op is not None and op.average and size > 1 and not divides_first(op, dtype, size)
        truth = size == 1 and op in LOGICAL   # nothing is reduced on one rank: make the 1 or 0 here
        if layout == "reduce_scatter_inplace":
            n = count // size

            def finish(buf):
                if rank:
                    buf[:n] = buf[rank * n:(rank + 1) * n]
                if average:
                    finish_average(buf[:n], size)
                if truth:
                    np.not_equal(buf[:n], 0, out=buf[:n])
            return finish
        if not (average or truth):
            return None
        n = count // size if layout == "reduce_scatter" else count

        def finish(buf):
            out = buf[:n]
            if average:
                finish_average(out, size)
            if truth:
                np.not_equal(out, 0, out=out)
        return finish

    # ---- the engine entry -----------------------------------------------------------------------
    def _start(self, layout, send, recv, count, dtype, op, root, sig_count, blocking=False, shape=None):
        """Start a collective; ``shape``: the array's, for the functional allreduce (see Signature.shaped)."""
        if self._freed:
            raise Error("this ddl.Communicator was freed")
        engine = self._engine
        if engine.inflight or engine.deferred or len(_ENGINES) > 1:   # (every communicator's: one buffer, one call)
            _check_not_in_flight(send, recv, in_flight_everywhere(), self._engine)
        if divides_first(op, dtype, self.size):
            layout, send, recv = self._divided_first(layout, send, recv, count)
        entry = self._compiled(layout, count, dtype, op, root, sig_count)
        plan, sig, _, _, limit = entry
        if shape is not None:
            sig = self._shaped(sig, shape)
        self._engine.admit(plan)   # may refuse the call: before it takes a sequence number
        seq = self._seq
        self._seq = seq + 1
        mode = self.check
        forget = None
        if self.size == 1:
            check = False
        elif mode == "always":
            check = True
        elif mode == "new":
            check = sig.base not in self._seen
            if check:
                self._seen.add(sig.base)
                forget = self._forget_signature
        else:
            check = False
        inline = _inline_input(layout, send, recv, count, dtype.itemsize, root, self.rank, self.size, limit) \
            if limit else None
        ex = _execution(entry, seq, send, recv, check, inline, sig)
        ex.on_error = forget
        self._engine.start(ex, blocking)
        return ex

    def _shaped(self, sig, shape):
        """``sig.shaped(shape)``, kept for the next call of a training loop (a few recent ones)."""
        key = (sig.base, shape)
        shaped = self._shaped_sigs.get(key)
        if shaped is None:
            if len(self._shaped_sigs) >= 64:
                del self._shaped_sigs[next(iter(self._shaped_sigs))]
            shaped = self._shaped_sigs[key] = sig.shaped(shape)
        return shaped

    def _divided_first(self, layout, send, recv, count):
        """``(layout, send, recv)`` of an AVG that divides every input first (float16, see
        :func:`ddl.ops.divides_first`): it runs out of place from a divided copy of the input, so the
        caller's buffers are untouched until the result lands (a call refused by the check loses
        nothing, in place too). In place, ``recv`` is the input, and the output (its first block for
        a reduce-scatter, where MPI puts it)."""
        if send is None:
            send = recv
            if layout == "reduce_scatter_inplace":
                recv = recv[:count // self.size]
            layout = layout.replace("_inplace", "")
        return layout, divided(send, self.size), recv

    def _forget_signature(self, ex):
        """check="new": a call whose check failed (MismatchError) is not "seen". Every rank checked it
        (else the check could not have completed) and added its own signature when it started; each
        forgets it when the error reaches the user -- at the same point of every rank's program, so the
        ranks' seen-sets stay alike and a corrected retry of the same call is checked on every rank
        (the ranks whose call had been right used to skip that check while the others waited in it)."""
        if isinstance(ex.error, MismatchError):
            self._seen.discard(ex.sig.base)

    def _announce_refusal(self, collective, exc):
        """Enter this rank's refusal of a ``collective`` call (``exc``) in the agreement and wait for it
        (check="always"). The outcome is added to ``exc`` as a note when the other ranks did not all
        refuse it too. In the other modes the others may not check this call at all, so the refusal
        just uses up the call's sequence number: the ranks that called correctly then fail in that call
        (StallError, or MismatchError where they check it) instead of pairing it with this rank's next
        call and computing with another call's data (they did, without a word)."""
        if self.size == 1 or self._freed or self._engine.broken is not None:
            return
        if self.check != "always":
            self._seq += 1
            exc.add_note(f"ddl: check={self.check!r}: the other ranks were not told; their ddl collective "
                         f"#{self._seq - 1} fails (StallError, or MismatchError where they check it)")
            return
        seq = self._seq
        try:
            self._engine.wait(self._agreement_only(refusal(collective, self._topology_digest, self.check),
                                                   f"{_LABEL[collective]} (refused)"))
        except MismatchError:
            exc.add_note(f"ddl: the other ranks were told; those that called correctly raise MismatchError "
                         f"for ddl collective #{seq}")
        except StallError as stall:
            exc.add_note(f"ddl: announcing this to the other ranks stalled: {stall}")

    def _reduction_args(self, sendbuf, recvbuf, op, what="Allreduce"):
        op = resolve_op(op)
        if is_in_place(sendbuf):
            recv = parse_buffer(recvbuf, "recvbuf", writable=True)
            return None, recv, op
        send = parse_buffer(sendbuf, "sendbuf")
        recv = parse_buffer(recvbuf, "recvbuf", writable=True)
        if send.dtype != recv.dtype:
            raise Error(f"{what}: sendbuf is {send.dtype} but recvbuf is {recv.dtype}; ddl does not convert")
        if _same_memory(send, recv, what):
            return None, recv, op  # Allreduce(buf, buf): in place
        return send, recv, op

    @_announced("allreduce")
    def _allreduce_start(self, sendbuf, recvbuf, op, blocking=False, shape=None):
        recent = self._recent_args(sendbuf, recvbuf, op)
        if recent is not None:
            return self._start(*recent.args, blocking, shape)
        send, recv, op_ = self._reduction_args(sendbuf, recvbuf, op)
        if send is None:
            args = ("allreduce_inplace", None, recv, recv.size, recv.dtype, op_, 0, recv.size)
        else:
            if send.size != recv.size:
                raise Error(f"Allreduce: sendbuf has {send.size} elements but recvbuf {recv.size}; they must match")
            args = ("allreduce", send, recv, recv.size, recv.dtype, op_, 0, recv.size)
        ex = self._start(*args, blocking, shape)
        if type(recvbuf) is np.ndarray and recv.nbytes <= _ARG_CACHE_BYTES and (
                type(sendbuf) is np.ndarray or is_in_place(sendbuf)):
            quick = None
            if ex.inline is not None and ex.check and not divides_first(op_, recv.dtype, self.size):
                layout, _, _, count, dtype, _, root, sig_count = args
                entry = self._compiled(layout, count, dtype, op_, root, sig_count)
                quick = (entry, ex.inline, memoryview(ex.inline.reshape(-1).view(np.uint8)),
                         memoryview(entry[1].vector))
            if len(self._args) >= 16:
                del self._args[next(iter(self._args))]
            self._args[(id(sendbuf), id(recvbuf), id(op))] = _RecentArgs(sendbuf, recvbuf, op, args, quick)
        return ex

    def _recent_args(self, sendbuf, recvbuf, op):
        """The :class:`_RecentArgs` of an Allreduce on these very arrays, or None: a training loop's
        gradient buffers, parsed once. Their memory cannot have moved (the entry holds weak references
        to them, and numpy refuses to resize an array that has one, even with refcheck=False); their
        dtypes and recvbuf's writability can change, and are checked again."""
        hit = self._args.get((id(sendbuf), id(recvbuf), id(op)))
        if hit is not None and hit.recvbuf is recvbuf and hit.sendbuf is sendbuf and hit.op is op and \
                recvbuf.dtype is hit.recv_dtype and (hit.send_dtype is None or sendbuf.dtype is hit.send_dtype) and \
                recvbuf.flags.writeable:
            return hit
        return None

    def _allreduce_quick(self, sendbuf, recvbuf, op):
        """The quick lane of a training loop's small blocking Allreduce: the same arrays as a recent call,
        inline on the shared-memory board, check="always", nothing else in flight on any
        communicator. The call is then the board exchange (:meth:`Engine.settle_alone`) with none of
        the general path's steps around it, which a repeated call has already passed: parsing, the
        plan's lookup, the refusals, the bookkeeping of an Execution. On 2 ranks with a core each an
        8-byte Allreduce takes 11-12 us this way instead of 21-23 us; on 8 ranks sharing 2 cores,
        where a call costs its CPU time several times over, 224-249 us instead of 308-326 us.

        Returns False, having done nothing, where the general path must take the call."""
        recent = self._recent_args(sendbuf, recvbuf, op)
        if recent is None or recent.quick is None or not self._quick_lane_open():
            return False
        entry, inline, inline_bytes, vector = recent.quick
        send, recv = recent.args[1:3]
        return self._run_quick(entry, vector, inline_bytes, send, recv, inline)

    def _quick_lane_open(self):
        """Whether nothing that a quick lane passes by needs to see the next call: nothing in flight on
        any communicator of this process, no failure, no trace, check="always", no pinned schedule."""
        engine = self._engine
        return not (engine.inflight or engine.deferred or engine.broken is not None or engine.hooked
                    or self._freed or self.check != "always" or self._pinned("allreduce", 0) is not None
                    or (len(_ENGINES) > 1 and any(in_flight_everywhere())))

    def _run_quick(self, entry, vector, data, send, recv, inline, sig=None, noted=None):
        """Run an inline allreduce of compiled ``entry`` in a quick lane (:meth:`_quick_lane_open`):
        ``vector`` and ``data`` are what it posts (its signature's vector, ``sig``'s where given, and
        its input), ``send`` and ``recv`` its parsed buffers, ``inline`` its input as an array. A slot
        that does not settle at once goes to the engine's books as the general path's would (its
        MismatchError noting the array ``noted``, see :meth:`_noting_array`). False, having done
        nothing, when the board has no room for it yet."""
        engine = self._engine
        seq = self._seq
        if not engine.board.can_post(seq, data.nbytes):
            return False
        self._seq = seq + 1
        self.last_path = "host"
        plan, _, finish, _, _ = entry
        if engine.settle_alone(seq, plan, vector, data, recv):
            if finish is not None:
                finish(recv)
            return True
        ex = _execution(entry, seq, send, recv, True, inline, sig)
        if noted is not None:
            ex = self._noting_array(ex, noted)
        engine.await_agreement(ex)
        engine.wait(ex)
        return True

    @_announced("reduce_scatter")
    def _reduce_scatter_start(self, sendbuf, recvbuf, op, blocking=False):
        send, recv, op = self._reduction_args(sendbuf, recvbuf, op, "Reduce_scatter_block")
        p = self.size
        if send is None:
            if recv.size % p:
                raise Error(f"Reduce_scatter_block(IN_PLACE): recvbuf must hold size*n = {p}*n elements, got {recv.size}")
            return self._start("reduce_scatter_inplace", None, recv, recv.size, recv.dtype, op, 0, recv.size // p,
                               blocking)
        if send.size != p * recv.size:
            raise Error(f"Reduce_scatter_block: sendbuf must hold size*n = {p}*{recv.size} = {p * recv.size} "
                        f"elements for a recvbuf of {recv.size}, got {send.size}")
        return self._start("reduce_scatter", send, recv, send.size, recv.dtype, op, 0, recv.size, blocking)

    @_announced("allgather")
    def _allgather_start(self, sendbuf, recvbuf, blocking=False):
        p = self.size
        recv = parse_buffer(recvbuf, "recvbuf", writable=True, bytes_only=True)
        if is_in_place(sendbuf):
            if recv.size % p:
                raise Error(f"Allgather(IN_PLACE): recvbuf must hold size*n = {p}*n elements, got {recv.size}")
            return self._start("allgather_inplace", None, recv, recv.size, recv.dtype, None, 0, recv.size // p,
                               blocking)
        send = parse_buffer(sendbuf, "sendbuf", bytes_only=True)
        if send.dtype != recv.dtype:
            raise Error(f"Allgather: sendbuf is {send.dtype} but recvbuf is {recv.dtype}; ddl does not convert")
        if recv.size != p * send.size:
            raise Error(f"Allgather: recvbuf must hold size*n = {p}*{send.size} = {p * send.size} elements, "
                        f"got {recv.size}")
        if _same_memory(send, recv, "Allgather"):
            raise Error("Allgather: sendbuf and recvbuf are the same memory; use ddl.IN_PLACE")
        return self._start("allgather", send, recv, recv.size, recv.dtype, None, 0, send.size, blocking)

    @_announced("broadcast")
    def _bcast_start(self, buf, root, blocking=False):
        root = _root(root, self.size)
        b = parse_buffer(buf, "buf", writable=self.rank != root, bytes_only=True)   # the root only reads it
        return self._start("broadcast", None, b, b.size, b.dtype, None, root, b.size, blocking)

    # ---- device buffers ----------------------------------------------------------------------------
    def _device_for(self, collective, *bufs):
        """The device executor when a buffer lives on a GPU (CuPy, torch CUDA, anything with
        ``__cuda_array_interface__`` or DLPack), else None. Created on first use; creating it is
        collective, so the ranks first agree that they all passed device buffers to this call (unless
        check="off"): a rank that passed host buffers raises MismatchError with the others, instead
        of leaving them blocked in the creation."""
        if type(bufs[-1]) is not np.ndarray:   # a numpy output buffer is the host path's hot case
            for buf in bufs:
                if buf is not None and not is_in_place(buf) and is_device_buffer(buf):
                    if self._freed:
                        raise Error("this ddl.Communicator was freed")
                    if self._device is None:
                        if self.size > 1 and self.check != "off":
                            self._engine.wait(self._agreement_only(
                                device_start(collective, self._topology_digest, self.check),
                                f"{_LABEL[collective]} (the first on device buffers)"))
                        from .gpu.executor import NcclExecutor
                        self._device = NcclExecutor(self)
                    return self._device
        self.last_path = "host"
        return None

    # ---- mpi4py-style API --------------------------------------------------------------------------
    # Device buffers go to the device executor (NCCL, CUDA-aware MPI or host staging: ``last_path``),
    # on ``stream`` when given, else on CuPy's current stream; host buffers ignore ``stream``.
    @_one_thread
    def Allreduce(self, sendbuf, recvbuf, op=SUM, stream=None):
        """``recvbuf = op(sendbuf of every rank)``; ``sendbuf`` may be ``ddl.IN_PLACE``."""
        if self._allreduce_quick(sendbuf, recvbuf, op):
            return
        dev = self._device_for("allreduce", sendbuf, recvbuf)
        if dev is not None:
            return dev.Allreduce(sendbuf, recvbuf, op=op, stream=stream)
        self._engine.wait(self._allreduce_start(sendbuf, recvbuf, op, blocking=True))

    @_one_thread
    def Iallreduce(self, sendbuf, recvbuf, op=SUM, stream=None):
        dev = self._device_for("allreduce", sendbuf, recvbuf)
        if dev is not None:
            return dev.Iallreduce(sendbuf, recvbuf, op=op, stream=stream)
        return Request(self._allreduce_start(sendbuf, recvbuf, op), self._engine)

    @_one_thread
    def Reduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Rank r gets block r (``n`` elements) of ``op`` over every rank's ``sendbuf`` (``size*n``)."""
        dev = self._device_for("reduce_scatter", sendbuf, recvbuf)
        if dev is not None:
            return dev.Reduce_scatter_block(sendbuf, recvbuf, op=op, stream=stream)
        self._engine.wait(self._reduce_scatter_start(sendbuf, recvbuf, op, blocking=True))

    @_one_thread
    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        dev = self._device_for("reduce_scatter", sendbuf, recvbuf)
        if dev is not None:
            return dev.Ireduce_scatter_block(sendbuf, recvbuf, op=op, stream=stream)
        return Request(self._reduce_scatter_start(sendbuf, recvbuf, op), self._engine)

    @_one_thread
    def Allgather(self, sendbuf, recvbuf, stream=None):
        """Block r of ``recvbuf`` (``size*n`` elements) gets rank r's ``sendbuf`` (``n``)."""
        dev = self._device_for("allgather", sendbuf, recvbuf)
        if dev is not None:
            return dev.Allgather(sendbuf, recvbuf, stream=stream)
        self._engine.wait(self._allgather_start(sendbuf, recvbuf, blocking=True))

    @_one_thread
    def Iallgather(self, sendbuf, recvbuf, stream=None):
        dev = self._device_for("allgather", sendbuf, recvbuf)
        if dev is not None:
            return dev.Iallgather(sendbuf, recvbuf, stream=stream)
        return Request(self._allgather_start(sendbuf, recvbuf), self._engine)

    @_one_thread
    def Bcast(self, buf, root=0, stream=None):
        """Every rank's ``buf`` gets ``root``'s."""
        dev = self._device_for("broadcast", buf)
        if dev is not None:
            return dev.Bcast(buf, root=root, stream=stream)
        self._engine.wait(self._bcast_start(buf, root, blocking=True))

    @_one_thread
    def Ibcast(self, buf, root=0, stream=None):
        dev = self._device_for("broadcast", buf)
        if dev is not None:
            return dev.Ibcast(buf, root=root, stream=stream)
        return Request(self._bcast_start(buf, root), self._engine)

    @_one_thread
    def Barrier(self):
        """Returns when every rank has called it (drives in-flight collectives meanwhile)."""
        self._engine.wait(self._barrier_start())

    @_one_thread
    def Ibarrier(self):
        return Request(self._barrier_start(), self._engine)

    def _barrier_start(self):
        if self._freed:
            raise Error("this ddl.Communicator was freed")
        return self._agreement_only(self._bare_signature("barrier"), "Barrier()")

    def _bare_signature(self, kind):
        """The signature of a call that is its agreement and nothing else (``barrier``, ``free``), kept
        with the plans."""
        sig = self._plans.get((kind,))
        if sig is None:
            sig = self._plans[(kind,)] = Signature(kind, 0, None, None, 0, 0, self._topology_digest, self.check)
        return sig

    def _agreement_only(self, sig, label):
        """Start a collective that is its agreement and nothing else (a barrier, a refusal)."""
        self._engine.admit(None)
        seq = self._seq
        self._seq = seq + 1
        ex = Execution(None, seq, sig, self.size > 1, label, None, None)
        ex.sig_hash = sig.hash(seq)
        ex.salt = sig.base
        self._engine.start(ex)
        return ex

    # ---- Horovod-style functional API ---------------------------------------------------------------
    @_one_thread
    def allreduce(self, array, op=SUM):
        """A new array: ``op`` over every rank's ``array`` (any array-like; scalars give scalars). A CuPy
        array or torch CUDA tensor gives a new one of its kind, made on the device."""
        dev = self._device_for("allreduce", array)
        if dev is not None:
            return dev.allreduce(array, op)
        return self._host_allreduce(array, op)

    @_one_thread
    def iallreduce(self, array, op=SUM):
        """Nonblocking :meth:`allreduce`: ``req.wait()`` returns the new array."""
        dev = self._device_for("allreduce", array)
        if dev is not None:
            return dev.iallreduce(array, op)
        return self._host_iallreduce(array, op)

    @_announced("allreduce")
    def _host_allreduce(self, array, op):
        arr, out, result = _functional(array)
        key = (arr.dtype, arr.shape, id(op))
        lane = self._functional_lanes.get(key)
        if lane is not None and lane[0] is op and self._quick_lane_open():
            _, entry, sig, vector = lane
            send, recv = arr.reshape(-1), out.reshape(-1)
            if self._run_quick(entry, vector, send, send, recv, send, sig, arr):
                return result()
        ex = self._functional_start(arr, out, op, blocking=True)
        if lane is None and ex.inline is not None and ex.check:
            self._keep_functional_lane(key, op, arr, ex.sig)
        self._engine.wait(self._noting_array(ex, arr))
        return result()

    def _keep_functional_lane(self, key, op, arr, sig):
        """The functional allreduce's quick lane for arrays of ``arr``'s dtype and shape, reduced by
        ``op``: ``(op, compiled entry, shaped signature, a memoryview of its vector)``, kept for the
        next calls (a training loop's loss and metrics; a few recent ones). Every later call passes a
        new array, so it posts through numpy; the rest is :meth:`_allreduce_quick`'s lane."""
        op_ = resolve_op(op)
        if divides_first(op_, arr.dtype, self.size):     # (a divided copy is what it posts)
            return
        entry = self._compiled("allreduce", arr.size, arr.dtype, op_, 0, arr.size)
        if len(self._functional_lanes) >= 16:
            del self._functional_lanes[next(iter(self._functional_lanes))]
        self._functional_lanes[key] = (op, entry, sig, memoryview(sig.vector))

    @_announced("allreduce")
    def _host_iallreduce(self, array, op):
        arr, out, result = _functional(array)
        return Request(self._noting_array(self._functional_start(arr, out, op), arr), self._engine, result)

    def _functional_start(self, arr, out, op, blocking=False):
        """Start the functional allreduce of ``arr`` (C-ordered, see :func:`_functional`) into its new
        output ``out``: the buffer API's start without its parsing, which these two arrays need not
        (contiguous, writable, apart, one dtype) and without its argument cache (the next call passes
        new arrays; the cache would only keep these alive)."""
        return self._start("allreduce", arr.reshape(-1), out.reshape(-1), arr.size, arr.dtype, resolve_op(op), 0,
                           arr.size, blocking, arr.shape)

    def _noting_array(self, ex, arr):
        """``ex``, whose MismatchError (if the ranks disagree) ends by saying what this rank passed where
        the message shows only a tag of its shape (more than 3 dimensions, or one of 2**20 or more)."""
        if shape_shown(arr.shape):
            return ex
        before = ex.on_error

        def on_error(ex):
            ex.on_error = before            # (said once, however often the request is waited for)
            if before is not None:
                before(ex)
            if isinstance(ex.error, MismatchError):
                passed = array_text(arr.dtype.name, arr.shape)
                ex.error.args = (f"{ex.error}; this rank (rank {self.rank}) passed {passed}",)
        ex.on_error = on_error
        return ex

    @_one_thread
    def grouped_allreduce(self, arrays, op=SUM):
        """``[allreduce(a) for a in arrays]`` with one collective per dtype over a packed buffer."""
        return self.grouped_iallreduce(arrays, op).wait()

    @_one_thread
    @_announced("grouped_allreduce")
    def grouped_iallreduce(self, arrays, op=SUM):
        """Nonblocking :meth:`grouped_allreduce`. With ``check="always"`` it first waits until every
        rank has called it with the same dtypes and shapes (else MismatchError on every rank): each rank
        then starts the same collectives, one per dtype, so a mismatch cannot leave one of them behind
        to pair with a later call."""
        given = list(arrays)
        arrays = [_numbers(a, "grouped_allreduce") for a in given]
        op = resolve_op(op)
        if self.size > 1 and self.check == "always":
            try:
                self._engine.wait(self._agreement_only(grouped(arrays, op, self._topology_digest, self.check),
                                                       f"grouped_allreduce({len(arrays)} arrays)"))
            except MismatchError as exc:    # the ranks compared digests: each says what it passed itself
                raise MismatchError(f"{exc}; this rank (rank {self.rank}) passed {_array_list(arrays)}") from None
        groups = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype, []).append(i)
        results = [None] * len(arrays)
        reqs = []
        for dtype, idx in groups.items():
            total = sum(arrays[i].size for i in idx)
            packed = np.empty(total, dtype)
            off = 0
            for i in idx:
                n = arrays[i].size
                packed[off:off + n] = arrays[i].reshape(-1)
                results[i] = packed[off:off + n].reshape(arrays[i].shape)
                off += n
            reqs.append(self._allreduce_start(IN_PLACE, packed, op))
        return _GroupRequest(reqs, self._engine, lambda: [_returned(out, g) for out, g in zip(results, given)])

    # ---- lifetime ------------------------------------------------------------------------------
    @_one_thread
    def Free(self):
        """Complete in-flight collectives and free the private communicators (collective).

        MPI's frees of a shared window or communicator wait for every rank, for ever. So the ranks
        first meet in a barrier under the stall watchdog: when a peer will not come (it gave up on an
        earlier collective, or skipped one and left), this rank raises the StallError that names it
        instead of hanging, and the collective frees are skipped (their memory goes with the process).
        A communicator that already failed is let go of the same way, at once."""
        if self._freed:
            return
        try:
            for ex in self._engine.pending():
                self._engine.wait(ex)
            if self._engine.broken is None and self.size > 1:
                self._engine.wait(self._agreement_only(self._bare_signature("free"), "Free()"))
        except BaseException:
            self._let_go()
            raise
        if self._engine.broken is not None:
            self._let_go()
            return
        if self._device is not None:
            self._device.Free()
        self._let_go()
        if self._board is not None:
            self._board.free()
        self._pcomm.Free()
        self._gcomm.Free()

    def _let_go(self):
        """This rank's part of freeing, which needs no other rank: refuse further calls, drop plans."""
        self._freed = True
        self._engine.close()
        self._plans.clear()
        self._args.clear()
        self._functional_lanes.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self._engine.broken is None:
            self.Free()
        else:
            # Freeing is collective; after an error the other ranks may not get here: do not hang.
            self._let_go()
        return False

    def __repr__(self):
        topo = self.topology.name if self.topology is not None else "single rank"
        return f"<ddl.Communicator rank {self.rank}/{self.size} on {topo}, check={self.check}>"


class _GroupRequest(Request):
    __slots__ = ("_reqs",)

    def __init__(self, exs, engine, results):
        super().__init__(exs[-1] if exs else None, engine, None)
        self._reqs = exs
        self._result = results

    @_one_thread
    def Wait(self, status=None):
        for ex in self._reqs:
            self._engine.wait(ex)
        return True

    def __repr__(self):
        return f"<ddl.Request grouped_allreduce of {len(self._reqs)} collectives, {'done' if self.done else 'in flight'}>"

    @_one_thread
    def Test(self, status=None):
        return all([self._engine.test(ex) for ex in self._reqs])

    test = Test

    def wait(self):
        self.Wait()
        return self._result()

    @property
    def done(self):
        return all(ex.done for ex in self._reqs)


def _all_set_up(comm, error):
    """Every rank says whether its own set-up failed (``error``) before the collective part of the
    constructor: a rank whose topology file is missing, or whose settings are wrong, raises its own
    error, and the others a :class:`ddl.Error` naming it, instead of waiting in ``MPI_Comm_dup``."""
    failed = [r for r, bad in enumerate(comm.allgather(error is not None)) if bad]
    if failed and error is None:
        raise Error(f"ddl.Communicator: {format_ranks(failed)} could not set up (their own error says why); "
                    f"every rank must pass the same topology and settings")


def _extent(arr):
    """``(first, end)`` byte addresses of a contiguous array, or None (no buffer, or an empty one)."""
    if arr is None or not arr.nbytes:
        return None
    first = arr.__array_interface__["data"][0]
    return first, first + arr.nbytes


def _overlap(a, b):
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _check_not_in_flight(send, recv, inflight, engine=None):
    """A buffer that a collective still in flight writes (its recvbuf), or reads while this call
    writes it, would give garbage: MPI forbids it, and ddl says so (on this rank; the others learn of
    the refusal through the agreement), whichever communicator (``engine``: this call's) runs that
    collective. Buffers are contiguous, so overlapping address ranges are overlap; each call's ranges
    are taken once, when a later call first compares with them."""
    mine = None
    for ex in inflight:
        if ex.bufs is None:
            continue
        if mine is None:
            mine = _extent(send), _extent(recv)
        mine_send, mine_recv = mine
        if ex.extents is None:
            ex.extents = (_extent(ex.bufs[0]), _extent(ex.bufs[1]))
        theirs_send, theirs_recv = ex.extents
        for what, clash in (("recvbuf", _overlap(mine_recv, theirs_recv) or _overlap(mine_recv, theirs_send)),
                            ("sendbuf", _overlap(mine_send, theirs_recv))):
            if clash:
                where = "" if engine is None or ex.engine is engine else " on another ddl.Communicator"
                raise Error(f"{what} shares memory with a buffer of {ex.label} (ddl collective #{ex.seq}{where}), "
                            f"still in flight: wait for that one first (one buffer in two calls in flight "
                            f"gives garbage; MPI forbids it too)")


def _size_of(nbytes_or_buffer):
    """The message size :meth:`Communicator.plan` / :meth:`~Communicator.explain` are asked about: a
    byte count or size text (see :func:`ddl.units.message_size`), or a buffer's bytes; else a
    :class:`ddl.Error` saying why."""
    if not isinstance(nbytes_or_buffer, (int, np.integer, str)) or isinstance(nbytes_or_buffer, bool):
        return parse_buffer(nbytes_or_buffer, "buffer", bytes_only=True).nbytes
    try:
        return message_size(nbytes_or_buffer)
    except (TypeError, ValueError) as exc:
        raise Error(str(exc)) from None


def _seconds(name, value, source=None):
    """``value`` as a positive number of seconds (``inf``: never), else a :class:`ddl.Error` naming
    the setting: a timeout of 0, a negative one or NaN would fire at once or never, silently."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0:
        where = f" ({source})" if source else ""
        raise Error(f"{name} must be a positive number of seconds (math.inf: never), got {value!r}{where}")
    return seconds


def _root(root, size):
    """``root`` as a rank of a communicator of ``size`` (an integer, as mpi4py demands: 1.7 is not
    rank 1, nor is True), else a :class:`ddl.Error`."""
    rank = whole_number(root)          # (None for True, which would be rank 1)
    if rank is None:
        raise Error(f"Bcast: root must be an integer rank, got {root!r}")
    if not 0 <= rank < size:
        raise Error(f"Bcast: root {rank} is not a rank of this communicator (size {size})")
    return rank


def _affinity():
    """The CPUs this process may run on. The node's ranks together are oversubscribed when the union
    of theirs is smaller than their number: a launcher that pins every rank to a core of its own
    (Intel MPI's and Open MPI's do by default, Slurm's --cpu-bind) leaves each rank one CPU, and yet
    no two ranks share one."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def _same_memory(a, b, what):
    """True when ``a`` and ``b`` are exactly the same memory; ddl.Error when they partly overlap."""
    if a.size and b.size and np.may_share_memory(a, b):
        if a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes:
            return True
        raise Error(f"{what}: sendbuf and recvbuf overlap in memory; use ddl.IN_PLACE for in-place operation")
    return False
