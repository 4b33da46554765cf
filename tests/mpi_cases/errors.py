"""Mismatch errors on every rank, argument errors, buffer spec forms.

    mpiexec -n N python -m mpi4py tests/mpi_cases/errors.py      (N >= 2)
"""
import array
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from _common import RANK, SIZE, WORLD, Checker, two_host_topology  # noqa: E402

import ddl  # noqa: E402

chk = Checker()
p, r = SIZE, RANK
last = p - 1
comm = ddl.Communicator(WORLD, stall_timeout=60)


def expect(exc_type, fn, *must_contain, label=""):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        for piece in must_contain:
            chk.ok(piece in text, f"{label}: {piece!r} not in message: {text}")
        return text
    except Exception as exc:  # wrong type
        chk.fail(f"{label}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
    chk.fail(f"{label}: expected {exc_type.__name__}, nothing raised")


def still_works(label):
    a = np.full(3, r + 1, np.float64)
    comm.Allreduce(ddl.IN_PLACE, a, op=ddl.SUM)
    chk.ok(np.all(a == p * (p + 1) / 2), f"communicator unusable after {label}")


# ---- mismatches: raised on EVERY rank, naming ranks and values --------------------------------------
count = 1001 if r == last else 1000
msg = expect(ddl.MismatchError, lambda: comm.Allreduce(np.ones(count, np.float32), np.empty(count, np.float32)),
             f"rank {last} called Allreduce with 1001 float32", "called Allreduce with 1000 float32", "count",
             label="count mismatch")
if r == 0:
    print("MISMATCH MESSAGE:", msg, flush=True)
still_works("count mismatch")

# a set-up error on one rank (its topology file has the wrong size, say) is an error on every rank, not a
# hang of the others in the constructor's collective part
wrong = two_host_topology(p + 1) if r == 0 else None
if r == 0:
    expect(ddl.Error, lambda: ddl.Communicator(WORLD, topology=wrong), f"has {p + 1} ranks but the communicator has {p}",
           label="a wrong topology on rank 0")
else:
    expect(ddl.Error, lambda: ddl.Communicator(WORLD), "rank 0 could not set up (their own error says why)",
           label="a wrong topology on rank 0 (the others)")
expect(ddl.Error, lambda: ddl.Communicator(MPI.COMM_NULL), "null communicator", label="COMM_NULL")
still_works("a set-up error on one rank")

# across the inline limit: n float32 ride on the agreement board, n + 1 take the schedule; still one error
n = comm.inline_bytes // 4 or 256
count = n + 1 if r == last else n
expect(ddl.MismatchError, lambda: comm.Allreduce(np.ones(count, np.float32), np.empty(count, np.float32)),
       f"rank {last} called Allreduce with {n + 1} float32", f"called Allreduce with {n} float32", "count",
       label="count mismatch across the inline limit")
still_works("count mismatch across the inline limit")

dt = np.float64 if r == 0 else np.float32
expect(ddl.MismatchError, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(10, dt)),
       "rank 0 called Allreduce with 10 float64", "with 10 float32", "dtype", label="dtype mismatch")

# the byte order is part of the dtype: big-endian int32 summed into little-endian int32 is garbage
dt = np.dtype(">i4") if r == last else np.dtype("<i4")
expect(ddl.MismatchError, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4, dt)), ">i4", "int32", "dtype",
       label="byte-order mismatch")
same = np.ones(4, ">i4")                         # on every rank: fine
comm.Allreduce(ddl.IN_PLACE, same)
chk.ok(np.all(same == p), "big-endian on every rank")

op = ddl.MAX if r == last else ddl.SUM
expect(ddl.MismatchError, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4), op=op), "(MAX)", "(SUM)", "op",
       label="op mismatch")

if r == 0:
    fn = lambda: comm.Bcast(np.ones(4), root=0)  # noqa: E731
else:
    fn = lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4))  # noqa: E731
expect(ddl.MismatchError, fn, "rank 0 called Bcast with 4 float64", "collective", label="collective mismatch")

msg = expect(ddl.MismatchError, lambda: comm.Bcast(np.ones(4), root=(1 if r == last else 0)), "root 1", "root 0",
             "[differs in: root]", label="root mismatch")
chk.ok(msg is not None and "schedule" not in msg, f"root mismatch blames the schedule it implies: {msg}")

# nonblocking: the error surfaces at Wait, on every rank, while other requests complete fine
good = np.full(2, r, np.int64)
q1 = comm.Iallreduce(ddl.IN_PLACE, good)
bad_n = 7 if r == 0 else 8
q2 = comm.Iallreduce(ddl.IN_PLACE, np.ones(bad_n, np.int64))
q3 = comm.Iallgather(np.full(1, r, np.int32), out3 := np.empty(p, np.int32))
q3.Wait()
expect(ddl.MismatchError, q2.Wait, "rank 0 called Allreduce with 7 int64", label="nonblocking mismatch")
q1.Wait()
chk.ok(np.all(good == sum(range(p))) and np.array_equal(out3, np.arange(p)), "requests around a mismatch")
still_works("nonblocking mismatch")

# more calls in flight than the tag window holds: the later ones wait in the communicator's queue, and the
# oldest's MismatchError belongs to its own Wait -- it once surfaced in a new call, which then was never posted
# while its sequence number was used up, and every later call of the ranks fell out of step
# (larger than the inline limit: an inline call can wait for the others' progress already when it starts; and
# the last rank starts late, so that the others fill the window before the mismatch is known)
import time  # noqa: E402
wc = ddl.Communicator(WORLD, stall_timeout=5)
window = wc._engine.tags.window
above = comm.inline_bytes // 8 + 4096     # float64 elements: above the inline limit
vals = [np.full(above + (i == 0 and r == last), r + 1.0) for i in range(window + 2)]
reqs = []
if r == last:
    time.sleep(0.5)
