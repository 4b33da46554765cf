"""Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling allgather.

Sources: R. Rabenseifner, "Optimization of collective reduction operations", ICCS 2004; R. Thakur,
R. Rabenseifner and W. Gropp, "Optimization of collective communication operations in MPICH", IJHPCA
19(1), 2005 (sec. 4: halving/doubling and the non-power-of-two handling used here).

``m = 2**floor(log2 p)`` ranks take part in the halving and doubling. With ``r = p - m`` extra ranks,
the first ``2r`` positions pair up: the odd one of each pair sends its whole vector to the even one,
which reduces it (and, for reduce-scatter and allgather, the pair's two blocks travel together), and
the odd one receives its result at the end. Each of the ``log2 m`` halving steps exchanges half of
what a rank still holds with the partner whose position differs in one bit; doubling undoes it.

Topology: positions are the ranks in the topology-aware ring order, and halving runs its bits from
the lowest (largest exchanges between ring neighbours, i.e. inside the fast tiers) up; doubling runs
them back down. Any bit order is correct: a rank keeps the segments of the positions that agree with
it on the bits done so far.

Collectives: allreduce, reduce_scatter, allgather (any p); not broadcast. Chunks: allreduce cuts the
buffer into ``m`` segments of ``k`` chunks, ``k = pipeline_depth(nbytes, m)`` (see ring.pipeline_depth);
reduce-scatter and allgather cut each rank's block into ``k`` chunks, ``k = pipeline_depth(nbytes, p)``.

Spans (allreduce). Piece ``i`` of segment ``s`` is chunk ``i m + rev(s)``, ``rev`` reversing the
``log2 m`` bits, so the segments a halving step sends are consecutive chunks, and so are those it
passes on at the same later step; each such group goes as spans (:meth:`ScheduleBuilder.runs`) of at
most ``SPAN_BYTES``, first pieces first: the partner reduces and passes on the first pieces of a step
while the later ones still arrive, as a pipeline of ``k`` waves through the steps.
"""
from itertools import groupby

from ..schedule import ScheduleBuilder
from .ring import MAX_SCHEDULE_OPS, check_request, nested_order, pipeline_depth, rank_partitions

NAME = "halving-doubling"
SUPPORTED = ("allreduce", "reduce_scatter", "allgather")
# Allreduce sends the segments that travel together as spans of at most SPAN_BYTES where its segments
# are cut into at least SPAN_MIN_WAVES pieces (waves), or where a message per chunk would exceed the
# operation budget; otherwise a message per chunk. At 256 MiB: with waves, spans do better than a
# message per chunk (1.000 of the bound instead of 1.11 on the 1:1 fat tree, 1.08 instead of 1.20 on
# the DGX A100); without, worse (1.54 instead of 1.29 on the 192-rank cluster, k = 2; 1.49 instead of
# 1.22 at 1024 ranks, where a message per chunk is 4.2 million operations). Caps of 4 and 16 MiB were
# each worse than 8 on some of the zoo.
SPAN_BYTES = 8 << 20
SPAN_MIN_WAVES = 4


def halving_doubling_schedule(order, collective, k=1, algorithm=NAME, span_chunks=None, **info):
    """Rabenseifner ``collective`` with positions ``order`` (a permutation of ``range(p)``); an allreduce
    sends spans of at most ``span_chunks`` chunks (default: any length)."""
    order = [int(r) for r in order]
    p = len(order)
    check_request(algorithm, collective, p, 0, SUPPORTED)
    active, partner_of = fold(order)
    m = len(active)
    bits = [1 << i for i in range(m.bit_length() - 1)]
    if collective == "allreduce":
        # piece i of segment s is chunk i * m + (s with its bits reversed): see the module docstring
        b = ScheduleBuilder(collective, p, (1,) * (m * k), algorithm=algorithm)
        nbits = len(bits)
        segments = [[i * m + int(f"{s:0{nbits}b}"[::-1] or "0", 2) for i in range(k)] for s in range(m)]
        everything = list(range(m * k))
    else:
        b = ScheduleBuilder(collective, p, (1,) * k, algorithm=algorithm)
        owned = [[a] + ([partner_of[a]] if a in partner_of else []) for a in active]
        segments = [[r * k + s for r in own for s in range(k)] for own in owned]
        everything = list(range(p * k))
    spans = collective == "allreduce"

    def blocks(a):                     # chunks of the odd rank `a` (its own block in RS/AG)
        return list(range(a * k, (a + 1) * k))

    if collective in ("allreduce", "reduce_scatter"):
        for even, odd in partner_of.items():
            for c in everything:
                b.transfer(odd, even, c, reduce=True)
        _halving(b, active, segments, bits, (span_chunks or m * k) if spans else None)
    else:
        for even, odd in partner_of.items():
            for c in blocks(odd):
                b.transfer(odd, even, c)
    if collective in ("allreduce", "allgather"):
        _doubling(b, active, segments, bits[::-1], (span_chunks or m * k) if spans else None)
        for even, odd in partner_of.items():
            mine = set(blocks(odd)) if collective == "allgather" else set()
            for c in everything:
                if c not in mine:
                    b.transfer(even, odd, c)
    else:
        for even, odd in partner_of.items():
            for c in blocks(odd):
                b.transfer(even, odd, c)
    return b.build(order=order, active=active, folded_pairs=[[o, e] for e, o in partner_of.items()],
                   halving_bits=bits, chunks_per_segment=k, **info)


