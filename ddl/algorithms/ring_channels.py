"""Several rings at once, each with its share of the buffer: NCCL's channels.

One ring uses one direction of one path out of every group of ranks. Where a group has more ways out
(a DGX A100 host has eight NICs; every NVLink is full duplex), NCCL runs several rings side by side,
its *channels*, and splits the data among them (Jeaugey, "NCCL 2.0", GTC 2017; ``graph/search.cc``
searches channels until a target bandwidth is met). This is that baseline, so ddl is compared with
rings as NCCL would run them, not with one ring.

Candidates are the topology-aware ring (:func:`ddl.algorithms.ring.ring_order`), its reverse (the other
direction of every link), on one box of at most 16 ranks other widest Hamiltonian cycles that avoid
the rank pairs taken before (as NCCL finds several NVLink rings on a DGX-1), and both directions of
rotations of every tier's groups: rotating a host's segment of the ring moves where the ring leaves
and enters the host, so each rotation leaves through another NIC. A linear programme (scipy's
HiGHS) gives the channels their rates: maximise their sum while the traffic of every channel's hops
(split evenly over each hop's routes) fits every link. Channels are added in that order and kept
only when they raise the LP's optimum by more than :data:`MIN_GAIN`, so a channel that only shares
another's links never joins. A channel slower than :data:`THIN` of the fastest is dropped too (the
DGX-1's PCIe ring, 6 against 50 GB/s): it pays every step's latency for a small share, and finishes
last (NCCL's channels are alike as well). Every ring block of a channel is then cut in proportion to
its rate (small integer weights), and into as many chunks as its share allows.

Collectives: all four. It declines where one ring is all the LP finds (it would repeat ``ring``) and
where two channels would exceed :data:`MAX_OPS` operations.
"""
from fractions import Fraction
from math import lcm

import numpy as np
from scipy.optimize import linprog

from ..errors import PlanError
from ..schedule import MAX_PATTERN_TOTAL, ScheduleBuilder
from ..units import counted
from .ring import (MAX_CHUNKS, MAX_PIPELINE, SEARCH_LIMIT, check_request, pipeline_depth, rank_partitions,
                   ring_order, rings_allgather, rings_reduce_scatter, widest_ring)

NAME = "ring-channels"
MIN_GAIN = 0.01          # a channel must add more than 1% to the rings' total rate ...
THIN = 0.25              # ... and run at least this fraction of the fastest channel's rate
MAX_CHANNELS = 16
MAX_CANDIDATES = 64      # orders tried (rotations of large groups are sampled evenly)
MAX_OPS = 1 << 19        # operations per schedule: what verifying and simulating it costs
EXTRA_CYCLES = 4         # more Hamiltonian cycles searched where the whole ring is one searched group
USED_PAIR = 1e-3         # a rank pair an earlier cycle took counts this much of its bandwidth
WEIGHT_STEPS = 8         # channel shares are rounded to fractions with denominators up to this


