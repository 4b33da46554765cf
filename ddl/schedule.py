"""The Schedule: the contract between planners and executors.

A schedule is, for every rank, an ordered *program* of point-to-point operations on *chunks* of the
user's buffer:

``Op("send", c, peer)``
    send this rank's current value of chunk ``c`` to ``peer``;
``Op("recv", c, peer)``
    receive chunk ``c`` from ``peer`` and copy it into place;
``Op("reduce", c, peer)``
    receive chunk ``c`` from ``peer`` and reduce it into this rank's value (``local op incoming``).

**Chunks** are exact fractions of the buffer, so one schedule is a size-independent template. The
buffer is cut into ``nblocks`` equal blocks (``nranks`` for reduce-scatter and allgather, whose block
``r`` belongs to rank ``r``; one block otherwise), and every block into ``len(pattern)`` chunks whose
sizes are proportional to the integer weights in ``pattern``. Chunk ``c`` is piece ``c % len(pattern)``
of block ``c // len(pattern)``. :meth:`Schedule.chunk_ranges` turns that into element ranges for any
count with integer arithmetic only, so every rank computes the same ranges.

**Order** is dataflow, derived from the program rather than stored: an operation on chunk ``c`` waits
for the operations on ``c`` before it in its rank's program that it conflicts with. A send waits for
the previous receive into ``c`` (it must send the new value); a receive waits for every earlier
operation on ``c`` (it must neither overwrite a value still being sent nor reorder reductions).
Operations on different chunks never wait on each other, which is what lets executors pipeline
chunks so every link the plan uses is busy at once, and what makes the reduction order a fixed
function of the schedule: the same on every rank and every run.

**Matching** follows MPI's non-overtaking rule: the k-th send of chunk ``c`` from ``a`` to ``b`` pairs
with the k-th receive of ``c`` at ``b`` from ``a``.

``routes`` optionally pins the physical paths a rank pair's traffic takes, with the share on each
(the multi-commodity-flow planner uses it); pairs without an entry follow the topology's routes,
split evenly.
"""
import gc
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from .errors import ScheduleError

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
SEND, RECV, REDUCE = "send", "recv", "reduce"
OP_KINDS = (SEND, RECV, REDUCE)
_KIND_CODE = {kind: code for code, kind in enumerate(OP_KINDS)}   # Dataflow.kind
FORMAT = "ddl.schedule/1"


class Op(NamedTuple):
    kind: str
    chunk: int
    peer: int


# Builders make millions of Ops: tuple.__new__ makes one in half the time of Op(...), a Python call.
_new_op = tuple.__new__


