"""Flow-level simulation of a schedule on a topology: how long it takes and which links it loads.

Model
=====
The simulator replays the schedule's dataflow (the same rules executors and the verifier follow, see
:mod:`ddl.schedule`) in continuous time.

* **Readiness.** An operation is *ready* when every operation in ``schedule.dependencies`` is complete.
* **Transfers.** A send and its matched receive (``schedule.matches``) form one transfer of
  ``chunk_fraction(c) * nbytes`` bytes. It starts as soon as the *send* is ready and no other message
  from the same rank to the same peer is still leaving: executors post their receives early into
  scratch space, so the sender never waits for the receiver, but the messages of one rank pair share
  one connection and leave one after the other (MPI's non-overtaking order), the earliest in the
  program first among those ready. This is what makes pipelines pipeline: chunk ``j`` moves on to the
  next hop while chunk ``j+1`` crosses this one, instead of all chunks crawling side by side.
* **Routes.** A transfer from rank ``s`` to ``d`` follows ``schedule.routes[(s, d)]`` (``(path, share)``
  pairs; shares are normalised to sum to 1) when the schedule pins it, else ``topo.routes(s, d)`` split
  evenly. Every path with a non-zero share is a separate *fluid flow* of ``share * bytes`` bytes over the
  directed links ``(u, v)`` of the path, each of capacity ``topo.capacity(u, v)``.
* **Bandwidth sharing.** Flows that are active at the same time share every link *max-min fairly*
  (progressive filling: all unfrozen flows grow at the same rate, a link that fills up freezes the flows
  through it). Rates are recomputed only when the set of active flows changes; flows that drain, and
  events that fire, within a relative ``1e-9`` of each other are handled as one event (at the latest of
  their times), so a symmetric step of ``p`` flows costs one rate computation, not ``p``; and a rank
  pair whose next message leaves the instant its previous one drained keeps its rate (a pipeline's
  back-to-back chunks cost no rate computation at all), and flows on a path that shares no link with
  any other active path split its narrowest link without one (a ring's hops, mostly).
* **Message cost.** A rank spends ``topo.message_cost`` seconds (the file's ``defaults.message_cost``,
  0 unless given) to post each message it sends, one message at a time: a send that becomes ready is
  posted that long after the rank's previous post (or after it became ready, if the rank was idle),
  and only then may it leave. Sends that become ready at one instant are posted in program order.
  Posting overlaps with the data of earlier messages on the wire, so a pair's pipeline of ``k``
  messages takes about ``max(k * cost, cost + bytes / bandwidth)``: LogP's overhead, which makes many
  small messages slower than few large ones where the bandwidth and latency terms cannot.
* **Latency.** A transfer's data *arrives* one path latency after its last byte leaves:
  ``arrival = drain end + latency``, the latency of a path being the sum of its links' latencies and,
  with several paths, the largest among those with a non-zero share. Bandwidth and latency thus
  pipeline (cut-through), as they do on real fabrics.
* **Completion.** A send completes when its data has arrived (so a later overwrite of that chunk waits,
  which is the executor's write-after-read rule). A ``recv`` completes at ``max(arrival, its own
  dependencies complete)``. A ``reduce`` then also needs ``bytes / topo.reduce_bandwidth(rank)`` on the
  rank's single compute engine: reductions of one rank run one at a time, first come first served in the
  order they became ready (those ready at the same instant in program order), starting at
  ``max(arrival, dependencies complete, engine free)``.
* **Empty chunks.** Executors skip zero-byte chunks on both sides (no message is sent), so a zero-byte
  transfer or reduction takes no time at all; it still orders the operations that depend on it.
* The makespan (``seconds``) is the completion time of the last operation; an empty schedule (one rank,
  or nothing to do) takes 0 seconds.

Why the prediction is never optimistic
--------------------------------------
The simulated execution is itself a feasible execution on the modelled fabric (serving one rank pair's
messages in turn only removes freedom): at every instant the rates of the flows through a link sum to
at most its capacity (progressive filling never hands out more than a link's residual capacity), every
byte of every chunk is carried over every link of its route, and every message pays the full latency of
its path after its last byte is sent, on top of the time its dependencies took. Nothing is ever done
earlier than the dataflow allows; the only approximation, merging events within ``1e-9`` relative time,
always moves events *later*. So any lower bound that holds for every execution on the topology
(cut/bandwidth bounds; :mod:`ddl.bounds`) also holds for the simulated time. The latency bound of
:mod:`ddl.bounds` is the round model's (a rank sends and receives one message at a time): it holds for
schedules that move one message per rank and step (rings, halving-doubling), but a rank here may send
or receive several at once, so a tree with several children can be predicted below it at tiny sizes.
The model can be *pessimistic* (max-min fair sharing is not the optimal rate allocation for the
makespan; a multi-path transfer waits for its slowest path plus its largest latency), never the other
way round.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .errors import ScheduleError
from .schedule import OP_KINDS, _flat_ops, gc_paused

__all__ = ["Simulation", "Outpaced", "simulate", "max_min_rates"]

# Relative tolerance within which drains and events are merged, and link shares count as equal.
RTOL = 1e-9
# Absolute floor of that tolerance, in seconds.
ATOL = 1e-18
# Relative slack of the optimality checks of the rate repair (see _repair).
_CHECK = 1e-7
# With a ceiling, links that carry at least this fraction of the busiest link's time are watched ...
WATCHED_LOAD = 0.5
# ... and the bound is checked every this many instants of the run.
CEILING_EVERY = 16
# ... and stops once that bound exceeds the ceiling by more than this part of it (ties are never cut).
OUTPACED_BY = 1e-6

_SEND, _RECV, _REDUCE = range(3)     # Dataflow.kind: indices into OP_KINDS
_NAMES = OP_KINDS


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    ``seconds``: makespan. ``link_bytes``: ``{(u, v): bytes}`` carried by every directed link that
    carried any. ``link_utilisation``: ``{(u, v): bytes / (capacity * seconds)}`` (0 when ``seconds`` is
    0). ``busiest``: the 5 most utilised links as ``((u, v), utilisation, bytes)``, most utilised first.
    ``transfers``: number of matched send/receive pairs in the schedule (empty ones included).
    ``events``: number of rate recomputations (what the simulation itself cost). ``timeline``: for every
    link :func:`simulate` was asked to trace, its load as ``((start, end, bytes/s), ...)``, piecewise
    constant over the run (empty for a link that carried nothing).
    """

    seconds: float
    link_bytes: dict = field(default_factory=dict)
    link_utilisation: dict = field(default_factory=dict)
    busiest: list = field(default_factory=list)
    transfers: int = 0
    events: int = 0
    timeline: dict = field(default_factory=dict)

    def profile(self, link, capacity, bins=60):
        """How busy ``link`` was in each of ``bins`` equal slices of the run: the traced load over
        ``capacity`` averaged per slice (a list of floats in [0, 1]). A link that idles while others
        work shows where a schedule's pipeline fills and drains."""
        busy = np.zeros(bins)
        if self.seconds <= 0:
            return busy.tolist()
        width = self.seconds / bins
        for start, end, load in self.timeline.get(link, ()):
            first, last = int(start / width), min(bins - 1, int(end / width))
            for k in range(first, last + 1):
                overlap = min(end, (k + 1) * width) - max(start, k * width)
                if overlap > 0:
                    busy[k] += overlap * load
        return np.clip(busy / (width * capacity), 0.0, 1.0).tolist()

    def __repr__(self):
        return f"Simulation({self.seconds:.6g} s, {self.transfers} transfers, {len(self.link_bytes)} links)"


