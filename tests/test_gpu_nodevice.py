"""GPU support tested without a GPU: buffers, dtypes, kernel sources (compiled by nvcc / NVRTC when
present, and run on the CPU through a host build of the same element loop), launch plans, and the
device executor's step logic (a lockstep NCCL-group simulator; CUDA-aware-MPI and host-staged paths
under mpiexec on host memory)."""
import ctypes
import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import ddl
from ddl.algorithms import ALGORITHMS
from ddl.gpu import buffers as B
from ddl.gpu import kernels as K
from ddl.gpu.executor import HostRuntime, _HostAlloc, detect_cuda_aware_mpi, run_plan
from ddl.gpu.launch_plan import (LAYOUTS, RECV_BUF, SCRATCH_BUF, SEND_BUF, WORK_BUF, chunk_locations, describe,
                                 launch_plan, transfer_levels)
from ddl.planner import flat_topology
from ddl.schedule import RECV, REDUCE, SEND
from mpi_cases._launch import job_env, mpi_command

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = BF16 = None

ROOT = Path(__file__).resolve().parents[1]
# DDL_NVCC: the nvcc to use, or "none" to skip the compilation tests
NVCC = os.environ.get("DDL_NVCC") or shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
NVCC = None if NVCC in (None, "", "none") else NVCC
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the generated CUDA C++ is not compiled here")


def npdt(name):
    if name == "bfloat16":
        if BF16 is None:
            pytest.skip("bfloat16 on the host needs ml_dtypes")
        return BF16
    return np.dtype(name)


# ==== dtypes ============================================================================================
EXPECTED = {  # name: (typestr, ctype, nccl enum)
    "float16": ("<f2", "__half", 6), "bfloat16": (None, "__nv_bfloat16", 9), "float32": ("<f4", "float", 7),
    "float64": ("<f8", "double", 8), "int8": ("|i1", "signed char", 0), "int16": ("<i2", "short", None),
    "int32": ("<i4", "int", 2), "int64": ("<i8", "long long", 4), "uint8": ("|u1", "unsigned char", 1),
    "uint16": ("<u2", "unsigned short", None), "uint32": ("<u4", "unsigned int", 3),
    "uint64": ("<u8", "unsigned long long", 5), "bool": ("|b1", "unsigned char", None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dtype_table(name):
    typestr, ctype, nccl = EXPECTED[name]
    d = B.DTYPES[name]
    assert (d.typestr, d.ctype, d.nccl) == (typestr, ctype, nccl)
    assert B.device_dtype(name) is d
    if typestr is not None:
        assert B.dtype_from_typestr(typestr) is d
        assert B.device_dtype(np.dtype(typestr)) is d
        assert np.dtype(typestr).itemsize == d.itemsize
        assert d.numpy == np.dtype(typestr)


def test_bfloat16_everywhere():
    d = B.DTYPES["bfloat16"]
    assert B.device_dtype("bf16") is d and B.device_dtype("bfloat16") is d
    assert B.dtype_from_dlpack(B.DL_BFLOAT, 16) is d
    if BF16 is not None:
        assert B.device_dtype(BF16) is d and d.numpy == BF16
    with pytest.raises(ddl.Error, match="bfloat16"):
        B.dtype_from_typestr("<V2")   # what a bfloat16 array's typestr looks like: ambiguous


def test_nccl_enums_match_cupy_constants_when_available():
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy not installed: enum values checked against nccl.h only")
    for name, attr in (("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"), ("int64", "NCCL_INT64"),
                       ("uint8", "NCCL_UINT8"), ("bfloat16", "NCCL_BFLOAT16")):
        if hasattr(nccl, attr):
            assert B.DTYPES[name].nccl == getattr(nccl, attr)


@pytest.mark.parametrize("bad", ["complex64", np.complex128, np.longdouble, "<c8", "O", "S4", ">f4", "<M8[s]"])
def test_unsupported_dtypes_raise(bad):
    if bad is np.longdouble and np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("longdouble is float64 on this platform")
    with pytest.raises(ddl.Error):
        B.device_dtype(bad)


def test_dlpack_dtype_codes():
    assert B.dtype_from_dlpack(B.DL_FLOAT, 32) is B.DTYPES["float32"]
    assert B.dtype_from_dlpack(B.DL_UINT, 64) is B.DTYPES["uint64"]
    assert B.dtype_from_dlpack(B.DL_BOOL, 8) is B.DTYPES["bool"]
    for code, bits, lanes in ((B.DL_COMPLEX, 64, 1), (B.DL_FLOAT, 8, 1), (B.DL_FLOAT, 32, 4), (B.DL_INT, 128, 1)):
        with pytest.raises(ddl.Error):
            B.dtype_from_dlpack(code, bits, lanes)


# ==== __cuda_array_interface__ ==========================================================================
class FakeCAI:
    """A device array as CuPy / Numba / torch present it: nothing but the interface dict."""

    def __init__(self, ptr, shape, typestr="<f4", strides=None, readonly=False, version=3, stream=None, **extra):
        self.cai = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly), "strides": strides,
                    "version": version, **extra}
        if stream is not None:
            self.cai["stream"] = stream

    @property
    def __cuda_array_interface__(self):
        return self.cai


PTR = 0x7F3A_0000_0200  # never dereferenced: the point is that it is taken as is


def test_an_anonymous_two_byte_array_is_bfloat16_when_the_spec_says_so():
    """The error for a '<V2' typestr says to name the dtype with [buf, 'bfloat16']: that must work."""
    raw = FakeCAI(PTR, (6,), typestr="<V2")
    with pytest.raises(ddl.Error, match=r"say which it is with \[buf, 'bfloat16'\]"):
        B.parse_device_buffer(raw)
    b = B.parse_device_buffer([raw, "bfloat16"])
    assert b.dtype is B.DTYPES["bfloat16"] and b.count == 6 and b.ptr == PTR
    assert B.parse_device_buffer([raw, 4, "bfloat16"]).count == 4


def test_cai_pointer_taken_as_is():
    b = B.parse_device_buffer(FakeCAI(PTR, (4, 5)), "recvbuf", writable=True)
    assert b.ptr == PTR and b.count == 20 and b.dtype.name == "float32" and b.nbytes == 80
    assert b.source == "cuda_array_interface" and b.stream is None


def test_cai_versions_and_stream():
    for v in (0, 1, 2):
        b = B.parse_device_buffer(FakeCAI(PTR, (8,), "<i8", version=v, stream=7))
        assert b.stream is None and b.dtype.name == "int64"   # 'stream' only means something in v3
    assert B.parse_device_buffer(FakeCAI(PTR, (8,), stream=0x55AA)).stream == 0x55AA
    with pytest.raises(ddl.Error, match="stream 0"):
        B.parse_device_buffer(FakeCAI(PTR, (8,), stream=0))


def test_cai_contiguity():
    # C-contiguous with explicit strides, F-contiguous, size-1 dims with arbitrary strides: accepted
    assert B.parse_device_buffer(FakeCAI(PTR, (3, 4), strides=(16, 4))).count == 12
    assert B.parse_device_buffer(FakeCAI(PTR, (3, 4), strides=(4, 12))).count == 12
    assert B.parse_device_buffer(FakeCAI(PTR, (1, 4), strides=(9999, 4))).count == 4
    assert B.parse_device_buffer(FakeCAI(PTR, (0, 4), strides=(4, 8))).count == 0
    for strides in ((32, 4), (16, 8), (4, 16)):   # a column slice, a stepped view, a transpose with padding
        with pytest.raises(ddl.Error, match="not contiguous"):
            B.parse_device_buffer(FakeCAI(PTR, (3, 4), strides=strides), "sendbuf")


