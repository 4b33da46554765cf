"""GPU tests that need a CUDA device and CuPy; the whole module is skipped (with the reason) without.

Kernels against numpy (every dtype and op, odd sizes, offsets, 1..11 inputs), kernel bandwidth
against a device-to-device copy (printed), a single-rank NCCL communicator, and an end-to-end
Allreduce on CuPy arrays with several ranks under mpiexec sharing the GPU(s) -- where NCCL refuses
two ranks on one device, the fallback path runs and must match numpy and the host executor.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

try:
    import cupy
    _NDEV = cupy.cuda.runtime.getDeviceCount()
    _REASON = None if _NDEV > 0 else "cupy sees 0 CUDA devices"
except Exception as exc:  # ImportError, CUDARuntimeError (no driver), ...
    cupy, _NDEV, _REASON = None, 0, f"{type(exc).__name__}: {exc}"
if _REASON is not None:
    pytest.skip(f"no CUDA device: {_REASON}", allow_module_level=True)

import ddl  # noqa: E402
from ddl.gpu import buffers as B  # noqa: E402
from ddl.gpu import kernels as K  # noqa: E402
from ddl.gpu.executor import NcclExecutor, nccl_status  # noqa: E402
from mpi_cases._launch import job_env, mpi_command  # noqa: E402

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

ROOT = Path(__file__).resolve().parents[1]
UFUNC = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
         "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "LAND": np.logical_and, "LOR": np.logical_or,
         "LXOR": np.logical_xor}
CACHE = K.KernelCache()


def host_dtype(name):
    if name == "bfloat16":
        if BF16 is None:
            pytest.skip("bfloat16 reference needs ml_dtypes")
        return BF16
    return np.dtype(name)


def storage(name):
    """CuPy has no bfloat16: its bits live in uint16 device arrays."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def random(name, n, rng, nan=False):
    d = host_dtype(name)
    if d.kind in "iu":
        info = np.iinfo(d)
        return rng.integers(info.min, info.max, n, dtype=d, endpoint=True)
    if d.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if nan and n:
        x[rng.integers(0, n, max(1, n // 9))] = np.nan
    return x.astype(d)


def to_device(host, name, offset=0):
    """A device copy of ``host`` starting ``offset`` elements into a fresh allocation."""
    st = storage(name)
    raw = cupy.zeros(host.size + offset + 8, st)
    view = raw[offset:offset + host.size]
    view.set(host.view(st))
    return raw, view


@pytest.mark.parametrize("name", list(K.KERNEL_DTYPES) + ["bool"])
def test_kernels_match_numpy(name):
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    d = host_dtype(name)
    kind = B.DTYPES[name].kind
    ops = [op for op in K.OPS if not (op in K.BITWISE and kind == "float")
           and not (kind == "bool" and op in ("SUM", "PROD"))]
    for op in ops:
        for k in (1, 2, 3, 8, 11):
            for n in (1, 5, 31, 1000, 4099, 1 << 16):
                offs = [0] * (k + 1) if n % 2 else [int(o) for o in rng.integers(0, 3, k + 1)]
                arrays = [random(name, n, rng, nan=op in ("MIN", "MAX")) for _ in range(k + 1)]
                dev = [to_device(a, name, o) for a, o in zip(arrays, offs)]
                out_raw, out = to_device(np.zeros(n, d), name, offs[0])
                for inplace in (False, True):
                    dst = dev[0][1] if inplace else out
                    CACHE.reduce(op, name, dst.data.ptr, dev[0][1].data.ptr, [v.data.ptr for _, v in dev[1:]], n)
                    cupy.cuda.get_current_stream().synchronize()
                    expect = arrays[0].copy()
                    for a in arrays[1:]:
                        UFUNC[op](expect, a, out=expect)
                    got = dst.get().view(d)
                    assert got.tobytes() == expect.tobytes(), (name, op, k, n, offs, inplace)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_scale_kernel(name):
    rng = np.random.default_rng(1)
    d = host_dtype(name)
    for n in (1, 7, 1000, 12345):
        x = random(name, n, rng)
        _, v = to_device(x, name, 1)
        CACHE.scale(name, v.data.ptr, n, 6.0)
        expect = x.copy()
        np.true_divide(expect, 6, out=expect, casting="unsafe")
        assert v.get().view(d).tobytes() == expect.tobytes()


def _time(fn, iters=20):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / iters


def test_kernel_bandwidth_vs_copy(capsys):
    """Printed, not asserted (see benchmarks/bench_gpu_kernels.py for the full table)."""
    n = 64 << 20  # 256 MiB of float32
    a, b, c = (cupy.ones(n, cupy.float32) for _ in range(3))
    t_copy = _time(lambda: cupy.cuda.runtime.memcpyAsync(c.data.ptr, a.data.ptr, a.nbytes, 3,
                                                         cupy.cuda.get_current_stream().ptr))
    t_red = _time(lambda: CACHE.reduce("SUM", "float32", a.data.ptr, a.data.ptr, [b.data.ptr], n))
    copy_bw = 2 * a.nbytes / t_copy / 1e9
    red_bw = 3 * a.nbytes / t_red / 1e9
    with capsys.disabled():
        print(f"\nfloat32 SUM 1 input, 256 MiB: kernel {red_bw:.0f} GB/s, D2D copy {copy_bw:.0f} GB/s, "
              f"ratio {red_bw / copy_bw:.2f} (target >= 0.85)")


def test_device_buffers_without_copy():
    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    b = B.parse_device_buffer(a)
    assert b.ptr == a.data.ptr and b.count == 12 and b.dtype.name == "float32"
    with cupy.cuda.Stream(non_blocking=True) as st:   # pending work is on the current stream
        assert B.parse_device_buffer(a).stream == st.ptr
    with pytest.raises(ddl.Error, match="not contiguous"):
        B.parse_device_buffer(a[:, ::2])
    assert B.parse_device_buffer(a.T).count == 12   # Fortran order
    assert B.is_device_buffer(a) and not B.is_device_buffer(a.get())
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.zeros(10, dtype=torch.bfloat16, device="cuda")
    tb = B.parse_device_buffer(t)
    assert tb.ptr == t.data_ptr() and tb.dtype.name == "bfloat16"


def test_single_rank_nccl_communicator():
    from mpi4py import MPI
    ok, version, why = nccl_status()
    comm = ddl.Communicator(MPI.COMM_SELF)
    ex = NcclExecutor(comm)
    x = cupy.arange(1001, dtype=cupy.float32)
    y = cupy.empty_like(x)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x *= 3          # enqueued on s: the collective on s must see it without any host synchronisation
    ex.Allreduce(x, y, op=ddl.SUM, stream=s)
    s.synchronize()
    cupy.testing.assert_array_equal(y, cupy.arange(1001, dtype=cupy.float32) * 3)
    z = cupy.ones(10, cupy.float64)
    req = ex.Iallreduce(ddl.IN_PLACE, z, op=ddl.AVG)
    req.Wait()
    cupy.testing.assert_array_equal(z, cupy.ones(10))
    expected = "nccl" if ok else ("cuda-aware-mpi" if ex.path == "cuda-aware-mpi" else "host-staged")
    assert ex.last_path == comm.last_path == expected, (ex.path_reason, why)
    if ok:
        assert ex._nccl is not None
    ex.Free()
    comm.Free()


def test_collectives_keep_their_call_order_across_streams():
    """The contract: a collective on another stream than the one before sees its result (NCCL needs
    the same order on every rank), and Free() leaves nothing of the communicator's queued. s1 is kept
    busy ahead of the first collective. (On one rank this passed on an H100 also before the executor
    ordered streams itself: the second call did not return before s1 was done, for a reason not
    established; with peers, NCCL's order is what the explicit wait guarantees.)"""
    from mpi4py import MPI
    comm = ddl.Communicator(MPI.COMM_SELF)
    n = 1 << 26
    a, b, c = cupy.ones(n, cupy.float32), cupy.zeros(n, cupy.float32), cupy.full(n, -1, cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        for _ in range(30):
            a *= 1.0                     # about 5 ms of work ahead of the first collective
    comm.Iallreduce(a, b, stream=s1)
    comm.Iallreduce(b, c, stream=s2)
    s2.synchronize()
    assert comm.last_path == "nccl" and bool((c == 1).all())
    with s1:
        for _ in range(30):
            a *= 1.0
    comm.Iallreduce(a, b, stream=s1)
    comm.Free()
    assert s1.done


def test_functional_allreduce_returns_a_new_device_array():
    from mpi4py import MPI
    comm = ddl.Communicator(MPI.COMM_SELF)
    x = cupy.arange(10, dtype=cupy.float32)
    y = comm.allreduce(x, op=ddl.SUM)
    assert isinstance(y, cupy.ndarray) and y.data.ptr != x.data.ptr and y.get().tolist() == x.get().tolist()
    z = comm.iallreduce(x, op=ddl.MAX).wait()
    assert isinstance(z, cupy.ndarray) and z.get().tolist() == x.get().tolist()
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        t = torch.full((5,), 2.0, device="cuda")
        u = comm.allreduce(t, op=ddl.AVG)
        assert isinstance(u, torch.Tensor) and u.is_cuda and u.data_ptr() != t.data_ptr() and torch.equal(u, t)
    comm.Free()


@pytest.mark.filterwarnings("error::DeprecationWarning")   # e.g. CuPy 14's on ExternalStream
def test_torch_cuda_tensors():
    """torch CUDA tensors go to the device executor as they are: float32 on a torch stream with pending
    work, bfloat16 (DLPack names its type), in place and nonblocking."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from mpi4py import MPI
    comm = ddl.Communicator(MPI.COMM_SELF)
    x = torch.arange(4099, device="cuda", dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 3                      # still pending on s when the collective is enqueued on s
        out = torch.empty_like(y)
    comm.Allreduce(y, out, op=ddl.SUM, stream=s)
    s.synchronize()
    assert torch.equal(out, x * 3) and comm.last_path in ("nccl", "cuda-aware-mpi")
    b = torch.randn(1001, device="cuda").to(torch.bfloat16)
    ob = torch.empty_like(b)
    comm.Allreduce(b, ob, op=ddl.MAX)
    torch.cuda.synchronize()
    assert torch.equal(ob, b)
    keep = b.clone()
    comm.Iallreduce(ddl.IN_PLACE, b, op=ddl.AVG).Wait()
    assert torch.equal(b, keep)
    comm.Free()


_SCRIPT = textwrap.dedent('''
    import numpy as np
    import cupy
    from mpi4py import MPI
    import ddl
    from ddl.gpu.executor import NcclExecutor

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    comm = ddl.Communicator(world)
    ex = NcclExecutor(comm)
    rng = np.random.default_rng(rank)
    for dt in (np.float32, np.float16, np.int32):
        for n in (1, 999, 1 << 20):
            h = (rng.standard_normal(n) * 5).astype(dt)
            ref = np.empty_like(h)
            comm.Allreduce(h, ref, op=ddl.SUM)                       # host executor
            total = np.sum(np.stack(world.allgather(h)).astype(np.float64), axis=0)
            d = cupy.asarray(h)
            out = cupy.empty_like(d)
            ex.Allreduce(d, out, op=ddl.SUM)
            got = out.get()
            assert got.tobytes() == ref.tobytes(), (rank, dt, n, ex.last_path)
            if np.dtype(dt).kind == "f":
                np.testing.assert_allclose(got.astype(np.float64), total, rtol=5e-2, atol=0.5)
            ex.Allreduce(ddl.IN_PLACE, d, op=ddl.SUM)
            assert d.get().tobytes() == ref.tobytes()
    if rank == 0:
        print(f"RESULT path={ex.last_path} ({ex.path_reason})", flush=True)
    ex.Free()
    comm.Free()
''')


def _result_under_mpiexec(tmp_path, nranks, text, **env):
    """Run the script ``text`` on ``nranks`` ranks (exit status 0 asserted); its rank 0's RESULT line."""
    script = tmp_path / "gpu_script.py"
    script.write_text(text)
    env = job_env(PYTHONUNBUFFERED="1", DDL_CACHE_DIR=str(tmp_path / "plans"), **env)
    proc = subprocess.run([*mpi_command(nranks), sys.executable, "-m", "mpi4py", str(script)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=550)
    assert proc.returncode == 0, proc.stdout[-6000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stdout[-3000:]
    return line


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.timeout(600)
def test_allreduce_on_cupy_arrays_under_mpiexec(tmp_path, nranks):
    line = _result_under_mpiexec(tmp_path, nranks, _SCRIPT)
    print(line[0])
    path = line[0].split("path=")[1].split()[0]
    if _NDEV < nranks:
        # NCCL refuses two ranks on one GPU: the duplicate is detected before NCCL is touched
        assert path in ("cuda-aware-mpi", "host-staged"), line[0]
        assert "share GPU" in line[0] or "NCCL unusable" in line[0]
    elif nccl_status()[0]:
        assert path == "nccl", line[0]


ALL = ("allreduce", "reduce_scatter", "allgather", "broadcast")
_PIPELINE_COLLECTIVES = {"auto": ALL, "ring": ALL, "halving-doubling": ALL[:3], "recursive-doubling": ALL[:1],
                         "double-binary-tree": ("allreduce", "broadcast")}
_PIPELINE_SCRIPT = textwrap.dedent('''
    """ddl's device pipeline (its kernels, its schedules, transfers per step) with ranks sharing a GPU.

    NCCL refuses two ranks on one GPU, and this MPI is not CUDA-aware; but memory from
    cudaMallocManaged is readable by the host, so MPI can carry it. Every CuPy allocation here is
    managed and the executor is told that MPI can take device pointers: the cuda-aware-mpi path then
    runs ddl's whole device pipeline (copies, reductions on the GPU, one MPI exchange per step)."""
    import os
    import numpy as np
    import cupy
    from mpi4py import MPI
    import ddl
    import ddl.gpu.executor as E

    os.environ["DDL_GPU_PATH"] = "cuda-aware-mpi"
    E.detect_cuda_aware_mpi = lambda: (True, "managed memory: the host reads it")
    cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    COLLECTIVES = %r
    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    checked = 0
    for algorithm, collectives in COLLECTIVES.items():
        comm = ddl.Communicator(world, algorithm=algorithm)
        rng = np.random.default_rng(1000 * rank + len(algorithm))
        for dt, ops in ((np.float32, (ddl.SUM, ddl.AVG, ddl.MAX)), (np.float16, (ddl.SUM,)),
                        (np.int64, (ddl.SUM, ddl.MIN))):
            for n in (p, 8 * p, 65539 * p):
                h = (rng.standard_normal(n) * 5).astype(dt)
                d = cupy.asarray(h)
                for op in ops:
                    ref, out = np.empty_like(h), cupy.empty_like(d)
                    comm.Allreduce(h, ref, op=op)                      # host executor
                    comm.Allreduce(d, out, op=op)
                    assert comm.last_path == "cuda-aware-mpi", comm.last_path
                    assert out.get().tobytes() == ref.tobytes(), ("allreduce", algorithm, dt, n, op.name)
                    fresh = comm.allreduce(d, op=op)                   # functional: a new CuPy array
                    assert isinstance(fresh, cupy.ndarray) and fresh.get().tobytes() == ref.tobytes()
                    checked += 1
                    if "reduce_scatter" in collectives:
                        rs_ref, rs = np.empty(n // p, dt), cupy.empty(n // p, dt)
                        comm.Reduce_scatter_block(h, rs_ref, op=op)
                        comm.Reduce_scatter_block(d, rs, op=op)
                        assert rs.get().tobytes() == rs_ref.tobytes(), ("reduce_scatter", algorithm, dt, n, op.name)
                        checked += 1
                if "allgather" in collectives:
                    ag_ref, ag = np.empty(n * p, dt), cupy.empty(n * p, dt)
                    comm.Allgather(h, ag_ref)
                    comm.Allgather(d, ag)
                    assert ag.get().tobytes() == ag_ref.tobytes() == np.concatenate(world.allgather(h)).tobytes()
                    checked += 1
                if "broadcast" in collectives:
                    b = d.copy()
                    comm.Bcast(b, root=p - 1)
                    assert b.get().tobytes() == world.bcast(h, root=p - 1).tobytes()
                    checked += 1
        comm.Free()
    world.Barrier()
    if rank == 0:
        print(f"RESULT checked={checked}", flush=True)
''')


@pytest.mark.parametrize("nranks", [3, 4])
@pytest.mark.timeout(600)
def test_device_pipeline_with_ranks_sharing_a_gpu(tmp_path, nranks):
    """The device path proper (not host staging) on real kernels: results equal the host executor's."""
    if not cupy.cuda.Device(0).attributes.get("ConcurrentManagedAccess", 0):
        pytest.skip("this GPU cannot share managed memory with the host while kernels run")
    line = _result_under_mpiexec(tmp_path, nranks, _PIPELINE_SCRIPT % (_PIPELINE_COLLECTIVES,), DDL_INLINE_BYTES="0")
    # 3 sizes x (each op of the dtype: allreduce, reduce-scatter; once: allgather, broadcast)
    expected = sum(3 * (ops * len(set(cs) & set(ALL[:2])) + len(set(cs) & set(ALL[2:])))
                   for cs in _PIPELINE_COLLECTIVES.values() for ops in (3, 1, 2))
    assert int(line[0].split("checked=")[1]) == expected, (expected, line[0])


@pytest.mark.timeout(300)
def test_torch_hook_example_on_the_gpu():
    """examples/torch_hook.py --device cuda: gradients averaged in place on the GPU under mpiexec, the
    loss curve equal to single-process training and the replicas identical."""
    pytest.importorskip("torch")
    proc = subprocess.run([*mpi_command(2), sys.executable, "examples/torch_hook.py", "--device", "cuda",
                           "--steps", "6"], cwd=ROOT, env=job_env(PYTHONUNBUFFERED="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
    assert proc.returncode == 0 and "TORCH_HOOK OK" in proc.stdout, proc.stdout[-4000:]
    path = proc.stdout.split("path: ")[1].split()[0]
    assert path == ("nccl" if _NDEV >= 2 and nccl_status()[0] else "host-staged"), proc.stdout[-2000:]
