"""Collectives on device buffers: NCCL, CUDA-aware MPI, or staging through host memory.

:class:`NcclExecutor` is the device counterpart of the host executor, one per
:class:`ddl.Communicator` (created on the first collective on device buffers; creation is
collective). It runs the communicator's plans -- the same :class:`~ddl.schedule.Schedule` the host
path would run -- translated by :mod:`ddl.gpu.launch_plan` into *steps*.

Paths (``executor.last_path`` and ``comm.last_path`` say which one ran; ``DDL_GPU_PATH`` forces one):

``"nccl"``
    One NCCL communicator per ddl communicator; rank 0's ``ncclUniqueId`` is broadcast over MPI.
    Each step is ONE NCCL group (``groupStart``; every send/recv of the step in the canonical order;
    ``groupEnd``), followed by the step's reductions (ddl's kernels, :mod:`ddl.gpu.kernels`), all on
    ONE stream, so steps pipeline back to back on the device without the host waiting. Transfers are
    byte transfers (``ncclUint8``), so every dtype works, int16 included.
``"cuda-aware-mpi"``
    When NCCL cannot be used and the MPI library is CUDA-aware (:func:`detect_cuda_aware_mpi`): the
    same steps, each as nonblocking MPI sends/receives on device pointers then the reductions; the
    host waits for the stream before each step (MPI does not know streams).
``"host-staged"``
    Otherwise: device -> host copy (pinned memory), the host executor (:class:`ddl.Communicator`'s
    numpy path), host -> device copy.

NCCL is used when CuPy has NCCL >= 2.7 (point-to-point) on every rank *and* no two ranks share a
GPU (NCCL refuses that: "Duplicate GPU detected"); that is checked over MPI before NCCL is touched,
and the decision is collective, so every rank takes the same path.

**Streams.** A collective runs on ``stream`` when given (a CuPy stream, a ``torch.cuda.Stream``, or
a raw ``cudaStream_t`` as an int), else on CuPy's current stream. It is enqueued after the work
already on that stream (so the kernels that produced the data need no synchronisation), buffers
exported with their own stream (CUDA array interface v3, DLPack) are made to wait for it, and the
result is visible to work enqueued on the stream afterwards. Collectives of one communicator run on
the device in the order they were called, whatever their streams: a collective on another stream than
the one before waits for that one first (NCCL needs its operations in the same order on every rank, and
two streams would let the device interleave them), and ``Free()`` waits for the last. The NCCL path
returns once everything is enqueued, like NCCL itself (``Wait()`` on a request, or
``stream.synchronize()``, waits for the device); keep the buffers alive until then. The other paths
return when the result is in place.

**Reduction order.** Reductions happen in each chunk's program order, on every path (see
:mod:`ddl.gpu.launch_plan`), and the kernels round after every operation: results are bitwise
identical on every rank, to each other path, and to the host executor running the same schedule. (The
host executor's smallest calls on one node take its inline path instead, which reduces in rank order:
the same values, possibly other last bits than a schedule's order; ``DDL_INLINE_BYTES=0`` turns it off.)
"""
import ctypes
import functools
import logging
import os
import socket
import sys
from collections import OrderedDict

import numpy as np

from ..agreement import announced, format_ranks
from ..buffers import IN_PLACE, is_in_place
from ..errors import Error, MismatchError
from ..ops import LOGICAL, SUM, check_op_dtype, divides_first, reduce_into, resolve_op
from ..settings import env_flag
from . import INSTALL_CUPY, requested_path
from .buffers import DTYPES, DeviceBuffer, parse_device_buffer
from .launch_plan import RECV_BUF, SCRATCH_BUF, SEND_BUF, WORK_BUF, launch_plan

log = logging.getLogger("ddl.gpu")

NCCL_MIN_VERSION = 2700   # ncclSend / ncclRecv
_NCCL_UINT8 = 1
_MPI_TAG_BASE = 64

_LAYOUT_COLLECTIVE = {"allreduce": "allreduce", "allreduce_inplace": "allreduce",
                      "reduce_scatter": "reduce_scatter", "reduce_scatter_inplace": "reduce_scatter",
                      "allgather": "allgather", "allgather_inplace": "allgather", "broadcast": "broadcast"}


# ---- environment probes -----------------------------------------------------------------------------
def _mpi_function(name):
    """A C function of the loaded MPI library (ctypes), or None."""
    try:
        import mpi4py.MPI  # noqa: F401  (loads libmpi)
    except ImportError:
        return None
    candidates = [None]
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({line.split()[-1] for line in f
                                  if os.path.basename(line.split()[-1]).startswith("libmpi")})
    except OSError:
        pass
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    return None