def test_cai_errors():
    with pytest.raises(ddl.Error, match="read-only"):
        B.parse_device_buffer(FakeCAI(PTR, (4,), readonly=True), "recvbuf", writable=True)
    assert B.parse_device_buffer(FakeCAI(PTR, (4,), readonly=True), "sendbuf").readonly
    with pytest.raises(ddl.Error, match="aligned"):
        B.parse_device_buffer(FakeCAI(PTR + 2, (4,)))
    with pytest.raises(ddl.Error, match="mask"):
        B.parse_device_buffer(FakeCAI(PTR, (4,), mask=object()))
    with pytest.raises(ddl.Error, match="not supported"):
        B.parse_device_buffer(FakeCAI(PTR, (4,), "<c8"))
    bad = FakeCAI(PTR, (4,))
    del bad.cai["typestr"]
    with pytest.raises(ddl.Error, match="typestr"):
        B.parse_device_buffer(bad)


def test_cai_specs():
    buf = FakeCAI(PTR, (10,), "<i2")
    b = B.parse_device_buffer([buf, 4])
    assert (b.ptr, b.count) == (PTR, 4)
    b = B.parse_device_buffer([buf, "bfloat16"])   # memory reinterpreted, not converted
    assert (b.ptr, b.count, b.dtype.name) == (PTR, 10, "bfloat16")
    b = B.parse_device_buffer([buf, (3, 2), "int16"])
    assert (b.ptr, b.count) == (PTR + 4, 3)
    b = B.parse_device_buffer([buf, "int32"])
    assert (b.count, b.dtype.name) == (5, "int32")
    with pytest.raises(ddl.Error, match="exceeds"):
        B.parse_device_buffer([buf, 11])
    with pytest.raises(ddl.Error, match="whole number"):
        B.parse_device_buffer([FakeCAI(PTR, (3,), "<i2"), "int32"])
    # the MPI datatype form
    from mpi4py import MPI
    assert B.parse_device_buffer([buf, MPI.SHORT]).dtype.name == "int16"


def test_is_device_buffer():
    assert B.is_device_buffer(FakeCAI(PTR, (4,)))
    assert B.is_device_buffer([FakeCAI(PTR, (4,)), 2])
    assert not B.is_device_buffer(np.zeros(4))
    assert not B.is_device_buffer([np.zeros(4), 2])
    assert not B.is_device_buffer(bytearray(8))
    assert not B.is_device_buffer(ddl.IN_PLACE)
    assert not B.is_device_buffer(None)

    class Raises:
        @property
        def __cuda_array_interface__(self):  # like a bfloat16 torch tensor
            raise TypeError("dtype torch.bfloat16 is not supported")
    assert B.is_device_buffer(Raises())
    with pytest.raises(ddl.Error, match="not supported"):
        B.parse_device_buffer(Raises())


# ==== DLPack ==========================================================================================
_DLTENSOR_NAME = b"dltensor"
_DLTENSOR_VERSIONED_NAME = b"dltensor_versioned"
_USED_NAME = b"used_dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDLPack:
    """A CUDA tensor seen through DLPack only (a hand-built DLManagedTensor in a real capsule)."""

    def __init__(self, ptr, shape, code=B.DL_FLOAT, bits=32, strides=None, byte_offset=0, device=(B.DL_CUDA, 1),
                 versioned=False, readonly=False):
        self.device = device
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides is not None else None
        t = B._DLTensor()
        t.data, t.device = ptr, B._DLDevice(*device)
        t.ndim, t.dtype = len(shape), B._DLDataType(code, bits, 1)
        t.shape = self.shape
        t.strides = self.strides if strides is not None else None
        t.byte_offset = byte_offset
        if versioned:
            self.managed = B._DLManagedTensorVersioned()
            self.managed.version = B._DLPackVersion(1, 0)
            self.managed.flags = 1 if readonly else 0
            self.managed.dl_tensor = t
            self.name = _DLTENSOR_VERSIONED_NAME
        else:
            self.managed = B._DLManagedTensor()
            self.managed.dl_tensor = t
            self.name = _DLTENSOR_NAME
        self.streams = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return _capsule_new(ctypes.addressof(self.managed), self.name, None)


def test_dlpack_device_buffer_without_copy():
    t = FakeDLPack(PTR, (2, 8), byte_offset=64)
    assert B.is_device_buffer(t)
    b = B.parse_device_buffer(t, "recvbuf", writable=True, stream=0x1234)
    assert b.ptr == PTR + 64 and b.count == 16 and b.device == 1 and b.dtype.name == "float32"
    assert b.source == "dlpack" and t.streams == [0x1234]   # the producer is told the consumer's stream
    B.parse_device_buffer(t, stream=0)
    assert t.streams[-1] == 1      # stream 0 is disallowed by the protocol: the legacy default stream is 1
    bf = B.parse_device_buffer(FakeDLPack(PTR, (5,), code=B.DL_BFLOAT, bits=16))
    assert bf.dtype.name == "bfloat16" and bf.nbytes == 10
    v = B.parse_device_buffer(FakeDLPack(PTR, (3,), versioned=True, readonly=True))
    assert v.readonly and v.ptr == PTR
    with pytest.raises(ddl.Error, match="not contiguous"):
        B.parse_device_buffer(FakeDLPack(PTR, (4, 4), strides=(8, 1)))
    assert B.parse_device_buffer(FakeDLPack(PTR, (4, 4), strides=(1, 4))).count == 16  # Fortran order
    managed = FakeDLPack(PTR, (4,), device=(B.DL_CUDA_MANAGED, 0))
    assert B.is_device_buffer(managed)
    cpu = FakeDLPack(PTR, (4,), device=(B.DL_CPU, 0))
    assert not B.is_device_buffer(cpu)
    with pytest.raises(ddl.Error, match="not a CUDA"):
        B.parse_device_buffer(cpu)
    with pytest.raises(ddl.Error, match="not supported"):
        B.parse_device_buffer(FakeDLPack(PTR, (4,), code=B.DL_COMPLEX, bits=64))


def test_dlpack_capsule_of_a_real_torch_tensor():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    info = B.dlpack_info(t.__dlpack__())
    assert info["ptr"] == t.data_ptr() and info["shape"] == (3, 4) and info["device_type"] == B.DL_CPU
    assert info["dtype"] == (B.DL_FLOAT, 32, 1)
    assert B.dlpack_info(t[1:].__dlpack__())["ptr"] == t.data_ptr() + 16
    assert B.dlpack_info(torch.zeros(2, dtype=torch.bfloat16).__dlpack__())["dtype"] == (B.DL_BFLOAT, 16, 1)
    assert not B.is_device_buffer(t)      # a CPU tensor is not a device buffer
    dummy = ctypes.c_int64(0)
    with pytest.raises(ddl.Error, match="unconsumed"):
        B.dlpack_info(_capsule_new(ctypes.addressof(dummy), _USED_NAME, None))


