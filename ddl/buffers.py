"""mpi4py-style buffer specifications, turned into flat numpy views without copying.

Accepted forms (as in mpi4py's upper-case methods):

* ``buf`` -- a numpy array, or anything exporting the buffer protocol (``bytearray``, ``array.array``,
  ``memoryview``, ...) or ``__array_interface__`` / ``__dlpack__`` (CPU tensors);
* ``[buf, count]`` -- the first ``count`` elements of ``buf``;
* ``[buf, dtype]`` -- the memory of ``buf`` read as ``dtype`` (like an MPI datatype: no conversion);
* ``[buf, count, dtype]``.

``dtype`` may be a numpy dtype or type (``np.float32``), a character code (``"f"``, ``"d"``, ``"i8"``),
a name (``"float32"``, ``"bfloat16"`` with ml_dtypes installed) or an mpi4py datatype (``MPI.FLOAT``,
``MPI.INT64_T``, ...).

Buffers must be contiguous in memory (C or Fortran order): ddl sends byte ranges of them and reduces
into them in place, so a strided view would need a hidden copy; it is refused with :class:`ddl.Error`
instead. Receive buffers must be writable.
"""
import sys

import numpy as np

from .errors import Error


class _InPlace:
    """The ``ddl.IN_PLACE`` sentinel (``MPI.IN_PLACE`` is accepted too)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "ddl.IN_PLACE"

    def __reduce__(self):
        return (_InPlace, ())


IN_PLACE = _InPlace()


def is_in_place(buf):
    if buf is IN_PLACE:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and buf is mpi.IN_PLACE


def resolve_dtype(dtype):
    """numpy dtype from a numpy dtype/type, char code, name or mpi4py Datatype."""
    if isinstance(dtype, np.dtype):
        return dtype
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(dtype, mpi.Datatype):
        from mpi4py.util import dtlib
        try:
            return np.dtype(dtlib.to_numpy_dtype(dtype))
        except Exception as exc:
            raise Error(f"MPI datatype {dtype.Get_name() or dtype!r} has no numpy equivalent: {exc}") from None
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    if isinstance(dtype, str):
        try:
            import ml_dtypes
            found = getattr(ml_dtypes, dtype.strip(), None)
            if found is not None:
                return np.dtype(found)
            if dtype.strip() == "E":
                return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            pass
    raise Error(f"cannot interpret {dtype!r} as a dtype (use a numpy dtype, a character code such as 'f', "
                f"or an MPI datatype such as MPI.FLOAT)")


def _as_array(obj, what, opaque_ok=False):
    """``obj`` as a numpy array on its memory. A buffer whose format numpy cannot read (ctypes'
    ``c_longdouble`` is ``'<g'``, ``c_void_p`` ``'<P'``) becomes opaque elements of its item size
    (``V16``) where ``opaque_ok`` (its bytes will only be moved, or read as a dtype the caller names);
    otherwise it is refused: reduced as raw bytes, it gave garbage without a word."""
    if type(obj) is np.ndarray:
        return obj
    if is_in_place(obj):   # (before the buffer protocol: mpi4py's MPI.IN_PLACE has one, of no bytes)
        raise Error(f"{what} cannot be IN_PLACE: IN_PLACE goes in sendbuf, with the buffer it stands for as "
                    f"recvbuf (Bcast's one buffer is always used in place)")
    if isinstance(obj, np.ma.MaskedArray):
        raise Error(f"{what} is a masked array: ddl reduces and moves every element, masked or not; pass "
                    f"its .data (masked values included) or .filled(value)")
    if isinstance(obj, np.ndarray):
        return obj.view(np.ndarray)     # a subclass's own view and reshape rules (np.matrix) are not for moving bytes
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is not None:
        if not view.contiguous:
            raise Error(f"{what} is not contiguous in memory; ddl needs contiguous buffers "
                        f"(pass a contiguous copy, e.g. numpy.ascontiguousarray)")
        try:
            return np.asarray(view)
        except (ValueError, TypeError, NotImplementedError):
            if not opaque_ok:
                raise Error(f"{what}: numpy cannot read the buffer format {view.format!r} of a "
                            f"{type(obj).__name__} ({view.itemsize}-byte items), so ddl cannot reduce it; "
                            f"name the dtype ([buf, dtype], e.g. [buf, numpy.longdouble] for ctypes.c_longdouble) "
                            f"or pass a numpy array") from None
            opaque = np.dtype(f"V{view.itemsize}")
            return np.frombuffer(view.cast("B"), dtype=opaque) if not view.readonly else \
                np.frombuffer(view.tobytes(), dtype=opaque)
    if hasattr(obj, "__array_interface__"):
        return np.asarray(obj)
    if hasattr(obj, "__dlpack__"):
        bf16 = torch_bfloat16(obj, what)
        if bf16 is not None:
            return bf16
        try:
            return np.from_dlpack(obj)
        except Exception as exc:
            on_cpu = getattr(obj, "__dlpack_device__", lambda: (1, 0))()[0] == 1
            raise Error(f"{what}: cannot access its memory via DLPack ({exc})"
                        + ("" if on_cpu else "; pass a CPU array")) from None
    hint = " (lists are not buffers: use numpy.array(...))" if isinstance(obj, (list, tuple)) else ""
    raise Error(f"{what} must be a numpy array or an object with the buffer protocol, got {type(obj).__name__}"
                + hint)


def torch_bfloat16(obj, what):
    """A torch bfloat16 tensor on the CPU as a numpy bfloat16 array on the same memory, or None for
    anything else: numpy's DLPack import has no bfloat16 (ml_dtypes gives numpy one), so the tensor's
    bits go through an int16 view. Looks for torch only where the program imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or obj.dtype != torch.bfloat16 or obj.device.type != "cpu":
        return None
    if obj.requires_grad:             # as DLPack refuses such tensors of other dtypes
        raise Error(f"{what}: the tensor requires gradient: pass tensor.detach()")
    try:
        import ml_dtypes
    except ImportError:
        raise Error("bfloat16 tensors need ml_dtypes: pip install ml_dtypes") from None
    try:
        return np.from_dlpack(obj.view(torch.int16)).view(ml_dtypes.bfloat16)
    except (RuntimeError, TypeError, ValueError, BufferError) as exc:   # whatever torch or numpy refuse
        raise Error(f"{what}: cannot access the bfloat16 tensor's memory ({exc})") from None