def detect_cuda_aware_mpi():
    """(is CUDA-aware, reason). ``DDL_CUDA_AWARE_MPI`` on or off (1, 0, ...) overrides; else MPICH's and Open MPI's
    ``MPIX_Query_cuda_support()`` (MPICH answers 1 only when built with CUDA *and* GPU support is
    enabled, ``MPIR_CVAR_ENABLE_GPU``). When nothing can tell, False: ddl then stages through host
    memory, which is always correct."""
    told = env_flag("DDL_CUDA_AWARE_MPI", None)
    if told is not None:
        return told, f"DDL_CUDA_AWARE_MPI={os.environ['DDL_CUDA_AWARE_MPI'].strip()}"
    if os.environ.get("MPIR_CVAR_ENABLE_GPU", "").strip() == "0":
        return False, "MPIR_CVAR_ENABLE_GPU=0 (MPICH's GPU support is disabled)"
    fn = _mpi_function("MPIX_Query_cuda_support")
    if fn is not None:
        try:
            value = int(fn())
        except Exception as exc:  # pragma: no cover - needs an initialised, odd MPI
            return False, f"MPIX_Query_cuda_support() failed ({exc})"
        return value == 1, f"MPIX_Query_cuda_support() = {value}"
    return False, ("the MPI library does not say whether it is CUDA-aware (no MPIX_Query_cuda_support); "
                   "set DDL_CUDA_AWARE_MPI=1 if it is")


def nccl_status():
    """(usable, version or None, reason) for CuPy's NCCL bindings on this process."""
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return False, None, f"cupy.cuda.nccl cannot be imported ({exc})"
    if not getattr(nccl, "available", True):
        return False, None, "CuPy was built without NCCL"
    try:
        version = int(nccl.get_version())
    except Exception as exc:
        return False, None, f"NCCL is not loadable ({exc})"
    if version < NCCL_MIN_VERSION:
        return False, version, f"NCCL {version} has no point-to-point send/recv (needs >= 2.7)"
    try:
        built = int(nccl.get_build_version())
    except Exception:
        built = version
    if built < NCCL_MIN_VERSION:
        return False, version, f"CuPy was built against NCCL {built}, without send/recv (needs >= 2.7)"
    if not hasattr(nccl, "groupStart") or not hasattr(nccl.NcclCommunicator, "send"):
        return False, version, "this CuPy's NCCL bindings lack send/recv/groupStart (upgrade CuPy)"
    return True, version, f"NCCL {version // 10000 if version >= 10000 else version // 1000}." \
                          f"{(version % 10000) // 100 if version >= 10000 else (version % 1000) // 100}"


def select_device(mpi_comm=None):
    """Make CUDA device ``node-local rank % device count`` current (CuPy) and return its ordinal.

    Call it (collectively: it splits the communicator by node) before the first collective on device
    buffers, e.g. in ``ddl bench --device gpu``; a ddl communicator's device collectives run on the
    device that is current when it runs its first one."""
    import cupy
    from mpi4py import MPI
    comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = local.Get_rank()
    finally:
        local.Free()
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise Error("no CUDA device is visible to this process")
    dev = local_rank % count
    cupy.cuda.Device(dev).use()
    return dev


# ---- runtimes: what run_plan needs from a device -----------------------------------------------------
class _RawStream:
    """A raw ``cudaStream_t`` presented through the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


class CupyRuntime:
    """Device operations through CuPy: copies, kernel launches, events, allocation."""

    def __init__(self):
        import cupy
        from .kernels import default_cache
        self.cupy = cupy
        self.kernels = default_cache()

    def stream(self, stream=None):
        """A CuPy stream object from None (current), a CuPy stream, a torch stream or an int."""
        cp = self.cupy
        if stream is None:
            return cp.cuda.get_current_stream()
        if type(stream).__module__.startswith("cupy") and hasattr(stream, "ptr"):
            return stream   # cupy.cuda.Stream / ExternalStream
        if isinstance(stream, (int, np.integer)):
            return self._external(int(stream))
        for attr in ("cuda_stream", "ptr", "handle"):
            value = getattr(stream, attr, None)
            if isinstance(value, (int, np.integer)):
                return self._external(int(value))
        raise Error(f"stream must be a CuPy stream, a torch.cuda.Stream or a cudaStream_t int, got {stream!r}")

    def _external(self, ptr):
        """A CuPy stream object for a raw ``cudaStream_t``: ``Stream.from_external`` (CuPy >= 14, which
        deprecates ExternalStream) through the CUDA stream protocol, else ExternalStream."""
        stream_class = self.cupy.cuda.Stream
        if hasattr(stream_class, "from_external"):
            return stream_class.from_external(_RawStream(ptr))
        return self.cupy.cuda.ExternalStream(ptr)

    def device(self):
        return self.cupy.cuda.Device().id

    def gpu_identity(self, dev):
        """A string naming the physical GPU (PCI bus id, else UUID), or None."""
        cp = self.cupy
        for get in (lambda: cp.cuda.Device(dev).pci_bus_id,
                    lambda: cp.cuda.runtime.deviceGetPCIBusId(dev),
                    lambda: bytes(cp.cuda.runtime.getDeviceProperties(dev)["uuid"]).hex()):
            try:
                value = get()
            except Exception:
                continue
            if value:
                return str(value)
        return None

    def pointer_device(self, ptr):
        try:
            return int(self.cupy.cuda.runtime.pointerGetAttributes(ptr).device)
        except Exception:
            return None

    def memcpy(self, dst, src, nbytes, stream):
        if nbytes:
            rt = self.cupy.cuda.runtime
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream.ptr)

    def reduce(self, op, dtype, out, a0, inputs, count, stream):
        self.kernels.reduce(op, dtype, out, a0, inputs, count, stream)

    def scale(self, dtype, ptr, count, divisor, stream):
        self.kernels.scale(dtype, ptr, count, divisor, stream)

    def prepare(self, op, dtype, widths, average):
        """Compile (on this device) the kernels a plan launches, before its collective starts."""
        if op is not None:
            for k in widths:
                self.kernels.reduce_kernel(op, dtype, k)
        if average:
            self.kernels.scale_kernel(dtype)

    def synchronize(self, stream):
        stream.synchronize()

    def alloc(self, nbytes, stream):
        with stream:
            return self.cupy.cuda.alloc(max(int(nbytes), 1))

    def pinned(self, nbytes):
        mem = self.cupy.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        return mem, np.frombuffer(mem, np.uint8, int(nbytes))

    def wait_stream(self, stream, other):
        """Make ``stream`` wait for the work enqueued so far on the raw stream handle ``other``."""
        rt = self.cupy.cuda.runtime
        if other is None or int(other) == stream.ptr or (stream.ptr == 0 and int(other) == 1):
            return
        ev = rt.eventCreateWithFlags(rt.eventDisableTiming)
        try:
            rt.eventRecord(ev, int(other))
            rt.streamWaitEvent(stream.ptr, ev, 0)
        finally:
            rt.eventDestroy(ev)

    def record(self, stream):
        ev = self.cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def wait_event(self, stream, event):
        """Make ``stream`` wait until ``event`` (from :meth:`record`) has happened."""
        stream.wait_event(event)


def _host_view(ptr, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else np.empty(0, np.uint8)


class HostRuntime:
    """The runtime interface on host memory (pointers are host addresses, numpy reductions).

    Not a GPU path: it runs :func:`run_plan` -- the exact step logic of the device paths -- on the
    CPU, for the tests and for debugging a schedule's launch plan without a device. Its reductions
    follow the kernels' contract (left fold, rounded after every operation)."""

    class _Stream:
        ptr = 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def stream(self, stream=None):
        return self._Stream()

    def memcpy(self, dst, src, nbytes, stream):
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    def reduce(self, op, dtype, out, a0, inputs, count, stream):
        npdt = _numpy_dtype(dtype)
        ufunc = resolve_op(op).ufunc
        n = count * npdt.itemsize
        o = _host_view(out, n).view(npdt)
        acc = _host_view(a0, n).view(npdt).copy()
        for p in inputs:
            reduce_into(ufunc, acc, _host_view(p, n).view(npdt), acc)
        o[...] = acc

    def scale(self, dtype, ptr, count, divisor, stream):
        npdt = _numpy_dtype(dtype)
        a = _host_view(ptr, count * npdt.itemsize).view(npdt)
        np.true_divide(a, divisor, out=a, casting="unsafe")

    def synchronize(self, stream):
        pass

    def prepare(self, op, dtype, widths, average):
        _numpy_dtype(dtype)    # bfloat16 without ml_dtypes: refused before the collective, not in it

    def alloc(self, nbytes, stream):
        return _HostAlloc(nbytes)

    def wait_stream(self, stream, other):
        pass

    def record(self, stream):
        return None


