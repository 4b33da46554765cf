"""Reduction kernels: CUDA C++ source generation per (op, dtype, number of inputs), run-time compilation.

The kernels themselves are in ``native/reduce.cuh`` (see ``native/README.md``). This module

* finds that file: ``ddl/native/`` next to the installed package first, then ``native/`` at the
  repository root (an editable install or a source checkout); ``DDL_NATIVE_DIR`` overrides both;
* generates, for a spec ``(op, dtype, ninputs)``, a small translation unit: the header text followed
  by one ``extern "C"`` kernel ``ddl_reduce_<op>_<dtype>_x<ninputs>(out, a0, a1, ..., n)`` computing
  ``out[i] = op(...op(a0[i], a1[i])..., a_ninputs[i])``: ``a0`` is the local value (may be ``out``),
  ``a1..`` the incoming chunks;
* compiles it on first use with CuPy's ``RawModule`` (NVRTC; CuPy picks the architecture of the
  current device and caches the binary on disk) and launches it on a given stream.

Generation and the launch geometry are pure Python (tested without a GPU); ``nvcc`` can compile every
generated source (the no-device tests do, when nvcc is installed), and :func:`host_harness_source`
wraps the same element loop into host functions so that the tests run it on the CPU against numpy.
"""
import functools
import math
import os
import threading
from pathlib import Path

import numpy as np

from ..errors import Error
from .buffers import DTYPES, device_dtype

OPS = ("SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR")
BITWISE = ("BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR")     # integers and bool only (logical ones too)
_OP_STRUCT = {"SUM": "ddl::OpSum", "PROD": "ddl::OpProd", "MIN": "ddl::OpMin", "MAX": "ddl::OpMax",
              "BAND": "ddl::OpBand", "BOR": "ddl::OpBor", "BXOR": "ddl::OpBxor",
              "LAND": "ddl::OpLand", "LOR": "ddl::OpLor", "LXOR": "ddl::OpLxor"}
MAX_INPUTS = 8       # incoming chunks one launch reduces (longer chains are split, in order)
BLOCK = 256          # threads per block (the kernels declare __launch_bounds__(BLOCK))
BLOCKS_PER_SM = 8    # grid cap: the grid-stride loop makes any grid correct; this one saturates HBM
HEADER = "reduce.cuh"

# the dtypes that have kernels of their own (bool uses uint8's: 0/1 bytes)
KERNEL_DTYPES = tuple(name for name, d in DTYPES.items() if d.kernel == name)


# ---- locating the CUDA sources --------------------------------------------------------------------
def native_dirs():
    """Directories searched for ``reduce.cuh``, in order."""
    here = Path(__file__).resolve().parent.parent  # the ddl package
    dirs = []
    env = os.environ.get("DDL_NATIVE_DIR")
    if env:
        dirs.append(Path(env))
    dirs += [here / "native", here.parent / "native"]
    return dirs


_source_cache = {}


def native_source():
    """Text of ``reduce.cuh`` (see :func:`native_dirs`)."""
    for d in native_dirs():
        path = d / HEADER
        if path.is_file():
            key = str(path)
            if key not in _source_cache:
                _source_cache[key] = path.read_text()
            return _source_cache[key]
    raise Error(f"ddl's CUDA sources ({HEADER}) were not found in {', '.join(map(str, native_dirs()))}; "
                f"reinstall ddl (its wheel ships them as ddl/native/{HEADER}; an editable install reads native/ "
                f"of its checkout) or set DDL_NATIVE_DIR")


# ---- specs ----------------------------------------------------------------------------------------
def op_name(op):
    """``ddl.SUM`` / ``"sum"`` -> ``"SUM"``; AVG is SUM and :func:`scale_kernel_source` (after the sum,
    or on each input before it for float16: :func:`ddl.ops.divides_first`)."""
    name = getattr(op, "name", op)
    if not isinstance(name, str):
        raise Error(f"not a reduction op: {op!r}")
    name = name.upper()
    if name == "AVG":
        raise Error("AVG has no kernel of its own: it is SUM and the scale kernel (divide by the rank count)")
    if name not in OPS:
        raise Error(f"unknown reduction op {op!r}; GPU kernels exist for {', '.join(OPS)}")
    return name


