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

**Spans** let one operation carry several chunks at once: one message instead of many, where an
algorithm moves a run of consecutive chunks (halving-doubling's halves, a hierarchical stage's share)
to one peer together. Span ``i`` of ``spans``, a pair ``(first, count)`` inside one block, has the
chunk id ``nchunks + i`` and stands for chunks ``first .. first + count - 1``, which are consecutive in
the buffer; an operation on it is the same operation on each of them, in one message. Dependencies
are those of its member chunks (an operation waits for what any of its chunks waits for); matching
pairs a span's send with a receive of the same span.

``routes`` optionally pins the physical paths a rank pair's traffic takes, with the share on each
(the multi-commodity-flow planner uses it); pairs without an entry follow the topology's routes,
split evenly.
"""
import errno
import gc
import json
import math
import operator
import os
import reprlib
import stat
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import ScheduleError

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
# the names of the communicator methods that run them, where they differ (lower case)
_METHOD_NAMES = {"reduce_scatter_block": "reduce_scatter", "bcast": "broadcast"}


def collective_name(name):
    """The name of :data:`COLLECTIVES` that ``name`` gives, in any case and also as a communicator
    method's (``Bcast``, ``Reduce_scatter_block``); other names are returned lower-cased, for the
    caller's error."""
    key = str(name).strip().lower()
    return _METHOD_NAMES.get(key, key)


