"""Device buffers: recognised and described without copying, and without importing CuPy.

A *device buffer* is anything that lives in CUDA device memory and says so through one of the two
standard protocols:

* ``__cuda_array_interface__`` (versions 0-3: CuPy arrays, Numba device arrays, PyTorch CUDA
  tensors, JAX, ...): ``shape``, ``typestr``, ``data = (pointer, read_only)``, optional ``strides``
  and (version 3) ``stream``;
* ``__dlpack__`` / ``__dlpack_device__`` with a CUDA device (``kDLCUDA`` or ``kDLCUDAManaged``):
  the DLPack capsule is read in place with :mod:`ctypes` (data pointer, byte offset, shape, strides,
  dtype), so bfloat16 tensors -- which ``__cuda_array_interface__`` cannot describe -- work too.

:func:`parse_device_buffer` accepts the same specs as :func:`ddl.buffers.parse_buffer`
(``buf``, ``[buf, count]``, ``[buf, dtype]``, ``[buf, count, dtype]``, ``[buf, (count, displ), dtype]``)
and returns a :class:`DeviceBuffer`: the device pointer *as exported* (no copy, no staging), the
element count, the :class:`DeviceDType` and the object that keeps the memory alive.

Contiguity: ddl moves byte ranges and reduces in place, so a buffer must be contiguous (C or
Fortran order); a strided view raises :class:`ddl.Error` rather than being copied behind your back.

**Streams.** A collective on device buffers runs on a CUDA stream: the one passed explicitly, else
CuPy's current stream. It is *enqueued* after whatever the caller already put on that stream, so
the caller's preceding kernels that produce the data are respected without any synchronisation, and
later work on that stream sees the result. A buffer exported with a ``stream`` (CUDA array
interface v3) or through DLPack is synchronised into the collective's stream by the protocol's
rules (an event wait; DLPack: the producer is given the consumer's stream).

**Dtypes** (:data:`DTYPES`): float16 (``__half``), bfloat16 (``__nv_bfloat16``), float32, float64,
int8 .. int64, uint8 .. uint64 and bool. Complex, float8, longdouble and structured dtypes raise
:class:`ddl.Error`. Each dtype knows its NCCL enum (``None`` where NCCL has none: int16, uint16,
bool -- ddl's NCCL transfers are byte transfers, so every dtype still works) and its CUDA C type.
"""
import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..buffers import split_spec
from ..errors import Error

# ---- dtypes ---------------------------------------------------------------------------------------

# NCCL's ncclDataType_t values (nccl.h; stable since NCCL 2.0, bfloat16 since 2.10).
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9

# DLPack DLDataTypeCode and DLDeviceType values (dlpack.h).
DL_INT, DL_UINT, DL_FLOAT, DL_OPAQUE, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 3, 4, 5, 6
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
DEVICE_TYPES = (DL_CUDA, DL_CUDA_MANAGED)


@dataclass(frozen=True)
class DeviceDType:
    """One supported element type, in every vocabulary ddl's GPU code needs."""

    name: str            # numpy-style name: "float32", "bfloat16", "bool", ...
    kind: str            # "float" | "int" | "bool" (the classes of ddl.ops)
    itemsize: int
    typestr: Optional[str]   # __cuda_array_interface__ typestr ("<f4"); None for bfloat16 (it has none)
    ctype: str           # CUDA C type of the kernels: "__half", "__nv_bfloat16", "float", "long long", ...
    nccl: Optional[int]  # ncclDataType_t, or None where NCCL has no such type
    kernel: str          # the dtype whose kernels this one uses (bool -> uint8: 0/1 bytes)

    @property
    def numpy(self):
        """The numpy dtype (bfloat16 needs ml_dtypes), or None when numpy cannot represent it."""
        if self.name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                return None
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.name)

    def __repr__(self):
        return f"DeviceDType({self.name})"


def _dt(name, kind, itemsize, typestr, ctype, nccl, kernel=None):
    return DeviceDType(name, kind, itemsize, typestr, ctype, nccl, kernel or name)


