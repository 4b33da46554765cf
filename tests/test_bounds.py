"""Tests of ddl.bounds against the known answers the zoo files state (DGX-1, fat trees) and against
brute force.

Graphs are built directly with networkx so that these tests do not depend on ddl.topology; the
Topology wrappers are exercised through a small stand-in object with the same interface and, when
ddl.topology exists, through real Topology objects.
"""
import hashlib
import heapq
import itertools
import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddl import bounds
from ddl.bounds import (Bound, CutBound, algbw, bandwidth_bound, bandwidth_bound_graph, broadcast_bandwidth_graph,
                        busbw, busbw_factor, cut_bound, cut_bound_graph, latency_bound, latency_bound_graph,
                        latency_rounds, lower_bound, lower_bound_graph, min_rank_latency_graph, rank_latency_matrix,
                        reduce_bandwidth_graph)
from ddl.errors import PlanError

GB = 1e9
N = 1 << 30


# ---------------------------------------------------------------------------------------------------
# graph builders


def link(g, a, b, capacity, latency=1e-6):
    g.add_edge(a, b, capacity=capacity, latency=latency)
    g.add_edge(b, a, capacity=capacity, latency=latency)


def star(p, bandwidth, latency=1e-6):
    g = nx.DiGraph()
    for i in range(p):
        link(g, f"gpu{i}", "sw", bandwidth, latency)
    return g, [f"gpu{i}" for i in range(p)]


DGX1_DOUBLE = [(0, 1), (0, 4), (1, 3), (2, 3), (2, 6), (4, 5), (5, 7), (6, 7)]
DGX1_SINGLE = [(0, 2), (0, 3), (1, 2), (1, 5), (3, 7), (4, 6), (4, 7), (5, 6)]


def dgx1(members=range(8)):
    """NVLink graph of a DGX-1 V100 restricted to ``members``: GPUs outside the job cannot forward."""
    members = list(members)
    g = nx.DiGraph()
    g.add_nodes_from(members)
    for pairs, bw in ((DGX1_DOUBLE, 50 * GB), (DGX1_SINGLE, 25 * GB)):
        for a, b in pairs:
            if a in members and b in members:
                link(g, a, b, bw)
    return g, members


def fat_tree(r, leaves=4, per_leaf=4, rank_bw=4 * GB):
    g, ranks = nx.DiGraph(), []
    for leaf in range(leaves):
        link(g, f"leaf{leaf}", "spine", 16 * GB / r)
        for i in range(per_leaf):
            v = f"leaf{leaf}/r{i}"
            link(g, v, f"leaf{leaf}", rank_bw)
            ranks.append(v)
    return g, ranks


def dgx_a100(boxes):
    """ForestColl's DGX A100 model: per box an NVSwitch giving each GPU 300 GB/s per direction, and
    each GPU its own 200 Gbit/s (25 GB/s) NIC into one InfiniBand fabric."""
    g, ranks = nx.DiGraph(), []
    for b in range(boxes):
        for i in range(8):
            v = f"b{b}/gpu{i}"
            link(g, v, f"b{b}/nvswitch", 300 * GB)
            link(g, v, "ib", 25 * GB)
            ranks.append(v)
    return g, ranks


def three_tier(gpus=4, hosts=16, racks=3):
    g, ranks = nx.DiGraph(), []
    for r in range(racks):
        link(g, f"r{r}", "spine", 50 * GB)
        for h in range(hosts):
            link(g, f"r{r}/h{h}", f"r{r}", 12.5 * GB)
            for k in range(gpus):
                v = f"r{r}/h{h}/gpu{k}"
                link(g, v, f"r{r}/h{h}", 150 * GB)
                ranks.append(v)
    return g, ranks


def allreduce_busbw(graph, ranks):
    t = bandwidth_bound_graph(graph, ranks, "allreduce", N)
    return busbw("allreduce", N, t, len(ranks))


def allgather_algbw(graph, ranks):
    return algbw(N, bandwidth_bound_graph(graph, ranks, "allgather", N))


def check_cut(graph, ranks, cb):
    """The reported cut is real: it holds some but not all ranks, and its numbers are its own."""
    inside = sum(1 for r in ranks if r in cb.cut)
    assert 1 <= inside < len(ranks)
    assert cb.ranks_in_cut == inside
    out = sum(d["capacity"] for u, v, d in graph.edges(data=True) if u in cb.cut and v not in cb.cut)
    assert cb.bandwidth_out == pytest.approx(out, rel=1e-12)
    assert cb.seconds_per_byte == pytest.approx(inside / (len(ranks) * out), rel=1e-12, abs=0)