# ==== kernel sources ======================================================================================
def test_native_sources_found_and_overridable(tmp_path, monkeypatch):
    assert "namespace ddl" in K.native_source()
    dirs = K.native_dirs()
    assert dirs[0].name == "native" and dirs[0].parent.name == "ddl"   # next to the package first
    assert dirs[1] == ROOT / "native"                                  # then the repository root
    (tmp_path / K.HEADER).write_text("// custom\n")
    monkeypatch.setenv("DDL_NATIVE_DIR", str(tmp_path))
    K._source_cache.clear()
    assert K.native_source() == "// custom\n"
    monkeypatch.setenv("DDL_NATIVE_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(K, "native_dirs", lambda: [tmp_path / "nowhere"])
    with pytest.raises(ddl.Error, match="not found"):
        K.native_source()
    K._source_cache.clear()


def test_every_spec_generates_a_kernel():
    specs = K.all_specs()
    # 4 arithmetic ops x 12 dtypes + 3 bitwise and 3 logical ops x 8 integer dtypes, each for 1..MAX_INPUTS inputs
    assert len(specs) == (4 * 12 + 6 * 8) * K.MAX_INPUTS
    names = set()
    for op, dt, k in specs:
        name = K.kernel_name(op, dt, k)
        names.add(name)
        src = K.kernel_source(op, dt, k)
        assert f'extern "C" __global__ void __launch_bounds__({K.BLOCK}) {name}(' in src
        wrapper = src.split(K.native_source())[-1]
        ctype = B.DTYPES[dt].ctype
        assert f"const {ctype}* a{k}," in wrapper and f"a{k + 1}" not in wrapper and f"{ctype}* out" in wrapper
        # the vectorised path (16-byte packs) and the scalar head/tail are in every kernel
        assert "uint4" in src and "load_pack_ro" in src and "head + npacks * PACK" in src
        assert ("#define DDL_WITH_HALF" in src) == (dt == "float16")
        assert ("#define DDL_WITH_BF16" in src) == (dt == "bfloat16")
        assert "#include <" not in src.replace("#include <cuda_fp16.h>", "").replace("#include <cuda_bf16.h>", "")
    assert len(names) == len(specs)
    for dt in ("float16", "bfloat16", "float32", "float64"):
        assert K.scale_kernel_name(dt) in K.scale_kernel_source(dt)
    assert K.kernel_name(ddl.MAX, "bool", 2) == K.kernel_name("max", "uint8", 2)   # bool: 0/1 bytes


def test_spec_errors():
    with pytest.raises(ddl.Error, match="integer or bool"):
        K.check_spec("BXOR", "float32")
    with pytest.raises(ddl.Error, match="bool"):
        K.check_spec("SUM", "bool")
    with pytest.raises(ddl.Error, match="AVG"):
        K.check_spec(ddl.AVG, "float32")
    with pytest.raises(ddl.Error, match="1..8"):
        K.check_spec("SUM", "float32", 0)
    with pytest.raises(ddl.Error, match="1..8"):
        K.check_spec("SUM", "float32", K.MAX_INPUTS + 1)
    with pytest.raises(ddl.Error, match="not supported"):
        K.check_spec("SUM", "complex64")
    with pytest.raises(ddl.Error, match="floating-point"):
        K.scale_kernel_name("int32")
    assert K.check_spec(ddl.SUM, np.float16, 3)[0] == "SUM"


def test_launch_config():
    assert K.launch_config(0, 4) == (1, K.BLOCK)
    assert K.launch_config(1, 4) == (1, K.BLOCK)
    # 4 packs of 16 B per thread with one input: 1 Mi floats = 256 Ki packs = 64 Ki threads = 256 blocks
    assert K.launch_config(1 << 20, 4, 1, sm_count=1000) == (256, K.BLOCK)
    assert K.launch_config(1 << 30, 4, 1, sm_count=132) == (132 * K.BLOCKS_PER_SM, K.BLOCK)
    assert K.launch_config(1000, 2, 1, aligned=False) == (4, K.BLOCK)
    assert K.unroll(1) == 4 and K.unroll(4) == 2 and K.unroll(8) == 1
    assert K.co_aligned([16, 32, 48]) and K.co_aligned([18, 34]) and not K.co_aligned([16, 18])


def test_unroll_mirrors_the_cuda_source():
    src = K.native_source()
    assert "UNROLL = K <= 3 ? 4 : (K <= 5 ? 2 : 1)" in src   # K = ninputs + 1 operands
    for n in range(1, K.MAX_INPUTS + 1):
        k = n + 1
        assert K.unroll(n) == (4 if k <= 3 else (2 if k <= 5 else 1))


# ---- compiling with nvcc ---------------------------------------------------------------------------
def _nvcc(args, cwd, timeout=900):
    proc = subprocess.run([NVCC] + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"nvcc {' '.join(args)} failed:\n{proc.stdout[-8000:]}"
    return proc.stdout


@needs_nvcc
@pytest.mark.timeout(1800)
def test_nvcc_compiles_every_generated_kernel(tmp_path):
    """Every (op, dtype, ninputs) kernel and every scale kernel, compiled to PTX for sm_80 (split in
    a few translation units compiled in parallel); every entry point is present and the reduction
    kernels use 128-bit vector loads and stores."""
    specs = K.all_specs()
    floats = ["float16", "bfloat16", "float32", "float64"]
    parts = {}
    for s in specs:
        parts.setdefault(s[1], []).append(s)
    jobs = []
    for i, (dt, group) in enumerate(sorted(parts.items())):
        src = tmp_path / f"k{i}.cu"
        src.write_text(K.module_source(group, [dt] if dt in floats else []))
        jobs.append((src.name, f"k{i}.ptx"))
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        list(pool.map(lambda j: _nvcc(["--ptx", "-arch=sm_80", "-std=c++17", j[0], "-o", j[1]], tmp_path), jobs))
    ptx = "".join((tmp_path / p).read_text() for _, p in jobs)
    entries = {line.split(".entry", 1)[1].split("(")[0].strip() for line in ptx.splitlines() if ".entry" in line}
    want = {K.kernel_name(*s) for s in specs} | {K.scale_kernel_name(d) for d in floats}
    assert want <= entries, sorted(want - entries)[:10]
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4.u32" in ptx


@needs_nvcc
@pytest.mark.timeout(900)
def test_nvcc_builds_standalone_kernel_sources_to_cubin(tmp_path):
    """The per-spec sources exactly as CuPy gets them, through ptxas too (sm_80 cubin): one per
    kernel dtype with the most inputs (the most registers), plus the scale kernels."""
    jobs = []
    for i, dt in enumerate(K.KERNEL_DTYPES):
        op = "MAX" if dt == "bool" else "SUM"
        (tmp_path / f"s{i}.cu").write_text(K.kernel_source(op, dt, K.MAX_INPUTS))
        jobs.append(f"s{i}.cu")
    for i, dt in enumerate(("float16", "bfloat16")):
        (tmp_path / f"c{i}.cu").write_text(K.scale_kernel_source(dt))
        jobs.append(f"c{i}.cu")
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        list(pool.map(lambda j: _nvcc(["--cubin", "-arch=sm_80", "-std=c++17", j, "-o", j + ".cubin"], tmp_path), jobs))
    for j in jobs:
        assert (tmp_path / (j + ".cubin")).stat().st_size > 0


# ---- compiling with NVRTC (what CuPy's RawModule uses) ----------------------------------------------
def _find_nvrtc():
    cands = []
    if os.environ.get("DDL_NVRTC_LIBRARY"):
        cands.append(os.environ["DDL_NVRTC_LIBRARY"])
    for base in filter(None, [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]):
        cands += sorted(glob.glob(os.path.join(base, "lib64", "libnvrtc.so*")))
    for p in sys.path:
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    for c in cands:
        if "builtins" in os.path.basename(c) or ".alt." in os.path.basename(c):
            continue
        try:
            d = os.path.dirname(c)
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def _nvrtc_compile(lib, src, opts):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"ddl.cu", 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    logbuf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, logbuf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, logbuf.value.decode(errors="replace")


@pytest.mark.timeout(900)
def test_nvrtc_compiles_kernel_sources():
    """NVRTC has no host headers: the sources must be self-contained (CuPy compiles them this way)."""
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (set DDL_NVRTC_LIBRARY, or install nvidia-cuda-nvrtc): the sources "
                    "are not run through NVRTC here")
    include = None
    for base in filter(None, [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]):
        if os.path.isfile(os.path.join(base, "include", "cuda_fp16.h")):
            include = os.path.join(base, "include")
            break
    opts = ["--gpu-architecture=compute_80"] + ([f"-I{include}"] if include else [])
    sources = [K.kernel_source("SUM" if dt != "bool" else "BOR", dt, k)
               for dt in K.KERNEL_DTYPES for k in (1, 3)]
    sources += [K.kernel_source(op, "int32", 2) for op in K.OPS] + [K.kernel_source(op, "float16", 2) for op in K.OPS[:4]]
    sources += [K.scale_kernel_source(dt) for dt in ("float16", "bfloat16", "float32", "float64")]
    for src in sources:
        rc, log = _nvrtc_compile(lib, src, opts)
        assert rc == 0, f"NVRTC failed:\n{log}\n--- source tail:\n{src[-600:]}"


# ---- running the kernels' element loop on the CPU ----------------------------------------------------
HARNESS_INPUTS = (1, 2, 3, 8)
FLOATS = ("float16", "bfloat16", "float32", "float64")
UFUNC = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
         "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "LAND": np.logical_and, "LOR": np.logical_or,
         "LXOR": np.logical_xor}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found: the kernels' element loop is not built for the host here")
    d = tmp_path_factory.mktemp("harness")
    specs = [s for s in K.all_specs() if s[2] in HARNESS_INPUTS]
    (d / "harness.cu").write_text(K.host_harness_source(specs, FLOATS))
    _nvcc(["-x", "cu", "-std=c++17", "-O1", "-Xcompiler", "-fPIC", "-shared", "harness.cu", "-o", "libharness.so"], d)
    return ctypes.CDLL(str(d / "libharness.so"))