class Outpaced(Exception):
    """A simulation stopped because its makespan provably exceeds the ceiling it was given.

    ``at_least``: the lower bound on the makespan that proved it (seconds)."""

    def __init__(self, at_least):
        super().__init__(at_least)
        self.at_least = at_least


def simulate(topo, schedule, nbytes, ceiling=None, trace=()):
    """Simulate ``schedule`` on ``topo`` for a buffer of ``nbytes`` bytes; see the module docstring.

    ``nbytes`` is the whole buffer as in :meth:`Schedule.chunk_ranges` (the big buffer of reduce-scatter
    and allgather). Raises :class:`ddl.ScheduleError` when the schedule does not fit the topology
    (rank count, routes over missing links) or deadlocks.

    ``ceiling``: a function returning the time this schedule has to beat, or None. A planner that
    already holds a faster candidate need not know by how much this one loses: every few instants the
    simulation takes the simulated time plus, for each of the most loaded links, the bytes of the
    transfers that have not yet started on it over its capacity. That is a lower bound on the
    makespan (those bytes cross the link after now, never faster than its capacity). Once it exceeds the
    ceiling by more than one part in a million (so ties are never cut), the run stops with
    :class:`Outpaced`. The function is called again at every check: it may fall while the run goes on.
    A fresh run first calls it at its first check, once it is set up (at 1024 ranks a ring's set-up
    alone takes 9 s), so a second call means that the run has passed a check.

    ``trace``: directed links ``(u, v)`` whose load over time to record in ``Simulation.timeline``.

    A run to its end is remembered on the schedule (which is immutable) for the topology's fingerprint
    and the size, and given again: an algorithm that simulates its variants to choose among them has
    simulated the one it returns, and the planner need not run it twice (on the 192-rank three-tier
    cluster 1.7 s of a 7.7 s plan). So is the bound that stopped a run: a later call whose ceiling is
    below it stops at once (a variant given up on as soon as it could not win the plan is not
    simulated again by the planner).
    """
    try:
        nbytes = float(nbytes)
    except (TypeError, ValueError):
        raise ScheduleError(f"buffer size must be a number of bytes, got {nbytes!r}") from None
    if not 0 <= nbytes < math.inf:
        raise ScheduleError(f"buffer size must be a non-negative number of bytes, got {nbytes!r}")
    if schedule.nranks != topo.nranks:
        raise ScheduleError(f"schedule for {schedule.nranks} ranks on a topology of {topo.nranks} ranks")
    if trace:
        return _Run(topo, schedule, nbytes, ceiling, tuple(trace)).run()
    runs = schedule.__dict__.setdefault("_simulations", {})    # (frozen: no attribute can be set)
    key = _run_key(topo, nbytes)
    if key not in runs:
        stops = schedule.__dict__.setdefault("_stopped_at", {})
        known = stops.get(key, 0.0)
        if ceiling is not None and known and known > ceiling() * (1.0 + OUTPACED_BY):
            raise Outpaced(known)                  # an earlier run stopped there proved it already
        try:
            runs[key] = _Run(topo, schedule, nbytes, ceiling, ()).run()
        except Outpaced as stopped:
            stops[key] = max(known, stopped.at_least)
            raise
    elif ceiling is not None and runs[key].seconds > ceiling() * (1.0 + OUTPACED_BY):
        raise Outpaced(runs[key].seconds)          # (the makespan itself bounds the makespan)
    return runs[key]


def simulated(topo, schedule, nbytes):
    """True when :func:`simulate` already holds the run of ``schedule`` on ``topo`` at ``nbytes`` (it
    answers at once)."""
    return _run_key(topo, nbytes) in schedule.__dict__.get("_simulations", ())


def _run_key(topo, nbytes):
    """What :func:`simulate` keeps a schedule's run under: the topology's fingerprint and the bytes."""
    return topo.fingerprint, float(nbytes)