# ---------------------------------------------------------------------------------------------------
# known answers


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
def test_uniform_star(p):
    B = 25 * GB
    g, ranks = star(p, B)
    assert bandwidth_bound_graph(g, ranks, "allreduce", N) == pytest.approx(2 * (p - 1) / p * N / B, rel=1e-9)
    assert bandwidth_bound_graph(g, ranks, "allgather", N) == pytest.approx((p - 1) / p * N / B, rel=1e-9)
    assert bandwidth_bound_graph(g, ranks, "reduce_scatter", N) == pytest.approx((p - 1) / p * N / B, rel=1e-9)
    assert allreduce_busbw(g, ranks) == pytest.approx(B, rel=1e-9)   # busbw of the bound = link bandwidth
    cb = cut_bound_graph(g, ranks)
    check_cut(g, ranks, cb)
    assert cb.rate == pytest.approx(B / (p - 1), rel=1e-12)


def test_dgx1_full_allreduce_busbw_150():
    g, ranks = dgx1()
    assert allreduce_busbw(g, ranks) == pytest.approx(150 * GB, rel=1e-9)
    cb = cut_bound_graph(g, ranks)
    check_cut(g, ranks, cb)
    assert cb.ranks_in_cut == 7 and cb.bandwidth_out == 150 * GB   # everyone but one GPU feeds it


@pytest.mark.parametrize("members, trees, allreduce", [
    ([0, 1, 4, 5], 75, 87.5),     # trees 75 GB/s (best NVLink ring 50)
    ([0, 4, 6, 7], 50, 75),       # trees 50 GB/s, no NVLink ring
    ([0, 1, 2, 3, 7], 25, 40),    # trees 25 GB/s: GPU 7 has one 25 GB/s link into the fragment
])
def test_dgx1_fragments(members, trees, allreduce):
    """The DESIGN's tree figures are allgather (and reduce-scatter) trees: in bus bandwidth
    ``algbw * (p-1)/p``, the cut bound equals them, so those trees are optimal for allgather. An
    allreduce that overlaps its reduction with the broadcast of the result does better (Blink's
    reduce-broadcast trees, see test_fragment_allreduce_beats_twice_the_allgather_bound)."""
    g, ranks = dgx1(members)
    p = len(ranks)
    assert busbw("allgather", N, bandwidth_bound_graph(g, ranks, "allgather", N), p) == pytest.approx(trees * GB)
    assert allreduce_busbw(g, ranks) == pytest.approx(allreduce * GB, rel=1e-9)
    check_cut(g, ranks, cut_bound_graph(g, ranks))


@pytest.mark.parametrize("r, expected", [(1, 64 / 15), (4, 64 / 15), (8, 8 / 3), (16, 4 / 3)])
def test_fat_tree_oversubscription(r, expected):
    g, ranks = fat_tree(r)
    assert allgather_algbw(g, ranks) == pytest.approx(expected * GB, rel=1e-9)
    assert round(allgather_algbw(g, ranks) / GB, 2) == {1: 4.27, 4: 4.27, 8: 2.67, 16: 1.33}[r]


@pytest.mark.parametrize("boxes, expected, limiting", [
    (2, 346.67, 15),   # everyone but one GPU: its 300 GB/s NVSwitch port + 25 GB/s NIC, 16 * 325/15
    (4, 266.67, 24),   # everyone but one box: the box's 8 NICs, 32 * 200/24
])
def test_dgx_a100_forestcoll_optimum(boxes, expected, limiting):
    g, ranks = dgx_a100(boxes)
    cb = cut_bound_graph(g, ranks)
    check_cut(g, ranks, cb)
    assert round(cb.algbw / GB, 2) == expected
    assert cb.ranks_in_cut == limiting
    assert allgather_algbw(g, ranks) == pytest.approx(cb.algbw, rel=1e-12)


