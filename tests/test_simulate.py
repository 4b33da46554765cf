"""Tests of the flow-level simulator (ddl.simulate): closed forms, fairness, costs, never optimistic."""
import heapq
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddl.simulate as simulate_module
from ddl.errors import ScheduleError
from ddl.schedule import Schedule, ScheduleBuilder
from ddl.simulate import Outpaced, Simulation, load_seconds, max_min_rates, simulate
from ddl.topology import Topology
from ddl.verify import verify

GB = 1e9
US = 1e-6
HUGE = 1e18                    # a reduce bandwidth that makes reductions free


# ------------------------------------------------------------------------------------------- helpers
def star(p, bandwidth=10 * GB, latency=1 * US, reduce_bandwidth=HUGE, uplinks=None, message_cost=None):
    """p GPU ranks, each with its own full-duplex link to one switch."""
    nodes = [("sw", "switch")] + [{"id": f"g{i}", "kind": "gpu", "reduce_bandwidth": reduce_bandwidth}
                                  for i in range(p)]
    bws = uplinks or [bandwidth] * p
    links = [{"a": f"g{i}", "b": "sw", "bandwidth": bws[i], "latency": latency} for i in range(p)]
    defaults = None if message_cost is None else {"message_cost": message_cost}
    return Topology("star", nodes, links, [f"g{i}" for i in range(p)], defaults)


def ring_allreduce(p):
    """Plain ring allreduce: p chunks, reduce-scatter then allgather around 0 -> 1 -> ... -> p-1 -> 0."""
    b = ScheduleBuilder("allreduce", p, (1,) * p, algorithm="ring")
    for s in range(p - 1):
        for i in range(p):
            b.transfer(i, (i + 1) % p, (i - s) % p, reduce=True)
    for s in range(p - 1):
        for i in range(p):
            b.transfer(i, (i + 1) % p, (i + 1 - s) % p)
    return b.build()


def ring_allgather(p):
    b = ScheduleBuilder("allgather", p, (1,), algorithm="ring")
    for s in range(p - 1):
        for i in range(p):
            b.transfer(i, (i + 1) % p, (i - s) % p)
    return b.build()


def ring_reduce_scatter(p):
    b = ScheduleBuilder("reduce_scatter", p, (1,), algorithm="ring")
    for s in range(p - 1):
        for i in range(p):
            b.transfer(i, (i + 1) % p, (i - s - 1) % p, reduce=True)
    return b.build()


def halving_doubling(p):
    """Recursive halving reduce-scatter + recursive doubling allgather (p a power of two), p chunks."""
    b = ScheduleBuilder("allreduce", p, (1,) * p, algorithm="halving-doubling")
    lo, hi = [0] * p, [p] * p
    masks = [1 << k for k in reversed(range(p.bit_length() - 1))]
    steps = []                                  # per step, per rank: (partner, kept range, given range)
    for m in masks:
        steps.append([])
        for r in range(p):
            q, mid = r ^ m, (lo[r] + hi[r]) // 2
            keep, give = ((lo[r], mid), (mid, hi[r])) if r < q else ((mid, hi[r]), (lo[r], mid))
            steps[-1].append((q, keep, give))
        lo, hi = [s[1][0] for s in steps[-1]], [s[1][1] for s in steps[-1]]
    for i, step in enumerate(steps):
        for r, (q, _keep, give) in enumerate(step):
            # what the partner passes on soonest goes last (messages to one peer leave in order)
            def passed_on(c):
                return next((k for k in range(i + 1, len(steps)) if c in range(*steps[k][q][2])), len(steps))
            for c in sorted(range(*give), key=passed_on, reverse=True):
                b.transfer(r, q, c, reduce=True)
    for m in reversed(masks):
        new = []
        for r in range(p):
            q = r ^ m
            for c in range(lo[r], hi[r]):
                b.transfer(r, q, c)
            new.append((min(lo[r], lo[q]), max(hi[r], hi[q])))
        lo, hi = [k[0] for k in new], [k[1] for k in new]
    return b.build()


def one_transfer_each(p, transfers, pattern, reduce=False):
    """A schedule of independent transfers (src, dst, chunk); only for timing, not a real collective."""
    b = ScheduleBuilder("allreduce", p, pattern)
    for src, dst, chunk in transfers:
        b.transfer(src, dst, chunk, reduce=reduce)
    return b.build()


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b))


try:
    from ddl.bounds import lower_bound
except ImportError:        # pragma: no cover - bounds are written in parallel
    lower_bound = None

try:
    from ddl.algorithms import ALGORITHMS
except ImportError:        # pragma: no cover - algorithms are written in parallel
    ALGORITHMS = None


