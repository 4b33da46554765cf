"""From a :class:`~ddl.schedule.Schedule` to device launches: steps of grouped sends/receives.

NCCL has no tags and no dataflow engine: point-to-point operations are issued in *groups*
(``ncclGroupStart`` / ``ncclGroupEnd``), a group's operations run concurrently, consecutive groups on
one stream run one after the other, and the k-th send from a to b matches the k-th receive at b from
a. This module turns the schedule's dataflow order into that form, in pure Python.

**Levels (global).** Every send is paired with its receive (``schedule.matches``): a *transfer*.
A transfer's level is one more than the highest level of the transfers its two operations depend on
(``schedule.dependencies`` on the sender and on the receiver), so a transfer never shares a level
with anything it waits for, and both halves of a transfer are issued in the same step on both
ranks. One exception makes several incoming chunks reduce in one kernel: a ``reduce`` whose only
dependency is the previous ``reduce`` of the same chunk (no send of the chunk in between) may share
that reduce's level; both are then received into separate scratch slots and reduced in program
order, by one launch ``out = op(op(a0, first), second)`` where the second goes after the chunk's value
(:attr:`Schedule.operand_order`, see :class:`Reduction`), else by two.

**Steps.** Step L holds this rank's transfers of level L, in a canonical order that both ends
compute alike -- sorted by (sender, receiver, the send's index in the sender's program) -- so NCCL's
in-order matching pairs exactly the transfers the schedule pairs; then the reductions of the
receives of that step, in program order. Deadlock freedom: every rank issues its groups in increasing
level and a transfer's halves share a level, so the lowest unfinished level can always complete.
Within a step no two operations touch the same chunk (they would depend on each other), except the
fused reduces above, which use distinct scratch slots: so a ``recv`` goes directly into place, a
``reduce`` into scratch, and scratch is reused from one step to the next (the stream orders them).

**Same reduction order as the host executor.** Reductions of a chunk happen in program order (fused
chains too: the kernel rounds after each operation), which is exactly what the host executor does;
results are bitwise identical.

Buffers: ``send``, ``recv`` (the user's), ``work`` (reduce-scatter's blocks of other ranks) and
``scratch``; offsets are bytes. Chunks are placed in them by :mod:`ddl.buffer_layout`, as on the host.
"""
from dataclasses import dataclass

import networkx as nx

from ..buffer_layout import LAYOUTS, RECV as RECV_BUF, SEND as SEND_BUF, WORK as WORK_BUF  # noqa: F401 (names)
from ..buffer_layout import chunk_locations, read_location
from ..errors import Error, ScheduleError
from ..schedule import RECV, REDUCE, SEND

SCRATCH_BUF = "scratch"
ALIGN = 16  # scratch slots keep the alignment (mod 16) of the chunk they are reduced into


@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation of a step."""

    kind: str       # "send" | "recv"
    peer: int
    buf: str        # SEND_BUF | RECV_BUF | WORK_BUF | SCRATCH_BUF
    offset: int     # bytes into buf
    nbytes: int
    chunk: int
    op_index: int   # index of the op in this rank's program
    reduce: bool    # a receive into scratch, reduced after the step
    tag: int        # ordinal among this step's transfers from the same sender to the same receiver
    key: tuple      # canonical sort key (sender, receiver, send index at the sender)


@dataclass(frozen=True)
class Reduction:
    """``out = op(...op(a0, inputs[0])..., inputs[-1])`` over ``count`` elements after a step, or with
    ``incoming_first`` ``op(...op(inputs[0], a0)...)``, as :attr:`Schedule.operand_order` says (an op
    need not be bitwise commutative: ``max(-0.0, +0.0)``); so only a chain's first input may go first."""

    chunk: int
    count: int
    out: tuple       # (buf, byte offset)
    a0: tuple        # (buf, byte offset): the chunk's current value (may equal out)
    inputs: tuple    # scratch byte offsets, in program order
    op_indices: tuple
    incoming_first: bool = False


@dataclass(frozen=True)
class Step:
    level: int
    transfers: tuple
    reductions: tuple
    scratch_bytes: int


@dataclass(frozen=True)
class LaunchPlan:
    """A schedule instantiated for (rank, count, itemsize, layout) as steps of grouped transfers."""

    rank: int
    nranks: int
    count: int
    itemsize: int
    layout: str
    collective: str
    steps: tuple
    copies: tuple          # (src buf, src offset, dst buf, dst offset, nbytes), before step 0
    scratch_bytes: int     # the largest step's scratch (reused from step to step)
    work_bytes: int

    @property
    def transfers(self):
        return [t for s in self.steps for t in s.transfers]

    @property
    def reductions(self):
        return [r for s in self.steps for r in s.reductions]


# ---- global levels --------------------------------------------------------------------------------
_levels_cache = {}


def _soft(program, deps, j):
    """Index of the reduce that op j (a reduce) may share a level with, or None."""
    if program[j].kind != REDUCE:
        return None
    d = deps[j]
    if len(d) == 1 and program[d[0]].kind == REDUCE and program[d[0]].chunk == program[j].chunk:
        return d[0]            # (a span and one of its chunks: not one chain, levels apart)
    return None