for i, v in enumerate(vals):
    try:
        reqs.append(wc.Iallreduce(ddl.IN_PLACE, v))
    except Exception as exc:
        chk.fail(f"starting call {i} of {len(vals)} (window {window}) raised {type(exc).__name__}: {exc}")
expect(ddl.MismatchError, reqs[0].Wait, f"rank {last} called Allreduce with {above + 1} float64", f"with {above} float64",
       label="a mismatch in the oldest of a full window of calls")
for i, q in enumerate(reqs[1:], 1):
    q.Wait()
    chk.ok(np.all(vals[i] == p * (p + 1) / 2), f"call {i} behind a mismatched one in a full window: {vals[i]}")
wc.Free()

comm = ddl.Communicator(WORLD, stall_timeout=60)
still_works("fresh communicator")

# ---- settings mismatch at construction ------------------------------------------------------------------
topo = two_host_topology(p) if r == 0 else None
expect(ddl.MismatchError, lambda: ddl.Communicator(WORLD, topology=topo), "rank 0 uses topology 'two-host",
       "topology 'flat", label="topology mismatch")
if comm.agreement == "shared-memory":   # the inline limit (env) must agree too: else a hang, not an error
    os.environ["DDL_INLINE_BYTES"] = "0" if r == 0 else "1024"
    expect(ddl.MismatchError, lambda: ddl.Communicator(WORLD), "rank 0 uses", "inline allreduce up to 0 bytes",
           "up to 1024 bytes", label="inline limit mismatch")
    os.environ["DDL_INLINE_BYTES"] = str(comm.inline_bytes + 1)
    expect(ddl.Error, lambda: ddl.Communicator(WORLD), "DDL_INLINE_BYTES must be between 0 and",
           label="inline limit above the board's")
    del os.environ["DDL_INLINE_BYTES"]

# ---- local argument errors (raised before any communication) -----------------------------------------
big = "topologies/fat-tree-4x4-r4.yaml" if p != 16 else "topologies/emulated-2rack.yaml"
expect(ddl.Error, lambda: ddl.Communicator(WORLD, topology=big), "has 16 ranks" if p != 16 else "has 8 ranks",
       f"communicator has {p} ranks", label="rank count")
x = np.arange(20, dtype=np.float32)
expect(ddl.Error, lambda: comm.Allreduce(x[::2], np.empty(10, np.float32)), "contiguous", label="strided sendbuf")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones((4, 4))[:, :2]), "contiguous", label="strided recvbuf")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4, np.int32), op=ddl.AVG), "AVG", "int32",
       label="AVG on ints")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4), op=ddl.BXOR), "BXOR", "float64",
       label="BXOR on floats")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4, bool), op=ddl.SUM), "bool", label="SUM on bool")
ro = np.ones(4)
ro.flags.writeable = False
expect(ddl.Error, lambda: comm.Allreduce(np.ones(4), ro), "read-only", label="read-only recvbuf")
# repeated calls with the same arrays take a shortcut; what can change between calls is checked again
a, o = np.ones(4), np.zeros(4)
comm.Allreduce(a, o)
o.flags.writeable = False
expect(ddl.Error, lambda: comm.Allreduce(a, o), "read-only", label="recvbuf made read-only between calls")
o.flags.writeable = True
for arr in (a, o):                   # moving them would leave the first call's views stale: refused
    expect(ValueError, lambda: arr.resize(1000, refcheck=False), "cannot resize",
           label="resizing an array a call has cached")
a[:] = r + 1
comm.Allreduce(a, o)
chk.ok(np.all(o == p * (p + 1) / 2), f"Allreduce after its arrays were refused a resize: {o[:3]}")
a2, o2 = np.resize(a, 1000), np.resize(o, 1000)   # np.resize: new arrays, new memory
comm.Allreduce(a2, o2)
chk.ok(np.all(o2 == p * (p + 1) / 2) and o2.size == 1000, f"Allreduce of np.resize's copies: {o2[:3]}")
expect(ddl.Error, lambda: comm.Allreduce(np.ones(4), np.empty(5)), "4 elements", "5", label="size mismatch")
expect(ddl.Error, lambda: comm.Allreduce(np.ones(4), np.empty(4, np.float32)), "float64", "float32",
       label="dtype differs")
expect(ddl.Error, lambda: comm.Reduce_scatter_block(np.ones(3 * p + 1), np.empty(3)), f"{p * 3}",
       label="reduce_scatter sizes")
expect(ddl.Error, lambda: comm.Allgather(np.ones(3), np.empty(3 * p + 1)), "size*n", label="allgather sizes")
expect(ddl.Error, lambda: comm.Bcast(np.ones(3), root=p), f"root {p}", label="bcast root")
expect(ddl.Error, lambda: comm.Bcast(np.ones(3), root=1.7), "integer rank", "1.7", label="bcast root 1.7")
expect(ddl.Error, lambda: comm.Ibcast(np.ones(3), root=None), "integer rank", "None", label="bcast root None")
expect(ddl.Error, lambda: comm.Bcast(np.ones(3), root=True), "integer rank", "True", label="bcast root True")
expect(ddl.Error, lambda: comm.Allreduce(np.ones(2), ddl.IN_PLACE), "recvbuf cannot be IN_PLACE: IN_PLACE goes in "
       "sendbuf", label="IN_PLACE as recvbuf")
expect(ddl.Error, lambda: comm.Bcast(ddl.IN_PLACE), "buf cannot be IN_PLACE", label="IN_PLACE to Bcast")
# mpi4py's sentinel alike (it has a buffer interface of no bytes, which ddl once took for an empty buffer)
expect(ddl.Error, lambda: comm.Bcast(MPI.IN_PLACE), "buf cannot be IN_PLACE", label="MPI.IN_PLACE to Bcast")
expect(ddl.Error, lambda: comm.Allreduce(MPI.IN_PLACE, MPI.IN_PLACE), "recvbuf cannot be IN_PLACE",
       label="MPI.IN_PLACE as recvbuf")