# ------------------------------------------------------------------------------- reference simulator
def reference(topo, sched, nbytes):
    """A slow, obviously-faithful replay of the model: global max-min rates recomputed at every event.

    Ops are rescanned until nothing changes; every flow is a separate row of the rate computation;
    no bundles, no incremental repair. Only for small cases. Messages of one rank pair go one at a
    time: once nothing else can happen, every idle pair starts its ready send earliest in the program.
    With a message cost, a rank posts its ready sends in program order, one cost apart, and a send
    may start once posted.
    """
    cost = topo.message_cost
    posted, last_post = {}, [0.0] * sched.nranks
    progs, deps, matches = sched.programs, sched.dependencies, sched.matches
    ops = [(r, i) for r in range(sched.nranks) for i in range(len(progs[r]))]
    size = {op: sched.chunk_fraction(progs[op[0]][op[1]].chunk) * nbytes for op in ops}
    done, arrival, started, pending, busy = {}, {}, set(), {}, set()
    flows, events = [], []
    engine_busy, engine_q = [False] * sched.nranks, [[] for _ in range(sched.nranks)]
    index, cap = {}, []

    def link(u, v):
        if (u, v) not in index:
            index[(u, v)] = len(cap)
            cap.append(topo.capacity(u, v))
        return index[(u, v)]

    def paths(s, d):
        if (s, d) in sched.routes:
            ps = [(p, w) for p, w in sched.routes[(s, d)] if w > 0]
        else:
            ps = [(p, 1.0) for p in topo.routes(s, d)]
        total = sum(w for _, w in ps)
        lat = max(sum(topo.latency(u, v) for u, v in zip(p, p[1:])) for p, _ in ps)
        return [([link(u, v) for u, v in zip(p, p[1:])], w / total) for p, w in ps], lat

    now = 0.0
    while True:
        progress = True
        while progress:
            progress = False
            for op in ops:
                r, i = op
                if op in done or op in started or not all((r, j) in done for j in deps[r][i]):
                    continue
                kind = progs[r][i].kind
                if kind == "send":
                    if size[op] == 0:
                        started.add(op)
                        progress = True
                        arrival[tuple(matches[r][i])] = done[op] = now
                elif op in arrival:
                    started.add(op)
                    progress = True
                    if kind == "recv" or size[op] == 0:
                        done[op] = now
                    else:
                        engine_q[r].append(op)
            for r in range(sched.nranks):
                if not engine_busy[r] and engine_q[r]:
                    op = engine_q[r].pop(0)
                    engine_busy[r] = True
                    heapq.heappush(events, (now + size[op] / topo.reduce_bandwidth(r), "engine", op))
                    progress = True
        for op in ops:
            r, i = op
            if (cost and progs[r][i].kind == "send" and op not in started and op not in posted
                    and all((r, j) in done for j in deps[r][i])):
                posted[op] = last_post[r] = max(now, last_post[r]) + cost
                heapq.heappush(events, (posted[op], "post", op))
        for op in ops:
            r, i = op
            peer = tuple(matches[r][i])
            if (progs[r][i].kind == "send" and op not in started and (r, peer[0]) not in busy
                    and all((r, j) in done for j in deps[r][i])
                    and (not cost or posted[op] <= now * (1 + 1e-12))):
                started.add(op)
                busy.add((r, peer[0]))
                ps, lat = paths(r, peer[0])
                pending[op] = [len(ps), lat]
                flows.extend({"links": ls, "rem": w * size[op], "send": op} for ls, w in ps)
        if not flows and not events:
            break
        if flows:
            mat = np.full((len(flows), max(len(f["links"]) for f in flows)), -1)
            for k, f in enumerate(flows):
                mat[k, :len(f["links"])] = f["links"]
            rates = max_min_rates(mat, np.array(cap))
        else:
            rates = []
        t = min([now + f["rem"] / x for f, x in zip(flows, rates)] + [events[0][0] if events else math.inf])
        for f, x in zip(flows, rates):
            f["rem"] -= x * (t - now)
        now = t
        keep = []
        for f, x in zip(flows, rates):
            if f["rem"] <= 1e-9 * x * now:
                p = pending[f["send"]]
                p[0] -= 1
                if p[0] == 0:
                    busy.discard((f["send"][0], matches[f["send"][0]][f["send"][1]][0]))
                    heapq.heappush(events, (now + p[1], "arrive", f["send"]))
            else:
                keep.append(f)
        flows = keep
        while events and events[0][0] <= now * (1 + 1e-12):
            _, what, op = heapq.heappop(events)
            if what == "post":
                continue
            done[op] = now
            if what == "arrive":
                arrival[tuple(matches[op[0]][op[1]])] = now
            else:
                engine_busy[op[0]] = False
    assert len(done) == len(ops), "reference deadlocked"
    return max(done.values(), default=0.0)


# ------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("p", [2, 3, 8, 12])
def test_ring_allreduce_closed_form(p):
    B, lat, N = 10 * GB, 1 * US, 48e6
    topo, sched = star(p, B, lat), ring_allreduce(p)
    verify(sched)
    sim = simulate(topo, sched, N)
    alpha = 2 * lat
    expected = 2 * (p - 1) / p * N / B + 2 * (p - 1) * alpha
    assert abs(sim.seconds - expected) <= 0.01 * expected
    assert close(sim.seconds, expected, 1e-7)            # in fact exact (but for 1e18 B/s reductions)
    assert sim.transfers == 2 * p * (p - 1)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_halving_doubling_closed_form(p):
    """With one chunk per rank the closed form is exact up to p = 4. From p = 8 a halving step hands
    on chunks that reached it one after the other (messages to one peer leave in order), so its first
    message starts while the step before is still sending and shares the links with it: 19% slower
    at p = 8 and 16. Cutting every segment into four chunks (as the library pipelines) recovers it,
    and more: each step sends the first pieces of all its segments first (one span each), so the next
    step starts on them while the rest arrive, and the steps' latencies overlap in part."""
    B, lat, N = 10 * GB, 5 * US, 16e6
    expected = 2 * math.log2(p) * 2 * lat + 2 * (p - 1) / p * N / B
    topo, sched = star(p, B, lat), halving_doubling(p)
    verify(sched)
    sim = simulate(topo, sched, N)
    if p <= 4:
        assert close(sim.seconds, expected, 1e-7)
    else:
        assert 1.1 * expected < sim.seconds < 1.25 * expected
    if ALGORITHMS is not None:
        from ddl.algorithms.halving_doubling import halving_doubling_schedule
        sched = halving_doubling_schedule(range(p), "allreduce", k=4)
        verify(sched)
        assert 2 * (p - 1) / p * N / B < simulate(topo, sched, N).seconds <= 1.03 * expected


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
@pytest.mark.parametrize("name", ["ring", "halving-doubling"])
def test_library_algorithms_on_star_match_closed_form(name):
    p, B, lat, N = 8, 10 * GB, 1 * US, 256e6
    topo = star(p, B, lat)
    sched = ALGORITHMS[name](topo, "allreduce", nbytes=N)
    sim = simulate(topo, sched, N)
    # bandwidth-dominated size: both algorithms send 2 (p-1)/p N through every rank's link
    bandwidth_term = 2 * (p - 1) / p * N / B
    assert bandwidth_term <= sim.seconds <= 1.01 * bandwidth_term + 4 * p * 2 * lat


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
@pytest.mark.parametrize("name", ["ring", "halving-doubling", "hierarchical"])
def test_load_seconds_is_the_busiest_links_bytes_over_its_capacity(name):
    # what a simulation finds every link carried, without simulating: a bound on the makespan
    topo = Topology.load(Path(__file__).resolve().parent.parent / "topologies" / "leaf-spine-2rack.yaml")
    N = 64e6
    sched = ALGORITHMS[name](topo, "allreduce", nbytes=N)
    sim = simulate(topo, sched, N)
    busiest = max(b / topo.capacity(*link) for link, b in sim.link_bytes.items())
    assert load_seconds(topo, sched, N) == pytest.approx(busiest, rel=1e-12)
    assert busiest <= sim.seconds
    assert load_seconds(topo, sched, 2 * N) == pytest.approx(2 * busiest, rel=1e-12)
    assert load_seconds(star(4), Schedule("allreduce", 4, (1,), ((),) * 4), N) == 0.0


