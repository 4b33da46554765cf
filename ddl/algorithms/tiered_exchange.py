"""Tiered exchange allreduce: recursive doubling in which a host's ranks talk to several hosts at once.

Sources: J. Bruck, C.-T. Ho, S. Kipnis, E. Upfal and D. Weathersby, "Efficient algorithms for all-to-all
communications in multiport message-passing systems", IEEE TPDS 8(11), 1997 (k-port rounds); J. L.
Träff and S. Hunold, "Decomposing MPI collectives for exploiting multi-lane communication", IEEE
CLUSTER 2020 (every rank of a node as a lane of the node's traffic).

For latency-bound sizes on tiered clusters. Recursive doubling pays one slow latency per doubling
across hosts; but a host of ``m`` ranks holds ``m`` ports, so once its ranks all know the host's sum,
``r - 1`` of them can swap it with ``r - 1`` other hosts in the same slow latency, and the host then
merges the ``r`` sums inside itself, where latency is small. One slow latency then multiplies what
the host knows ``r``-fold instead of 2-fold.

Structure (from the tiers, fastest first; see :func:`ddl.algorithms.hierarchical.stage_partitions`):
the first tier's groups are the *hosts*, all of ``m`` ranks. First every host runs recursive
doubling inside itself. Then, tier by tier, each group of the tier combines its units (the groups of
the tier below, all alike): the ``n`` units are numbered, ``n`` is split into radices ``r`` (mixed
radix, like recursive doubling's bits) and in the round of one digit the units that differ only in
that digit form a block. In a block, the ranks of the units' hosts at the same place pair up across
units by a proper edge colouring of the complete graph on the block's digits (rank ``1 + colour``
of a host speaks to the units whose edge has that colour; rank 0 keeps the host's own sum); each pair
swaps sums. Then every host merges the block's ``r`` sums, held one per *slot* (the digit they came
from), by recursive doubling over the slots in digit order, in which the host's other ranks stand in
for the missing places of a power of two (:func:`_merge`). Every host of a block so computes the same
expression of the same unit sums, and every rank ends with the same expression: results stay bitwise
identical (the verifier checks it).

On 4 GPUs x 16 hosts x 3 racks (2, 6 and 10 us): in-host doubling (4 us), two rounds of radix 4 among
the hosts of a rack (6 + 4 us each), one of radix 3 among the racks (10 + 4 us): 38 us predicted,
against 50 us for recursive doubling; the latency bound is 18 us.

Collectives: allreduce only. Chunks: ``k = pipeline_depth(nbytes)``, every one through every round,
as in recursive doubling. Where the tiers do not fit (a single tier, hosts of different sizes, units
of different sizes, a unit count with a prime factor larger than a host's ports allow: ``m`` for an
even radix, ``m - 1`` for an odd one), all ranks form one host and the schedule is recursive
doubling's; ``auto`` does not build it there (:func:`repeats_doubling`).
"""
from functools import lru_cache

from ..errors import PlanError
from ..schedule import ScheduleBuilder
from .hierarchical import stage_partitions
from .recursive_doubling import doubling
from .ring import check_request, nested_order, pipeline_depth, rank_partitions

NAME = "tiered-exchange"
SUPPORTED = ("allreduce",)


def colouring(r):
    """Proper edge colouring of the complete graph on ``r`` digits: ``{(d, e): colour}``, symmetric;
    ``r - 1`` colours when ``r`` is even (circle method), ``r`` when odd (``(d + e) mod r``)."""
    if r % 2:
        return {(d, e): (d + e) % r for d in range(r) for e in range(r) if d != e}
    n = r - 1
    colour = {(d, e): (d + e) % n for d in range(n) for e in range(n) if d != e}
    for d in range(n):                 # the colour d misses among the others goes to the pivot n
        colour[(d, n)] = colour[(n, d)] = 2 * d % n
    return colour