DTYPES = {d.name: d for d in (
    _dt("float16", "float", 2, "<f2", "__half", NCCL_FLOAT16),
    _dt("bfloat16", "float", 2, None, "__nv_bfloat16", NCCL_BFLOAT16),
    _dt("float32", "float", 4, "<f4", "float", NCCL_FLOAT32),
    _dt("float64", "float", 8, "<f8", "double", NCCL_FLOAT64),
    _dt("int8", "int", 1, "|i1", "signed char", NCCL_INT8),
    _dt("int16", "int", 2, "<i2", "short", None),
    _dt("int32", "int", 4, "<i4", "int", NCCL_INT32),
    _dt("int64", "int", 8, "<i8", "long long", NCCL_INT64),
    _dt("uint8", "int", 1, "|u1", "unsigned char", NCCL_UINT8),
    _dt("uint16", "int", 2, "<u2", "unsigned short", None),
    _dt("uint32", "int", 4, "<u4", "unsigned int", NCCL_UINT32),
    _dt("uint64", "int", 8, "<u8", "unsigned long long", NCCL_UINT64),
    _dt("bool", "bool", 1, "|b1", "unsigned char", None, kernel="uint8"),
)}

_ANONYMOUS_2B = ("<V2", "V2", "|V2")   # how bfloat16 arrays describe themselves (numpy has no bfloat16)
_ALIASES = {"half": "float16", "f2": "float16", "bf16": "bfloat16", "float": "float32", "single": "float32",
            "double": "float64", "f4": "float32", "f8": "float64", "bool_": "bool", "e": "float16"}
_SUPPORTED = ", ".join(DTYPES)


def _unsupported(what):
    return Error(f"dtype {what} is not supported on GPU buffers; supported: {_SUPPORTED}")


def _from_numpy(dt):
    dt = np.dtype(dt)
    if dt.kind == "V" and dt.fields is None and dt.subdtype is None and dt.itemsize == 2:
        ml = sys.modules.get("ml_dtypes")
        if ml is not None and dt == np.dtype(ml.bfloat16):
            return DTYPES["bfloat16"]
    if dt.byteorder == ">" and dt.itemsize > 1:
        raise Error(f"dtype {dt.str} is big-endian; CUDA devices are little-endian")
    key = {"f": "float", "i": "int", "u": "uint", "b": "bool"}.get(dt.kind)
    if key is None:
        raise _unsupported(f"{dt} ({dt.str})")
    name = "bool" if key == "bool" else f"{key}{dt.itemsize * 8}"
    found = DTYPES.get(name)
    if found is None:  # float128 / longdouble, float8 stored as kind 'f' by some libraries
        raise _unsupported(f"{dt} ({dt.str})")
    return found


def device_dtype(dtype):
    """:class:`DeviceDType` from a DeviceDType, numpy dtype/type, name, typestr or MPI datatype.

    Raises :class:`ddl.Error` for anything else (complex, float8, longdouble, structured ...).
    """
    if isinstance(dtype, DeviceDType):
        return dtype
    if isinstance(dtype, str):
        s = dtype.strip()
        key = _ALIASES.get(s.lower(), s.lower())
        if key in DTYPES:
            return DTYPES[key]
        if s in _ANONYMOUS_2B:
            raise Error(f"typestr {s!r} is an anonymous 2-byte type (this is how bfloat16 arrays export "
                        f"themselves to numpy): say which it is with [buf, 'bfloat16'], or pass the "
                        f"tensor itself (DLPack knows it is bfloat16)")
        try:
            return _from_numpy(np.dtype(s))
        except TypeError:
            raise Error(f"cannot interpret {dtype!r} as a dtype; supported: {_SUPPORTED}") from None
    if isinstance(dtype, (np.dtype, type)):
        try:
            return _from_numpy(dtype)
        except TypeError:
            raise _unsupported(repr(dtype)) from None
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(dtype, mpi.Datatype):
        from ..buffers import resolve_dtype
        return _from_numpy(resolve_dtype(dtype))
    # torch.dtype and friends: their str() is "torch.float32"
    text = str(dtype).rsplit(".", 1)[-1]
    if text in DTYPES or text in _ALIASES:
        return device_dtype(text)
    raise Error(f"cannot interpret {dtype!r} as a dtype; supported: {_SUPPORTED}")


def dtype_from_typestr(typestr):
    """``__cuda_array_interface__`` typestr (``"<f4"``, ``"|u1"`` ...) -> :class:`DeviceDType`."""
    if not isinstance(typestr, str):
        raise Error(f"__cuda_array_interface__ typestr must be a string, got {typestr!r}")
    return device_dtype(typestr)