@dataclass(frozen=True, eq=True)
class Schedule:
    """Per-rank programs of chunk transfers implementing one collective (see module docstring)."""

    collective: str
    nranks: int
    pattern: tuple
    programs: tuple
    root: int = 0
    algorithm: str = ""
    info: dict = field(default_factory=dict, compare=False, hash=False)
    routes: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ScheduleError(f"unknown collective {self.collective!r}; expected one of {', '.join(COLLECTIVES)}")
        if len(self.programs) != self.nranks:
            raise ScheduleError(f"{len(self.programs)} programs for {self.nranks} ranks")
        if not self.pattern or any((not isinstance(w, (int, np.integer))) or w <= 0 for w in self.pattern):
            raise ScheduleError(f"chunk pattern must be positive integers, got {self.pattern!r}")
        if not 0 <= self.root < self.nranks:
            raise ScheduleError(f"root {self.root} is not a rank of {self.nranks}")

    # ---- chunk geometry -------------------------------------------------------------------------
    @property
    def nblocks(self):
        return self.nranks if self.collective in ("reduce_scatter", "allgather") else 1

    @property
    def chunks_per_block(self):
        return len(self.pattern)

    @property
    def nchunks(self):
        return self.nblocks * len(self.pattern)

    def block_of(self, chunk):
        return chunk // len(self.pattern)

    def chunk_fraction(self, chunk):
        """Fraction of the whole buffer that chunk ``chunk`` covers (for cost models)."""
        return self.pattern[chunk % len(self.pattern)] / (sum(self.pattern) * self.nblocks)

    @cached_property
    def chunk_fractions(self):
        return np.array([self.chunk_fraction(c) for c in range(self.nchunks)])

    def chunk_ranges(self, count):
        """Element ranges ``[start, stop)`` of every chunk for a buffer of ``count`` elements.

        ``count`` is the whole buffer (for reduce-scatter the send buffer, for allgather the receive
        buffer) and must then be divisible by the number of ranks. Chunks may be empty when ``count``
        is small; every rank computes identical ranges.
        """
        if count < 0 or count % self.nblocks:
            raise ScheduleError(f"{self.collective} on {self.nranks} ranks needs a count divisible by "
                                f"{self.nblocks}, got {count}")
        block = count // self.nblocks
        cum = np.concatenate(([0], np.cumsum(self.pattern, dtype=np.int64)))
        inner = (block * cum) // cum[-1]  # exact integer arithmetic: no float rounding across ranks
        starts = (np.arange(self.nblocks, dtype=np.int64)[:, None] * block + inner[None, :-1]).ravel()
        stops = (np.arange(self.nblocks, dtype=np.int64)[:, None] * block + inner[None, 1:]).ravel()
        return np.stack([starts, stops], axis=1)

    # ---- derived structure -----------------------------------------------------------------------
    @cached_property
    def dependencies(self):
        """For every rank, for every op, the indices of the earlier ops it must wait for."""
        with gc_paused():
            return tuple(_program_dependencies(program) for program in self.programs)

    @cached_property
    def matches(self):
        """For every rank, for every op, ``(peer, op index at peer)`` of the op it pairs with."""
        with gc_paused():
            return _match(self)

    @cached_property
    def dataflow(self):
        """The :class:`Dataflow`: every op as one index, with its partner and dependency edges."""
        with gc_paused():
            return _dataflow(self)

    @property
    def nops(self):
        return sum(len(p) for p in self.programs)

    def bytes_sent(self, nbytes):
        """Bytes each rank sends for a buffer of ``nbytes`` (by chunk fractions)."""
        frac = self.chunk_fractions
        return [float(sum(frac[op.chunk] for op in prog if op.kind == SEND)) * nbytes for prog in self.programs]

    # ---- serialisation ---------------------------------------------------------------------------
    def to_dict(self):
        return {
            "format": FORMAT,
            "collective": self.collective,
            "nranks": self.nranks,
            "root": self.root,
            "algorithm": self.algorithm,
            "pattern": [int(w) for w in self.pattern],
            "info": self.info,
            "routes": [{"src": s, "dst": d, "paths": [{"via": list(p), "share": w} for p, w in paths]}
                       for (s, d), paths in sorted(self.routes.items())],
            "programs": [[[op.kind, op.chunk, op.peer] for op in prog] for prog in self.programs],
        }

    @classmethod
    def from_dict(cls, data):
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ScheduleError(f"not a ddl schedule (expected \"format\": \"{FORMAT}\")")
        try:
            programs = tuple(tuple(Op(str(k), int(c), int(p)) for k, c, p in prog) for prog in data["programs"])
            routes = {(int(r["src"]), int(r["dst"])): tuple((tuple(p["via"]), float(p["share"])) for p in r["paths"])
                      for r in data.get("routes", [])}
            return cls(collective=data["collective"], nranks=int(data["nranks"]),
                       pattern=tuple(int(w) for w in data["pattern"]), programs=programs,
                       root=int(data.get("root", 0)), algorithm=data.get("algorithm", ""),
                       info=data.get("info", {}), routes=routes)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"malformed schedule: {exc!r}") from None

    def to_json(self, indent=None):
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"schedule is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path):
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(f.read())

    def __repr__(self):
        return (f"Schedule({self.algorithm or '?'} {self.collective}, {self.nranks} ranks, "
                f"{self.nchunks} chunks, {self.nops} ops)")


class ScheduleBuilder:
    """Accumulates transfers step by step into per-rank programs.

    Planners describe an algorithm as a sequence of transfers; appending both halves of a transfer at
    once keeps every send paired with its receive by construction.
    """

    def __init__(self, collective, nranks, pattern=(1,), root=0, algorithm=""):
        self.collective, self.nranks, self.root, self.algorithm = collective, nranks, root, algorithm
        self.pattern = tuple(int(w) for w in pattern)
        self.programs = [[] for _ in range(nranks)]
        self.routes = {}

    def transfer(self, src, dst, chunk, reduce=False):
        self.programs[src].append(_new_op(Op, (SEND, chunk, dst)))
        self.programs[dst].append(_new_op(Op, (REDUCE if reduce else RECV, chunk, src)))

    def exchange(self, a, b, chunk, reduce=True):
        """``a`` and ``b`` swap their values of ``chunk`` and both reduce (or, ``reduce=False``, each
        keeps the other's): each sends before it receives, so both use the old values."""
        self.round([(a, b, chunk, reduce), (b, a, chunk, reduce)])

    def round(self, transfers):
        """Transfers ``(src, dst, chunk, reduce)`` that all ship the values held before the round: every
        rank's sends go into its program before its receives, each kind in the order given (so a rank
        that receives several values reduces them in that order)."""
        landings = []
        for src, dst, chunk, reduce in transfers:
            self.programs[src].append(_new_op(Op, (SEND, chunk, dst)))
            landings.append((dst, _new_op(Op, (REDUCE if reduce else RECV, chunk, src))))
        for dst, op in landings:
            self.programs[dst].append(op)

    def build(self, **info):
        return Schedule(self.collective, self.nranks, self.pattern,
                        tuple(tuple(p) for p in self.programs), root=self.root, algorithm=self.algorithm,
                        info=info, routes=dict(self.routes))