def load_seconds(topo, schedule, nbytes):
    """The busiest link's bytes over its capacity when ``schedule`` moves a buffer of ``nbytes``: a
    lower bound on its makespan, found without simulating (the bytes a link carries do not depend on
    when they cross it). Two layouts of the same data that differ only in which links carry it compare
    by this at a fraction of a simulation's cost."""
    return max((b / topo.capacity(*link) for link, b in link_totals(topo, schedule, nbytes).items()), default=0.0)


def link_totals(topo, schedule, nbytes):
    """``{(u, v): bytes}`` that every directed link carries when ``schedule`` moves a buffer of
    ``nbytes`` (links that carry nothing left out), without simulating: what
    :attr:`Simulation.link_bytes` will say.

    Sends paired with their receives are all it takes, not the dependencies: unless the schedule
    holds its :attr:`~ddl.schedule.Schedule.dataflow` already, it is not built (hierarchical's
    one-chunk schedule with a share per rank at 1024 ranks: 5.8 s with it, spans expanded to their
    chunks, 0.3 s without)."""
    run = _Run(topo, schedule, float(nbytes))
    if "dataflow" in schedule.__dict__:
        n, kind, rank, size, partner, _, _ = run._flatten()
        if n == 0:
            return {}
    else:
        flat = _flat_ops(schedule)
        if flat is None:           # no operations
            return {}
        kind, chunk, rank, partner, _ = flat
        size = schedule.chunk_fractions[chunk] * float(nbytes)
    _, pair_route, pair_bytes, _ = run._pairs(kind, rank, partner, size)
    total = _link_totals(run.fabric, pair_route, pair_bytes)
    return {key: float(b) for key, b in zip(run.fabric.keys, total) if b > 0}


def max_min_rates(flow_links, capacity, weights=None, bottlenecks=False):
    """Weighted max-min fair rates by progressive filling (numpy).

    ``flow_links``: int array ``(nflows, hops)`` of link indices, padded with -1; ``capacity``: float
    array of every link's capacity; ``weights``: how many unit flows each row stands for (default 1).
    Returns the rate of one unit flow of every row: row ``i`` takes ``weights[i] * rate[i]`` of every
    link it crosses, and these never sum to more than a link's capacity. Rows without links get ``inf``.
    With ``bottlenecks=True`` returns ``(rates, links)``: for every row a link (index into
    ``capacity``) that is saturated and on which no row is faster (-1 for rows without links).

    The simulator keeps the same rates up to date region by region as flows come and go
    (:func:`_repair`); this computes them for a whole set of flows at once, from scratch, and is what
    the tests hold the simulator's rates to.
    """
    nflows = flow_links.shape[0]
    rate = np.zeros(nflows)
    neck = np.full(nflows, -1, dtype=np.int64)
    if nflows == 0:
        return (rate, neck) if bottlenecks else rate
    w = np.ones(nflows) if weights is None else np.asarray(weights, dtype=float)
    mask = flow_links >= 0
    entry_flow = np.nonzero(mask)[0]
    entry_link = flow_links[mask]
    links, entry_local = np.unique(entry_link, return_inverse=True)
    nlinks = len(links)
    residual = np.asarray(capacity, dtype=float)[links]
    frozen = np.bincount(entry_flow, minlength=nflows) == 0
    rate[frozen] = math.inf
    entry_w = w[entry_flow]
    load = np.bincount(entry_local, weights=entry_w, minlength=nlinks)
    level = 0.0
    while not frozen.all():
        live = load > 0
        share = np.full(nlinks, math.inf)
        np.divide(residual, load, out=share, where=live)
        delta = share.min()
        level += delta
        saturated = live & (share <= delta * (1.0 + RTOL))
        residual -= delta * load
        residual[saturated] = 0.0
        np.maximum(residual, 0.0, out=residual)
        sel = saturated[entry_local] & ~frozen[entry_flow]
        hit = entry_flow[sel]
        rate[hit] = level
        neck[hit] = links[entry_local[sel]]
        frozen[hit] = True
        load = np.bincount(entry_local, weights=entry_w * ~frozen[entry_flow], minlength=nlinks)
    return (rate, neck) if bottlenecks else rate


def _repair(region, st, now):
    """Bring the max-min fair rates up to date after the bundles in ``region`` changed.

    Rates are recomputed for ``region`` with every other bundle's usage held fixed; then the
    optimality conditions of max-min fairness are checked where the new rates could break them: every
    bundle needs a *bottleneck*, a saturated link of its path on which no flow is faster. Bundles that
    fail join the region and it is filled again, until everything checks out. Before the change every
    bundle had such a bottleneck, so only links the region crosses need checking. The result is the
    unique max-min fair allocation (up to the slack ``_CHECK`` of the checks), but the work stays near
    the change instead of spanning every bundle that shares a link, transitively, with it. Updates the
    state in place (settling virtual time at ``now`` before a rate changes) and returns the bundles
    whose rate changed.
    """
    rate, link_bundles = st.rate, st.link_bundles
    held, load, capacity = st.held, st.load, st.cap
    changed = set()
    check = _CHECK
    while True:
        new, neck, members = _fill_region(region, st)
        for b, r in new.items():
            if st.set_rate(b, r, now):
                changed.add(b)
            st.hold(b, neck[b])
        failed = set()
        # (i) no bundle outside the region may be faster on a region bundle's bottleneck
        slowest = {}
        for b in region:
            l = neck[b]
            r = rate[b]
            if r < slowest.get(l, math.inf):
                slowest[l] = r
        for l, r in slowest.items():
            on = link_bundles[l]
            if len(on) > len(members[l]):
                top = r * (1.0 + check)
                for x in on:
                    if rate[x] > top and x not in region:
                        failed.add(x)
        # (ii) bundles outside the region held back on a link the region crosses: the link must still
        # be full, and no region bundle on it faster (outside bundles there were not, and kept their rates)
        for l, mem in members.items():
            hl = held[l]
            if not hl:
                continue
            out = [x for x in hl if x not in region]
            if not out:
                continue
            if load[l] < capacity[l] * (1.0 - check):
                failed.update(out)
            else:
                floor = max(rate[x] for x in mem) * (1.0 - check)
                failed.update(x for x in out if rate[x] < floor)
        if not failed:
            return changed
        region = region | failed