def dtype_from_dlpack(code, bits, lanes=1):
    """DLPack ``DLDataType`` (code, bits, lanes) -> :class:`DeviceDType`."""
    if lanes != 1:
        raise Error(f"DLPack dtype with {lanes} lanes (a vector type) is not supported")
    name = {DL_INT: f"int{bits}", DL_UINT: f"uint{bits}", DL_FLOAT: f"float{bits}",
            DL_BFLOAT: f"bfloat{bits}", DL_BOOL: "bool" if bits == 8 else None}.get(code)
    if name is None or name not in DTYPES:
        kind = {DL_COMPLEX: "complex", DL_OPAQUE: "opaque", DL_BOOL: "bool"}.get(code, f"code {code}")
        raise _unsupported(f"DLPack {kind} with {bits} bits")
    return DTYPES[name]


# ---- device buffers -------------------------------------------------------------------------------

@dataclass
class DeviceBuffer:
    """A contiguous range of device memory, described as exported (no copy was made).

    ``ptr`` is the address of the first element, ``count`` elements of ``dtype``. ``device`` is the
    CUDA ordinal when the exporter said (DLPack) else None. ``stream`` is the exporter's stream
    (CUDA array interface v3) that the collective must wait for, or None. ``owner`` keeps the memory
    alive while ddl uses the pointer.
    """

    ptr: int
    count: int
    dtype: DeviceDType
    device: Optional[int] = None
    stream: Optional[int] = None
    readonly: bool = False
    shape: tuple = ()
    source: str = "cuda_array_interface"
    owner: Any = field(default=None, repr=False)

    @property
    def nbytes(self):
        return self.count * self.dtype.itemsize

    @property
    def itemsize(self):
        return self.dtype.itemsize

    def sub(self, start, count):
        """Elements ``[start, start + count)`` as a DeviceBuffer (same memory)."""
        return DeviceBuffer(self.ptr + start * self.dtype.itemsize, count, self.dtype, self.device, self.stream,
                            self.readonly, (count,), self.source, self.owner)

    @property
    def __cuda_array_interface__(self):
        """So that CUDA-aware MPI (through mpi4py) and CuPy can use it directly."""
        dt = self.dtype
        typestr = dt.typestr if dt.typestr is not None else "<u2"
        return {"shape": (self.count,), "typestr": typestr, "data": (self.ptr, self.readonly),
                "strides": None, "version": 3, "stream": None}


def _contiguous(shape, strides, itemsize):
    """True when (shape, strides in bytes) is C- or Fortran-contiguous (size-1 dims ignored)."""
    if strides is None:
        return True
    if any(s == 0 for s in shape):
        return True
    dims = [(n, st) for n, st in zip(shape, strides) if n != 1]
    expect = itemsize
    ok_c = True
    for n, st in reversed(dims):
        if st != expect:
            ok_c = False
            break
        expect *= n
    if ok_c:
        return True
    expect = itemsize
    for n, st in dims:
        if st != expect:
            return False
        expect *= n
    return True