def _levels_through_exchanges(schedule, nodes, preds):
    """:func:`transfer_levels`' levels where waits form cycles: transfers on a cycle of waits that
    all allow the same step (weight 0: an exchange's two transfers) share one; a cycle through a wait
    for an earlier step cannot run."""
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_weighted_edges_from((q, n, w) for n in nodes for q, w in preds[n])
    dag = nx.condensation(graph)
    member = dag.graph["mapping"]
    for u, v, w in graph.edges(data="weight"):
        if w and member[u] == member[v]:
            stuck = sorted(dag.nodes[member[u]]["members"])[:4]
            raise ScheduleError(f"schedule {schedule!r} has a cycle of waits (e.g. the sends at (rank, op) "
                                f"{stuck}); it cannot run")
    step = {}
    for x in nx.topological_sort(dag):
        step[x] = max((step[member[q]] + w for n in dag.nodes[x]["members"] for q, w in preds[n]
                       if member[q] != x), default=0)
    return {n: step[member[n]] for n in nodes}


def transfer_levels(schedule):
    """For every rank, for every op of its program, the level (step) of the transfer it belongs to.

    Raises :class:`ddl.ScheduleError` when the schedule's waits form a cycle.
    """
    entry = _levels_cache.get(id(schedule))
    if entry is not None and entry[0] is schedule:
        return entry[1]
    progs, deps, matches = schedule.programs, schedule.dependencies, schedule.matches
    # transfer id of every op: the (rank, index) of its send
    tid = []
    for r, prog in enumerate(progs):
        row = []
        for i, op in enumerate(prog):
            row.append((r, i) if op.kind == SEND else tuple(matches[r][i]))
        tid.append(row)
    nodes = [(r, i) for r, prog in enumerate(progs) for i, op in enumerate(prog) if op.kind == SEND]
    preds = {}   # transfer -> list of (predecessor transfer, weight 1 hard / 0 soft)
    succs = {n: [] for n in nodes}
    for (a, i) in nodes:
        b, j = matches[a][i]
        p = [(tid[a][d], 1) for d in deps[a][i]]
        soft = _soft(progs[b], deps[b], j)
        reduce = progs[b][j].kind == REDUCE
        for d in deps[b][j]:
            # a reduce receives into scratch and combines after its step, so it may share a step with
            # the receiver's own send of the chunk (an exchange: both partners send, then both reduce)
            p.append((tid[b][d], 0 if d == soft or (reduce and progs[b][d].kind == SEND) else 1))
        preds[(a, i)] = p
        for q, _w in p:
            succs[q].append((a, i))
    indeg = {n: len(preds[n]) for n in nodes}
    level = {}
    ready = [n for n in nodes if indeg[n] == 0]
    while ready:
        n = ready.pop()
        lv = 0
        for q, w in preds[n]:
            lv = max(lv, level[q] + w)
        level[n] = lv
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(level) != len(nodes):       # exchanges: transfers that may share a step wait on each other
        level = _levels_through_exchanges(schedule, nodes, preds)
    out = tuple(tuple(level[tid[r][i]] for i in range(len(prog))) for r, prog in enumerate(progs))
    _levels_cache[id(schedule)] = (schedule, out)
    if len(_levels_cache) > 256:
        _levels_cache.pop(next(iter(_levels_cache)))
    return out