def _private_change(b, rate, st):
    """Whether bundle ``b``, whose bottleneck is a link only it uses, may just take per-flow ``rate``.

    Its total rate stays that link's capacity, so no link's load changes. Slower flows break no
    other bundle's bottleneck; faster ones must not overtake a bundle held back on a link they share.
    """
    if rate <= st.rate[b]:
        return True
    floor = rate * (1.0 - _CHECK)
    rates, held = st.rate, st.held
    for l in st.links[b]:
        for x in held[l]:
            if x != b and rates[x] < floor:
                return False
    return True


def _fill_region(region, st):
    """Weighted max-min fair rates of ``region`` with the usage of every other bundle held fixed.

    ``st.load[l]`` is the current usage of link ``l`` by all bundles. Returns ``({bundle: per-flow
    rate}, {bundle: bottleneck link}, {link: region bundles on it})``. A link that carries one bundle of
    the region only caps that bundle, so only links shared within the region take part in the filling.

    Plain Python at every size: a region's filling takes one step per level at which links fill, and
    the vectorised :func:`max_min_rates` pays a dozen numpy calls for each, which cost more than the
    heap below where links fill at many levels, as a packing's do. Handing regions of more than 48
    bundles to it, as the simulator once did, took 17-20 s of CPU to simulate tree-packing's 256 MiB
    allreduce on the leaf-spine cluster instead of 11-15 s (alternating runs); the heap's entries left
    in place until popped (below) then took it to 8-10 s. (Hierarchical's regions at 1024 ranks fill
    in few levels, and numpy was a little faster there: 7.0-7.3 s a simulation against 7.1-7.7 s.)
    """
    bundle_links, weight, rate, load, capacity = st.links, st.m, st.rate, st.load, st.cap
    members, freed, flows = {}, {}, {}     # per link: region bundles, their usage, their flows
    for b in region:
        w = weight[b]
        use = w * rate[b]
        for l in bundle_links[b]:
            mem = members.get(l)
            if mem is None:
                members[l] = [b]
                freed[l] = use
                flows[l] = w
            else:
                mem.append(b)
                freed[l] += use
                flows[l] += w
    # Progressive filling as a sequence of events in the common level: a bundle reaches the cap of
    # the links it has to itself, or a shared link fills up (at level remaining / unfrozen flows).
    # A shared link's level only rises as flows through it freeze (each at a level no higher than
    # the link's), so its entry in the heap stays where it is until popped, and is pushed again then
    # if the link has risen since: far fewer pushes than one per change.
    heappush, heappop = heapq.heappush, heapq.heappop
    todo = []                      # (level, kind, id): kind 0 = bundle cap, 1 = shared link full
    residual, lim, at_cap = {}, {}, {}
    for l, mem in members.items():
        r = capacity[l] - (load[l] - freed[l])
        r = residual[l] = r if r > 0.0 else 0.0
        if len(mem) > 1:
            todo.append((r / flows[l], 1, l))
        else:                      # the first of a bundle's own links with the least room caps it
            del flows[l]
            b = mem[0]
            if r < lim.get(b, math.inf):
                lim[b] = r
                at_cap[b] = l
    for b, r in lim.items():
        todo.append((r / weight[b], 0, b))
    heapq.heapify(todo)
    rates, neck = {}, {}
    left = len(region)
    while left:
        level, what, x = heappop(todo)
        if what == 0:
            if x in rates:
                continue
            frozen, at = (x,), at_cap[x]
        else:
            c = flows.get(x)
            if c is None:                  # full already, or all its flows frozen elsewhere
                continue
            due = residual[x] / c
            if due > level:                # risen since it was pushed
                heappush(todo, (due, 1, x))
                continue
            del flows[x]
            frozen, at = [b for b in members[x] if b not in rates], x
        for b in frozen:
            rates[b] = level
            neck[b] = at
            left -= 1
            w = weight[b]
            use = w * level
            for l in bundle_links[b]:
                c = flows.get(l)
                if c is not None:
                    c -= w
                    if c:
                        flows[l] = c
                        r = residual[l] - use
                        residual[l] = r if r > 0.0 else 0.0
                    else:
                        del flows[l]
    return rates, neck, members