def test_three_tier_host_link_limits():
    g, ranks = three_tier()
    cb = cut_bound_graph(g, ranks)
    check_cut(g, ranks, cb)
    assert cb.ranks_in_cut == 188 and cb.bandwidth_out == 12.5 * GB   # all but one host
    assert cb.algbw == pytest.approx(192 * 12.5 * GB / 188, rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# broadcast, reduce, directions, degenerate cases


def test_broadcast_bound():
    g, ranks = star(8, 25 * GB)
    assert bandwidth_bound_graph(g, ranks, "broadcast", N) == pytest.approx(N / (25 * GB), rel=1e-12)
    g, ranks = dgx1()
    rate, cut = broadcast_bandwidth_graph(g, ranks, root=3)
    assert rate == 150 * GB and 3 in cut
    g, ranks = dgx1([0, 1, 2, 3, 7])
    assert bandwidth_bound_graph(g, ranks, "broadcast", N, root=0) == pytest.approx(N / (25 * GB), rel=1e-12)
    assert bandwidth_bound_graph(g, ranks, "broadcast", N, root=4) == pytest.approx(N / (25 * GB), rel=1e-12)
    g, ranks = dgx_a100(2)
    rate, cut = broadcast_bandwidth_graph(g, ranks, root=0)
    assert rate == 200 * GB and cut >= {f"b0/gpu{i}" for i in range(8)}   # box 0's eight NICs
    with pytest.raises(PlanError):
        bandwidth_bound_graph(g, ranks, "broadcast", N, root=16)


def test_directed_graph_reduce_scatter_uses_reverse_cuts():
    g, ranks = nx.DiGraph(), ["a", "b", "c"]
    for v in ranks:
        g.add_edge(v, "sw", capacity=10 * GB, latency=1e-6)
        g.add_edge("sw", v, capacity=40 * GB, latency=1e-6)
    # allgather: min(out of one rank 10, into one rank 40 / 2 others) = 10; reduce-scatter: min(40, 10/2)
    assert cut_bound_graph(g, ranks).rate == 10 * GB
    assert bandwidth_bound_graph(g, ranks, "allgather", N) == pytest.approx(N / (3 * 10 * GB), rel=1e-12)
    assert bandwidth_bound_graph(g, ranks, "reduce_scatter", N) == pytest.approx(N / (3 * 5 * GB), rel=1e-12)
    # allreduce: each byte crosses between the three ranks 2(3-1) = 4 times, out of 30 GB/s in all
    assert bandwidth_bound_graph(g, ranks, "allreduce", N) == pytest.approx(4 * N / (30 * GB), rel=1e-12)
    assert broadcast_bandwidth_graph(g, ranks)[0] == 10 * GB
    assert reduce_bandwidth_graph(g, ranks)[0] == 10 * GB   # each sender has 10 GB/s out


def test_single_rank_and_shared_vertex():
    g, ranks = star(1, 25 * GB)
    assert cut_bound_graph(g, ranks) == CutBound(0.0, frozenset(), 0, math.inf)
    for c in bounds.COLLECTIVES:
        assert lower_bound_graph(g, ranks, c, N) == Bound(0.0, 0.0, 0.0)
    # two ranks on gpu0: they exchange for free, count twice in every cut, and have latency 0
    g, _ = star(3, 30 * GB)
    ranks = ["gpu0", "gpu0", "gpu1", "gpu2"]
    cb = cut_bound_graph(g, ranks)
    assert cb.rate == 10 * GB and cb.ranks_in_cut == 3   # all but gpu1 (or gpu2): 30 GB/s over 3 ranks
    assert cb.seconds_per_byte == pytest.approx(3 / (4 * 30 * GB), rel=1e-12, abs=0)
    assert min_rank_latency_graph(g, ranks) == 0.0
    assert broadcast_bandwidth_graph(g, ["gpu0", "gpu0"])[0] == math.inf


def test_disconnected_rank_is_infinite():
    g, ranks = star(3, 25 * GB)
    g.add_node("lonely")
    assert math.isinf(cut_bound_graph(g, ranks + ["lonely"]).seconds_per_byte)
    g.add_edge("lonely", "sw", capacity=25 * GB, latency=1e-6)      # can send, cannot receive
    cb = cut_bound_graph(g, ranks + ["lonely"])
    assert math.isinf(cb.seconds_per_byte) and cb.bandwidth_out == 0.0 and "lonely" not in cb.cut
    h = nx.DiGraph()
    h.add_edge(0, 9, capacity=1.0, latency=1e-6)
    h.add_node(1)
    assert min_rank_latency_graph(h, [0, 1]) == math.inf


def test_inexact_capacities_still_give_the_cut():
    # 16/6 GB/s has no small common unit with the others: rounded flows, but a real (optimal) cut
    g, ranks = fat_tree(6)
    cb = cut_bound_graph(g, ranks)
    check_cut(g, ranks, cb)
    assert cb.ranks_in_cut == 12
    assert cb.algbw == pytest.approx(16 * (16 * GB / 6) / 12, rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# latency


def test_latency_bound():
    g, ranks = star(8, 25 * GB, latency=1e-6)
    assert min_rank_latency_graph(g, ranks) == pytest.approx(2e-6)
    for c in bounds.COLLECTIVES:
        assert latency_bound_graph(g, ranks, c) == pytest.approx(3 * 2e-6)
    g, ranks = star(9, 25 * GB, latency=1e-6)
    assert latency_bound_graph(g, ranks, "allreduce") == pytest.approx(4 * 2e-6)
    g, ranks = dgx1()
    g[0][1]["latency"] = 0.5e-6
    # one fast pair: 3 rounds of 0.5 us, but the pair is a group of 2 that hears from the other 6
    # only over 1 us links, and 2 * 3^k >= 8 takes k = 2 of them
    assert latency_bound_graph(g, ranks, "allgather") == pytest.approx(2 * 1e-6)
    # directed: only a -> x -> c exists; the vertex that is nearest to c's own out-edges is c itself
    h = nx.DiGraph()
    h.add_edge("a", "x", latency=5e-6, capacity=1.0)
    h.add_edge("x", "c", latency=4e-6, capacity=1.0)
    h.add_edge("c", "x", latency=1e-6, capacity=1.0)
    assert min_rank_latency_graph(h, ["a", "c"]) == pytest.approx(9e-6)


def test_rank_latency_matrix():
    h = nx.DiGraph()
    h.add_edge("a", "x", latency=5e-6, capacity=1.0)
    h.add_edge("x", "c", latency=4e-6, capacity=1.0)
    h.add_edge("c", "x", latency=1e-6, capacity=1.0)
    h.add_edge("x", "b", latency=0.0, capacity=1.0)
    h.add_edge("b", "c", latency=1e-6, capacity=1.0)          # b is a rank: a -> x -> b -> c is no path
    lat = rank_latency_matrix(h, ["a", "c", "b", "c"])
    assert lat[0, 1] == pytest.approx(9e-6) and lat[0, 2] == pytest.approx(5e-6)
    assert lat[2, 1] == pytest.approx(1e-6) and lat[1, 2] == pytest.approx(1e-6)
    assert lat[1, 3] == lat[3, 1] == 0.0 and lat[0, 0] == 0.0     # two ranks on c
    assert math.isinf(lat[1, 0]) and math.isinf(lat[2, 0])       # nothing reaches a


def _telephone_optimum(lat):
    """Least time of an allgather in lock-step rounds where every rank sends at most one and receives at
    most one message per round and a round lasts as long as its slowest message (Dijkstra over what
    every rank knows). Lock-step executions are executions of the model, so no bound may exceed it."""
    p = len(lat)
    full = (1 << p) - 1
    moves = []
    for senders in itertools.product([None, *range(p)], repeat=p):        # senders[r]: who r hears
        chosen = [s for s in senders if s is not None]
        if len(chosen) == len(set(chosen)) and all(s != r for r, s in enumerate(senders)) and chosen:
            moves.append((max(lat[s][r] for r, s in enumerate(senders) if s is not None), senders))
    start = tuple(1 << r for r in range(p))
    best = {start: 0.0}
    heap = [(0.0, start)]
    while heap:
        t, know = heapq.heappop(heap)
        if all(k == full for k in know):
            return t
        if t > best[know]:
            continue
        for cost, senders in moves:
            nxt = tuple(k | (know[s] if s is not None else 0) for k, s in zip(know, senders))
            if nxt != know and t + cost < best.get(nxt, math.inf):
                best[nxt] = t + cost
                heapq.heappush(heap, (t + cost, nxt))
    return math.inf


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=6, max_size=6), st.integers(0, 2))
def test_latency_bound_never_exceeds_the_telephone_optimum(weights, shape):
    """Four ranks, as two hosts of two, one host of three, or four hosts, with random latencies."""
    groups = ([[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0], [1], [2], [3]])[shape]
    g = nx.DiGraph()
    for i, members in enumerate(groups):
        for r in members:
            link(g, r, f"host{i}", 1.0, weights[r] * 1e-7)
        link(g, f"host{i}", "spine", 1.0, weights[4 + i % 2] * 1e-6)
    ranks = list(range(4))
    lat = rank_latency_matrix(g, ranks)
    optimum = _telephone_optimum(lat.tolist())
    assert latency_bound_graph(g, ranks, "allgather") <= optimum * (1 + 1e-9)