def _slot(cursor, out_offset):
    """Next scratch offset >= cursor congruent to out_offset mod ALIGN (keeps the vector path)."""
    base = -(-cursor // ALIGN) * ALIGN
    return base + out_offset % ALIGN


def launch_plan(schedule, rank, count, itemsize, layout="allreduce_inplace"):
    """Translate ``schedule`` for ``rank`` and a buffer of ``count`` elements of ``itemsize`` bytes.

    ``count`` is the whole buffer as in :meth:`Schedule.chunk_ranges` (reduce-scatter: the send
    buffer, allgather: the receive buffer). Operations on empty chunks are dropped (every rank drops
    the same ones). Returns a :class:`LaunchPlan`.
    """
    if not 0 <= rank < schedule.nranks:
        raise Error(f"rank {rank} is not a rank of {schedule!r}")
    itemsize = int(itemsize)
    ranges, locs, precopies = chunk_locations(schedule, rank, count, layout)
    program = schedule.programs[rank]
    deps = schedule.dependencies[rank]
    matches = schedule.matches[rank]
    levels = transfer_levels(schedule)[rank]
    operand_order = schedule.operand_order_of(rank)

    written = [False] * schedule.nchunks
    copies = [(sb, so * itemsize, db, do * itemsize, n * itemsize) for sb, so, db, do, n in precopies]
    per_level = {}   # level -> dict(transfers=[], reds=[], open={chunk: reduction list index}, cursor)

    def state(lv):
        st = per_level.get(lv)
        if st is None:
            st = per_level[lv] = {"transfers": [], "reds": [], "open": {}, "cursor": 0}
        return st

    for i, (kind, c, peer) in enumerate(program):
        e0, e1 = int(ranges[c, 0]), int(ranges[c, 1])
        if e1 <= e0:
            continue
        nbytes = (e1 - e0) * itemsize
        home = locs[c][1]
        cur = read_location(schedule, locs, written, c)
        lv = levels[i]
        st = state(lv)
        if kind == SEND:
            if cur is None:
                raise Error(f"schedule {schedule!r}: rank {rank} op {i} sends chunk {c} before it holds data")
            key = (rank, peer, i)
            st["transfers"].append((key, kind, peer, cur[0], cur[1] * itemsize, nbytes, c, i, False))
            continue
        hbuf, hoff = home[0], home[1] * itemsize
        if kind == RECV:
            key = (peer, rank, matches[i][1])
            st["transfers"].append((key, "recv", peer, hbuf, hoff, nbytes, c, i, False))
            st["open"].pop(c, None)
        else:  # REDUCE
            if cur is None:
                raise Error(f"schedule {schedule!r}: rank {rank} op {i} reduces into chunk {c} before it holds data")
            slot = _slot(st["cursor"], hoff)
            st["cursor"] = slot + nbytes
            key = (peer, rank, matches[i][1])
            st["transfers"].append((key, "recv", peer, SCRATCH_BUF, slot, nbytes, c, i, True))
            soft = _soft(program, deps, i)
            k = st["open"].get(c)
            first = operand_order[i]             # the incoming operand first: only as a chain's first input
            if isinstance(first, tuple):         # a span whose members differ: a reduction per member
                for m, f in zip(schedule.members(c), first):
                    off = (int(ranges[m, 0]) - e0) * itemsize
                    st["reds"].append({"chunk": c, "count": int(ranges[m, 1] - ranges[m, 0]), "first": f,
                                       "out": (hbuf, hoff + off), "a0": (cur[0], cur[1] * itemsize + off),
                                       "inputs": [slot + off], "ops": [i]})
                st["open"].pop(c, None)
            elif (soft is not None and k is not None and levels[soft] == lv and st["reds"][k]["ops"][-1] == soft
                    and not first):
                st["reds"][k]["inputs"].append(slot)
                st["reds"][k]["ops"].append(i)
            else:
                st["reds"].append({"chunk": c, "count": e1 - e0, "out": (hbuf, hoff), "first": first,
                                   "a0": (cur[0], cur[1] * itemsize), "inputs": [slot], "ops": [i]})
                st["open"][c] = len(st["reds"]) - 1
        for m in schedule.members(c):
            written[m] = True

    steps = []
    for lv in sorted(per_level):
        st = per_level[lv]
        trs = sorted(st["transfers"], key=lambda t: t[0])
        ordinal = {}
        out = []
        for key, kind, peer, buf, off, nbytes, c, i, red in trs:
            pair = key[:2]
            tag = ordinal.get(pair, 0)
            ordinal[pair] = tag + 1
            out.append(Transfer(kind, peer, buf, off, nbytes, c, i, red, tag, key))
        reds = tuple(Reduction(r["chunk"], r["count"], r["out"], r["a0"], tuple(r["inputs"]), tuple(r["ops"]),
                               r["first"]) for r in st["reds"])
        steps.append(Step(lv, tuple(out), reds, st["cursor"]))

    for c, (init, home, needed) in enumerate(locs[:schedule.nchunks]):
        e0, e1 = int(ranges[c, 0]), int(ranges[c, 1])
        if needed and not written[c] and e1 > e0 and init is not None and init != home:
            copies.append((init[0], init[1] * itemsize, home[0], home[1] * itemsize, (e1 - e0) * itemsize))
    work = count * itemsize if layout == "reduce_scatter" and schedule.nranks > 1 else 0
    return LaunchPlan(rank, schedule.nranks, count, itemsize, layout, schedule.collective, tuple(steps),
                      tuple(copies), max((s.scratch_bytes for s in steps), default=0), work)


def describe(plan):
    """Human-readable listing of a launch plan (debugging: ``print(describe(lp))``)."""
    lines = [f"rank {plan.rank}/{plan.nranks} {plan.layout} count={plan.count} itemsize={plan.itemsize}: "
             f"{len(plan.steps)} steps, scratch {plan.scratch_bytes} B, work {plan.work_bytes} B"]
    for sb, so, db, do, n in plan.copies:
        lines.append(f"  copy {sb}+{so} -> {db}+{do} ({n} B)")
    for s in plan.steps:
        lines.append(f"  step {s.level}:")
        for t in s.transfers:
            lines.append(f"    {t.kind} chunk {t.chunk} {'to' if t.kind == 'send' else 'from'} {t.peer}: "
                         f"{t.buf}+{t.offset} ({t.nbytes} B){' [reduce]' if t.reduce else ''}")
        for r in s.reductions:
            local, incoming = f"{r.a0[0]}+{r.a0[1]}", f"scratch {list(r.inputs)}"
            first, second = (incoming, local) if r.incoming_first else (local, incoming)
            lines.append(f"    reduce chunk {r.chunk}: {r.out[0]}+{r.out[1]} = op({first}, {second}) x {r.count}")
    return "\n".join(lines)
