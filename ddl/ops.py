"""Reduction operations and the dtypes they accept.

``ddl.SUM PROD MIN MAX AVG BAND BOR BXOR LAND LOR LXOR`` are :class:`Op` objects. Each reduces with a
numpy ufunc, in place (``ufunc(local, incoming, out=local)``, or the operands the other way round), so
no temporary is created per chunk. All of them are commutative and associative on exact types; on
floats the *order* of reduction, operands included, is a fixed function of the schedule, so results
are bitwise identical on every rank and every run. Operand order counts even where values commute:
``max(-0.0, +0.0)`` and ``max(+0.0, -0.0)`` differ in sign, and a sum of two NaNs keeps the first's
sign and payload (:attr:`ddl.schedule.Schedule.operand_order` fixes it).

Dtypes: every numpy integer (``int8`` .. ``int64``, ``uint8`` .. ``uint64``), ``bool``, ``float16``
``float32`` ``float64`` ``longdouble``, ``complex64`` ``complex128``, and the ml_dtypes floats
(``bfloat16``, float8 variants) when ml_dtypes is installed (numpy ufuncs work on them).

Rules (violations raise :class:`ddl.Error` before any communication):

* ``BAND BOR BXOR`` need integers or bool;
* ``LAND LOR LXOR`` (logical, as MPI's) need integers or bool; on integers the result is 1 or 0 (any
  non-zero value counts as true), never a bitwise combination;
* ``MIN MAX`` refuse complex numbers (no order);
* ``SUM PROD AVG`` refuse bool (numpy would silently turn ``+`` into ``or``);
* ``AVG`` is ``SUM`` followed by a division by the number of ranks on every rank, except on float16
  (:func:`divides_first`): there every rank's input is divided first, then summed. It is defined for
  floating-point (and complex) dtypes only and **refuses integers**, as Horovod does: neither floor
  division (surprising for negative sums) nor a silent cast is a good default. Use ``SUM`` and divide
  yourself, or convert to a float dtype first.

mpi4py users may pass ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN``, ``MPI.MAX``, ``MPI.BAND``, ``MPI.BOR``,
``MPI.BXOR``, ``MPI.LAND``, ``MPI.LOR``, ``MPI.LXOR``, or the names as strings (``"sum"``, ``"avg"``,
``"land"``, ...).
"""
import sys

import numpy as np

from .errors import Error


class Op:
    """A reduction operation: a name, a numpy ufunc and the dtype classes it accepts."""

    __slots__ = ("name", "code", "ufunc", "accepts", "average")

    def __init__(self, name, code, ufunc, accepts, average=False):
        self.name, self.code, self.ufunc, self.accepts, self.average = name, code, ufunc, accepts, average

    def __repr__(self):
        return f"ddl.{self.name}"

    def __reduce__(self):  # pickles as the module-level singleton
        return (_by_name, (self.name,))


_NUM = frozenset({"int", "float", "complex"})
SUM = Op("SUM", 1, np.add, _NUM)
PROD = Op("PROD", 2, np.multiply, _NUM)
MIN = Op("MIN", 3, np.minimum, frozenset({"int", "float", "bool"}))
MAX = Op("MAX", 4, np.maximum, frozenset({"int", "float", "bool"}))
AVG = Op("AVG", 5, np.add, frozenset({"float", "complex"}), average=True)
BAND = Op("BAND", 6, np.bitwise_and, frozenset({"int", "bool"}))
BOR = Op("BOR", 7, np.bitwise_or, frozenset({"int", "bool"}))
BXOR = Op("BXOR", 8, np.bitwise_xor, frozenset({"int", "bool"}))
LAND = Op("LAND", 9, np.logical_and, frozenset({"int", "bool"}))
LOR = Op("LOR", 10, np.logical_or, frozenset({"int", "bool"}))
LXOR = Op("LXOR", 11, np.logical_xor, frozenset({"int", "bool"}))

OPS = (SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR, LAND, LOR, LXOR)
LOGICAL = (LAND, LOR, LXOR)
_BY_NAME = {op.name: op for op in OPS}
_BY_CODE = {op.code: op for op in OPS}
_ALIASES = {"AVERAGE": AVG, "MEAN": AVG}


@np.errstate(all="ignore")   # (as a decorator: half the cost of a with block)
def reduce_into(ufunc, a, b, out):
    """``out = a op b`` without a temporary (``out`` may be ``a`` or ``b``), floating-point exceptions
    ignored (see :func:`reduce_quietly`)."""
    reduce_quietly(ufunc, a, b, out)


