"""The quick lane of a repeated small blocking Allreduce (``Communicator._allreduce_quick``): when it is
taken, that its results are the general path's, and that everything it must not pass by sends the call
down the general path instead.

    mpiexec -n N python tests/mpi_cases/quick_lane.py      (N >= 2, one node)
"""
import gc
import os
import sys
import weakref

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import RANK, SIZE, WORLD, Checker  # noqa: E402

import ddl  # noqa: E402
from ddl.trace import CALL, END, MessageTrace  # noqa: E402

chk = Checker()
p, r = SIZE, RANK
comm = ddl.Communicator(WORLD, stall_timeout=60)
chk.ok(comm.agreement == "shared-memory" and comm.inline_bytes > 0, f"needs the board: {comm.agreement}")

general = []                       # every call that took the general path (Communicator._start)


def counted(c):
    """``c``, its calls that take the general path counted in ``general``."""
    start = c._start
    c._start = lambda *args: general.append(args[0]) or start(*args)
    return c


def through(call):
    """``(whether call() took the quick lane -- the general path never started it, its result)``."""
    before = len(general)
    result = call()
    return len(general) == before, result


def taken(call):
    return through(call)[0]


counted(comm)


def values(dtype, count, salt=0, rank=r):
    """A rank's input: values whose sum depends on the order of the additions (for floats)."""
    x = (np.arange(count) * 0.37 + rank * 1.9 + salt) * (10.0 ** (rank % 3 - 1))
    return x.astype(dtype)


def rank_order(dtype, count, op=np.add, salt=0):
    """The result every rank must hold, bit for bit: the ranks' inputs reduced in rank order."""
    rows = [values(dtype, count, salt, q) for q in range(p)]
    out = rows[0].copy()
    for row in rows[1:]:
        op(out, row, out=out)
    return out


# ---- taken from the second call with the same arrays on, with the general path's results ---------
for dtype in (np.float32, np.float64, np.int64):
    a, o = values(dtype, 5), np.empty(5, dtype)
    chk.ok(not taken(lambda: comm.Allreduce(a, o)), f"{dtype.__name__}: the first call took the quick lane")
    first = o.copy()
    lanes = 0
    for salt in range(1, 6):
        a[:] = values(dtype, 5, salt)
        lanes += taken(lambda: comm.Allreduce(a, o))
        chk.ok(np.array_equal(o, rank_order(dtype, 5, salt=salt)),
               f"{dtype.__name__}, call {salt}: {o} is not the rank-order sum")
        chk.same_everywhere(f"{dtype.__name__} quick {salt}", o)
    chk.ok(lanes == 5, f"{dtype.__name__}: {lanes} of 5 repeated calls took the quick lane")
    chk.ok(np.array_equal(first, rank_order(dtype, 5)), f"{dtype.__name__}: the first call's result {first}")

# in place, MAX, and AVG (whose division the lane must do too)
buf = values(np.float64, 3)
comm.Allreduce(ddl.IN_PLACE, buf)
buf[:] = values(np.float64, 3, 7)
chk.ok(taken(lambda: comm.Allreduce(ddl.IN_PLACE, buf)), "in place: the repeated call took the general path")
chk.ok(np.array_equal(buf, rank_order(np.float64, 3, salt=7)), f"in place: {buf}")
a, o = values(np.float32, 4), np.empty(4, np.float32)
for salt in (0, 1):
    a[:] = values(np.float32, 4, salt)
    lane = taken(lambda: comm.Allreduce(a, o, op=ddl.MAX))
    chk.ok(lane == (salt == 1) and np.array_equal(o, rank_order(np.float32, 4, np.maximum, salt)), f"MAX: {o}")
for salt in (0, 1):
    a[:] = values(np.float32, 4, salt)
    lane = taken(lambda: comm.Allreduce(a, o, op=ddl.AVG))
    want = rank_order(np.float32, 4, salt=salt) / np.float32(p)
    chk.ok(lane == (salt == 1) and np.array_equal(o, want), f"AVG (quick lane {lane}): {o}, not {want}")
    chk.same_everywhere(f"AVG {salt}", o)
# float16 AVG divides every input first, into a new array: never the quick lane
h, ho = np.full(4, 2.0, np.float16), np.empty(4, np.float16)
for _ in range(3):
    chk.ok(not taken(lambda: comm.Allreduce(h, ho, op=ddl.AVG)), "float16 AVG took the quick lane")
    chk.ok(np.all(ho == 2.0), f"float16 AVG: {ho}")
# above the inline limit: the schedule, never the lane
n = comm.inline_bytes // 8 + 1
big, bigo = np.full(n, r + 1.0), np.empty(n)
for _ in range(2):
    chk.ok(not taken(lambda: comm.Allreduce(big, bigo)), "a call above the inline limit took the quick lane")
    chk.ok(np.all(bigo == p * (p + 1) / 2), "above the inline limit: wrong sum")

