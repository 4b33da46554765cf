"""Host MPI executor: runs a :class:`~ddl.schedule.Schedule` on numpy buffers with nonblocking MPI.

Pieces
------
:class:`CompiledPlan`
    A schedule instantiated for one rank, element count, item size and buffer layout, computed once
    and cached: for every op (ops on empty chunks dropped -- every rank drops the same ones, since
    chunk ranges are identical everywhere) its byte/element ranges, where it reads from, where it
    writes to, its scratch slot, its dependency counter and its dependents.
:class:`Execution`
    One in-flight collective: the user's buffers, the per-call counters, its tag base.
:class:`Engine`
    The progress engine of one :class:`ddl.Communicator`. It owns ONE array of MPI requests for all
    in-flight collectives and drives all of them whenever any ``Wait``/``Test`` is called (with
    ``MPI_Testsome``), so ranks waiting on different requests cannot deadlock.

Execution rules
---------------
* Traffic uses a private duplicate of the user's communicator, so it never matches user messages.
* An op starts only when the ops it depends on (``schedule.dependencies``) have completed.
* Receives are posted early, at the start of the data phase, in program order: a ``recv`` that is the
  first op on its chunk directly into its destination; every ``reduce``, and a ``recv`` that must
  wait for earlier ops on its chunk, into a scratch slot (the reduction is then
  ``ufunc(local, scratch, out=local)``: no temporary). For chunks larger than ``early_limit`` bytes
  (default 256 KiB, env ``DDL_EARLY_LIMIT``) a ``recv`` that has dependencies is posted only when they
  complete, directly into place (large messages use MPI's rendezvous protocol, so posting late costs
  no extra copy, while an early scratch receive would cost one). A ``reduce`` is always posted early:
  its scratch slot costs no copy, and a sender whose rendezvous finds the receive posted streams while
  the receiver is still busy with the chunk (a tree node reducing from several children receives
  from all of them at once, as the cost model assumes). Either way the receives of one chunk from one
  peer are posted in program order (a reduce behind a late receive from the same peer waits too),
  which with MPI's non-overtaking rule pairs the k-th send with the k-th receive exactly as
  ``schedule.matches`` says.
* Sends are issued as soon as their dependencies complete, straight from the buffer (no copy). One
  exception, when the job spans several nodes: sends with no dependencies to ranks of this rank's own
  node leave ``DDL_NODE_WINDOW`` (default 1) at a time, each of the others when an earlier one
  completes (:func:`_pace_node_sends`), since a flood of them through shared memory stops MPICH's
  network progress. Held ones leave at once when their collective has made no progress for 10 ms
  (the stall watchdog looks every 50 ms while a rank waits).
* Reductions of a chunk happen in program order (each waits for the previous write to its chunk), so
  the reduction order -- hence every bit of the result -- is a fixed function of the schedule. The
  operands go in the order :attr:`Schedule.operand_order` gives (``ufunc(scratch, local, out=local)``
  where the incoming one goes first): two ranks that combine the same partial results then compute
  the same bits even where an op is not bitwise commutative (``max(-0.0, +0.0)`` is -0.0 and
  ``max(+0.0, -0.0)`` +0.0; a sum of two NaNs keeps the first one's sign and payload). The verifier
  proves it.
* Tags: ``1 + slot * 2**chunk_bits + chunk`` with ``slot = (seq mod window, signature salt)``, all
  within ``MPI.TAG_UB``; at most ``window - 1`` collectives are in flight per rank (starting another
  first completes the oldest, whose error, if any, waits for its own ``Wait``: see
  :meth:`Engine.admit`), so concurrent collectives never cross. Tag 0 is never used for data.
* Buffers: each chunk has an *initial* location (where this rank's input for it is) and a *home*
  (where its value is written and the result ends). For ``Allreduce(sendbuf, recvbuf)`` the initial
  location is ``sendbuf`` and the home ``recvbuf``: sends before the first write read ``sendbuf``,
  the first reduction is ``ufunc(sendbuf_chunk, incoming, out=recvbuf_chunk)``, so no copy of
  ``sendbuf`` is ever made. Reduce-scatter keeps blocks other than its own in a cached workspace;
  allgather reads its own block from ``sendbuf`` and copies it into ``recvbuf`` once. A schedule
  with spans (several chunks in one message) needs them side by side: there every chunk's input is
  first copied to its home, one copy per contiguous run, before any message moves. These rules are
  :mod:`ddl.buffer_layout`'s, shared with the GPU launch plan.

Inline collectives: on one node (shared-memory agreement, ``check="always"``, ``algorithm="auto"``), a
collective whose per-rank input is at most ``Communicator.inline_bytes`` (``min(1 MiB, 2 MiB / p)``)
does not run its schedule: each rank posts its input beside its signature on the
:class:`~ddl.agreement.ShmBoard`, and once every rank has posted (the agreement) each computes its
result from the posted rows itself, reducing in rank order (:meth:`Engine._inline_result`). No
message at all: on an oversubscribed node every message hop costs a scheduling round, so this is what
makes small collectives cheap. Whether a call goes inline is a function of its signature, so a rank
whose call differs still meets the others on the board and gets the :class:`~ddl.MismatchError`.

Waiting: ``MPI_Testsome`` over all requests (plus the shared-memory agreement board, see
:class:`ddl.agreement.ShmBoard`), and when nothing completed:

* node not oversubscribed (a core per rank): spin a few polls, then ``sched_yield``, then naps backing
  off from 100 us to 1 ms after 2 ms without progress, or after 50 ms while a message above MPI's
  eager size is in flight: some MPIs move such a message only while both ranks are inside MPI (Intel
  MPI between ranks of one host: napping there made a 64 MiB allreduce on 2 ranks 4x slower);
* oversubscribed (more ranks on the node than the CPUs they may run on together, detected; env
  ``DDL_OVERSUBSCRIBED``): a waiting rank must leave the CPU to the rank it waits for: it yields after
  every empty poll, and after 1 ms without progress sleeps on a futex *doorbell* that peers ring when
  they send it a message or complete an agreement (:class:`Doorbell`, x86-64 Linux, one node), or else
  naps 20-200 us. A spinning MPI is what makes 8 ranks on 2 cores slow under any competing load.

Everything is tunable by environment (``DDL_SPIN``, ``DDL_IDLE_SLEEP_AFTER``, ``DDL_IDLE_SLEEP_AFTER_LARGE``,
``DDL_IDLE_NAP``, ``DDL_IDLE_NAP_MAX``, ``DDL_DOORBELL`` (auto, on or off), ``DDL_TIMERSLACK=0`` (or off, no,
false), ``DDL_EARLY_LIMIT``, ``DDL_LARGE_MESSAGE``, ``DDL_NODE_WINDOW``).
"""
import math
import os
import sys
import time
import weakref
from collections import deque

import numpy as np

from .buffer_layout import RECV as RECV_BUFFER, SEND as SEND_BUFFER, WORK, chunk_locations, read_location
from .errors import Error, StallError
from .ops import reduce_quietly
from .schedule import RECV, SEND
from .settings import env_auto_flag, env_flag, env_float, env_int

# compiled op codes
C_SEND, C_RECV_DIRECT, C_RECV_SCRATCH, C_RECV_LATE, C_REDUCE_EARLY, C_REDUCE_LATE = range(6)
# buffer ids
B_SEND, B_RECV, B_WORK, B_SCRATCH = range(4)
# request events
EV_ARRIVE, EV_DONE, EV_LATE_REDUCE, EV_AGREE, EV_GATHER = range(5)

_CODE_NAMES = {C_SEND: "send", C_RECV_DIRECT: "recv", C_RECV_SCRATCH: "recv", C_RECV_LATE: "recv",
               C_REDUCE_EARLY: "reduce", C_REDUCE_LATE: "reduce"}

STATUS_TAG = 7  # on the signature communicator, never the data one
_VIEW_CACHE_BYTES = 1 << 20  # plans up to this size may keep their per-op views (see Engine._views)
_EAGER_TEST = 4096           # sends up to this size are tested for completion right after MPI_Isend
SCRATCH_BYTES = 1 << 30       # scratch kept for reuse, all plans together (env DDL_SCRATCH_BYTES; see ScratchPool)
_RELEASE_HELD = 0.01          # s without progress after which held sends go anyway (Engine._release_held)
_ENGINES = []  # weak references to every live engine of this process (see Engine.poll); a plain list: len() is cheap