def check_spec(op, dtype, ninputs=1):
    """Validate and normalise a kernel spec: returns (op name, DeviceDType, ninputs)."""
    name = op_name(op)
    dt = device_dtype(dtype)
    if name in BITWISE and dt.kind == "float":
        raise Error(f"{name} needs an integer or bool dtype, got {dt.name}")
    if dt.kind == "bool" and name in ("SUM", "PROD"):
        raise Error(f"{name} is not defined for bool (use BOR / BAND / MAX / MIN)")
    if not isinstance(ninputs, int) or not 1 <= ninputs <= MAX_INPUTS:
        raise Error(f"a kernel reduces 1..{MAX_INPUTS} incoming chunks, not {ninputs!r}")
    return name, dt, ninputs


def all_specs():
    """Every valid (op name, kernel dtype name, ninputs): what :func:`module_source` can hold."""
    out = []
    for name in OPS:
        for dt in KERNEL_DTYPES:
            if name in BITWISE and DTYPES[dt].kind == "float":
                continue
            for k in range(1, MAX_INPUTS + 1):
                out.append((name, dt, k))
    return out


def kernel_name(op, dtype, ninputs):
    name, dt, k = check_spec(op, dtype, ninputs)
    return f"ddl_reduce_{name.lower()}_{dt.kernel}_x{k}"


def scale_kernel_name(dtype):
    dt = device_dtype(dtype)
    if dt.kind != "float":
        raise Error(f"AVG (a division) is defined for floating-point dtypes only, not {dt.name}")
    return f"ddl_scale_{dt.kernel}"


# ---- source generation ----------------------------------------------------------------------------
_TIES_MACRO = {"float16": "HALF", "bfloat16": "BF16", "float32": "FLOAT", "float64": "DOUBLE"}


@functools.lru_cache(maxsize=None)
def ties_second(ufunc, dtype):
    """Whether numpy's ``ufunc`` (minimum or maximum) keeps the second of two equal operands of
    ``dtype`` (-0.0 and +0.0 compare equal), as ddl's host executor computes it: numpy's SIMD loops
    do, its scalar loops keep the first, so the answer depends on the CPU, the numpy build and the
    dtype (float16 keeps the first where float32 keeps the second). The kernels are told, so that a
    reduction on the device gives the host's bits. Asked once per process (numpy does not change)."""
    from ..ops import reduce_into
    first, second = np.full(16, -0.0, dtype), np.full(16, 0.0, dtype)
    out = np.empty_like(first)
    reduce_into(ufunc, first, second, out)
    return not np.signbit(out[0])


def _preamble(dtypes):
    lines = ["// generated by ddl/gpu/kernels.py from native/reduce.cuh"]
    names = {device_dtype(d).kernel for d in dtypes}
    if "float16" in names:
        lines.append("#define DDL_WITH_HALF 1")
    if "bfloat16" in names:
        lines.append("#define DDL_WITH_BF16 1")
    for name in sorted(names & set(_TIES_MACRO)):
        dt = DTYPES[name].numpy
        if dt is not None:
            for op, ufunc in (("MIN", np.minimum), ("MAX", np.maximum)):
                lines.append(f"#define DDL_{op}_TIES_SECOND_{_TIES_MACRO[name]} {int(ties_second(ufunc, dt))}")
    return "\n".join(lines) + "\n"


def _ctype(dt):
    return DTYPES[dt.kernel].ctype


def _reduce_wrapper(op, dtype, ninputs, host=False):
    name, dt, k = check_spec(op, dtype, ninputs)
    t = _ctype(dt)
    kname = kernel_name(name, dt, k)
    params = ", ".join([f"{t}* out"] + [f"const {t}* a{i}" for i in range(k + 1)] + ["unsigned long long n"])
    args = ", ".join(f"a{i}" for i in range(k + 1))
    call = f"ddl::reduce_thread<{_OP_STRUCT[name]}, {t}>"
    if host:
        return (f'extern "C" void host_{kname}({params}, unsigned long long nthreads) {{\n'
                f"    for (unsigned long long t = 0; t < nthreads; ++t) {call}(out, n, t, nthreads, {args});\n"
                f"}}\n")
    return (f'extern "C" __global__ void __launch_bounds__({BLOCK}) {kname}({params}) {{\n'
            f"    {call}(out, n, ddl::thread_index(), ddl::thread_count(), {args});\n"
            f"}}\n")


