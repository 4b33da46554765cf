"""Message timelines of ddl's host executor: when each message of a collective was posted, when it
arrived, on every rank, written as a Chrome trace (``ddl bench --trace FILE``; open the file in
Perfetto, https://ui.perfetto.dev, or chrome://tracing).

Why: a collective that takes longer than its prediction loses the time somewhere -- one rank that
starts late, a link that idles, a long tail. The simulator says when each message should move; this
says when it did, per rank and per peer.

How: :class:`MessageTrace` hooks one communicator's progress engine (:class:`ddl.executor.Engine`) by
setting instance attributes over five of its entry points: ``start`` (a collective is called),
``_start_data`` (its agreement is done: its messages may move), ``_isend`` (a message is posted),
``_dispatch`` (a request completed: for a receive, the message has arrived) and ``_finish`` (the
collective is done on this rank). The executor itself carries no tracing code, so an untraced
communicator pays nothing. Events are kept only inside :meth:`MessageTrace.recording`, under its label.
An arrival is stamped when the receiving rank's engine sees the receive complete, which on a rank that
was asleep or busy is later than the last byte landed: that lag is part of what a timeline shows.

Clocks: every rank stamps with ``time.perf_counter``. Ranks of one machine (one kernel) share that
clock exactly; :func:`clock_offsets` measures every other machine's offset from rank 0's by ping-pong
(the sample with the shortest round trip), so ranks on different machines line up to within half that
round trip.

In a program of one's own::

    from ddl.trace import MessageTrace, chrome_trace, gather
    traced = MessageTrace(comm)                       # comm: a ddl.Communicator
    with traced.recording("step 1"):
        comm.Allreduce(grads, out)
    events = gather(MPI.COMM_WORLD, traced.take())    # collective; rank 0 gets every rank's events
    hosts = MPI.COMM_WORLD.gather(MPI.Get_processor_name())
    if events is not None:
        json.dump(chrome_trace(events, hosts), open("trace.json", "w"))

The k-th send of a tag from one rank to another pairs with the k-th arrival of that tag there (MPI's
non-overtaking rule). On a message's receiver, the timeline of the pair ``sender -> receiver`` shows
each message from when it could start moving -- its post, or the previous message's arrival on that
pair, whichever is later -- to its arrival, so the pair's messages never overlap and an idle pair shows
as a gap.
"""
import time
from contextlib import contextmanager

CALL, DATA, POST, ARRIVE, END = "call", "data", "post", "arrive", "end"


class MessageTrace:
    """The message events of one communicator's collectives, under the label of :meth:`recording`.

    An event is ``(label, time, kind, peer, nbytes, tag)``: kind :data:`CALL`, :data:`DATA` and
    :data:`END` (peer -1) mark a collective's call, the end of its agreement and its end on this rank;
    :data:`POST` a message posted to ``peer``, :data:`ARRIVE` one arrived from ``peer``."""

    def __init__(self, comm):
        from . import executor
        self.engine = engine = comm._engine
        self.events = []
        self.label = None
        clock = time.perf_counter
        add = self.events.append
        start, start_data, isend = engine.start, engine._start_data, engine._isend
        self._isend = isend
        dispatch, finish = engine._dispatch, engine._finish
        received = (executor.EV_ARRIVE, executor.EV_DONE, executor.EV_LATE_REDUCE)

        def traced_start(ex, *args, **kwargs):
            if self.label is not None:
                add((self.label, clock(), CALL, -1, 0, 0))
            return start(ex, *args, **kwargs)

        def traced_start_data(ex):
            if self.label is not None:
                add((self.label, clock(), DATA, -1, 0, 0))
            return start_data(ex)

        def traced_isend(buf, peer, tag):
            if self.label is not None:
                add((self.label, clock(), POST, peer, buf.nbytes, tag))
            return isend(buf, peer, tag)

        def traced_dispatch(owner):
            ex, k, ev = owner
            if self.label is not None and ev in received and ex.plan is not None:
                op = ex.plan.ops[k]
                if op[0] != executor.C_SEND:
                    add((self.label, clock(), ARRIVE, op[1], op[12] - op[11], ex.tag_base + op[2]))
            return dispatch(owner)

        def traced_finish(ex):
            finish(ex)
            if self.label is not None:
                add((self.label, clock(), END, -1, 0, 0))

        engine.start, engine._start_data, engine._isend = traced_start, traced_start_data, traced_isend
        engine._dispatch, engine._finish = traced_dispatch, traced_finish
        engine.hooked = True

    @contextmanager
    def recording(self, label):
        """Keep the events of the collectives called inside, under ``label`` (any picklable value). Only
        what happens inside is kept: wait for a nonblocking collective inside the block too."""
        self.label = label
        try:
            yield
        finally:
            self.label = None

    def take(self):
        """The events kept so far, which are forgotten here."""
        events, self.events[:] = list(self.events), []
        return events

    def close(self):
        """Unhook the engine: it runs untraced again."""
        for name in ("start", "_start_data", "_dispatch", "_finish"):
            self.engine.__dict__.pop(name, None)
        self.engine._isend = self._isend
        self.engine.hooked = False