class _Fabric:
    """Directed links and bundles (distinct paths) the schedule uses, indexed, with per-pair routes."""

    def __init__(self, topo, schedule):
        self.topo, self.schedule = topo, schedule
        self.index = {}
        self.keys, self.caps, self.lats = [], [], []
        self.bundle_links = []         # bundle -> tuple of link indices
        self.pairs = {}

    def link(self, u, v, where):
        i = self.index.get((u, v))
        if i is None:
            cap = float(self.topo.capacity(u, v))
            if not cap > 0:
                raise ScheduleError(f"{where}: route uses {u!r} -> {v!r}, which is not a link of the topology")
            i = self.index[(u, v)] = len(self.keys)
            self.keys.append((u, v))
            self.caps.append(cap)
            self.lats.append(float(self.topo.latency(u, v)))
        return i

    def _check_forwarding(self, where, path, ends):
        """A pinned path must follow the rules every bound assumes (see :mod:`ddl.bounds`): no vertex
        twice, only transit vertices in between (GPUs and ranks do not forward), and none at all where
        the two ranks share a direct link, which transports take alone."""
        if len(set(path)) < len(path):
            raise ScheduleError(f"{where}: path {list(path)} passes through a vertex twice")
        for v in path[1:-1]:
            try:
                transit = self.topo.is_transit(v)
            except KeyError:
                raise ScheduleError(f"{where}: path {list(path)} passes through {v!r}, which is no node of "
                                    f"the topology") from None
            if not transit:
                raise ScheduleError(f"{where}: path {list(path)} passes through {v!r}, which does not forward "
                                    f"data (only switch, nic, host, cpu and pcie vertices that are not ranks do)")
        if len(path) > 2 and self.topo.capacity(*ends) > 0:
            raise ScheduleError(f"{where}: path {list(path)} goes around the direct link {ends[0]!r} -> {ends[1]!r}, "
                                f"which transports take alone between ranks that have one")

    def route(self, src, dst):
        """``(bundles, shares, latency)`` of the pair: one bundle per path with a non-zero share."""
        r = self.pairs.get((src, dst))
        if r is not None:
            return r
        where = f"route {src} -> {dst}"
        pinned = self.schedule.routes.get((src, dst))
        if pinned is None:
            paths = tuple(self.topo.routes(src, dst))
            if not paths:
                raise ScheduleError(f"{where}: the topology has no route between these ranks")
            paths = [(tuple(p), 1.0) for p in paths]
        else:
            try:
                paths = [(tuple(p), float(w)) for p, w in pinned]
            except (TypeError, ValueError):
                raise ScheduleError(f"{where}: routes must be (path, share) pairs") from None
            if any(not (0 <= w < math.inf) for _, w in paths):
                raise ScheduleError(f"{where}: path shares must be finite and non-negative")
        merged = {}
        for p, w in paths:
            if w > 0:
                merged[p] = merged.get(p, 0.0) + w
        total = sum(merged.values())
        if not total > 0:
            raise ScheduleError(f"{where}: no path has a positive share")
        if total == math.inf:          # each share finite, their sum not: every share over it would be 0 or nan
            raise ScheduleError(f"{where}: the path shares add up to more than a float holds; they are relative "
                                f"(each path's part of their sum): scale them down")
        ends = (self.topo.ranks[src], self.topo.ranks[dst])
        bundles, shares, latency = [], [], 0.0
        for path, w in merged.items():
            if len(path) < 2 or (path[0], path[-1]) != ends:
                raise ScheduleError(f"{where}: path {list(path)} must run from {ends[0]!r} to {ends[1]!r}")
            if pinned is not None:
                self._check_forwarding(where, path, ends)
            ids = tuple(self.link(u, v, where) for u, v in zip(path[:-1], path[1:]))
            bundles.append(len(self.bundle_links))
            self.bundle_links.append(ids)
            shares.append(w / total)
            latency = max(latency, sum(self.lats[i] for i in ids))
        r = self.pairs[(src, dst)] = (bundles, shares, latency)
        return r


class _State:
    """Bundles and links during a run (plain lists: the event loop reads them millions of times)."""

    def __init__(self, fabric):
        nb, nl = len(fabric.bundle_links), len(fabric.caps)
        self.links = fabric.bundle_links       # bundle -> its links
        self.cap = fabric.caps
        self.m = [0] * nb                      # active flows of the bundle
        self.v = [0.0] * nb                    # virtual time: bytes served per flow ...
        self.t = [0.0] * nb                    # ... up to this time
        self.rate = [0.0] * nb                 # bytes/s of each of its flows
        self.bottleneck = [-1] * nb            # a full link of its path on which no flow is faster
        self.link_bundles = [set() for _ in range(nl)]   # active bundles on each link
        self.held = [set() for _ in range(nl)]           # bundles whose bottleneck it is
        self.load = [0.0] * nl                 # bytes/s through each link

    def set_rate(self, b, rate, now):
        """Give bundle ``b``'s flows ``rate`` from ``now`` on; whether it changed."""
        old = self.rate[b]
        if rate == old:
            return False
        self.v[b] += old * (now - self.t[b])
        self.t[b] = now
        self.rate[b] = rate
        delta = self.m[b] * (rate - old)
        load = self.load
        for l in self.links[b]:
            load[l] += delta
        return True

    def hold(self, b, link):
        """Make ``link`` bundle ``b``'s bottleneck."""
        old = self.bottleneck[b]
        if link != old:
            if old >= 0:
                self.held[old].discard(b)
            self.held[link].add(b)
            self.bottleneck[b] = link