expect(ddl.Error, lambda: comm.Allgather(np.ones(2), MPI.IN_PLACE), "recvbuf cannot be IN_PLACE",
       label="MPI.IN_PLACE as Allgather's recvbuf")
# Bcast's root only reads its buffer: read-only there is fine, elsewhere refused
ro_root = np.full(5, 7.0) if r == last else np.zeros(5)
ro_root.flags.writeable = r != last
comm.Bcast(ro_root, root=last)
chk.ok(np.all(ro_root == 7.0), f"Bcast from a read-only buffer at the root: {ro_root}")
ro_leaf = np.full(5, 7.0) if r == 0 else np.zeros(5)
ro_leaf.flags.writeable = r == 0 or r != last
if p > 1:
    expect(ddl.Error, lambda: comm.Bcast(ro_leaf, root=0), "buf is read-only" if r == last else f"rank {last}",
           label="Bcast into a read-only buffer")
root_np = np.ones(3) * r
comm.Bcast(root_np, root=np.int64(last))          # numpy's integers are ranks
chk.ok(np.all(root_np == last), f"Bcast from np.int64({last}): {root_np}")
comm.Bcast(b := np.full(2, r, np.int32), root=np.int64(last))
chk.ok(np.all(b == last), "Bcast with a numpy integer root")
for bad in (-5, 0, float("nan"), "soon"):
    expect(ddl.Error, lambda: ddl.Communicator(WORLD, stall_timeout=bad), "stall_timeout must be a positive number",
           repr(bad), label=f"stall_timeout={bad!r}")
os.environ["DDL_STALL_WARNING"] = "-5"
expect(ddl.Error, lambda: ddl.Communicator(WORLD), "stall_warning must be", "env DDL_STALL_WARNING",
       label="DDL_STALL_WARNING=-5")
del os.environ["DDL_STALL_WARNING"]
expect(ddl.Error, lambda: setattr(comm, "stall_warning", 0), "stall_warning must be", label="stall_warning = 0")
comm.stall_warning = float("inf")              # never warn: allowed
chk.ok(comm.stall_warning == float("inf") and comm.stall_timeout == 60, "stall settings kept")
comm.stall_warning = 60
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, [1.0, 2.0]), "list", label="list buffer")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4), op="median"), "median", label="unknown op")
buf = np.arange(10.0)
expect(ddl.Error, lambda: comm.Allreduce(buf[:6], buf[4:]), "overlap", label="overlapping buffers")
still_works("local errors")

# ---- an argument error on ONE rank: it raises its own error, the others MismatchError at once (not a
# StallError once stall_timeout has passed), and the communicator stays usable -------------------------
def one_rank_refuses(label, odd, call_ok, call_bad, own_words, collective="Allreduce"):
    if r == odd:
        text = expect(ddl.Error, call_bad, *own_words, label=f"{label} (the refusing rank)")
        chk.ok(text is not None and not text.startswith("ranks disagree"), f"{label}: the refusing rank got {text}")
    else:
        expect(ddl.MismatchError, call_ok, f"rank {odd} called {collective} with arguments it refused",
               label=f"{label} (the others)")
    still_works(label)


ro = np.ones(4)
ro.flags.writeable = False
one_rank_refuses("read-only recvbuf on one rank", last, lambda: comm.Allreduce(np.ones(4), np.empty(4)),
                 lambda: comm.Allreduce(np.ones(4), ro), ["read-only"])
big_ro = np.ones(1 << 18)              # above the inline limit
big_ro.flags.writeable = False
one_rank_refuses("read-only large recvbuf on one rank", 0, lambda: comm.Iallreduce(np.ones(1 << 18), np.empty(1 << 18)).Wait(),
                 lambda: comm.Iallreduce(np.ones(1 << 18), big_ro), ["read-only"])
# a masked array reached the board and the executor, whose reshapes it refused with numpy's own error after the
# call had taken its number: the others waited until stall_timeout, and the communicator was lost
one_rank_refuses("masked array on one rank", 0, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(3)),
                 lambda: comm.Allreduce(ddl.IN_PLACE, np.ma.array(np.ones(3), mask=[0, 1, 0])), ["masked array", ".filled"])
mat = np.asmatrix(np.full((2, 3), r + 1.0))      # other ndarray subclasses are their plain arrays
comm.Allreduce(ddl.IN_PLACE, mat)
chk.ok(np.all(np.asarray(mat) == p * (p + 1) / 2), f"Allreduce of an np.matrix: {mat}")
one_rank_refuses("AVG on ints on one rank", 0, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4), op=ddl.AVG),
                 lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(4, np.int32), op=ddl.AVG), ["AVG", "int32"])
one_rank_refuses("bad root on one rank", last, lambda: comm.Bcast(np.ones(3), root=0),
                 lambda: comm.Bcast(np.ones(3), root=p), [f"root {p}"], collective="Bcast")
one_rank_refuses("allgather sizes on one rank", last, lambda: comm.Allgather(np.ones(3), np.empty(3 * p)),
                 lambda: comm.Allgather(np.ones(3), np.empty(3 * p + 1)), ["size*n"], collective="Allgather")
# numpy's own errors on an argument are refusals too: a ragged list in the functional API, and the next
# call of every rank still meets the others' (it once returned a sum of mismatched calls)
one_rank_refuses("ragged list on one rank", 1 % p, lambda: comm.allreduce([1.0, 2.0]),
                 lambda: comm.allreduce([[1.0, 2.0], [3.0]]), ["inhomogeneous"])