def test_rank_one_and_empty_schedules_take_no_time():
    topo1 = Topology("one", [("g0", "gpu")], [], ["g0"])
    empty1 = Schedule("allreduce", 1, (1,), ((),))
    assert simulate(topo1, empty1, 1e9).seconds == 0.0
    topo = star(4)
    empty = Schedule("allreduce", 4, (1,), ((),) * 4)
    sim = simulate(topo, empty, 1e9)
    assert sim.seconds == 0.0 and sim.link_bytes == {} and sim.busiest == [] and sim.transfers == 0


def test_zero_bytes_cost_nothing():
    sim = simulate(star(4), ring_allreduce(4), 0)
    assert sim.seconds == 0.0 and sim.link_bytes == {} and sim.transfers == 24


# ---------------------------------------------------------------------------------- message cost
def test_a_message_cost_adds_once_per_step_of_a_ring():
    p, B, lat, N, C = 4, 10 * GB, 1 * US, 48e6, 20 * US
    sim = simulate(star(p, B, lat, message_cost=C), ring_allreduce(p), N)
    assert close(sim.seconds, 2 * (p - 1) * (C + N / p / B + 2 * lat), 1e-7)
    assert simulate(star(p, B, lat, message_cost=C), ring_allreduce(p), 0).seconds == 0.0   # nothing sent


def test_a_rank_posts_its_messages_one_at_a_time():
    B, lat, C = 10 * GB, 1 * US, 50 * US
    # four small messages from g0 to g1 (each 1 us on the wire): posting binds, 4 C
    small, N = 4, 4e4
    sched = one_transfer_each(2, [(0, 1, c) for c in range(small)], (1,) * small)
    assert close(simulate(star(2, B, lat, message_cost=C), sched, N).seconds, small * C + N / small / B + 2 * lat)
    # large ones (1 ms each): posting overlaps the wire, the cost is paid once
    N = 4e7
    assert close(simulate(star(2, B, lat, message_cost=C), sched, N).seconds, C + N / B + 2 * lat)
    # one rank to two peers pays twice; two ranks to one peer pay once each, side by side
    N = 2e4
    fan_out = one_transfer_each(3, [(0, 1, 0), (0, 2, 1)], (1, 1))
    assert close(simulate(star(3, B, lat, message_cost=C), fan_out, N).seconds, 2 * C + N / 2 / B + 2 * lat)
    fan_in = one_transfer_each(3, [(0, 2, 0), (1, 2, 1)], (1, 1))
    assert close(simulate(star(3, B, lat, message_cost=C), fan_in, N).seconds, C + N / B + 2 * lat)
    # no cost given: none charged
    assert close(simulate(star(3, B, lat), fan_out, N).seconds, N / B + 2 * lat)


# -------------------------------------------------------------------------------------- fairness
def test_two_flows_sharing_a_link_get_half_each():
    B, lat, N = 8 * GB, 1 * US, 8e6
    sched = one_transfer_each(3, [(0, 2, 0), (1, 2, 1)], (1, 1))     # both into g2's downlink
    sim = simulate(star(3, B, lat), sched, N)
    assert close(sim.seconds, (N / 2) / (B / 2) + 2 * lat)


def test_flow_bottlenecked_elsewhere_leaves_the_rest_to_the_other():
    B, lat, N = 8 * GB, 1 * US, 8e6
    # g0's own uplink is B/4: its flow gets B/4 and g1's flow the remaining 3B/4 of g2's downlink,
    # so N/4 and 3N/4 both take N/B. An equal split would make g1's flow take 1.5 N/B.
    topo = star(3, uplinks=[B / 4, B, B], latency=lat)
    sched = one_transfer_each(3, [(0, 2, 0), (1, 2, 1)], (1, 3))
    sim = simulate(topo, sched, N)
    assert close(sim.seconds, N / B + 2 * lat)
    assert close(sim.link_utilisation[("sw", "g2")], (N / B) / sim.seconds)