# ---- what sends a repeated call down the general path -------------------------------------------
a, o = np.full(4, r + 1.0), np.empty(4)
comm.Allreduce(a, o)
chk.ok(taken(lambda: comm.Allreduce(a, o)), "the repeated call did not take the quick lane")
want = np.full(4, p * (p + 1) / 2)

# a nonblocking collective in flight (its buffers could be these)
req = comm.Iallreduce(big, bigo)
chk.ok(not taken(lambda: comm.Allreduce(a, o)), "took the quick lane with an Iallreduce in flight")
req.Wait()
chk.ok(np.array_equal(o, want) and np.all(bigo == p * (p + 1) / 2), "results with an Iallreduce in flight")
# ... also on another communicator of this process
other = ddl.Communicator(WORLD)
req = other.Iallreduce(big, bigo)
chk.ok(not taken(lambda: comm.Allreduce(a, o)), "took the quick lane with another communicator's call in flight")
req.Wait()
other.Allreduce(big, bigo)                        # another communicator, nothing in flight: the lane again
chk.ok(taken(lambda: comm.Allreduce(a, o)), "another idle communicator kept the quick lane off")
other.Free()

# a trace hooks the engine: every call must reach it
traced = MessageTrace(comm)
with traced.recording("step"):
    chk.ok(not taken(lambda: comm.Allreduce(a, o)), "took the quick lane past a trace")
events = traced.take()
chk.ok([e[2] for e in events if e[2] in (CALL, END)] == [CALL, END], f"the traced call's events: {events}")
traced.close()
chk.ok(taken(lambda: comm.Allreduce(a, o)), "the quick lane stayed off after the trace was closed")

# the check mode changed on the communicator
comm.check = "new"
chk.ok(not taken(lambda: comm.Allreduce(a, o)), "took the quick lane with check='new'")
comm.check = "always"
chk.ok(taken(lambda: comm.Allreduce(a, o)) and np.array_equal(o, want), "the quick lane after check='always' again")

# recvbuf made read-only: refused on this rank, MismatchError on the others (the general path's refusal)
o.flags.writeable = False
try:
    comm.Allreduce(a, o)
    chk.fail("Allreduce into a read-only recvbuf was taken")
except ddl.Error as exc:
    chk.ok("read-only" in str(exc), f"read-only recvbuf: {exc}")
o.flags.writeable = True

# a schedule pinned on the planner runs at every size: the lane must give way to it
pinned = counted(ddl.Communicator(WORLD))
pinned.Allreduce(a, o)
chk.ok(taken(lambda: pinned.Allreduce(a, o)), "the repeated call did not take the quick lane")
pinned.planner.pin(pinned.planner.schedule("allreduce", a.nbytes, "ring"))
chk.ok(not taken(lambda: pinned.Allreduce(a, o)), "took the quick lane past a pinned schedule")
chk.ok(np.array_equal(o, want), f"with a pinned schedule: {o}")
chk.ok(pinned.explain(a).algorithm == "ring", "the pinned ring is not what runs")
pinned.Free()

# ---- signatures that differ: MismatchError on every rank, then the lane works again --------------
a4, o4, a5, o5 = np.ones(4), np.empty(4), np.ones(5), np.empty(5)
for x, y in ((a4, o4), (a5, o5)):
    comm.Allreduce(x, y)
    chk.ok(taken(lambda: comm.Allreduce(x, y)), "the pair did not take the quick lane")
x, y = (a4, o4) if r == 0 else (a5, o5)
try:
    comm.Allreduce(x, y)
    chk.fail("counts 4 and 5 in one Allreduce were not refused")
except ddl.MismatchError as exc:
    chk.ok("count" in str(exc), f"the mismatch's message: {exc}")
chk.ok(taken(lambda: comm.Allreduce(a, o)) and np.array_equal(o, want), "the quick lane after a mismatch")

# ---- the functional allreduce: a new array every call, a lane per (dtype, shape, op) ----------------
for salt in range(4):
    x = values(np.float64, 6, salt).reshape(2, 3)
    lane, y = through(lambda: comm.allreduce(x))
    chk.ok(lane == (salt > 0), f"functional call {salt}: quick lane {lane}")
    chk.ok(y.shape == (2, 3) and np.array_equal(y.reshape(-1), rank_order(np.float64, 6, salt=salt)),
           f"functional call {salt}: {y}")
    chk.same_everywhere(f"functional {salt}", y)
for salt in range(3):
    lane, y = through(lambda: comm.allreduce(float(r + salt), op=ddl.AVG))
    mean = sum(float(q + salt) for q in range(p)) / p
    chk.ok(lane == (salt > 0) and type(y) is float and y == mean, f"functional AVG of floats: {y!r}, not {mean}")
for salt in range(3):
    lane, y = through(lambda: comm.allreduce(np.float32(r + salt)))
    chk.ok(lane == (salt > 0) and type(y) is np.float32 and y == sum(q + salt for q in range(p)),
           f"functional np.float32: {y!r}")
for _ in range(2):
    chk.ok(not taken(lambda: comm.allreduce(np.full(3, 2.0, np.float16), op=ddl.AVG)),
           "functional float16 AVG took the quick lane")