def clock_offsets(world, rounds=5):
    """Every rank's ``time.perf_counter`` minus rank 0's, a list on every rank. Ranks that read one
    clock (:func:`_clock_id`: one kernel since its boot, one time namespace; emulated hosts included)
    have offset 0 between them, exactly: a ping-pong between two ranks that share two cores measures
    scheduling, not clocks, and drew arrivals milliseconds before their posts. One rank of every other
    clock is measured by ping-pong with rank 0: of ``rounds`` round trips the shortest, assuming its
    two halves equal. Collective over ``world``."""
    rank, tag = world.rank, 7
    clocks = world.allgather(_clock_id() or ("rank", rank))
    first = {}
    for r, clock in enumerate(clocks):
        first.setdefault(clock, r)
    measured = [r for r in first.values() if r != 0 and clocks[r] != clocks[0]]
    by_clock = None
    if rank == 0:
        by_clock = {clocks[0]: 0.0}
        for peer in measured:
            best = None
            for _ in range(rounds):
                t0 = time.perf_counter()
                world.send(None, dest=peer, tag=tag)
                theirs = world.recv(source=peer, tag=tag)
                t1 = time.perf_counter()
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, theirs - (t0 + t1) / 2)
            by_clock[clocks[peer]] = best[1]
    elif rank in measured:
        for _ in range(rounds):
            world.recv(source=0, tag=tag)
            world.send(time.perf_counter(), dest=0, tag=tag)
    by_clock = world.bcast(by_clock, root=0)
    return [by_clock[clock] for clock in clocks]


def _clock_id():
    """What names the clock ``time.perf_counter`` reads (CLOCK_MONOTONIC on Linux): the kernel's boot
    id and this process's time-namespace offsets; None where neither can be read (every rank is then
    measured). Network namespaces (an emulated cluster's hosts) share it."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/timens_offsets"):
        try:
            with open(path, encoding="ascii") as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append(None)
    return None if parts[0] is None else tuple(parts)


def gather(world, events, offsets=None):
    """Collective over ``world``: every rank's ``events`` (from :meth:`MessageTrace.take`) on rank 0, as a
    list per rank on rank 0's clock; None on the other ranks. ``offsets``: what :func:`clock_offsets`
    gave before, on every rank, or None on every rank to measure them now."""
    if offsets is None:
        offsets = clock_offsets(world)
    got = world.gather(events, root=0)
    return None if got is None else aligned(got, offsets)


def messages(events_by_rank):
    """Pair every rank's posts with the arrivals they became: ``[(src, dst, nbytes, posted, arrived)]``
    per label, as ``{label: [...]}``, times as given. A post whose arrival is missing (or an arrival
    whose post is) is left out."""
    posts, arrivals = {}, {}
    for rank, events in enumerate(events_by_rank):
        for label, t, kind, peer, nbytes, tag in events:
            if kind == POST:
                posts.setdefault((label, rank, peer, tag), []).append((t, nbytes))
            elif kind == ARRIVE:
                arrivals.setdefault((label, peer, rank, tag), []).append(t)
    out = {}
    for key, sent in posts.items():
        label, src, dst, _tag = key
        for (posted, nbytes), arrived in zip(sent, sorted(arrivals.get(key, ()))):
            out.setdefault(label, []).append((src, dst, nbytes, posted, arrived))
    return out


def aligned(events_by_rank, offsets):
    """``events_by_rank`` with every time on rank 0's clock."""
    return [[(label, t - off, kind, peer, nbytes, tag) for label, t, kind, peer, nbytes, tag in events]
            for events, off in zip(events_by_rank, offsets)]