class _HostAlloc:
    def __init__(self, nbytes):
        self.array = np.zeros(max(int(nbytes), 1) + 64, np.uint8)
        self.ptr = self.array.ctypes.data


def _numpy_dtype(dtype):
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    npdt = dt.numpy
    if npdt is None:
        raise Error(f"{dt.name} on the host needs ml_dtypes (pip install ml_dtypes)")
    return npdt


# ---- transports: one step's grouped point-to-point operations -----------------------------------------
class NcclTransport:
    """A step = one NCCL group of byte sends/receives on the collective's stream (asynchronous)."""

    def __init__(self, comm):
        from cupy.cuda import nccl
        self.nccl, self.comm = nccl, comm

    def step(self, ops, stream):
        nccl, comm, s = self.nccl, self.comm, stream.ptr
        nccl.groupStart()
        try:
            for kind, peer, ptr, nbytes, _tag in ops:
                if kind == "send":
                    comm.send(ptr, nbytes, _NCCL_UINT8, peer, s)
                else:
                    comm.recv(ptr, nbytes, _NCCL_UINT8, peer, s)
        finally:
            nccl.groupEnd()


class MpiTransport:
    """A step = nonblocking MPI sends/receives on device (or, with HostRuntime, host) pointers.

    MPI does not know streams: the host first waits for the stream (the previous step's reductions
    and the caller's work), then posts the step and waits for it. Tags are the transfer's ordinal
    within the step for its (sender, receiver) pair; MPI's non-overtaking rule keeps steps apart."""

    def __init__(self, mpi_comm, runtime):
        from mpi4py import MPI
        self.MPI, self.comm, self.rt = MPI, mpi_comm, runtime

    def step(self, ops, stream):
        MPI = self.MPI
        self.rt.synchronize(stream)
        reqs = []
        u8 = DTYPES["uint8"]
        for kind, peer, ptr, nbytes, tag in ops:
            if kind != "send":
                reqs.append(self.comm.Irecv([DeviceBuffer(ptr, nbytes, u8), MPI.BYTE], peer, _MPI_TAG_BASE + tag))
        for kind, peer, ptr, nbytes, tag in ops:
            if kind == "send":
                reqs.append(self.comm.Isend([DeviceBuffer(ptr, nbytes, u8, readonly=True), MPI.BYTE], peer,
                                            _MPI_TAG_BASE + tag))
        MPI.Request.Waitall(reqs)


