"""Cross-rank agreement: every rank must call the same collective with the same arguments.

MPI leaves a mismatch (rank 3 calls ``Allreduce`` with 1001 floats, the others with 1000) undefined:
usually a hang, sometimes a truncation error, sometimes a silently wrong answer. ddl checks instead.

**The check.** A collective's *signature* is (sequence number, collective, count, dtype, op, root,
digest of the schedule that will run, topology fingerprint, check mode, and for the functional
``allreduce`` a digest of the array's shape). Two implementations, with the
same guarantee -- one point of agreement per collective, seen identically by every rank:

* across nodes: every rank hashes its signature to ``h`` (62 bits) and the ranks run ONE tiny
  collective, an ``MPI_Iallreduce`` of the two int64 ``[h, -h]`` with ``MPI_MAX``. The result is
  ``[max h, -min h]``: the ranks agree iff ``max h == min h``. Only when they do not (the error path)
  do they gather the full signatures, with an ``MPI_Iallgather`` on a second private communicator;
* all ranks on one node (the usual single-host multi-GPU/CPU job; env ``DDL_AGREEMENT=mpi`` forces
  the other): :class:`ShmBoard`, the full signatures posted in an MPI shared-memory window. No
  message, no MPI call, no ``log2(p)`` rounds of message hops -- which on an oversubscribed node
  cost a scheduling round each -- and the stall watchdog learns exactly which ranks have not arrived.

A mismatch is raised as :class:`ddl.MismatchError` on EVERY rank, e.g.::

    ranks disagree on ddl collective #7: rank 3 called Allreduce with 1001 float32 (SUM);
    ranks 0-2 called Allreduce with 1000 float32 (SUM) [differs in: count]

The check is nonblocking: it is posted when the collective is called and completed by the progress
engine (see :mod:`ddl.executor`), which starts the data phase only once the check has passed. Nothing
is sent before that, so a mismatch never corrupts a buffer, and the private communicators stay clean:
the communicator remains usable after a :class:`~ddl.MismatchError`.

**Why always check (``check="always"``, the default).** The issue suggests checking only signatures
"not seen before". That is unsafe when decided per rank: the check is itself a collective, so all
ranks must agree on *whether* to run it, and the one case the check exists for -- ranks whose call
sequences diverged -- is exactly the case where one rank has seen its signature (and skips) while
another has not (and checks). The skipping rank proceeds to the data phase, the checking rank waits
for a check nobody else joins: a hang. Worse, two ranks that have both seen their (different)
signatures before would both skip and exchange data of different collectives: a wrong answer. A
check whose cost is one 16-byte allreduce (latency only; it overlaps with nothing else on the rank
anyway, because the data phase has to wait for it), or a few shared-memory writes and reads, is the
safe default.

``check="new"`` is the opt-in compromise: check only signatures this rank has not seen before (a call
whose check failed is forgotten when its MismatchError reaches the caller, on every rank alike: see
``Communicator._forget_signature``). It is made *safe* by salting the message tags of the data phase
with the signature hash, so messages of two different collectives do not match: a divergence then
shows up as a :class:`ddl.StallError` after ``stall_timeout`` (naming the ranks) instead of a
MismatchError -- never a hang, and a wrong answer only if the salts collide (1 in 64 with MPICH's tag
range; ``TagSpace.salt_bits`` in :mod:`ddl.executor`). ``check="off"`` skips the check entirely (tags
stay salted). All ranks must use the same ``check`` mode (verified when the Communicator is created).
"new" and "off" use the MPI implementation of the check.
"""
import copy
import functools
import hashlib

import numpy as np

from .errors import MismatchError
from .units import counted

COLLECTIVE_CODES = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3, "broadcast": 4, "barrier": 5, "free": 6,
                    "grouped_allreduce": 7}
COLLECTIVE_NAMES = {1: "Allreduce", 2: "Reduce_scatter_block", 3: "Allgather", 4: "Bcast", 5: "Barrier", 6: "Free",
                    7: "grouped_allreduce"}
