"""GPU support for ddl: device buffers, reduction kernels, and the NCCL executor.

Importing ``ddl.gpu`` (and :mod:`ddl.gpu.buffers`, :mod:`ddl.gpu.kernels`, :mod:`ddl.gpu.launch_plan`)
needs numpy only; CuPy is imported when a collective actually runs on device buffers.

* :mod:`ddl.gpu.buffers` -- recognise device buffers (``__cuda_array_interface__``, DLPack) without
  copying; dtype table (numpy / NCCL / CUDA C);
* :mod:`ddl.gpu.kernels` -- CUDA C++ reduction kernels from ``native/reduce.cuh``, compiled at run
  time (CuPy RawModule / NVRTC);
* :mod:`ddl.gpu.launch_plan` -- a Schedule turned into steps of grouped sends/receives and the
  reductions after each step (pure Python);
* :mod:`ddl.gpu.executor` -- :class:`NcclExecutor`: runs collectives on device buffers over NCCL,
  CUDA-aware MPI, or by staging through host memory, and says which (``last_path``).
"""
__all__ = ["DTYPES", "DeviceBuffer", "DeviceDType", "device_dtype", "is_device_buffer", "parse_device_buffer",
           "NcclExecutor", "detect_cuda_aware_mpi"]

INSTALL_CUPY = ("pip install cupy-cuda12x (CUDA 12) or cupy-cuda13x (CUDA 13), or in ddl's source tree "
                "pip install -e '.[gpu]' or '.[gpu-cuda13]'")

import os  # noqa: E402

from ..errors import Error  # noqa: E402
from ..settings import env_flag  # noqa: E402
from .buffers import DTYPES, DeviceBuffer, DeviceDType, device_dtype, is_device_buffer, parse_device_buffer  # noqa: F401,E402

PATHS = ("nccl", "cuda-aware-mpi", "host-staged")


def requested_path(path=None):
    """The device path asked for: ``path``, else env ``DDL_GPU_PATH``, else ``auto``."""
    requested = (path or os.environ.get("DDL_GPU_PATH", "auto") or "auto").strip().lower()
    if requested not in PATHS + ("auto",):
        raise Error(f"DDL_GPU_PATH / path must be auto, {', '.join(PATHS)}; got {requested!r}")
    return requested


def check_settings():
    """Read the GPU settings of the environment when a communicator is made, as every other setting is:
    a typo then fails where the job starts, on every rank, not at its first collective on device buffers
    (which may come hours later, or only on some ranks)."""
    requested_path()
    env_flag("DDL_CUDA_AWARE_MPI", None)
    env_flag("DDL_GPU_VERBOSE", False)


def __getattr__(name):
    if name in ("NcclExecutor", "detect_cuda_aware_mpi"):
        from . import executor
        return getattr(executor, name)
    raise AttributeError(f"module 'ddl.gpu' has no attribute {name!r}")
