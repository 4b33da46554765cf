"""Every collective x op x dtype x count against numpy references; bitwise identity across ranks.

    mpiexec -n N python -m mpi4py tests/mpi_cases/collectives.py [full|quick]

``full`` runs every dtype with every op it supports; ``quick`` a representative subset (for 8 ranks
on a small machine). Also: several nonblocking collectives in flight waited in rank-dependent orders,
more than the tag window in flight, every algorithm of the registry, the functional API.
"""
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import BF16, RANK, SIZE, WORLD, Checker, hosts_topology, two_host_topology  # noqa: E402

import ddl  # noqa: E402
from ddl.ops import dtype_class  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "full"
chk = Checker()
p, r = SIZE, RANK
comm = ddl.Communicator(WORLD, stall_timeout=120)

ALL_DTYPES = [np.float16, BF16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
              np.uint16, np.uint32, np.uint64, np.bool_, np.complex64]
ALL_DTYPES = [np.dtype(d) for d in ALL_DTYPES if d is not None]
OPS = [ddl.SUM, ddl.PROD, ddl.MIN, ddl.MAX, ddl.AVG, ddl.BAND, ddl.BOR, ddl.BXOR, ddl.LAND, ddl.LOR, ddl.LXOR]
LOGICAL = (ddl.LAND, ddl.LOR, ddl.LXOR)
COUNTS = sorted({0, 1, max(p - 1, 1), 7, 1001})
if mode == "quick":
    ALL_DTYPES = [np.dtype(d) for d in (np.float16, BF16, np.float32, np.int8, np.uint64, np.bool_) if d is not None]
    COUNTS = sorted({0, 1, max(p - 1, 1), 1001})


def supported(op, dt):
    try:
        ddl.ops.check_op_dtype(op, dt)
        return True
    except ddl.Error:
        return False


def inputs(rank, dt, count, op):
    """Deterministic input of ``rank`` (every rank can compute every rank's input)."""
    rng = np.random.default_rng([rank, count, ALL_DTYPES.index(dt) if dt in ALL_DTYPES else 99, op.code])
    cls = dtype_class(dt)
    if cls == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if cls == "int":
        info = np.iinfo(dt)
        if op in LOGICAL:      # 1 and 2 are both true, though 1 & 2 == 0: bitwise would differ
            return rng.choice([0, 0, 1, 2, 5], count).astype(dt)
        if op is ddl.PROD:
            vals = rng.choice([1, 1, 1, 3] if info.min == 0 else [1, -1, 1, 3], count)
            return vals.astype(dt)
        return rng.integers(info.min, info.max, count, endpoint=True, dtype=dt)
    if op is ddl.PROD:
        vals = rng.choice([0.5, 1.0, -1.0, 2.0], count)
    else:
        vals = rng.standard_normal(count) * 4
    if cls == "complex":
        vals = vals + 1j * rng.standard_normal(count)
    return vals.astype(dt)


def reference(dt, count, op, blocks=1):
    arrays = [inputs(k, dt, count * blocks, op) for k in range(p)]
    cls = dtype_class(dt)
    if cls in ("int", "bool") or op in (ddl.MIN, ddl.MAX) or (op is ddl.PROD and cls != "complex"):
        exact = functools.reduce(lambda a, b: op.ufunc(a, b), arrays)
        return (exact != 0 if op in LOGICAL else exact), None   # (one rank: 1 or 0 all the same)
    wide = np.complex128 if cls == "complex" else np.float64
    if op is ddl.PROD:  # complex products round
        exact = functools.reduce(np.multiply, [a.astype(wide) for a in arrays])
        bound = functools.reduce(np.multiply, [np.abs(a.astype(wide)) for a in arrays]) * 4
    else:
        exact = sum(a.astype(wide) for a in arrays)
        bound = sum(np.abs(a.astype(wide)) for a in arrays)
    eps = float(np.finfo(dt).eps) if dt != BF16 else 2.0 ** -7
    if op.average:
        exact, bound = exact / p, bound / p
    return exact, (p + 2) * eps * bound + 1e-30


def close(result, ref, tol):
    if tol is None:
        return np.array_equal(result, ref)
    cls = dtype_class(result.dtype)
    wide = np.complex128 if cls == "complex" else np.float64
    return bool(np.all(np.abs(result.astype(wide) - ref) <= tol))


