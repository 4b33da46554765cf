"""Tiered exchange allreduce: recursive doubling in which a host takes in several hosts' sums at once.

Sources: J. Bruck, C.-T. Ho, S. Kipnis, E. Upfal and D. Weathersby, "Efficient algorithms for all-to-all
communications in multiport message-passing systems", IEEE TPDS 8(11), 1997 (k-port rounds); J. L.
Träff and S. Hunold, "Decomposing MPI collectives for exploiting multi-lane communication", IEEE
CLUSTER 2020 (the ranks of a node as lanes of the node's traffic).

For latency-bound sizes on tiered clusters. Recursive doubling pays one slow latency per doubling
across hosts; but a host of ``m`` ranks holds ``m`` ports, so once its ranks all know the host's sum
it can take in the sums of ``r - 1 <= m`` other hosts in one slow latency and combine them inside
itself, where latency is small. One slow latency then multiplies what the host knows ``r``-fold
instead of 2-fold: as much as the latency bound allows a host (:func:`ddl.bounds.latency_rounds`).

Structure (from the tiers, fastest first; see :func:`ddl.algorithms.hierarchical.stage_partitions`):
the first tier's groups are the *hosts*, all of ``m`` ranks. First every host runs recursive
doubling inside itself. Then, tier by tier, each group of the tier combines its units (the groups of
the tier below, all alike): the ``n`` units are numbered, ``n`` is split into radices ``r <= m + 1``
(mixed radix, like recursive doubling's bits) and in the round of one digit the units that differ
only in that digit form a block; the hosts at the same place in a block's units combine their sums
``S_0 .. S_{r-1}`` (digit order) in one *cross round* and one *merge round*:

* radix 2: every rank swaps with its counterpart in the other host and reduces (no merge round);
* radix ``r >= 3``: the sums split into a low half ``[0, ceil(r/2))`` and a high half. Two *lane*
  ranks of every host each build one half's sum as a chain in digit order, ``(S_0 + S_1) + S_2 ...``,
  from messages of the other hosts' lanes arriving at once (a lane starts from the host's own sum when
  it is one of the first two terms, and otherwise receives the first term and gets the host's own sum
  from a *keeper* rank when its turn comes). In the merge round the two lanes swap and reduce, and
  every other rank receives the low half and reduces the high half into it.

Every host of a block thus computes ``low + high`` of the same sums in the same order, and every rank
ends with the same expression: results stay bitwise identical (the verifier checks it). A host takes
in ``r - 1`` messages per cross round, a lane up to ``ceil(r/2)`` of them, a rank at most two per
merge round: a schedule for the multi-port rounds the fabric offers at latency-bound sizes (the
simulator charges latency per message, no per-message overhead).

On 4 GPUs x 16 hosts x 3 racks (2, 6 and 10 us): in-host doubling (4 us), two rounds of radix 4 among
the hosts of a rack (6 + 2 us each), one of radix 3 among the racks (10 + 2 us): 32 us predicted,
against 50 us for recursive doubling; the latency bound is 18 us.

Collectives: allreduce only. Chunks: ``k = pipeline_depth(nbytes)``, every one through every round,
as in recursive doubling. Where the tiers do not fit (a single tier, hosts of different sizes, units
of different sizes, a unit count with a prime factor above ``m + 1``), all ranks form one host and the
schedule is recursive doubling's; ``auto`` does not build it there (:func:`repeats_doubling`).
"""
from functools import lru_cache

from ..errors import PlanError
from ..schedule import ScheduleBuilder
from .hierarchical import stage_partitions
from .recursive_doubling import doubling
from .ring import check_request, nested_order, pipeline_depth, rank_partitions

NAME = "tiered-exchange"
SUPPORTED = ("allreduce",)
KEEPER = 0                 # the rank of a host that keeps its sum through a cross round