SEND, RECV, REDUCE = "send", "recv", "reduce"
OP_KINDS = (SEND, RECV, REDUCE)
_KIND_CODE = {kind: code for code, kind in enumerate(OP_KINDS)}   # Dataflow.kind
FORMAT = "ddl.schedule/2"          # 2: spans; a schedule of format 1 (no spans) still loads
_READABLE = ("ddl.schedule/1", FORMAT)
MAX_PATTERN_TOTAL = 1 << 48            # chunk weights sum to at most this: boundaries stay exact integers


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
    spans: tuple = ()

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ScheduleError(f"unknown collective {self.collective!r}; expected one of {', '.join(COLLECTIVES)}")
        if len(self.programs) != self.nranks:
            raise ScheduleError(f"{len(self.programs)} programs for {self.nranks} ranks")
        if not self.pattern or any(not isinstance(w, (int, np.integer)) or isinstance(w, bool) or w <= 0
                                   for w in self.pattern):
            raise ScheduleError(f"chunk pattern must be positive integers, got {self.pattern!r}")
        total = sum(int(w) for w in self.pattern)
        if total > MAX_PATTERN_TOTAL:
            raise ScheduleError(f"chunk pattern weights sum to {total}; at most {MAX_PATTERN_TOTAL} (2^48), so "
                                f"that chunk boundaries stay exact integers")
        if not 0 <= self.root < self.nranks:
            raise ScheduleError(f"root {self.root} is not a rank of {self.nranks}")
        for src, dst in self.routes:
            if not (0 <= src < self.nranks and 0 <= dst < self.nranks) or src == dst:
                raise ScheduleError(f"routes: ({src}, {dst}) is not a pair of two ranks of {self.nranks}")
        per_block = len(self.pattern)
        for i, span in enumerate(self.spans):
            first, count = span if len(span) == 2 else (None, None)
            integers = isinstance(first, (int, np.integer)) and isinstance(count, (int, np.integer))
            if (not integers or count < 2 or first < 0 or first + count > self.nchunks
                    or first // per_block != (first + count - 1) // per_block):
                raise ScheduleError(f"span {i} {span!r} (chunk id {self.nchunks + i}) must be (first, count) with "
                                    f"count >= 2 consecutive chunks inside one block of {per_block}")

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

    @property
    def nids(self):
        """Chunk ids an operation may name: the chunks, then the spans."""
        return self.nchunks + len(self.spans)

    def members(self, chunk):
        """The chunks that chunk id ``chunk`` stands for: itself, or a span's run of chunks."""
        if chunk < self.nchunks:
            return range(chunk, chunk + 1)
        first, count = self.spans[chunk - self.nchunks]
        return range(first, first + count)

    def block_of(self, chunk):
        return self.members(chunk)[0] // len(self.pattern)

    def chunk_fraction(self, chunk):
        """Fraction of the whole buffer that chunk id ``chunk`` covers (for cost models)."""
        whole = sum(self.pattern) * self.nblocks
        return sum(self.pattern[c % len(self.pattern)] for c in self.members(chunk)) / whole

    @cached_property
    def chunk_fractions(self):
        return np.array([self.chunk_fraction(c) for c in range(self.nids)])

    def chunk_ranges(self, count):
        """Element ranges ``[start, stop)`` of every chunk id (chunks, then spans) for a buffer of
        ``count`` elements.

        ``count`` is the whole buffer (for reduce-scatter the send buffer, for allgather the receive
        buffer) and must then be divisible by the number of ranks. Chunks may be empty when ``count``
        is small; every rank computes identical ranges.
        """
        count = operator.index(count)      # a Python int: numpy's fixed-width integers would wrap below
        if count >= 1 << 62:               # offsets are int64 (and no buffer is 2^62 elements)
            raise ScheduleError(f"a count of {count} elements is beyond what a schedule indexes (2^62)")
        if count < 0 or count % self.nblocks:
            raise ScheduleError(f"{self.collective} on {self.nranks} ranks needs a count divisible by "
                                f"{self.nblocks}, got {count}")
        block = count // self.nblocks
        cum = np.concatenate(([0], np.cumsum(self.pattern, dtype=np.int64)))
        # exact integer arithmetic (no float rounding across ranks); in Python's integers where
        # block * total could leave int64
        if block * int(cum[-1]) < 1 << 62:
            inner = (block * cum) // cum[-1]
        else:
            total = int(cum[-1])
            inner = np.array([block * int(c) // total for c in cum], dtype=np.int64)
        starts = (np.arange(self.nblocks, dtype=np.int64)[:, None] * block + inner[None, :-1]).ravel()
        stops = (np.arange(self.nblocks, dtype=np.int64)[:, None] * block + inner[None, 1:]).ravel()
        if self.spans:
            first, count = np.array(self.spans, dtype=np.int64).T
            starts, stops = np.concatenate((starts, starts[first])), np.concatenate((stops, stops[first + count - 1]))
        return np.stack([starts, stops], axis=1)

    # ---- derived structure -----------------------------------------------------------------------
    @cached_property
    def dependencies(self):
        """For every rank, for every op, the indices of the earlier ops it must wait for."""
        with gc_paused():
            return tuple(_program_dependencies(program, self.members if self.spans else None)
                         for program in self.programs)

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

    @cached_property
    def operand_order(self):
        """For every operation (in :attr:`dataflow` order), whether a reduce puts the incoming operand
        first, so that ranks combining the same two partial results compute the same bits (see
        :mod:`ddl.verify`; a tuple per member for a span whose members differ). Worked out once, by
        :func:`ddl.verify.verify` where it ran."""
        from .verify import operand_order
        return operand_order(self)

    def operand_order_of(self, rank):
        """:attr:`operand_order` of ``rank``'s program, op by op (worked out only where it reduces)."""
        program = self.programs[rank]
        if not any(op.kind == REDUCE for op in program):
            return [False] * len(program)
        start = int(self.dataflow.starts[rank])
        return self.operand_order[start:start + len(program)]

    def bytes_sent(self, nbytes):
        """Bytes each rank sends for a buffer of ``nbytes`` (by chunk fractions)."""
        frac = self.chunk_fractions
        return [float(sum(frac[op.chunk] for op in prog if op.kind == SEND)) * nbytes for prog in self.programs]

    # ---- serialisation ---------------------------------------------------------------------------
    def to_dict(self):
        return {
            "format": FORMAT,
            "collective": self.collective,
            "nranks": int(self.nranks),
            "root": int(self.root),
            "algorithm": self.algorithm,
            "pattern": [int(w) for w in self.pattern],
            "info": self.info,
            "routes": [{"src": int(s), "dst": int(d),
                        "paths": [{"via": list(p), "share": float(w)} for p, w in paths]}
                       for (s, d), paths in sorted(self.routes.items())],
            "spans": [[int(first), int(count)] for first, count in self.spans],
            "programs": [[[op.kind, int(op.chunk), int(op.peer)] for op in prog] for prog in self.programs],
        }

    @classmethod
    def from_dict(cls, data):
        """The schedule ``data`` (a :meth:`to_dict`, as read from JSON) describes. Every part is checked
        for its shape first, so that a hand edit gone wrong is named where it is (``programs[2][5]``,
        ``routes[0].paths[1].via``) instead of failing later, deep in a tool, on a value of the wrong
        type; what the parts mean together (ranks, chunks, pairs) is checked by the constructor and the
        verifier."""
        given = data.get("format") if isinstance(data, dict) else None
        if isinstance(given, str) and given.startswith("ddl.schedule/") and given not in _READABLE:
            raise ScheduleError(f"a ddl schedule of format {given!r}, which this version of ddl does not read "
                                f"(it reads {', '.join(map(repr, _READABLE))}): plan it again with this version")
        if given not in _READABLE:
            raise ScheduleError(f"not a ddl schedule (expected \"format\": \"{FORMAT}\")")
        algorithm, info = data.get("algorithm", ""), data.get("info", {})
        if not isinstance(algorithm, str) or not isinstance(info, dict):
            raise ScheduleError(f"\"algorithm\" must be a string and \"info\" a mapping, not "
                                f"{type(algorithm).__name__} and {type(info).__name__}")
        with gc_paused():                  # (millions of operations, no cycles: see gc_paused)
            return cls(collective=_field(data, "collective", "the schedule"),
                       nranks=_int(_field(data, "nranks", "the schedule"), "nranks"),
                       pattern=_pattern(_field(data, "pattern", "the schedule")),
                       programs=_programs(_field(data, "programs", "the schedule")),
                       root=_int(data.get("root", 0), "root"), algorithm=algorithm, info=info,
                       routes=_routes(data.get("routes", [])), spans=_spans(data.get("spans", [])))

    def to_json(self, indent=None):
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text):
        try:
            with gc_paused():              # a list per operation: as from_dict
                data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"schedule is not valid JSON: {exc}") from None
        except RecursionError:
            raise ScheduleError("schedule is not valid JSON: nested too deeply") from None
        return cls.from_dict(data)

    def save(self, path):
        """Write the schedule as JSON to ``path``, whole or not at all: a write that fails (a full disk)
        leaves what the file held. OSError names the file."""
        write_file(path, self.to_json())

    @classmethod
    def load(cls, path):
        """Read a schedule saved with :meth:`save` (``ddl plan --save``); errors name the file."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise ScheduleError(f"{path}: not a ddl schedule (not text)") from None
        try:
            return cls.from_json(text)
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc}") from None

    def __repr__(self):
        return (f"Schedule({self.algorithm or '?'} {self.collective}, {self.nranks} ranks, "
                f"{self.nchunks} chunks{f' and {len(self.spans)} spans' if self.spans else ''}, {self.nops} ops)")


def write_file(path, text, replace=True):
    """Write ``text`` to ``path`` through a temporary file in its folder, renamed into place, so that
    readers see the old file or the new one and never a part; readable as the umask allows (like a
    file opened for writing, not a temporary file's 0600). ``replace=False``: only where ``path`` does
    not exist yet (a hard link, which fails if it does, so that of two writers the first stays);
    returns whether it wrote. A symlink is followed, as writing through it would (see
    :func:`write_target`). OSError names ``path``."""
    shown, path = path, write_target(path)
    try:
        # a short prefix: the temporary name must fit where the file's own name (up to 255 bytes) does
        fd, tmp = tempfile.mkstemp(suffix=".tmp", prefix=path.name[:32] + "-", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(shown)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:                       # a file system without hard links
            if path.exists():
                return False
            os.replace(tmp, path)
        return True
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(shown)) from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_target(path):
    """The file that writing ``path`` replaces, as a Path. A symlink's target: renaming a new file over
    the link would replace the link itself, so the target is written instead (renamed in its own
    folder: still atomic) and the link stays. Refused, with an OSError naming ``path``, where something
    other than a regular file is there: renaming over a device, a FIFO or a socket would destroy it (as
    root, over /dev/null, the system's)."""
    target = Path(os.path.realpath(path))
    kind = file_kind(target)
    if kind is not None:
        linked = f"links to {target}, " if os.path.islink(path) else ""
        raise OSError(errno.EEXIST, f"{linked}{kind}, not a regular file: name a file to write", str(path))
    return target


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def file_kind(path):
    """What is at ``path`` (following symlinks) when it is there and not a regular file: "a folder",
    "a character device", ...; None for a regular file, or where nothing is (or it cannot be looked
    at: the write itself then says why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


# ---- reading a schedule's parts: each checks its shape and names the entry that is wrong -----------
def _show(value):
    """A wrong entry as a message shows it: its repr, cut short (it may be a whole program)."""
    return reprlib.repr(value)


def _field(mapping, key, where):
    """``mapping[key]``, where ``mapping`` is the schedule or one of its entries (named ``where``)."""
    if key not in mapping:
        raise ScheduleError(f"{where} has no \"{key}\"")
    return mapping[key]


def _int(value, where):
    """A JSON integer as is; anything else (1.5, "3", true) is refused, not truncated into another value."""
    if type(value) is not int:
        raise ScheduleError(f"{where} must be an integer, got {_show(value)}")
    return value


def _list(value, where, of):
    """``value``, which must be a list (``of``: what it holds, for the message)."""
    if not isinstance(value, (list, tuple)):
        raise ScheduleError(f"{where} must be a list of {of}, got {_show(value)}")
    return value


def _pattern(value):
    return tuple(_int(w, f"pattern[{i}]") for i, w in enumerate(_list(value, "pattern", "chunk weights")))


def _spans(value):
    return tuple(_span(i, span) for i, span in enumerate(_list(value, "spans", "[first, count] pairs")))


def _span(i, span):
    if not (isinstance(span, (list, tuple)) and len(span) == 2 and type(span[0]) is int and type(span[1]) is int):
        raise ScheduleError(f"spans[{i}]: a span is [first, count], two integers, got {_show(span)}")
    return tuple(span)


def _programs(value):
    programs = _list(value, "programs", "programs, one per rank (each a list of operations)")
    return tuple(_program(rank, ops) for rank, ops in enumerate(programs))


def _program(rank, ops):
    """Rank ``rank``'s program as a tuple of :class:`Op`. Schedules hold millions of operations, so
    they are made and their types checked a whole program at a time, in C (no Python call per
    operation); only a program that fails is gone through again, to name its first wrong operation."""
    _list(ops, f"programs[{rank}]", "operations [kind, chunk, peer]")
    try:
        program = tuple(map(_new_op, repeat(Op), ops))
    except TypeError:                                  # an operation that is no sequence
        program = None
    if program is not None and _well_formed(program):
        return program
    i, op = next((i, op) for i, op in enumerate(ops) if not _is_op(op))
    raise ScheduleError(f"programs[{rank}][{i}]: an operation is [kind, chunk, peer], a string and two "
                        f"integers, got {_show(op)}")


def _well_formed(program):
    """Whether every operation of ``program`` has three items: a string and two integers (what makes
    the tuples :func:`_program` made Ops: it made one of any sequence, a string "abc" or a dict too)."""
    if not program:
        return True
    if set(map(len, program)) != {3}:
        return False
    kinds, chunks, peers = zip(*program)
    return set(map(type, kinds)) == {str} and set(map(type, chunks)) == set(map(type, peers)) == {int}


def _is_op(op):
    return (isinstance(op, (list, tuple)) and len(op) == 3 and type(op[0]) is str and type(op[1]) is int
            and type(op[2]) is int)


def _routes(value):
    """``{(src, dst): ((via, share), ...)}`` from the ``routes`` entries."""
    routes = {}
    for i, entry in enumerate(_list(value, "routes", '{"src", "dst", "paths"} entries')):
        where = f"routes[{i}]"
        if not isinstance(entry, dict):
            raise ScheduleError(f'{where} must be a mapping {{"src": rank, "dst": rank, "paths": [...]}}, '
                                f"got {_show(entry)}")
        pair = (_int(_field(entry, "src", where), f"{where}.src"), _int(_field(entry, "dst", where), f"{where}.dst"))
        if pair in routes:
            raise ScheduleError(f"routes: pair {pair[0]} -> {pair[1]} is listed twice; give each pair once, "
                                f"with all its paths")
        paths = _list(_field(entry, "paths", where), f"{where}.paths", '{"via", "share"} entries')
        routes[pair] = tuple(_path(f"{where}.paths[{j}]", path) for j, path in enumerate(paths))
        if sum(share for _, share in routes[pair]) == math.inf:
            raise ScheduleError(f"{where}: the shares add up to more than a float holds; they are relative "
                                f"(each path's part of their sum): scale them down")
    return routes


def _path(where, path):
    """One ``{"via": [node, ...], "share": number}`` entry of a route as ``(via, share)``."""
    if not isinstance(path, dict):
        raise ScheduleError(f'{where} must be a mapping {{"via": [node, ...], "share": number}}, got {_show(path)}')
    via, share = _field(path, "via", where), _field(path, "share", where)
    if not isinstance(via, (list, tuple)) or not all(type(v) is str for v in via):
        raise ScheduleError(f"{where}.via must be a list of node names (strings), got {_show(via)}")
    if type(share) not in (int, float) or not 0 <= share <= sys.float_info.max:
        raise ScheduleError(f"{where}.share must be a finite number >= 0 (the path's part of the pair's "
                            f"traffic), got {_show(share)}")
    return tuple(via), float(share)


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
        self.spans = {}                   # (first, count) -> its index in Schedule.spans
        nblocks = nranks if collective in ("reduce_scatter", "allgather") else 1
        self._nchunks = nblocks * len(self.pattern)
        self._firsts = []                 # the first chunk of every span, by index

    def first_chunk(self, cid):
        """The chunk a chunk id starts with: itself, or a span's first chunk (see :meth:`runs`)."""
        return cid if cid < self._nchunks else self._firsts[cid - self._nchunks]

    def runs(self, chunks, pieces=1, most=None):
        """Chunk ids that carry ``chunks`` in few operations: every run of consecutive chunks inside one
        block becomes a span (see the module docstring), or ``pieces`` spans of about equal length, each
        of at most ``most`` chunks; a lone chunk stays itself. Algorithms that move many chunks to one
        peer at once send these instead, one message each."""
        ids, k = [], len(self.pattern)
        chunks = sorted(chunks)
        i = 0
        while i < len(chunks):
            j = i + 1
            while j < len(chunks) and chunks[j] == chunks[j - 1] + 1 and chunks[j] % k:
                j += 1
            q = min(max(pieces, -(-(j - i) // (most or j - i))), j - i)
            for a, z in ((i + (j - i) * x // q, i + (j - i) * (x + 1) // q) for x in range(q)):
                if z - a == 1:
                    ids.append(chunks[a])
                else:
                    index = self.spans.setdefault((chunks[a], z - a), len(self.spans))
                    if index == len(self._firsts):
                        self._firsts.append(chunks[a])
                    ids.append(self._nchunks + index)
            i = j
        return ids

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
                        info=info, routes=dict(self.routes), spans=tuple(self.spans))


def _program_dependencies(program, members=None):
    """Dataflow dependencies of one rank's program (see the module docstring for the rule);
    ``members`` maps a chunk id to its chunks where the schedule has spans."""
    if members is not None:
        return _span_dependencies(program, members)
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


def _span_dependencies(program, members):
    """:func:`_program_dependencies` with spans: an op waits for what any of its chunks waits for.
    The single-chunk loop there is kept beside this one: it is twice as fast, and executors run it
    on every program of schedules of millions of operations."""
    last_write, sends_since_write, deps = {}, {}, []
    for i, (kind, chunk, _peer) in enumerate(program):
        mine = set()
        for c in members(chunk):
            w = last_write.get(c)
            if w is not None:
                mine.add(w)
            if kind == SEND:
                sends_since_write.setdefault(c, []).append(i)
            else:
                mine.update(sends_since_write.pop(c, ()))
                last_write[c] = i
        deps.append(tuple(sorted(mine)))
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
            and ((peer >= 0) & (peer < n) & (peer != rank) & (chunk >= 0) & (chunk < schedule.nids)).all()):
        return _flat_checked(schedule, base)
    send = code == 0
    key = (np.where(send, rank, peer) * n + np.where(send, peer, rank)) * schedule.nids + chunk
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
    op, member = _member_ops(schedule, chunk)
    key = rank[op] * schedule.nchunks + member
    order = np.argsort(key, kind="stable")   # by (rank, chunk), program order
    key = key[order]
    write = code[op[order]] != 0
    order = op[order]                         # from here on, the op of every (op, member chunk) pair
    m = len(key)
    pos = np.arange(m)
    first = np.ones(m, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    group_start = np.maximum.accumulate(np.where(first, pos, 0))
    group_end = np.empty(m, dtype=np.int64)   # one past the last op of the group
    group_end[::-1] = np.minimum.accumulate(np.where(np.append(first[1:], True), pos + 1, m)[::-1])
    prev_write = np.full(m, -1, dtype=np.int64)
    prev_write[1:] = np.maximum.accumulate(np.where(write, pos, -1))[:-1]
    prev_write[prev_write < group_start] = -1
    next_write = np.full(m, m, dtype=np.int64)
    next_write[:-1] = np.minimum.accumulate(np.where(write, pos, m)[::-1])[::-1][1:]
    after = ~write & (next_write < group_end)      # a send, and a later write of its chunk waits for it
    src = np.concatenate((prev_write[prev_write >= 0], pos[after]))
    dst = np.concatenate((pos[prev_write >= 0], next_write[after]))
    src, dst = order[src], order[dst]
    if schedule.spans:                         # two ops sharing several chunks: one edge
        edge = np.unique(src * total + dst)
        src, dst = edge // total, edge % total
    else:
        by_src = np.lexsort((dst, src))
        src, dst = src[by_src], dst[by_src]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=total)))).tolist()
    targets = dst.tolist()
    dependents = [targets[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return Dataflow(base.tolist(), code.tolist(), rank.tolist(), chunk.tolist(), partner.tolist(),
                    np.bincount(dst, minlength=total).tolist(), dependents)


def _member_ops(schedule, chunk):
    """``(op, member)``: every op paired with each chunk its chunk id stands for, in op order (the
    ops themselves where the schedule has no spans)."""
    ops = np.arange(len(chunk))
    if not schedule.spans:
        return ops, chunk
    spans = np.array(schedule.spans, dtype=np.int64)
    first = np.concatenate((np.arange(schedule.nchunks), spans[:, 0]))[chunk]
    count = np.concatenate((np.ones(schedule.nchunks, dtype=np.int64), spans[:, 1]))[chunk]
    op = np.repeat(ops, count)
    offset = np.arange(len(op)) - np.repeat(np.cumsum(count) - count, count)
    return op, first[op] + offset


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
            if not 0 <= chunk < schedule.nids:
                raise ScheduleError(f"rank {rank} op {i}: chunk {chunk} out of range 0..{schedule.nids - 1}")
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