def ports_needed(r):
    """Ranks a host needs for radix ``r``: the keeper (rank 0) and one per colour."""
    return 1 + (r - 1 if r % 2 == 0 else r)


def radices(n, m):
    """Mixed radix of ``n`` units for hosts of ``m`` ranks: fewest rounds, then fewest merge rounds;
    raises PlanError when a prime factor needs more ports than a host has."""

    @lru_cache(maxsize=None)
    def best(k):
        if k == 1:
            return (0, 0), ()
        options = []
        for r in range(2, k + 1):
            if k % r == 0 and ports_needed(r) <= m:
                (rounds, merges), rest = best(k // r)
                width = (r - 1).bit_length()             # in-host rounds of the merge (see _merge)
                merge = width + (0 if 1 << width <= m else 2)
                options.append(((rounds + 1, merges + merge), (r,) + rest))
        if not options:
            return (float("inf"), 0), ()
        return min(options)

    cost, digits = best(n)
    if cost[0] == float("inf"):
        raise PlanError(f"{NAME}: {n} units do not split into radices that hosts of {m} ranks can serve "
                        f"(radix r needs r ranks per host when even, r + 1 when odd)")
    return list(digits)


def tiered_exchange_schedule(hosts, stages, collective="allreduce", k=1, algorithm=NAME, **info):
    """Tiered exchange allreduce. ``hosts``: rank lists, all of one size (their order is their port
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
            _combine(b, hosts, units, digits, chunks)
    return b.build(hosts=hosts, radices=plan, **info)


def _combine(b, hosts, units, digits, chunks):
    """The rounds of one group: one per digit of the mixed radix ``digits``."""
    stride = 1
    for r in digits:
        colour = colouring(r)
        for u, unit in enumerate(units):
            d = u // stride % r
            block = [u + (e - d) * stride for e in range(r)]      # the units differing in this digit
            for place, host in enumerate(unit):
                for e in range(d + 1, r):                        # each pair once, from its lower digit
                    other = hosts[units[block[e]][place]]
                    for c in chunks:
                        b.exchange(hosts[host][1 + colour[d, e]], other[1 + colour[d, e]], c, reduce=False)
        for u, unit in enumerate(units):
            d = u // stride % r
            for host in unit:
                ranks = hosts[host]
                slots = [ranks[0] if e == d else ranks[1 + colour[d, e]] for e in range(r)]
                _merge(b, slots, [x for x in ranks if x not in slots], chunks)
        stride *= r


def _merge(b, slots, spare, chunks):
    """Allreduce inside a host of the values the ranks ``slots`` hold (in slot order); ``spare`` ranks
    hold nothing that counts and end with the result too.

    Recursive doubling over ``2**ceil(log2 len(slots))`` places, slots first and spare ranks filling
    the rest: two places that both hold a value exchange and reduce, a place that holds one copies it
    to an empty partner. No folding, so three slots on a host of four take two rounds, not three plus
    one to tell the fourth rank. Where the host is too small for that, the slots fold (recursive
    doubling) and then hand the result to the spare ranks."""
    width = 1 << (len(slots) - 1).bit_length()
    if width > len(slots) + len(spare):
        doubling(b, slots, chunks)
        rest = spare
    else:
        places = slots + spare[:width - len(slots)]
        rest = spare[width - len(slots):]
        held = [True] * len(slots) + [False] * (width - len(slots))
        for x in (1 << i for i in range(width.bit_length() - 1)):
            for j in range(width):
                q = j ^ x
                if j < q and (held[j] or held[q]):
                    for c in chunks:
                        if held[j] and held[q]:
                            b.exchange(places[j], places[q], c)
                        elif held[j]:
                            b.transfer(places[j], places[q], c)
                        else:
                            b.transfer(places[q], places[j], c)
            held = [held[j] or held[j ^ x] for j in range(width)]
    for rank in rest:
        for c in chunks:
            b.transfer(slots[0], rank, c)


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
        return unfit(f"hosts of unequal sizes {sorted(sizes)}")
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