def _aligned(nbytes, misalign, rng):
    """A uint8 array whose data starts ``misalign`` bytes after a 16-byte boundary."""
    raw = np.zeros(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + misalign
    return raw[start:start + nbytes]


def _random(dt_name, n, rng, nan=False):
    d = npdt(dt_name)
    if d.kind in "iu":
        info = np.iinfo(d)
        return rng.integers(info.min, info.max, n, dtype=d, endpoint=True)
    if d == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if nan and n:                      # MIN/MAX: NaNs, and signed zeros (equal: which one is kept shows)
        zeros = rng.integers(0, n, max(1, n // 3))
        x[zeros] = np.where(rng.integers(0, 2, len(zeros)) == 1, -0.0, 0.0)
        x[rng.integers(0, n, max(1, n // 7))] = np.nan
    return x.astype(d)


def _fold(op, arrays, d):
    from ddl.ops import reduce_into    # exactly as the host executor reduces
    acc = arrays[0].copy()
    with np.errstate(all="ignore"):
        for a in arrays[1:]:
            reduce_into(UFUNC[op], acc, a, acc)
    return acc


@needs_nvcc
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dt_name", list(K.KERNEL_DTYPES))
def test_kernel_element_loop_matches_numpy_bitwise(harness, dt_name):
    """The CUDA element loop (vector body, scalar head and tail, any thread count), built for the
    host, against numpy's in-order fold: every op, 1/2/3/8 inputs, odd sizes, co-aligned and
    differently misaligned pointers, in place and not. Bitwise, NaNs included."""
    rng = np.random.default_rng(hash(dt_name) & 0xFFFF)
    d = npdt(dt_name)
    isz = d.itemsize
    ops = [op for op in K.OPS if not (op in K.BITWISE and d.kind == "f")]
    if d.kind == "V":
        ops = ["SUM", "PROD", "MIN", "MAX"]
    checked = 0
    for op in ops:
        for k in HARNESS_INPUTS:
            fn = getattr(harness, "host_" + K.kernel_name(op, dt_name, k))
            fn.restype = None
            for n in (0, 1, 3, 8, 17, 64, 257, 1001):
                for mis in ("same0", "same", "mixed"):
                    if mis == "same0":
                        offs = [0] * (k + 2)
                    elif mis == "same":
                        m = int(rng.integers(1, 16 // isz)) * isz if isz < 16 else 0
                        offs = [m] * (k + 2)
                    else:
                        offs = [int(rng.integers(0, 16 // isz)) * isz for _ in range(k + 2)]
                    for inplace in (False, True):
                        bufs = [_aligned(n * isz, o, rng).view(d) for o in offs]
                        arrays = [_random(dt_name, n, rng, nan=op in ("MIN", "MAX")) for _ in range(k + 1)]
                        for b, a in zip(bufs[1:], arrays):
                            b[...] = a
                        out = bufs[1] if inplace else bufs[0]
                        if not inplace:
                            out[...] = 0
                        expect = _fold(op, arrays, d)
                        nthreads = int(rng.choice([1, 3, 32, 1024]))
                        fn(*[ctypes.c_void_p(b.ctypes.data) for b in [out] + bufs[1:]], ctypes.c_ulonglong(n),
                           ctypes.c_ulonglong(nthreads))
                        assert out.view(np.uint8).tobytes() == expect.view(np.uint8).tobytes(), \
                            (op, dt_name, k, n, offs, inplace, nthreads, out[:8], expect[:8])
                        checked += 1
    assert checked > 100


@needs_nvcc
@pytest.mark.parametrize("dt_name", FLOATS)
def test_scale_kernel_matches_numpy_true_divide(harness, dt_name):
    rng = np.random.default_rng(5)
    d = npdt(dt_name)
    fn = getattr(harness, "host_" + K.scale_kernel_name(dt_name))
    fn.restype = None
    for n in (0, 1, 7, 100, 1003):
        for off in (0, d.itemsize):
            buf = _aligned(n * d.itemsize, off, rng).view(d)
            buf[...] = _random(dt_name, n, rng)
            expect = buf.copy()
            np.true_divide(expect, 3, out=expect, casting="unsafe")
            fn(ctypes.c_void_p(buf.ctypes.data), ctypes.c_ulonglong(n), ctypes.c_double(3.0), ctypes.c_ulonglong(7))
            assert buf.view(np.uint8).tobytes() == expect.view(np.uint8).tobytes()


# ==== launch plans ======================================================================================
COLL_LAYOUTS = {"allreduce": ("allreduce", "allreduce_inplace"), "reduce_scatter": ("reduce_scatter", "reduce_scatter_inplace"),
                "allgather": ("allgather", "allgather_inplace"), "broadcast": ("broadcast",)}


def _schedules():
    out = []
    from ddl.topology import Topology
    topos = [flat_topology(n) for n in (2, 3, 4, 5, 8)] + [Topology.load(ROOT / "topologies" / "dgx1-v100.yaml")]
    for topo in topos:
        for name in ("ring", "halving-doubling", "double-binary-tree", "hierarchical"):
            for coll in COLL_LAYOUTS:
                try:
                    s = ALGORITHMS[name](topo, coll, root=min(1, topo.nranks - 1))
                except ddl.PlanError:
                    continue
                out.append(pytest.param(s, id=f"{topo.name}-{name}-{coll}"))
    return out


SCHEDULES = _schedules()


def _soft(program, deps, i):
    return (program[i].kind == REDUCE and len(deps[i]) == 1 and program[deps[i][0]].kind == REDUCE)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_levels_respect_dependencies(sched):
    levels = transfer_levels(sched)
    for r, prog in enumerate(sched.programs):
        deps = sched.dependencies[r]
        for i in range(len(prog)):
            peer, j = sched.matches[r][i]
            assert levels[r][i] == levels[peer][j]           # both halves of a transfer in one step
            for d in deps[i]:
                if _soft(prog, deps, i):
                    assert levels[r][d] <= levels[r][i]       # a fused reduce chain may share a step
                else:
                    assert levels[r][d] < levels[r][i]


@pytest.mark.parametrize("sched", SCHEDULES)
def test_launch_plan_translation(sched):
    """Sends match receives step by step and in order; byte ranges are chunk_ranges; reductions run
    in program order; scratch slots are disjoint and keep the destination's alignment."""
    n = sched.nranks
    for count in (n * 1000 + (0 if sched.nblocks > 1 else 7), n * 3):
        for itemsize in (2, 4):
            for layout in COLL_LAYOUTS[sched.collective]:
                lps = [launch_plan(sched, r, count, itemsize, layout) for r in range(n)]
                ranges = sched.chunk_ranges(count)
                _check_matching(sched, lps)
                for r, lp in enumerate(lps):
                    _check_ranges(sched, lp, ranges, r, count, itemsize, layout)
                    _check_reduction_order(sched, lp, ranges, r)
                    _check_scratch(lp)
                    assert describe(lp)


def _check_matching(sched, lps):
    by_level = {}
    for r, lp in enumerate(lps):
        for step in lp.steps:
            for t in step.transfers:
                src, dst = (r, t.peer) if t.kind == "send" else (t.peer, r)
                by_level.setdefault((step.level, src, dst, t.kind), []).append(t)
            # canonical order inside a group
            assert [t.key for t in step.transfers] == sorted(t.key for t in step.transfers)
    for (lv, src, dst, kind), ts in by_level.items():
        if kind != "send":
            continue
        rs = by_level.get((lv, src, dst, "recv"), [])
        assert [(t.chunk, t.nbytes, t.tag) for t in ts] == [(t.chunk, t.nbytes, t.tag) for t in rs], (lv, src, dst)
        for t, u in zip(ts, rs):
            assert sched.matches[src][t.op_index] == (dst, u.op_index)
    for (lv, src, dst, kind) in by_level:
        if kind == "recv":
            assert (lv, src, dst, "send") in by_level


def _check_ranges(sched, lp, ranges, r, count, itemsize, layout):
    _, locs, _ = chunk_locations(sched, r, count, layout)
    seen = set()
    prog = sched.programs[r]
    for t in lp.transfers:
        e0, e1 = ranges[t.chunk]
        assert t.nbytes == (e1 - e0) * itemsize > 0
        init, home, _ = locs[sched.members(t.chunk)[0]]      # a span lives where its first chunk does
        if t.kind == "send":
            assert (t.buf, t.offset) in {(init[0], init[1] * itemsize) if init else None, (home[0], home[1] * itemsize)}
        elif t.reduce:
            assert t.buf == SCRATCH_BUF
        else:
            assert (t.buf, t.offset) == (home[0], home[1] * itemsize)
        seen.add(t.op_index)
        assert prog[t.op_index].chunk == t.chunk and prog[t.op_index].peer == t.peer
    expected = {i for i, op in enumerate(prog) if ranges[op.chunk][1] > ranges[op.chunk][0]}
    assert seen == expected    # every op on a non-empty chunk appears once; empty chunks dropped
    for sb, so, db, do, nbytes in lp.copies:
        assert nbytes > 0 and (sb, so) != (db, do)
    if layout == "reduce_scatter" and sched.nranks > 1:
        assert lp.work_bytes == count * itemsize
    bufs = {t.buf for t in lp.transfers}
    assert bufs <= {SEND_BUF, RECV_BUF, WORK_BUF, SCRATCH_BUF}


def _check_reduction_order(sched, lp, ranges, r):
    prog = sched.programs[r]
    done = []
    for step in lp.steps:
        reduce_in_step = {t.op_index for t in step.transfers if t.reduce}
        for red in step.reductions:
            assert set(red.op_indices) <= reduce_in_step
            assert list(red.op_indices) == sorted(red.op_indices)
            assert all(prog[i].chunk == red.chunk and prog[i].kind == REDUCE for i in red.op_indices)
            assert len(red.inputs) == len(red.op_indices) and red.count == ranges[red.chunk][1] - ranges[red.chunk][0]
            done += list(red.op_indices)
    for c in range(sched.nchunks):
        mine = [i for i in done if prog[i].chunk == c]
        assert mine == sorted(mine)   # each chunk's reductions in program order across steps
        assert mine == [i for i, op in enumerate(prog) if op.chunk == c and op.kind == REDUCE
                        and ranges[c][1] > ranges[c][0]]


def _check_scratch(lp):
    for step in lp.steps:
        slots = sorted((t.offset, t.offset + t.nbytes) for t in step.transfers if t.reduce)
        for (a0, a1), (b0, b1) in zip(slots, slots[1:]):
            assert a1 <= b0
        assert all(b <= step.scratch_bytes <= lp.scratch_bytes for _, b in slots)
        for red in step.reductions:
            for s in red.inputs:
                assert s % 16 == red.out[1] % 16


def test_fusion_happens_where_a_rank_reduces_several_incoming_chunks():
    s = ALGORITHMS["double-binary-tree"](flat_topology(8), "allreduce")
    fused = [red for r in range(8) for red in launch_plan(s, r, 8000, 4, "allreduce").reductions if len(red.inputs) > 1]
    assert fused, "double binary tree: an inner node reduces both children's chunks in one launch"


def test_launch_plan_errors():
    s = ALGORITHMS["ring"](flat_topology(4), "reduce_scatter")
    with pytest.raises(ddl.ScheduleError):
        launch_plan(s, 0, 10, 4, "reduce_scatter")     # not divisible by 4 ranks
    with pytest.raises(ddl.Error):
        launch_plan(s, 0, 8, 4, "sideways")
    with pytest.raises(ddl.Error):
        launch_plan(s, 4, 8, 4, "reduce_scatter")
    assert set(LAYOUTS) == {lay for v in COLL_LAYOUTS.values() for lay in v}


def test_cyclic_schedule_is_refused():
    from ddl.schedule import Op, Schedule
    progs = ((Op(RECV, 0, 1), Op(SEND, 1, 1)), (Op(RECV, 1, 0), Op(SEND, 0, 0)))
    s = Schedule("allreduce", 2, (1, 1), progs)
    # no cycle: different chunks never wait on each other
    assert transfer_levels(s)
    progs = ((Op(RECV, 0, 1), Op(SEND, 0, 1)), (Op(RECV, 0, 0), Op(SEND, 0, 0)))
    with pytest.raises(ddl.ScheduleError, match="cycle"):
        transfer_levels(Schedule("allreduce", 2, (1,), progs))


# ==== the executor's step logic on a simulated NCCL ======================================================
class Recorder:
    """Runtime + transport that record what one rank enqueues on its stream (nothing runs yet)."""

    def __init__(self):
        self.log = []
        self.host = HostRuntime()

    def memcpy(self, dst, src, nbytes, stream):
        self.log.append(("local", lambda: self.host.memcpy(dst, src, nbytes, None)))

    def reduce(self, op, dtype, out, a0, inputs, count, stream):
        self.log.append(("local", lambda: self.host.reduce(op, dtype, out, a0, list(inputs), count, None)))

    def scale(self, dtype, ptr, count, divisor, stream):
        self.log.append(("local", lambda: self.host.scale(dtype, ptr, count, divisor, None)))

    def synchronize(self, stream):
        pass

    def step(self, ops, stream):
        self.log.append(("group", list(ops)))


def simulate_nccl(logs):
    """Replay the ranks' streams with NCCL's semantics: groups run in stream order; inside a group
    every op is live at once; the k-th send a->b pairs with the k-th recv at b from a, and completes
    only when its partner is in the partner's *current* group (no buffering: a group that waits on a
    later group of its peer deadlocks here as it would on NCCL)."""
    nr = len(logs)
    seq = []
    for r, log in enumerate(logs):
        counters, s = {}, []
        for kind, item in log:
            if kind == "group":
                g = []
                for op in item:
                    key = (op[0], op[1])
                    counters[key] = counters.get(key, 0) + 1
                    g.append(counters[key] - 1)
                s.append(g)
            else:
                s.append(None)
        seq.append(s)
    pos = [0] * nr
    pending = [None] * nr
    while True:
        progress = False
        for r in range(nr):
            while pos[r] < len(logs[r]) and logs[r][pos[r]][0] == "local":
                logs[r][pos[r]][1]()
                pos[r] += 1
                progress = True
            if pos[r] < len(logs[r]) and pending[r] is None:
                ops = logs[r][pos[r]][1]
                _no_overlaps(ops)
                pending[r] = set(range(len(ops)))
                progress = True
        for r in range(nr):
            if not pending[r]:
                continue
            ops = logs[r][pos[r]][1]
            for i in sorted(pending[r]):
                kind, peer, ptr, nbytes, _tag = ops[i]
                if kind != "send" or pending[peer] is None:
                    continue
                k = seq[r][pos[r]][i]
                pops = logs[peer][pos[peer]][1]
                match = [j for j in pending[peer] if pops[j][0] == "recv" and pops[j][1] == r and seq[peer][pos[peer]][j] == k]
                if match:
                    j = match[0]
                    assert pops[j][3] == nbytes, "send/recv sizes differ"
                    ctypes.memmove(pops[j][2], ptr, nbytes)
                    pending[r].discard(i)
                    pending[peer].discard(j)
                    progress = True
        for r in range(nr):
            if pending[r] is not None and not pending[r]:
                pending[r] = None
                pos[r] += 1
                progress = True
        if all(pos[r] == len(logs[r]) for r in range(nr)):
            return
        assert progress, f"deadlock: ranks at log positions {pos}, pending {pending}"


def _no_overlaps(ops):
    spans = sorted((ptr, ptr + n, kind) for kind, _p, ptr, n, _t in ops)
    for (a0, a1, ka), (b0, b1, kb) in zip(spans, spans[1:]):
        assert a1 <= b0 or (ka == kb == "send"), "a group writes memory that another op of it touches"


def interpret(sched, values, ufunc):
    """Reference: run the schedule's dataflow on per-chunk numpy values (any valid order gives the
    same bits: each chunk's reductions are ordered by its program)."""
    n = sched.nranks
    deps = sched.dependencies
    done = [[False] * len(p) for p in sched.programs]
    msgs = {}
    remaining = sum(len(p) for p in sched.programs)
    while remaining:
        moved = False
        for r in range(n):
            for i, (kind, c, peer) in enumerate(sched.programs[r]):
                if done[r][i] or not all(done[r][d] for d in deps[r][i]):
                    continue
                members = sched.members(c)          # a span: its chunks in one message
                if kind == SEND:
                    msgs[(r, i)] = [values[r][m].copy() for m in members]
                else:
                    key = tuple(sched.matches[r][i])
                    if key not in msgs:
                        continue
                    for m, piece in zip(members, msgs.pop(key)):
                        values[r][m] = piece if kind == RECV else ufunc(values[r][m], piece)
                done[r][i] = True
                remaining -= 1
                moved = True
        assert moved
    return values


def _inputs_for(layout, n, count, d, rng, dt_name):
    block = count // n if layout.startswith(("reduce_scatter", "allgather")) else count
    if layout.startswith("allgather"):
        return [_random(dt_name, block, rng) for _ in range(n)]
    return [_random(dt_name, count, rng) for _ in range(n)]


def _run_simulated(sched, layout, dt_name, op, count, root=0, ins=None):
    """Every rank's run_plan on host memory, replayed by simulate_nccl; returns inputs and outputs."""
    n = sched.nranks
    d = npdt(dt_name)
    rng = np.random.default_rng(count + n)
    ins = _inputs_for(layout, n, count, d, rng, dt_name) if ins is None else ins
    recorders, keep, outs = [], [], []
    for r in range(n):
        lp = launch_plan(sched, r, count, d.itemsize, layout)
        rec = Recorder()
        if layout == "allreduce":
            send, recv = ins[r].copy(), np.zeros(count, d)
        elif layout in ("allreduce_inplace", "broadcast"):
            send, recv = None, ins[r].copy()
        elif layout == "reduce_scatter":
            send, recv = ins[r].copy(), np.zeros(count // n, d)
        elif layout == "reduce_scatter_inplace":
            send, recv = None, ins[r].copy()
        elif layout == "allgather":
            send, recv = ins[r].copy(), np.zeros(count, d)
        else:  # allgather_inplace
            send, recv = None, np.zeros(count, d)
            recv[r * (count // n):(r + 1) * (count // n)] = ins[r]
        scratch, work = _HostAlloc(lp.scratch_bytes + 32), _HostAlloc(lp.work_bytes + 32)
        align = recv.ctypes.data % 16
        ptrs = {SEND_BUF: send.ctypes.data if send is not None else 0, RECV_BUF: recv.ctypes.data,
                SCRATCH_BUF: -(-scratch.ptr // 16) * 16 + align, WORK_BUF: -(-work.ptr // 16) * 16 + align}
        run_plan(lp, ptrs, rec, rec, op, B.DTYPES[dt_name], None)
        recorders.append(rec)
        keep.append((send, scratch, work))
        outs.append(recv)
    simulate_nccl([rec.log for rec in recorders])
    return ins, outs


def _reference(sched, layout, ins, count, ufunc, d):
    n = sched.nranks
    ranges = sched.chunk_ranges(count)
    values = []
    for r in range(n):
        vals = []
        for c in range(sched.nchunks):
            e0, e1 = ranges[c]
            if layout.startswith("allgather"):
                b = sched.block_of(c)
                blk = count // n
                vals.append(ins[r][e0 - r * blk:e1 - r * blk].copy() if b == r else np.zeros(e1 - e0, d))
            elif layout == "broadcast" and r != sched.root:
                vals.append(np.zeros(e1 - e0, d))
            else:
                vals.append(ins[r][e0:e1].copy())
        values.append(vals)
    interpret(sched, values, ufunc)
    return values, ranges


@pytest.mark.parametrize("sched", SCHEDULES)
def test_nccl_step_logic_end_to_end_on_simulated_nccl(sched):
    n = sched.nranks
    for layout in COLL_LAYOUTS[sched.collective]:
        reducing = sched.collective in ("allreduce", "reduce_scatter")
        cases = [("float16", "SUM"), ("int32", "PROD"), ("float32", "MAX")] if reducing else [("float32", None), ("int8", None)]
        for dt_name, op in cases:
            count = n * 257 if sched.nblocks > 1 else 1001
            d = npdt(dt_name)
            ins, outs = _run_simulated(sched, layout, dt_name, op, count)
            ufunc = UFUNC[op] if op else None
            values, ranges = _reference(sched, layout, ins, count, ufunc, d)
            blk = count // n
            for r in range(n):
                for c in range(sched.nchunks):
                    e0, e1 = ranges[c]
                    b = sched.block_of(c)
                    if sched.collective == "reduce_scatter":
                        if b != r:
                            continue
                        # in place the block stays where it is (the executor moves it to the front after)
                        got = outs[r][e0:e1] if layout.endswith("inplace") else outs[r][e0 - r * blk:e1 - r * blk]
                    else:
                        got = outs[r][e0:e1]
                    want = values[r][c]
                    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (layout, dt_name, op, r, c)
            if op == "SUM" and sched.collective == "allreduce":
                total = np.sum(np.stack(ins).astype(np.float64), axis=0)
                np.testing.assert_allclose(outs[0].astype(np.float64), total, rtol=2e-2, atol=0.1)
            if sched.collective == "allgather":
                for r in range(n):
                    np.testing.assert_array_equal(outs[r], np.concatenate(ins))


def test_partners_put_the_same_operand_first_on_the_device_path():
    """max(-0.0, +0.0) is -0.0 and max(+0.0, -0.0) +0.0: where partners combine the same partial
    results (recursive doubling here, positions not in rank order) every rank must put the same one
    first (Schedule.operand_order), in the launch plan's reductions as in the host executor."""
    from ddl.algorithms.recursive_doubling import recursive_doubling_schedule
    from ddl.verify import verify
    sched = recursive_doubling_schedule([0, 3, 1, 2])
    verify(sched)
    count = 64
    ins = [np.where(np.arange(count) % 4 == r, -0.0, 0.0).astype(np.float32) for r in range(4)]
    _, outs = _run_simulated(sched, "allreduce", "float32", "MAX", count, ins=ins)
    assert len({o.tobytes() for o in outs}) == 1
    swapped = [r.incoming_first for rank in range(4)
               for step in launch_plan(sched, rank, count, 4, "allreduce").steps for r in step.reductions]
    assert any(swapped) and not all(swapped)


@pytest.mark.parametrize("name", ["recursive-doubling", "tiered-exchange"])
def test_exchanges_run_on_the_device_path(name):
    """Both partners of an exchange send, then reduce what they received: the two transfers wait on
    each other's sends, which used to read as a cycle of waits (these small-message algorithms could not
    run on GPUs). A reduce receives into scratch and combines after its step, so they share one."""
    from ddl.topology import Topology
    topo = Topology.load(Path(__file__).resolve().parent.parent / "topologies" / "fat-tree-4x4-r4.yaml")
    sched = ALGORITHMS[name](topo, "allreduce", nbytes=64)
    count = 16 * 5
    ins = [np.arange(count, dtype=np.int32) * (r + 1) for r in range(16)]
    _, outs = _run_simulated(sched, "allreduce", "int32", "SUM", count, ins=ins)
    for out in outs:
        np.testing.assert_array_equal(out, np.sum(ins, axis=0))


def test_simulator_catches_mismatched_groups():
    a, b = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    logs = [[("group", [("send", 1, a.ctypes.data, 16, 0)]), ("group", [("recv", 1, a.ctypes.data, 16, 0)])],
            [("group", [("send", 0, b.ctypes.data, 16, 0)]), ("group", [("recv", 0, b.ctypes.data, 16, 0)])]]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_nccl(logs)   # both ranks send first and receive in a later group: NCCL would hang


# ==== fallbacks under mpiexec, on host memory ================================================================
def test_cuda_aware_mpi_detection_explains_itself(monkeypatch):
    aware, why = detect_cuda_aware_mpi()
    assert isinstance(aware, bool) and why
    monkeypatch.setenv("DDL_CUDA_AWARE_MPI", "1")
    assert detect_cuda_aware_mpi() == (True, "DDL_CUDA_AWARE_MPI=1")
    monkeypatch.setenv("DDL_CUDA_AWARE_MPI", "false")        # (any word but 0 and 1 was ignored)
    assert detect_cuda_aware_mpi() == (False, "DDL_CUDA_AWARE_MPI=false")
    monkeypatch.setenv("DDL_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ddl.Error, match="DDL_CUDA_AWARE_MPI='maybe' is neither on"):
        detect_cuda_aware_mpi()
    monkeypatch.setenv("DDL_CUDA_AWARE_MPI", "")
    monkeypatch.setenv("MPIR_CVAR_ENABLE_GPU", "0")
    assert detect_cuda_aware_mpi()[0] is False


_MPI_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    import ddl
    from ddl.gpu.executor import HostRuntime, NcclExecutor
    sys.path.insert(0, "tests/mpi_cases")   # run from the repository root
    from _host_array import HostArray       # exercises the device executor on the CPU

    path = sys.argv[1]
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    algorithm = sys.argv[2]
    if algorithm == "double-binary-tree":   # it plans allreduce and broadcast only
        algorithm = {"allreduce": algorithm, "broadcast": algorithm}
    comm = ddl.Communicator(world, algorithm=algorithm)
    ex = NcclExecutor(comm, runtime=HostRuntime(), path=path)
    rng = np.random.default_rng(rank)
    checks = 0
    def same(a, b, what):
        global checks
        checks += 1
        if a.tobytes() != b.tobytes():
            print(f"FAIL rank {rank} {what}: {a[:6]} vs {b[:6]}", flush=True)
            world.Abort(1)
    for dt in (np.float16, np.float32, np.int64):
        for n in (1, 13, 1000):
            x = (rng.standard_normal(n * size) * 4).astype(dt)
            for op in (ddl.SUM, ddl.MAX) + ((ddl.AVG,) if np.dtype(dt).kind == "f" else (ddl.BXOR,)):
                ref = np.empty_like(x); comm.Allreduce(x, ref, op=op)           # the host executor
                out = np.empty_like(x); ex.Allreduce(HostArray(x), HostArray(out), op=op)
                same(out, ref, f"Allreduce {op} {dt} {n}")
                y = x.copy(); ex.Allreduce(ddl.IN_PLACE, HostArray(y), op=op)
                same(y, ref, f"Allreduce in place {op} {dt} {n}")
                rr = np.empty(n, dt); comm.Reduce_scatter_block(x, rr, op=op)
                ro = np.zeros(n, dt); ex.Reduce_scatter_block(HostArray(x), HostArray(ro), op=op)
                same(ro, rr, f"Reduce_scatter_block {op} {dt} {n}")
                z = x.copy(); ex.Reduce_scatter_block(ddl.IN_PLACE, HostArray(z), op=op)
                same(z[:n], rr, f"Reduce_scatter_block in place {op} {dt} {n}")
            g = np.zeros(n * size, dt); comm.Allgather(x[:n], g)
            go = np.zeros(n * size, dt); ex.Allgather(HostArray(x[:n].copy()), HostArray(go))
            same(go, g, f"Allgather {dt} {n}")
            gi = np.zeros(n * size, dt); gi[rank * n:(rank + 1) * n] = x[:n]
            ex.Allgather(ddl.IN_PLACE, HostArray(gi)); same(gi, g, f"Allgather in place {dt} {n}")
            for root in range(size):
                b = x.copy() if rank == root else np.zeros_like(x)
                ex.Bcast(HostArray(b), root=root)
                ref = x.copy(); comm.Bcast(ref, root=root)
                same(b, ref, f"Bcast root {root} {dt} {n}")
    # float16 AVG divides first on the device as on the host: a sum past 65504 averages to a finite value
    big = np.full(13 * size, 40000.0, np.float16)
    big[1::2] = -30000.0 + rank
    ref = np.empty_like(big); comm.Allreduce(big, ref, op=ddl.AVG)
    assert np.isfinite(ref).all(), ref[:4]
    out = np.empty_like(big); ex.Allreduce(HostArray(big), HostArray(out), op=ddl.AVG)
    same(out, ref, "float16 AVG past 65504")
    y = big.copy(); ex.Allreduce(ddl.IN_PLACE, HostArray(y), op=ddl.AVG); same(y, ref, "float16 AVG in place")
    rr = np.empty(13, np.float16); comm.Reduce_scatter_block(big, rr, op=ddl.AVG)
    ro = np.zeros(13, np.float16); ex.Reduce_scatter_block(HostArray(big), HostArray(ro), op=ddl.AVG)
    same(ro, rr, "float16 Reduce_scatter_block AVG past 65504")
    z = big.copy(); ex.Reduce_scatter_block(ddl.IN_PLACE, HostArray(z), op=ddl.AVG)
    same(z[:13], rr, "float16 Reduce_scatter_block AVG in place")
    same(z[13:], big[13:], "float16 Reduce_scatter_block AVG in place, beyond its block")
    assert ex.last_path == path, (ex.last_path, path)
    # ddl.Communicator hands device buffers to its device executor (here the one on host memory)
    comm._device = ex
    x = (rng.standard_normal(100 * size)).astype(np.float32)
    ref = np.empty_like(x); comm.Allreduce(x, ref, op=ddl.SUM)
    assert comm.last_path == "host"
    out = np.empty_like(x); comm.Allreduce(HostArray(x), HostArray(out), op=ddl.SUM)
    same(out, ref, "Communicator.Allreduce on device buffers")
    assert comm.last_path == path, comm.last_path
    out = np.empty_like(x); comm.Iallreduce(HostArray(x), HostArray(out), op=ddl.SUM).Wait()
    same(out, ref, "Communicator.Iallreduce on device buffers")
    g = np.zeros(100 * size * size, np.float32); comm.Allgather(x, g)
    go = np.zeros_like(g); comm.Allgather(HostArray(x), HostArray(go)); same(go, g, "Communicator.Allgather")
    b = x.copy() if rank == 0 else np.zeros_like(x); comm.Bcast(HostArray(b), root=0)
    ref0 = x.copy(); comm.Bcast(ref0, root=0); same(b, ref0, "Communicator.Bcast")
    comm._device = None
    try:
        ex.Allreduce(HostArray(np.zeros(3, np.float32)), HostArray(np.zeros(4, np.float32)))
        raise SystemExit("size mismatch not caught")
    except ddl.Error:
        pass
    # an argument error on one rank only: the others raise MismatchError at once, not block in MPI
    for call in ("Allreduce", "Bcast"):
        try:
            if call == "Allreduce":
                ex.Allreduce(HostArray(np.zeros(3, np.float32)), HostArray(np.zeros(4 if rank == 1 else 3, np.float32)))
            else:
                ex.Bcast(HostArray(np.zeros(3, np.float32)), root=size if rank == 1 else 0)
            raise SystemExit(f"rank {rank}: nothing raised for a {call} one rank refused")
        except ddl.MismatchError as exc:
            assert rank != 1 and "rank 1 called" in str(exc) and "arguments it refused" in str(exc), (rank, exc)
        except ddl.Error as exc:
            assert rank == 1 and "MismatchError" not in type(exc).__name__, (rank, exc)
        out = np.empty_like(x); ex.Allreduce(HostArray(x), HostArray(out), op=ddl.SUM)
        same(out, ref, f"Allreduce after a {call} one rank refused")
    ex.Free()
    # a GPU that one rank cannot use (a wrong CUDA_VISIBLE_DEVICES): an error on every rank, no hang
    class NoDeviceOnRank1(HostRuntime):
        def device(self):
            if rank == 1:
                raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
            return 0
    broken = NcclExecutor(comm, runtime=NoDeviceOnRank1(), path=path)
    try:
        broken.Allreduce(HostArray(np.zeros(4, np.float32)), HostArray(np.zeros(4, np.float32)))
        raise SystemExit(f"rank {rank}: a GPU rank 1 cannot use was not noticed")
    except ddl.Error as exc:
        assert ("rank 1 cannot use its GPU" + (": cudaErrorNoDevice" if rank == 1 else " (its own error")) in str(exc), exc
    checks += 1
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        # without CuPy a real device executor cannot run: a clear error on every rank, no hang
        other = ddl.Communicator(world)
        try:
            other.Allreduce(HostArray(np.zeros(4, np.float32)), HostArray(np.zeros(4, np.float32)))
            raise SystemExit("device buffers without CuPy not refused")
        except ddl.Error as exc:
            assert "CuPy" in str(exc), exc
        other.Free()
    total = world.reduce(checks, root=0)
    if rank == 0:
        print(f"RESULT {path}: {total} checks passed on {size} ranks ({ex.path_reason})", flush=True)
    comm.Free()
''')


@pytest.mark.parametrize("path,nranks,algorithm", [("cuda-aware-mpi", 3, "auto"), ("cuda-aware-mpi", 4, "double-binary-tree"),
                                                    ("cuda-aware-mpi", 4, "ring"), ("host-staged", 3, "auto")])
@pytest.mark.timeout(600)
def test_fallback_paths_under_mpiexec_match_the_host_executor(tmp_path, path, nranks, algorithm):
    """The device executor's MPI step transport (the CUDA-aware-MPI path) and the host-staged path,
    run on host memory under mpiexec: results bitwise equal to ddl's host executor, every layout."""
    script = tmp_path / "gpu_fallback.py"
    script.write_text(_MPI_SCRIPT)
    # DDL_INLINE_BYTES=0: the host reference runs its schedule at every size (small allreduces would
    # otherwise be reduced from the shared-memory board, in another order than the schedule's)
    env = job_env(PYTHONUNBUFFERED="1", DDL_CACHE_DIR=str(tmp_path / "plans"), DDL_INLINE_BYTES="0")
    proc = subprocess.run([*mpi_command(nranks), sys.executable, "-m", "mpi4py", str(script), path, algorithm],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=550)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"RESULT {path}:" in proc.stdout, proc.stdout[-3000:]


class FakeBothInterfaces(FakeDLPack):
    """A device tensor that exports both interfaces, as a PyTorch CUDA tensor does."""

    def __init__(self, typestr, **kw):
        super().__init__(PTR, (6,), **kw)
        self.__cuda_array_interface__ = {"shape": (6,), "typestr": typestr, "data": (PTR, False),
                                         "version": 3, "strides": None}


def test_anonymous_two_byte_interface_gives_way_to_dlpack():
    """PyTorch exports a bfloat16 CUDA tensor's __cuda_array_interface__ as '<V2': DLPack names the type."""
    bf = FakeBothInterfaces("<V2", code=B.DL_BFLOAT, bits=16)
    b = B.parse_device_buffer(bf)
    assert b.dtype.name == "bfloat16" and b.source == "dlpack" and b.count == 6 and bf.streams
    typed = B.parse_device_buffer([FakeBothInterfaces("<V2", code=B.DL_BFLOAT, bits=16), "float16"])
    assert typed.dtype.name == "float16" and typed.count == 6    # the caller named the type: raw bytes
    plain = FakeBothInterfaces("<f4")
    assert B.parse_device_buffer(plain).source != "dlpack" and plain.streams == []


def test_functional_allreduce_of_a_device_array_goes_to_the_device_executor():
    """comm.allreduce(device array) returns a new array of the same kind from the device executor; an
    array type it cannot make a new one of gets an error naming the supported kinds and the buffer API."""
    from mpi4py import MPI
    from ddl.gpu.executor import HostRuntime, NcclExecutor
    sys.path.insert(0, str(Path(__file__).parent / "mpi_cases"))
    from _host_array import HostArray
    comm = ddl.Communicator(MPI.COMM_SELF)
    comm._device = NcclExecutor(comm, runtime=HostRuntime(), path="cuda-aware-mpi")
    x = HostArray(np.arange(4.0))
    for call in (comm.allreduce, comm.iallreduce):
        with pytest.raises(ddl.Error, match=r"CuPy arrays and torch tensors .* use Allreduce\(send, recv\)"):
            call(x)
    assert comm.allreduce(np.arange(3)).tolist() == [0, 1, 2] and comm.last_path == "host"
    assert comm.allreduce(2.5) == 2.5
    comm.Free()