def ring_channels(topo, collective, *, root=0, nbytes=None):
    """NCCL-style channels on ``topo`` (see the module docstring)."""
    p = topo.nranks
    check_request(NAME, collective, p, root)
    if p < 3:
        raise PlanError(f"{NAME}: {counted(p, 'rank')} {'has' if p == 1 else 'have'} one ring at most (both directions "
                        f"are the same pair)")
    per_ring = ring_ops(p, collective)
    if 2 * per_ring > MAX_OPS:
        raise PlanError(f"{NAME}: two channels on {p} ranks take {2 * per_ring} operations "
                        f"(limit {MAX_OPS}); 'ring' and 'hierarchical' plan this size")
    orders, rates = choose_channels(topo, candidate_orders(topo), min(MAX_CHANNELS, MAX_OPS // per_ring))
    if len(orders) < 2:
        raise PlanError(f"{NAME}: one ring already uses every way out of each group that more rings "
                        f"could (it would repeat 'ring')")
    return rated_channels(orders, rates, collective, nbytes, root)


def ring_ops(p, collective):
    """Operations of one ring channel of ``p`` ranks, a chunk per ring block: a send and a receive per
    rank and step, ``p - 1`` steps each way for an allreduce. A broadcast is a chain, one transfer per
    step: counted as a ring it was ``p`` times too many, which declined broadcasts past 362 ranks that
    take a few thousand operations and held the pipelining of large ones below what the budget
    allows."""
    if collective == "broadcast":
        return 2 * (p - 1)
    return 2 * p * (p - 1) * (2 if collective == "allreduce" else 1)


def rated_channels(orders, rates, collective, nbytes, root=0, steps=WEIGHT_STEPS, algorithm=NAME, **info):
    """:func:`channels_schedule` for channels running at ``rates``: shares in proportion to them
    (fractions with denominators up to ``steps``), each ring block pipelined in as many chunks as its
    share allows and the operation budget (:data:`MAX_OPS`) holds for all channels."""
    p = len(orders[0])
    weights = integer_weights(rates, steps)
    most = max(1, min(MAX_PIPELINE, MAX_OPS // (len(orders) * ring_ops(p, collective))))   # chunks per ring block
    ks = [pipeline_depth(nbytes * w / sum(weights) if nbytes else nbytes, 1 if collective == "broadcast" else p,
                         max_k=most, max_chunks=MAX_CHUNKS) for w in weights]
    return channels_schedule(orders, weights, collective, ks, root, algorithm=algorithm,
                             channel_rates=[float(r) for r in rates], **info)


def candidate_orders(topo):
    """The ring order and its reverse, other cycles of a one-box ring (:func:`other_cycles`), then
    both directions of each tier's groups rotated; deduplicated by their sets of hops, at most
    :data:`MAX_CANDIDATES`."""
    base = ring_order(topo)
    p = len(base)
    found, seen = [], set()

    def add(order):
        hops = frozenset((order[i], order[(i + 1) % p]) for i in range(p))
        if hops not in seen and len(found) < MAX_CANDIDATES:
            seen.add(hops)
            found.append(order)

    add(base)
    add(base[::-1])
    partitions = rank_partitions(topo)
    if len(partitions[0]) == 1 and p <= SEARCH_LIMIT:   # one box, searched whole: other cycles, both ways
        for order in other_cycles(topo, base):
            add(order)
            add(order[::-1])
    for part in partitions:
        size = max(len(g) for g in part)
        if len(part) < 2 or size < 2:
            continue               # one group (the whole ring) or single ranks: nothing moves
        for shift in np.unique(np.linspace(1, size - 1, num=min(size - 1, MAX_CANDIDATES // 2)).astype(int)):
            rotated = rotate_groups(base, part, int(shift))
            add(rotated)
            add(rotated[::-1])
    return found


def other_cycles(topo, first, count=EXTRA_CYCLES):
    """Up to ``count`` more widest Hamiltonian cycles, each over the rank pairs no earlier cycle uses
    (either way round) where such a cycle exists: every pair an earlier cycle took counts a thousand
    times narrower. On a DGX-1 the second cycle takes the single NVLinks once the first has all the
    double ones, and the third goes over PCIe."""
    p = len(first)
    used = {}

    def note(order):
        for i in range(p):
            pair = frozenset((order[i], order[(i + 1) % p]))
            used[pair] = used.get(pair, 0) + 1

    def residual(a, b):
        return topo.route_bandwidth(a, b) * USED_PAIR ** used.get(frozenset((a, b)), 0)

    note(first)
    found = []
    for _ in range(count):
        order, _bottleneck = widest_ring(list(range(p)), residual)
        found.append(order)
        note(order)
    return found


def rotate_groups(order, groups, shift):
    """``order`` with each group's (contiguous) segment rotated left by ``shift``."""
    out = list(order)
    position = {r: i for i, r in enumerate(order)}
    for group in groups:
        slots = sorted(position[r] for r in group)
        segment = [order[i] for i in slots]
        s = shift % len(segment)
        for i, r in zip(slots, segment[s:] + segment[:s]):
            out[i] = r
    return out


def channel_load(topo, order, index):
    """``{link index: hops' traffic per unit of the channel's rate}``: every hop of the ring carries
    the channel's rate, split evenly over that hop's routes."""
    load = {}
    p = len(order)
    for i in range(p):
        paths = topo.routes(order[i], order[(i + 1) % p])
        for path in paths:
            for u, v in zip(path[:-1], path[1:]):
                key = index.setdefault((u, v), len(index))
                load[key] = load.get(key, 0.0) + 1.0 / len(paths)
    return load


def choose_channels(topo, candidates, max_channels=MAX_CHANNELS):
    """``(orders, rates)``: the candidates kept, in order, with their LP rates (bytes/s per hop)."""
    index = {}
    loads = [channel_load(topo, order, index) for order in candidates]
    capacity = np.zeros(len(index))
    for (u, v), i in index.items():
        capacity[i] = topo.capacity(u, v)
    kept, best, rates = [], 0.0, []
    for j in range(len(candidates)):
        if len(kept) == max_channels:
            break
        trial = kept + [j]
        value, x = _max_total_rate([loads[t] for t in trial], capacity)
        if value > best * (1 + MIN_GAIN):
            kept, best, rates = trial, value, x
    strong = [j for j, r in zip(kept, rates) if r >= THIN * max(rates)]
    if len(strong) < len(kept):        # thin channels out: the others' rates are solved again
        _value, rates = _max_total_rate([loads[t] for t in strong], capacity)
        kept = strong
    return [candidates[j] for j in kept], list(rates)


def _max_total_rate(loads, capacity):
    """Max sum of channel rates ``x`` with ``sum_j x_j load_j[l] <= capacity[l]`` for every link."""
    a = np.zeros((len(capacity), len(loads)))
    for j, load in enumerate(loads):
        for link, amount in load.items():
            a[link, j] = amount
    used = a.any(axis=1)
    res = linprog(-np.ones(len(loads)), A_ub=a[used], b_ub=capacity[used], bounds=(0, None), method="highs")
    if res.status != 0:
        raise PlanError(f"{NAME}: the channel LP failed ({res.message})")
    return -res.fun, res.x


def integer_weights(rates, steps=WEIGHT_STEPS):
    """Small positive integers in (about) the proportion of ``rates``: each rate over the fastest as a
    fraction with a denominator up to ``steps``. Where those denominators are many and unlike (sixteen
    rings at 64 steps: their least common multiple passed 10^10, and the chunk pattern 2^48), each
    rate is rounded to a multiple of ``1/steps`` of the fastest instead: the same precision, one
    denominator."""
    top = max(rates)
    fractions = [max(Fraction(r / top).limit_denominator(steps), Fraction(1, steps)) for r in rates]
    scale = lcm(*(f.denominator for f in fractions))
    if scale > steps * steps:
        return [max(1, round(steps * r / top)) for r in rates]
    return [int(f * scale) for f in fractions]


def channels_schedule(orders, weights, collective, k=1, root=0, algorithm=NAME, routes=None, **info):
    """Rings over ``orders`` side by side, channel ``j`` carrying ``weights[j] / sum(weights)`` of every
    block in ``k[j]`` chunks per ring block (``k`` may be one int for all); ring steps of the channels
    interleave in the programs. ``routes`` pins rank pairs' paths (:attr:`Schedule.routes`)."""
    orders = [[int(r) for r in order] for order in orders]
    p = len(orders[0])
    check_request(algorithm, collective, p, root)
    # only a broadcast has a root: another collective's schedule must not depend on the one asked with
    root = int(root) if collective == "broadcast" else 0
    ks = [int(k)] * len(orders) if isinstance(k, int) else [int(x) for x in k]
    rings = p if collective == "allreduce" else 1      # ring blocks per channel within one buffer block
    scale = lcm(*ks)
    if sum(weights) * scale * rings > MAX_PATTERN_TOTAL:
        raise PlanError(f"{algorithm}: channel weights {list(weights)} with {ks} chunks per ring block cut the "
                        f"buffer finer than a schedule's chunk pattern can hold")
    pattern, first = [], []                            # chunk weights; first piece of each channel
    for w, kj in zip(weights, ks):
        first.append(len(pattern))
        pattern += [w * scale // kj] * (rings * kj)
    width = len(pattern)
    if collective == "allreduce":      # position i of channel j ends owning the channel's ring block i
        ring_blocks = [[[f + i * kj + s for s in range(kj)] for i in range(p)] for f, kj in zip(first, ks)]
    elif collective in ("reduce_scatter", "allgather"):   # position i holds rank order[i]'s block
        ring_blocks = [[[order[i] * width + f + s for s in range(kj)] for i in range(p)]
                       for order, f, kj in zip(orders, first, ks)]
    else:
        ring_blocks = [[[f + s for s in range(kj)]] + [[]] * (p - 1) for f, kj in zip(first, ks)]
        orders = [order[order.index(root):] + order[:order.index(root)] for order in orders]
    b = ScheduleBuilder(collective, p, tuple(pattern), root=root, algorithm=algorithm)
    b.routes.update(routes or {})
    if collective in ("allreduce", "reduce_scatter"):
        rings_reduce_scatter(b, orders, ring_blocks)
    if collective != "reduce_scatter":
        rings_allgather(b, orders, ring_blocks)
    return b.build(channels=orders, channel_weights=list(weights), channel_chunks=ks, **info)