def run_plan(lp, ptrs, transport, rt, op, dtype, stream):
    """Enqueue a :class:`~ddl.gpu.launch_plan.LaunchPlan`: initial copies, then for every step its
    transfers (``transport.step``) and its reductions (``rt.reduce``), in order.

    ``ptrs``: base address of each buffer (``send``, ``recv``, ``work``, ``scratch``)."""
    for sb, so, db, do, n in lp.copies:
        rt.memcpy(ptrs[db] + do, ptrs[sb] + so, n, stream)
    scratch = ptrs.get(SCRATCH_BUF)
    for step in lp.steps:
        if step.transfers:
            transport.step([(t.kind, t.peer, ptrs[t.buf] + t.offset, t.nbytes, t.tag) for t in step.transfers],
                           stream)
        for r in step.reductions:
            a0, inputs = ptrs[r.a0[0]] + r.a0[1], [scratch + s for s in r.inputs]
            if r.incoming_first:       # the lower rank's operand first (see Reduction)
                a0, inputs[0] = inputs[0], a0
            rt.reduce(op, dtype, ptrs[r.out[0]] + r.out[1], a0, inputs, r.count, stream)


# ---- requests ---------------------------------------------------------------------------------------------
class DeviceRequest:
    """Handle of a device collective. ``Wait()`` blocks until the device finished it (NCCL path: an
    event on its stream); ``Test()`` asks without blocking. ``wait()`` returns the functional result."""

    __slots__ = ("_event", "_result")

    def __init__(self, event=None, result=None):
        self._event, self._result = event, result

    def Wait(self):
        if self._event is not None:
            self._event.synchronize()
        return True

    def Test(self):
        return True if self._event is None else bool(self._event.done)

    def wait(self):
        self.Wait()
        return True if self._result is None else self._result

    test = Test

    @property
    def done(self):
        return self.Test()

    @staticmethod
    def Waitall(requests):
        for r in requests:
            r.Wait()
        return True


# ---- the executor -----------------------------------------------------------------------------------------
# A device collective's entry: an exception before the call reached an agreement is announced
# (NcclExecutor._refuse), then raised, as on the host (ddl.agreement.announced).
_announced = functools.partial(announced, counter="_entered", refuse="_refuse")