def _size(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _not_contiguous(what, shape, strides):
    return Error(f"{what} is not contiguous in device memory (shape {tuple(shape)}, strides {tuple(strides)} "
                 f"bytes); ddl needs contiguous buffers: pass a contiguous copy (cupy.ascontiguousarray, "
                 f"tensor.contiguous()) or a contiguous slice")


def from_cuda_array_interface(obj, what="buffer", cai=None, typed_later=False):
    """DeviceBuffer from an object's ``__cuda_array_interface__`` (v0-v3), pointer taken as is."""
    if cai is None:
        try:
            cai = obj.__cuda_array_interface__
        except AttributeError:
            raise Error(f"{what} has no __cuda_array_interface__") from None
        except Exception as exc:
            raise Error(f"{what}: its __cuda_array_interface__ failed ({exc})") from None
    if not isinstance(cai, dict):
        raise Error(f"{what}: __cuda_array_interface__ must be a dict, got {type(cai).__name__}")
    missing = [k for k in ("shape", "typestr", "data") if k not in cai]
    if missing:
        raise Error(f"{what}: __cuda_array_interface__ lacks {', '.join(missing)}")
    version = int(cai.get("version", 0))
    if cai.get("mask") is not None:
        raise Error(f"{what}: masked arrays (__cuda_array_interface__ mask) are not supported")
    shape = tuple(int(s) for s in cai["shape"])
    if typed_later and str(cai["typestr"]).strip() in _ANONYMOUS_2B:
        dtype = DTYPES["uint16"]       # bfloat16's raw bits: the spec's dtype (parse_device_buffer) says what
    else:
        dtype = dtype_from_typestr(cai["typestr"])
    data = cai["data"]
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise Error(f"{what}: __cuda_array_interface__ data must be (pointer, read_only), got {data!r}")
    ptr, readonly = int(data[0] or 0), bool(data[1])
    strides = cai.get("strides")
    if strides is not None:
        strides = tuple(int(s) for s in strides)
        if len(strides) != len(shape):
            raise Error(f"{what}: __cuda_array_interface__ strides {strides} do not match shape {shape}")
        if not _contiguous(shape, strides, dtype.itemsize):
            raise _not_contiguous(what, shape, strides)
    count = _size(shape)
    if count and ptr % dtype.itemsize:
        raise Error(f"{what}: device pointer {ptr:#x} is not aligned to its {dtype.itemsize}-byte elements")
    stream = cai.get("stream") if version >= 3 else None
    if stream is not None:
        stream = int(stream)
        if stream == 0:
            raise Error(f"{what}: __cuda_array_interface__ stream 0 is disallowed by the protocol (ambiguous)")
    return DeviceBuffer(ptr, count, dtype, None, stream, readonly, shape, "cuda_array_interface", obj)


# DLPack structures (dlpack.h), read with ctypes.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_FLAG_READ_ONLY = 1

_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_info(capsule):
    """Read a DLPack capsule in place: dict(ptr, device_type, device_id, shape, strides (elements or
    None), dtype (code, bits, lanes), readonly). ``ptr`` includes ``byte_offset``.

    The capsule is not consumed (not renamed): its producer's destructor frees the managed tensor
    when the capsule is garbage collected, so the caller keeps the capsule alive while it uses the
    pointer.
    """
    name = _capsule_get_name(capsule)
    if name == b"dltensor":
        managed = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, name))
        t, flags = managed.dl_tensor, 0
    elif name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_get_pointer(capsule, name))
        if managed.version.major > 1:
            raise Error(f"DLPack version {managed.version.major}.{managed.version.minor} is not supported")
        t, flags = managed.dl_tensor, managed.flags
    else:
        raise Error(f"not an unconsumed DLPack capsule (name {name!r})")
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if t.strides else None
    return {"ptr": int(t.data or 0) + int(t.byte_offset), "device_type": int(t.device.device_type),
            "device_id": int(t.device.device_id), "shape": shape, "strides": strides,
            "dtype": (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)),
            "readonly": bool(flags & _DLPACK_FLAG_READ_ONLY)}