def test_lower_bound_is_max_of_parts():
    g, ranks = star(4, 25 * GB, latency=1e-6)
    small = lower_bound_graph(g, ranks, "allreduce", 8)
    assert small.seconds == small.latency_seconds == pytest.approx(2 * 2e-6)
    big = lower_bound_graph(g, ranks, "allreduce", N)
    assert big.seconds == big.bandwidth_seconds == pytest.approx(1.5 * N / (25 * GB))
    nothing = lower_bound_graph(g, ranks, "allreduce", 0)     # no message need be sent
    assert nothing.seconds == nothing.latency_seconds == nothing.bandwidth_seconds == 0
    with pytest.raises(PlanError):
        lower_bound_graph(g, ranks, "alltoallv", N)


def test_busbw_helpers():
    assert algbw(100, 2.0) == 50.0 and algbw(100, 0.0) == math.inf
    assert busbw_factor("allreduce", 8) == pytest.approx(1.75)
    assert busbw_factor("allgather", 8) == busbw_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == 1.0
    assert busbw("allreduce", 100, 1.0, 4) == pytest.approx(150.0)
    with pytest.raises(PlanError):
        busbw_factor("scan", 4)


# ---------------------------------------------------------------------------------------------------
# against brute force


def random_graph(rng, integer=True):
    nranks = rng.randint(3, 7)
    nswitch = rng.randint(0, 2)
    vertices = [f"r{i}" for i in range(nranks)] + [f"s{i}" for i in range(nswitch)]
    g = nx.DiGraph()
    g.add_nodes_from(vertices)

    def cap():
        return float(rng.randint(1, 12)) * GB if integer else rng.uniform(0.1, 100.0) * GB
    for a, b in itertools.permutations(vertices, 2):
        if rng.random() < 0.35:
            g.add_edge(a, b, capacity=cap(), latency=rng.choice([1, 2, 3, 5]) * 1e-6)
    ranks = [f"r{i}" for i in range(nranks)]
    if rng.random() < 0.15:
        ranks.append(rng.choice(ranks))   # two ranks on one vertex now and then
    return g, ranks