def check_reductions():
    for dt in ALL_DTYPES:
        for op in OPS:
            if not supported(op, dt):
                continue
            for count in COUNTS:
                tag = f"{dt.name} {op.name} count {count}"
                send = inputs(r, dt, count, op)
                keep = send.copy()
                recv = np.empty_like(send)
                comm.Allreduce(send, recv, op=op)
                ref, tol = reference(dt, count, op)
                chk.ok(close(recv, ref, tol), f"Allreduce {tag}: {recv[:4]} vs reference {ref[:4]}")
                chk.ok(np.array_equal(send.view(np.uint8), keep.view(np.uint8)), f"Allreduce {tag} modified sendbuf")
                chk.same_everywhere(f"Allreduce {tag}", recv)
                buf = send.copy()
                comm.Allreduce(ddl.IN_PLACE, buf, op=op)
                chk.ok(np.array_equal(buf.view(np.uint8), recv.view(np.uint8)),
                       f"Allreduce IN_PLACE {tag} differs bitwise from the out-of-place result")
                # reduce-scatter: count per rank
                send = inputs(r, dt, count * p, op)
                keep = send.copy()
                out = np.empty(count, dt)
                comm.Reduce_scatter_block(send, out, op=op)
                ref, tol = reference(dt, count, op, blocks=p)
                mine = ref[r * count:(r + 1) * count]
                chk.ok(close(out, mine, None if tol is None else tol[r * count:(r + 1) * count]),
                       f"Reduce_scatter_block {tag}: {out[:4]} vs {mine[:4]}")
                chk.ok(np.array_equal(send.view(np.uint8), keep.view(np.uint8)), f"Reduce_scatter_block {tag} modified sendbuf")
                comm.Reduce_scatter_block(ddl.IN_PLACE, send, op=op)
                chk.ok(np.array_equal(send[:count].view(np.uint8), out.view(np.uint8)),
                       f"Reduce_scatter_block IN_PLACE {tag} differs bitwise from out-of-place")
        # op-free collectives once per dtype
        for count in COUNTS:
            tag = f"{dt.name} count {count}"
            mine = inputs(r, dt, count, ddl.MAX)
            out = np.empty(count * p, dt)
            comm.Allgather(mine, out)
            ref = np.concatenate([inputs(k, dt, count, ddl.MAX) for k in range(p)])
            chk.ok(np.array_equal(out.view(np.uint8), ref.view(np.uint8)), f"Allgather {tag}")
            inplace = np.zeros(count * p, dt)
            inplace[r * count:(r + 1) * count] = mine
            comm.Allgather(ddl.IN_PLACE, inplace)
            chk.ok(np.array_equal(inplace.view(np.uint8), ref.view(np.uint8)), f"Allgather IN_PLACE {tag}")
            root = (p - 1) // 2 + (1 if p > 1 else 0) if p > 1 else 0
            root = min(root, p - 1)
            buf = inputs(r, dt, count, ddl.MIN)
            comm.Bcast(buf, root=root)
            ref = inputs(root, dt, count, ddl.MIN)
            chk.ok(np.array_equal(buf.view(np.uint8), ref.view(np.uint8)), f"Bcast root {root} {tag}")