def test_back_to_back_messages_of_a_pair_carry_on_without_a_rate_update():
    # g0 sends four N/8 chunks to g2 one after the other while g1 sends N/2: g2's downlink gives each
    # pair B/2 throughout, so both end at N/B. The three hand-overs between g0's messages leave the
    # set of active flows as it was, so they cost no rate update: one at the start, one at the end.
    B, lat, N = 8 * GB, 1 * US, 8e6
    sched = one_transfer_each(3, [(0, 2, 0), (0, 2, 1), (0, 2, 2), (0, 2, 3), (1, 2, 4)], (1, 1, 1, 1, 4))
    sim = simulate(star(3, B, lat), sched, N)
    assert close(sim.seconds, N / B + 2 * lat)
    assert sim.events == 2
    # with a gap between the messages (each waits for the one before to arrive) the rates do change
    b = ScheduleBuilder("allreduce", 3, (1, 1, 4))
    b.transfer(0, 2, 0)
    b.transfer(2, 0, 0)
    b.transfer(0, 2, 1)
    b.transfer(1, 2, 2)
    assert simulate(star(3, B, lat), b.build(), N).events > 2


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
def test_a_ceiling_stops_a_schedule_that_cannot_beat_it_and_no_other():
    # On the 8:1 fat tree a flat ring sends twice what hierarchical sends over each uplink; with
    # hierarchical's time as the ceiling the ring stops, with a lower bound that is above the
    # ceiling and below its full simulation.
    topo = Topology.load("topologies/fat-tree-4x4-r8.yaml")
    N = 64e6
    fast = simulate(topo, ALGORITHMS["hierarchical"](topo, "allreduce", nbytes=N), N)
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=N)
    slow = simulate(topo, ring, N)
    assert slow.seconds > 1.1 * fast.seconds
    with pytest.raises(Outpaced) as stopped:
        simulate(topo, ring, N, ceiling=lambda: fast.seconds)
    assert fast.seconds < stopped.value.at_least <= slow.seconds * (1 + 1e-9)
    # a ceiling the schedule meets exactly (a tie) or beats does not stop it, and changes nothing
    for ceiling in (slow.seconds, 2 * slow.seconds, math.inf):
        again = simulate(topo, ring, N, ceiling=lambda: ceiling)
        assert again.seconds == slow.seconds and again.link_bytes == slow.link_bytes


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
def test_a_ceiling_that_falls_during_the_run_stops_it_later():
    # the bound is checked again as the run goes: a ceiling that only falls after the start still
    # stops the run, with a bound no smaller than the simulated time at that check
    topo = Topology.load("topologies/fat-tree-4x4-r8.yaml")
    N = 64e6
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=N)
    full = simulate(topo, ring, N)
    calls = []

    def ceiling():
        calls.append(1)
        return math.inf if len(calls) < 20 else full.seconds / 2

    with pytest.raises(Outpaced) as stopped:    # (a schedule not yet simulated: ``ring``'s run is remembered)
        simulate(topo, ALGORITHMS["ring"](topo, "allreduce", nbytes=N), N, ceiling=ceiling)
    assert len(calls) == 20
    assert full.seconds / 2 < stopped.value.at_least <= full.seconds * (1 + 1e-9)


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
def test_a_stopped_run_leaves_its_bound_and_a_lower_ceiling_stops_at_once(monkeypatch):
    # what stopped a run is remembered on the schedule: a later call whose ceiling is below that bound
    # stops without simulating; without a ceiling it runs the schedule out, to no less than the bound
    topo = Topology.load("topologies/fat-tree-4x4-r8.yaml")
    N = 64e6
    fast = simulate(topo, ALGORITHMS["hierarchical"](topo, "allreduce", nbytes=N), N).seconds
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=N)
    with pytest.raises(Outpaced) as first:
        simulate(topo, ring, N, ceiling=lambda: fast)
    with monkeypatch.context() as m:
        m.setattr(simulate_module._Run, "run", lambda self: pytest.fail("simulated again"))
        for ceiling in (fast, fast / 2):
            with pytest.raises(Outpaced) as again:
                simulate(topo, ring, N, ceiling=lambda: ceiling)
            assert again.value.at_least == first.value.at_least
    full = simulate(topo, ring, N, ceiling=lambda: math.inf)
    assert full.seconds >= first.value.at_least and simulate(topo, ring, N) is full


@pytest.mark.skipif(ALGORITHMS is None, reason="ddl.algorithms not available")
def test_a_run_to_its_end_is_remembered_per_topology_and_size():
    # an algorithm that simulated its variants returns one the planner simulates again: the run is
    # given again, for the same topology (by fingerprint) and size only, and a ceiling still stops it
    topo = Topology.load("topologies/fat-tree-4x4-r8.yaml")
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=64e6)
    first = simulate(topo, ring, 64e6)
    assert simulate(topo, ring, 64e6) is first
    assert simulate(Topology.load("topologies/fat-tree-4x4-r8.yaml"), ring, 64e6) is first
    assert simulate(topo, ring, 64e6, ceiling=lambda: first.seconds) is first      # a tie
    with pytest.raises(Outpaced) as stopped:
        simulate(topo, ring, 64e6, ceiling=lambda: first.seconds / 2)
    assert stopped.value.at_least == first.seconds
    other = simulate(topo, ring, 32e6)
    assert other is not first and other.seconds < first.seconds
    slower = Topology.load("topologies/fat-tree-4x4-r16.yaml")
    assert simulate(slower, ring, 64e6).seconds > first.seconds
    traced = simulate(topo, ring, 64e6, trace=[first.busiest[0][0]])
    assert traced is not first and traced.seconds == first.seconds and traced.timeline