chk.ok(np.array_equal(comm.allreduce(np.full(2, r + 1.0)), np.full(2, p * (p + 1) / 2)), "allreduce after a refusal")
one_rank_refuses("grouped_allreduce of a ragged list on one rank", last, lambda: comm.grouped_allreduce([np.ones(2)]),
                 lambda: comm.grouped_allreduce([[[1.0], [2.0, 3.0]]]), ["inhomogeneous"], collective="grouped_allreduce")
# grouped calls run one collective per dtype: ranks that pass different dtypes or shapes must all raise, and
# start none of them (a collective started on one rank only once paired with the next call: wrong sums)
for label, mine, says in (
        ("a dtype more on one rank", [np.ones(3), np.ones(2, np.float32)], ["number of dtypes"]),
        ("array sizes that differ on one rank, same total", [np.ones(2), np.ones(3)],
         ["the arrays' dtypes or shapes, in order (the same totals"])):
    arrays = mine if r == last else [np.ones(3), np.ones(2)]
    own = "float64[2], float64[3]" if mine[1].dtype == np.float64 and r == last else \
        "float64[3], float32[2]" if r == last else "float64[3], float64[2]"
    expect(ddl.MismatchError, lambda: comm.grouped_allreduce(arrays), "grouped_allreduce of 2 arrays, 5 elements in",
           *says, f"this rank (rank {r}) passed 2 arrays: {own}", label=f"grouped_allreduce with {label}")
    still_works(f"grouped_allreduce with {label}")
    req = comm.Iallreduce(ddl.IN_PLACE, np.full(2, r + 1.0))      # an in-flight call does not confuse the next
    out = comm.grouped_allreduce([np.full(3, r + 1.0), np.full(2, r + 1, np.int32)])
    req.Wait()
    chk.ok(np.all(out[0] == p * (p + 1) / 2) and np.all(out[1] == p * (p + 1) // 2) and out[1].dtype == np.int32,
           f"grouped_allreduce after {label}: {out}")
expect(ddl.MismatchError, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(5)) if r == last else comm.grouped_allreduce(
    [np.ones(3), np.ones(2)]), f"rank {last} called Allreduce with 5 float64", "called grouped_allreduce of 2 arrays",
    label="a grouped call against a plain one")
still_works("a grouped call against a plain one")
# the functional allreduce compares shapes (as Horovod does): a transposed array on one rank, a scalar against a
# one-element array, the functional call against the buffer API's; blocking and not, the request waited twice
for label, mine, theirs, says in (
        ("a transposed array", np.ones((3, 2)), np.ones((2, 3)), "called allreduce of float64[2, 3] (SUM)"),
        ("a scalar against an array of one", np.ones(1), 2.0, "called allreduce of float64 scalar (SUM)")):
    shown = "float64[3, 2]" if mine.ndim == 2 else "float64[1]"
    expect(ddl.MismatchError, lambda: comm.allreduce(mine if r == last else theirs),
           f"rank {last} called allreduce of {shown} (SUM)", says, "[differs in: array shape]",
           label=f"allreduce of {label}")
    still_works(f"allreduce of {label}")
# a shape that a signature word cannot hold (4 dimensions) is tagged, and each rank says its own
mine = np.ones((1, 2, 3, 1)) if r == last else np.ones((2, 1, 3, 1))
expect(ddl.MismatchError, lambda: comm.allreduce(mine), "called allreduce of float64, shape #", "[differs in: array shape]",
       f"this rank (rank {r}) passed float64[{', '.join(map(str, mine.shape))}]", label="allreduce of 4-d arrays")
req = comm.iallreduce(np.ones(6) if r == 0 else np.ones((2, 3)))
first = expect(ddl.MismatchError, req.wait, "rank 0 called allreduce of float64[6] (SUM)", "[differs in: array shape]",
               label="iallreduce of another shape on rank 0")
chk.ok(expect(ddl.MismatchError, req.wait, label="iallreduce waited again") == first, "the second wait says it again")
expect(ddl.MismatchError, lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(6)) if r == 0 else comm.allreduce(np.ones(6)),
       "rank 0 called Allreduce with 6 float64", "called allreduce of float64[6]", "against the buffer API's Allreduce",
       label="the functional call against the buffer API's")
chk.ok(np.array_equal(comm.allreduce(np.full((2, 3), r + 1.0)), np.full((2, 3), p * (p + 1) / 2)),
       "allreduce of one shape everywhere, after the mismatches")
# grouped results are of the kind given, as allreduce's: a Python scalar for a Python one (it gave 0-d arrays)
outs = comm.grouped_allreduce([np.ones(2), 5, np.float32(1.5), [1, 2]])
chk.ok(type(outs[0]) is np.ndarray and type(outs[1]) is int and outs[1] == 5 * p and type(outs[2]) is np.float32
       and type(outs[3]) is np.ndarray and outs[3].tolist() == [p, 2 * p], f"grouped results' kinds: {outs!r}")
chk.ok(type(comm.allreduce(5)) is int and type(comm.iallreduce(np.float32(1)).wait()) is np.float32,
       "allreduce of scalars gives scalars of their kind")
# Waitall waits for every request before it raises the first error (it left the ones after a failure pending)
parts = [np.full(3, r + 1.0), np.ones(4 if r != last else 5), np.full(3, r + 1.0)]
reqs = [comm.Iallreduce(ddl.IN_PLACE, a) for a in parts]
expect(ddl.MismatchError, lambda: ddl.Request.Waitall(reqs), f"rank {last} called Allreduce with 5 float64",
       label="Waitall with a mismatch in the middle")