def _program_dependencies(program):
    """Dataflow dependencies of one rank's program (see the module docstring for the rule)."""
    last_write = {}
    sends_since_write = {}
    deps = []
    for i, (kind, chunk, _peer) in enumerate(program):
        w = last_write.get(chunk)
        if kind == SEND:
            deps.append((w,) if w is not None else ())
            sends_since_write.setdefault(chunk, []).append(i)
        else:
            earlier = sends_since_write.pop(chunk, [])
            deps.append(tuple(earlier) + ((w,) if w is not None else ()))
            last_write[chunk] = i
    return tuple(deps)


@contextmanager
def gc_paused():
    """Run a block without the cyclic garbage collector: building millions of small tuples (one per
    operation) makes no cycles, but would trigger a collection every few thousand of them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _match(schedule):
    """Pair sends with receives in MPI's non-overtaking order; raise on any op without a partner."""
    flat = _flat_ops(schedule)
    if flat is None:
        return tuple(() for _ in schedule.programs)
    _code, _chunk, rank, partner, base = flat
    peer_rank = rank[partner]
    ranks, index = peer_rank.tolist(), (partner - base[peer_rank]).tolist()
    return tuple(tuple(zip(ranks[base[r]:base[r + 1]], index[base[r]:base[r + 1]]))
                 for r in range(schedule.nranks))


def _flat_ops(schedule):
    """Every op of every rank as one numpy sequence, rank after rank in program order: ``(kind codes,
    chunks, ranks, partners, starts)``, or None without ops. ``partners`` pairs sends with receives:
    the k-th send and the k-th receive of one (source, destination, chunk), in program order, are the
    k-th entries of that key in the two stably sorted key arrays. ``starts``: index of every rank's
    first op, and the total. Schedules with a bad or unpaired operation go to
    :func:`_match_checked`, which names it."""
    n, programs = schedule.nranks, schedule.programs
    lengths = [len(p) for p in programs]
    kinds, chunks, peers = [], [], []
    for program in programs:
        if program:
            k, c, q = zip(*program)
            kinds += k
            chunks += c
            peers += q
    if not kinds:
        return None
    base = np.concatenate(([0], np.cumsum(lengths)))
    try:
        code = np.fromiter(map(_KIND_CODE.__getitem__, kinds), dtype=np.int64, count=len(kinds))
    except (KeyError, TypeError):                # not an operation kind
        return _flat_checked(schedule, base)
    chunk, peer = np.array(chunks), np.array(peers)
    rank = np.repeat(np.arange(n), lengths)
    if not (chunk.dtype.kind in "iu" and peer.dtype.kind in "iu"
            and ((peer >= 0) & (peer < n) & (peer != rank) & (chunk >= 0) & (chunk < schedule.nchunks)).all()):
        return _flat_checked(schedule, base)
    send = code == 0
    key = (np.where(send, rank, peer) * n + np.where(send, peer, rank)) * schedule.nchunks + chunk
    sends, receives = np.flatnonzero(send), np.flatnonzero(~send)
    sends = sends[np.argsort(key[sends], kind="stable")]
    receives = receives[np.argsort(key[receives], kind="stable")]
    if len(sends) != len(receives) or (key[sends] != key[receives]).any():
        return _flat_checked(schedule, base)
    partner = np.empty(len(kinds), dtype=np.int64)
    partner[sends], partner[receives] = receives, sends
    return code, chunk.astype(np.int64), rank, partner, base


def _flat_checked(schedule, base):
    """:func:`_flat_ops` through :func:`_match_checked`, which raises on the first bad op (the checks
    the vectorised path makes at once may also fail on valid ops of unusual types, e.g. numpy ints)."""
    matches = _match_checked(schedule)
    programs = schedule.programs
    code = np.array([_KIND_CODE[op[0]] for prog in programs for op in prog], dtype=np.int64)
    chunk = np.array([int(op[1]) for prog in programs for op in prog], dtype=np.int64)
    rank = np.repeat(np.arange(schedule.nranks), [len(p) for p in programs])
    partner = np.array([base[pr] + pi for m in matches for pr, pi in m], dtype=np.int64)
    return code, chunk, rank, partner, base