def idle_policy(oversubscribed):
    """``(spin, sleep_after, sleep_after_large, nap, nap_max)`` of a waiting rank (see
    :meth:`Engine._drive_until` and the module docstring): ``spin`` empty polls, then ``sched_yield``
    until ``sleep_after`` seconds without progress (``sleep_after_large`` while a large message is in
    flight), then doorbell sleep or naps from ``nap`` to ``nap_max`` seconds. Oversubscribed: yield at
    once, sleep after 1 ms, large messages or not (on the emulated clusters, where the kernel carries the
    links on the same cores, yielding for 50 ms made the interleaved two racks' 64 MiB allreduce 4-11%
    slower). Each can be set by environment."""
    spin = env_int("DDL_SPIN", 0 if oversubscribed else 64, minimum=0)
    sleep_after = env_float("DDL_IDLE_SLEEP_AFTER", 0.001 if oversubscribed else 0.002, minimum=0)
    sleep_after_large = max(sleep_after, env_float("DDL_IDLE_SLEEP_AFTER_LARGE",
                                                    sleep_after if oversubscribed else 0.05, minimum=0))
    nap = env_float("DDL_IDLE_NAP", 0.00002 if oversubscribed else 0.0001, minimum=0)
    nap_max = max(nap, env_float("DDL_IDLE_NAP_MAX", 0.0002 if oversubscribed else 0.001, minimum=0))
    return spin, sleep_after, sleep_after_large, nap, nap_max


def in_flight_everywhere():
    """Every collective in flight on any live engine (communicator) of this process: a buffer that one
    of them still uses is off limits to every communicator (see Communicator._start)."""
    for ref in _ENGINES:
        engine = ref()
        if engine is not None and (engine.inflight or engine.deferred):
            yield from engine.pending()


class TagSpace:
    """How tags are carved out of ``[1, TAG_UB]``: window x salt x chunk bits."""

    def __init__(self, tag_ub):
        bits = max(int(tag_ub + 1).bit_length() - 2, 8)  # 2**bits <= TAG_UB
        self.window_bits = min(5, max(1, bits - 9))
        self.salt_bits = min(6, max(0, bits - self.window_bits - 12))
        self.chunk_bits = bits - self.window_bits - self.salt_bits
        self.window = 1 << self.window_bits
        self.max_chunks = (1 << self.chunk_bits) - 1

    def base(self, seq, salt):
        slot = ((seq & (self.window - 1)) << self.salt_bits) | (salt & ((1 << self.salt_bits) - 1))
        return 1 + (slot << self.chunk_bits)


def _combine(ufunc, v):
    """Reduce the operands of a reduction's views (see :meth:`CompiledPlan.views`) into its output.

    Called while the engine is driven (:meth:`Engine._drive_loop`, :meth:`Engine._poll_while_progress`),
    which hold ``np.errstate(all="ignore")`` for the whole wait: floating-point exceptions are ignored
    (see :func:`ddl.ops.reduce_quietly`) at the cost of one errstate per wait, not one per reduction."""
    if v[1] is None:                   # a span whose members take different operand orders
        for a, b, out in v[2]:
            reduce_quietly(ufunc, a, b, out)
    else:
        reduce_quietly(ufunc, v[1], v[2], v[3])


@np.errstate(all="ignore")   # see ddl.ops.reduce_quietly (as a decorator: half the cost of a with block)
def _reduce_rows(ufunc, rows, out):
    """``out = rows[0] op rows[1] op ... op rows[-1]``, in that order (inline collectives)."""
    ufunc(rows[0], rows[1], out=out)
    for r in range(2, len(rows)):
        reduce_quietly(ufunc, out, rows[r], out)


class CompiledPlan:
    """A schedule instantiated for (rank, count, itemsize, layout); see the module docstring."""

    def __init__(self, schedule, rank, count, dtype, layout, ufunc=None, early_limit=None, node_peers=(),
                 node_window=None):
        self.schedule, self.rank, self.count, self.dtype, self.layout = schedule, rank, count, dtype, layout
        self.ufunc = ufunc
        isz = self.itemsize = np.dtype(dtype).itemsize
        if early_limit is None:
            early_limit = plan_settings()[0]
        n = schedule.nranks
        nchunks = schedule.nchunks
        # initial location and home of every chunk id (ddl.buffer_layout), with our buffer numbers
        ranges, locs, precopies = chunk_locations(schedule, rank, count, layout)
        buffer_id = {SEND_BUFFER: B_SEND, RECV_BUFFER: B_RECV, WORK: B_WORK}
        locs = [tuple(None if at is None else (buffer_id[at[0]], at[1]) for at in loc[:2]) + loc[2:] for loc in locs]
        init, home, needed = zip(*locs)
        self.needs_work = layout == "reduce_scatter" and n > 1
        self.precopies = [(buffer_id[sb], so, buffer_id[db], do, ln) for sb, so, db, do, ln in precopies]

        program = schedule.programs[rank]
        deps = schedule.dependencies[rank]
        operand_order = schedule.operand_order_of(rank)
        keep = [i for i, op in enumerate(program) if ranges[op.chunk, 1] > ranges[op.chunk, 0]]
        new_index = {old: k for k, old in enumerate(keep)}
        written = [False] * nchunks
        ops, need0, dependents, early, orig = [], [], [[] for _ in keep], [], []
        late_from = set()  # (chunk, peer) of receives posted late
        scratch = 0
        for k, i in enumerate(keep):
            kind, c, peer = program[i]
            e0, e1 = int(ranges[c, 0]), int(ranges[c, 1])
            ln = e1 - e0
            hb, ho = home[c]
            current = read_location(schedule, locs, written, c)
            if current is None and kind != RECV:
                raise Error(f"schedule {schedule!r}: rank {rank} op {i} uses chunk {c} before it holds data")
            sb, so = current or home[c]
            # a dependency dropped (an empty chunk) can only be one through a chunk of this span that is empty
            my_deps = [new_index[d] for d in deps[i] if d in new_index]
            for d in my_deps:
                dependents[d].append(k)
            nd = len(my_deps)
            scr = (0, 0)
            if kind == SEND:
                code = C_SEND
                need = nd
            else:
                small = ln * isz <= early_limit
                if kind == RECV:
                    code = C_RECV_DIRECT if nd == 0 else (C_RECV_SCRATCH if small else C_RECV_LATE)
                    if code == C_RECV_LATE:
                        late_from.add((c, peer))
                else:
                    # early even when large: its scratch costs no copy, and the sender can stream
                    # while this rank is still busy with the chunk (late only behind a late receive
                    # from the same peer, whose message must match first)
                    code = C_REDUCE_LATE if (c, peer) in late_from else C_REDUCE_EARLY
                if code in (C_RECV_SCRATCH, C_REDUCE_EARLY, C_REDUCE_LATE):
                    scr = (scratch, scratch + ln)
                    scratch += ln
                if code in (C_RECV_DIRECT, C_RECV_SCRATCH, C_REDUCE_EARLY):
                    early.append(k)
                    need = nd + 1  # +1: the arrival of the message
                else:
                    need = nd
                for m in schedule.members(c):
                    written[m] = True
            # (code, peer, chunk, read buf, read e0, read e1, home buf, home e0, home e1, scratch e0, scratch e1,
            #  read b0, read b1, home b0, home b1, scratch b0, scratch b1, incoming first: a bool, or
            #  (start, stop, first) per member of a span whose members differ)
            first = operand_order[i]
            if isinstance(first, tuple):
                first = tuple((int(ranges[m, 0]) - e0, int(ranges[m, 1]) - e0, f)
                              for m, f in zip(schedule.members(c), first))
            ops.append((code, peer, c, sb, so, so + ln, hb, ho, ho + ln, scr[0], scr[1],
                        so * isz, (so + ln) * isz, ho * isz, (ho + ln) * isz, scr[0] * isz, scr[1] * isz, first))
            need0.append(need)
            orig.append(i)
        self.ops = ops
        self.need0 = need0
        self.dependents = [tuple(d) for d in dependents]
        self.early = early
        self.ready0 = [k for k, nd in enumerate(need0) if nd == 0]
        if node_window is None:
            node_window = plan_settings()[2]
        self.held, self.paced = _pace_node_sends(ops, self.ready0, node_peers, node_window)
        if self.held:
            held = set(self.held)
            self.ready0 = [k for k in self.ready0 if k not in held]
        self.original_index = orig
        self.scratch_elems = scratch
        # bytes of one call's (scratch, work) pair (see resources, ScratchPool)
        self.resource_bytes = (scratch + (self.count if self.needs_work else 0)) * isz
        # chunks needed here but never written: copy initial -> home (e.g. allgather's own block, 1 rank)
        copies = []
        for c in range(nchunks):
            e0, e1 = int(ranges[c, 0]), int(ranges[c, 1])
            if needed[c] and not written[c] and e1 > e0 and init[c] is not None and init[c] != home[c]:
                copies.append((init[c][0], init[c][1], home[c][0], home[c][1], e1 - e0))
        self.copies = copies
        self.nops = len(ops)
        self.max_chunk = schedule.nids
        # messages above MPI's eager size need both sides' progress (rendezvous): see Doorbell
        large = plan_settings()[1]
        self.large = any(o[12] - o[11] > large or o[14] - o[13] > large for o in ops)
        self.cache_views = count * isz <= _VIEW_CACHE_BYTES   # see Engine._views

    def views(self, bufs):
        """Per op: its message buffer (bytes) and, for local work, its typed operands (see
        :meth:`Engine._views`, which keeps the last call's)."""
        byts = [None if b is None else b.view(np.uint8) for b in bufs]
        scr_b, scr_t = byts[B_SCRATCH], bufs[B_SCRATCH]
        vs = []
        for o in self.ops:
            code = o[0]
            if code == C_SEND:
                vs.append((byts[o[3]][o[11]:o[12]],))
            elif code == C_RECV_DIRECT or code == C_RECV_LATE:
                vs.append((byts[o[6]][o[13]:o[14]],))
            elif code == C_RECV_SCRATCH:
                vs.append((scr_b[o[15]:o[16]], scr_t[o[9]:o[10]], bufs[o[6]][o[7]:o[8]]))
            else:  # reductions: message into scratch; out = local (initial or home) op incoming, or
                # incoming op local (Schedule.operand_order); per member where a span's members differ
                local, incoming, out = bufs[o[3]][o[4]:o[5]], scr_t[o[9]:o[10]], bufs[o[6]][o[7]:o[8]]
                if isinstance(o[17], tuple):
                    vs.append((scr_b[o[15]:o[16]], None, [(incoming[a:b], local[a:b], out[a:b]) if f else
                                                          (local[a:b], incoming[a:b], out[a:b])
                                                          for a, b, f in o[17]], None))
                else:
                    vs.append((scr_b[o[15]:o[16]], *((incoming, local) if o[17] else (local, incoming)), out))
        return vs

    def resources(self):
        """A fresh (scratch, work) pair for one call (see :class:`ScratchPool`, which reuses them)."""
        scratch = np.empty(self.scratch_elems, self.dtype) if self.scratch_elems else None
        work = np.empty(self.count, self.dtype) if self.needs_work else None
        return scratch, work

    def describe_op(self, k):
        code, peer, c = self.ops[k][:3]
        i = self.original_index[k]
        word = "to" if code == C_SEND else "from"
        return f"op {i} ({_CODE_NAMES[code]} chunk {c} {word} rank {peer})"