def summary(events_by_rank, hosts):
    """Per label, the moments of a collective that say where its time went, in seconds after the first
    rank called it: ``agreement`` (the last rank's agreement done; None when no rank had one),
    ``first_message`` and ``last_message`` (arrivals between hosts, or between any two ranks when all
    share one host; None without messages), ``end`` (the last rank done), and ``between`` ("hosts" or
    "ranks"). ``events_by_rank`` on one clock (:func:`aligned`)."""
    marks = {}
    for events in events_by_rank:
        for label, t, kind, *_ in events:
            if kind in (CALL, DATA, END):
                marks.setdefault(label, {}).setdefault(kind, []).append(t)
    many_hosts = len(set(hosts)) > 1
    out = {}
    pairs = messages(events_by_rank)
    for label, m in marks.items():
        t0 = min(m.get(CALL, [0.0]))
        arrivals = [arrived for src, dst, _n, _p, arrived in pairs.get(label, ())
                    if not many_hosts or hosts[src] != hosts[dst]]
        out[label] = {
            "agreement": max(m[DATA]) - t0 if DATA in m else None,
            "first_message": min(arrivals) - t0 if arrivals else None,
            "last_message": max(arrivals) - t0 if arrivals else None,
            "end": max(m[END]) - t0 if END in m else None,
            "between": "hosts" if many_hosts else "ranks",
        }
    return out


def chrome_trace(events_by_rank, hosts, name_of=str):
    """The Chrome trace (a dict, for ``json.dump``) of ``events_by_rank`` (on one clock: :func:`aligned`):
    one process per rank (named with its host), a ``calls`` track with every collective (from its call
    to its end, and its agreement inside) and a track per peer it received from, with every message
    from when it could start moving to its arrival. ``name_of(label)`` names a collective."""
    starts = [t for events in events_by_rank for _l, t, *_ in events]
    base = min(starts, default=0.0)

    def us(t):
        return round((t - base) * 1e6, 3)

    def span(begin, end):      # (ts + dur is end's own rounded time: spans that touch do not overlap)
        return {"ts": us(begin), "dur": round(us(end) - us(begin), 3)}

    trace = []
    for rank, host in enumerate(hosts):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "calls"}})
    for rank, events in enumerate(events_by_rank):
        open_calls = {}
        for label, t, kind, *_ in events:
            if kind == CALL:
                open_calls[label] = [t, None]
            elif kind == DATA and label in open_calls:
                open_calls[label][1] = t
            elif kind == END and label in open_calls:
                called, agreed = open_calls.pop(label)
                trace.append({"name": name_of(label), "ph": "X", "pid": rank, "tid": 0, **span(called, t)})
                if agreed is not None:
                    trace.append({"name": "agreement", "ph": "X", "pid": rank, "tid": 0, **span(called, agreed)})
    peers = set()
    for label, found in messages(events_by_rank).items():
        by_pair = {}
        for src, dst, nbytes, posted, arrived in found:
            by_pair.setdefault((src, dst), []).append((arrived, posted, nbytes))
        for (src, dst), msgs in by_pair.items():
            peers.add((src, dst))
            free = None
            for arrived, posted, nbytes in sorted(msgs):
                begin = min(arrived, posted if free is None else max(posted, free))
                trace.append({"name": f"{nbytes} B from {src}", "ph": "X", "pid": dst, "tid": 1 + src,
                              **span(begin, arrived), "args": {"collective": name_of(label), "bytes": nbytes,
                                       "posted_ms": round((posted - base) * 1e3, 3)}})
                free = arrived
    for src, dst in sorted(peers):
        trace.append({"name": "thread_name", "ph": "M", "pid": dst, "tid": 1 + src,
                      "args": {"name": f"from rank {src}" + (f" ({hosts[src]})" if hosts[src] != hosts[dst] else "")}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