def _scale_wrapper(dtype, host=False):
    dt = device_dtype(dtype)
    kname = scale_kernel_name(dt)
    t = _ctype(dt)
    params = f"{t}* out, unsigned long long n, double divisor"
    if host:
        return (f'extern "C" void host_{kname}({params}, unsigned long long nthreads) {{\n'
                f"    for (unsigned long long t = 0; t < nthreads; ++t) ddl::scale_thread<{t}>(out, n, divisor, t, nthreads);\n"
                f"}}\n")
    return (f'extern "C" __global__ void __launch_bounds__({BLOCK}) {kname}({params}) {{\n'
            f"    ddl::scale_thread<{t}>(out, n, divisor, ddl::thread_index(), ddl::thread_count());\n"
            f"}}\n")


def kernel_source(op, dtype, ninputs):
    """Complete CUDA C++ source of the kernel :func:`kernel_name` ``(op, dtype, ninputs)``."""
    _, dt, _ = check_spec(op, dtype, ninputs)
    return _preamble([dt]) + native_source() + "\n" + _reduce_wrapper(op, dt, ninputs)


def scale_kernel_source(dtype):
    """Source of ``ddl_scale_<dtype>(out, n, divisor)``: ``out[i] /= divisor`` (AVG's division)."""
    dt = device_dtype(dtype)
    return _preamble([dt]) + native_source() + "\n" + _scale_wrapper(dt)


def module_source(specs, scale_dtypes=(), host=False):
    """One translation unit holding many kernels (the header once, then one wrapper per spec).

    ``host=True`` emits host functions ``host_<kernel name>(..., nthreads)`` instead, which run the
    same element loop for every thread index in turn (see :func:`host_harness_source`).
    """
    specs = [check_spec(*s) for s in specs]
    dts = [dt for _, dt, _ in specs] + [device_dtype(d) for d in scale_dtypes]
    body = [_reduce_wrapper(n, dt, k, host) for n, dt, k in specs]
    body += [_scale_wrapper(d, host) for d in scale_dtypes]
    return _preamble(dts) + native_source() + "\n" + "".join(body)


def host_harness_source(specs, scale_dtypes=()):
    """Host-compilable source (``nvcc -x cu -shared``) of the kernels' element loop (tests)."""
    return module_source(specs, scale_dtypes, host=True)


# ---- launch geometry ------------------------------------------------------------------------------
def unroll(ninputs):
    """Packs in flight per thread in the kernel's main loop (mirrors Reduce::UNROLL in reduce.cuh)."""
    k = ninputs + 1
    return 4 if k <= 3 else (2 if k <= 5 else 1)