class ScratchPool:
    """The (scratch, work) arrays of finished calls, kept for the next call of the same plan: fresh
    large arrays cost page faults, and a training loop calls the same sizes every step. A plan keeps
    up to ``per_plan`` pairs (calls of it in flight at once), and all plans together at most
    ``budget`` bytes and ``plans`` plans, the least recently used dropped first (but never the plan
    just released, however large): a job whose sizes vary (a plan per exact count) would otherwise hold
    scratch, and the plans, for every size it has seen. Plans without scratch are not kept at all."""

    def __init__(self, budget, per_plan=4, plans=256):
        self.budget, self.per_plan, self.plans = budget, per_plan, plans
        self.free = {}         # plan -> its free pairs; in order of last release, oldest first
        self.nbytes = 0

    def acquire(self, plan):
        pairs = self.free.get(plan)
        if not pairs:
            return plan.resources()
        self.nbytes -= plan.resource_bytes
        pair = pairs.pop()
        if not pairs:
            del self.free[plan]
        return pair

    def release(self, plan, pair):
        if not plan.resource_bytes:    # nothing to reuse (a plan without scratch): keep no reference to it
            return
        pairs = self.free.pop(plan, [])
        if len(pairs) < self.per_plan:
            pairs.append(pair)
            self.nbytes += plan.resource_bytes
        self.free[plan] = pairs
        while (self.nbytes > self.budget or len(self.free) > self.plans) and len(self.free) > 1:
            oldest = next(iter(self.free))
            self.nbytes -= len(self.free.pop(oldest)) * oldest.resource_bytes

    def clear(self):
        self.free.clear()
        self.nbytes = 0


def plan_settings():
    """``(DDL_EARLY_LIMIT, DDL_LARGE_MESSAGE)`` in bytes and ``DDL_NODE_WINDOW`` (messages): read as a
    plan is compiled, and when a communicator is made, so that a typo fails there and then on every
    node."""
    return (env_int("DDL_EARLY_LIMIT", 256 * 1024, minimum=0), env_int("DDL_LARGE_MESSAGE", 16 * 1024, minimum=0),
            env_int("DDL_NODE_WINDOW", 1, minimum=0))


def _pace_node_sends(ops, ready, node_peers, window):
    """``(held, paced)``: which of the sends ready at the start (``ready``, compiled op indices) wait
    for an earlier one, and the set of all those that are paced.

    Paced are the sends ready at the start that go to ranks of this node (``node_peers``) and are too
    large to be sent eagerly: the first ``window`` leave at once, each of the others (``held``, program
    order) when a paced one completes (see :meth:`Engine._complete`). Why: such sends have no
    dependency, so without a window all of them leave together -- tens of MiB through shared memory at
    the start of a tree-packing allreduce -- and MPICH's progress engine skips its network progress in
    every poll that moved shared-memory data. The rank that gathers its node's sums for other nodes
    then sent and received nothing over the network for the first ~150 ms of a 64 MiB allreduce on the
    emulated two racks (``ddl bench --trace``). ``window`` 0 (or no node peers) paces nothing."""
    if not window or not node_peers:
        return [], frozenset()
    paced = [k for k in ready if ops[k][0] == C_SEND and ops[k][1] in node_peers and ops[k][12] - ops[k][11] > _EAGER_TEST]
    return paced[window:], frozenset(paced)


class Execution:
    """One collective in flight (see :class:`Engine`)."""

    __slots__ = ("held", "plan", "seq", "sig", "sig_hash", "check", "salt", "tag_base", "bufs", "views", "need",
                 "remaining", "state", "error", "done", "check_buf", "gather_buf", "resources", "finish",
                 "t_start", "t_progress", "warned", "label", "agree_done", "engine", "inline", "extents",
                 "on_error")

    def __init__(self, plan, seq, sig, check, label, sendbuf, recvbuf, finish=None):
        self.plan, self.seq, self.sig, self.check, self.label = plan, seq, sig, check, label
        self.bufs = [sendbuf, recvbuf, None, None]
        self.views = None
        self.need = None
        self.remaining = -1
        self.state = "new"
        self.error = None
        self.done = False
        self.finish = finish
        self.resources = None
        self.warned = False
        self.agree_done = False
        self.check_buf = self.gather_buf = None
        self.inline = None  # a collective small enough to ride on the agreement board: what it posts
        self.extents = None  # (send, recv) address ranges, once a later call asks (see Communicator._start)
        self.on_error = None  # called when its error is raised to the user (see Engine._deliver)
        self.held = None  # sends to ranks of this node not yet released (see _pace_node_sends)