def test_max_min_rates_progressive_filling():
    # link 0 (cap 1): flows 0, 1; link 1 (cap 2): flows 1, 2
    mat = np.array([[0, -1], [0, 1], [1, -1]])
    cap = np.array([1.0, 2.0])
    assert np.allclose(max_min_rates(mat, cap), [0.5, 0.5, 1.5])
    # row 0 stands for 3 flows: link 0 gives 0.25 to each of 4 flows, flow 2 takes the rest of link 1
    rates, necks = max_min_rates(mat, cap, [3, 1, 1], bottlenecks=True)
    assert np.allclose(rates, [0.25, 0.25, 1.75])
    assert list(necks) == [0, 0, 1]
    assert np.all(np.bincount(mat[mat >= 0], weights=(np.array([3, 1, 1])[:, None] * rates[:, None]
                                                     * (mat >= 0))[mat >= 0]) <= cap * (1 + 1e-12))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_filling_a_large_region_gives_the_max_min_fair_rates(data):
    """The simulator's filling of a region (a heap whose entries stay until popped), on regions of
    up to 300 bundles over shared links, against :func:`max_min_rates`, with part of every link's
    capacity held by bundles outside the region and the region's own old usage still in the load."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    nlinks = int(rng.integers(2, 60))
    nbundles = int(rng.integers(2, 300))
    cap = rng.uniform(1.0, 100.0, nlinks)
    bundle_links = [tuple(int(l) for l in rng.choice(nlinks, size=int(rng.integers(1, min(nlinks, 6) + 1)),
                                                      replace=False)) for _ in range(nbundles)]
    weight = [int(w) for w in rng.integers(1, 5, nbundles)]
    old_rate = rng.uniform(0.0, 10.0, nbundles).tolist()
    outside = cap * rng.uniform(0.0, 0.9, nlinks) * rng.integers(0, 2, nlinks)   # held by others

    def usage(rates):
        """Every link's load: the part held outside the region, and the region's at these rates."""
        used = outside.copy()
        for b, links in enumerate(bundle_links):
            for l in links:
                used[l] += weight[b] * rates[b]
        return used

    state = type("State", (), dict(links=bundle_links, m=weight, rate=old_rate, load=usage(old_rate).tolist(),
                                   cap=cap.tolist()))()
    rates, neck, members = simulate_module._fill_region(set(range(nbundles)), state)

    table = np.full((nbundles, max(map(len, bundle_links))), -1)
    for b, links in enumerate(bundle_links):
        table[b, :len(links)] = links
    expected = max_min_rates(table, cap - outside, weight)
    got = np.array([rates[b] for b in range(nbundles)])
    assert np.allclose(got, expected, rtol=1e-9, atol=0.0)
    assert {l: sorted(m) for l, m in members.items()} == {
        l: sorted(b for b in range(nbundles) if l in bundle_links[b]) for l in set(table[table >= 0].tolist())}
    used = usage(got)
    for b in range(nbundles):
        l = neck[b]
        assert l in bundle_links[b]
        assert used[l] >= cap[l] * (1 - 1e-9)          # its bottleneck is full ...
        assert all(got[x] <= got[b] * (1 + 1e-9) for x in members[l])   # ... and no flow on it is faster


# ------------------------------------------------------------------------------- costs that add up
def test_reductions_run_one_at_a_time_on_a_rank():
    B, lat, N, R = 1000 * GB, 1 * US, 30e6, 5 * GB
    nodes = [("sw", "switch")] + [{"id": f"g{i}", "kind": "gpu", "reduce_bandwidth": R} for i in range(4)]
    links = [{"a": f"g{i}", "b": "sw", "bandwidth": B, "latency": lat} for i in range(4)]
    topo = Topology("star", nodes, links, [f"g{i}" for i in range(4)])
    # three chunks of N/3 arrive at g0 together (sharing its downlink), then three reductions of N/3
    transfers = [(1, 0, 0), (2, 0, 1), (3, 0, 2)]
    sim = simulate(topo, one_transfer_each(4, transfers, (1, 1, 1), reduce=True), N)
    assert close(sim.seconds, N / B + 2 * lat + N / R)
    # a plain receive costs no compute
    assert close(simulate(topo, one_transfer_each(4, transfers, (1, 1, 1)), N).seconds, N / B + 2 * lat)


def test_latency_adds_per_hop_and_per_dependent_transfer():
    B, N = 4 * GB, 4e6
    nodes = [("a", "gpu"), ("s1", "switch"), ("s2", "switch"), ("b", "gpu")]
    links = [{"a": "a", "b": "s1", "bandwidth": B, "latency": 1 * US},
             {"a": "s1", "b": "s2", "bandwidth": B, "latency": 2 * US},
             {"a": "s2", "b": "b", "bandwidth": B, "latency": 3 * US}]
    topo = Topology("line", nodes, links, ["a", "b"])
    one = one_transfer_each(2, [(0, 1, 0)], (1,))
    assert close(simulate(topo, one, N).seconds, N / B + 6 * US)
    # there and back: the return waits for the reduction, which waits for the arrival
    b = ScheduleBuilder("allreduce", 2, (1,))
    b.transfer(0, 1, 0, reduce=True)
    b.transfer(1, 0, 0)
    sim = simulate(topo, b.build(), N)
    assert close(sim.seconds, 2 * (N / B + 6 * US) + N / topo.reduce_bandwidth(1))
    assert sim.link_bytes == {("a", "s1"): N, ("s1", "s2"): N, ("s2", "b"): N,
                              ("b", "s2"): N, ("s2", "s1"): N, ("s1", "a"): N}


def test_send_completes_only_when_its_data_has_arrived():
    # g0 sends chunk 0 to g1, then overwrites chunk 0 with a receive from g2: that receive may arrive
    # early (scratch), but completes only after g0's send has arrived at g1 (write after read)
    B, lat, N = 10 * GB, 1 * US, 10e6
    topo = star(3, B, lat, uplinks=[B / 10, B, B])
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.transfer(0, 1, 0)
    b.transfer(2, 0, 0)
    b.transfer(0, 1, 0)        # sends the new value: after the receive, hence after the first send
    sim = simulate(topo, b.build(), N)
    assert close(sim.seconds, 2 * (N / (B / 10) + 2 * lat))


# -------------------------------------------------------------------------------------- routes
def diamond(B=10 * GB, lat=1 * US):
    nodes = [("a", "gpu"), ("b", "gpu"), ("s1", "switch"), ("s2", "switch")]
    links = [{"a": x, "b": y, "bandwidth": B, "latency": lat}
             for x, y in (("a", "s1"), ("s1", "b"), ("a", "s2"), ("s2", "b"))]
    return Topology("diamond", nodes, links, ["a", "b"])


def test_split_over_two_disjoint_paths_halves_the_time():
    B, lat, N = 10 * GB, 1 * US, 10e6
    topo = diamond(B, lat)
    assert len(topo.routes(0, 1)) == 2          # ECMP: the default splits evenly already
    base = one_transfer_each(2, [(0, 1, 0)], (1,))
    only_s1 = ((("a", "s1", "b"), 1.0),)
    both = ((("a", "s1", "b"), 0.5), (("a", "s2", "b"), 0.5))
    pinned = {}
    for name, route in (("one", only_s1), ("two", both)):
        s = Schedule(base.collective, base.nranks, base.pattern, base.programs, routes={(0, 1): route})
        pinned[name] = simulate(topo, s, N)
    assert close(pinned["one"].seconds, N / B + 2 * lat)
    assert close(pinned["two"].seconds, N / (2 * B) + 2 * lat)
    assert close(simulate(topo, base, N).seconds, pinned["two"].seconds)
    assert pinned["one"].link_bytes == {("a", "s1"): N, ("s1", "b"): N}
    assert pinned["two"].link_bytes[("a", "s2")] == N / 2
    # unequal shares: the transfer lasts as long as its biggest share
    s = Schedule(base.collective, 2, base.pattern, base.programs,
                 routes={(0, 1): ((("a", "s1", "b"), 3.0), (("a", "s2", "b"), 1.0))})
    assert close(simulate(topo, s, N).seconds, 0.75 * N / B + 2 * lat)


def test_bad_inputs_raise():
    topo, base = diamond(), one_transfer_each(2, [(0, 1, 0)], (1,))
    bad = Schedule(base.collective, 2, base.pattern, base.programs, routes={(0, 1): ((("a", "b"), 1.0),)})
    with pytest.raises(ScheduleError, match="not a link"):
        simulate(topo, bad, 1e6)
    wrong_end = Schedule(base.collective, 2, base.pattern, base.programs,
                         routes={(0, 1): ((("a", "s1"), 1.0),)})
    with pytest.raises(ScheduleError, match="must run from"):
        simulate(topo, wrong_end, 1e6)
    huge = 1.5e308                     # each share finite, their sum not (the same path twice, or two paths)
    for route in (((("a", "s1", "b"), huge), (("a", "s1", "b"), huge)),
                  ((("a", "s1", "b"), huge), (("a", "s2", "b"), huge))):
        overflow = Schedule(base.collective, 2, base.pattern, base.programs, routes={(0, 1): route})
        with pytest.raises(ScheduleError, match="add up to more than a float holds"):
            simulate(topo, overflow, 1e6)
    with pytest.raises(ScheduleError, match="ranks"):
        simulate(star(3), base, 1e6)
    with pytest.raises(ScheduleError):
        simulate(topo, base, -1)
    # each rank receives chunk 0 before sending it: nobody can start
    b = ScheduleBuilder("allreduce", 2, (1,))
    b.programs[0] += [("recv", 0, 1), ("send", 0, 1)]
    b.programs[1] += [("recv", 0, 0), ("send", 0, 0)]
    from ddl.schedule import Op
    cyc = Schedule("allreduce", 2, (1,), tuple(tuple(Op(*op) for op in p) for p in b.programs))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(topo, cyc, 1e6)


# ------------------------------------------------------------------------------ accounting
def test_link_bytes_equal_bytes_sent_times_hops():
    p, N = 6, 6e6
    sim = simulate(star(p), ring_allreduce(p), N)
    per_rank = 2 * (p - 1) / p * N
    for i in range(p):
        assert close(sim.link_bytes[(f"g{i}", "sw")], per_rank)
        assert close(sim.link_bytes[("sw", f"g{i}")], per_rank)
    assert close(sum(sim.link_bytes.values()), 2 * sum(ring_allreduce(p).bytes_sent(N)))
    assert len(sim.busiest) == 5
    utils = [u for _, u, _ in sim.busiest]
    assert utils == sorted(utils, reverse=True)
    for link, u, nbytes in sim.busiest:
        assert sim.link_utilisation[link] == u and sim.link_bytes[link] == nbytes
    assert all(u <= 1 + 1e-9 for u in sim.link_utilisation.values())
    assert isinstance(sim, Simulation)


def test_link_bytes_on_a_real_multi_hop_topology():
    topo = Topology.load("topologies/dgx1-v100.yaml")
    sched, N = ring_allreduce(topo.nranks), 8e6
    sim = simulate(topo, sched, N)
    expected = 0.0
    frac = sched.chunk_fractions
    for r, prog in enumerate(sched.programs):
        for op in prog:
            if op.kind == "send":
                paths = topo.routes(r, op.peer)
                expected += frac[op.chunk] * N * sum(len(q) - 1 for q in paths) / len(paths)
    assert close(sum(sim.link_bytes.values()), expected)


# ----------------------------------------------------------------------- never optimistic, exact
def _random_topology(draw):
    p = draw(st.integers(2, 6))
    nsw = draw(st.integers(1, 2))
    bw = st.floats(1 * GB, 100 * GB)
    lat = st.floats(0.1 * US, 5 * US)
    nodes = [(f"s{k}", "switch") for k in range(nsw)]
    nodes += [{"id": f"g{i}", "kind": "gpu", "reduce_bandwidth": draw(st.sampled_from([HUGE, 20 * GB]))}
              for i in range(p)]
    links = []
    for i in range(p):
        homes = draw(st.sampled_from([[0], [1], [0, 1]])) if nsw == 2 else [0]
        for k in homes:
            links.append({"a": f"g{i}", "b": f"s{k}", "bandwidth": draw(bw), "latency": draw(lat)})
    if nsw == 2:
        links.append({"a": "s0", "b": "s1", "bandwidth": draw(bw), "latency": draw(lat)})
    if p > 2 and draw(st.booleans()):
        links.append({"a": "g0", "b": "g1", "bandwidth": draw(bw), "latency": draw(lat)})
    cost = draw(st.sampled_from([0.0, 0.0, 2 * US, 30 * US]))
    return Topology("random", nodes, links, [f"g{i}" for i in range(p)], {"message_cost": cost})


@st.composite
def cases(draw):
    topo = _random_topology(draw)
    p = topo.nranks
    makers = [("allreduce", ring_allreduce), ("allgather", ring_allgather),
              ("reduce_scatter", ring_reduce_scatter)]
    if p & (p - 1) == 0:
        makers.append(("allreduce", halving_doubling))
    collective, make = draw(st.sampled_from(makers))
    sched, planned = make(p), False
    if ALGORITHMS is not None and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(ALGORITHMS)))
        try:
            sched, planned = ALGORITHMS[name](topo, collective, nbytes=None), True
        except Exception:           # noqa: BLE001 - an algorithm that does not apply
            pass
    nbytes = draw(st.sampled_from([1e3, 1e6, 3e7])) * p
    return topo, collective, sched, nbytes, planned


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_never_below_the_lower_bound_and_matches_reference(case):
    topo, collective, sched, nbytes, planned = case
    sim = simulate(topo, sched, nbytes)
    assert all(u <= 1 + 1e-9 for u in sim.link_utilisation.values())
    if lower_bound is not None:
        bound = lower_bound(topo, collective, nbytes)
        assert sim.seconds >= bound.bandwidth_seconds * (1 - 1e-9)
        if not planned:
            # The latency bound is the round model's (one message in and one out per rank at a time);
            # the simulator lets a rank send several at once, so a planner's schedule (a tree with
            # several children, direct sends to every rank) may beat it at tiny sizes, as the README
            # says. The hand-built rings and halving-doubling here move one message per step.
            assert sim.seconds >= bound.seconds * (1 - 1e-9)
    if sched.nops <= 400:
        assert close(sim.seconds, reference(topo, sched, nbytes), 1e-6)


@pytest.mark.skipif(lower_bound is None, reason="ddl.bounds not available")
@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.sampled_from([1e3, 1e6, 1e8]), st.floats(1 * GB, 100 * GB))
def test_never_below_the_lower_bound_on_uniform_stars(p, nbytes, bandwidth):
    topo = star(p, bandwidth)
    for collective, sched in (("allreduce", ring_allreduce(p)), ("allgather", ring_allgather(p)),
                              ("reduce_scatter", ring_reduce_scatter(p))):
        assert simulate(topo, sched, nbytes).seconds >= lower_bound(topo, collective, nbytes).seconds * (1 - 1e-9)


@pytest.mark.skipif(lower_bound is None, reason="ddl.bounds not available")
def test_allreduce_bound_holds_on_uneven_ranks():
    # g1 has a 1 GB/s link, the others 100 GB/s. g1 uploads its whole vector to g0, which reduces
    # everything and sends the result back; in 32 chunks, the upload and the download of
    # g1 overlap, so it takes about N/B: twice the allgather cut bound (2 (p-1)/p N/B = 1.5 N/B) would
    # not be a bound; the allreduce bound (N/B, the min cut) is, and nearly attained.
    p, N = 4, 16e6
    topo = star(p, uplinks=[100 * GB, 1 * GB, 100 * GB, 100 * GB])
    pattern = (1,) * 32
    b = ScheduleBuilder("allreduce", p, pattern)
    for c in range(len(pattern)):
        for r in (1, 2, 3):
            b.transfer(r, 0, c, reduce=True)
        for r in (1, 2, 3):
            b.transfer(0, r, c)
    sched = b.build()
    verify(sched)
    sim = simulate(topo, sched, N)
    bound = lower_bound(topo, "allreduce", N).seconds
    assert bound == pytest.approx(N / (1 * GB), rel=1e-9)
    assert bound <= sim.seconds <= 1.05 * bound
    assert sim.seconds < 2 * lower_bound(topo, "allgather", N).seconds


@pytest.mark.skipif(lower_bound is None, reason="ddl.bounds not available")
# 16 MB on the 32-rank leaf-spine: reduce-broadcast-trees simulates its variants while it builds them
# there, and the three largest schedules take 22 s at 64 MB, 9 s at 16 MB
@pytest.mark.parametrize("name,N", [("dgx1-v100", 64e6), ("dgx-a100-2x8", 64e6), ("fat-tree-4x4-r4", 64e6),
                                    ("leaf-spine-2rack", 16e6)])
def test_zoo_algorithms_never_below_the_bound(name, N):
    topo = Topology.load(f"topologies/{name}.yaml")
    scheds = [ring_allreduce(topo.nranks)]
    if ALGORITHMS is not None:
        for fn in ALGORITHMS.values():
            try:
                scheds.append(fn(topo, "allreduce", nbytes=N))
            except Exception:       # noqa: BLE001 - an algorithm that does not apply
                pass
    bound = lower_bound(topo, "allreduce", N).seconds
    for s in scheds:
        sim = simulate(topo, s, N)
        assert sim.seconds >= bound * (1 - 1e-9), s.algorithm
        if s.nops <= 1000:
            assert close(sim.seconds, reference(topo, s, N), 1e-6), s.algorithm


def test_large_ring_is_fast():
    topo = Topology.load("topologies/ibm-3tier-192.yaml")
    sched = ring_allreduce(96)
    sub = topo.with_ranks(topo.ranks[::2])
    sched.dependencies, sched.matches
    t0 = time.process_time()
    sim = simulate(sub, sched, 1 << 28)
    elapsed = time.process_time() - t0
    assert sim.transfers == 2 * 96 * 95
    assert elapsed < 10          # about 0.5 s on a quiet core


@pytest.mark.parametrize("p", [3, 6, 8, 12])
def test_classic_schedules_at_every_size_on_a_star(p):
    """Regression: rounding in the filling's event keys once dropped a link's only live entry (an
    IndexError on halving-doubling, 8 ranks, 64 MiB). Every classic schedule simulates at every size,
    never below the bound."""
    from ddl.algorithms import ALGORITHMS
    from ddl.planner import flat_topology

    topo = flat_topology(p)
    for nbytes in (8, 1 << 20, 64 << 20, 256 << 20):
        for name in ("ring", "halving-doubling", "recursive-doubling", "double-binary-tree", "hierarchical"):
            sim = simulate(topo, ALGORITHMS[name](topo, "allreduce", nbytes=nbytes), nbytes)
            assert sim.seconds >= lower_bound(topo, "allreduce", nbytes).seconds * (1 - 1e-9), (name, nbytes)


# ------------------------------------------------------------------------------------------- timeline
def chain_broadcast(p, k):
    """Rank 0 streams ``k`` chunks down the chain 0 -> 1 -> ... -> p-1 (each forwards as it receives)."""
    b = ScheduleBuilder("broadcast", p, (1,) * k, root=0, algorithm="chain")
    for c in range(k):
        for i in range(p - 1):
            b.transfer(i, i + 1, c)
    return b.build()


def test_timeline_adds_up_to_the_link_bytes_and_shows_the_pipeline_fill():
    topo = star(3, latency=0.0)
    nbytes = 64 << 20
    sched = chain_broadcast(3, 8)
    first, last = ("g0", "sw"), ("sw", "g2")
    plain = simulate(topo, sched, nbytes)
    traced = simulate(topo, sched, nbytes, trace=[first, last, ("g2", "sw")])
    assert traced.seconds == plain.seconds and traced.link_bytes == plain.link_bytes
    assert plain.timeline == {}
    for link in (first, last):
        spans = traced.timeline[link]
        assert all(a < b and load > 0 for a, b, load in spans)
        assert all(b <= c for (_, b, _), (c, _, _) in zip(spans, spans[1:]))         # in order, apart
        assert sum((b - a) * load for a, b, load in spans) == pytest.approx(plain.link_bytes[link], rel=1e-9)
        profile = traced.profile(link, 10 * GB, bins=9)
        assert sum(profile) / 9 == pytest.approx(plain.link_utilisation[link], rel=1e-9)
    # 8 chunks, 9 steps: the first hop works in steps 1-8, the second in steps 2-9, each at full rate
    assert traced.profile(first, 10 * GB, bins=9) == pytest.approx([1.0] * 8 + [0.0], abs=1e-6)
    assert traced.profile(last, 10 * GB, bins=9) == pytest.approx([0.0] + [1.0] * 8, abs=1e-6)
    assert traced.timeline[("g2", "sw")] == ()                                      # carried nothing


def test_pinned_routes_must_follow_the_forwarding_rules_the_bounds_assume():
    """A hand-made route around a direct link, through a GPU outside the job, through another rank or
    over one vertex twice is refused by name: it would be predicted far below the lower bound (or, for
    the loop, crash the rate computation)."""
    import dataclasses
    nodes = [("sw", "switch"), ("sw2", "switch"), ("g0", "gpu"), ("g1", "gpu"), ("g2", "gpu"), ("gx", "gpu")]
    links = [{"a": "g0", "b": "g1", "bandwidth": 1 * GB}, {"a": "g0", "b": "gx", "bandwidth": 10 * GB},
             {"a": "gx", "b": "g2", "bandwidth": 10 * GB}, {"a": "g1", "b": "sw2", "bandwidth": 10 * GB},
             {"a": "g0", "b": "sw2", "bandwidth": 10 * GB}] + \
            [{"a": f"g{i}", "b": "sw", "bandwidth": 10 * GB} for i in range(3)]
    topo = Topology("direct", nodes, links, ["g0", "g1", "g2"])
    base = ring_allreduce(3)
    assert simulate(topo, base, 1 << 20).seconds > 0
    for pair, path, says in (((0, 1), ("g0", "sw", "g1"), "goes around the direct link 'g0' -> 'g1'"),
                             ((2, 0), ("g2", "gx", "g0"), "passes through 'gx', which does not forward"),
                             ((0, 2), ("g0", "gx", "g2"), "passes through 'gx', which does not forward"),
                             ((1, 2), ("g1", "sw", "g0", "sw", "g2"), "passes through a vertex twice"),
                             ((1, 2), ("g1", "sw", "g0", "g1", "sw", "g2"), "passes through a vertex twice"),
                             ((1, 2), ("g1", "nowhere", "g2"), "passes through 'nowhere', which is no node")):
        pinned = dataclasses.replace(base, routes={pair: [(path, 1.0)]})
        with pytest.raises(ScheduleError, match=f"route {pair[0]} -> {pair[1]}: .*{says}"):
            simulate(topo, pinned, 1 << 20)
    through_rank = dataclasses.replace(base, routes={(2, 0): [(("g2", "sw", "g1", "sw2", "g0"), 1.0)]})
    with pytest.raises(ScheduleError, match="route 2 -> 0: .*passes through 'g1', which does not forward"):
        simulate(topo, through_rank, 1 << 20)
    fine = dataclasses.replace(base, routes={(1, 2): [(("g1", "sw", "g2"), 1.0)]})
    assert simulate(topo, fine, 1 << 20).seconds > 0


@pytest.mark.parametrize("name", ["fat-tree-4x4-r8", "dgx-a100", "ibm-3tier-fragment"])
def test_link_totals_are_what_the_simulation_carries_without_building_the_dataflow(name):
    # sends paired with their receives are all the totals need: a schedule that has no dataflow yet
    # (hierarchical's spans expand to every chunk there) gets none, and the totals are the bytes the
    # simulation then reports, to the last bit; one that has it uses it
    from ddl.algorithms import ALGORITHMS
    from ddl.simulate import link_totals
    topo = Topology.load(Path(__file__).resolve().parent.parent / "topologies" / f"{name}.yaml")
    for algorithm in ("ring", "hierarchical", "halving-doubling", "multicommodity-flow"):
        sched = ALGORITHMS[algorithm](topo, "allreduce")
        fresh = "dataflow" not in sched.__dict__          # (routing simulates its bases: it has one)
        assert fresh or algorithm == "multicommodity-flow"
        totals = link_totals(topo, sched, 3e6)
        assert ("dataflow" not in sched.__dict__) == fresh, algorithm
        assert totals == simulate(topo, sched, 3e6).link_bytes, algorithm
        assert link_totals(topo, sched, 3e6) == totals       # (from the dataflow, built by the simulation)
    b = ScheduleBuilder("allreduce", topo.nranks, (1,))
    b.programs[0].append(("send", 0, 1))                       # rank 1 never receives it
    with pytest.raises(ScheduleError, match="rank 0 sends it to rank 1 1 time"):
        link_totals(topo, b.build(), 3e6)