REFUSED = 16   # collective code + REFUSED: a call whose arguments its rank refused (see refusal)
GROUPED = 32   # collective code + GROUPED: the arrays of a grouped call (see grouped)
GAVE_UP = 64   # the collective code of a board row whose rank gave up on it (see ShmBoard.give_up)
DEVICE = 128   # collective code + DEVICE: a communicator's first call on device buffers (see device_start)
CHECK_MODES = ("always", "new", "off")
_MASK62 = (1 << 62) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# Layout of the int64 signature vector gathered on mismatch.
SIG_LEN = 12
(_SEQ, _COLL, _COUNT, _ITEMSIZE, _DT0, _DT1, _OP, _ROOT, _SCHED, _TOPO, _MODE, _SHAPE) = range(SIG_LEN)


def digest62(*parts):
    """Stable 62-bit hash of strings/ints (identical on every rank, unlike ``hash()``)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") & _MASK62


def _dtype_words(dtype):
    dt = None if dtype is None else np.dtype(dtype)
    # the byte order counts: '>i4' and '<i4' are both named int32, and summing one into the other is wrong
    label = "" if dt is None else dt.name if dt.isnative else dt.str
    name = label.encode()[:16].ljust(16, b"\x00")
    return int.from_bytes(name[:8], "little", signed=True), int.from_bytes(name[8:], "little", signed=True)


def _dtype_name(w0, w1):
    raw = int(w0).to_bytes(8, "little", signed=True) + int(w1).to_bytes(8, "little", signed=True)
    return raw.rstrip(b"\x00").decode(errors="replace") or "?"


_DIM_BITS = 20      # a shape word holds up to 3 dimensions of up to 2**20 - 1 each ...
_DIGESTED = 7       # ... else a digest of the shape, marked by this in its low 3 bits (see shape_word)


def shape_word(shape):
    """The signature's non-zero word for an array ``shape``: the shape itself where it has at most 3
    dimensions, each under 2**20 (low 3 bits: 1 + the number of dimensions, then 20 bits a dimension),
    so that a mismatch can print every rank's shape; else a digest of it (low bits :data:`_DIGESTED`)."""
    if len(shape) <= 3 and all(d < 1 << _DIM_BITS for d in shape):
        word = len(shape) + 1
        for i, d in enumerate(shape):
            word |= int(d) << (3 + _DIM_BITS * i)
        return word
    return (digest62("shape", *shape) >> 3) << 3 | _DIGESTED


def shape_shown(shape):
    """Whether a mismatch message prints ``shape`` itself (else only a tag: see :func:`shape_word`)."""
    return shape_word(shape) & 7 != _DIGESTED


def _shape_text(word, dtype_name):
    """``float64[2, 3]`` for a shape word (see :func:`shape_word`); ``float64, shape #1a2b3c`` for a
    digested one (the same tag for the same shape)."""
    tag = word & 7
    if tag == _DIGESTED:
        return f"{dtype_name}, shape #{word >> 40:06x}"
    return array_text(dtype_name, [(word >> (3 + _DIM_BITS * i)) & ((1 << _DIM_BITS) - 1) for i in range(tag - 1)])


def array_text(dtype_name, shape):
    """``float64[2, 3]``: an array's dtype and shape (``float64 scalar`` for a 0-d one)."""
    return f"{dtype_name}[{', '.join(map(str, shape))}]" if len(shape) else f"{dtype_name} scalar"