def fold(order):
    """The non-power-of-two rule of the doubling algorithms: ``(active, folded)``. ``active`` lists
    the ``m = 2**floor(log2 p)`` ranks that take part in the doubling, by position; ``folded`` maps the
    even rank of each of the first ``p - m`` pairs of ``order`` to the odd one folded into it."""
    p = len(order)
    m = 1 << (p.bit_length() - 1)
    extra = p - m
    active = [order[2 * j] if j < extra else order[j + extra] for j in range(m)]
    return active, {order[2 * j]: order[2 * j + 1] for j in range(extra)}


def _halving(b, active, segments, bits, span_chunks=None):
    """Recursive halving: at bit ``x``, position ``j`` sends its partner ``j ^ x`` the segments of the
    positions that agree with the partner on every bit done so far (including ``x``); they reduce.
    Messages to one peer leave in program order, so the segments the partner keeps go first and those
    it passes on soonest last: otherwise its next step would start early and slow the exchange still
    under way (every rank's link is then shared by two steps and idles at the end). ``bits`` are the
    powers of two from 1 up, so the segments of a step are the partner's low bits under any high ones,
    listed directly (the whole schedule costs its size, not ``m`` per rank and step). With
    ``span_chunks``, the segments handed on at the same step go as spans of at most that many chunks,
    first pieces first (see the module docstring); without, a message per chunk."""
    m, nbits = len(active), len(bits)
    for i, x in enumerate(bits):
        hi = i + 1
        for j in range(m):
            q = j ^ x
            low = q & ((1 << hi) - 1)

            def passed_on(s):          # the bit at which q hands segment s on (nbits: q keeps it)
                u = (s ^ q) >> hi
                return hi + (u & -u).bit_length() - 1 if u else nbits
            mine = sorted((low | (t << hi) for t in range(m >> hi)), key=passed_on, reverse=True)
            if span_chunks:
                groups = [list(g) for _, g in groupby(mine, key=passed_on)]
                for piece in range(len(segments[0])):
                    for g in groups:
                        for c in b.runs([segments[s][piece] for s in g], most=span_chunks):
                            b.transfer(active[j], active[q], c, reduce=True)
                continue
            for s in mine:
                for c in segments[s]:
                    b.transfer(active[j], active[q], c, reduce=True)


def _doubling(b, active, segments, bits, span_chunks=None):
    """Recursive doubling: at bit ``x`` (the powers of two from the top down), position ``j`` sends
    everything it holds -- the segments of the positions that agree with it on ``x`` and every bit
    below -- to ``j ^ x`` (with ``span_chunks``, as in :func:`_halving`)."""
    m = len(active)
    for x in bits:
        hi = x.bit_length()
        for j in range(m):
            low = j & ((1 << hi) - 1)
            held = [low | (t << hi) for t in range(m >> hi)]
            if span_chunks:
                for piece in range(len(segments[0])):
                    for c in b.runs([segments[s][piece] for s in held], most=span_chunks):
                        b.transfer(active[j], active[j ^ x], c)
                continue
            for s in held:
                for c in segments[s]:
                    b.transfer(active[j], active[j ^ x], c)


def halving_doubling(topo, collective, *, root=0, nbytes=None):
    """Rabenseifner on the topology-aware ring order (see the module docstring)."""
    p = topo.nranks
    check_request(NAME, collective, p, root, SUPPORTED)
    order, _ = nested_order(p, rank_partitions(topo), topo.route_bandwidth)
    m = 1 << (p.bit_length() - 1)
    k = pipeline_depth(nbytes, m if collective == "allreduce" else p)
    spans = k >= SPAN_MIN_WAVES or 4 * m * (m - 1) * k > MAX_SCHEDULE_OPS
    # spans of at most SPAN_BYTES; of any length where the size is unknown (k is then 1, and spans are
    # wanted only for the operation budget): a message per chunk there was a million operations at 512
    # ranks, where any known size got spans
    most = (max(1, int(SPAN_BYTES * m * k // nbytes)) if nbytes else None) if spans else 1
    return halving_doubling_schedule(order, collective, k, span_chunks=most)