def brute_rate(g, ranks):
    """min over vertex sets S holding some but not all ranks of B+(S) / |S ∩ ranks|."""
    vertices = list(g.nodes)
    best = math.inf
    for bits in range(1, 2 ** len(vertices)):
        S = {v for i, v in enumerate(vertices) if bits >> i & 1}
        k = sum(1 for r in ranks if r in S)
        if k == 0 or k == len(ranks):
            continue
        out = sum(d["capacity"] for u, v, d in g.edges(data=True) if u in S and v not in S)
        best = min(best, out / k)
    return best


def brute_latency(g, ranks):
    rset, best = set(ranks), math.inf
    if len(rset) < len(ranks):
        return 0.0
    for u, v in itertools.permutations(rset, 2):
        sub = g.subgraph([w for w in g if w not in rset or w in (u, v)])
        try:
            best = min(best, nx.dijkstra_path_length(sub, u, v, weight="latency"))
        except nx.NetworkXNoPath:
            pass
    return best


@settings(max_examples=120, deadline=None)
@given(st.randoms(use_true_random=False))
def test_cut_bound_matches_brute_force(rng):
    g, ranks = random_graph(rng)
    expected = brute_rate(g, ranks)
    cb = cut_bound_graph(g, ranks)
    if expected == 0:
        assert math.isinf(cb.seconds_per_byte)
        return
    assert cb.rate == pytest.approx(expected, rel=1e-12)
    check_cut(g, ranks, cb)
    assert min_rank_latency_graph(g, ranks) == pytest.approx(brute_latency(g, ranks), rel=1e-12)
    root = rng.randrange(len(ranks))
    others = {r for r in ranks if r != ranks[root]}
    flows = [nx.maximum_flow_value(g, ranks[root], v) for v in others]
    rate, cut = broadcast_bandwidth_graph(g, ranks, root)
    assert rate == pytest.approx(min(flows) if flows else math.inf, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_cut_bound_float_capacities(rng):
    """Arbitrary float capacities: rounded flows, but always a real cut within 1e-6 of the optimum."""
    g, ranks = random_graph(rng, integer=False)
    expected = brute_rate(g, ranks)
    cb = cut_bound_graph(g, ranks)
    if expected == 0:
        assert math.isinf(cb.seconds_per_byte)
        return
    check_cut(g, ranks, cb)
    assert expected * (1 - 1e-12) <= cb.rate <= expected * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------------
# Topology wrappers


class StandIn:
    """The part of the Topology interface that ddl.bounds uses."""

    def __init__(self, graph, ranks, name="stand-in"):
        self._graph = nx.freeze(graph)
        self.ranks = tuple(ranks)
        self.nranks = len(self.ranks)
        self.name = name
        edges = sorted((str(u), str(v), d["capacity"], d["latency"]) for u, v, d in graph.edges(data=True))
        self.fingerprint = hashlib.sha256(repr((edges, self.ranks)).encode()).hexdigest()
        self.calls = 0

    def usable_graph(self):
        self.calls += 1
        return self._graph


def test_wrappers_on_stand_in_topology():
    topo = StandIn(*dgx1())
    cb = cut_bound(topo)
    assert cut_bound(topo) is cb and cut_bound(topo, reverse=True) is cb   # cached; full duplex
    t = bandwidth_bound(topo, "allreduce", N)
    calls = topo.calls
    assert bandwidth_bound(topo, "allreduce", 2 * N) == pytest.approx(2 * t)
    assert topo.calls == calls                                              # served from the cache
    assert busbw("allreduce", N, t, 8) == pytest.approx(150 * GB, rel=1e-9)
    assert bandwidth_bound(topo, "broadcast", N, root=2) == pytest.approx(N / (150 * GB))
    assert latency_bound(topo, "allreduce") == pytest.approx(3e-6)
    lb = lower_bound(topo, "allgather", N)
    assert lb.seconds == lb.bandwidth_seconds == pytest.approx(N * 7 / (8 * 150 * GB))
    assert latency_bound(StandIn(*star(1, GB)), "broadcast") == 0.0
    with pytest.raises(PlanError):
        bandwidth_bound(topo, "broadcast", N, root=8)


def _topology_module():
    try:
        from ddl import topology
    except ImportError:
        return None
    return topology


def _dgx1_topology():
    """NVLink DGX-1 as a Topology. Topology requires every rank pair to be connected without GPU
    forwarding, so the GPUs also hang off a token 1 kB/s PCIe switch (1e-8 of an NVLink: invisible at
    rel=1e-6)."""
    from ddl.topology import Topology
    return Topology.from_dict({
        "name": "dgx1-nvlink",
        "defaults": {"latency": "1 us"},
        "nodes": [{"id": "gpu{g}", "kind": "gpu", "for": {"g": 8}}, {"id": "pcie", "kind": "pcie"}],
        "links": [
            {"a": "gpu{g}", "b": "pcie", "bandwidth": "1 kB/s", "latency": "5 us", "for": {"g": 8}},
            {"a": "gpu{p[0]}", "b": "gpu{p[1]}", "bandwidth": "25 GB/s", "count": 2,
             "for": {"p": [list(e) for e in DGX1_DOUBLE]}},
            {"a": "gpu{p[0]}", "b": "gpu{p[1]}", "bandwidth": "25 GB/s",
             "for": {"p": [list(e) for e in DGX1_SINGLE]}},
        ],
        "ranks": [{"id": "gpu{g}", "for": {"g": 8}}],
    })


def test_topology_dgx1_and_fragments():
    topo = _dgx1_topology()
    t = bandwidth_bound(topo, "allreduce", N)
    assert busbw("allreduce", N, t, 8) == pytest.approx(150 * GB, rel=1e-6)
    assert cut_bound(topo) is cut_bound(topo)
    assert latency_bound(topo, "allreduce") == pytest.approx(3e-6)
    # fragments: the GPUs left out are not ranks and cannot forward (usable_graph drops them)
    for members, expected in (([0, 1, 4, 5], 87.5), ([0, 4, 6, 7], 75), ([0, 1, 2, 3, 7], 40)):
        frag = topo.with_ranks([f"gpu{g}" for g in members])
        t = bandwidth_bound(frag, "allreduce", N)
        assert busbw("allreduce", N, t, len(members)) == pytest.approx(expected * GB, rel=1e-6)
        lb = lower_bound(frag, "allreduce", N)
        assert lb.seconds == lb.bandwidth_seconds == t


def test_topology_hierarchy_three_tier():
    from ddl.topology import Topology
    topo = Topology.from_dict({"name": "ibm-3tier", "tiers": [
        {"name": "gpu", "count": 4, "bandwidth": "150 GB/s", "latency": "1 us"},
        {"name": "host", "count": 16, "bandwidth": "12.5 GB/s", "latency": "1 us"},
        {"name": "rack", "count": 3, "bandwidth": "50 GB/s", "latency": "1 us"}]})
    assert topo.nranks == 192
    cb = cut_bound(topo)
    assert cb.ranks_in_cut == 188 and cb.bandwidth_out == pytest.approx(12.5 * GB)
    g, ranks = three_tier()
    assert cb.seconds_per_byte == pytest.approx(cut_bound_graph(g, ranks).seconds_per_byte, rel=1e-12, abs=0)
    assert latency_bound(topo, "allgather") == pytest.approx(8 * 2e-6)   # ceil(log2 192) = 8, GPU-host-GPU
    # hosts of 4 need 3 cross-host latencies (4 * 5^3 >= 192), racks of 64 one cross-rack latency
    lat = rank_latency_matrix(topo.usable_graph(), list(topo.ranks))
    assert latency_rounds(lat) == [(pytest.approx(2e-6), 8), (pytest.approx(4e-6), 3), (pytest.approx(6e-6), 1)]
    assert bandwidth_bound(topo, "broadcast", N) == pytest.approx(N / (12.5 * GB), rel=1e-12)


def test_latency_tiers_of_the_ibm_cluster():
    """2 us inside a host, 6 us across hosts, 10 us across racks: the cross-host tier binds."""
    from ddl.topology import Topology
    topo = Topology.load("topologies/ibm-3tier-192.yaml")
    assert latency_bound(topo, "allreduce") == pytest.approx(max(8 * 2e-6, 3 * 6e-6, 1 * 10e-6))


# ---------------------------------------------------------------------------------------------------
# allreduce: the partition bound is attained where twice the allgather bound is not a bound


def reduce_broadcast_trees(p, trees, pieces):
    """An allreduce schedule of Blink's kind: each ``(weight, root, parent)`` tree carries ``weight``
    of the buffer in ``pieces`` chunks, reduced up to ``root`` and broadcast back down, pipelined."""
    from ddl.schedule import ScheduleBuilder
    pattern = [w for w, _, _ in trees for _ in range(pieces)]
    b = ScheduleBuilder("allreduce", p, pattern, algorithm="reduce-broadcast-trees")
    orders = []
    for _w, root, parent in trees:
        def depth(v):
            return 0 if v == root else 1 + depth(parent[v])
        orders.append(sorted(parent, key=depth))
    for j in range(pieces):                  # piece by piece, so every tree makes progress at once
        for t, (_w, _root, parent) in enumerate(trees):
            c = t * pieces + j
            for v in reversed(orders[t]):
                b.transfer(v, parent[v], c, reduce=True)
            for v in orders[t]:
                b.transfer(parent[v], v, c)
    return b.build()


def test_fragment_allreduce_beats_twice_the_allgather_bound():
    """DGX-1 GPUs {0,1,4,5} form the NVLink cycle 0-1-5-4-0 of 50, 25, 50, 50 GB/s. Four paths, each
    the cycle less one edge, weighted 1, 4, 1, 1 (less 0-1, 1-5, 4-5, 0-4), load every edge in
    proportion to its capacity: an allreduce at N / (58.3 GB/s), busbw 87.5 GB/s, where twice the
    allgather bound claims busbw 75 at most. The partition bound (each GPU on its own) is exact."""
    from ddl.simulate import simulate
    from ddl.verify import verify
    frag = _dgx1_topology().with_ranks([f"gpu{g}" for g in (0, 1, 4, 5)])    # ranks 0, 1, 2, 3
    paths = {"0-1": (1, [1, 3, 2, 0]), "1-5": (4, [3, 2, 0, 1]), "4-5": (1, [2, 0, 1, 3]), "0-4": (1, [0, 1, 3, 2])}
    trees = []
    for weight, path in paths.values():
        root = path[1]
        parent = {path[0]: path[1], path[2]: path[1], path[3]: path[2]}
        trees.append((weight, root, parent))
    sched = reduce_broadcast_trees(4, trees, pieces=64)
    verify(sched)
    nbytes = 2**28
    t = simulate(frag, sched, nbytes).seconds
    bound = bandwidth_bound(frag, "allreduce", nbytes)
    assert busbw("allreduce", nbytes, bound, 4) == pytest.approx(87.5 * GB, rel=1e-6)
    assert bound <= t <= 1.05 * bound
    twice_allgather = 2 * bandwidth_bound(frag, "allgather", nbytes)
    assert t < 0.9 * twice_allgather


def test_allreduce_bound_of_a_rank_behind_a_slow_link():
    """One rank behind 1 GB/s, three behind 100 GB/s: it must upload and download N, which overlap,
    so the bound is N/B (the min cut), not the 2(p-1)/p N/B a uniform star at 1 GB/s would need."""
    g = nx.DiGraph()
    for i, bw in enumerate([100, 1, 100, 100]):
        link(g, f"gpu{i}", "sw", bw * GB)
    ranks = [f"gpu{i}" for i in range(4)]
    ab = bounds.allreduce_bound_graph(g, ranks)
    assert ab.seconds_per_byte == pytest.approx(1 / (1 * GB), rel=1e-12, abs=0)
    assert ab.bandwidth / ab.crossings == 1 * GB
    assert {"gpu1"} in [set(s) & set(ranks) for s in ab.groups]


@pytest.mark.parametrize("r", [1, 4, 8, 16])
def test_allreduce_partition_bound_on_fat_trees(r):
    """Up to 4:1 the ranks' own 4 GB/s links limit (each rank a group: 2·15/16 N / 4 GB/s); past
    it the leaves' uplinks (each leaf a group: 2·3 N / (4 · 2 · 16/r GB/s) per byte, both directions)."""
    g, ranks = fat_tree(r)
    ab = bounds.allreduce_bound_graph(g, ranks)
    expected = max(2 * 15 / (16 * 4 * 16 * GB) * 16, 2 * 3 / (4 * 16 * GB / r)) if r > 4 else 2 * 15 / (16 * 4 * GB)
    assert ab.seconds_per_byte == pytest.approx(expected, rel=1e-12, abs=0)
    assert len(ab.groups) == (16 if r <= 4 else 4)


def test_allreduce_bound_degenerate_cases():
    g, _ = star(3, 30 * GB)
    assert bounds.allreduce_bound_graph(g, ["gpu0", "gpu0"]).seconds_per_byte == 0.0
    # ranks sharing a vertex form one group: gpu0 (twice) and gpu1 gossip over 30 GB/s each way
    shared = bounds.allreduce_bound_graph(g, ["gpu0", "gpu0", "gpu1"])
    assert shared.seconds_per_byte == pytest.approx(1 / (30 * GB), rel=1e-12, abs=0)
    g.add_node("lonely")
    assert math.isinf(bounds.allreduce_bound_graph(g, ["gpu0", "gpu1", "lonely"]).seconds_per_byte)


# ---------------------------------------------------------------------------------------------------
# transfers routed as transports route them (direct links alone)


def test_a_direct_link_is_all_two_gpus_have():
    """Two GPUs joined by 25 GB/s of NVLink and by 12 GB/s each to a PCIe switch: the cut bound sees
    37 GB/s leave each GPU, but a peer copy between them takes NVLink, so 25 is all there is."""
    g = nx.DiGraph()
    link(g, "gpu0", "gpu1", 25 * GB)
    link(g, "gpu0", "pcie", 12 * GB)
    link(g, "gpu1", "pcie", 12 * GB)
    ranks = ["gpu0", "gpu1"]
    assert cut_bound_graph(g, ranks).bandwidth_out == 37 * GB
    tb = bounds.transfer_bound_graph(g, ranks)
    assert tb.bandwidth == pytest.approx(50 * GB, rel=1e-9)          # 25 GB/s each way
    for collective in ("allgather", "reduce_scatter", "allreduce"):
        t = bandwidth_bound_graph(g, ranks, collective, N)
        assert busbw(collective, N, t, 2) == pytest.approx(25 * GB, rel=1e-9)
    # without the direct link the switch carries it all, and the bound is the switch's
    g.remove_edges_from([("gpu0", "gpu1"), ("gpu1", "gpu0")])
    assert bounds.transfer_bound_graph(g, ranks).seconds_per_byte == 0.0
    assert busbw("allreduce", N, bandwidth_bound_graph(g, ranks, "allreduce", N), 2) == pytest.approx(12 * GB)


def test_dgx1_with_pcie_bound_is_156():
    """NVLink alone: 150 GB/s of allreduce bus bandwidth. Each GPU's 12 GB/s of PCIe would make 162,
    but only hops between GPUs without NVLink use PCIe, and two GPUs share each switch's 12 GB/s
    uplink: 8 x 150 + 4 x 12 GB/s of transfers, 156 per GPU."""
    from ddl.topology import Topology

    topo = Topology.load("topologies/dgx1-v100.yaml")
    assert 2 * 7 / 8 / bounds.allreduce_bound(topo).seconds_per_byte == pytest.approx(162 * GB)
    assert bounds.transfer_bound(topo).bandwidth == pytest.approx((8 * 150 + 4 * 12) * GB, rel=1e-9)
    assert busbw("allreduce", N, bandwidth_bound(topo, "allreduce", N), 8) == pytest.approx(156 * GB, rel=1e-9)
    assert busbw("allgather", N, bandwidth_bound(topo, "allgather", N), 8) == pytest.approx(156 * GB, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.randoms(use_true_random=False))
def test_transfer_bound_never_exceeds_the_tree_packing_optimum(rng):
    """Tree packing's LP is exact over every tree whose edges take the routes transports take, so
    it bounds the transfer bound from above on every fabric, direct links and switches mixed."""
    from ddl.algorithms.tree_packing import tree_packing
    from ddl.topology import Topology

    p = rng.randint(2, 5)
    nsw = rng.randint(1, 3)
    links = [{"a": f"s{i}", "b": f"s{rng.randrange(i)}", "bandwidth": rng.choice([4, 10, 25]) * GB}
             for i in range(1, nsw)]
    for r in range(p):
        links.append({"a": f"g{r}", "b": f"s{rng.randrange(nsw)}", "bandwidth": rng.choice([4, 10, 25]) * GB})
        links += [{"a": f"g{r}", "b": f"g{q}", "bandwidth": rng.choice([4, 10, 25]) * GB}
                  for q in range(r) if rng.random() < 0.5]
    topo = Topology.from_dict({"name": "mixed",
                               "nodes": [{"id": f"s{i}", "kind": "switch"} for i in range(nsw)]
                               + [{"id": f"g{r}", "kind": "gpu"} for r in range(p)],
                               "links": links, "ranks": [f"g{r}" for r in range(p)]})
    lp = tree_packing(topo, "allgather", nbytes=N).info["seconds_per_byte"]
    assert bounds.transfer_bound(topo).seconds_per_byte <= lp * (1 + 1e-6)
    assert bandwidth_bound(topo, "allgather", N) <= lp * N * (1 + 1e-6)