def reduce_quietly(ufunc, a, b, out):
    """:func:`reduce_into` for a caller already inside ``np.errstate(all="ignore")``.

    Floating-point exceptions (overflow, invalid, ...) are never trapped nor warned about, as in MPI:
    under the user's ``np.seterr(over="raise")`` an overflow on one rank would otherwise raise halfway
    through a collective and leave the other ranks waiting for it (and with the default settings,
    print RuntimeWarnings that point into ddl). The result holds the IEEE value (inf, nan).

    One element is computed aside: numpy takes ``add(a, b, out=a)`` of a single element for a
    reduction and keeps ``b``'s NaN (sign and payload) instead of ``a``'s, which would break the
    operand order that makes results bitwise identical on every rank."""
    if out.size == 1:
        out[...] = ufunc(a, b)
    else:
        ufunc(a, b, out=out)


def _by_name(name):
    return _BY_NAME[name]


def op_from_code(code):
    return _BY_CODE.get(int(code))


def resolve_op(op):
    """``ddl.SUM`` / ``"sum"`` / ``MPI.SUM`` ... -> the :class:`Op`; anything else raises ddl.Error."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        key = op.strip().upper()
        found = _BY_NAME.get(key) or _ALIASES.get(key)
        if found is not None:
            return found
        raise Error(f"unknown reduction op {op!r}; use one of {', '.join(o.name for o in OPS)}")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(op, mpi.Op):
        for name in ("SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"):
            if op == getattr(mpi, name):
                return _BY_NAME.get(name) or _ALIASES[name]
        name = next((f"MPI.{n}" for n in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP", "OP_NULL")
                     if op == getattr(mpi, n, None)), None)
        if name is None:   # (mpi4py shows an Op as <mpi4py.MPI.Op object at 0x...>: say what it is)
            name = ("a predefined MPI.Op" if getattr(op, "is_predefined", False)
                    else "a user-defined MPI.Op (MPI.Op.Create)")
        raise Error(f"MPI reduction op {name} is not supported by ddl; use one of "
                    f"{', '.join(o.name for o in OPS)}")
    raise Error(f"op must be one of ddl.{', ddl.'.join(o.name for o in OPS)}, got {op!r}")


def dtype_class(dtype):
    """``'int' | 'float' | 'complex' | 'bool'`` for a supported numpy dtype, else None."""
    dtype = np.dtype(dtype)
    kind = dtype.kind
    if kind in "iu":
        return "int"
    if kind == "f":
        return "float"
    if kind == "c":
        return "complex"
    if kind == "b":
        return "bool"
    if kind == "V" and dtype.fields is None and dtype.subdtype is None:
        ml = sys.modules.get("ml_dtypes")
        if ml is not None:
            try:
                ml.finfo(dtype)
                return "float"
            except Exception:
                pass
            try:
                ml.iinfo(dtype)
                return "int"
            except Exception:
                pass
    return None


def check_op_dtype(op, dtype):
    """Raise :class:`ddl.Error` unless ``op`` can reduce ``dtype`` (see the module docstring)."""
    cls = dtype_class(dtype)
    if cls is None:
        raise Error(f"dtype {np.dtype(dtype)} is not supported for reductions (numeric dtypes only: "
                    f"integers, float16/32/64, complex, bool, and bfloat16 with ml_dtypes)")
    if cls not in op.accepts:
        if op.average and cls == "int":
            raise Error(f"AVG is not defined for integer dtype {np.dtype(dtype)} (ddl, like Horovod, refuses "
                        f"it rather than silently truncating): use SUM and divide, or reduce a float array")
        if op in (BAND, BOR, BXOR, LAND, LOR, LXOR):
            raise Error(f"{op.name} needs an integer or bool dtype, got {np.dtype(dtype)}")
        raise Error(f"{op.name} is not defined for dtype {np.dtype(dtype)}")


def divides_first(op, dtype, nranks):
    """Whether an AVG of ``dtype`` over ``nranks`` divides every rank's input by the rank count before
    the sum (instead of the sum after it). float16 only: its largest value is 65504, which the sum of
    ordinary values passes (40000 averaged over 3 ranks: ``inf`` when summed first), and NCCL's
    ``ncclAvg`` and PyTorch DDP divide first there too. Other floats reach 1e38 and more, and
    dividing the sum rounds once instead of once per rank. ``dtype``: a numpy dtype or a name."""
    return op is not None and op.average and nranks > 1 and str(dtype) == "float16"


@np.errstate(all="ignore")
def divided(array, nranks):
    """A new array: ``array`` divided by ``nranks`` in its own dtype (an AVG's input, see
    :func:`divides_first`); underflow ignored, as in the reduction."""
    return np.true_divide(array, nranks, dtype=array.dtype)


@np.errstate(all="ignore")
def finish_average(array, nranks):
    """In-place division by ``nranks`` that ends an AVG (``array`` holds the sum); floating-point
    exceptions (underflow) ignored, as in the reduction (see :func:`reduce_quietly`)."""
    np.true_divide(array, nranks, out=array, casting="unsafe")