class NcclExecutor:
    """Device collectives of one :class:`ddl.Communicator` (see the module docstring).

    ``runtime``: the device runtime (default :class:`CupyRuntime`); ``path``: force a path (default
    ``DDL_GPU_PATH`` or ``"auto"``). Construction is collective over the communicator.
    """

    def __init__(self, comm, runtime=None, path=None):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._mcomm = comm.mpi_comm.Dup()
        try:
            self._mcomm.Set_name(f"ddl-gpu({comm.mpi_comm.Get_name() or 'comm'})")
        except Exception:  # pragma: no cover - cosmetic
            pass
        self._rt = runtime
        self.requested_path = requested_path(path)
        self.verbose = env_flag("DDL_GPU_VERBOSE", False)     # rank 0 says which path it took
        self.path = None          # decided on first use (collectively)
        self.path_reason = ""
        self.last_path = None
        self.device = None
        self._nccl = None
        self._plans = OrderedDict()
        self._buffers = OrderedDict()
        self._pinned = {}
        self._prepared = {}
        self._freed = False
        self._previous = None     # (event, stream ptr) of the last collective enqueued on the NCCL path
        self._copy = None         # the divided copy of the last float16 AVG's input (see _copy_space)
        self._entered = 0         # calls that reached the agreement (see _announced)

    # ---- runtime and path ---------------------------------------------------------------------------
    @property
    def runtime(self):
        if self._rt is None:
            try:
                self._rt = CupyRuntime()
            except ImportError as exc:
                raise Error(f"device buffers need CuPy ({INSTALL_CUPY}): {exc}") from None
        return self._rt

    def _agree_all(self, flag):
        """True iff ``flag`` is true on every rank (collective)."""
        from mpi4py import MPI
        return bool(self._mcomm.allreduce(1 if flag else 0, op=MPI.MIN))

    def _choose_path(self):
        if self.path is not None:
            return self.path
        want = self.requested_path
        rt = self.runtime
        try:                           # local, but its failure must reach every rank (the rest is collective)
            self.device = rt.device() if hasattr(rt, "device") else None
            failure = None
        except Exception as exc:
            failure = exc
        failed = [r for r, bad in enumerate(self._mcomm.allgather(failure is not None)) if bad]
        if failure is not None:
            raise Error(f"ddl.gpu: rank {self.rank} cannot use its GPU: {failure}") from failure
        if failed:
            whose = "its" if len(failed) == 1 else "their"
            raise Error(f"ddl.gpu: {format_ranks(failed)} cannot use {whose} GPU ({whose} own error says why)")
        reasons = []
        path = None
        if want in ("auto", "nccl"):
            ok, _version, why = nccl_status() if isinstance(rt, CupyRuntime) else (False, None, "no CuPy runtime")
            bus = None
            if ok:
                bus = rt.gpu_identity(self.device)
                if bus is None:
                    ok, why = False, "cannot identify the GPU (PCI bus id / UUID), so cannot rule out two ranks on one GPU"
            table = self._mcomm.allgather((socket.gethostname(), bus, ok, why))
            seen = {}
            dup = None
            for r, (host, b, _ok, _why) in enumerate(table):
                if b is None:
                    continue
                if (host, b) in seen and dup is None:
                    dup = f"ranks {seen[(host, b)]} and {r} share GPU {b} on {host} (NCCL needs one GPU per rank)"
                seen.setdefault((host, b), r)
            bad = [(r, w) for r, (_h, _b, o, w) in enumerate(table) if not o]
            if bad:
                reasons.append(f"NCCL unusable on rank {bad[0][0]}: {bad[0][1]}")
            elif dup:
                reasons.append(dup)
            else:
                err = None
                try:
                    self._nccl_init()
                except Exception as exc:
                    err = exc
                if self._agree_all(err is None):
                    path = "nccl"
                    reasons.append(why)
                else:
                    self._nccl_destroy()
                    reasons.append(f"NCCL initialisation failed{f': {err}' if err else ' on another rank'}")
            if path is None and want == "nccl":
                raise Error("DDL_GPU_PATH=nccl but NCCL cannot be used: " + "; ".join(reasons))
        if path is None and want in ("auto", "cuda-aware-mpi"):
            aware, why = detect_cuda_aware_mpi()
            if isinstance(rt, HostRuntime):
                aware, why = True, "host runtime (pointers are host memory)"
            if self._agree_all(aware):
                path = "cuda-aware-mpi"
                reasons.append(f"CUDA-aware MPI ({why})")
            else:
                reasons.append(f"MPI is not CUDA-aware on every rank ({why})")
                if want == "cuda-aware-mpi":
                    raise Error("DDL_GPU_PATH=cuda-aware-mpi but " + reasons[-1])
        if path is None:
            path = "host-staged"
            if want == "host-staged":
                reasons.append("requested (DDL_GPU_PATH / path=host-staged)")
        self.path = path
        self.path_reason = "; ".join(reasons)
        msg = f"ddl.gpu: rank {self.rank}/{self.size} runs device collectives on the {path} path ({self.path_reason})"
        log.info(msg)
        if self.verbose and self.rank == 0:
            sys.stderr.write(msg + "\n")
        return path

    def _nccl_init(self):
        from cupy.cuda import nccl
        uid = None
        if self.rank == 0:
            try:                       # rank 0 still takes part in the broadcast when this fails
                uid = nccl.get_unique_id()
            except Exception as exc:
                uid = f"rank 0 could not create the NCCL unique id: {exc}"
        uid = self._mcomm.bcast(uid, root=0)
        if isinstance(uid, str):
            raise Error(uid)
        self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)

    def _nccl_destroy(self):
        if self._nccl is not None:
            try:
                self._nccl.destroy()
            except Exception:  # pragma: no cover
                pass
            self._nccl = None

    # ---- plans and buffers ------------------------------------------------------------------------------
    def _schedule(self, collective, nbytes, root):
        return self.comm.plan(int(nbytes), collective, root)

    def _launch_plan(self, layout, count, dt, root):
        key = (layout, count, dt.itemsize, root)
        entry = self._plans.get(key)
        if entry is None:
            sched = self._schedule(_LAYOUT_COLLECTIVE[layout], count * dt.itemsize, root)
            entry = (sched, launch_plan(sched, self.rank, count, dt.itemsize, layout))
            self._plans[key] = entry
            if len(self._plans) > 64:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return entry

    def _workspace(self, lp, stream, align_to):
        """(scratch ptr, work ptr) for ``lp`` on ``stream``; scratch keeps ``align_to`` mod 16."""
        key = (id(lp), stream.ptr, align_to % 16)
        entry = self._buffers.get(key)
        if entry is None or entry[0] is not lp:
            what = (f"the device workspace of this collective ({lp.scratch_bytes} B scratch, "
                    f"{lp.work_bytes} B work)")
            mems = []
            scratch = work = 0
            if lp.scratch_bytes:
                m, scratch = self._alloc_aligned(lp.scratch_bytes, stream, align_to, what)
                mems.append(m)
            if lp.work_bytes:
                m, work = self._alloc_aligned(lp.work_bytes, stream, align_to, what)
                mems.append(m)
            entry = (lp, scratch, work, mems)
            self._buffers[key] = entry
            if len(self._buffers) > 8:
                self._buffers.popitem(last=False)
        return entry[1], entry[2]

    def _copy_space(self, nbytes, stream, align_to):
        """A device buffer of ``nbytes`` on ``stream`` for the divided copy of an AVG's input (see
        :func:`ddl.ops.divides_first`), at ``align_to`` mod 16 like the workspace; kept until the next
        call, so a collective still queued on the stream keeps its input."""
        self._copy, ptr = self._alloc_aligned(nbytes, stream, align_to,
                                              f"the device copy of this AVG's input ({nbytes} B)")
        return ptr

    def _alloc_aligned(self, nbytes, stream, align_to, what):
        """``(memory, pointer)``: ``nbytes`` on ``stream`` from a pointer at ``align_to`` mod 16 (the
        user's buffer's offset, so that kernels combining the two see the same alignment in both). A
        failed allocation (e.g. cupy's OutOfMemoryError) becomes a ddl error naming ``what``, announced
        to the peers."""
        try:
            m = self.runtime.alloc(nbytes + 32, stream)
        except Error:
            raise
        except Exception as exc:
            raise Error(f"cannot allocate {what}: {type(exc).__name__}: {exc}") from exc
        return m, -(-m.ptr // 16) * 16 + align_to % 16

    def _prepare(self, lp, kop, dt, op):
        """Have the runtime ready the kernels ``lp`` will launch (CuPy: compile them), once per plan."""
        prepare = getattr(self.runtime, "prepare", None)
        if prepare is None or (kop is None and not (op is not None and op.average)):
            return
        key = (id(lp), kop, dt.name, bool(op is not None and op.average))
        if self._prepared.get(key) is lp:
            return
        from .kernels import MAX_INPUTS
        widths = set()
        for r in lp.reductions:
            n = len(r.inputs)
            while n > MAX_INPUTS:
                widths.add(MAX_INPUTS)
                n -= MAX_INPUTS
            widths.add(n)
        try:
            prepare(kop, dt, sorted(widths), bool(op is not None and op.average and self.size > 1))
        except Error:
            raise
        except Exception as exc:
            raise Error(f"cannot prepare the GPU kernels of this collective: {type(exc).__name__}: {exc}") from exc
        self._prepared[key] = lp
        if len(self._prepared) > 256:
            self._prepared.pop(next(iter(self._prepared)))

    def _check_device(self, *bufs):
        rt = self.runtime
        if not hasattr(rt, "pointer_device") or self.device is None:
            return
        for b in bufs:
            if b is None or not b.count:
                continue
            dev = b.device if b.device is not None else rt.pointer_device(b.ptr)
            if dev is not None and dev != self.device:
                raise Error(f"buffer is on CUDA device {dev} but this communicator's device collectives run on "
                            f"device {self.device} (the current device when it first ran one): use one device "
                            f"per rank, selected before the first collective")

    def _agree(self, collective, count, dt, op, root, sched):
        """Cross-rank check of the call (skipped with check='off'), in the ddl communicator's own
        agreement: a device call takes a sequence number there like a host call, so a mismatch --
        arguments, or a rank that passed host buffers to this call -- raises MismatchError on every
        rank before any data moves (NCCL has no tags: a mismatch would hang or corrupt), and a rank
        that does not arrive gives StallError after ``stall_timeout`` (its give-up marked for a late
        rank), not a hang."""
        self._entered += 1
        c = self.comm
        if self.size == 1 or getattr(c, "check", "always") == "off":
            return
        from ..agreement import COLLECTIVE_CODES, COLLECTIVE_NAMES, Signature, digest62
        schedule_digest = c._check_schedule(sched, collective, root)     # (made when comm.plan gave it)
        npdt = dt.numpy if dt.numpy is not None else np.dtype(f"u{dt.itemsize}")
        # the schedule word says "on device buffers": a host call of the same arguments differs there
        sig = Signature(collective, int(count), npdt, op, int(root), digest62("device", dt.name, schedule_digest),
                        c._topology_digest, c.check)
        name = COLLECTIVE_NAMES[COLLECTIVE_CODES[collective]]
        label = f"{name}({int(count)} x {dt.name}{f', {op.name}' if op is not None else ''}) on device buffers"
        try:
            c._engine.wait(c._agreement_only(sig, label))
        except MismatchError as exc:
            exc.add_note("ddl: this rank called it on device buffers; a rank that passed host (numpy) buffers "
                         "to the same call differs in its schedule")
            raise

    def _refuse(self, collective, exc):
        """This rank refused a ``collective`` call (``exc``) before it reached the agreement: enter the
        refusal in the ddl communicator's agreement, where the other ranks wait for this call (after
        the path choice, itself collective, so that the ranks stay in step on a first call), so that
        they raise MismatchError at once instead of blocking."""
        if self.size == 1 or self._freed:
            return
        try:
            self._choose_path()
        except Exception:          # no runtime to choose with: nothing more to say than exc
            return
        self.comm._announce_refusal(collective, exc)

    # ---- the collectives -----------------------------------------------------------------------------------
    def _run(self, layout, send, recv, count, op, root, stream, sig_count):
        if self._freed:
            raise Error("this ddl.Communicator's device executor was freed")
        dt = recv.dtype
        if op is not None:
            _check_op(op, dt)
        path = self._choose_path()
        if self.size == 1 and op in LOGICAL:
            path = "host-staged"   # one rank reduces nothing; the host path makes the 1 or 0 (no kernel for it)
        if path == "host-staged":
            req = self._run_staged(layout, send, recv, op, root, stream)
        else:
            req = self._run_device(path, layout, send, recv, count, op, root, stream, sig_count)
        self._ran(path)
        return req

    def _ran(self, path):
        """Record the path that ran, here and on the communicator (``comm.last_path``)."""
        self.last_path = path
        try:
            self.comm.last_path = path
        except Exception:  # pragma: no cover - a communicator with __slots__
            pass

    def _run_device(self, path, layout, send, recv, count, op, root, stream, sig_count):
        dt = recv.dtype
        collective = _LAYOUT_COLLECTIVE[layout]
        rt = self.runtime
        s = rt.stream(stream)
        self._check_device(send, recv)
        first = divides_first(op, dt.name, self.size)
        if first:                # out of place, from a divided copy of the input (as on the host)
            layout = layout.replace("_inplace", "")
        sched, lp = self._launch_plan(layout, count, dt, root)
        kop = "SUM" if op is not None and op.average else (op.name if op is not None else None)
        # everything that may fail on one rank alone (allocation, kernel compilation) before the
        # agreement: a failure is then announced as a refusal, instead of leaving the peers blocked
        # in the transfers of a plan this rank abandoned
        scratch, work = self._workspace(lp, s, recv.ptr)
        copy = self._copy_space(count * recv.itemsize, s, recv.ptr) if first else None
        self._prepare(lp, kop, dt, op)
        self._agree(collective, sig_count, dt, op, root, sched)
        for b in (send, recv):
            if b is not None and b.stream is not None:
                rt.wait_stream(s, b.stream)
        if self._previous is not None and self._previous[1] != s.ptr:
            rt.wait_event(s, self._previous[0])     # the previous collective ran on another stream
        if first:
            rt.memcpy(copy, (send if send is not None else recv).ptr, count * recv.itemsize, s)
            rt.scale(dt, copy, count, float(self.size), s)
            send_ptr = copy
        else:
            send_ptr = send.ptr if send is not None else 0
        ptrs = {SEND_BUF: send_ptr, RECV_BUF: recv.ptr, WORK_BUF: work, SCRATCH_BUF: scratch}
        transport = NcclTransport(self._nccl) if path == "nccl" else MpiTransport(self._mcomm, rt)
        run_plan(lp, ptrs, transport, rt, kop, dt, s)
        self._finish(layout, recv, count, op, rt, s)
        if path == "nccl":
            done = rt.record(s)
            self._previous = (done, s.ptr)
            return DeviceRequest(done)
        rt.synchronize(s)
        return DeviceRequest()

    def _finish(self, layout, recv, count, op, rt, s):
        p, isz = self.size, recv.itemsize
        if layout == "reduce_scatter_inplace":
            n = count // p
            if self.rank:
                rt.memcpy(recv.ptr, recv.ptr + self.rank * n * isz, n * isz, s)
        if op is not None and op.average and p > 1 and not divides_first(op, recv.dtype.name, p):
            n = count // p if layout in ("reduce_scatter", "reduce_scatter_inplace") else count
            rt.scale(recv.dtype, recv.ptr, n, float(p), s)

    def _run_staged(self, layout, send, recv, op, root, stream):
        """Device -> pinned host, the host executor, host -> device (synchronous)."""
        rt = self.runtime
        s = rt.stream(stream)
        for b in (send, recv):
            if b is not None and b.stream is not None:
                rt.wait_stream(s, b.stream)
        npdt = _numpy_dtype(recv.dtype)
        hrecv = self._host_buffer("recv", recv.nbytes).view(npdt)
        hsend = self._host_buffer("send", send.nbytes).view(npdt) if send is not None else None
        if send is not None:
            rt.memcpy(hsend.ctypes.data, send.ptr, send.nbytes, s)
        else:  # in place (and broadcast): recvbuf is the input
            rt.memcpy(hrecv.ctypes.data, recv.ptr, recv.nbytes, s)
        rt.synchronize(s)
        c = self.comm
        sb = hsend if send is not None else IN_PLACE
        self._entered += 1         # the host communicator's agreement takes it from here
        if layout.startswith("allreduce"):
            c.Allreduce(sb, hrecv, op)
        elif layout.startswith("reduce_scatter"):
            c.Reduce_scatter_block(sb, hrecv, op)
        elif layout.startswith("allgather"):
            c.Allgather(sb, hrecv)
        else:
            c.Bcast(hrecv, root)
        rt.memcpy(recv.ptr, hrecv.ctypes.data, recv.nbytes, s)
        rt.synchronize(s)
        return DeviceRequest()

    def _host_buffer(self, which, nbytes):
        entry = self._pinned.get(which)
        if entry is None or entry[1].size < nbytes:
            rt = self.runtime
            if hasattr(rt, "pinned"):
                mem, arr = rt.pinned(max(nbytes, 64))
            else:
                mem, arr = None, np.empty(max(nbytes, 64), np.uint8)
            entry = self._pinned[which] = (mem, arr)
        return entry[1][:nbytes]

    # ---- argument handling (mirrors ddl.Communicator) ------------------------------------------------
    def _reduction_args(self, sendbuf, recvbuf, op, what, stream):
        op = resolve_op(op)
        recv = parse_device_buffer(recvbuf, "recvbuf", writable=True, stream=self._stream_handle(stream))
        if is_in_place(sendbuf):
            return None, recv, op
        send = parse_device_buffer(sendbuf, "sendbuf", stream=self._stream_handle(stream))
        if send.dtype != recv.dtype:
            raise Error(f"{what}: sendbuf is {send.dtype.name} but recvbuf is {recv.dtype.name}; ddl does not convert")
        _no_overlap(send, recv, what)
        return send, recv, op

    def _stream_handle(self, stream):
        if stream is None:
            return None
        if isinstance(stream, (int, np.integer)):
            return int(stream)
        for attr in ("ptr", "cuda_stream", "handle"):
            v = getattr(stream, attr, None)
            if isinstance(v, (int, np.integer)):
                return int(v)
        return None

    @_announced("allreduce")
    def _allreduce(self, sendbuf, recvbuf, op, stream):
        send, recv, op = self._reduction_args(sendbuf, recvbuf, op, "Allreduce", stream)
        if send is None or (send.ptr == recv.ptr and send.count == recv.count and send.count):
            return self._run("allreduce_inplace", None, recv, recv.count, op, 0, stream, recv.count)
        if send.count != recv.count:
            raise Error(f"Allreduce: sendbuf has {send.count} elements but recvbuf {recv.count}; they must match")
        return self._run("allreduce", send, recv, recv.count, op, 0, stream, recv.count)

    @_announced("reduce_scatter")
    def _reduce_scatter(self, sendbuf, recvbuf, op, stream):
        send, recv, op = self._reduction_args(sendbuf, recvbuf, op, "Reduce_scatter_block", stream)
        p = self.size
        if send is None:
            if recv.count % p:
                raise Error(f"Reduce_scatter_block(IN_PLACE): recvbuf must hold size*n = {p}*n elements, got {recv.count}")
            return self._run("reduce_scatter_inplace", None, recv, recv.count, op, 0, stream, recv.count // p)
        if send.count != p * recv.count:
            raise Error(f"Reduce_scatter_block: sendbuf must hold size*n = {p}*{recv.count} = {p * recv.count} "
                        f"elements for a recvbuf of {recv.count}, got {send.count}")
        return self._run("reduce_scatter", send, recv, send.count, op, 0, stream, recv.count)

    @_announced("allgather")
    def _allgather(self, sendbuf, recvbuf, stream):
        p = self.size
        recv = parse_device_buffer(recvbuf, "recvbuf", writable=True, stream=self._stream_handle(stream))
        if is_in_place(sendbuf):
            if recv.count % p:
                raise Error(f"Allgather(IN_PLACE): recvbuf must hold size*n = {p}*n elements, got {recv.count}")
            return self._run("allgather_inplace", None, recv, recv.count, None, 0, stream, recv.count // p)
        send = parse_device_buffer(sendbuf, "sendbuf", stream=self._stream_handle(stream))
        if send.dtype != recv.dtype:
            raise Error(f"Allgather: sendbuf is {send.dtype.name} but recvbuf is {recv.dtype.name}; ddl does not convert")
        if recv.count != p * send.count:
            raise Error(f"Allgather: recvbuf must hold size*n = {p}*{send.count} = {p * send.count} elements, "
                        f"got {recv.count}")
        _no_overlap(send, recv, "Allgather")
        return self._run("allgather", send, recv, recv.count, None, 0, stream, send.count)

    @_announced("broadcast")
    def _bcast(self, buf, root, stream):
        from ..communicator import _root
        root = _root(root, self.size)
        b = parse_device_buffer(buf, "buf", writable=True, stream=self._stream_handle(stream))
        return self._run("broadcast", None, b, b.count, None, root, stream, b.count)

    # ---- public API: the Communicator's methods, plus stream= ----------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=SUM, stream=None):
        self._allreduce(sendbuf, recvbuf, op, stream)

    def Iallreduce(self, sendbuf, recvbuf, op=SUM, stream=None):
        return self._allreduce(sendbuf, recvbuf, op, stream)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        self._reduce_scatter(sendbuf, recvbuf, op, stream)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        return self._reduce_scatter(sendbuf, recvbuf, op, stream)

    def Allgather(self, sendbuf, recvbuf, stream=None):
        self._allgather(sendbuf, recvbuf, stream)

    def Iallgather(self, sendbuf, recvbuf, stream=None):
        return self._allgather(sendbuf, recvbuf, stream)

    def Bcast(self, buf, root=0, stream=None):
        self._bcast(buf, root, stream)

    def Ibcast(self, buf, root=0, stream=None):
        return self._bcast(buf, root, stream)

    def allreduce(self, array, op=SUM, stream=None):
        """A new device array (same type: CuPy array or torch tensor): ``op`` over every rank's."""
        return self.iallreduce(array, op, stream).wait()

    def iallreduce(self, array, op=SUM, stream=None):
        mod = type(array).__module__.split(".")[0]
        if mod == "cupy":
            import cupy
            out = cupy.empty_like(array)
        elif mod == "torch":
            import torch
            out = torch.empty_like(array)
        else:
            raise Error(f"allreduce(array) on device returns a new array of the same kind: CuPy arrays and "
                        f"torch tensors are supported, got {type(array).__name__}; use Allreduce(send, recv)")
        req = self._allreduce(array, out, op, stream)
        return DeviceRequest(req._event, out)

    def Free(self):
        """Release the NCCL communicator and the private MPI communicator (collective)."""
        if self._freed:
            return
        self._freed = True
        if self._previous is not None:
            self._previous[0].synchronize()   # NCCL work still queued: destroy and free after it
        self._previous = None
        self._nccl_destroy()
        self._buffers.clear()
        self._copy = None
        self._pinned.clear()
        self._mcomm.Free()

    def __repr__(self):
        return (f"<ddl.gpu.NcclExecutor rank {self.rank}/{self.size} path={self.path or 'undecided'}"
                f" device={self.device}>")


def _check_op(op, dt):
    """ddl.ops' rules (same messages) for a device dtype, numpy-representable or not."""
    if dt.numpy is not None:
        check_op_dtype(op, dt.numpy)
    elif dt.kind not in op.accepts:
        raise Error(f"{op.name} is not defined for dtype {dt.name}")


def _no_overlap(a, b, what):
    if a.count and b.count:
        a0, a1 = a.ptr, a.ptr + a.nbytes
        b0, b1 = b.ptr, b.ptr + b.nbytes
        if a0 < b1 and b0 < a1 and not (a0 == b0 and a1 == b1):
            raise Error(f"{what}: sendbuf and recvbuf overlap in device memory; use ddl.IN_PLACE for in-place "
                        f"operation")