class _Run:
    def __init__(self, topo, schedule, nbytes, ceiling=None, trace=()):
        self.topo, self.schedule, self.nbytes, self.ceiling, self.trace = topo, schedule, nbytes, ceiling, trace
        self.fabric = _Fabric(topo, schedule)

    def _watched(self, link_total):
        """For the ceiling check: ``(the bytes each watched link must carry, their capacities, the
        watched links of every bundle as positions in those lists)``, from ``link_total`` (bytes per
        link over the run). Watched are the links whose load over capacity comes within
        :data:`WATCHED_LOAD` of the busiest's: any subset gives a valid bound, and these are where it
        starts highest."""
        fabric = self.fabric
        caps = np.array(fabric.caps)
        seconds = link_total / caps
        watched = np.nonzero(seconds >= WATCHED_LOAD * seconds.max())[0] if len(seconds) else []
        local = {int(l): i for i, l in enumerate(watched)}
        bundle_watch = [tuple(local[l] for l in links if l in local) for links in fabric.bundle_links]
        return link_total[watched].tolist(), caps[watched].tolist(), bundle_watch

    def _flatten(self):
        """Every op of every rank as one index (:attr:`Schedule.dataflow`), with its bytes and a
        fresh count of the ops it still waits for."""
        df = self.schedule.dataflow
        n = len(df.kind)
        size = (self.schedule.chunk_fractions[np.array(df.chunk, dtype=np.int64)] * self.nbytes).tolist() if n else []
        return n, df.kind, df.rank, size, df.partner, list(df.waiting), df.dependents

    def _pairs(self, kind, rank, partner, size):
        """The rank pairs that transfers join, numbered in the order of their first send, with numpy:
        ``(pair of every op (-1 but for sends), route of every pair (as :meth:`_Fabric.route`), bytes
        every pair carries, number of transfers)``. Routes are resolved in that order too, so the first
        pair without one is the one named; then the pinned routes of pairs that carry nothing."""
        nranks = self.schedule.nranks
        sends = np.flatnonzero(np.array(kind) == _SEND)
        ranks = np.array(rank)
        keys, first, inverse = np.unique(ranks[sends] * nranks + ranks[np.array(partner)[sends]],
                                         return_index=True, return_inverse=True)
        by_first = np.argsort(first)
        number = np.empty(len(keys), dtype=np.int64)
        number[by_first] = np.arange(len(keys))
        pair_of_send = number[inverse.ravel()]
        send_pair = np.full(len(kind), -1, dtype=np.int64)
        send_pair[sends] = pair_of_send
        routes = [self.fabric.route(*divmod(int(key), nranks)) for key in keys[by_first]]
        for pair in sorted(self.schedule.routes):   # pinned but unused: still checked, a wrong entry is wrong
            self.fabric.route(*pair)
        pair_bytes = np.bincount(pair_of_send, weights=np.array(size)[sends], minlength=len(keys))
        return send_pair.tolist(), routes, pair_bytes.tolist(), len(sends)

    def run(self):
        with gc_paused():              # millions of small containers: the cyclic GC only costs time here
            return self._run()

    def _run(self):
        topo, schedule, fabric = self.topo, self.schedule, self.fabric
        n, kind, rank, size, partner, waiting, dependents = self._flatten()
        if n == 0:
            return Simulation(0.0)

        send_pair, pair_route, pair_bytes, ntransfers = self._pairs(kind, rank, partner, size)
        nranks = schedule.nranks
        reduce_bw = [float(topo.reduce_bandwidth(r)) for r in range(nranks)]
        link_total = _link_totals(fabric, pair_route, pair_bytes)   # the result's, and the ceiling's start

        # Operation state. Work items and events name an op g and what happens to it, packed in an int.
        DONE, LAND, READY = 0, 1, 2            # work items: 4 * g + action
        POSTED, ENGINE = 0, 1                  # timed events: (time, 2 * g + POSTED or ENGINE) or (time, -batch)
        now = 0.0
        makespan = 0.0
        completed = 0
        finished = [False] * n
        arrived = [False] * n          # recv/reduce: its data has arrived
        deps_ready = [False] * n       # recv/reduce: its dependencies are complete
        paths_left = [0] * n           # send: flows of its transfer still draining
        heap = []                      # timed events
        arrivals = []                  # batches of transfers whose data arrives at the same time
        engine_busy = [False] * nranks
        engine_queue = [[] for _ in range(nranks)]   # heaps of (time it became ready, op)
        engine_idle = set()            # ranks whose engine is free while reductions may be waiting
        # Messages between one pair of ranks go one at a time (MPI's non-overtaking order over one
        # connection): ready sends wait in a heap per pair, earliest in the program first.
        pair_busy = [False] * len(pair_route)
        pair_wait = [[] for _ in range(len(pair_route))]
        pair_dirty = set()             # pairs that may start a send now
        cost = float(topo.message_cost)
        posting = []                   # with a message cost: sends that became ready now, to post
        posted_at = [0.0] * nranks     # when each rank has posted its last message

        # Bundles: all active flows on one path get the same rate (max-min fairness is symmetric), so
        # they are served in virtual time: b_v[b] bytes per flow had been served at time b_t[b], at
        # b_rate[b] since. A flow drains when its bundle's virtual time reaches its key (virtual time at
        # its start + its bytes); b_heap[b] holds the keys, bheap the bundles' next drain times.
        st = _State(fabric)
        bundle_links, link_bundles, link_load, held = st.links, st.link_bundles, st.load, st.held
        b_m, b_v, b_t, b_rate, bottleneck = st.m, st.v, st.t, st.rate, st.bottleneck
        nb = len(bundle_links)
        cap = st.cap
        b_ver = [0] * nb
        b_flows = [deque() for _ in range(nb)]   # (key, send op) of the bundle's flows, in key order
        bheap = []                     # (drain time of the bundle's next flow, bundle, version)
        changed = set()                # bundles whose number of flows changed since the last rate update
        repush = set()                 # bundles whose next drain time changed
        emptied = set()                # bundles whose last flow drained at this instant
        carried_on = []                # ... and that took the next flow of their pair at once
        events = 0
        ceiling = self.ceiling
        bundle_watch = None
        if ceiling is not None:        # bytes the most loaded links must still take (see simulate)
            unstarted, watched_cap, bundle_watch = self._watched(link_total)
            check_in = 1

        # a receive whose data and dependencies are there completes at once (DONE) unless it reduces
        # (LAND: queue on the rank's compute engine)
        landing_action = [DONE if k == _RECV or b == 0 else LAND for k, b in zip(kind, size)]
        work = deque()
        for g in range(n):
            if waiting[g] == 0:
                if kind[g] == _SEND:
                    work.append(4 * g + READY)
                else:
                    deps_ready[g] = True
        push_work, pop_work = work.append, work.popleft
        heappush, heappop = heapq.heappush, heapq.heappop
        traced = [fabric.index.get(tuple(e)) for e in self.trace]
        samples = [] if traced else None     # (time, load of every traced link from then on)

        while True:
            if bundle_watch is not None:
                check_in -= 1
                if not check_in:
                    check_in = CEILING_EVERY
                    at_least = now + max((u / c for u, c in zip(unstarted, watched_cap)), default=0.0)
                    if at_least > ceiling() * (1.0 + OUTPACED_BY):
                        raise Outpaced(at_least)
            # ---- everything that happens at `now` ----
            while work:
                x = pop_work()
                g = x >> 2
                action = x & 3
                if action == DONE:
                    completed += 1
                    finished[g] = True
                    for d in dependents[g]:
                        w = waiting[d] - 1
                        waiting[d] = w
                        if not w:
                            if kind[d] == _SEND:
                                push_work(4 * d + READY)
                            else:
                                deps_ready[d] = True
                                if arrived[d]:
                                    push_work(4 * d + landing_action[d])
                    continue
                if action == READY:    # a send
                    if size[g] > 0 and cost:
                        posting.append(g)
                    elif size[g] > 0:
                        pair = send_pair[g]
                        heappush(pair_wait[pair], g)
                        pair_dirty.add(pair)
                    else:              # executors skip empty chunks: nothing is sent
                        push_work(4 * g + DONE)
                        h = partner[g]
                        arrived[h] = True
                        if deps_ready[h]:
                            push_work(4 * h + landing_action[h])
                    continue
                # LAND: a reduction with its data and dependencies queues on its rank's engine
                r = rank[g]
                heappush(engine_queue[r], (now, g))
                if not engine_busy[r]:
                    engine_idle.add(r)

            # ---- with a message cost, ranks post the sends that became ready, one at a time ----
            if posting:
                posting.sort()
                for g in posting:
                    r = rank[g]
                    t = (now if posted_at[r] < now else posted_at[r]) + cost
                    posted_at[r] = t
                    heappush(heap, (t, 2 * g + POSTED))
                posting.clear()

            # ---- free engines start the reduction that has waited longest (ties: program order) ----
            for r in engine_idle:
                q = engine_queue[r]
                if q and not engine_busy[r]:
                    _t, g = heappop(q)
                    engine_busy[r] = True
                    heappush(heap, (now + size[g] / reduce_bw[r], 2 * g + ENGINE))
            engine_idle.clear()

            # ---- pairs that are free start their earliest waiting send ----
            for pair in pair_dirty:
                if not pair_busy[pair] and pair_wait[pair]:
                    pair_busy[pair] = True
                    g = heappop(pair_wait[pair])
                    nbytes = size[g]
                    bundles, shares, _lat = pair_route[pair]
                    paths_left[g] = len(bundles)
                    for b, share in zip(bundles, shares):
                        if bundle_watch is not None:
                            for i in bundle_watch[b]:
                                unstarted[i] -= share * nbytes
                        m = b_m[b]
                        if m:
                            rate = b_rate[b]
                            v = b_v[b] = b_v[b] + rate * (now - b_t[b])
                            for l in bundle_links[b]:
                                link_load[l] += rate
                        else:
                            v = b_v[b] = 0.0
                            for l in bundle_links[b]:
                                link_bundles[l].add(b)
                            if b in emptied:   # drained just now: the same flows as before, same rates
                                emptied.discard(b)
                                rate = b_rate[b]
                                for l in bundle_links[b]:
                                    link_load[l] += rate
                                carried_on.append(b)
                        b_t[b] = now
                        b_m[b] = m + 1
                        q = b_flows[b]
                        item = (v + share * nbytes, g)
                        if not q or q[-1] <= item:
                            q.append(item)
                        else:          # a shorter flow overtakes longer ones (rare)
                            q.insert(bisect.bisect(q, item), item)
                        changed.add(b)
            pair_dirty.clear()
            makespan = now
            if emptied:                # bundles that drained and did not carry on lose their rates
                for b in emptied:
                    b_rate[b] = 0.0
                    held[bottleneck[b]].discard(b)
                    bottleneck[b] = -1
                emptied.clear()
            if carried_on:             # a bundle that drained and took its next flow at once: the set of
                for b in carried_on:   # active bundles, hence every rate, is what it was
                    if b_m[b] == 1:
                        changed.discard(b)
                        repush.add(b)
                carried_on = []

            # ---- load changed: repair the max-min fair rates around the changes ----
            if changed:
                events += 1
                region = set()
                for b in changed:
                    m = b_m[b]
                    if not m:          # gone: whoever was held back on its links may speed up
                        for l in bundle_links[b]:
                            region.update(held[l])
                        continue
                    l = bottleneck[b]
                    if not (l >= 0 and len(link_bundles[l]) == 1 and _private_change(b, cap[l] / m, st)):
                        # Unless held back by a link it has to itself (its flows share that link's
                        # capacity among more or fewer flows, nothing else changes), only a bundle
                        # alone on every link of its path escapes the repair: its narrowest link holds it.
                        l = -1
                        for x in bundle_links[b]:
                            if len(link_bundles[x]) != 1:
                                l = -1
                                break
                            if l < 0 or cap[x] < cap[l]:
                                l = x
                        if l < 0:
                            region.add(b)
                            continue
                        st.hold(b, l)
                    st.set_rate(b, cap[l] / m, now)
                repush |= changed
                changed = set()
                if region:
                    repush |= _repair(region, st, now)
            if repush:
                for b in repush:
                    if b_m[b]:
                        v = b_ver[b] = b_ver[b] + 1
                        heappush(bheap, (b_t[b] + (b_flows[b][0][0] - b_v[b]) / b_rate[b], b, v))
                repush = set()

            if samples is not None:
                samples.append((now, [0.0 if i is None else link_load[i] for i in traced]))

            # ---- next event: drains and timed events within RTOL of the earliest ----
            while bheap and bheap[0][2] != b_ver[bheap[0][1]]:
                heappop(bheap)
            t_next = bheap[0][0] if bheap else math.inf
            if heap and heap[0][0] < t_next:
                t_next = heap[0][0]
            if t_next == math.inf:
                break
            limit = t_next + max(RTOL * t_next, ATOL)
            t_hi = t_next
            drained = []
            while bheap and bheap[0][0] <= limit:
                _t, b, v = heappop(bheap)
                if v != b_ver[b]:
                    continue
                b_ver[b] = v + 1       # this entry is used up
                rate, v0, t0 = b_rate[b], b_v[b], b_t[b]
                kmax = v0 + rate * (limit - t0)
                h = b_flows[b]
                key, g = h.popleft()   # its first flow drains for sure
                drained.append(g)
                while h and h[0][0] <= kmax:
                    key, g = h.popleft()
                    drained.append(g)
                t = t0 + (key - v0) / rate
                if t > t_hi:
                    t_hi = t
                left = len(h)
                delta = (left - b_m[b]) * rate
                b_m[b] = left
                changed.add(b)
                if left:
                    for l in bundle_links[b]:
                        link_load[l] += delta
                else:
                    for l in bundle_links[b]:
                        on = link_bundles[l]
                        on.discard(b)
                        link_load[l] = link_load[l] + delta if on else 0.0
                    emptied.add(b)
            fired = []
            while heap and heap[0][0] <= limit:
                t, x = heappop(heap)
                fired.append(x)
                if t > t_hi:
                    t_hi = t
            now = t_hi
            if drained:
                landing = {}           # latency -> transfers drained now that arrive after it
                for g in drained:
                    left = paths_left[g] - 1
                    paths_left[g] = left
                    if left:
                        continue
                    pair = send_pair[g]
                    pair_busy[pair] = False
                    pair_dirty.add(pair)
                    latency = pair_route[pair][2]
                    if latency > 0:
                        batch = landing.get(latency)
                        if batch is None:
                            landing[latency] = [g]
                        else:
                            batch.append(g)
                    else:
                        push_work(4 * g + DONE)
                        h = partner[g]
                        arrived[h] = True
                        if deps_ready[h]:
                            push_work(4 * h + landing_action[h])
                for latency, batch in landing.items():
                    arrivals.append(batch)
                    heappush(heap, (now + latency, -len(arrivals)))
            for x in fired:
                if x < 0:              # a batch of transfers arrives
                    batch = arrivals[-x - 1]
                    arrivals[-x - 1] = None
                    for g in batch:
                        push_work(4 * g + DONE)
                        h = partner[g]
                        arrived[h] = True
                        if deps_ready[h]:
                            push_work(4 * h + landing_action[h])
                    continue
                g = x >> 1
                if x & 1 == POSTED:    # send g is posted: it leaves once its pair is free
                    pair = send_pair[g]
                    heappush(pair_wait[pair], g)
                    pair_dirty.add(pair)
                    continue
                # reduction g finished: its rank's engine takes the next one
                push_work(4 * g + DONE)
                r = rank[g]
                engine_busy[r] = False
                engine_idle.add(r)

        if completed < n:
            starts = [0] * nranks
            for g in range(n - 1, -1, -1):
                starts[rank[g]] = g
            stuck = [f"rank {rank[g]} op {g - starts[rank[g]]} ({_NAMES[kind[g]]} "
                     f"{'to' if kind[g] == _SEND else 'from'} rank {rank[partner[g]]})"
                     for g in range(n) if not finished[g]][:4]
            raise ScheduleError(f"deadlock: {n - completed} operations never complete; first stuck: "
                                + "; ".join(stuck))
        return self._result(makespan, link_total, ntransfers, events, _timeline(self.trace, samples, makespan))

    def _result(self, seconds, total, ntransfers, events, timeline=None):
        fabric = self.fabric
        link_bytes, util = {}, {}
        for i, key in enumerate(fabric.keys):
            if total[i] > 0:
                link_bytes[key] = float(total[i])
                util[key] = float(total[i] / (fabric.caps[i] * seconds)) if seconds > 0 else 0.0
        busiest = sorted(((k, util[k], link_bytes[k]) for k in link_bytes),
                         key=lambda x: (-x[1], -x[2], str(x[0])))[:5]
        return Simulation(float(seconds), link_bytes, util, busiest, ntransfers, events, timeline or {})


def _timeline(links, samples, end):
    """``{link: ((start, end, load), ...)}`` from the loads sampled after every rate update: each holds
    until the next sample (the last until ``end``); idle stretches and repeats are merged away."""
    samples = samples or []
    until = [t for t, _ in samples[1:]] + [end]
    out = {}
    for j, link in enumerate(links):
        spans = []
        for (t, loads), t1 in zip(samples, until):
            load = loads[j]
            if t1 <= t or load <= 0:
                continue
            if spans and spans[-1][1] == t and spans[-1][2] == load:
                spans[-1] = (spans[-1][0], t1, load)
            else:
                spans.append((t, t1, load))
        out[tuple(link)] = tuple(spans)
    return out


def _link_totals(fabric, pair_route, pair_bytes):
    """Bytes every link of ``fabric`` carries in the whole run (numpy array by link index)."""
    total = np.zeros(len(fabric.keys))
    for (bundles, shares, _), nbytes in zip(pair_route, pair_bytes):
        if nbytes > 0:
            for b, share in zip(bundles, shares):
                total[list(fabric.bundle_links[b])] += share * nbytes
    return total