def radices(n, m):
    """Mixed radix of ``n`` units for hosts of ``m`` ranks: fewest rounds, then fewest merge rounds
    (radix 2 needs none); raises PlanError when a prime factor is above ``m + 1``."""

    @lru_cache(maxsize=None)
    def best(k):
        if k == 1:
            return (0, 0), ()
        options = []
        for r in range(2, min(k, m + 1) + 1):
            if k % r == 0:
                (rounds, merges), rest = best(k // r)
                options.append(((rounds + 1, merges + (r > 2)), (r,) + rest))
        if not options:
            return (float("inf"), 0), ()
        return min(options)

    cost, digits = best(n)
    if cost[0] == float("inf"):
        raise PlanError(f"{NAME}: {n} units do not split into radices that hosts of {m} ranks can serve "
                        f"(a host takes in at most {m} sums per round: radix {m + 1} at most)")
    return list(digits)


def tiered_exchange_schedule(hosts, stages, collective="allreduce", k=1, algorithm=NAME, **info):
    """Tiered exchange allreduce. ``hosts``: rank lists, all of one size (their order is their lane
    order); ``stages``: for every tier above the hosts, its groups, each a list of units, each unit a
    list of host indices in the same places (units of one group are alike). One host of every rank
    and no stages is recursive doubling."""
    hosts = [[int(r) for r in h] for h in hosts]
    p = sum(len(h) for h in hosts)
    check_request(algorithm, collective, p, 0, SUPPORTED)
    m = len(hosts[0])
    if any(len(h) != m for h in hosts):
        raise PlanError(f"{algorithm} needs hosts of one size; got {sorted({len(h) for h in hosts})}")
    b = ScheduleBuilder(collective, p, (1,) * k, algorithm=algorithm)
    chunks = range(k)
    for h in hosts:
        doubling(b, h, chunks)
    plan = []
    for groups in stages:
        for units in groups:
            if len({len(u) for u in units}) != 1:
                raise PlanError(f"{algorithm} needs the units of a tier to be alike; got sizes "
                                f"{sorted({len(u) for u in units})}")
            digits = radices(len(units), m)
            plan.append(digits)
            stride = 1
            for r in digits:
                for u, unit in enumerate(units):
                    if u // stride % r == 0:            # the block's first unit speaks for the block
                        block = [units[u + e * stride] for e in range(r)]
                        for place in range(len(unit)):
                            _block(b, [hosts[v[place]] for v in block], chunks)
                stride *= r
    return b.build(hosts=hosts, radices=plan, **info)


def _block(b, members, chunks):
    """One cross round and one merge round among the hosts ``members`` (rank lists, in digit order):
    every rank of every member ends with the same expression of the members' sums."""
    r = len(members)
    if r == 2:
        for x, y in zip(*members):
            for c in chunks:
                b.exchange(x, y, c)
        return
    lanes = (1, 2) if len(members[0]) > 2 else (0, 1)    # the keeper is needed only from radix 5
    split = (r + 1) // 2
    halves = (range(split), range(split, r))
    cross = []
    for own, host in enumerate(members):
        for lane, half in zip(lanes, halves):
            for i, (term, keep) in enumerate(_chain(half, own)):
                if keep:
                    continue
                src = host[KEEPER] if term == own else members[term][lane]
                cross += [(src, host[lane], c, i > 0) for c in chunks]
    b.round(cross)
    merge = []
    for host in members:
        low, high = host[lanes[0]], host[lanes[1]]
        for c in chunks:
            merge += [(low, high, c, True), (high, low, c, True)]
            merge += [(x, rank, c, reduce) for rank in host if rank not in (low, high)
                      for x, reduce in ((low, False), (high, True))]
    b.round(merge)


def _chain(half, own):
    """The terms of ``half`` (digits) in the order a lane of host ``own`` takes them, as ``(digit,
    kept)``: the chain ``(S_a + S_b) + S_c ...`` in digit order, where a lane already holding ``S_own``
    keeps it as the first term if ``own`` is one of the first two (addition commutes) and otherwise
    receives the first term into place."""
    terms = list(half)
    if own in terms[:2]:
        terms.remove(own)
        return [(own, True)] + [(t, False) for t in terms]
    return [(t, False) for t in terms]


def tiered_exchange(topo, collective, *, root=0, nbytes=None):
    """Tiered exchange on ``topo``'s tiers (see the module docstring); where they do not fit, every rank
    forms one host and this is recursive doubling (``auto`` then skips it: :func:`repeats_doubling`)."""
    check_request(NAME, collective, topo.nranks, root, SUPPORTED)
    hosts, stages, _ = _structure(topo)
    return tiered_exchange_schedule(hosts, stages, collective, pipeline_depth(nbytes))


def repeats_doubling(topo):
    """Why ``tiered-exchange`` would only repeat recursive doubling on ``topo``, or None."""
    why = _structure(topo)[2]
    return f"{why}: it would repeat recursive doubling" if why else None


def _structure(topo):
    """``(hosts, stages, why)``: the arguments of :func:`tiered_exchange_schedule` from ``topo``'s tiers
    and None, or, where the tiers do not fit, one host of every rank (in ring order), no stages, and
    why they do not fit."""
    p = topo.nranks
    parts = rank_partitions(topo)
    order, _ = nested_order(p, parts, topo.route_bandwidth)

    def unfit(why):
        return [order], [], why

    pos = {r: i for i, r in enumerate(order)}
    try:
        stages = stage_partitions(p, parts)
    except PlanError as exc:
        return unfit(str(exc))
    if len(stages) < 2:
        return unfit("one tier")
    hosts = sorted((sorted(g, key=pos.get) for g in stages[0]), key=lambda h: pos[h[0]])
    sizes = {len(h) for h in hosts}
    if len(sizes) > 1:
        return unfit(f"the groups of its fastest tier have unequal sizes {sorted(sizes)}")
    units = [[i] for i in range(len(hosts))]      # the units of the tier below, as lists of hosts
    grouped = []
    for groups in stages[1:]:
        owner = {r: gi for gi, g in enumerate(groups) for r in g}
        children = [[] for _ in groups]
        for unit in units:
            children[owner[hosts[unit[0]][0]]].append(unit)
        for kids in children:
            if len({len(u) for u in kids}) > 1:
                return unfit(f"units of unequal sizes in a tier ({sorted({len(u) for u in kids})} hosts)")
            try:
                radices(len(kids), len(hosts[0]))
            except PlanError as exc:
                return unfit(str(exc))
        grouped.append([sorted(kids, key=lambda u: pos[hosts[u[0]][0]]) for kids in children])
        units = [[h for unit in kids for h in unit] for kids in grouped[-1]]
    return hosts, grouped, None