class Doorbell:
    """Futex doorbells in the shared-memory board: an idle rank sleeps in the kernel until a peer rings.

    On a node with more ranks than cores, a waiting rank must get off the CPU (a spinning one steals the
    core of the rank it waits for), but a nap costs its length in latency on every message hop. With a
    doorbell the waiting rank reads its bell, polls MPI once more, and sleeps on the bell (``FUTEX_WAIT``
    with a timeout); a rank that sends it a message, or completes the agreement, increments the bell
    and wakes it (``FUTEX_WAKE``). The futex protocol (the kernel compares the value under its lock)
    loses no wake-up; the timeout (2 ms) is only a safety net and keeps the stall watchdog ticking.
    Eager messages are in the receiver's shared-memory queue when ``MPI_Isend`` returns, so a woken
    rank finds them; transfers that need several MPI handshakes (large messages) make the engine fall
    back to short naps while they are in flight.
    """

    SYS_FUTEX = {"x86_64": 202, "amd64": 202}
    TIMEOUT = 0.002

    def __init__(self, board, rank):
        import ctypes
        import platform
        self.nr = self.SYS_FUTEX[platform.machine().lower()]
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int]

        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        sec = int(self.TIMEOUT)
        self._timeout = ctypes.byref(Timespec(sec, int((self.TIMEOUT - sec) * 1e9)))
        bells = board.bells                        # int32 views, one word per rank, stride 8 bytes
        base = bells.ctypes.data
        step = bells.strides[0] // 4
        self.addr = [base + r * bells.strides[0] for r in range(board.size)]
        self.rank = rank
        # plain memoryview over the words: reading/bumping a bell costs ~0.1 us instead of numpy's ~1 us
        raw = np.frombuffer(bells.base, dtype=np.int32)
        self._words = memoryview(bells.base).cast("B").cast("i")
        offset = (base - raw.ctypes.data) // 4
        self._idx = [offset + r * step for r in range(board.size)]
        foffset = (board.sleeping.ctypes.data - raw.ctypes.data) // 4
        self._flag = [foffset + r * step for r in range(board.size)]
        self._me = self._idx[rank]
        self._my_flag = self._flag[rank]

    @classmethod
    def supported(cls):
        import platform
        return platform.machine().lower() in cls.SYS_FUTEX

    def value(self):
        return self._words[self._me]

    def ring(self, r):
        i = self._idx[r]
        w = self._words
        w[i] = (w[i] + 1) & 0x7FFFFFFF  # not atomic: two ringers may both write v+1, which still wakes it
        if w[self._flag[r]]:            # the wake system call only when the peer sleeps (or is about to)
            self._syscall(self.nr, self.addr[r], 1, 0x7FFFFFFF, None, None, 0)  # FUTEX_WAKE (shared)

    def wait(self, value):
        """Sleep until the bell differs from ``value`` (rung), or the timeout.

        The sleep flag is raised before the caller's last poll (see Engine._drive_until) and the kernel
        compares the bell under its lock, so a ring that happens after ``value`` was read either is
        seen by that poll, or changes the bell before the sleep (no sleep), or finds the flag raised
        and wakes us. (A ringer could read a stale flag only within a store-buffer drain, far shorter
        than the poll in between; the timeout bounds even that.)"""
        self._syscall(self.nr, self.addr[self.rank], 0, value, self._timeout, None, 0)  # FUTEX_WAIT
        self._words[self._my_flag] = 0

    def prepare(self):
        """Raise the sleep flag and return the bell's value (then poll once more, then :meth:`wait`)."""
        self._words[self._my_flag] = 1
        return self._words[self._me]

    def cancel(self):
        self._words[self._my_flag] = 0


def _no_pause():
    pass


