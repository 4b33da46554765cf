"""Pieces of the MPI executor that need no MPI: ops, buffer specs, agreement messages, compiled plans."""
import array
import subprocess
from pathlib import Path
import sys

import re

import numpy as np
import pytest

import ddl
from ddl.agreement import Signature, describe, format_ranks, grouped, mismatch_error, refusal
from ddl.buffers import IN_PLACE, is_in_place, parse_buffer, resolve_dtype
from ddl.executor import (C_RECV_DIRECT, C_RECV_LATE, C_RECV_SCRATCH, C_REDUCE_EARLY, C_REDUCE_LATE, C_SEND,
                          CompiledPlan, TagSpace)
from ddl.ops import check_op_dtype, resolve_op
from ddl.schedule import ScheduleBuilder


def test_importing_ddl_does_not_import_mpi4py():
    code = "import sys, ddl; ddl.SUM; ddl.IN_PLACE; ddl.Communicator; assert 'mpi4py' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ops_resolve_and_dtype_rules():
    assert resolve_op("avg") is ddl.AVG and resolve_op(ddl.MAX) is ddl.MAX and resolve_op("lor") is ddl.LOR
    with pytest.raises(ddl.Error, match="unknown reduction op"):
        resolve_op("median")
    with pytest.raises(ddl.Error, match="AVG is not defined for integer dtype int32"):
        check_op_dtype(ddl.AVG, np.int32)
    with pytest.raises(ddl.Error, match="BAND needs an integer or bool dtype, got float16"):
        check_op_dtype(ddl.BAND, np.float16)
    with pytest.raises(ddl.Error, match="LXOR needs an integer or bool dtype, got float32"):
        check_op_dtype(ddl.LXOR, np.float32)
    with pytest.raises(ddl.Error, match="MIN is not defined for dtype complex64"):
        check_op_dtype(ddl.MIN, np.complex64)
    for dt in (np.float16, np.float32, np.int8, np.uint64):
        check_op_dtype(ddl.SUM, dt)
    ml = pytest.importorskip("ml_dtypes")
    check_op_dtype(ddl.AVG, ml.bfloat16)
    with pytest.raises(ddl.Error):
        check_op_dtype(ddl.BXOR, ml.bfloat16)


def test_mpi_ops_map():
    from mpi4py import MPI
    assert resolve_op(MPI.SUM) is ddl.SUM and resolve_op(MPI.BXOR) is ddl.BXOR
    assert (resolve_op(MPI.LAND), resolve_op(MPI.LOR), resolve_op(MPI.LXOR)) == (ddl.LAND, ddl.LOR, ddl.LXOR)
    with pytest.raises(ddl.Error, match="not supported"):
        resolve_op(MPI.MAXLOC)
    # named, not shown as <mpi4py.MPI.Op object at 0x...>
    for op, name in ((MPI.MAXLOC, "MPI.MAXLOC"), (MPI.REPLACE, "MPI.REPLACE"),
                     (MPI.Op.Create(lambda a, b, t: None), r"a user-defined MPI.Op \(MPI.Op.Create\)")):
        with pytest.raises(ddl.Error, match=f"MPI reduction op {name} is not supported"):
            resolve_op(op)


def test_logical_ops_are_logical_on_integers():
    """MPI_LAND and friends treat any non-zero integer as true and give 1 or 0: 1 and 2 are both true,
    although 1 & 2 == 0 (they were once bitwise here)."""
    a, b = np.array([1, 2, 0, 0, -3], np.int32), np.array([2, 1, 7, 0, 4], np.int32)
    for op, expect in ((ddl.LAND, [1, 1, 0, 0, 1]), (ddl.LOR, [1, 1, 1, 0, 1]), (ddl.LXOR, [0, 0, 1, 0, 0])):
        check_op_dtype(op, np.int32)
        out = a.copy()
        op.ufunc(out, b, out=out)            # what the executor does, in place
        assert out.dtype == np.int32 and out.tolist() == expect, op