chk.ok(all(q.done for q in reqs) and np.all(parts[2] == p * (p + 1) / 2), "Waitall completed every request")
still_works("Waitall with a mismatch in the middle")
# one buffer in two calls in flight (MPI forbids it; it gave garbage): refused, and every rank raises (those
# whose first call had already completed learn of the refusal through the agreement)
# (a first call that had already finished on every rank leaves the buffer free: then both run, in turn)
for n in (4, 1 << 18):                 # inline, and above the inline limit (1 MiB at most)
    shared = np.full(n, r + 1.0)
    first = comm.Iallreduce(ddl.IN_PLACE, shared)
    try:
        comm.Iallreduce(ddl.IN_PLACE, shared).Wait()
        refused = False
    except ddl.Error:
        refused = True
    first.Wait()
    outcomes = WORLD.allgather(refused)
    chk.ok(len(set(outcomes)) == 1, f"a buffer in two calls in flight, {n}: refused on some ranks only: {outcomes}")
    total = p * (p + 1) / 2
    chk.ok(np.all(shared == (total if refused else p * total)), f"a buffer in two calls in flight, {n}: {shared[:3]}")
    shared[:] = total
    halves = [comm.Iallreduce(ddl.IN_PLACE, part) for part in (shared[: n // 2], shared[n // 2:])]   # disjoint: fine
    for req in halves:
        req.Wait()
    chk.ok(np.all(shared == p * p * (p + 1) / 2), f"disjoint halves of one buffer in flight at once, {n}")
    still_works(f"a buffer in two calls in flight, {n}")
# ... and the same on two communicators: each has its own engine, but the memory is one (it gave mixed sums)
other = ddl.Communicator(WORLD, stall_timeout=60)
shared = np.full(1 << 18, r + 1.0)
first = comm.Iallreduce(ddl.IN_PLACE, shared)        # large: in flight until waited for, on every rank
expect(ddl.Error, lambda: other.Iallreduce(ddl.IN_PLACE, shared), "recvbuf shares memory with a buffer of Allreduce",
       "on another ddl.Communicator", "still in flight", label="a buffer in flight on another communicator")
first.Wait()
chk.ok(np.all(shared == p * (p + 1) / 2), f"a buffer in flight on another communicator: {shared[:3]}")
other.Free()
still_works("a buffer in flight on another communicator")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, [np.ones(4), "abc", "d"]), "count must be an integer", "'abc'",
       label="a count that is a string")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, [np.ones(4), 2.7, "d"]), "count must be an integer", "2.7",
       label="a count that is a float")
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, [np.ones(4), (2, 1.5), "d"]), "displacement must be an integer",
       label="a displacement that is a float")

# the functional API is element-wise whatever the memory order of each rank's array
fa = np.arange(6.0).reshape(2, 3)
fa = np.asfortranarray(fa) if r == 0 else fa
res = comm.allreduce(fa)
chk.ok(np.array_equal(res, p * np.arange(6.0).reshape(2, 3)), f"allreduce of a Fortran-ordered array on rank 0: {res}")
chk.ok(repr(comm.grouped_iallreduce([])).startswith("<ddl.Request grouped_allreduce of 0"), "repr of an empty group")
chk.ok(comm.plan("64KiB").nranks == p and comm.explain("64KiB").nbytes == 65536, "plan / explain of a size string")
expect(ddl.Error, lambda: comm.plan(-5), "non-negative", label="plan of a negative size")
# a collective named as its method is (Bcast, Reduce_scatter_block), in any case, plans as the planner's name does
chk.ok(comm.plan("64KiB", "Bcast", root=last) == comm.plan("64KiB", "broadcast", root=last)
       and comm.explain("64KiB", "REDUCE_SCATTER_BLOCK").collective == "reduce_scatter", "plan of a method's name")
expect(ddl.Error, lambda: comm.plan("64KiB", "alltoall"), "collective must be one of allreduce, reduce_scatter",
       "'alltoall'", label="plan of an unknown collective")
expect(ddl.Error, lambda: comm.explain("a lot"), "cannot parse size", label="explain of an unreadable size")
report = comm.explain(np.ones(1 << 14, np.float32))          # a buffer, as comm.plan takes one
chk.ok(report.nbytes == 65536 and report.schedule == comm.plan("64KiB"), "explain of a buffer")
text = str(report)
chk.ok(text.startswith(f"allreduce of 64 KiB: {report.algorithm} (verified: ") and "\nwhy        " in text
       and f"gap {report.gap:.3f}x" in text and "Plan(" not in text, f"explain prints a report: {text!r}")

# one rank reduces nothing, yet a logical op still gives 1 or 0, on the host and the device path
from ddl.gpu.executor import HostRuntime, NcclExecutor  # noqa: E402
sys.path.insert(0, os.path.dirname(__file__))
from _host_array import HostArray  # noqa: E402
solo = ddl.Communicator(MPI.COMM_SELF)
dev = NcclExecutor(solo, runtime=HostRuntime(), path="cuda-aware-mpi")
for op, want in ((ddl.LAND, [1, 0, 1]), (ddl.LOR, [1, 0, 1]), (ddl.LXOR, [1, 0, 1])):
    chk.ok(solo.allreduce(np.array([5, 0, -7]), op=op).tolist() == want, f"{op} on one rank")
    out = np.empty(3, np.int64)
    dev.Allreduce(HostArray(np.array([5, 0, -7])), HostArray(out), op=op)
    chk.ok(out.tolist() == want, f"{op} on one rank, device path: {out}")
    rs = np.array([3, 0, 9])
    solo.Reduce_scatter_block(ddl.IN_PLACE, rs, op=op)
    chk.ok(rs.tolist() == want, f"{op} reduce-scatter in place on one rank: {rs}")
dev.Free()
solo.Free()

# ---- planners other than ddl's own: their schedules are proven before they run ---------------------------
from ddl.planner import Planner, flat_topology  # noqa: E402
from ddl.schedule import Schedule  # noqa: E402