class Engine:
    """Progress engine of one communicator: owns every in-flight collective and their requests.

    ``board`` is a :class:`ddl.agreement.ShmBoard` when the communicator lives on one node (the
    agreement then goes through shared memory), else None (``MPI_Iallreduce``). ``oversubscribed``
    says that this node runs more ranks than it has cores: waiting ranks then sleep on their doorbell
    (or nap) at once instead of spinning, so the ranks that have work get the cores.
    """

    QUICK_POLLS = 16  # see settle_alone
    hooked = False  # True while ddl.trace hooks this engine's entry points: Communicator._allreduce_quick,
    #                 which passes them by, then stays off

    def __init__(self, pcomm, gcomm, stall_warning, stall_timeout, board=None, oversubscribed=False,
                 scratch_bytes=SCRATCH_BYTES):
        from mpi4py import MPI
        self.MPI = MPI
        self.pcomm, self.gcomm, self.board = pcomm, gcomm, board
        self.rank, self.size = pcomm.Get_rank(), pcomm.Get_size()
        self.tags = TagSpace(pcomm.Get_attr(MPI.TAG_UB) or 32767)
        self.stall_warning, self.stall_timeout = stall_warning, stall_timeout
        self.reqs = []      # MPI requests (completed ones become REQUEST_NULL until compaction)
        self.owners = []    # parallel: (execution, op index, event) or None
        self.nactive = 0
        self.inflight = {}  # seq -> Execution, in start order
        self.agree_queue = []  # checked executions in start order; results processed in that order
        self.deferred = deque()  # executions posted but not started yet, in call order (see start)
        self.broken = None
        self._testsome = MPI.Request.Testsome
        self._isend = pcomm.Isend
        self._irecv = pcomm.Irecv
        self._now = self._last_drive = time.monotonic()
        self._status_sent = set()
        self._status = {}
        self._status_reqs = []
        self._last_status_poll = 0.0
        self.oversubscribed = oversubscribed
        self.spin, self.sleep_after, self.sleep_after_large, self.nap, self.nap_max = idle_policy(oversubscribed)
        if env_flag("DDL_TIMERSLACK", True) and oversubscribed:   # (read either way: a typo fails everywhere)
            _tight_timer_slack()
        use_bell = env_auto_flag("DDL_DOORBELL")
        self.bell = None
        if board is not None and Doorbell.supported() and (oversubscribed if use_bell is None else use_bell):
            self.bell = Doorbell(board, self.rank)
        self._large = 0  # in-flight collectives with multi-handshake (large) messages: no doorbell sleep
        self.scratch = ScratchPool(scratch_bytes)
        self._last_views = None  # (plan, its four buffers, their views) of the last call: see _views
        self._to_ring = set()  # peers sent to since the last flush (a woken peer may preempt us at once,
        #                         so we ring after issuing all the sends of a round of work)
        _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None] + [weakref.ref(self)]

    # ---- starting ---------------------------------------------------------------------------------
    def admit(self, plan):
        """Everything that may refuse a new collective (of ``plan``; None: agreement only), done before
        the caller gives it a sequence number: a call that raises here was never posted, so it must not
        have used one up either (the other ranks would then pair their next call with this rank's
        following one)."""
        if self.broken is not None:
            raise Error(f"this ddl communicator is unusable after an earlier failure: {self.broken}")
        if plan is not None and plan.max_chunk > self.tags.max_chunks:
            raise Error(f"schedule has {plan.max_chunk} chunks; this MPI's TAG_UB allows at most "
                        f"{self.tags.max_chunks}: plan with fewer chunks")

    def start(self, ex, blocking=False):
        """Post ``ex`` (:meth:`admit` first; nothing here refuses it); ``blocking``: the caller waits for it
        next (see :meth:`_inline_alone`).

        Posting never waits for another rank, as MPI's nonblocking collectives promise: where ``ex``
        cannot start yet (see :meth:`_has_room`), or an earlier call still waits, it joins
        ``deferred`` and starts, in call order, from a later poll. Waiting here instead deadlocked
        ranks that post to two communicators in different orders (rank 0 fills one communicator's
        board while rank 1 fills the other's, each waiting for the other to enter)."""
        if self.deferred or not self._has_room(ex):
            ex.engine = self
            ex.state = "deferred"
            ex.t_start = ex.t_progress = time.monotonic()
            self.deferred.append(ex)
            return
        self._begin(ex, blocking)

    def _has_room(self, ex):
        """Whether ``ex`` may start now: its tag slot (``seq`` modulo the tag window) is not still used by
        an earlier collective in flight, and, with the agreement on the shared-memory board, every rank
        is done with the board slot it takes (a peer may be up to DEPTH collectives behind, and
        PAYLOAD_DEPTH behind for an inline one with more data than a small slot: ShmBoard.depth)."""
        inflight = self.inflight
        if inflight and ex.seq - next(iter(inflight)) >= self.tags.window:
            return False
        return not ex.check or self.board is None or \
            self.board.can_post(ex.seq, 0 if ex.inline is None else ex.inline.nbytes)

    def _start_deferred(self):
        """Start the deferred collectives that have room now, in call order; True if one started. On a
        communicator that failed they fail too (their waits raise), instead of waiting for ever."""
        q = self.deferred
        if self.broken is not None:
            err = Error(f"this ddl communicator is unusable after an earlier failure: {self.broken}")
            while q:
                self._fail(q.popleft(), err)
            return True
        started = False
        while q and self._has_room(q[0]):
            self._begin(q.popleft())
            started = True
        return started

    def pending(self):
        """Every collective posted here and not done: those in flight, then the deferred ones."""
        return list(self.inflight.values()) + list(self.deferred)

    def _begin(self, ex, blocking=False):
        if blocking and ex.inline is not None and ex.check and not self.inflight:   # (room: see start)
            self._inline_alone(ex)
            return
        self._register(ex)
        if not ex.check:
            self._start_data(ex)
            if self._to_ring:
                self._flush_rings()
            return
        ex.state = "agreement"
        board = self.board
        if board is not None:
            self._post_board(ex.seq, ex.sig.vector, ex.inline)
            self.agree_queue.append(ex)
            self._poll_board()
            if self._to_ring:
                self._flush_rings()
        else:
            ex.check_buf = buf = _check_buffer(ex.sig_hash)
            self._add(self.pcomm.Iallreduce(buf[:2], buf[2:], self.MPI.MAX), (ex, -1, EV_AGREE))
            self.agree_queue.append(ex)

    def _register(self, ex):
        """``ex`` is in flight: the watchdog sees it, :meth:`wait` drives it."""
        ex.engine = self
        ex.tag_base = self.tags.base(ex.seq, ex.salt)
        ex.t_start = ex.t_progress = time.monotonic()
        self.inflight[ex.seq] = ex

    def _post_board(self, seq, vector, data):
        """Enter collective ``seq`` (signature ``vector``, inline input ``data`` or None) on the agreement
        board; ring the peers' doorbells (at the next flush) when this rank arrived last."""
        board = self.board
        board.post(seq, vector, data)
        if self.bell is not None:
            board.fence()  # of two ranks arriving together, at least one sees it is last
            if board.ready(seq):
                self._to_ring.update(r for r in range(self.size) if r != self.rank)

    def _inline_alone(self, ex):
        """A blocking inline collective with nothing else in flight: :meth:`settle_alone`; one it could
        not settle is registered and left to :meth:`wait` (watchdog, sleep, the error on every rank)."""
        try:
            settled = self.settle_alone(ex.seq, ex.plan, ex.sig.vector, ex.inline, ex.bufs[B_RECV])
        except Exception as exc:   # pragma: no cover - local numpy work; no message is pending
            self._fail(ex, exc)
            return
        if settled:
            self._finish(ex)
        else:
            self.await_agreement(ex)

    def settle_alone(self, seq, plan, vector, inline, recv):
        """Post inline collective ``seq`` of ``plan`` (nothing else in flight, room on the board: see
        :meth:`start`) and poll only its board slot, up to ``QUICK_POLLS`` times. True: every rank
        posted the same signature, and the result is in ``recv`` (the slot is finished). False: the
        slot was not ready by then, or the signatures differ; the collective is posted, and its
        Execution must go to :meth:`await_agreement`.

        Its result depends on nothing but the board, so the general machinery (registration, MPI
        requests, other communicators, the idle clock) would only cost: on an oversubscribed node every
        poll is a time slice that the ranks that have not posted yet could use, and a short, warm path
        hands them the core sooner (8 ranks on 2 cores: about 20% off an 8-byte Allreduce)."""
        board = self.board
        self._post_board(seq, vector, inline)
        if self._to_ring:
            self._flush_rings()
        ready = board.ready
        pause = os.sched_yield if self.oversubscribed else _no_pause
        for _ in range(self.QUICK_POLLS):
            if ready(seq):
                if not board.agreed(seq):
                    return False
                self._settle_slot(plan, seq, recv)
                return True
            pause()
        return False

    def await_agreement(self, ex):
        """``ex``, posted on the board by :meth:`settle_alone` and not settled there, joins the books."""
        self._register(ex)
        ex.state = "agreement"
        self.agree_queue.append(ex)
        self._poll_board()

    def close(self):
        """The communicator was freed: stop being driven by the other engines."""
        _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None and ref() is not self]
        self.broken = self.broken or "the communicator was freed"
        self.scratch.clear()
        self._last_views = None

    def _add(self, req, owner):
        self.reqs.append(req)
        self.owners.append(owner)
        self.nactive += 1

    def _start_data(self, ex):
        plan = ex.plan
        ex.state = "data"
        if plan is None:  # barrier: the agreement was all of it
            self._finish(ex)
            return
        if plan.nops == 0:
            bufs = ex.bufs
            for sb, so, hb, ho, ln in plan.copies:
                bufs[hb][ho:ho + ln] = bufs[sb][so:so + ln]
            self._finish(ex)
            return
        if plan.large:
            self._large += 1
        res = ex.resources = self.scratch.acquire(plan)
        bufs = ex.bufs
        bufs[B_SCRATCH], bufs[B_WORK] = res[0], res[1]
        views = ex.views = self._views(plan, bufs)
        ex.need = plan.need0.copy()
        ex.remaining = plan.nops
        ops = plan.ops
        tb = ex.tag_base
        irecv = self._irecv
        reqs, owners = self.reqs, self.owners
        for sb, so, hb, ho, ln in plan.precopies:     # before any receive may land at home
            bufs[hb][ho:ho + ln] = bufs[sb][so:so + ln]
        for k in plan.early:
            o = ops[k]
            reqs.append(irecv(views[k][0], o[1], tb + o[2]))
            owners.append((ex, k, EV_ARRIVE))
        self.nactive += len(plan.early)
        if plan.held:
            ex.held = deque(plan.held)
        if plan.ready0:
            self._run(ex, plan.ready0.copy())
        for sb, so, hb, ho, ln in plan.copies:
            bufs[hb][ho:ho + ln] = bufs[sb][so:so + ln]
        if ex.remaining == 0:
            self._finish(ex)

    def _views(self, plan, bufs):
        """``plan.views(bufs)``, reused when the last call was this plan's on the same buffers (a training
        loop passes the same arrays every step, and slicing is most of the per-op cost of a small
        collective). Only the LAST call's views are kept, on the engine: they hold that call's arrays
        and scratch, and a cache per plan (up to 256) kept every array ever passed alive, and scratch
        beyond the ScratchPool's budget. Holding the arrays also keeps their identity from being reused
        while the entry lives."""
        last = self._last_views
        if (last is not None and last[0] is plan and last[1] is bufs[0] and last[2] is bufs[1]
                and last[3] is bufs[2] and last[4] is bufs[3]):
            return last[5]
        vs = plan.views(bufs)
        self._last_views = (plan, bufs[0], bufs[1], bufs[2], bufs[3], vs) if plan.cache_views else None
        return vs

    # ---- dataflow ---------------------------------------------------------------------------------
    def _run(self, ex, ready):
        """Fire every op in ``ready`` (their counters hit zero) and whatever they make ready, FIFO."""
        plan = ex.plan
        ops, dependents = plan.ops, plan.dependents
        need, views = ex.need, ex.views
        tb = ex.tag_base
        reqs, owners = self.reqs, self.owners
        i = 0
        while i < len(ready):
            k = ready[i]
            i += 1
            o = ops[k]
            code = o[0]
            if code == C_SEND:
                req = self._isend(views[k][0], o[1], tb + o[2])
                if self.bell is not None:
                    self._to_ring.add(o[1])   # rung after this round of work (_flush_rings)
                if o[12] - o[11] <= _EAGER_TEST and req.Test():
                    # an eager send is usually complete on return (copied into the peer's queue):
                    # finish it now instead of tracking a request and dispatching its completion later
                    ex.remaining -= 1
                    for j in dependents[k]:
                        need[j] -= 1
                        if need[j] == 0:
                            ready.append(j)
                    continue
                reqs.append(req)
                owners.append((ex, k, EV_DONE))
                self.nactive += 1
                continue
            if code == C_RECV_LATE:
                reqs.append(self._irecv(views[k][0], o[1], tb + o[2]))
                owners.append((ex, k, EV_DONE))
                self.nactive += 1
                continue
            if code == C_REDUCE_LATE:
                reqs.append(self._irecv(views[k][0], o[1], tb + o[2]))
                owners.append((ex, k, EV_LATE_REDUCE))
                self.nactive += 1
                continue
            if code == C_REDUCE_EARLY:
                _combine(plan.ufunc, views[k])
            elif code == C_RECV_SCRATCH:
                v = views[k]
                v[2][...] = v[1]
            # completed locally
            ex.remaining -= 1
            for j in dependents[k]:
                need[j] -= 1
                if need[j] == 0:
                    ready.append(j)

    def _complete(self, ex, k):
        ex.remaining -= 1
        ready = None
        need = ex.need
        if ex.held and k in ex.plan.paced:
            ready = [ex.held.popleft()]     # the next paced send (see _pace_node_sends)
        for j in ex.plan.dependents[k]:
            need[j] -= 1
            if need[j] == 0:
                if ready is None:
                    ready = [j]
                else:
                    ready.append(j)
        if ready is not None:
            self._run(ex, ready)
        if ex.remaining == 0:
            self._finish(ex)

    def _finish(self, ex):
        try:
            if ex.finish is not None:
                ex.finish(ex.bufs[B_RECV])
        except Exception as exc:  # pragma: no cover - finishing is local numpy work
            ex.error = exc
        if ex.resources is not None:
            self.scratch.release(ex.plan, ex.resources)
            ex.resources = None
            if ex.plan.large:
                self._large -= 1
        ex.bufs = ex.views = None
        ex.state = "done"
        ex.done = True
        self.inflight.pop(ex.seq, None)   # (an inline collective settled alone was never registered)

    def _fail(self, ex, exc):
        ex.error = exc
        if ex.resources is not None and ex.plan.large:
            self._large -= 1
        ex.resources = None  # requests may still write into them: never reuse
        ex.state = "failed"
        ex.done = True
        self.inflight.pop(ex.seq, None)

    # ---- agreement --------------------------------------------------------------------------------
    def _agreement_ready(self):
        """MPI path: process finished checks in start order (Iallgathers must start in the same order)."""
        q = self.agree_queue
        while q and q[0].agree_done:
            ex = q.pop(0)
            buf = ex.check_buf
            if buf[2] == -buf[3]:
                self._start_data(ex)
            else:
                vec = ex.sig.with_seq(ex.seq)
                ex.gather_buf = (vec, np.empty((self.size, vec.size), np.int64))
                ex.state = "mismatch"
                self._add(self.gcomm.Iallgather(vec, ex.gather_buf[1]), (ex, -1, EV_GATHER))

    def _poll_board(self):
        """Shared-memory path: settle every check at the head of the queue whose rows are all posted."""
        q = self.agree_queue
        board = self.board
        progressed = False
        while q and board.ready(q[0].seq):
            ex = q.pop(0)
            progressed = True
            if ex.state == "failed":   # given up (stall) while it waited here: only free the slot
                board.finish(ex.seq)
                continue
            ex.t_progress = self._now
            if board.agreed(ex.seq):
                if ex.inline is not None:
                    self._finish_inline(ex)
                else:
                    board.finish(ex.seq)
                    self._start_data(ex)
            else:
                from .agreement import gave_up
                table = board.table(ex.seq)
                board.finish(ex.seq)
                quitters = gave_up(table)
                if quitters:
                    self._abandoned(ex, quitters)
                else:
                    self._mismatched(ex, table)
        return progressed

    def _mismatched(self, ex, table):
        """The ranks' signatures of ``ex`` differ (``table``, one row per rank): it fails with the
        MismatchError that says how. Where some rank called ``Free`` there, that rank has let go of the
        communicator, so this one is unusable too: its next call (its own ``Free`` included) ends at
        once instead of waiting ``stall_timeout`` for a rank that is gone."""
        from .agreement import format_ranks, freed_by, mismatch_error
        self._fail(ex, mismatch_error(table, ex.seq, self.rank))
        freers = freed_by(table)
        if freers and self.rank not in freers:
            self.broken = f"MismatchError in collective #{ex.seq}, where {format_ranks(freers)} freed the communicator"

    def _abandoned(self, ex, quitters):
        """Ranks ``quitters`` gave up on ``ex`` (StallError) before every rank had entered it (this one,
        or another still on its way): it fails here too, with a StallError naming them, and the
        communicator is unusable, as theirs are."""
        from .agreement import format_ranks
        one = len(quitters) == 1
        err = StallError(f"{ex.label} (ddl collective #{ex.seq}) on rank {self.rank}: {format_ranks(quitters)} "
                         f"gave up on it (StallError: {'its' if one else 'their'} stall_timeout passed before "
                         f"every rank had entered it) and will not take part; this communicator is unusable "
                         f"now, as on {'that rank' if one else 'those ranks'}")
        err.seq = ex.seq
        self.broken = f"StallError in collective #{ex.seq} ({format_ranks(quitters)} gave up on it)"
        self._fail(ex, err)

    def _finish_inline(self, ex):
        try:
            self._settle_slot(ex.plan, ex.seq, ex.bufs[B_RECV])
        except Exception as exc:   # pragma: no cover - local numpy work; no message is pending
            self._fail(ex, exc)
            return
        self._finish(ex)

    def _settle_slot(self, plan, seq, recv):
        """The result of inline collective ``seq`` (agreed) into ``recv``; its board slot is then finished,
        also where computing the result raised."""
        try:
            self._inline_result(plan, seq, recv)
        finally:
            self.board.finish(seq)

    def _inline_result(self, plan, seq, recv):
        """Inline collective ``seq`` of ``plan``: every rank posted its input with its signature, so the
        agreement is the whole collective. Each rank computes its result (into ``recv``) from the
        posted rows itself; reductions go in rank order (row 0 op row 1, then op row 2, ...): the same
        expression on every rank, bitwise identical results."""
        layout, p, rank = plan.layout, self.size, self.rank
        recv = recv.reshape(-1)
        if layout == "broadcast":
            root = plan.schedule.root
            if rank != root:
                recv[...] = self.board.posted(seq, plan.count, plan.dtype)[root]
            return
        if layout.startswith("allgather"):
            n = plan.count // p
            recv.reshape(p, n)[...] = self.board.posted(seq, n, plan.dtype)
            return
        rows = self.board.posted(seq, plan.count, plan.dtype)
        out = recv
        if layout.startswith("reduce_scatter"):   # the in-place finisher moves block `rank` to the front
            n = plan.count // p
            rows = rows[:, rank * n:(rank + 1) * n]
            out = recv[:n] if layout == "reduce_scatter" else recv[rank * n:(rank + 1) * n]
        _reduce_rows(plan.ufunc, rows, out)

    # ---- progress ---------------------------------------------------------------------------------
    def _dispatch(self, owner):
        ex, k, ev = owner
        if ex.state == "failed":
            return  # a request of a collective that already raised (stall, mismatch) completed late
        ex.t_progress = self._now
        if ev == EV_ARRIVE:
            if self.bell is not None and ex.plan.large:
                self._ring_sender(ex, k)
            need = ex.need
            need[k] -= 1
            if need[k] == 0:
                self._run(ex, [k])
                if ex.remaining == 0:
                    self._finish(ex)
        elif ev == EV_DONE:
            if self.bell is not None and ex.plan.large:
                self._ring_sender(ex, k)
            self._complete(ex, k)
        elif ev == EV_LATE_REDUCE:
            if self.bell is not None and ex.plan.large:
                self._ring_sender(ex, k)
            _combine(ex.plan.ufunc, ex.views[k])
            self._complete(ex, k)
        elif ev == EV_AGREE:
            ex.agree_done = True
            self._agreement_ready()
        elif ev == EV_GATHER:
            self._mismatched(ex, ex.gather_buf[1])

    def _ring_sender(self, ex, k):
        """A receive of a large message completed: its sender's Isend can now complete, wake it."""
        o = ex.plan.ops[k]
        if o[0] != C_SEND:
            self._to_ring.add(o[1])

    def _flush_rings(self):
        bell, peers = self.bell, self._to_ring
        for r in peers:
            bell.ring(r)
        peers.clear()

    def poll(self):
        """Test every request once and handle what completed; True when something did.

        Also drives the other live communicators of this process, as MPI's own progress engine does:
        ranks waiting on requests of different communicators then cannot deadlock either."""
        progressed = self._poll_own()
        if len(_ENGINES) > 1:
            for ref in _ENGINES:
                other = ref()
                if other is not None and other is not self and (other.nactive or other.agree_queue or other.deferred):
                    if other._poll_own():
                        progressed = True
                    if other._to_ring:
                        other._flush_rings()
        if self._to_ring:
            self._flush_rings()
        return progressed

    def _poll_own(self):
        progressed = False
        if self.nactive:
            try:
                idx = self._testsome(self.reqs)
            except self.MPI.Exception as exc:
                self._mpi_failure(exc)
            if idx:
                self._now = time.monotonic()
                owners = self.owners
                for k in idx:
                    owner = owners[k]
                    owners[k] = None
                    self.nactive -= 1
                    try:
                        self._dispatch(owner)
                    except Exception as exc:
                        self._local_failure(owner[0], exc)
                progressed = True
                if len(owners) > 32 and self.nactive * 2 < len(owners):
                    keep = [k for k, o in enumerate(owners) if o is not None]
                    self.reqs = [self.reqs[k] for k in keep]
                    self.owners = [owners[k] for k in keep]
        if self.agree_queue and self.board is not None:
            if self._poll_board():
                progressed = True
        if self.deferred:
            if progressed:    # progress in flight is the queue's too (see _watchdog)
                self.deferred[0].t_progress = time.monotonic()
            if self._start_deferred():
                progressed = True
        return progressed

    def _local_failure(self, ex, exc):
        """Local work of ``ex`` (a reduction, a copy) raised ``exc``: ``ex`` fails with it -- raised by its
        own wait, not by whichever call happened to drive the engine, and the requests completed in the
        same poll are still handled -- and the communicator is unusable: this rank will not send the rest
        of ``ex``, and messages it does not receive now could match a later collective's. The peers learn
        that it gave up (their stall diagnostics name it)."""
        self.broken = f"{type(exc).__name__} in collective #{ex.seq} on rank {self.rank}: {exc}"
        if ex.state != "failed":
            self._send_status(ex, failed=True)
            self._fail(ex, exc)

    def _mpi_failure(self, exc):
        """An MPI error inside the data phase: every in-flight collective fails with a ddl.Error."""
        seqs = sorted(self.inflight)
        err = Error(f"MPI error in ddl collective(s) {', '.join(f'#{q}' for q in seqs)} on rank {self.rank}: "
                    f"{exc.Get_error_string() if hasattr(exc, 'Get_error_string') else exc}"
                    + (" -- ranks probably called different collectives (the agreement check is off)"
                       if "trunc" in str(exc).lower() else ""))
        self.broken = f"MPI error ({exc})"
        for ex in list(self.inflight.values()):
            self._fail(ex, err)
        raise err from None

    def _resume(self):
        """Entering a wait or test: a long time the user spent outside ddl (computing between an
        Iallreduce and its Wait) does not count as a stall. Short ones do (a loop that polls Test every
        second), or a dead peer would never be named: absences of at least half the stall warning
        (or timeout, if shorter) and 0.5 s are forgiven."""
        now = time.monotonic()
        if now - self._last_drive > max(0.5, min(self.stall_warning, self.stall_timeout) / 2):
            for other in self.pending():
                if other.t_progress < now:
                    other.t_progress = now
        self._now = now

    def wait(self, ex):
        """Drive all in-flight collectives until ``ex`` is done; raise its error, if any."""
        self.settle(ex)
        if ex.error is not None:
            self._deliver(ex)

    def settle(self, ex):
        """Drive all in-flight collectives until ``ex`` is done, keeping its error for its own wait."""
        if not ex.done:
            self._resume()
            self._drive_until(None, ex)

    @staticmethod
    def _deliver(ex):
        """Raise the error of ``ex`` to the caller of its wait or test (its ``on_error`` first: see
        Communicator._start)."""
        if ex.on_error is not None:
            ex.on_error(ex)
        raise ex.error

    def _drive_until(self, cond, ex):
        """Poll until ``ex`` is done (cond None) or ``cond()`` holds; waits per the idle policy.

        Idle policy: ``spin`` empty polls, then ``sched_yield`` between polls until ``sleep_after``
        seconds without progress, then sleep: on the doorbell (oversubscribed node, see
        :class:`Doorbell`) or in naps backing off from ``nap`` to ``nap_max``. Yielding keeps a rank
        responsive inside a collective (a rank that yields hands its core straight to the rank it waits
        for; a woken sleeper may wait for the running task's time slice), sleeping keeps long waits
        (skewed ranks, a user computing between collectives) from burning cores."""
        self._drive_loop(cond, ex)
        self._last_drive = time.monotonic()

    @np.errstate(all="ignore")   # the reductions done meanwhile: see _combine
    def _drive_loop(self, cond, ex):
        idle = 0
        poll = self.poll
        spin, nap0, nap_max = self.spin, self.nap, self.nap_max
        bell = self.bell
        nap = nap0
        last = time.monotonic()
        tick = last
        while not (ex.done if cond is None else cond()):
            if poll():
                idle = 0
                nap = nap0
                last = self._now
                continue
            idle += 1
            if idle <= spin:
                continue
            now = time.monotonic()
            if now - tick > 0.05:
                tick = now
                self._watchdog(now)
                if ex.done:
                    break
            if now - last < (self.sleep_after_large if self._large else self.sleep_after):
                os.sched_yield()
            elif bell is not None and not self._large:
                v = bell.prepare()   # flag up, bell read before the last poll: no ring can be lost
                if poll():
                    bell.cancel()
                    idle = 0
                    last = self._now
                    continue
                bell.wait(v)
            else:
                time.sleep(nap)   # back off while nothing happens: fewer polls stealing cores
                if nap < nap_max:
                    nap *= 1.5

    def test(self, ex):
        if not ex.done:
            self._resume()
            self._poll_while_progress()
            self._watchdog(time.monotonic())
            self._last_drive = time.monotonic()
        if ex.done and ex.error is not None:
            self._deliver(ex)
        return ex.done

    @np.errstate(all="ignore")   # the reductions done meanwhile: see _combine
    def _poll_while_progress(self):
        while self.poll():
            pass

    # ---- stall watchdog ---------------------------------------------------------------------------
    def _watchdog(self, now):
        self._poll_status(now)
        # a deferred collective waits for those in flight, which are watched; with none, for a peer
        # that still holds the board slot it needs
        watched = list(self.inflight.values()) or list(self.deferred)[:1]
        for ex in watched:
            stalled = now - ex.t_progress
            if ex.held and stalled >= _RELEASE_HELD:
                self._release_held(ex)
            if stalled >= self.stall_warning / 2:
                self._send_status(ex)      # (once) so that the peers' warnings can say that this rank waits too
            if stalled >= self.stall_warning and not ex.warned:
                ex.warned = True
                sys.stderr.write(f"ddl WARNING: {self.describe_stall(ex, stalled)}\n")
                sys.stderr.flush()
            gone = self._gone(ex.seq)
            if gone:
                self._give_up(ex, StallError(self.describe_stall(ex, stalled, gone)))
            if stalled >= self.stall_timeout:
                self._poll_status(now, force=True)
                hint = ("" if ex.check or self.size == 1 else
                        " (this collective skipped the agreement check, check='new'/'off': ranks that called "
                        "different collectives look exactly like this; rerun with check='always' to find out)")
                self._give_up(ex, StallError(self.describe_stall(ex, stalled)
                                             + f" [stall_timeout {self.stall_timeout:g} s]" + hint))

    def _release_held(self, ex):
        """Send every paced send of ``ex`` still held: its collective made no progress for a while. A
        paced send waits for an earlier one to complete, which needs its receive posted; a schedule may
        post that receive only after data that a held send carries, and this ends such a wait."""
        held, ex.held = list(ex.held), None
        self._run(ex, held)
        if ex.remaining == 0:
            self._finish(ex)

    def _gone(self, seq):
        """The peers that gave up on (or failed in) ddl collective ``seq`` or an earlier one, as they told
        this rank: their communicator is broken, so they take part in no collective from there on."""
        return sorted(r for r, (s, code, _) in self._status.items() if code in (3, 4) and s <= seq)

    def _give_up(self, ex, err):
        """This rank gives up on ``ex`` with StallError ``err``: it tells the peers, fails every collective
        in flight or deferred with ``err`` (the communicator is unusable from here) and raises it."""
        err.seq = ex.seq
        self.broken = f"StallError in collective #{ex.seq}"
        self._send_status(ex, gave_up=True)
        for other in list(self.inflight.values()):
            if other.state == "agreement" and self.board is not None:
                self.board.give_up(other.seq)   # a rank arriving later must not agree with us
            self._fail(other, err)
        while self.deferred:
            self._fail(self.deferred.popleft(), err)
        raise err

    def _send_status(self, ex, gave_up=False, failed=False):
        """Tell every peer "I am stuck in collective #seq" (or "I gave up on it", or "it failed here with
        an error of my own"): stall diagnostics."""
        key = (ex.seq, gave_up or failed)
        if key in self._status_sent or self.size == 1:
            return
        self._status_sent.add(key)
        code = 4 if failed else 3 if gave_up else {"agreement": 0, "data": 1}.get(ex.state, 2)
        msg = np.array([self.rank, ex.seq, code], np.int64)
        for r in range(self.size):
            if r != self.rank:
                self._status_reqs.append(self.gcomm.Isend(msg, r, STATUS_TAG))

    def _poll_status(self, now, force=False):
        if not force and now - self._last_status_poll < 0.05:
            return
        self._last_status_poll = now
        MPI = self.MPI
        st = MPI.Status()
        buf = np.empty(3, np.int64)
        while self.gcomm.Iprobe(MPI.ANY_SOURCE, STATUS_TAG, st):
            self.gcomm.Recv(buf, st.Get_source(), STATUS_TAG)
            self._status[int(buf[0])] = (int(buf[1]), int(buf[2]), now)
        if self._status_reqs:
            self._status_reqs = [r for r in self._status_reqs if not r.Test()]

    def describe_stall(self, ex, stalled, gone=()):
        """Why ``ex`` is stuck, from this rank's view and the peers' status messages; ``gone``: the peers
        that left the communicator (see :meth:`_gone`), for which this rank gives up without waiting."""
        from .agreement import format_ranks
        head = (f"{ex.label} (ddl collective #{ex.seq}) on rank {self.rank} "
                + ("cannot complete" if gone else f"has made no progress for {stalled:.1f} s"))
        same, gave_up, failed, elsewhere, silent = [], {}, {}, [], []
        for r in range(self.size):
            if r == self.rank:
                continue
            s = self._status.get(r)
            if s is None:
                silent.append(r)
            elif s[1] in (3, 4) and s[0] <= ex.seq:
                (gave_up if s[1] == 3 else failed).setdefault(s[0], []).append(r)
            elif s[0] == ex.seq:
                same.append(r)
            else:
                elsewhere.append((r, s[0], s[1]))
        away = []
        if ex.state == "agreement" and self.board is not None:
            missing = self.board.missing(ex.seq)
            latest = ", ".join(f"rank {r}: #{s}" if s >= 0 else f"rank {r}: none yet" for r, s in sorted(missing.items())[:8])
            body = (f"; waiting in the agreement step for {format_ranks(sorted(missing))}, which "
                    f"{'has' if len(missing) == 1 else 'have'} not entered it (latest ddl collective entered: {latest})")
            entered = [r for r in silent if r not in missing]  # posted on the board: in it with us
            same = sorted(set(same) | set(entered))
            away = [r for r in silent if r in missing]         # and never said they wait in one of ours
            silent = []
        elif ex.state == "agreement":
            body = "; waiting in the agreement step for every rank to enter this collective"
        elif ex.state == "data":
            body = "; " + self._pending_text(ex)
        elif ex.state == "deferred" and self.board is not None:
            earlier = ex.seq - self.board.depth(0 if ex.inline is None else ex.inline.nbytes)
            behind = self.board.behind(earlier)
            body = (f"; not started: {format_ranks(behind)} {'has' if len(behind) == 1 else 'have'} not finished "
                    f"ddl collective #{earlier}, whose slot on the shared agreement board this one takes")
        else:
            body = f"; state {ex.state}"
        notes = []
        if away:
            notes.append(f"{format_ranks(away)}: busy outside this communicator (computing, in another ddl "
                         f"communicator's collective or another MPI call) or dead")
        if same:
            notes.append(f"{format_ranks(same)} {'is' if len(same) == 1 else 'are'} stuck in it too")
        for seq, ranks in sorted(gave_up.items()):
            notes.append(f"{format_ranks(ranks)} gave up on {'it' if seq == ex.seq else f'ddl collective #{seq}'} "
                         f"(StallError) and will not take part" + ("" if seq == ex.seq else " in any later one"))
        for seq, ranks in sorted(failed.items()):
            notes.append(f"{format_ranks(ranks)} failed in {'it' if seq == ex.seq else f'ddl collective #{seq}'} with "
                         f"an error of {'its' if len(ranks) == 1 else 'their'} own and will not take part"
                         + ("" if seq == ex.seq else " in any later one"))
        for r, seq, code in elsewhere:
            notes.append(f"rank {r} " + ("gave up on" if code == 3 else "failed in" if code == 4 else "is stuck in")
                         + f" ddl collective #{seq}")
        if silent and (ex.warned or ex.state == "agreement"):
            notes.append(f"no word from {format_ranks(silent)}: not in this collective, busy outside ddl "
                         f"(not calling Wait/Test), in another MPI call, or dead")
        if not ex.check and ex.plan is not None and self.size > 1:
            notes.append("this call was not checked against the other ranks' (check='new' checks a signature "
                         "the first time a rank sees it, 'off' never): if they called with other arguments, "
                         "DDL_CHECK=always says which")
        if gone:
            notes.append("this communicator is unusable now: make a new one (Free lets go of this one at once)")
        return head + body + (". " + "; ".join(notes) if notes else "")

    def _pending_text(self, ex):
        from .agreement import format_ranks
        plan = ex.plan
        waiting = {}
        outstanding = [o for o in self.owners if o is not None and o[0] is ex and o[1] >= 0]
        for _, k, ev in outstanding:
            waiting.setdefault(plan.ops[k][1], []).append(k)
        if not waiting:
            return "no request outstanding"
        parts = []
        for peer in sorted(waiting):
            ks = sorted(waiting[peer])
            steps = ", ".join(plan.describe_op(k) for k in ks[:4]) + (f" and {len(ks) - 4} more" if len(ks) > 4 else "")
            parts.append(f"rank {peer}: {steps}")
        queued = sum(1 for k, nd in enumerate(ex.need) if nd > 0) - len(outstanding)
        return (f"waiting for {format_ranks(sorted(waiting))} -- " + "; ".join(parts)
                + (f" ({max(queued, 0)} later ops queued behind them)" if queued > 0 else ""))


def _tight_timer_slack():
    """Let short naps be short: Linux rounds sleeps up by the thread's timer slack (50 us by default),
    which on an oversubscribed node is most of a message hop. Sets 1 us for this thread (env
    ``DDL_TIMERSLACK=0`` keeps the default)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except Exception:  # pragma: no cover - not Linux
        pass


def _check_buffer(h):
    buf = np.empty(4, np.int64)
    buf[0] = h
    buf[1] = -h
    return buf