def test_buffer_specs():
    a = np.arange(10, dtype=np.float32)
    assert parse_buffer(a).base is not None or parse_buffer(a) is a
    v = parse_buffer([a, 4])
    assert v.size == 4 and np.shares_memory(v, a)
    v = parse_buffer([a, np.int32])
    assert v.dtype == np.int32 and v.size == 10 and np.shares_memory(v, a)
    v = parse_buffer([a, 3, "f"])
    assert v.size == 3 and v.dtype == np.float32
    v = parse_buffer([a, (2, 5), "f"])
    assert v[0] == 5 and v.size == 2
    b = bytearray(16)
    v = parse_buffer([b, "d"], writable=True)
    v[:] = 1.5
    assert np.frombuffer(b, np.float64).tolist() == [1.5, 1.5]
    assert parse_buffer(array.array("i", [1, 2, 3])).dtype == np.int32
    f = np.asfortranarray(np.ones((3, 4)))
    assert parse_buffer(f).size == 12 and np.shares_memory(parse_buffer(f), f)
    with pytest.raises(ddl.Error, match="not contiguous"):
        parse_buffer(np.ones((4, 4))[:, 1])
    with pytest.raises(ddl.Error, match="lists are not buffers"):
        parse_buffer([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ddl.Error, match="exceeds"):
        parse_buffer([a, 11])
    with pytest.raises(ddl.Error, match="read-only"):
        parse_buffer(bytes(8), writable=True)
    with pytest.raises(ddl.Error, match="whole number"):
        parse_buffer([np.ones(3, np.uint8), np.float32])
    assert is_in_place(IN_PLACE) and not is_in_place(a)
    # a buffer format numpy cannot read (ctypes' long double: '<g'; a pointer: '<P'): refused where it would be
    # reduced (it was summed as raw bytes), unless the spec names the dtype; moved as opaque items otherwise
    import ctypes
    ld = (ctypes.c_longdouble * 3)(1.5, 2.5, 3.5)
    with pytest.raises(ddl.Error, match="recvbuf: numpy cannot read the buffer format '<g' .*cannot reduce it"):
        parse_buffer(ld, "recvbuf", writable=True)
    with pytest.raises(ddl.Error, match="'<P'"):
        parse_buffer((ctypes.c_void_p * 2)(), "sendbuf")
    v = parse_buffer([ld, np.longdouble], "recvbuf", writable=True)
    assert v.dtype == np.longdouble and v.tolist() == [1.5, 2.5, 3.5]
    v = parse_buffer([ld, 2], "buf", writable=True, bytes_only=True)     # the count counts items, not bytes
    assert v.dtype == np.dtype("V16") and v.nbytes == 32 and v.view(np.longdouble).tolist() == [1.5, 2.5]
    from mpi4py import MPI
    assert is_in_place(MPI.IN_PLACE)
    assert resolve_dtype(MPI.DOUBLE) == np.float64 and resolve_dtype("i8") == np.int64


def test_torch_tensors_of_bfloat16_are_buffers_and_a_tensor_that_requires_grad_is_refused_clearly():
    torch = pytest.importorskip("torch")
    ml = pytest.importorskip("ml_dtypes")
    from ddl.communicator import _numbers
    t = torch.full((4,), 1.5, dtype=torch.bfloat16)
    v = parse_buffer(t, "recvbuf", writable=True)        # numpy's DLPack import alone has no bfloat16
    assert v.dtype == np.dtype(ml.bfloat16) and v.astype(np.float32).tolist() == [1.5] * 4
    v[:] = np.array([2.0, 3.0, 4.0, 5.0], ml.bfloat16)   # the tensor's own memory
    assert t.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert _numbers(torch.ones(3, dtype=torch.bfloat16), "allreduce").dtype == np.dtype(ml.bfloat16)
    for tensor in (torch.ones(3, requires_grad=True), torch.ones(3, dtype=torch.bfloat16, requires_grad=True)):
        with pytest.raises(ddl.Error, match="recvbuf: .*(require|gradient)"):
            parse_buffer(tensor, "recvbuf", writable=True)
        with pytest.raises(ddl.Error, match="allreduce: .*grad"):
            _numbers(tensor, "allreduce")


def test_a_strided_tensor_is_told_to_call_contiguous():
    torch = pytest.importorskip("torch")
    with pytest.raises(ddl.Error, match=r"sendbuf is not contiguous .* pass tensor.contiguous\(\) or a contiguous"):
        parse_buffer(torch.ones(4, 4)[:, 0], "sendbuf")
    with pytest.raises(ddl.Error, match=r"pass numpy.ascontiguousarray\(...\) or a contiguous"):
        parse_buffer(np.ones((4, 4))[:, 0], "sendbuf")


def test_functional_allreduce_of_cpu_tensors_returns_tensors():
    """A tensor in, a tensor out (Horovod's rule), bfloat16 too, so that ``p.grad = comm.allreduce(p.grad)``
    works; numpy arrays and scalars come back as they went in."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    from mpi4py import MPI
    comm = ddl.Communicator(MPI.COMM_SELF)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for result in (comm.allreduce(t, op=ddl.AVG), comm.iallreduce(t).wait()):
        assert isinstance(result, torch.Tensor) and result.dtype == torch.float32 and torch.equal(result, t)
    b = torch.full((3,), 1.5, dtype=torch.bfloat16)
    outs = comm.grouped_allreduce([t, b, np.ones(2, np.int64), torch.tensor(7)])
    assert [type(o).__name__ for o in outs] == ["Tensor", "Tensor", "ndarray", "Tensor"]
    assert outs[1].dtype == torch.bfloat16 and outs[1].tolist() == [1.5] * 3 and outs[3].item() == 7
    assert torch.equal(outs[0], t) and outs[0].data_ptr() != t.data_ptr()   # a new tensor, not the input
    assert comm.allreduce(2.5) == 2.5
    comm.Free()


def test_errors_about_the_topology_of_ddl_topology_say_where_its_name_came_from(monkeypatch, tmp_path):
    """A file the user never typed (``ddl emulate run`` and job scripts set DDL_TOPOLOGY) is named as the
    variable's; a file given directly is not."""
    from mpi4py import MPI
    from ddl.topology import Topology
    missing = tmp_path / "nope.yaml"
    monkeypatch.setenv("DDL_TOPOLOGY", str(missing))
    with pytest.raises(ddl.TopologyError, match=r"nope.yaml: no such file.* \[the file named by environment "
                                                r"variable DDL_TOPOLOGY\]$"):
        ddl.Communicator(MPI.COMM_SELF)
    with pytest.raises(ddl.TopologyError) as err:
        Topology.load(tmp_path / "other.yaml")
    assert "DDL_TOPOLOGY" not in str(err.value)
    eight = str(Path(__file__).parent.parent / "topologies" / "dgx1-v100.yaml")
    monkeypatch.setenv("DDL_TOPOLOGY", eight)
    with pytest.raises(ddl.Error, match=r"topology 'dgx1-v100' \(.*dgx1-v100.yaml, named by environment variable "
                                        r"DDL_TOPOLOGY\) has 8 ranks but the communicator has 1 rank: use a "
                                        r"topology whose ranks: list has one entry per process"):
        ddl.Communicator(MPI.COMM_SELF)


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"


def test_mismatch_message_names_ranks_and_fields():
    good = Signature("allreduce", 1000, np.dtype(np.float32), ddl.SUM, 0, 11, 22)
    bad = Signature("allreduce", 1001, np.dtype(np.float32), ddl.SUM, 0, 11, 22)
    table = [good.with_seq(4)] * 3 + [bad.with_seq(4)]
    err = mismatch_error(table, 4, rank=0)
    assert isinstance(err, ddl.MismatchError)
    text = str(err)
    assert "rank 3 called Allreduce with 1001 float32 (SUM)" in text
    assert "ranks 0-2 called Allreduce with 1000 float32 (SUM)" in text
    assert "[differs in: count]" in text and "collective #4" in text
    assert describe(Signature("broadcast", 5, np.dtype(np.int8), None, 2, 0, 0).vector) == "Bcast with 5 int8 (root 2)"
    assert good.hash(4) != bad.hash(4) and good.hash(4) != good.hash(5) and 0 <= good.hash(7) < 2 ** 62


def test_a_refused_call_is_named_without_field_noise():
    good = Signature("allreduce", 4, np.dtype(np.float64), ddl.SUM, 0, 11, 22)
    refused = refusal("allreduce", 22)
    err = mismatch_error([good.with_seq(7), refused.with_seq(7), good.with_seq(7)], 7, rank=2)
    text = str(err)
    assert "rank 1 called Allreduce with arguments it refused" in text
    assert "ranks 0, 2 called Allreduce with 4 float64 (SUM)" in text
    assert "differs in" not in text and "schedule" not in text, text
    # ranks that refused the same collective agree (each then raises its own error); other calls do not
    assert refusal("allreduce", 22).hash(7) == refused.hash(7)
    assert len({refused.hash(7), refusal("broadcast", 22).hash(7), good.hash(7)}) == 3
    assert describe(refusal("broadcast", 22).vector).startswith("Bcast with arguments it refused")
    err = mismatch_error([refused.with_seq(7), good.with_seq(7), refused.with_seq(7)], 7, rank=1)
    assert "ranks 0, 2 called Allreduce with arguments they refused (their own errors say why)" in str(err), str(err)

def test_a_grouped_call_agrees_on_every_array_and_says_what_differs():
    two = grouped([np.ones(3), np.ones(2, np.float32)], ddl.SUM, 22)
    one = grouped([np.ones(3), np.ones(2)], ddl.SUM, 22)
    swapped = grouped([np.ones(2), np.ones(3)], ddl.SUM, 22)
    assert describe(two.vector) == "grouped_allreduce of 2 arrays, 5 elements in 2 dtypes (SUM)"
    assert describe(one.vector) == "grouped_allreduce of 2 arrays, 5 elements in 1 dtype (SUM)"
    assert len({two.hash(3), one.hash(3), swapped.hash(3), grouped([np.ones(3), np.ones(2)], ddl.MAX, 22).hash(3)}) == 4
    assert grouped([np.zeros(3), np.zeros(2)], ddl.SUM, 22).hash(3) == one.hash(3)   # the values do not count
    text = str(mismatch_error([one.with_seq(3), two.with_seq(3)], 3, rank=0))
    assert "rank 1 called grouped_allreduce of 2 arrays, 5 elements in 2 dtypes (SUM)" in text
    assert "[differs in: number of dtypes, the arrays' dtypes or shapes]" in text, text
    assert "[differs in: the arrays' dtypes or shapes, in order (the same totals: arrays in another order, split " \
           "or shaped otherwise)]" in str(mismatch_error([one.with_seq(3), swapped.with_seq(3)], 3, 0))
    reshaped = grouped([np.ones((3, 1)), np.ones(2)], ddl.SUM, 22)         # same dtypes and sizes, one shape more
    assert reshaped.hash(3) != one.hash(3) and "in order (the same totals" in str(
        mismatch_error([one.with_seq(3), reshaped.with_seq(3)], 3, 0))
    plain = Signature("allreduce", 5, np.dtype(np.float64), ddl.SUM, 0, 11, 22)
    text = str(mismatch_error([plain.with_seq(3), one.with_seq(3)], 3, rank=0))
    assert "rank 0 called Allreduce with 5 float64 (SUM); rank 1 called grouped_allreduce" in text, text


def test_the_functional_allreduce_agrees_on_shapes_and_names_what_differs():
    plain = Signature("allreduce", 6, np.dtype(np.float64), ddl.SUM, 0, 11, 22)
    wide, tall = plain.shaped((2, 3)), plain.shaped((3, 2))
    assert len({plain.hash(5), wide.hash(5), tall.hash(5), plain.shaped((6,)).hash(5)}) == 4
    assert plain.shaped((2, 3)).hash(5) == wide.hash(5) and plain.shaped(()).hash(5) != plain.shaped((1,)).hash(5)
    assert plain.vector[-1] == 0 and describe(plain.vector).startswith("Allreduce with 6 float64")
    assert describe(wide.vector) == "allreduce of float64[2, 3] (SUM)"
    assert describe(plain.shaped(()).vector) == "allreduce of float64 scalar (SUM)"
    text = str(mismatch_error([wide.with_seq(5), tall.with_seq(5), wide.with_seq(5)], 5, rank=1))
    assert "rank 1 called allreduce of float64[3, 2] (SUM); ranks 0, 2 called allreduce of float64[2, 3] (SUM) " \
           "[differs in: array shape]" in text, text
    text = str(mismatch_error([plain.with_seq(5), wide.with_seq(5)], 5, rank=1))
    assert "rank 0 called Allreduce with 6 float64 (SUM); rank 1 called allreduce of float64[2, 3] (SUM) [differs in: " \
           "collective (the functional allreduce, which compares array shapes, against the buffer API's Allreduce)]" \
           in text, text
    # a count that differs too is named with the shape, and the schedule word stays out of it
    other = Signature("allreduce", 8, np.dtype(np.float64), ddl.SUM, 0, 12, 22).shaped((2, 4))
    text = str(mismatch_error([wide.with_seq(5), other.with_seq(5)], 5, rank=0))
    assert "[differs in: count, array shape]" in text, text


def test_shapes_are_shown_where_a_word_holds_them_and_tagged_where_not():
    from ddl.agreement import shape_shown, shape_word
    for shape in ((), (1,), (2, 3), ((1 << 20) - 1, 1, 7)):
        assert shape_shown(shape) and 0 < shape_word(shape) < 2 ** 63
        plain = Signature("allreduce", int(np.prod(shape)), np.dtype(np.int32), ddl.MAX, 0, 11, 22)
        shown = f"int32[{', '.join(map(str, shape))}]" if shape else "int32 scalar"
        assert describe(plain.shaped(shape).vector) == f"allreduce of {shown} (MAX)"
    big, deep = (1 << 20,), (2, 3, 4, 5)
    assert not shape_shown(big) and not shape_shown(deep) and shape_word(big) != shape_word(deep)
    plain = Signature("allreduce", 120, np.dtype(np.float32), ddl.SUM, 0, 11, 22)
    tag = describe(plain.shaped(deep).vector)
    assert re.fullmatch(r"allreduce of float32, shape #[0-9a-f]{6} \(SUM\)", tag), tag
    assert tag == describe(plain.shaped((2, 3, 4, 5)).vector) != describe(plain.shaped((5, 4, 3, 2)).vector)


def test_scratch_is_reused_per_plan_and_bounded_in_bytes_over_all_plans():
    from ddl.executor import ScratchPool

    class Plan:                        # what the pool needs of a CompiledPlan: fresh arrays on demand
        def __init__(self, nbytes):
            self.resource_bytes, self.made = nbytes, 0

        def resources(self):
            self.made += 1
            return np.empty(self.resource_bytes, np.uint8), None

    pool = ScratchPool(budget=300, per_plan=2)
    a, b, c = Plan(100), Plan(100), Plan(1000)
    first = pool.acquire(a)
    pool.release(a, first)
    assert pool.acquire(a) is first and a.made == 1           # the next call of a plan reuses its arrays
    pool.release(a, first)
    pool.release(b, pool.acquire(b))
    assert pool.nbytes == 200
    pool.release(c, pool.acquire(c))                         # over budget: the others go, oldest first ...
    assert list(pool.free) == [c] and pool.nbytes == 1000    # ... but the plan just used stays, however large
    pool.release(a, pool.acquire(a))
    assert a.made == 2 and list(pool.free) == [a] and pool.nbytes == 100
    pairs = [pool.acquire(b) for _ in range(3)]              # three calls of one plan in flight at once
    for pair in pairs:
        pool.release(b, pair)
    assert len(pool.free[b]) == 2 and pool.nbytes == 300     # a plan keeps per_plan pairs
    pool.clear()
    assert not pool.free and pool.nbytes == 0

    class Bare(Plan):                  # a plan without scratch or work arrays (a broadcast, say)
        def resources(self):
            self.made += 1
            return None, None

    few = ScratchPool(budget=1 << 30, per_plan=2, plans=3)
    for _ in range(1000):
        bare = Bare(0)
        few.release(bare, few.acquire(bare))
    assert not few.free                                       # nothing to reuse: no reference kept
    many = [Plan(10) for _ in range(10)]
    for plan in many:
        few.release(plan, few.acquire(plan))
    assert list(few.free) == many[-3:] and few.nbytes == 30   # at most `plans` plans, the newest


def test_a_buffer_of_a_call_in_flight_is_refused_for_another():
    from types import SimpleNamespace

    from ddl.communicator import _check_not_in_flight
    buf, other = np.zeros(100), np.zeros(100)
    flight = [SimpleNamespace(bufs=[None, buf, None, None], label="Allreduce(100 x float64, SUM)", seq=7, extents=None),
              SimpleNamespace(bufs=None, label="done", seq=6, extents=None)]   # finished: buffers let go
    with pytest.raises(ddl.Error, match=r"recvbuf shares memory with a buffer of Allreduce\(100 x float64, SUM\) "
                                        r"\(ddl collective #7\), still in flight"):
        _check_not_in_flight(None, buf[10:20], flight)
    with pytest.raises(ddl.Error, match="sendbuf shares memory"):               # read while it is written
        _check_not_in_flight(buf[:5], other, flight)
    _check_not_in_flight(other, other[:3], flight)                             # other memory: fine
    reading = [SimpleNamespace(bufs=[buf, other, None, None], label="Allreduce", seq=8, extents=None)]
    _check_not_in_flight(buf, np.zeros(100), reading)                          # two reads of one sendbuf: fine
    with pytest.raises(ddl.Error, match="recvbuf shares memory"):              # writing what is being sent
        _check_not_in_flight(None, buf, reading)
    mine, theirs = object(), object()                                           # the engines of two communicators
    elsewhere = [SimpleNamespace(bufs=[None, buf, None, None], label="Allreduce", seq=3, extents=None, engine=theirs)]
    with pytest.raises(ddl.Error, match=r"\(ddl collective #3 on another ddl.Communicator\), still in flight"):
        _check_not_in_flight(None, buf, elsewhere, mine)


def test_tag_space_fits_tag_ub():
    for ub in (32767, 2 ** 21 - 1, 2 ** 29 - 1, 2 ** 31 - 1):
        t = TagSpace(ub)
        top = t.base(t.window - 1, (1 << t.salt_bits) - 1) + t.max_chunks
        assert top <= ub and t.base(0, 0) >= 1 and t.window >= 2
        assert len({t.base(s, 0) for s in range(t.window)}) == t.window


def _ring(n, pattern=(1,)):
    b = ScheduleBuilder("allreduce", n, pattern * n, algorithm="ring")
    k = len(pattern)
    for phase in (True, False):
        for step in range(n - 1):
            for r in range(n):
                blk = (r - step + (0 if phase else 1)) % n
                for j in range(k):
                    b.transfer(r, (r + 1) % n, blk * k + j, reduce=phase)
    return b.build()


def test_compiled_plan_classifies_ops_and_drops_empty_chunks():
    s = _ring(3)
    from ddl.verify import verify
    verify(s)
    plan = CompiledPlan(s, 0, 3000, np.dtype(np.float32), "allreduce", ufunc=np.add)
    codes = [o[0] for o in plan.ops]
    assert codes.count(C_SEND) == 4 and codes.count(C_REDUCE_EARLY) == 2
    assert codes.count(C_RECV_SCRATCH) + codes.count(C_RECV_DIRECT) == 2
    assert plan.scratch_elems > 0 and not plan.copies
    # the first send of rank 0 reads sendbuf (buffer 0); later sends read recvbuf (buffer 1)
    first_send = next(o for o in plan.ops if o[0] == C_SEND)
    assert first_send[3] == 0
    # large chunks: copies with dependencies are posted late, straight into place; reductions stay
    # early (their scratch costs no copy, and the sender streams while the receiver is busy)
    big = CompiledPlan(s, 0, 3000, np.dtype(np.float32), "allreduce", ufunc=np.add, early_limit=16)
    assert C_RECV_LATE in [o[0] for o in big.ops]
    assert [o[0] for o in big.ops].count(C_REDUCE_EARLY) == 2
    # ... except a reduction behind a late receive of the same chunk from the same peer: MPI must match
    # the receive first, so the reduction is posted after it
    # (a valid allreduce: rank 1 returns x0 + x1, then forwards x2, which rank 0 adds)
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.transfer(0, 1, 0, reduce=True)
    b.transfer(1, 0, 0)
    b.transfer(2, 1, 0)
    b.transfer(1, 0, 0, reduce=True)
    b.transfer(0, 1, 0)
    b.transfer(0, 2, 0)
    odd = CompiledPlan(b.build(), 0, 3000, np.dtype(np.float32), "allreduce", ufunc=np.add, early_limit=16)
    assert [o[0] for o in odd.ops] == [C_SEND, C_RECV_LATE, C_REDUCE_LATE, C_SEND, C_SEND]
    odd = CompiledPlan(b.build(), 0, 3000, np.dtype(np.float32), "allreduce", ufunc=np.add)
    assert [o[0] for o in odd.ops] == [C_SEND, C_RECV_SCRATCH, C_REDUCE_EARLY, C_SEND, C_SEND]
    # 2 elements over 3 chunks: one chunk is empty and its ops are dropped on every rank
    tiny = [CompiledPlan(s, r, 2, np.dtype(np.float32), "allreduce", ufunc=np.add) for r in range(3)]
    assert all(t.nops < plan.nops for t in tiny)
    empty = CompiledPlan(s, 1, 0, np.dtype(np.float32), "allreduce", ufunc=np.add)
    assert empty.nops == 0


def test_sends_to_ranks_of_the_same_node_are_paced():
    """Sends ready at the start that go to ranks of this node leave ``node_window`` at a time (program
    order): the others are held. Sends to other nodes, eager-sized ones and sends with dependencies
    never are; window 0, or no node peers, holds nothing."""
    from ddl.schedule import Op, Schedule
    from ddl.verify import verify
    # rank 1 sums chunks 0, 1 and 3, rank 2 chunk 2; each sends its sums back
    s = Schedule("allreduce", 3, (1, 1, 1, 1), (
        (Op("send", 0, 1), Op("send", 1, 1), Op("send", 2, 2), Op("send", 3, 1),
         Op("recv", 0, 1), Op("recv", 1, 1), Op("recv", 2, 2), Op("recv", 3, 1)),
        (Op("send", 2, 2), Op("reduce", 0, 0), Op("reduce", 0, 2), Op("reduce", 1, 0), Op("reduce", 1, 2),
         Op("reduce", 3, 0), Op("reduce", 3, 2), Op("send", 0, 0), Op("send", 0, 2), Op("send", 1, 0),
         Op("send", 1, 2), Op("send", 3, 0), Op("send", 3, 2), Op("recv", 2, 2)),
        (Op("send", 0, 1), Op("send", 1, 1), Op("send", 3, 1), Op("reduce", 2, 0), Op("reduce", 2, 1),
         Op("send", 2, 0), Op("send", 2, 1), Op("recv", 0, 1), Op("recv", 1, 1), Op("recv", 3, 1))),
        algorithm="test")
    verify(s)
    compiled = lambda window, count=1 << 20, peers=frozenset({1}): CompiledPlan(
        s, 0, count, np.dtype(np.float32), "allreduce", ufunc=np.add, node_peers=peers, node_window=window)
    chunks_to = lambda plan, peer, ks: [plan.ops[k][2] for k in ks if plan.ops[k][1] == peer]
    one = compiled(1)
    assert chunks_to(one, 1, one.ready0) == [0] and chunks_to(one, 1, one.held) == [1, 3]   # program order
    assert chunks_to(one, 2, one.ready0) == [2] and not chunks_to(one, 2, one.held)         # another node
    assert len(one.paced) == 3 and not set(one.held) & set(one.ready0)
    two = compiled(2)
    assert chunks_to(two, 1, two.ready0) == [0, 1] and chunks_to(two, 1, two.held) == [3]
    for plan in (compiled(0), compiled(1, peers=frozenset()), compiled(1, count=4000)):   # 4000 B: eager sized
        assert not plan.held and not plan.paced and len(plan.ready0) == 4
    # rank 1's sends with dependencies (the sums) are never paced, though rank 0 is a node peer
    sums = CompiledPlan(s, 1, 1 << 20, np.dtype(np.float32), "allreduce", ufunc=np.add,
                        node_peers=frozenset({0}), node_window=1)
    assert not sums.held and len(sums.paced) == 0


@pytest.mark.parametrize("value,says", [("nan", "is not a number"), ("abc", "is not a number"),
                                        ("inf", "must be a whole number"), ("-inf", "must be a whole number"),
                                        ("4096.9", "must be a whole number"), ("0.5", "must be a whole number")])
def test_integer_settings_refuse_what_is_not_a_whole_number(monkeypatch, value, says):
    from ddl.settings import env_float, env_int
    monkeypatch.setenv("DDL_EARLY_LIMIT", value)
    with pytest.raises(ddl.Error, match=f"DDL_EARLY_LIMIT={value!r} {says}"):
        env_int("DDL_EARLY_LIMIT", 7)
    for written, number in (("4096", 4096), ("4e3", 4000), (" 12.0 ", 12)):
        monkeypatch.setenv("DDL_EARLY_LIMIT", written)
        assert env_int("DDL_EARLY_LIMIT", 7) == number
    monkeypatch.setenv("DDL_EARLY_LIMIT", "inf")
    assert env_float("DDL_EARLY_LIMIT", 7) == float("inf")      # where inf means "never" (stall settings)


def test_a_rank_gives_up_at_once_on_peers_that_gave_up_on_this_or_an_earlier_collective():
    from types import SimpleNamespace
    from ddl.executor import Engine
    status = {0: (3, 3, 0.0), 1: (3, 3, 0.0), 3: (4, 1, 0.0), 4: (5, 4, 0.0)}    # rank: (seq, code, when)
    eng = SimpleNamespace(rank=2, size=5, board=None, _status=status)
    assert Engine._gone(eng, 2) == [] and Engine._gone(eng, 3) == [0, 1] and Engine._gone(eng, 5) == [0, 1, 4]
    ex = SimpleNamespace(label="Allreduce(4 x float64, SUM)", seq=4, state="agreement", check=True, plan=None,
                         warned=True)
    text = Engine.describe_stall(eng, ex, 0.1, Engine._gone(eng, 4))
    assert text.startswith("Allreduce(4 x float64, SUM) (ddl collective #4) on rank 2 cannot complete; waiting in the")
    assert "ranks 0, 1 gave up on ddl collective #3 (StallError) and will not take part in any later one" in text
    assert "rank 3 is stuck in it too" in text and "rank 4 failed in ddl collective #5" in text, text
    assert text.endswith("this communicator is unusable now: make a new one (Free lets go of this one at once)")
    status[0] = (4, 3, 0.0)
    text = Engine.describe_stall(eng, ex, 0.1, [0, 1])
    assert "rank 1 gave up on ddl collective #3 (StallError) and will not take part in any later one; rank 0 gave up " \
           "on it (StallError) and will not take part;" in text, text


def test_word_settings_take_any_case_and_refuse_other_words(monkeypatch):
    from ddl.settings import env_word
    for written, word in (("OFF", "off"), (" New", "new"), ("", "always")):
        monkeypatch.setenv("DDL_CHECK", written)
        assert env_word("DDL_CHECK", "always", ("always", "new", "off")) == word
    monkeypatch.setenv("DDL_CHECK", "sometimes")
    with pytest.raises(ddl.Error, match="environment variable DDL_CHECK must be one of always, new, off, got 'sometimes'"):
        env_word("DDL_CHECK", "always", ("always", "new", "off"))


def test_the_functional_api_returns_results_of_the_kind_given_and_refuses_what_it_cannot_reduce():
    from ddl.communicator import _numbers, _returned
    out = np.array(6.0)
    assert type(_returned(out, 2.0)) is float and type(_returned(np.array(6), 2)) is int
    assert type(_returned(np.array(True), True)) is bool
    assert _returned(np.array(6.0, np.float32), np.float32(2)).dtype == np.float32        # a numpy scalar stays one
    assert isinstance(_returned(np.ones(2), [1.0, 1.0]), np.ndarray)
    with pytest.raises(ddl.Error, match="a Python int beyond int64's range"):
        _numbers(2 ** 70, "allreduce")
    with pytest.raises(ddl.Error, match="objects that are not numbers"):
        _numbers([None, 1], "allreduce")
    with pytest.raises(ddl.Error, match=r"IN_PLACE belongs to the buffer API \(comm.Allreduce\(ddl.IN_PLACE, buf\)"):
        _numbers(ddl.IN_PLACE, "allreduce")


def test_on_off_settings_take_the_usual_words_and_refuse_others(monkeypatch):
    from ddl.planner import Planner, flat_topology
    from ddl.settings import env_flag
    for words, meaning in ((("1", "true", "Yes", "ON "), True), (("0", "false", "NO", "off"), False), (("",), None)):
        for word in words:
            monkeypatch.setenv("DDL_OVERSUBSCRIBED", word)
            assert env_flag("DDL_OVERSUBSCRIBED", None) is meaning, word
    monkeypatch.setenv("DDL_OVERSUBSCRIBED", "maybe")        # (it was taken for "on", DDL_PLAN_CACHE's likewise)
    with pytest.raises(ddl.Error, match=r"DDL_OVERSUBSCRIBED='maybe' is neither on \(1, true, yes, on\) nor off"):
        env_flag("DDL_OVERSUBSCRIBED", None)
    monkeypatch.setenv("DDL_PLAN_CACHE", "maybe")
    with pytest.raises(ddl.Error, match="DDL_PLAN_CACHE='maybe'"):
        Planner(flat_topology(2))


def test_the_doorbell_setting_is_auto_on_or_off(monkeypatch):
    from ddl.settings import env_auto_flag
    for word, meaning in (("", None), ("auto", None), (" AUTO", None), ("1", True), ("on", True), ("0", False),
                          ("off", False)):
        monkeypatch.setenv("DDL_DOORBELL", word)
        assert env_auto_flag("DDL_DOORBELL") is meaning, word
    monkeypatch.setenv("DDL_DOORBELL", "2")                  # (it was taken for off)
    with pytest.raises(ddl.Error, match=r"DDL_DOORBELL='2' is neither auto, on \(1, true, yes, on\) nor off"):
        env_auto_flag("DDL_DOORBELL")


def test_a_span_whose_chunks_take_different_operand_orders_is_reduced_chunk_by_chunk():
    """Rank 1 ships a span of two chunks to rank 2: chunk 0 holds x0 op x1 (rank 0's contribution:
    it goes first at rank 2), chunk 1 only x1, while rank 2's own chunk 1 already holds x0 op x2 (so
    its own goes first). One message, two operand orders: the views reduce each chunk its own way."""
    from ddl.executor import _combine
    from ddl.verify import verify
    b = ScheduleBuilder("allreduce", 3, (1, 1))
    b.transfer(0, 1, 0, reduce=True)
    b.transfer(0, 2, 1, reduce=True)
    (span,) = b.runs([0, 1])
    b.transfer(1, 2, span, reduce=True)
    b.transfer(2, 0, span)
    b.transfer(2, 1, span)
    sched = b.build()
    verify(sched)
    starts = sched.dataflow.starts
    assert sched.operand_order[starts[2] + 1] == (True, False)      # rank 2: reduce chunk 1, then the span
    plan = CompiledPlan(sched, 2, 4, np.dtype(np.float64), "allreduce_inplace", ufunc=np.maximum)
    recv = np.array([-0.0, -0.0, 7.0, 7.0])
    scratch, work = plan.resources()
    assert plan.resource_bytes == sum(a.nbytes for a in (scratch, work) if a is not None) > 0   # (ScratchPool)
    views = plan.views([None, recv, work, scratch])
    k = next(k for k, o in enumerate(plan.ops) if o[2] == span and o[0] in (C_REDUCE_EARLY, C_REDUCE_LATE))
    first, segments = views[k][1], views[k][2]
    assert first is None and len(segments) == 2
    incoming0, local0 = np.zeros(2), recv[:2].copy()
    segments[0][0][...] = incoming0   # the incoming chunk 0 goes first ...
    segments[1][1][...] = 5.0         # ... the incoming chunk 1 second
    _combine(np.maximum, views[k])
    want = np.maximum(incoming0, local0)
    assert want.tobytes() != np.maximum(local0, incoming0).tobytes()    # +0.0 and -0.0: the order shows
    assert recv.tobytes() == np.concatenate([want, [7.0, 7.0]]).tobytes()


def test_the_idle_policy_keeps_driving_large_messages_where_each_rank_has_a_core(monkeypatch):
    """Some MPIs move a message above the eager size only while both ranks are in MPI (Intel MPI on one
    host): a rank with a core of its own yields for 50 ms before it naps while one is in flight, 2 ms
    otherwise; an oversubscribed one leaves its core after 1 ms either way. Environment overrides."""
    from ddl.executor import idle_policy
    for key in ("DDL_SPIN", "DDL_IDLE_SLEEP_AFTER", "DDL_IDLE_SLEEP_AFTER_LARGE", "DDL_IDLE_NAP", "DDL_IDLE_NAP_MAX"):
        monkeypatch.delenv(key, raising=False)
    assert idle_policy(False) == (64, 0.002, 0.05, 0.0001, 0.001)
    assert idle_policy(True) == (0, 0.001, 0.001, 0.00002, 0.0002)
    monkeypatch.setenv("DDL_IDLE_SLEEP_AFTER_LARGE", "0.2")
    assert idle_policy(True)[2] == 0.2
    monkeypatch.setenv("DDL_IDLE_SLEEP_AFTER_LARGE", "0")          # never shorter than for any message
    assert idle_policy(False)[1:3] == (0.002, 0.002)


@pytest.mark.parametrize("large", [0, 1])
def test_a_waiting_rank_naps_only_after_its_idle_time(monkeypatch, large):
    """The wait loop itself, nothing ever completing for 30 ms: with a large message in flight it only
    yields; without, it naps once 2 ms have gone by."""
    import time
    from ddl import executor
    engine = executor.Engine.__new__(executor.Engine)
    engine.poll = lambda: False
    engine.spin, engine.sleep_after, engine.sleep_after_large, engine.nap, engine.nap_max = 0, 0.002, 0.05, 1e-4, 1e-3
    engine.bell, engine._large, engine._watchdog = None, large, lambda now: None
    calls = {"yield": 0, "nap": 0}
    sleep = time.sleep
    monkeypatch.setattr(executor.os, "sched_yield", lambda: calls.update({"yield": calls["yield"] + 1}))
    monkeypatch.setattr(executor.time, "sleep", lambda s: (calls.update({"nap": calls["nap"] + 1}), sleep(s)))
    deadline = time.monotonic() + 0.03
    engine._drive_loop(lambda: time.monotonic() > deadline, None)
    assert calls["yield"] > 0
    assert (calls["nap"] == 0) if large else (calls["nap"] > 0), calls


def test_an_mpi_error_is_told_by_its_cause():
    from ddl.communicator import _mpi_reason
    stack = ("Other MPI error, error stack:\ninternal_Comm_split_type(103).......: MPI_Comm_split_type(MPI_COMM_WORLD, "
             "split_type=1) failed\nMPIR_Comm_split_type_impl(105)......: \nMPIR_Get_contextid_sparse_group(567): Too "
             "many communicators (0/2048 free on this process; ignore_id=0)\n")
    assert _mpi_reason(Exception(stack)) == "Too many communicators (0/2048 free on this process; ignore_id=0)"
    assert _mpi_reason(Exception("MPI_ERR_INTERN: internal error")) == "MPI_ERR_INTERN: internal error"
