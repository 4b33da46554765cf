"""``ddl bench --device gpu``: the benchmark's buffers on the GPU, and NCCL's own allreduce as a peer.

:mod:`ddl.bench` runs the same loop for host and device buffers; what differs lives in a *memory*
object (where buffers are made, poisoned, read back, and how a timed call waits for the device):
:class:`ddl.bench.HostMemory` for numpy, :class:`DeviceMemory` here for CuPy. Peers on the GPU:

* ``nccl`` -- :class:`NcclImpl`, ``ncclAllReduce`` through CuPy (the reference every GPU collective is
  measured against). NCCL refuses two ranks on one GPU, so with fewer GPUs than ranks on a machine it
  is skipped, with that reason;
* ``mpi`` -- ``MPI_Allreduce`` on the device buffers when the MPI library is CUDA-aware, else staged
  through host memory (copy down, allreduce, copy up: what a framework without CUDA-aware MPI does);
  the header says which.

A timed call ends when the device has finished (the current stream is synchronised), for every
implementation alike.
"""

from ..bench import Skip, poison
from ..errors import Error
from . import INSTALL_CUPY


class DeviceMemory:
    """CuPy buffers on this rank's GPU (node-local rank modulo the GPUs visible)."""

    name = "gpu"

    def __init__(self, world):
        from .executor import select_device

        problem = None
        try:
            import cupy
        except ImportError as exc:
            cupy, problem = None, f"CuPy cannot be imported ({exc}); {INSTALL_CUPY}"
        if cupy is not None:
            try:
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    problem = "no CUDA device is visible"
            except Exception as exc:  # CUDA driver missing or broken
                problem = f"CUDA is not usable ({exc})"
        problems = [p for p in world.allgather(problem) if p]
        if problems:
            raise Error(f"--device gpu: {problems[0]}")
        self.cp = cupy
        self.device_id = select_device(world)
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"]
        self.label = f"GPU {self.device_id} ({name.decode() if isinstance(name, bytes) else name})"

    def upload(self, host):
        return self.cp.asarray(host)

    def empty_like(self, a):
        return self.cp.empty_like(a)

    def download(self, a, out=None):
        return self.cp.asnumpy(a, out=out)

    def upload_into(self, dst, host):
        dst.set(host)

    def poison(self, a):
        poison(a)               # CuPy arrays fill like numpy ones

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def mpi_staging(self):
        """True when MPI must be handed host copies (the MPI library is not CUDA-aware)."""
        from .executor import detect_cuda_aware_mpi

        aware, _reason = detect_cuda_aware_mpi()
        return not aware

    def attach(self, comm):
        """Nothing to do: a ddl.Communicator makes its device executor on the first device call."""


class NcclImpl:
    """``ncclAllReduce`` on the benchmark's device buffers, on the current stream."""

    kind = "peer"
    name = "nccl"

    def __init__(self, world, memory):
        from mpi4py import MPI

        from .buffers import device_dtype
        from .executor import nccl_status

        ok, _version, reason = nccl_status()
        oks = world.allgather((ok, reason))
        bad = [r for o, r in oks if not o]
        if bad:
            raise Skip(bad[0])
        where = world.allgather((MPI.Get_processor_name(), memory.device_id))
        if len(set(where)) < len(where):
            raise Skip(f"{len(where)} ranks share {len(set(where))} GPU(s); NCCL needs a GPU per rank")
        from cupy.cuda import nccl

        uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None, root=0)
        self.comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        self.nccl, self.memory, self.dtype_of = nccl, memory, device_dtype
        self.library = reason
        self.op = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def prepare_size(self, nbytes):
        pass

    def prepare(self, send, recv):
        self.memory.poison(recv)

    def call(self, send, recv, op):
        stream = self.memory.cp.cuda.get_current_stream()
        self.comm.allReduce(send.data.ptr, recv.data.ptr, send.size, self.dtype_of(send.dtype).nccl,
                            self.op[op], stream.ptr)

    def close(self):
        self.comm.destroy()