class Signature:
    """What one rank is about to run; ``base`` hashes everything but the sequence number."""

    __slots__ = ("collective", "count", "dtype", "op", "root", "schedule_digest", "topology_digest", "mode",
                 "base", "vector")

    def __init__(self, collective, count, dtype, op, root, schedule_digest, topology_digest, mode="always"):
        self.collective, self.count, self.dtype, self.op, self.root = collective, count, dtype, op, root
        self.schedule_digest, self.topology_digest, self.mode = schedule_digest, topology_digest, mode
        d0, d1 = _dtype_words(dtype)
        vec = np.zeros(SIG_LEN, np.int64)
        vec[_COLL] = COLLECTIVE_CODES[collective]
        vec[_COUNT] = count
        vec[_ITEMSIZE] = np.dtype(dtype).itemsize if dtype is not None else 0
        vec[_DT0], vec[_DT1] = d0, d1
        vec[_OP] = op.code if op is not None else 0
        vec[_ROOT] = root
        vec[_SCHED] = schedule_digest
        vec[_TOPO] = topology_digest
        vec[_MODE] = CHECK_MODES.index(mode)
        self.vector = vec
        self.base = digest62(*vec[1:].tolist())

    def hash(self, seq):
        """62-bit hash of this signature at sequence number ``seq``."""
        return (self.base ^ ((seq * _GOLDEN) & _MASK62)) & _MASK62

    def shaped(self, shape):
        """This signature for the functional ``allreduce`` of an array of ``shape``. Ranks whose arrays
        hold as many elements in other shapes then disagree, as in Horovod: reducing a ``(2, 3)`` into
        a ``(3, 2)`` element by element is a bug of the caller's, and so is mixing the functional call
        with the buffer API's ``Allreduce`` (whose word is 0) in one collective."""
        sig = copy.copy(self)
        sig.vector = self.vector.copy()
        sig.vector[_SHAPE] = shape_word(shape)
        sig.base = digest62(*sig.vector[1:].tolist())
        return sig

    def with_seq(self, seq):
        vec = self.vector.copy()
        vec[_SEQ] = seq
        return vec


def refusal(collective, topology_digest, mode="always"):
    """The signature a rank posts for a ``collective`` call whose arguments it refused (a read-only
    buffer, AVG on integers, a plan it could not make): the other ranks, which called it correctly and
    wait in its agreement, then raise :class:`ddl.MismatchError` at once, naming this rank, instead of a
    StallError once ``stall_timeout`` has passed. Ranks that all refused the same collective agree and
    each raises its own error."""
    return _marked(COLLECTIVE_CODES[collective] + REFUSED, topology_digest, mode)


def device_start(collective, topology_digest, mode="always"):
    """The signature a rank posts before its communicator's first call on device buffers: making the
    device executor is collective (an MPI communicator is duplicated), so a rank that passed host
    buffers to the same call would leave the others blocked in it. Agreeing first makes that a
    MismatchError on every rank; ranks that all pass device buffers agree and go on."""
    return _marked(COLLECTIVE_CODES[collective] + DEVICE, topology_digest, mode)


def _marked(code, topology_digest, mode):
    """A signature that says only ``code`` (a collective's code plus a mark): a barrier's, recoded."""
    sig = Signature("barrier", 0, None, None, 0, 0, topology_digest, mode)
    sig.vector[_COLL] = code
    sig.base = digest62(*sig.vector[1:].tolist())
    return sig


def grouped(arrays, op, topology_digest, mode="always"):
    """The signature of a grouped allreduce's arrays, which its ranks agree on before its collectives
    start: they run one collective per dtype, so ranks that passed different dtypes would otherwise
    start different numbers of collectives and fall out of step. It holds the number of arrays, of
    elements and of dtypes, and a digest of every array's dtype and shape in order (shapes as the
    functional ``allreduce`` compares them: see :meth:`Signature.shaped`)."""
    dtypes = {a.dtype for a in arrays}
    layout = digest62(*(f"{a.dtype.str}:{a.shape}" for a in arrays))
    sig = Signature("allreduce", sum(a.size for a in arrays), None, op, len(dtypes), layout, topology_digest, mode)
    sig.vector[_COLL] = COLLECTIVE_CODES["allreduce"] + GROUPED
    sig.vector[_ITEMSIZE] = len(arrays)
    sig.base = digest62(*sig.vector[1:].tolist())
    return sig


def _grouped(vec):
    return int(vec[_COLL]) == COLLECTIVE_CODES["allreduce"] + GROUPED


def announced(collective, counter, refuse):
    """Decorator of a collective's entry method: when it raises before the call reached the agreement
    (the object's ``counter`` attribute, which every call that reaches it advances, did not move), the
    object's ``refuse(collective, exc)`` method announces the refusal to the other ranks first, then
    the exception goes on. Nested entries announce once: the inner one has moved the counter."""
    def decorate(entry):
        @functools.wraps(entry)
        def announcing(self, *args, **kwargs):
            before = getattr(self, counter)
            try:
                return entry(self, *args, **kwargs)
            except Exception as exc:
                if getattr(self, counter) == before:
                    getattr(self, refuse)(collective, exc)
                raise
        return announcing
    return decorate