def check_large():
    """Big enough for pipelined schedules and (with DDL_EARLY_LIMIT small) late-posted receives."""
    count = 300_007 - (300_007 % p)
    rng = np.random.default_rng(r)
    a = rng.standard_normal(count).astype(np.float32)
    out = np.empty_like(a)
    comm.Allreduce(a, out, op=ddl.SUM)
    ref = sum(np.random.default_rng(k).standard_normal(count).astype(np.float32).astype(np.float64) for k in range(p))
    chk.ok(np.allclose(out, ref, rtol=1e-5, atol=1e-4 * p), f"large Allreduce: {out[:3]} vs {ref[:3]}")
    chk.same_everywhere("large Allreduce", out)
    out2 = np.empty_like(a)
    comm.Allreduce(a, out2, op=ddl.SUM)
    chk.ok(np.array_equal(out, out2), "large Allreduce not bitwise reproducible run to run")
    rs = np.empty(count // p, np.float32)
    comm.Reduce_scatter_block(a, rs, op=ddl.AVG)
    chk.ok(np.allclose(rs, (ref / p)[r * (count // p):(r + 1) * (count // p)], rtol=1e-5, atol=1e-4),
           "large Reduce_scatter_block AVG")
    g = np.empty(count, np.float32)
    comm.Allgather(a[: count // p], g)
    ref_g = np.concatenate([np.random.default_rng(k).standard_normal(count).astype(np.float32)[: count // p]
                            for k in range(p)])
    chk.ok(np.array_equal(g, ref_g), "large Allgather")
    b = a.copy() if r == p - 1 else np.zeros_like(a)
    comm.Bcast(b, root=p - 1)
    chk.ok(np.array_equal(b, np.random.default_rng(p - 1).standard_normal(count).astype(np.float32)), "large Bcast")


def check_nonblocking():
    rng = np.random.default_rng(1000 + r)
    specs = [(np.float32, 5, ddl.SUM), (np.float64, 1001, ddl.MAX), (np.int32, 0, ddl.SUM), (np.int64, 3, ddl.BXOR),
             (np.float16, 77, ddl.AVG), (np.uint8, 2 * p + 1, ddl.MIN),
             (np.int32, 300007, ddl.LAND), (np.int16, 300007, ddl.LXOR)]   # beyond the inline limit: scheduled
    reqs, outs = [], []
    for i, (dt, count, op) in enumerate(specs):
        dt = np.dtype(dt)
        a = inputs(r, dt, count, op)
        b = np.empty_like(a)
        reqs.append(comm.Iallreduce(a, b, op=op))
        outs.append(b)
    # rank-dependent wait order, some via Test() polling
    order = rng.permutation(len(reqs))
    for j, i in enumerate(order):
        if (j + r) % 2:
            while not reqs[i].Test():
                pass
        else:
            reqs[i].Wait()
    for (dt, count, op), b in zip(specs, outs):
        ref, tol = reference(np.dtype(dt), count, op)
        chk.ok(close(b, ref, tol), f"Iallreduce {np.dtype(dt).name} {op.name} {count}: {b[:3]} vs {ref[:3]}")
        chk.same_everywhere(f"Iallreduce {np.dtype(dt).name} {op.name} {count}", b)

    # every nonblocking collective at once, waited in reverse on odd ranks
    n = 5
    ag_out = np.empty(n * p, np.int32)
    rs_out = np.empty(n, np.float64)
    bc = np.arange(n, dtype=np.int16) if r == 0 else np.zeros(n, np.int16)
    ar = np.full(3, r + 1, np.int64)
    reqs = [comm.Iallgather(np.full(n, r, np.int32), ag_out),
            comm.Ireduce_scatter_block(np.arange(n * p, dtype=np.float64), rs_out),
            comm.Ibcast(bc, root=0), comm.Ibarrier(), comm.Iallreduce(ddl.IN_PLACE, ar, op=ddl.PROD)]
    for q in (reversed(reqs) if r % 2 else reqs):
        q.Wait()
    chk.ok(np.array_equal(ag_out, np.repeat(np.arange(p), n)), "Iallgather")
    chk.ok(np.array_equal(rs_out, np.arange(n * p, dtype=np.float64)[r * n:(r + 1) * n] * p), "Ireduce_scatter_block")
    chk.ok(np.array_equal(bc, np.arange(n)), "Ibcast")
    import math
    chk.ok(np.all(ar == math.factorial(p)), "Iallreduce PROD in place")

    # more collectives in flight than the tag window: waited newest first
    many = 40
    bufs = [np.full(4, r + i, np.int64) for i in range(many)]
    reqs = [comm.Iallreduce(ddl.IN_PLACE, b, op=ddl.SUM) for b in bufs]
    for q in reversed(reqs):
        q.Wait()
    chk.ok(all(np.all(b == sum(range(p)) + p * i) for i, b in enumerate(bufs)), f"{many} Iallreduce in flight")
    chk.ok(ddl.Request.Testall(reqs), "Testall after completion")
    from mpi4py import MPI
    status = MPI.Status()                  # mpi4py's signatures: a status is accepted, and left as it is
    q = comm.Iallreduce(ddl.IN_PLACE, np.ones(2))
    chk.ok(q.Wait(status) and q.Test(status) and ddl.Request.Waitall([q], [status]) and
           ddl.Request.Testall([q], [status]), "Wait, Test, Waitall and Testall with mpi4py statuses")


def check_two_communicators():
    """Requests of two communicators waited in opposite orders on alternate ranks: any wait drives both."""
    other = ddl.Communicator(WORLD)
    x = np.full(4, r, np.int64)
    y = np.full(4, 2 * r, np.int64)
    qa = comm.Iallreduce(ddl.IN_PLACE, x)
    qb = other.Iallreduce(ddl.IN_PLACE, y)
    for q in ((qb, qa) if r % 2 else (qa, qb)):
        q.Wait()
    chk.ok(np.all(x == sum(range(p))) and np.all(y == 2 * sum(range(p))), "two communicators")
    other.Free()


def check_posts_never_wait():
    """Nonblocking calls return without waiting for another rank (MPI's promise): even ranks post a
    batch to one communicator and then one to another, odd ranks the other way round, each batch more
    calls than the tag window and the board's payload slots hold. A post used to wait for room, and
    each half of the ranks then waited in one communicator for the other half, which waited in the
    other (a StallError after the stall timeout)."""
    one, two = ddl.Communicator(WORLD, stall_timeout=30), ddl.Communicator(WORLD, stall_timeout=30)
    calls = one._engine.tags.window + 2
    for count in (3, one.inline_bytes // 8 + 1):   # int64 elements: inline, and above the inline limit
        bufs = {c: [np.full(count, r + i, np.int64) for i in range(calls)] for c in (one, two)}
        reqs = []
        for c in ((one, two) if r % 2 == 0 else (two, one)):
            reqs += [c.Iallreduce(ddl.IN_PLACE, b) for b in bufs[c]]
        ddl.Request.Waitall(reqs)
        chk.ok(all(np.all(b == sum(range(p)) + p * i) for c in (one, two) for i, b in enumerate(bufs[c])),
               f"{calls} Iallreduce of {count} int64 on each of two communicators, posted in opposite orders")
    one.Free()
    two.Free()


def check_algorithms():
    from ddl.algorithms import ALGORITHMS
    topo = two_host_topology(p)
    ran = {}
    for name in ALGORITHMS:
        c = ddl.Communicator(WORLD, topology=topo, algorithm=name)
        for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
            for count in (1, 13 * p, 40_000):
                try:
                    c.plan(count * 4, collective=coll, root=min(1, p - 1))
                except ddl.PlanError:
                    continue
                run(c, count, f"{name} {coll} {count}")
                ran[name] = ran.get(name, 0) + 1
        c.Free()
    if p > 1:
        chk.ok(len(ran) >= 3, f"only algorithms {sorted(ran)} could run")


def check_hierarchical_ramped_waves():
    """hierarchical on two hosts at 8 MiB: its chunks are waves of unequal sizes (1, 2, ..., 2, 1 per
    target); the sums must still be right and bitwise the same everywhere."""
    if p < 3:                  # hosts of one rank each: a single stage, nothing to overlap
        return
    topo = two_host_topology(p)
    c = ddl.Communicator(WORLD, topology=topo, algorithm="hierarchical")
    count = 2 << 20
    sched = c.plan(count * 4)
    chk.ok(sched.info["ramped"] and len(set(sched.pattern)) > 1, f"not ramped: {sched.pattern[:8]}")
    _ar(c, count, "hierarchical ramped waves")
    c.Free()


class ExchangeHierarchy:
    """hierarchical on two hosts whose ranks exchange directly (one step: every rank sends each share
    to its holder, which reduces them in a fixed order) instead of by ring, in ramped waves, with the
    lag and spans."""

    def schedule(self, collective, nbytes, algorithm=None, root=0):
        from ddl.algorithms.hierarchical import hierarchical_schedule
        hosts = [list(range((p + 1) // 2)), list(range((p + 1) // 2, p))]
        return hierarchical_schedule(list(range(p)), [hosts], collective, 4, root, waves=4, ramped=True, lag=1,
                                     exchange=(1,))


def check_hierarchical_exchange():
    """Direct exchange inside the hosts (hosts of 3 and more ranks, where it differs from a ring):
    every collective right and bitwise the same everywhere."""
    if p < 5:
        return
    c = ddl.Communicator(WORLD, planner=ExchangeHierarchy())
    chk.ok(c.plan(4 << 20).info["exchange_stages"] == [1], "hierarchical: no exchange stage")
    for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
        for count in (7 * p, 300_000):
            run(c, count, f"hierarchical exchange {coll} {count}")
    c.Free()


SPLIT_FIRST_RACK = (p + 3) // 4 * 2        # ranks in SplitHierarchy's first rack (whole hosts of two)


class SplitHierarchy:
    """hierarchical over three stages (hosts of two ranks, two racks, all), in ramped waves split into
    parts (the same place in the host, the same diagonal across the racks), with the lag and spans; an
    allreduce's racks hold equal shares (unequal racks: chunks of unequal sizes)."""

    def schedule(self, collective, nbytes, algorithm=None, root=0):
        from ddl.algorithms.hierarchical import hierarchical_schedule
        hosts = [list(range(i, min(i + 2, p))) for i in range(0, p, 2)]
        racks = [list(range(SPLIT_FIRST_RACK)), list(range(SPLIT_FIRST_RACK, p))]
        return hierarchical_schedule(list(range(p)), [hosts, racks], collective, 4, root, waves=4, ramped=True,
                                     lag=2, split=True, balanced=True)


def check_hierarchical_split_waves():
    """Waves split into parts on three stages, racks holding equal shares (5 ranks: unequal hosts and
    racks): every collective right and bitwise the same everywhere."""
    if p < 5:
        return
    c = ddl.Communicator(WORLD, planner=SplitHierarchy())
    sched = c.plan(4 << 20)
    chk.ok(sched.info["wave_parts"] > 1, "hierarchical: waves not split")
    unequal = SPLIT_FIRST_RACK != p - SPLIT_FIRST_RACK     # then the ramp's two sizes times two shares
    chk.ok(sched.info["balanced"] and (len(set(sched.pattern)) > 2) == unequal,
           f"hierarchical: shares not balanced: {sorted(set(sched.pattern))}")
    for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
        for count in (7 * p, 300_000):
            run(c, count, f"hierarchical split waves {coll} {count}")
    c.Free()


class SpanRings:
    """A planner of ring schedules that send most of a block's pieces as one span (one message) and its
    first piece alone, and gather whole blocks as spans: spans and chunks of one block mix, so the
    executor must find chunks written one way and read the other in place."""

    def schedule(self, collective, nbytes, algorithm=None, root=0):
        from ddl.algorithms.ring import ring_allgather, ring_reduce_scatter
        from ddl.schedule import ScheduleBuilder
        k = 3
        ranks = list(range(root, p)) + list(range(root))
        per_block = k * (p if collective == "allreduce" else 1)
        b = ScheduleBuilder(collective, p, (1,) * per_block, root=root, algorithm="span-rings")

        def split(j):       # block j's pieces: the first alone, the rest one span
            return [j * k] + b.runs(range(j * k + 1, (j + 1) * k))
        if collective in ("allreduce", "reduce_scatter"):
            ring_reduce_scatter(b, ranks, [split(j) for j in ranks])
        if collective in ("allreduce", "allgather"):    # whole blocks
            ring_allgather(b, ranks, [b.runs(range(j * k, (j + 1) * k)) for j in ranks])
        if collective == "broadcast":
            ring_allgather(b, ranks, [split(0)] + [[] for _ in ranks[1:]])
        return b.build()


def check_spans():
    """Schedules with spans, in place and not, every collective: right and bitwise the same everywhere."""
    if p < 2:
        return
    c = ddl.Communicator(WORLD, planner=SpanRings())
    for count in (1, 3 * p, 30_001 * p):
        for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
            run(c, count, f"spans {coll} {count}")
        a = inputs(r, np.dtype(np.float64), count, ddl.SUM)
        c.Allreduce(ddl.IN_PLACE, a, op=ddl.SUM)
        ref, tol = reference(np.dtype(np.float64), count, ddl.SUM)
        chk.ok(close(a, ref, tol), f"spans allreduce in place {count}")
        chk.same_everywhere(f"spans in place {count}", a)
        g = np.full(count * p, -1, np.int32)
        g[r * count:(r + 1) * count] = r
        c.Allgather(ddl.IN_PLACE, g)
        chk.ok(np.array_equal(g, np.repeat(np.arange(p, dtype=np.int32), count)), f"spans allgather in place {count}")
        x = inputs(r, np.dtype(np.int64), count * p, ddl.SUM)
        c.Reduce_scatter_block(ddl.IN_PLACE, x, op=ddl.SUM)
        ref, _ = reference(np.dtype(np.int64), count, ddl.SUM, blocks=p)
        chk.ok(np.array_equal(x[:count], ref[r * count:(r + 1) * count]), f"spans reduce-scatter in place {count}")
    chk.ok(c.plan(4 * 3 * p).spans, "span-rings planned no spans")
    c.Free()


def check_ring_channels():
    """ring-channels on one box whose ranks are joined in a cycle of direct links (and a slow switch):
    the ring both ways round at least, every collective right and bitwise the same everywhere."""
    if p < 3:
        return
    from ddl.topology import Topology
    topo = Topology.from_dict({
        "name": "cycle-box", "nodes": [{"id": "pcie", "kind": "pcie"}, {"id": "cpu{g}", "kind": "cpu", "for": {"g": p}}],
        "links": [{"a": f"cpu{g}", "b": f"cpu{(g + 1) % p}", "bandwidth": "25 GB/s"} for g in range(p)]
                 + [{"a": f"cpu{g}", "b": "pcie", "bandwidth": "2 GB/s"} for g in range(p)],
        "ranks": [{"id": "cpu{g}", "for": {"g": p}}]})
    c = ddl.Communicator(WORLD, topology=topo, algorithm="ring-channels")
    chk.ok(len(c.plan(4 << 20).info["channels"]) >= 2, "ring-channels: one channel")
    for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
        for count in (7 * p, 300_000):
            run(c, count, f"ring-channels {coll} {count}")
    c.Free()


def check_delegated():
    """delegated on two hosts, the second behind a link 20 times slower: its ranks reduce at home, send
    the sum out through a relay and take the result back; at 4 MiB the chunks are cut into pieces (and
    the first and last in the core too). Right and bitwise the same everywhere, in place and not."""
    if p < 3:                  # the fast host must hold two ranks
        return
    topo = hosts_topology([(p + 1) // 2, p // 2], bandwidths=["1 GB/s", "50 MB/s"], name="slow-second-host")
    c = ddl.Communicator(WORLD, topology=topo, algorithm="delegated")
    info = c.plan(4 << 20).info
    chk.ok(info["slow_hosts"] == [list(range((p + 1) // 2, p))] and max(info["pieces"]) > 1 and info["ramp_chunks"],
           f"delegated: not the second host, or no pieces: {info}")
    for count in (1, 13 * p, 40_000, 1 << 20):
        _ar(c, count, f"delegated {count}")
    a = inputs(r, np.dtype(np.float64), 1 << 20, ddl.SUM)
    c.Allreduce(ddl.IN_PLACE, a, op=ddl.SUM)
    ref, tol = reference(np.dtype(np.float64), 1 << 20, ddl.SUM)
    chk.ok(close(a, ref, tol), "delegated in place")
    chk.same_everywhere("delegated in place", a)
    c.Free()


def check_ring_packing():
    """ring-packing on ranks joined in a cycle of direct links and, in pairs, under leaf switches of a
    tree: rings of unequal rates with some hops split over two paths, every collective right and
    bitwise the same everywhere (the paths are the fabric's business; the chunks must add up)."""
    if p < 3:
        return
    from ddl.topology import Topology
    leaves = (p + 1) // 2
    topo = Topology.from_dict({
        "name": "paired-cycle", "nodes": [{"id": "root", "kind": "switch"}]
        + [{"id": f"leaf{j}", "kind": "switch"} for j in range(leaves)] + [{"id": f"cpu{g}", "kind": "cpu"} for g in range(p)],
        "links": [{"a": f"cpu{g}", "b": f"cpu{(g + 1) % p}", "bandwidth": "25 GB/s"} for g in range(p)]
                 + [{"a": f"cpu{g}", "b": f"leaf{g // 2}", "bandwidth": "10 GB/s"} for g in range(p)]
                 + [{"a": f"leaf{j}", "b": "root", "bandwidth": "10 GB/s"} for j in range(leaves)],
        "ranks": [f"cpu{g}" for g in range(p)]})
    c = ddl.Communicator(WORLD, topology=topo, algorithm="ring-packing")
    weights = c.plan(4 << 20).info["channel_weights"]
    chk.ok(len(set(weights)) > 1, f"ring-packing: rings of equal shares {weights}")
    for coll, run in (("allreduce", _ar), ("reduce_scatter", _rs), ("allgather", _ag), ("broadcast", _bc)):
        for count in (7 * p, 300_000):
            run(c, count, f"ring-packing {coll} {count}")
    c.Free()


def check_tiered_exchange_lanes():
    """tiered-exchange on three hosts of two ranks (six of the ranks): radix 3, where the two ranks of
    a host each chain half of the hosts' sums from several messages at once, then merge."""
    if p < 6:
        return
    sub = WORLD.Split(0 if r < 6 else 1, r)
    if r < 6:
        c = ddl.Communicator(sub, topology=hosts_topology([2, 2, 2]), algorithm="tiered-exchange")
        f32 = np.dtype(np.float32)
        for count in (1, 13 * 6, 40_000):
            chk.ok(c.plan(count * 4).info["radices"] == [[3]], "tiered-exchange radix 3")
            a = inputs(r, f32, count, ddl.SUM)
            out = np.empty_like(a)
            c.Allreduce(a, out, op=ddl.SUM)
            arrays = [inputs(k, f32, count, ddl.SUM).astype(np.float64) for k in range(6)]
            tol = 8 * float(np.finfo(f32).eps) * sum(np.abs(x) for x in arrays) + 1e-30
            chk.ok(close(out, sum(arrays), tol), f"tiered-exchange lanes {count}")
            chk.ok(len(set(sub.allgather(out.tobytes()))) == 1, f"tiered-exchange lanes {count}: bitwise")
        c.Free()
    sub.Free()


def _ar(c, count, tag):
    a = inputs(r, np.dtype(np.float32), count, ddl.SUM)
    out = np.empty_like(a)
    c.Allreduce(a, out, op=ddl.SUM)
    ref, tol = reference(np.dtype(np.float32), count, ddl.SUM)
    chk.ok(close(out, ref, tol), f"{tag}")
    chk.same_everywhere(tag, out)


def _rs(c, count, tag):
    a = inputs(r, np.dtype(np.int64), count * p, ddl.SUM)
    out = np.empty(count, np.int64)
    c.Reduce_scatter_block(a, out, op=ddl.SUM)
    ref, _ = reference(np.dtype(np.int64), count, ddl.SUM, blocks=p)
    chk.ok(np.array_equal(out, ref[r * count:(r + 1) * count]), tag)


def _ag(c, count, tag):
    out = np.empty(count * p, np.int32)
    c.Allgather(np.full(count, r, np.int32), out)
    chk.ok(np.array_equal(out, np.repeat(np.arange(p, dtype=np.int32), count)), tag)


def _bc(c, count, tag):
    root = min(1, p - 1)
    buf = np.arange(count, dtype=np.float64) if r == root else np.zeros(count)
    c.Bcast(buf, root=root)
    chk.ok(np.array_equal(buf, np.arange(count, dtype=np.float64)), tag)


def check_functional():
    x = np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1)
    y = comm.allreduce(x, op=ddl.AVG)
    chk.ok(y.shape == (3, 4) and np.allclose(y, np.arange(12).reshape(3, 4) * (p + 1) / 2), "allreduce AVG functional")
    chk.ok(np.array_equal(x, np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1)), "functional allreduce modified input")
    s = comm.allreduce(r + 1)
    chk.ok(s == p * (p + 1) // 2 and isinstance(s, int), f"scalar allreduce: {s!r}")
    z = comm.allreduce(np.array(r + 1.0))
    chk.ok(z.shape == () and z == p * (p + 1) / 2, f"0-d array allreduce keeps its shape: {z!r}")
    arrays = [np.full((2, 3), r, np.float32), np.arange(5, dtype=np.int64) + r, np.ones(1, np.float32) * r,
              np.zeros((0,), np.float32)]
    outs = comm.grouped_allreduce(arrays, op=ddl.SUM)
    tot = sum(range(p))
    chk.ok([o.shape for o in outs] == [a.shape for a in arrays], "grouped shapes")
    chk.ok(np.all(outs[0] == tot) and np.array_equal(outs[1], np.arange(5) * p + tot) and np.all(outs[2] == tot),
           f"grouped_allreduce values {outs}")
    chk.ok(outs[1].dtype == np.int64 and outs[0].dtype == np.float32, "grouped dtypes")
    h = comm.iallreduce(np.ones(3, np.float32), op=ddl.SUM)
    chk.ok(np.all(h.wait() == p), "iallreduce handle")
    f = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    comm.Allreduce(ddl.IN_PLACE, f, op=ddl.SUM)
    chk.ok(np.array_equal(f, np.arange(6).reshape(2, 3) * p), "Fortran-ordered buffer")


def check_inline():
    """Allreduces of at most inline_bytes (auto, one node, check always) ride on the agreement board:
    every rank reduces the posted inputs in rank order, so the result is exactly that expression."""
    limit = min(1 << 20, (2 << 20) // p) // 64 * 64
    chk.ok(comm.inline_bytes == (limit if comm.agreement == "shared-memory" else 0),
           f"inline_bytes {comm.inline_bytes} with agreement {comm.agreement}")
    ring = ddl.Communicator(WORLD, algorithm="ring")
    chk.ok(ring.inline_bytes == 0, "an explicit algorithm must run its schedule")
    ring.Free()
    n = limit // 4
    for count in (n, n + 1):               # n float32: inline (shared memory); n + 1: the schedule
        x = [inputs(k, np.dtype(np.float32), count, ddl.SUM) for k in range(p)]
        out = np.empty(count, np.float32)
        comm.Allreduce(x[r], out, op=ddl.SUM)
        chk.same_everywhere(f"Allreduce of {count} float32", out)
        ref = functools.reduce(np.add, x)  # rank order, in float32
        if count * 4 <= comm.inline_bytes:
            chk.ok(np.array_equal(out.view(np.uint32), ref.view(np.uint32)),
                   "inline allreduce is not the rank-order reduction")
        else:
            chk.ok(np.allclose(out, ref, rtol=1e-5, atol=1e-4), f"Allreduce of {count} float32")
        avg = np.empty(count, np.float32)
        comm.Allreduce(x[r], avg, op=ddl.AVG)
        chk.ok(np.allclose(avg, ref / p, rtol=1e-5, atol=1e-5), f"AVG of {count} float32")
        chk.same_everywhere(f"AVG of {count} float32", avg)
    # the other collectives take the same path up to the limit (per-rank input), the schedule above it
    m = limit // 8                         # float64 elements that fit
    for n in (max(m // p, 1), m // p + 1):  # reduce-scatter: each rank's input is n * p elements
        x = [inputs(k, np.dtype(np.float64), n * p, ddl.SUM) for k in range(p)]
        out = np.empty(n, np.float64)
        comm.Reduce_scatter_block(x[r], out, op=ddl.SUM)
        ref = functools.reduce(np.add, x)[r * n:(r + 1) * n]
        chk.ok(np.allclose(out, ref, rtol=1e-12, atol=1e-12), f"Reduce_scatter_block of {n}x{p} float64")
        if n * p <= m and comm.inline_bytes:   # reduced from the board in rank order
            chk.ok(np.array_equal(out, ref), "inline reduce-scatter is not the rank-order reduction")
        inplace = x[r].copy()
        comm.Reduce_scatter_block(ddl.IN_PLACE, inplace, op=ddl.SUM)
        chk.ok(np.array_equal(inplace[:n], out), f"Reduce_scatter_block IN_PLACE of {n}x{p} float64")
    for n in (max(m, 1), m + 1):           # allgather and broadcast: each rank's input is n elements
        x = [inputs(k, np.dtype(np.float64), n, ddl.MAX) for k in range(p)]
        g = np.empty(n * p, np.float64)
        comm.Allgather(x[r], g)
        want = np.concatenate(x)
        chk.ok(np.array_equal(g, want), f"Allgather of {n} float64")
        gi = np.zeros(n * p, np.float64)
        gi[r * n:(r + 1) * n] = x[r]
        comm.Allgather(ddl.IN_PLACE, gi)
        chk.ok(np.array_equal(gi, want), f"Allgather IN_PLACE of {n} float64")
        for root in sorted({0, p - 1}):
            b = x[r].copy()
            comm.Bcast(b, root=root)
            chk.ok(np.array_equal(b, x[root]), f"Bcast of {n} float64 from {root}")
    # inline and scheduled requests in flight together, waited in reverse order
    small = [np.full(3, r + i, np.int64) for i in range(4)]
    big = np.full(5000, r, np.int64)
    reqs = [comm.Iallreduce(ddl.IN_PLACE, a) for a in small[:2]] + [comm.Iallreduce(ddl.IN_PLACE, big)] + \
           [comm.Iallreduce(ddl.IN_PLACE, a) for a in small[2:]]
    for q in reversed(reqs):
        q.Wait()
    total = p * (p - 1) // 2
    chk.ok(all(np.all(a == total + p * i) for i, a in enumerate(small)) and np.all(big == total),
           "inline and scheduled Iallreduce in flight together")


def check_signed_zeros_and_nans():
    """Bitwise identity where ops are not bitwise commutative: max(-0.0, +0.0) is -0.0 and
    max(+0.0, -0.0) +0.0, and a sum of two NaNs keeps the first one's sign and payload. Every
    algorithm (recursive doubling and the tiered exchange have partners combine the same two partial
    results), inline and scheduled."""
    from ddl.algorithms import ALGORITHMS
    topo = two_host_topology(p)
    comms = [("auto", comm)] + [(name, ddl.Communicator(WORLD, topology=topo, algorithm=name)) for name in ALGORITHMS]
    # chunks of one element too: numpy's in-place add of one element keeps the second operand's NaN
    for count in (13 * p + 5, 1, p + 1):
        zeros = np.where(np.arange(count) % 2 == r % 2, -0.0, 0.0)
        nans = np.full(count, np.nan)
        nans.view(np.uint64)[:] |= np.uint64(r + 1) | (np.uint64(r % 2) << np.uint64(63))  # payload, sign
        cases = [(ddl.MAX, zeros), (ddl.MIN, zeros), (ddl.SUM, nans), (ddl.PROD, nans)]
        for name, c in comms:
            for op, x in cases:
                for dt in (np.float64, np.float32):
                    try:
                        if name != "auto":
                            c.plan(count * np.dtype(dt).itemsize)
                    except ddl.PlanError:
                        continue
                    out = x.astype(dt)
                    c.Allreduce(ddl.IN_PLACE, out, op=op)
                    chk.same_everywhere(f"{name} {op} {np.dtype(dt)} x {count} signed zeros / NaN payloads", out)
    for name, c in comms:
        if name != "auto":
            c.Free()


def check_float16_average():
    """float16 AVG divides every input first (as NCCL and PyTorch DDP): values whose sum passes 65504
    average to a finite value, identical everywhere, inline and scheduled, in place or not, and the
    caller's input is untouched. float32 still sums first: its AVG is the sum's division."""
    def given(rank, count):
        x = np.full(count, 40000.0, np.float16)
        x[1::2] = -30000.0 + rank                  # a rank-dependent half
        return x

    for count in (5, 300007):                      # inline (one node, small) and by the schedule
        x = given(r, count)
        keep = x.copy()
        ref = sum(given(k, count).astype(np.float64) for k in range(p)) / p
        for inplace in (False, True):
            what = f"float16 AVG of {count}{' in place' if inplace else ''}"
            if inplace:
                out = x.copy()
                comm.Allreduce(ddl.IN_PLACE, out, op=ddl.AVG)
            else:
                out = np.empty_like(x)
                comm.Allreduce(x, out, op=ddl.AVG)
                chk.ok(np.array_equal(x, keep), f"{what}: the input changed")
            chk.ok(np.isfinite(out).all(), f"{what}: {out[:4]} (the sum overflows float16)")
            chk.ok(np.allclose(out, ref, rtol=5e-3), f"{what}: {out[:4]} vs {ref[:4]}")
            chk.same_everywhere(what, out)
        n = count // p + 1
        xs = np.resize(x, n * p)
        rs = np.empty(n, np.float16)
        comm.Reduce_scatter_block(xs, rs, op=ddl.AVG)
        chk.ok(np.isfinite(rs).all(), f"float16 Reduce_scatter_block AVG of {n}x{p}: {rs[:4]}")
        inplace = xs.copy()
        comm.Reduce_scatter_block(ddl.IN_PLACE, inplace, op=ddl.AVG)
        chk.ok(np.array_equal(inplace[:n], rs), f"float16 Reduce_scatter_block AVG IN_PLACE of {n}x{p}")
        chk.ok(np.array_equal(inplace[n:], xs[n:]), "float16 Reduce_scatter_block AVG IN_PLACE: beyond its block")
        req = comm.Iallreduce(x, out, op=ddl.AVG)
        req.Wait()
        chk.same_everywhere(f"float16 Iallreduce AVG of {count}", out)
    y = np.full(4, 3.0e38, np.float32)             # float32 sums first: the same sum, then divided
    out = np.empty_like(y)
    comm.Allreduce(y, out, op=ddl.AVG)
    chk.ok(np.isinf(out).all() if p > 1 else np.array_equal(out, y), f"float32 AVG sums first: {out}")


def check_reproducible():
    """A fresh communicator reproduces the bits of the first one (every run, not just every rank)."""
    a = inputs(r, np.dtype(np.float32), 1001, ddl.SUM)
    o1, o2 = np.empty_like(a), np.empty_like(a)
    comm.Allreduce(a, o1)
    c2 = ddl.Communicator(WORLD)
    c2.Allreduce(a, o2)
    c2.Free()
    chk.ok(np.array_equal(o1.view(np.uint32), o2.view(np.uint32)), "fresh communicator gives different bits")


check_reductions()
check_large()
check_nonblocking()
check_functional()
check_two_communicators()
check_posts_never_wait()
check_inline()
check_float16_average()
check_reproducible()
check_signed_zeros_and_nans()
if mode == "full" or p in (5, 8):
    check_algorithms()
    check_hierarchical_ramped_waves()
    check_hierarchical_exchange()
    check_hierarchical_split_waves()
    check_ring_channels()
    check_ring_packing()
    check_delegated()
    check_spans()
    check_tiered_exchange_lanes()
waiting = "doorbell" if comm._engine.bell is not None else ("naps" if comm._engine.oversubscribed else "spin")
comm.Free()
chk.finish(f"collectives[{mode}]", f"agreement {comm.agreement}, waiting {waiting}")
