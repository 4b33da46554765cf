"""Review of the device executor's error and in-flight handling, without a GPU: the CUDA-aware-MPI path
run on host memory (HostRuntime) under mpiexec, as in test_gpu_nodevice.py.

The host path guarantees (README, errors and stalls) that a failure on one rank never leaves the others
blocked, that a call refused on one rank is announced to the others, and that a rank that does not
arrive gives a StallError, not a hang. These check the same on the device path."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpi_cases._launch import job_env, mpi_command

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy as np
    from mpi4py import MPI
    import ddl
    from ddl.gpu.executor import HostRuntime, NcclExecutor
    sys.path.insert(0, "tests/mpi_cases")   # run from the repository root
    from _host_array import HostArray

    case = sys.argv[1]
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = ddl.Communicator(world, stall_timeout=3, stall_warning=2)

    class Flaky(HostRuntime):
        """Rank 1 runs out of memory for large workspaces, and fails to build a PROD kernel."""
        def alloc(self, nbytes, stream):
            if rank == 1 and nbytes > 4096:
                raise MemoryError("out of memory allocating 200000 bytes")
            return super().alloc(nbytes, stream)

        def prepare(self, op, dtype, widths, average):
            if rank == 1 and op == "PROD":
                raise RuntimeError("NVRTC_ERROR_COMPILATION")   # what a kernel that fails to build raises
            super().prepare(op, dtype, widths, average)

    ex = NcclExecutor(comm, runtime=Flaky(), path="cuda-aware-mpi")
    x = np.arange(8, dtype=np.float32)

    def allreduce(op=ddl.SUM, n=8, host=False):
        a = np.arange(n, dtype=np.float32)
        out = np.zeros_like(a)
        if host:
            comm.Allreduce(a, out, op=op)
        else:
            comm.Allreduce(HostArray(a), HostArray(out), op=op)
        return out

    def expect(fn, mine, others, what):
        try:
            fn()
        except ddl.Error as exc:
            want = mine if rank == 1 else others
            assert type(exc) is want[0] and want[1] in str(exc), (rank, what, type(exc), exc)
        else:
            raise SystemExit(f"rank {rank}: nothing raised for {what}")
        out = allreduce()                       # the communicator stays usable and in step
        assert (out == np.arange(8) * size).all(), (rank, what, out)

    if case == "first-call":
        # the communicator's first call on device buffers makes its device executor, collectively:
        # rank 1 passing host buffers to it is a MismatchError everywhere, not ranks blocked in the making
        try:
            allreduce(host=rank == 1)
            raise SystemExit(f"rank {rank}: no MismatchError")
        except ddl.MismatchError as exc:
            assert "on device buffers" in str(exc), (rank, exc)
        assert comm._device is None, rank
        assert (allreduce(host=True) == np.arange(8) * size).all(), rank    # still in step
    comm._device = ex                           # device buffers go to the executor on host memory
    allreduce()
    if case == "one-rank-fails":
        # a workspace allocation fails on rank 1 only: a ddl.Error there, MismatchError on the others
        expect(lambda: allreduce(n=100000), (ddl.Error, "cannot allocate the device workspace"),
               (ddl.MismatchError, "rank 1 called Allreduce with arguments it refused"), "workspace")
        # a kernel that does not build on rank 1 only: the same, before any data moves
        expect(lambda: allreduce(op=ddl.PROD), (ddl.Error, "NVRTC_ERROR_COMPILATION"),
               (ddl.MismatchError, "rank 1 called Allreduce with arguments it refused"), "kernel")
        # rank 1 passes host buffers to a call the others make on device buffers: MismatchError everywhere
        expect(lambda: allreduce(host=rank == 1), (ddl.MismatchError, "ranks disagree"),
               (ddl.MismatchError, "ranks disagree"), "host and device buffers")
    elif case == "absent":
        # rank 1 arrives after rank 0's stall_timeout: StallError on rank 0, then on rank 1 naming it
        if rank == 1:
            time.sleep(4.5)
        try:
            allreduce()
            raise SystemExit(f"rank {rank}: no StallError")
        except ddl.StallError as exc:
            assert rank == 0 or "rank 0 gave up" in str(exc), (rank, exc)
    world.Barrier()
    if rank == 0:
        print(f"RESULT {case} ok", flush=True)
''')


def _run(tmp_path, case, nranks, timeout):
    script = tmp_path / "gpu_review.py"
    script.write_text(_SCRIPT)
    env = job_env(PYTHONUNBUFFERED="1", DDL_CACHE_DIR=str(tmp_path / "plans"), DDL_INLINE_BYTES="0")
    try:
        proc = subprocess.run([*mpi_command(nranks), sys.executable, "-m", "mpi4py", str(script), case],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{case}: the ranks hung ({timeout} s)\n{out[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"RESULT {case} ok" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(60)
def test_device_failure_on_one_rank_is_announced_not_a_hang(tmp_path):
    """A workspace allocation (out of memory) or a kernel build that fails on one rank used to happen
    after the agreement: that rank raised a raw MemoryError, the others blocked in the plan's transfers
    forever. A rank that passed host buffers to a device call paired with its peers' NEXT device call
    (wrong data, and the call after hung). Now: ddl.Error there, MismatchError on the others."""
    _run(tmp_path, "one-rank-fails", 3, 30)


@pytest.mark.timeout(60)
def test_device_call_a_rank_does_not_join_gives_stall_error(tmp_path):
    """The device agreement was a blocking MPI_Allreduce without a stall watchdog: a missing rank
    blocked the others forever, stall_timeout or not."""
    _run(tmp_path, "absent", 2, 25)


@pytest.mark.timeout(60)
def test_first_device_call_with_host_buffers_on_one_rank_is_a_mismatch(tmp_path):
    """Making the device executor (at a communicator's first call on device buffers) is collective: a
    rank that passed host buffers to that call left the others blocked in it forever while it raised
    StallError. The ranks now agree first: MismatchError on every rank, and the communicator goes on."""
    _run(tmp_path, "first-call", 3, 30)