# a functional call keeps nothing of its input once it returned (they filled the argument cache, 16 deep)
refs = []
for shape in (3, 4, 3, 4):                 # a lane's first call and its next one, for two shapes
    x = np.ones(shape)
    refs.append(weakref.ref(x))
    comm.allreduce(x)
    comm.iallreduce(x).wait()
    del x
gc.collect()
kept = sum(ref() is not None for ref in refs)
chk.ok(kept == 0, f"functional calls kept {kept} inputs alive")
# the same elements in another shape: MismatchError on every rank, in the lane too
for shape in ((2, 3), (3, 2)):
    comm.allreduce(np.ones(shape))
try:
    comm.allreduce(np.ones((2, 3) if r == 0 else (3, 2)))
    chk.fail("shapes (2, 3) and (3, 2) in one functional allreduce were not refused")
except ddl.MismatchError as exc:
    chk.ok("shape" in str(exc), f"the shape mismatch's message: {exc}")
chk.ok(taken(lambda: comm.Allreduce(a, o)) and np.array_equal(o, want),
       "the quick lane after a functional mismatch")

# ---- many small nonblocking calls in flight: each takes a small slot beside its signature slot, so none
# waits for a payload slot (of which the board has only PAYLOAD_DEPTH); larger ones do, with the same results
from ddl.agreement import ShmBoard  # noqa: E402
hooks = ddl.Communicator(WORLD)
small = ShmBoard.small_limit(p) // 8                 # float64 elements that fill a small slot
calls = min(24, hooks._engine.tags.window - 1)        # (at most window - 1 in flight: see ddl.executor)
chk.ok(calls > ShmBoard.PAYLOAD_DEPTH, f"only {calls} calls fit in this MPI's tag window")
for count, most_deferred in ((small, 0), (small + 1, None)):
    xs = [values(np.float64, count, salt) for salt in range(calls)]
    reqs = [hooks.iallreduce(x) for x in xs]
    deferred = len(hooks._engine.deferred)
    results = [req.wait() for req in reqs]
    chk.ok(most_deferred is None or deferred <= most_deferred,
           f"{deferred} of {calls} small calls had to wait for a slot")
    for salt, y in enumerate(results):
        chk.ok(np.array_equal(y, rank_order(np.float64, count, salt=salt)), f"{count} elements, call {salt}: wrong")
    chk.same_everywhere(f"in flight, {count} elements", np.concatenate(results))
# every inline collective at the edge of a small slot, all in flight together: small and payload slots mixed,
# a broadcast's root posting data where the others post none; each checked against MPI's own (whole numbers:
# sums exact in any order, so that MPI's order of reduction does not matter)
edge = []                                            # (ddl request, ddl's output, MPI's output)
for nbytes in (small * 8 - 8, small * 8, small * 8 + 8):
    n = nbytes // 4                                  # float32 elements per rank
    x = (np.arange(n) % 1000 + 7 * r + nbytes).astype(np.float32)
    xs = (np.arange(n * p) % 1000 + 5 * r + nbytes).astype(np.float32)
    for name, given, out_size in (("Allreduce", x, n), ("Reduce_scatter_block", xs, n), ("Allgather", x, n * p)):
        mine, theirs = np.empty(out_size, np.float32), np.empty(out_size, np.float32)
        edge.append((getattr(hooks, "I" + name[0].lower() + name[1:])(given, mine), mine, theirs))   # Iallreduce...
        getattr(WORLD, name)(given, theirs)
    for root in (0, p - 1):
        mine = x.copy() if r == root else np.zeros(n, np.float32)
        theirs = mine.copy()
        edge.append((hooks.Ibcast(mine, root=root), mine, theirs))
        WORLD.Bcast(theirs, root=root)
for k, (req, mine, theirs) in enumerate(edge):
    req.Wait()
    chk.ok(np.array_equal(mine, theirs), f"in-flight collective {k} at a small slot's edge differs from MPI's")
hooks.Free()

# ---- a peer that never calls: StallError naming it, through the lane's fallback ------------------
late = p - 1
stalled = ddl.Communicator(WORLD, stall_timeout=60)   # (a loaded machine may be slow to plan the first call)
s, so = np.ones(2), np.empty(2)
stalled.Allreduce(s, so)
stalled.Allreduce(s, so)                         # the next call with these arrays takes the lane
stalled.stall_timeout = 2
if r != late:
    try:
        stalled.Allreduce(s, so)
        chk.fail(f"an Allreduce without rank {late} completed")
    except ddl.StallError as exc:
        chk.ok(f"rank {late}" in str(exc), f"the StallError does not name rank {late}: {exc}")
WORLD.Barrier()
if r == late:                                    # it comes late: the others gave up on the call
    try:
        stalled.Allreduce(s, so)
        chk.fail("the late rank's Allreduce completed")
    except ddl.StallError as exc:
        chk.ok("gave up" in str(exc), f"the late rank's error: {exc}")

chk.finish("quick-lane")