def like_input(result, given):
    """``result`` (a numpy array) as the functional API returns it for the argument ``given``: a CPU
    torch tensor on the same memory where ``given`` is a torch tensor (Horovod's rule: a tensor in,
    a tensor out), else the array itself. Looks for torch only where the program imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(given, torch.Tensor):
        return result
    if given.dtype == torch.bfloat16:   # torch reads no numpy bfloat16: through an int16 view, as above
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)


def flat_view(arr, what, given=None):
    """1-D view of a contiguous numpy array in memory order; ddl.Error if it is not contiguous, whose fix
    speaks the language of ``given`` (the caller's object: a torch tensor has ``.contiguous()``)."""
    if arr.flags.c_contiguous:
        return arr.reshape(-1)
    if arr.flags.f_contiguous:
        return arr.reshape(-1, order="F")
    fix = "tensor.contiguous()" if callable(getattr(given, "contiguous", None)) else "numpy.ascontiguousarray(...)"
    raise Error(f"{what} is not contiguous in memory (shape {arr.shape}, strides {arr.strides}); ddl needs "
                f"contiguous buffers: pass {fix} or a contiguous slice")


def _whole(value, what, name):
    """An integer of a buffer spec; a float such as 2.7 or a string is refused, not truncated or let
    through to a ValueError."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise Error(f"{what}: the {name} must be an integer, got {value!r}")


def split_spec(spec, what, not_a_buffer):
    """An mpi4py buffer spec -> ``(buf, count or None, displacement, dtype or None)``.

    Shared by the host and the device buffer parsers: the forms are the same, only the memory differs.
    ``not_a_buffer`` is the message for a list of numbers (a common mistake: lists are not buffers).
    """
    count = dtype = None
    displ = 0
    if not isinstance(spec, (list, tuple)):
        return spec, count, displ, dtype
    if not spec or isinstance(spec[0], (int, float, complex, np.number)):
        raise Error(not_a_buffer)
    if len(spec) == 2:
        buf, second = spec
        if isinstance(second, (int, np.integer)) and not isinstance(second, bool):
            count = int(second)
        else:
            dtype = second
    elif len(spec) == 3:
        buf, count, dtype = spec
        if isinstance(count, (tuple, list)):  # mpi4py's (count, displacement)
            if len(count) != 2:
                raise Error(f"{what}: count must be an int or (count, displacement)")
            count, displ = _whole(count[0], what, "count"), _whole(count[1], what, "displacement")
        count = None if count is None else _whole(count, what, "count")
    else:
        raise Error(f"{what} spec must be buf, [buf, count], [buf, dtype] or [buf, count, dtype]; "
                    f"got a {type(spec).__name__} of length {len(spec)}")
    return buf, count, displ, dtype


def parse_buffer(spec, what="buffer", writable=False, bytes_only=False):
    """Buffer spec -> 1-D numpy array viewing the described memory (no copy).

    ``what`` names the argument in error messages (``"recvbuf"``). ``bytes_only``: the collective only
    moves the bytes (Bcast, Allgather), so a buffer format numpy cannot read is accepted as opaque items
    of its size (see :func:`_as_array`); a reduction refuses it unless the spec names a dtype.
    """
    buf, count, displ, dtype = split_spec(
        spec, what, f"{what} must be a numpy array or an object with the buffer protocol, got a "
                    f"{type(spec).__name__} of numbers (lists are not buffers: use numpy.array(...))")
    arr = _as_array(buf, what, opaque_ok=bytes_only or dtype is not None)
    flat = flat_view(arr, what, buf)
    if dtype is not None:
        dt = resolve_dtype(dtype)
        if dt != flat.dtype:
            raw = flat.view(np.uint8)
            if raw.size % dt.itemsize:
                raise Error(f"{what}: {raw.size} bytes are not a whole number of {dt} elements")
            flat = raw.view(dt)
    if displ:
        if displ < 0 or displ > flat.size:
            raise Error(f"{what}: displacement {displ} outside a buffer of {flat.size} elements")
        flat = flat[displ:]
    if count is not None:
        if count < 0:
            raise Error(f"{what}: negative count {count}")
        if count > flat.size:
            raise Error(f"{what}: count {count} exceeds the buffer's {flat.size} {flat.dtype} elements")
        flat = flat[:count]
    if writable and not flat.flags.writeable:
        raise Error(f"{what} is read-only; the result must be written into a writable buffer")
    return flat