def dlpack_device(obj):
    """``obj.__dlpack_device__()`` as (device_type, device_id), or None when it has none / fails."""
    fn = getattr(type(obj), "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        dev = obj.__dlpack_device__()
        return int(dev[0]), int(dev[1])
    except Exception:
        return None


def from_dlpack(obj, what="buffer", stream=None):
    """DeviceBuffer from a CUDA DLPack exporter (``__dlpack__``), pointer taken as is.

    ``stream``: the consumer's stream pointer (the collective's); the producer makes it wait for
    its pending work. None asks for the legacy default stream, per the protocol.
    """
    dev = dlpack_device(obj)
    if dev is None or dev[0] not in DEVICE_TYPES:
        raise Error(f"{what} is not a CUDA DLPack exporter (device {dev})")
    kwargs = {}
    if stream is not None:
        kwargs["stream"] = 1 if int(stream) == 0 else int(stream)  # 0 is disallowed; 1 = legacy default
    try:
        capsule = obj.__dlpack__(**kwargs)
    except TypeError:
        capsule = obj.__dlpack__()
    except Exception as exc:
        raise Error(f"{what}: __dlpack__ failed ({exc})") from None
    info = dlpack_info(capsule)
    dtype = dtype_from_dlpack(*info["dtype"])
    shape, strides = info["shape"], info["strides"]
    if strides is not None and not _contiguous(shape, [s * dtype.itemsize for s in strides], dtype.itemsize):
        raise _not_contiguous(what, shape, [s * dtype.itemsize for s in strides])
    count = _size(shape)
    if count and info["ptr"] % dtype.itemsize:
        raise Error(f"{what}: device pointer {info['ptr']:#x} is not aligned to its {dtype.itemsize}-byte elements")
    return DeviceBuffer(info["ptr"], count, dtype, info["device_id"], None, info["readonly"], shape, "dlpack",
                        (obj, capsule))


def _unwrap(spec):
    if isinstance(spec, (list, tuple)) and spec and not isinstance(spec[0], (int, float, complex, np.number)):
        return spec[0]
    return spec


def is_device_buffer(spec):
    """True when ``spec`` (a buffer or an mpi4py-style ``[buf, ...]`` spec) is in CUDA device memory.

    Never imports CuPy and never exports the buffer: it looks at ``__dlpack_device__`` first (a
    PyTorch CPU tensor says CPU there), then at whether ``__cuda_array_interface__`` exists.
    """
    obj = _unwrap(spec)
    if obj is None or isinstance(obj, (np.ndarray, np.generic, int, float, complex, bytes, bytearray, memoryview)):
        return False
    dev = dlpack_device(obj)
    if dev is not None:
        return dev[0] in DEVICE_TYPES
    try:
        obj.__cuda_array_interface__
    except AttributeError:
        return False
    except Exception:
        return True  # it is a device array whose interface cannot describe it: parse_device_buffer says why
    return True


def as_device_buffer(obj, what="buffer", stream=None, typed_later=False):
    """DeviceBuffer of a whole object: ``__cuda_array_interface__`` first, then DLPack.
    An interface that says only "2 anonymous bytes" (bfloat16 tensors of PyTorch do) gives way to
    DLPack when the object has it, since DLPack names bfloat16.
    ``typed_later``: a spec names the dtype, so an anonymous 2-byte typestr (bfloat16's) is read as
    raw bytes instead of refused."""
    if isinstance(obj, DeviceBuffer):
        return obj
    cai_error = None
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    except Exception as exc:  # e.g. a bfloat16 torch tensor: its interface refuses, DLPack can say it
        cai, cai_error = None, exc
    if cai is not None:
        if not typed_later and isinstance(cai, dict) and str(cai.get("typestr", "")).strip() in _ANONYMOUS_2B:
            dev = dlpack_device(obj)
            if dev is not None and dev[0] in DEVICE_TYPES:
                return from_dlpack(obj, what, stream)   # a torch bfloat16 tensor: only DLPack names its type
        return from_cuda_array_interface(obj, what, cai, typed_later)
    dev = dlpack_device(obj)
    if dev is not None and dev[0] in DEVICE_TYPES:
        return from_dlpack(obj, what, stream)
    if cai_error is not None:
        raise Error(f"{what}: its __cuda_array_interface__ failed ({cai_error})")
    raise Error(f"{what} is not a CUDA device buffer (no __cuda_array_interface__, no CUDA __dlpack_device__)")


def parse_device_buffer(spec, what="buffer", writable=False, stream=None):
    """Buffer spec -> flat :class:`DeviceBuffer` (no copy), as :func:`ddl.buffers.parse_buffer`."""
    buf, count, displ, dtype = split_spec(
        spec, what, f"{what} must be a device array or an mpi4py-style [buf, count, dtype] spec")
    b = as_device_buffer(buf, what, stream, typed_later=dtype is not None)
    if dtype is not None:
        dt = device_dtype(dtype)
        if dt != b.dtype:
            nbytes = b.nbytes
            if nbytes % dt.itemsize:
                raise Error(f"{what}: {nbytes} bytes are not a whole number of {dt.name} elements")
            if b.count and b.ptr % dt.itemsize:
                raise Error(f"{what}: device pointer {b.ptr:#x} is not aligned to {dt.name} elements")
            b = DeviceBuffer(b.ptr, nbytes // dt.itemsize, dt, b.device, b.stream, b.readonly,
                             (nbytes // dt.itemsize,), b.source, b.owner)
    if displ:
        if displ < 0 or displ > b.count:
            raise Error(f"{what}: displacement {displ} outside a buffer of {b.count} elements")
        b = b.sub(displ, b.count - displ)
    if count is not None:
        if count < 0:
            raise Error(f"{what}: negative count {count}")
        if count > b.count:
            raise Error(f"{what}: count {count} exceeds the buffer's {b.count} {b.dtype.name} elements")
        b = b.sub(0, count)
    else:
        b = DeviceBuffer(b.ptr, b.count, b.dtype, b.device, b.stream, b.readonly, (b.count,), b.source, b.owner)
    if writable and b.readonly:
        raise Error(f"{what} is read-only; the result must be written into a writable buffer")
    return b