def launch_config(count, itemsize, ninputs=1, sm_count=None, aligned=True):
    """(grid, block) for reducing ``count`` elements: enough threads to give every thread ``unroll``
    16-byte packs (or one element when the pointers are not co-aligned), capped at
    ``BLOCKS_PER_SM`` blocks per SM (the grid-stride loop covers the rest). Always >= 1 block."""
    if count <= 0:
        return 1, BLOCK
    if aligned:
        pack = max(16 // itemsize, 1)
        work = math.ceil(count / pack / unroll(ninputs))
    else:
        work = count
    grid = max(1, math.ceil(work / BLOCK))
    cap = (sm_count or 132) * BLOCKS_PER_SM
    return min(grid, cap), BLOCK


def co_aligned(ptrs):
    """True when all pointers have the same address mod 16 (the vector path applies)."""
    return len({int(p) & 15 for p in ptrs}) <= 1


# ---- compilation and launch (CuPy) ----------------------------------------------------------------
def compile_options():
    """NVRTC options: the CUDA include directory (for cuda_fp16.h / cuda_bf16.h) when CuPy knows it.

    No ``-arch``: CuPy adds the current device's. No fast math: IEEE results, NaN propagation and
    correctly rounded division are part of the contract (bitwise equal to the host executor)."""
    opts = []
    try:
        import cupy
        path = cupy.cuda.get_cuda_path()
    except Exception:
        path = None
    path = path or os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME")
    if path and os.path.isdir(os.path.join(path, "include")):
        opts.append("-I" + os.path.join(path, "include"))
    return tuple(opts)


class KernelCache:
    """Compiled kernels per (kernel name, device), compiled on first use (thread safe)."""

    def __init__(self):
        self._kernels = {}
        self._lock = threading.Lock()
        self._sms = {}
        self._launch = {}        # (op, dtype as given, inputs, device) -> (kernel, itemsize, SMs)

    def _get(self, name, make_source):
        """The kernel ``name`` on the current device; ``make_source()`` gives its source, asked only when
        it is compiled (building it costs tens of microseconds, and this runs before every launch)."""
        import cupy
        dev = cupy.cuda.Device().id
        key = (name, dev)
        kern = self._kernels.get(key)
        if kern is None:
            with self._lock:
                kern = self._kernels.get(key)
                if kern is None:
                    try:
                        mod = cupy.RawModule(code=make_source(), options=compile_options())
                        kern = mod.get_function(name)
                    except Exception as exc:
                        raise Error(f"compiling GPU kernel {name} failed: {exc}") from exc
                    self._kernels[key] = kern
        return kern

    def reduce_kernel(self, op, dtype, ninputs):
        return self._get(kernel_name(op, dtype, ninputs), lambda: kernel_source(op, dtype, ninputs))

    def scale_kernel(self, dtype):
        return self._get(scale_kernel_name(dtype), lambda: scale_kernel_source(dtype))

    def sm_count(self):
        import cupy
        dev = cupy.cuda.runtime.getDevice()
        sms = self._sms.get(dev)
        if sms is None:
            sms = self._sms[dev] = cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
        return sms

    def reduce(self, op, dtype, out, a0, inputs, count, stream=None):
        """Launch ``out = op(a0, *inputs)`` over ``count`` elements (device pointers as ints).

        ``inputs`` longer than MAX_INPUTS are reduced in consecutive launches, in order (bitwise the
        same: the kernel rounds after every operation). ``stream``: a CuPy stream (default: current).

        This runs for every reduction of every step, so it keeps its own host time small (measured on
        an H100 host: 17 us a launch before, against 6 us for CuPy's launch itself): kernels are looked
        up by (op, dtype, width, device) without building their names, and the arguments go to CuPy
        as Python ints, which it passes as 64-bit integers (the kernels take ``unsigned long long``).
        """
        import cupy
        if count <= 0:
            return
        if not inputs:
            raise Error("a reduction needs at least one incoming chunk")
        dev = cupy.cuda.runtime.getDevice()
        ctx = stream if stream is not None else cupy.cuda.get_current_stream()
        with ctx:
            src = a0
            for start in range(0, len(inputs), MAX_INPUTS):
                part = inputs[start:start + MAX_INPUTS]
                key = (op, dtype, len(part), dev)
                entry = self._launch.get(key)
                if entry is None:
                    dt = device_dtype(dtype)
                    entry = self._launch[key] = (self.reduce_kernel(op, dt, len(part)), dt.itemsize,
                                                 self.sm_count())
                kern, itemsize, sms = entry
                grid, block = launch_config(count, itemsize, len(part), sms, co_aligned([out, src, *part]))
                kern((grid,), (block,), (int(out), int(src), *map(int, part), int(count)))
                src = out

    def scale(self, dtype, ptr, count, divisor, stream=None):
        """Launch ``ptr[i] /= divisor`` over ``count`` elements (AVG)."""
        import cupy
        import numpy as np
        if count <= 0:
            return
        dt = device_dtype(dtype)
        ctx = stream if stream is not None else cupy.cuda.get_current_stream()
        with ctx:
            kern = self.scale_kernel(dt)
            grid, block = launch_config(count, dt.itemsize, 1, self.sm_count())
            kern((grid,), (block,), (np.uint64(ptr), np.uint64(count), np.float64(divisor)))


_default_cache = None


def default_cache():
    """The process-wide :class:`KernelCache`."""
    global _default_cache
    if _default_cache is None:
        _default_cache = KernelCache()
    return _default_cache