@dataclass(frozen=True)
class Dataflow:
    """A schedule's ops as one sequence, rank after rank in program order, for the tools that replay
    its dataflow (:mod:`ddl.simulate`, :mod:`ddl.verify`). Plain lists, which their loops read
    millions of times faster than numpy arrays. Op ``g`` is op ``g - starts[rank[g]]`` of its rank.

    ``kind``: the op's index in :data:`OP_KINDS` (0 send, 1 recv, 2 reduce). ``partner``: the op it
    pairs with (:attr:`Schedule.matches`). ``waiting``: how many ops of its rank it waits for,
    ``dependents``: the ops that wait for it, in program order (the edges of
    :attr:`Schedule.dependencies`, computed here again with numpy; a test holds the two together).
    Shared by every user of the schedule: read, never modify.
    """

    starts: list
    kind: list
    rank: list
    chunk: list
    partner: list
    waiting: list
    dependents: list


def _dataflow(schedule):
    """The :class:`Dataflow` of ``schedule``, with numpy: the dependency rule of the module docstring
    applied to all ops of one (rank, chunk) at once, in program order. A write (recv or reduce) waits
    for the previous write and the sends since; a send waits for the previous write."""
    flat = _flat_ops(schedule)
    if flat is None:
        return Dataflow([0] * (schedule.nranks + 1), [], [], [], [], [], [])
    code, chunk, rank, partner, base = flat
    total = len(code)
    key = rank * schedule.nchunks + chunk
    order = np.argsort(key, kind="stable")   # by (rank, chunk), program order
    key = key[order]
    write = code[order] != 0
    pos = np.arange(total)
    first = np.ones(total, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    group_start = np.maximum.accumulate(np.where(first, pos, 0))
    group_end = np.empty(total, dtype=np.int64)   # one past the last op of the group
    group_end[::-1] = np.minimum.accumulate(np.where(np.append(first[1:], True), pos + 1, total)[::-1])
    prev_write = np.full(total, -1, dtype=np.int64)
    prev_write[1:] = np.maximum.accumulate(np.where(write, pos, -1))[:-1]
    prev_write[prev_write < group_start] = -1
    next_write = np.full(total, total, dtype=np.int64)
    next_write[:-1] = np.minimum.accumulate(np.where(write, pos, total)[::-1])[::-1][1:]
    after = ~write & (next_write < group_end)      # a send, and a later write of its chunk waits for it
    src = np.concatenate((prev_write[prev_write >= 0], pos[after]))
    dst = np.concatenate((pos[prev_write >= 0], next_write[after]))
    src, dst = order[src], order[dst]
    by_src = np.lexsort((dst, src))
    src, dst = src[by_src], dst[by_src]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=total)))).tolist()
    targets = dst.tolist()
    dependents = [targets[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return Dataflow(base.tolist(), code.tolist(), rank.tolist(), chunk.tolist(), partner.tolist(),
                    np.bincount(dst, minlength=total).tolist(), dependents)


def _match_checked(schedule):
    """:func:`_match` one operation at a time, raising on the first one that is bad or unpaired."""
    n = schedule.nranks
    queues = {}
    for rank, program in enumerate(schedule.programs):
        for i, (kind, chunk, peer) in enumerate(program):
            if kind not in OP_KINDS:
                raise ScheduleError(f"rank {rank} op {i}: unknown operation {kind!r}")
            if not 0 <= peer < n or peer == rank:
                raise ScheduleError(f"rank {rank} op {i} ({kind} chunk {chunk}): peer {peer} is not another rank")
            if not 0 <= chunk < schedule.nchunks:
                raise ScheduleError(f"rank {rank} op {i}: chunk {chunk} out of range 0..{schedule.nchunks - 1}")
            key = (rank, peer, chunk) if kind == SEND else (peer, rank, chunk)
            side = 0 if kind == SEND else 1
            queues.setdefault(key, ([], []))[side].append((rank, i))
    matches = [[None] * len(p) for p in schedule.programs]
    for (src, dst, chunk), (sends, recvs) in queues.items():
        if len(sends) != len(recvs):
            raise ScheduleError(f"chunk {chunk}: rank {src} sends it to rank {dst} {len(sends)} time(s) "
                                f"but rank {dst} receives it from rank {src} {len(recvs)} time(s)")
        for (sr, si), (rr, ri) in zip(sends, recvs):
            matches[sr][si] = (rr, ri)
            matches[rr][ri] = (sr, si)
    return tuple(tuple(m) for m in matches)
