"""Symbolic verification of schedules: correctness proved, not hoped.

The verifier executes a schedule on symbols instead of numbers. Every rank starts with a symbol per
chunk ("rank r's contribution to chunk c"); a reduction combines two symbols into an expression whose
*set of contributors* must be disjoint (every contribution counted exactly once) and whose *identity*
records the reduction order, operand order included. At the end:

* allreduce: every rank holds, in every chunk, an expression over all ranks, and the *same*
  expression on every rank — so float results are bitwise identical everywhere;
* reduce-scatter: rank r holds the full reduction in every chunk of block r;
* allgather: every rank holds, in every chunk, the owner's original data;
* broadcast: every rank holds the root's data, and the root receives nothing (it holds every chunk
  already, and its buffer may be read-only: the root of ``Bcast`` only reads it).

Operand order: ``max(-0.0, +0.0)`` is -0.0 and ``max(+0.0, -0.0)`` +0.0, and a sum of two NaNs keeps
the first one's sign and payload, so two ranks that combine the same two partial results (recursive
doubling's partners) must put them in the same order. The rule, here and in the executors: the
operand whose contributors include the lowest rank goes first. It depends on the operands alone, so
both partners agree; the executors learn it per operation from :func:`operand_order` (a by-product of
:func:`verify`), since a rank cannot tell from its own program whose contributions an incoming chunk
holds.

Execution follows the schedule's dataflow rules (see :mod:`ddl.schedule`) as a topological sort over
the operations of all ranks (:attr:`Schedule.dataflow`), with an edge from every send to its matched
receive. Operations left over when no more can run form a cycle of waits: the verifier names the first
stuck operation of each rank. Values seen by a send are those the executor would send, whatever order
ready operations run in, because conflicting operations on a chunk are always ordered by dependencies.
"""
from collections import deque
from dataclasses import dataclass

from .errors import ScheduleError
from .schedule import OP_KINDS, REDUCE, SEND, gc_paused


@dataclass(frozen=True)
class Verdict:
    """What a successful verification established."""

    collective: str
    nranks: int
    nchunks: int
    nops: int
    reductions: int


class Abandoned(Exception):
    """A proof stopped because its ``stop`` callable said so (see :func:`verify`)."""


# A proof asks its ``stop`` callable once per this many operations.
_STOP_EVERY = 1 << 16


def verify(schedule, stop=None):
    """Prove ``schedule`` correct or raise :class:`ddl.ScheduleError` naming the first broken chunk.

    ``stop``: a callable asked before each step of the set-up (the dataflow, the initial symbols: at
    1024 ranks a ring's take 7 s and 3 s) and then every 65536 operations; when it returns true the
    proof is abandoned with :class:`Abandoned` (a planner proving a schedule before it knows whether it
    will pick it)."""
    if schedule.collective == "broadcast":
        for i, op in enumerate(schedule.programs[schedule.root]):
            if op.kind != SEND:
                raise ScheduleError(f"{_describe(schedule, schedule.root, i)}: the root of a broadcast receives "
                                    f"nothing (it holds every chunk, and its buffer may be read-only)")
    with gc_paused():                  # a value per reduction: millions of small tuples, no cycles
        values, state, order, reductions = _symbolic_run(schedule, stop)
        _check_final(schedule, state, values)
    schedule.__dict__.setdefault("operand_order", order)     # Schedule.operand_order, already worked out
    return Verdict(schedule.collective, schedule.nranks, schedule.nchunks, schedule.nops, reductions)


def operand_order(schedule):
    """For every operation (in :attr:`Schedule.dataflow` order), whether it combines the incoming
    operand first: ``True``/``False`` for a reduce (``False`` for every other operation), a tuple of them
    for a reduce of a span whose members differ. Executors follow it; use :attr:`Schedule.operand_order`,
    which caches it (and which :func:`verify` fills as it goes)."""
    with gc_paused():
        return _symbolic_run(schedule)[2]