def broken(collective, nbytes, root=0):
    """A ring allreduce whose first reduction became a plain receive: one contribution is lost."""
    d = Planner(flat_topology(p), use_disk_cache=False).schedule(collective, nbytes, "ring", root).to_dict()
    for prog in d["programs"]:
        for op in prog:
            if op[0] == "reduce":
                op[0] = "recv"
                break
        else:
            continue
        break
    return Schedule.from_dict(d)


class Foreign:
    def schedule(self, collective, nbytes, algorithm="auto", root=0):
        return broken(collective, nbytes, root)


class Subclass(Planner):           # a subclass of ddl's planner is foreign too
    def schedule(self, collective, nbytes, algorithm="auto", root=0):
        return broken(collective, nbytes, root)


for planner in (Foreign(), Subclass(flat_topology(p), use_disk_cache=False)):
    c = ddl.Communicator(WORLD, planner=planner, stall_timeout=60)
    expect(ddl.ScheduleError, lambda: c.Allreduce(ddl.IN_PLACE, np.ones(1 << 16)), "lacks the contribution",
           label=f"broken schedule from a {type(planner).__name__} planner")

# a schedule saved (and perhaps edited by hand) runs at every size once pinned; a wrong one fails at the pin
import tempfile  # noqa: E402
saved = os.path.join(tempfile.gettempdir(), f"ddl-pinned-ring-{os.getpid()}.json")
Planner(flat_topology(p), use_disk_cache=False).schedule("allreduce", 1 << 20, "ring").save(saved)
c = ddl.Communicator(WORLD, stall_timeout=60)
chk.ok(c.planner.pin(saved).algorithm == "ring", "pin returns the schedule")
for n in (3, 1 << 12, 1 << 18):      # sizes beyond the inline limit run the schedule
    chk.ok(c.plan(n * 8).algorithm == "ring", f"the pinned schedule at {n * 8} bytes")
    v = np.full(n, r + 1.0)
    c.Allreduce(ddl.IN_PLACE, v)
    chk.ok(np.all(v == p * (p + 1) / 2), f"Allreduce with a pinned schedule, {n} elements")
inline_sized = [entry for key, entry in c._plans.items() if isinstance(entry, tuple) and key[1] == 3]
chk.ok(len(inline_sized) == 1 and inline_sized[0][4] == 0 and c._inline["allreduce"] == comm.inline_bytes,
       "a pinned schedule runs at inline sizes too (its plan has no inline limit, the communicator has one)")
solo = ddl.Communicator(MPI.COMM_SELF)             # one rank: no topology, but a planner all the same
chk.ok(solo.explain(1024).nbytes == 1024, "explain on a one-rank communicator")
expect(ddl.PlanError, lambda: solo.planner.pin(saved), f"the schedule is for {p} ranks",
       label="pinning another rank count's schedule on one rank")
solo.Free()
late = ddl.Communicator(WORLD, stall_timeout=60)   # pinned after a call of that size: the pin runs from then on
v = np.full(1 << 18, r + 1.0)
late.Allreduce(ddl.IN_PLACE, v)
before = next(entry[0].schedule for entry in late._plans.values())
late.planner.pin(saved)
late.Allreduce(ddl.IN_PLACE, v)
ran = [entry[0].schedule for entry in late._plans.values()]
chk.ok(len(ran) == 1 and ran[0] is late.planner.pinned("allreduce") and ran[0] is not before
       and np.all(v == p * p * (p + 1) / 2),
       "a schedule pinned after the first call of a size runs from the next call on")
late.Free()
odd = ddl.Communicator(WORLD, stall_timeout=60)    # ranks that pin different schedules: caught, not run
odd.planner.pin(saved if r == 0 else Planner(flat_topology(p), use_disk_cache=False).schedule(
    "allreduce", 1 << 20, "recursive-doubling"))
expect(ddl.MismatchError, lambda: odd.Allreduce(ddl.IN_PLACE, np.ones(1 << 18)), "differs in: schedule",
       label="a schedule pinned on one rank only")
odd.Free()
broken("allreduce", 1 << 20).save(saved)
expect(ddl.ScheduleError, lambda: c.planner.pin(saved), "lacks the contribution", label="pinning a wrong schedule")
os.unlink(saved)
c.Free()