def _refused(vec):
    return REFUSED < int(vec[_COLL]) < GROUPED


def _device_start(vec):
    return DEVICE < int(vec[_COLL])


def check_buffer(sig_hash):
    """int64[4]: ``[h, -h]`` to send and two slots for the MAX-reduced result."""
    buf = np.empty(4, np.int64)
    buf[0] = sig_hash
    buf[1] = -sig_hash
    return buf


def agreed(buf):
    """True when the MAX-reduced ``[max h, -min h]`` in ``buf[2:]`` says every rank had the same hash."""
    return buf[2] == -buf[3]


def gave_up(table):
    """The ranks whose row of a board ``table`` says they gave up on the collective (StallError)."""
    return [r for r, row in enumerate(table) if int(row[_COLL]) == GAVE_UP]


def freed_by(table):
    """The ranks whose row of a board or gathered ``table`` says they called ``Free`` there."""
    return [r for r, row in enumerate(table) if int(row[_COLL]) == COLLECTIVE_CODES["free"]]


def describe(vec, several=False):
    """Human form of one signature vector: ``Allreduce with 1000 float32 (SUM)`` (``several``: the
    signature of more than one rank, for the words that say who)."""
    from .ops import op_from_code
    if _refused(vec):
        name = COLLECTIVE_NAMES.get(int(vec[_COLL]) - REFUSED, "a collective")
        return (f"{name} with arguments they refused (their own errors say why)" if several else
                f"{name} with arguments it refused (its own error says why)")
    if int(vec[_COLL]) == GAVE_UP:
        return "this collective, then gave up on it (StallError)"
    if _device_start(vec):
        name = COLLECTIVE_NAMES.get(int(vec[_COLL]) - DEVICE, "a collective")
        return f"{name} on device buffers (GPU arrays; host buffers must be host buffers on every rank)"
    if _grouped(vec):
        ndtypes = int(vec[_ROOT])
        return (f"grouped_allreduce of {int(vec[_ITEMSIZE])} arrays, {int(vec[_COUNT])} elements in "
                f"{counted(ndtypes, 'dtype')} ({op_from_code(vec[_OP]).name})")
    name = COLLECTIVE_NAMES.get(int(vec[_COLL]), f"collective {int(vec[_COLL])}")
    if int(vec[_SHAPE]):            # the functional call (see Signature.shaped): its array's dtype and shape
        return (f"allreduce of {_shape_text(int(vec[_SHAPE]), _dtype_name(vec[_DT0], vec[_DT1]))} "
                f"({op_from_code(vec[_OP]).name})")
    if int(vec[_COLL]) in (COLLECTIVE_CODES["barrier"], COLLECTIVE_CODES["free"]):
        return name
    text = f"{name} with {int(vec[_COUNT])} {_dtype_name(vec[_DT0], vec[_DT1])}"
    extras = []
    op = op_from_code(vec[_OP]) if vec[_OP] else None
    if op is not None:
        extras.append(op.name)
    if int(vec[_COLL]) == COLLECTIVE_CODES["broadcast"]:
        extras.append(f"root {int(vec[_ROOT])}")
    return text + (f" ({', '.join(extras)})" if extras else "")