def _symbolic_run(schedule, stop=None):
    """``(values, final state, operand order, number of reductions)`` of running ``schedule`` on symbols."""
    _ask(stop, schedule, "before it started")
    schedule.dataflow                  # (built once, here, between two questions)
    _ask(stop, schedule, "after the dataflow")
    values = _Values()
    state = _initial_state(schedule, values)
    _ask(stop, schedule, "after the initial state")
    order = [False] * schedule.nops
    reductions = _execute(schedule, state, values, order, stop)
    return values, state, order, reductions


def _ask(stop, schedule, when):
    """Abandon the proof (:class:`Abandoned`) when ``stop`` says so; ``when``: where it stood."""
    if stop is not None and stop():
        raise Abandoned(f"proof of {schedule!r} abandoned {when}")


def check(schedule):
    """``(True, "")`` or ``(False, reason)``: the verifier's verdict without raising."""
    try:
        verify(schedule)
        return True, ""
    except ScheduleError as exc:
        return False, str(exc)


class _Values:
    """Interned symbolic values: an id per distinct expression, with its contributor set (bitmask)."""

    def __init__(self):
        self.masks = []
        self._ids = {}

    def leaf(self, rank, chunk):
        return self._intern(("leaf", rank, chunk), 1 << rank)

    def combine(self, local, incoming):
        """``(the combined value, whether the incoming operand goes first)``: the operand whose
        contributors include the lowest rank goes first (see the module docstring)."""
        a, b = self.masks[local], self.masks[incoming]
        first = b & -b < a & -a
        return self._intern((incoming, local) if first else (local, incoming), a | b), first

    def _intern(self, key, mask):
        vid = self._ids.get(key)
        if vid is None:
            vid = self._ids[key] = len(self.masks)
            self.masks.append(mask)
        return vid


def _initial_state(schedule, values):
    n, k = schedule.nranks, schedule.chunks_per_block
    state = [[None] * schedule.nchunks for _ in range(n)]
    for r in range(n):
        for c in range(schedule.nchunks):
            if schedule.collective in ("allreduce", "reduce_scatter"):
                state[r][c] = values.leaf(r, c)
            elif schedule.collective == "allgather" and c // k == r:
                state[r][c] = values.leaf(r, c)
            elif schedule.collective == "broadcast" and r == schedule.root:
                state[r][c] = values.leaf(r, c)
    return state


def _describe(schedule, rank, index):
    kind, chunk, peer = schedule.programs[rank][index]
    direction = "to" if kind == SEND else "from"
    what = f"chunk {chunk}"
    if chunk >= schedule.nchunks:
        span = schedule.members(chunk)
        what = f"span {chunk} (chunks {span[0]}..{span[-1]})"
    return f"rank {rank} op {index} ({kind} {what} {direction} rank {peer})"


