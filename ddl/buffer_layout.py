"""Where every chunk of a collective lives in the user's buffers, for the executors that run it.

A *layout* says which buffers a call has: ``allreduce`` (``sendbuf`` -> ``recvbuf``),
``allreduce_inplace``, ``reduce_scatter`` (``recvbuf`` holds this rank's block; the other blocks live
in a workspace of the whole count), ``reduce_scatter_inplace``, ``allgather`` (``sendbuf`` holds this
rank's block), ``allgather_inplace`` and ``broadcast``. Every chunk has an *initial* location (where
this rank's input for it is, or None where it has none) and a *home* (where its value is written and
the result ends), as ``(buffer, element offset)`` with the buffers named ``send``, ``recv``,
``work``. The host executor (:mod:`ddl.executor`) and the GPU launch plan
(:mod:`ddl.gpu.launch_plan`) both place chunks by these rules, so a schedule runs alike on both.

Spans (several chunks in one message) need their chunks side by side. Where a schedule has spans,
every chunk therefore starts at its home: its input is copied there before any message moves, one
copy per contiguous run (the *pre-copies*), and a span lives at its first chunk's home.
"""
from .errors import Error

LAYOUTS = ("allreduce", "allreduce_inplace", "reduce_scatter", "reduce_scatter_inplace", "allgather",
           "allgather_inplace", "broadcast")
SEND, RECV, WORK = "send", "recv", "work"


def chunk_locations(schedule, rank, count, layout):
    """``(ranges, locations, precopies)`` for ``rank`` and a buffer of ``count`` elements.

    ``ranges``: :meth:`Schedule.chunk_ranges`. ``locations``: per chunk id (chunks, then spans)
    ``(initial or None, home, needed)``, where ``needed`` says the result must end at home (spans:
    False, their chunks say it). ``precopies``: ``(buffer, offset, buffer, offset, elements)`` to do
    before the first operation (only with spans; see the module docstring)."""
    if layout not in LAYOUTS:
        raise Error(f"unknown buffer layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    ranges = schedule.chunk_ranges(count)
    block = count // schedule.nblocks
    locs = []
    for c in range(schedule.nchunks):
        s = int(ranges[c, 0])
        b = schedule.block_of(c)
        if layout == "allreduce":
            init, home, needed = (SEND, s), (RECV, s), True
        elif layout in ("allreduce_inplace", "broadcast", "allgather_inplace"):
            init, home, needed = (RECV, s), (RECV, s), True
            if layout == "broadcast" and rank != schedule.root:
                init = None
            if layout == "allgather_inplace" and b != rank:
                init = None
        elif layout == "reduce_scatter":
            init = (SEND, s)
            home = (RECV, s - rank * block) if b == rank else (WORK, s)
            needed = b == rank
        elif layout == "reduce_scatter_inplace":
            init, home, needed = (RECV, s), (RECV, s), b == rank
        else:  # allgather
            init = (SEND, s - rank * block) if b == rank else None
            home, needed = (RECV, s), True
        locs.append((init, home, needed))
    precopies = []
    if schedule.spans:
        for c, (init, home, needed) in enumerate(locs):
            if init is None or init == home:
                continue
            n = int(ranges[c, 1] - ranges[c, 0])
            last = precopies[-1] if precopies else None
            if last and (last[0], last[1] + last[4], last[2], last[3] + last[4]) == (*init, *home):
                precopies[-1] = last[:4] + (last[4] + n,)      # the run goes on
            elif n:
                precopies.append((*init, *home, n))
            locs[c] = (home, home, needed)
        for span in map(schedule.members, range(schedule.nchunks, schedule.nids)):
            home = locs[span[0]][1]
            locs.append((home if all(locs[m][0] is not None for m in span) else None, home, False))
    return ranges, locs, precopies


def read_location(schedule, locs, written, chunk):
    """Where an operation on chunk id ``chunk`` finds this rank's value: its home once each of its
    chunks has been written or starts there, else its initial location (None: no data yet).
    ``written``: per chunk, whether an operation has written it."""
    init, home, _needed = locs[chunk]
    if all(written[m] or locs[m][0] == locs[m][1] for m in schedule.members(chunk)):
        return home
    return init