def format_ranks(ranks):
    """``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5'``; ``[3]`` -> ``'rank 3'``."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else (f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}"))
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


_FIELDS = ((_SEQ, "call sequence (a rank skipped or added a ddl collective)"), (_COLL, "collective"),
           (_COUNT, "count"), (_ITEMSIZE, "dtype"), (_DT0, "dtype"), (_DT1, "dtype"), (_OP, "op"),
           (_ROOT, "root"), (_SCHED, "schedule (the ranks' algorithm=, planner, pinned schedule or plan cache differ: "
                                              "node-local caches may hold other plans of this size class; give "
                                              "all ranks one DDL_CACHE_DIR or delete the stale plan files)"),
           (_TOPO, "topology"), (_MODE, "check mode"), (_SHAPE, "array shape"))
_MIXED = "collective (the functional allreduce, which compares array shapes, against the buffer API's Allreduce)"


_CALL_FIELDS = (_SEQ, _COLL, _COUNT, _ITEMSIZE, _DT0, _DT1, _OP, _ROOT, _SHAPE)

# The same fields where every rank made a grouped call (see grouped).
_GROUPED_FIELDS = ((_SEQ, _FIELDS[0][1]), (_COUNT, "number of elements"), (_ITEMSIZE, "number of arrays"),
                   (_ROOT, "number of dtypes"), (_SCHED, "the arrays' dtypes or shapes"), (_OP, "op"),
                   (_TOPO, "topology"), (_MODE, "check mode"))


def mismatch_error(table, seq, rank):
    """:class:`ddl.MismatchError` built from the gathered signature vectors (``table[r]`` = rank r's)."""
    table = np.asarray(table)
    groups = {}
    for r, row in enumerate(table):
        groups.setdefault(tuple(int(x) for x in row), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    rows = list(groups)
    # a refusal, or device buffers against host ones: what differs is that (no field list, no digests)
    refused = any(_refused(v) or _device_start(v) for v in rows)
    # The schedule follows from the call (its size class, root ...): it is news only where the calls agree.
    call_differs = any(len({row[idx] for row in rows}) > 1 for idx in _CALL_FIELDS)
    parts = []
    for vec, ranks in ordered:
        text = describe(vec, len(ranks) > 1)
        if len({v[_SEQ] for v in groups}) > 1:
            text += f" as its ddl collective #{vec[_SEQ]}"
        if len({(v[_SCHED], v[_TOPO]) for v in groups}) > 1 and not (refused or call_differs or _grouped(vec)):
            text += f" [schedule {vec[_SCHED]:016x}, topology {vec[_TOPO]:016x}]"
        parts.append(f"{format_ranks(ranks)} called {text}")
    all_grouped = all(_grouped(v) for v in rows)
    differs = []
    for idx, label in () if refused else _GROUPED_FIELDS if all_grouped else _FIELDS:
        if idx == _SCHED and call_differs and not all_grouped:
            continue
        if len({row[idx] for row in rows}) > 1 and label not in differs:
            differs.append(label)
    if all_grouped and differs == [_GROUPED_FIELDS[4][1]]:   # the same totals: an order or a split differs
        differs = ["the arrays' dtypes or shapes, in order (the same totals: arrays in another order, split or "
                   "shaped otherwise)"]
    if "array shape" in differs and not all(row[_SHAPE] for row in rows):
        differs[differs.index("array shape")] = _MIXED
    msg = (f"ranks disagree on ddl collective #{seq} (reported on rank {rank}): " + "; ".join(parts)
           + (f" [differs in: {', '.join(differs)}]" if differs else ""))
    err = MismatchError(msg)
    err.signatures = {r: describe(row) for r, row in enumerate(table)}
    return err


class ShmBoard:
    """The agreement through shared memory, for communicators that live on one node.

    Every rank owns a row of ``DEPTH`` slots in one MPI shared-memory window. To enter collective
    ``seq`` a rank writes its signature vector into slot ``seq % DEPTH`` and then the slot's sequence
    word (last, so a reader that sees the sequence number sees the signature). A rank has agreement on
    ``seq`` when every row shows ``seq`` there: it then compares the rows -- a mismatch is raised on
    every rank from the same table, with no further communication -- and publishes that it is done
    reading (``done[rank] = seq + 1``). A slot is reused only when every rank is done with its previous
    occupant (flow control: a broadcast root may otherwise run ``DEPTH`` collectives ahead).

    Same guarantee as the ``MPI_Iallreduce`` check (one point of agreement per collective, never a
    partial view), but no message and no MPI call: on an oversubscribed node, where every message
    hop costs a scheduling round, it removes ``log2(p)`` hops from every collective. It also tells the
    stall watchdog exactly which ranks have not entered a collective.
    """

    DEPTH = 64
    # Data posted with a signature (inline collectives, see ddl.executor): up to inline_limit(p) bytes per
    # rank, in PAYLOAD_DEPTH slots of their own (so the window stays small: 8 MiB at most) -- or, up to
    # small_limit(p) bytes, in a small slot beside every signature slot: a gradient hook's many small
    # nonblocking calls in flight then wait for slots as seldom as agreements without data do.
    INLINE_MAX = 1 << 20
    INLINE_SLOT = 2 << 20      # bytes of one payload slot, all ranks together
    PAYLOAD_DEPTH = 4
    SMALL_MAX = 1 << 10
    SMALL_SLOT = 64 << 10      # bytes of one small slot, all ranks together (DEPTH of them: 4 MiB at most)

    @classmethod
    def inline_limit(cls, nranks):
        """Bytes a rank may post with a signature: ``min(1 MiB, 2 MiB / p)``, a multiple of 64."""
        return min(cls.INLINE_MAX, cls.INLINE_SLOT // max(nranks, 1)) // 64 * 64

    @classmethod
    def small_limit(cls, nranks):
        """Bytes a rank may post in a small slot: ``min(1 KiB, 64 KiB / p)``, a multiple of 64."""
        return min(cls.SMALL_MAX, cls.SMALL_SLOT // max(nranks, 1)) // 64 * 64

    def __init__(self, comm):
        from mpi4py import MPI
        import platform
        p, D, L = comm.Get_size(), self.DEPTH, SIG_LEN
        self.inline_bytes = self.inline_limit(p)
        self.small_bytes = min(self.small_limit(p), self.inline_bytes)
        W = self.PAYLOAD_DEPTH * p * self.inline_bytes // 8
        S = D * p * self.small_bytes // 8
        self.rank, self.size = comm.Get_rank(), p
        nwords = D * p + D * p * L + 3 * p + W + S  # 2p words: a 32-bit doorbell and a sleep flag per rank
        self.win = MPI.Win.Allocate_shared(nwords * 8 if self.rank == 0 else 0, 8, comm=comm)
        buf, _ = self.win.Shared_query(0)
        words = np.frombuffer(buf, dtype=np.int64, count=nwords)
        if self.rank == 0:
            words[:] = 0
        parts = np.cumsum([0, D * p, D * p * L, p, 2 * p, W, S])
        self.seqs = words[parts[0]:parts[1]].reshape(D, p)               # seq + 1 of each rank's entry
        self.sigs = words[parts[1]:parts[2]].reshape(D, p, L)            # the signature vectors
        self.done = words[parts[2]:parts[3]]                             # agreements each rank finished
        flags = words[parts[3]:parts[4]].view(np.int32)                  # futex words (see executor.Doorbell)
        self.bells = flags[0:2 * p:2]                                     # ... a doorbell per rank
        self.sleeping = flags[2 * p::2]                                   # ... 1 while its rank sleeps on it
        self.inline = words[parts[4]:parts[5]].view(np.uint8).reshape(self.PAYLOAD_DEPTH, p, self.inline_bytes)
        self.small = words[parts[5]:parts[6]].view(np.uint8).reshape(D, p, self.small_bytes)
        # built once so that the hot path is a memory comparison: memoryview == memoryview
        self._seq_views = [memoryview(self.seqs[s]) for s in range(D)]
        self._expect = np.zeros((D, p), np.int64)
        self._expect_views = [memoryview(self._expect[s]) for s in range(D)]
        # ... and this rank's rows, viewed once (a view made per call costs more than a small post's copy)
        self._own_sigs = [memoryview(self.sigs[s, self.rank]) for s in range(D)]
        self._expect_rows = list(self._expect)
        self._own_payload = [memoryview(self.inline[k, self.rank]) for k in range(self.PAYLOAD_DEPTH)]
        self._own_small = [memoryview(self.small[s, self.rank]) for s in range(D)]
        self._posted = {}   # (slot, count, dtype) -> the view posted() returns
        self._min_done = 0
        self._fence = None
        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
            # weakly ordered CPU: MPI_Win_sync is the memory barrier between data and sequence words
            self.win.Lock_all(MPI.MODE_NOCHECK)
            self._fence = self.win.Sync
        comm.Barrier()

    def depth(self, nbytes):
        """How many collectives apart two that post ``nbytes`` each may take the same slot: DEPTH, or
        PAYLOAD_DEPTH for data beyond a small slot."""
        return self.PAYLOAD_DEPTH if nbytes > self.small_bytes else self.DEPTH

    def can_post(self, seq, nbytes=0):
        """Whether slot ``seq`` is free for a post of ``nbytes`` of data: every rank is done with its
        previous occupant (see :meth:`depth`)."""
        depth = self.depth(nbytes)
        if self._min_done > seq - depth:  # done counters only grow: a cached minimum is safe
            return True
        self._min_done = int(self.done.min())
        return self._min_done > seq - depth

    def post(self, seq, vector, data=None):
        """Enter collective ``seq`` with signature ``vector`` (its seq word is overwritten here) and,
        optionally, up to :attr:`inline_bytes` of ``data`` (a contiguous numpy array, or a memoryview of
        its bytes, which copies faster; check ``can_post(seq, data.nbytes)`` first) that every rank can
        read with :meth:`posted` until it calls :meth:`finish`. ``vector``: an int64 array, or a
        memoryview of one."""
        s = seq % self.DEPTH
        if data is not None:
            n = data.nbytes
            if n:
                slot = self._own_small[s] if n <= self.small_bytes else self._own_payload[seq % self.PAYLOAD_DEPTH]
                slot[:n] = data if type(data) is memoryview else data.reshape(-1).view(np.uint8)
        row = self._own_sigs[s]
        row[:] = vector
        row[0] = seq
        self._expect_rows[s].fill(seq + 1)
        if self._fence:
            self._fence()
        self.seqs[s, self.rank] = seq + 1

    def fence(self):
        """Full memory barrier (MPI_Win_sync): makes this rank's post visible before it reads the others'.
        Needed when a rank decides from ``ready`` whether it arrived last (doorbells)."""
        if self._fence is None:
            from mpi4py import MPI
            self.win.Lock_all(MPI.MODE_NOCHECK)
            self._fence = self.win.Sync
        self._fence()

    def ready(self, seq):
        """Every rank has entered ``seq`` (call after :meth:`post`)."""
        s = seq % self.DEPTH
        return self._seq_views[s] == self._expect_views[s]

    def agreed(self, seq):
        """Call once ``ready(seq)``: True when every rank posted the same signature."""
        if self._fence:
            self._fence()
        rows = self.sigs[seq % self.DEPTH]
        return rows.tobytes() == rows[self.rank].tobytes() * self.size

    def posted(self, seq, count, dtype):
        """Every rank's data posted with ``seq``: an array ``(size, count)`` of ``dtype`` (a view). Its
        place follows from its size alone, which is every rank's (``post`` puts it there)."""
        key = (seq % self.DEPTH, count, dtype)
        rows = self._posted.get(key)
        if rows is None:
            if len(self._posted) >= 512:
                self._posted.clear()
            n = count * np.dtype(dtype).itemsize
            area = self.small[key[0]] if n <= self.small_bytes else self.inline[seq % self.PAYLOAD_DEPTH]
            rows = self._posted[key] = area[:, :n].view(dtype)
        return rows

    def table(self, seq):
        return self.sigs[seq % self.DEPTH].copy()

    def finish(self, seq):
        self.done[self.rank] = seq + 1

    def give_up(self, seq):
        """This rank gave up on ``seq`` (StallError) before its agreement settled: mark its row (if it
        posted one), so that a rank arriving later raises too instead of agreeing with the rows the
        others abandoned (and, inline, computing a result from them that nobody else has). One aligned
        word is written: a reader sees the row as it was or with the mark, never half of it."""
        s = seq % self.DEPTH
        if self.seqs[s, self.rank] == seq + 1:
            self.sigs[s, self.rank, _COLL] = GAVE_UP

    def behind(self, seq):
        """The ranks that have not finished the agreement on collective ``seq``."""
        return [r for r in range(self.size) if self.done[r] <= seq]

    def missing(self, seq):
        """``{rank: latest collective it entered (or -1)}`` for the ranks that have not entered ``seq``."""
        col = self.seqs[seq % self.DEPTH]
        return {r: int(self.seqs[:, r].max()) - 1 for r in range(self.size) if col[r] != seq + 1}

    def free(self):
        if self._fence:
            self.win.Unlock_all()
        self._fence = None
        self.win.Free()