def _execute(schedule, state, values, order, stop=None):
    """Run the schedule on symbols; returns the number of reductions. ``order``: a list (one entry per
    operation) that receives every reduce's operand order (see :func:`operand_order`)."""
    df = schedule.dataflow
    kind, rank, chunk, partner, dependents = df.kind, df.rank, df.chunk, df.partner, df.dependents
    send, reduce = OP_KINDS.index(SEND), OP_KINDS.index(REDUCE)
    waiting = [w + (k != send) for w, k in zip(df.waiting, kind)]   # a receive also waits for its send
    inflight = [None] * len(kind)          # receive -> the value its send shipped
    masks, combine = values.masks, values.combine

    def describe(g):
        return _describe(schedule, rank[g], g - df.starts[rank[g]])

    nchunks = schedule.nchunks
    members = [None] * nchunks + [schedule.members(c) for c in range(nchunks, schedule.nids)]
    ready = deque(g for g, w in enumerate(waiting) if not w)
    pop, push = ready.popleft, ready.append
    done = reductions = 0
    while ready:
        g = pop()
        done += 1
        if not done % _STOP_EVERY:
            _ask(stop, schedule, f"after {done} operations")
        row, c = state[rank[g]], chunk[g]
        if c >= nchunks:                   # a span: the same on each of its chunks, in one message
            if kind[g] == send:
                inflight[partner[g]] = [_sent(row, m, describe, g) for m in members[c]]
            else:
                firsts = []
                for m, incoming in zip(members[c], inflight[g]):
                    reductions += _land(row, m, incoming, kind[g] == reduce, masks, combine, describe, g, firsts)
                if firsts:
                    order[g] = firsts[0] if len(set(firsts)) == 1 else tuple(firsts)
        elif kind[g] == send:
            value = row[c]
            if value is None:
                _sent(row, c, describe, g)     # raises
            inflight[partner[g]] = value
        elif kind[g] == reduce:
            local, incoming = row[c], inflight[g]
            if local is None or masks[local] & masks[incoming]:
                _land(row, c, incoming, True, masks, combine, describe, g)   # raises
            row[c], order[g] = combine(local, incoming)
            reductions += 1
        else:
            row[c] = inflight[g]
        if kind[g] == send:
            h = partner[g]
            w = waiting[h] - 1
            waiting[h] = w
            if not w:
                push(h)
        for d in dependents[g]:
            w = waiting[d] - 1
            waiting[d] = w
            if not w:
                push(d)
    if done < len(kind):
        first_stuck = {}
        for g, w in enumerate(waiting):
            if w:
                first_stuck.setdefault(rank[g], g)
        stuck = [describe(g) for g in first_stuck.values()]
        raise ScheduleError(f"deadlock: {len(kind) - done} operations wait in a cycle; first stuck: "
                            + "; ".join(stuck[:4]))
    return reductions


def _sent(row, c, describe, g):
    """The value a send of chunk ``c`` ships."""
    value = row[c]
    if value is None:
        raise ScheduleError(f"{describe(g)}: chunk {c} holds no data on this rank yet")
    return value


def _land(row, c, incoming, reduce, masks, combine, describe, g, firsts=None):
    """Store (or reduce) a received value of chunk ``c``; returns the number of reductions, 0 or 1."""
    if not reduce:
        row[c] = incoming
        return 0
    local = row[c]
    if local is None:
        raise ScheduleError(f"{describe(g)}: reduces into chunk {c}, which holds no data on this rank")
    overlap = masks[local] & masks[incoming]
    if overlap:
        raise ScheduleError(f"{describe(g)}: contribution of rank(s) {_ranks(overlap)} to chunk {c} would be "
                            f"counted twice")
    row[c], first = combine(local, incoming)
    if firsts is not None:
        firsts.append(first)
    return 1


def _ranks(mask):
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _check_final(schedule, state, values):
    n, k = schedule.nranks, schedule.chunks_per_block
    full = (1 << n) - 1
    coll = schedule.collective
    for c in range(schedule.nchunks):
        owner = c // k
        holders = [owner] if coll == "reduce_scatter" else range(n)
        for r in holders:
            v = state[r][c]
            if v is None:
                raise ScheduleError(f"chunk {c} never reaches rank {r}")
            mask = values.masks[v]
            if coll in ("allreduce", "reduce_scatter") and mask != full:
                missing = _ranks(full & ~mask)
                raise ScheduleError(f"chunk {c} on rank {r} lacks the contribution of rank(s) {missing}")
            source = {"allgather": owner, "broadcast": schedule.root}.get(coll)
            if source is not None and v != values.leaf(source, c):
                raise ScheduleError(f"chunk {c} on rank {r} does not hold rank {source}'s data")
        if coll == "allreduce":
            distinct = {state[r][c] for r in range(n)}
            if len(distinct) > 1:
                raise ScheduleError(f"chunk {c} is reduced in different orders on different ranks: results "
                                    f"would not be bitwise identical")