# ---- floating-point exceptions: never trapped nor warned about, as in MPI -----------------------------------
# (under np.seterr(over="raise") an overflow raised halfway through a collective on some ranks and left the
# others waiting; with numpy's defaults it printed RuntimeWarnings pointing into ddl)
import warnings  # noqa: E402
for n in (10, comm.inline_bytes // 2 + 4096):   # inline (on the agreement board, one node), the schedule
    for settings in ({"all": "raise"}, {}):
        v = np.ones(n, np.float16)
        v[0] = 60000.0
        avg = np.full(n, 1e-7, np.float16)
        try:
            with np.errstate(**settings), warnings.catch_warnings():
                warnings.simplefilter("error")
                comm.Allreduce(ddl.IN_PLACE, v)
                comm.Iallreduce(ddl.IN_PLACE, avg, op=ddl.AVG).Wait()
        except Exception as exc:
            chk.fail(f"an overflow in a float16 Allreduce of {n} under np.errstate({settings}): "
                     f"{type(exc).__name__}: {exc}")
        chk.ok(np.isinf(v[0]) and np.all(v[1:] == p), f"float16 overflow, {n}: {v[:3]}")
        chk.same_everywhere(f"float16 AVG of subnormals, {n}", avg)
still_works("floating-point exceptions")

# ---- what a call leaves behind: the last call's views at most, never every array ever passed ------------------
import gc  # noqa: E402
import weakref  # noqa: E402
refs = []
for i in range(12):
    n = above + i        # a plan per size, above the inline limit and within the view cache's
    s_, o_ = np.full(n, r + 1.0), np.empty(n)
    comm.Allreduce([s_, n], [o_, n])     # (a list spec: Allreduce's argument cache keeps no reference)
    chk.ok(np.all(o_ == p * (p + 1) / 2), f"Allreduce of {n}")
    refs += [weakref.ref(s_), weakref.ref(o_)]
    del s_, o_
gc.collect()
alive = sum(ref() is not None for ref in refs)
chk.ok(alive <= 2, f"{alive} of the {len(refs)} arrays passed to 12 Allreduce calls of different sizes are still "
                   f"alive after the calls returned and the caller dropped them (the last call's two at most)")

# ---- buffer spec forms -------------------------------------------------------------------------------
a = np.arange(8, dtype=np.float32) + r
out = np.zeros(8, np.float32)
comm.Allreduce([a, 5], [out, 5])
chk.ok(np.array_equal(out[:5], (np.arange(5) * p + sum(range(p)))) and np.all(out[5:] == 0), "[buf, count]")
out = np.zeros(8, np.float32)
comm.Allreduce([a, MPI.FLOAT], [out, MPI.FLOAT])
chk.ok(np.array_equal(out, np.arange(8) * p + sum(range(p))), "[buf, MPI.FLOAT]")
raw = bytearray(np.full(4, r, np.int32).tobytes())
res = bytearray(16)
comm.Allreduce([raw, 4, "i"], [res, 4, "i"], op=ddl.MAX)
chk.ok(np.array_equal(np.frombuffer(res, np.int32), np.full(4, last)), "[bytearray, count, 'i']")
arr = array.array("d", [float(r)] * 3)
comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
chk.ok(list(arr) == [float(sum(range(p)))] * 3, f"array.array with MPI.IN_PLACE / MPI.SUM: {arr}")
mv = memoryview(np.full(6, 2, np.int16))
comm.Allreduce(ddl.IN_PLACE, mv, op=ddl.PROD)
chk.ok(np.all(np.asarray(mv) == 2 ** p), "memoryview")
d = np.full(4, r, np.float64)
outd = np.empty(4)
comm.Allreduce([d, np.dtype(np.float64)], [outd, "d"], op="max")
chk.ok(np.all(outd == last), "numpy dtype / char code / string op")
# a buffer format numpy cannot read (ctypes' long double is '<g'): a reduction refuses it on every rank (it
# summed raw bytes), unless the spec names the dtype; a collective that only moves bytes takes it as it is
import ctypes  # noqa: E402
ld = (ctypes.c_longdouble * 2)(1.5, 2.5)
expect(ddl.Error, lambda: comm.Allreduce(ddl.IN_PLACE, ld), "buffer format '<g'", "cannot reduce it", "[buf, dtype]",
       label="Allreduce of a ctypes long double array")
comm.Allreduce(ddl.IN_PLACE, [ld, np.longdouble])
chk.ok(list(ld) == [1.5 * p, 2.5 * p], f"Allreduce of [ctypes long double array, numpy.longdouble]: {list(ld)}")
ld = (ctypes.c_longdouble * 3)(r, r + 0.5, r)
comm.Bcast([ld, 2], root=last)                  # the count counts its items, not bytes
chk.ok(list(ld) == [last, last + 0.5, r], f"Bcast of 2 items of a ctypes long double array: {list(ld)}")
ptrs = (ctypes.c_void_p * p)()
comm.Allgather((ctypes.c_void_p * 1)(r + 7), ptrs)
chk.ok(list(ptrs) == [q + 7 for q in range(p)], f"Allgather of ctypes pointers: {list(ptrs)}")
bytes_in = np.full(8, r, np.uint8)
bo = np.empty(8 * p, np.uint8)
comm.Allgather([bytes_in, MPI.BYTE], [bo, MPI.BYTE])
chk.ok(np.array_equal(bo, np.repeat(np.arange(p, dtype=np.uint8), 8)), "MPI.BYTE allgather")

# ---- check modes ------------------------------------------------------------------------------------
for mode in ("new", "off"):
    c3 = ddl.Communicator(WORLD, check=mode, stall_timeout=5)
    for i in range(3):  # "new": the first call of a signature is checked, the repeats are not
        v = np.full(5, r + i, np.int32)
        c3.Allreduce(ddl.IN_PLACE, v)
        chk.ok(np.all(v == sum(range(p)) + p * i), f"check={mode} call {i}")
    if mode == "new":   # a never-seen signature is checked: a mismatch is still caught on every rank
        n_bad = 9 if r == 0 else 10
        expect(ddl.MismatchError, lambda: c3.Allreduce(ddl.IN_PLACE, np.ones(n_bad, np.int16)),
               "rank 0 called Allreduce with 9 int16", label="check=new mismatch")
        v = np.ones(5, np.int32)
        c3.Allreduce(ddl.IN_PLACE, v)
        chk.ok(np.all(v == p), "check=new after a mismatch")
        # the corrected call: the ranks whose call had been right have "seen" it, but their call failed too,
        # so it is checked on every rank (it once was only on rank 0, which then waited in a check alone)
        v = np.ones(10, np.int16)
        try:
            c3.Allreduce(ddl.IN_PLACE, v)
        except ddl.Error as exc:
            chk.fail(f"check=new: retrying the corrected call after a mismatch raised {type(exc).__name__}: {exc}")
        chk.ok(np.all(v == p), f"check=new: the corrected call after a mismatch: {v}")
    c3.Free()
    # An argument error on one rank is not announced in these modes, but it uses up the call's number:
    # the others' call fails, and so does the refusing rank's next (the others' call took that one for
    # its partner, and returned a sum of two different calls without a word).
    c4 = ddl.Communicator(WORLD, check=mode, stall_timeout=1.5)
    c4.Allreduce(ddl.IN_PLACE, np.ones(7))                 # "new": a seen signature, unchecked from here on
    if r == last:
        try:
            c4.Allreduce(ddl.IN_PLACE, np.ones(14)[::2])
            chk.fail(f"check={mode}: a non-contiguous recvbuf was taken")
        except ddl.Error as exc:
            notes = " ".join(getattr(exc, "__notes__", []))
            chk.ok("not contiguous" in str(exc) and "the other ranks were not told" in notes,
                   f"check={mode}: the refusing rank's error: {exc} {notes}")
    try:
        c4.Allreduce(ddl.IN_PLACE, np.ones(7))             # the others' call #1, the refusing rank's #2
        chk.fail(f"check={mode}: the call after a refusal on rank {last} returned without an error")
    except (ddl.StallError, ddl.MismatchError):
        pass
    except Exception as exc:
        chk.fail(f"check={mode}: the call after a refusal on rank {last}: {type(exc).__name__}: {exc}")
    c4.Free()
expect(ddl.Error, lambda: ddl.Communicator(WORLD, check="sometimes"), "check must be one of", label="bad check")
# a misspelt algorithm fails where the communicator is made (it was taken, and every call then failed)
for spelt in ("rign", {"allreduce": "hierarchical", "broadcast": "tree"}):
    expect(ddl.Error, lambda: ddl.Communicator(WORLD, algorithm=spelt), "unknown algorithm", "choose one of: auto, ring",
           label=f"algorithm={spelt!r}")
os.environ["DDL_CHECK"] = "bogus"
expect(ddl.Error, lambda: ddl.Communicator(WORLD), "environment variable DDL_CHECK must be one of always, new, off, "
       "got 'bogus'", label="bad DDL_CHECK")
for word in ("OFF", " New "):           # words in any case, spaces around them ignored
    os.environ["DDL_CHECK"] = word
    cw = ddl.Communicator(WORLD)
    chk.ok(cw.check == word.strip().lower(), f"DDL_CHECK={word!r}: check {cw.check!r}")
    cw.Free()
os.environ["DDL_OVERSUBSCRIBED"] = "maybe"
del os.environ["DDL_CHECK"]
expect(ddl.Error, lambda: ddl.Communicator(WORLD), "DDL_OVERSUBSCRIBED='maybe' is neither on", label="bad DDL_OVERSUBSCRIBED")
del os.environ["DDL_OVERSUBSCRIBED"]
# settings that only some nodes or jobs use are read on every one: a typo fails wherever the job runs
for name, value, says in (("DDL_TIMERSLACK", "x", "is neither on"), ("DDL_SPIN", "-3", "must be at least 0"),
                          ("DDL_IDLE_NAP", "-1", "must be at least 0"), ("DDL_GPU_PATH", "x", "must be auto, nccl"),
                          ("DDL_GPU_VERBOSE", "x", "is neither on"), ("DDL_CUDA_AWARE_MPI", "x", "is neither on"),
                          ("DDL_LARGE_MESSAGE", "-5", "must be at least 0"), ("DDL_EARLY_LIMIT", "1e5x", "not a number"),
                          ("DDL_INLINE_BYTES", "1.5", "must be a whole number"), ("DDL_AGREEMENT", "both", "must be one of")):
    os.environ.update({name: value, "DDL_OVERSUBSCRIBED": "0"})
    expect(ddl.Error, lambda: ddl.Communicator(WORLD), name, says, label=f"bad {name}, on a node not oversubscribed")
    del os.environ[name], os.environ["DDL_OVERSUBSCRIBED"]

# ---- threads ----------------------------------------------------------------------------------------------
# One thread at a time inside ddl: a second that calls in meanwhile is refused at once (two inside together
# returned wrong sums, different on each rank). Here a helper thread of every rank but the last sits in a
# Barrier that the last rank joins only after the others' main threads have tried to call in.
import threading  # noqa: E402
import time  # noqa: E402

chk.ok(MPI.Query_thread() == MPI.THREAD_MULTIPLE, "mpi4py initialised MPI with THREAD_MULTIPLE")
other = ddl.Communicator(WORLD)
pending = other.Iallreduce(np.ones(2), np.empty(2))
if r != last:
    inside = threading.Thread(target=comm.Barrier, name="helper")
    inside.start()
    time.sleep(0.3)
    for label, call in (("Allreduce on the same communicator", lambda: comm.Allreduce(ddl.IN_PLACE, np.ones(2))),
                        ("Bcast on another communicator", lambda: other.Bcast(np.ones(2))),
                        ("Test of a request of another communicator", pending.Test),
                        ("allreduce", lambda: comm.allreduce(np.ones(2)))):
        expect(ddl.Error, call, "from thread 'MainThread' while another thread is inside ddl",
               "not thread safe", label=f"{label} while a thread is inside ddl")
    chk.ok(inside.is_alive(), "the helper thread was inside ddl all along (its Barrier waits for the last rank)")
    WORLD.Barrier()
    inside.join()
else:
    WORLD.Barrier()
    comm.Barrier()
pending.Wait()
# one after the other, calls from different threads are fine
got = {}
worker = threading.Thread(target=lambda: got.setdefault("sum", comm.allreduce(np.full(3, r + 1.0))))
worker.start()
worker.join()
chk.ok(np.array_equal(got.get("sum"), np.full(3, p * (p + 1) / 2)), f"a call from another thread, alone: {got}")
still_works("refused calls from a second thread")
other.Free()

# ---- lifetime -------------------------------------------------------------------------------------------
with ddl.Communicator(WORLD) as c2:
    z = np.ones(2)
    c2.Allreduce(ddl.IN_PLACE, z)
    chk.ok(np.all(z == p), "context manager")
expect(ddl.Error, lambda: c2.Allreduce(ddl.IN_PLACE, z), "freed", label="use after Free")
comm.Free()
chk.finish("errors")
