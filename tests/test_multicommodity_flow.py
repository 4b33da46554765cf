"""Multi-commodity-flow routing: the LP splits traffic over parallel paths, never harms, stays fast."""
import importlib
import math
import time

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from ddl.algorithms import ALGORITHMS, ring_schedule
from ddl.algorithms.multicommodity_flow import (multicommodity_flow, pair_demands, route_commodities,
                                                schedule_phases, solve_commodities)
from ddl.errors import PlanError
from ddl.schedule import Schedule
from ddl.topology import Topology
from ddl.verify import verify

mcf_module = importlib.import_module("ddl.algorithms.multicommodity_flow")

simulate = pytest.importorskip("ddl.simulate").simulate

GB = 1e9
MiB = 1 << 20


def two_paths():
    """Two hosts, each with two NICs: one on a 25 GB/s switch, one on a 12 GB/s rail of two switches."""
    return Topology.from_dict({
        "name": "two-paths",
        "nodes": [{"id": "g0", "kind": "cpu"}, {"id": "g1", "kind": "cpu"},
                  {"id": "fast", "kind": "switch"}, {"id": "sw", "kind": "switch"},
                  {"id": "sw2", "kind": "switch"}],
        "links": [{"a": "g0", "b": "fast", "bandwidth": "25 GB/s"},
                  {"a": "g1", "b": "fast", "bandwidth": "25 GB/s"},
                  {"a": "g0", "b": "sw", "bandwidth": "12 GB/s"},
                  {"a": "sw", "b": "sw2", "bandwidth": "12 GB/s"},
                  {"a": "g1", "b": "sw2", "bandwidth": "12 GB/s"}],
        "ranks": ["g0", "g1"]})


def nvlink_and_pcie():
    """Two GPUs: NVLink 25 GB/s direct, and a PCIe path of 12 GB/s through their PCIe switch."""
    return Topology.from_dict({
        "name": "nvlink-and-pcie",
        "nodes": [{"id": "g0", "kind": "gpu"}, {"id": "g1", "kind": "gpu"}, {"id": "sw", "kind": "pcie"}],
        "links": [{"a": "g0", "b": "g1", "bandwidth": "25 GB/s"},
                  {"a": "g0", "b": "sw", "bandwidth": "12 GB/s"},
                  {"a": "g1", "b": "sw", "bandwidth": "12 GB/s"}],
        "ranks": ["g0", "g1"]})


def leaf_spine(up0="4 GB/s", up1="2 GB/s", per_leaf=4, leaves=2):
    """``leaves`` leaves of ``per_leaf`` ranks (10 GB/s each), every leaf linked to spine0 at ``up0``
    and to spine1 at ``up1``; rank i sits on leaf i % leaves (interleaved)."""
    n = per_leaf * leaves
    return Topology.from_dict({
        "name": "leaf-spine",
        "nodes": [{"id": "spine{s}", "kind": "switch", "for": {"s": 2}},
                  {"id": "leaf{l}", "kind": "switch", "for": {"l": leaves}},
                  {"id": "n{i}", "kind": "cpu", "for": {"i": n}}],
        "links": [{"a": f"n{i}", "b": f"leaf{i % leaves}", "bandwidth": "10 GB/s"} for i in range(n)]
        + [{"a": "leaf{l}", "b": "spine0", "bandwidth": up0, "for": {"l": leaves}},
           {"a": "leaf{l}", "b": "spine1", "bandwidth": up1, "for": {"l": leaves}}],
        "ranks": [f"n{i}" for i in range(n)]})


def link_loads(demands, routes):
    load = {}
    for pair, b in demands.items():
        for path, share in routes[pair]:
            for e in zip(path[:-1], path[1:]):
                load[e] = load.get(e, 0.0) + b * share
    return load


def widest_time(topo, demands):
    """Bottleneck time of ``demands`` on the topology's own (widest, ECMP) routes."""
    load = {}
    for (s, d), b in demands.items():
        paths = topo.routes(s, d)
        for path in paths:
            for e in zip(path[:-1], path[1:]):
                load[e] = load.get(e, 0.0) + b / len(paths)
    return max(v / topo.capacity(*e) for e, v in load.items())


def check_routes(topo, demands, routing, rtol=1e-5):
    """Every path is a real, transit-only path; shares are positive and sum to 1 per pair; every
    source's path flows conserve; no link carries more than capacity * T."""
    graph = topo.usable_graph()
    assert set(routing.routes) == {p for p, b in demands.items() if b > 0 and p[0] != p[1]}
    for (s, d), paths in routing.routes.items():
        assert math.isclose(sum(w for _, w in paths), 1.0, rel_tol=1e-9)
        assert all(w >= mcf_module.MIN_SHARE for _, w in paths)
        assert len({p for p, _ in paths}) == len(paths)
        if graph.has_edge(topo.ranks[s], topo.ranks[d]):      # a direct link is used alone
            assert paths == (((topo.ranks[s], topo.ranks[d]), 1.0),)
        for path, _ in paths:
            assert path[0] == topo.ranks[s] and path[-1] == topo.ranks[d]
            assert len(set(path)) == len(path)
            assert all(topo.is_transit(v) for v in path[1:-1])
            assert all(graph.has_edge(u, v) for u, v in zip(path[:-1], path[1:]))
    # conservation per source: out - in = supply at the source, -demand at each destination, 0 elsewhere
    for s in {s for s, _ in routing.routes}:
        net = {}
        for (src, d), paths in routing.routes.items():
            if src != s:
                continue
            for path, w in paths:
                for u, v in zip(path[:-1], path[1:]):
                    net[u] = net.get(u, 0.0) + demands[(s, d)] * w
                    net[v] = net.get(v, 0.0) - demands[(s, d)] * w
        supply = sum(b for (src, _), b in demands.items() if src == s)
        for v, x in net.items():
            expect = supply if v == topo.ranks[s] else -demands.get((s, topo.ranks.index(v)), 0.0) \
                if v in topo.ranks else 0.0
            assert abs(x - expect) <= 1e-9 * supply
    for e, load in link_loads(demands, routing.routes).items():
        assert load <= topo.capacity(*e) * routing.seconds * (1 + rtol)


def reference_T(topo, demands):
    """The same LP written the plain way: one commodity per pair, every usable edge, no pruning."""
    graph = topo.usable_graph()
    edges = list(graph.edges())
    verts = list(graph.nodes)
    vi = {v: i for i, v in enumerate(verts)}
    pairs = sorted(demands)
    rank_vertices = set(topo.ranks)
    cols, rows_eq, vals_eq, b_eq, ub_rows, ub_cols = [], [], [], [], [], []
    for k, (s, d) in enumerate(pairs):
        vs, vd = topo.ranks[s], topo.ranks[d]
        usable = [i for i, (u, v) in enumerate(edges)
                  if (u == vs or u not in rank_vertices) and (v == vd or v not in rank_vertices)
                  and (v != vd or u == vs or not graph.has_edge(vs, vd))]    # a direct link alone
        base_row = k * len(verts)
        for i in usable:
            j = len(cols)
            cols.append((k, i))
            u, v = edges[i]
            rows_eq += [base_row + vi[u], base_row + vi[v]]
            vals_eq += [1.0, -1.0]
            ub_rows.append(i)
            ub_cols.append(j)
        rhs = np.zeros(len(verts))
        rhs[vi[vs]] = demands[(s, d)] / MiB
        rhs[vi[vd]] = -demands[(s, d)] / MiB
        b_eq.append(rhs)
    n = len(cols)
    a_eq = sp.csr_matrix((vals_eq, (rows_eq, [j for j in range(n) for _ in (0, 1)])),
                         shape=(len(pairs) * len(verts), n + 1))
    caps = np.array([graph[u][v]["capacity"] for u, v in edges]) / GB      # well-scaled for HiGHS
    a_ub = sp.csr_matrix((np.concatenate([np.ones(n), -caps]),
                          (np.concatenate([ub_rows, np.arange(len(edges))]),
                           np.concatenate([ub_cols, np.full(len(edges), n)]))), shape=(len(edges), n + 1))
    c = np.zeros(n + 1)
    c[-1] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(edges)), A_eq=a_eq, b_eq=np.concatenate(b_eq),
                  bounds=(0, None), method="highs")
    assert res.status == 0
    return res.fun * MiB / GB


# ---- (1) two disjoint paths of different capacity ----------------------------------------------------
def test_two_paths_split_by_capacity_and_simulated_time():
    topo = two_paths()
    nbytes = 256 * MiB
    routing = solve_commodities(topo, {(0, 1): nbytes})
    shares = dict(routing.routes[(0, 1)])
    assert shares[("g0", "fast", "g1")] == pytest.approx(25 / 37, rel=1e-5)      # T slack of 1e-6
    assert shares[("g0", "sw", "sw2", "g1")] == pytest.approx(12 / 37, rel=1e-5)
    assert routing.seconds == pytest.approx(nbytes / (37 * GB), rel=1e-6)
    assert routing.max_utilisation == pytest.approx(1.0, rel=1e-5)

    sched = multicommodity_flow(topo, "broadcast", nbytes=nbytes, bases=("ring",))
    assert sched.info["routing"] == "lp" and sched.info["split_pairs"] == 1
    widest = ALGORITHMS["ring"](topo, "broadcast", nbytes=nbytes)
    t_lp, t_widest = simulate(topo, sched, nbytes).seconds, simulate(topo, widest, nbytes).seconds
    assert t_lp == pytest.approx(nbytes / (37 * GB), abs=5e-6)       # + a couple of microseconds latency
    assert t_widest == pytest.approx(nbytes / (25 * GB), abs=5e-6)
    # whatever the base (tree packing too, when registered), the prediction is the two paths' sum
    auto = multicommodity_flow(topo, "broadcast", nbytes=nbytes)
    assert simulate(topo, auto, nbytes).seconds == pytest.approx(nbytes / (37 * GB), abs=5e-6)
    # a tiny message is latency-bound: the longer, slower rail would only add latency, so no split
    small = multicommodity_flow(topo, "broadcast", nbytes=64, bases=("ring",))
    assert small.info["routing"] == "base"
    assert simulate(topo, small, 64).seconds == pytest.approx(simulate(topo, widest, 64).seconds)


def test_direct_link_is_never_split():
    """A peer copy between GPUs joined by NVLink takes NVLink: the LP must not plan part of it through
    their PCIe switch (no transport could run that), and the fabric's own route is the link alone."""
    topo = nvlink_and_pcie()
    assert topo.routes(0, 1) == (("g0", "g1"),)
    nbytes = 256 * MiB
    routing = solve_commodities(topo, {(0, 1): nbytes, (1, 0): nbytes})
    assert routing.routes == {(0, 1): ((("g0", "g1"), 1.0),), (1, 0): ((("g1", "g0"), 1.0),)}
    assert routing.seconds == pytest.approx(nbytes / (25 * GB), rel=1e-6)
    sched = multicommodity_flow(topo, "allreduce", nbytes=nbytes)
    verify(sched)
    assert sched.info["routing"] == "base"
    used = {e for paths in sched.routes.values() for path, _ in paths for e in zip(path[:-1], path[1:])}
    assert used <= {("g0", "g1"), ("g1", "g0")}


# ---- (2) leaf-spine with two spines, interleaved ring ------------------------------------------------
@pytest.mark.parametrize("up0, up1", [("4 GB/s", "2 GB/s"), ("3 GB/s", "3 GB/s")])
def test_leaf_spine_interleaved_ring_balanced(up0, up1):
    topo = leaf_spine(up0, up1)
    p, nbytes = 8, 64 * MiB
    sched = ring_schedule(list(range(p)), "allreduce")      # rank i on leaf i % 2: every hop crosses
    demands = pair_demands(sched, nbytes)
    assert set(demands) == {(i, (i + 1) % p) for i in range(p)}
    hop = 2 * (p - 1) / p * nbytes                         # bytes per ring hop over the allreduce
    assert all(b == pytest.approx(hop) for b in demands.values())
    routing = solve_commodities(topo, demands)
    check_routes(topo, demands, routing)
    uplinks = float(up0.split()[0]) * GB + float(up1.split()[0]) * GB
    analytic = (p // 2) * hop / uplinks                    # p/2 hops leave each leaf over both spines
    assert routing.seconds == pytest.approx(analytic, rel=1e-6)
    assert routing.seconds <= widest_time(topo, demands) * (1 + 1e-9)
    load = link_loads(demands, routing.routes)
    spine_links = [(f"leaf{l}", f"spine{s}") for l in range(2) for s in range(2)] + \
                  [(f"spine{s}", f"leaf{l}") for l in range(2) for s in range(2)]
    for e in spine_links:                                  # every spine link exactly as busy as the others
        assert load[e] / topo.capacity(*e) == pytest.approx(analytic, rel=1e-5)
    if up0 != up1:
        assert routing.seconds < 0.7 * widest_time(topo, demands)   # widest routing ignores spine1
    else:
        assert routing.seconds == pytest.approx(widest_time(topo, demands), rel=1e-6)  # ECMP already


def test_leaf_spine_planner_uses_both_spines():
    topo = leaf_spine("4 GB/s", "2 GB/s", per_leaf=4, leaves=2)
    nbytes = 64 * MiB
    sched = multicommodity_flow(topo, "allreduce", nbytes=nbytes)
    verify(sched)
    base = ALGORITHMS[sched.info["base_algorithm"]](topo, "allreduce", nbytes=nbytes)
    t_mcf, t_base = simulate(topo, sched, nbytes).seconds, simulate(topo, base, nbytes).seconds
    assert sched.info["routing"] == "lp"
    assert t_mcf < 0.8 * t_base
    used = {e for paths in sched.routes.values() for path, _ in paths for e in zip(path[:-1], path[1:])}
    assert ("leaf0", "spine1") in used and ("leaf0", "spine0") in used


# ---- (3) random topologies: conservation, shares, optimality ----------------------------------------
@st.composite
def random_case(draw):
    nsw = draw(st.integers(1, 3))
    nr = draw(st.integers(2, 5))
    bw = st.sampled_from(["4 GB/s", "10 GB/s", "25 GB/s"])
    links = {}
    for i in range(1, nsw):
        links[(f"s{draw(st.integers(0, i - 1))}", f"s{i}")] = draw(bw)
    for i in range(nsw):
        for j in range(i + 1, nsw):
            if draw(st.booleans()):
                links[(f"s{i}", f"s{j}")] = draw(bw)
    for r in range(nr):
        home = draw(st.integers(0, nsw - 1))
        links[(f"r{r}", f"s{home}")] = draw(bw)
        for i in range(nsw):
            if i != home and draw(st.integers(0, 3)) == 0:
                links[(f"r{r}", f"s{i}")] = draw(bw)
        for q in range(r + 1, nr):
            if draw(st.integers(0, 3)) == 0:
                links[(f"r{r}", f"r{q}")] = draw(bw)
    topo = Topology.from_dict({
        "name": "random",
        "nodes": [{"id": f"s{i}", "kind": "switch"} for i in range(nsw)]
        + [{"id": f"r{r}", "kind": "gpu"} for r in range(nr)],
        "links": [{"a": a, "b": b, "bandwidth": w} for (a, b), w in links.items()],
        "ranks": [f"r{r}" for r in range(nr)]})
    pairs = [(s, d) for s in range(nr) for d in range(nr) if s != d]
    chosen = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=len(pairs), unique=True))
    demands = {pair: float(draw(st.integers(1, 8))) * MiB for pair in chosen}
    return topo, demands


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_case())
def test_random_topologies_conserve_flow_and_are_optimal(case):
    topo, demands = case
    routing = solve_commodities(topo, demands)
    check_routes(topo, demands, routing)
    # no worse than the widest-path routes, and the same optimum as the plain per-pair LP
    assert routing.seconds <= widest_time(topo, demands) * (1 + 1e-7)
    assert routing.seconds == pytest.approx(reference_T(topo, demands), rel=1e-6)
    assert route_commodities(topo, demands) == routing.routes          # cached, deterministic


def test_phases_are_weighted_sum_of_per_phase_times():
    topo = leaf_spine("4 GB/s", "2 GB/s")
    a, b = {(0, 1): 6.0 * GB}, {(2, 3): 6.0 * GB, (4, 5): 6.0 * GB}
    routing = solve_commodities(topo, phases=[(1.0, a), (2.0, b)])
    # phase a: one flow over both spines (6 GB/s); phase b: two flows over the same 6 GB/s
    assert routing.seconds == pytest.approx(1.0 * 6 / 6 + 2.0 * 12 / 6, rel=1e-6)
    with pytest.raises(PlanError):
        solve_commodities(topo, {(0, 9): 1.0})
    with pytest.raises(PlanError):
        solve_commodities(topo)


def test_lp_failure_is_a_plan_error(monkeypatch):
    class Failed:
        status, x, message, fun = 2, None, "The problem is infeasible. (HiGHS Status 8)", None
    monkeypatch.setattr(mcf_module, "linprog", lambda *a, **k: Failed())
    mcf_module._ROUTE_CACHE.clear()
    with pytest.raises(PlanError, match="routing LP failed.*infeasible"):
        solve_commodities(two_paths(), {(1, 0): 3.0})


# ---- (4) the schedule: base programs, verified, routes for every pair -------------------------------
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_schedule_verifies_and_keeps_base_programs(collective):
    topo = Topology.load("topologies/dgx1-v100.yaml")
    nbytes = 64 * MiB
    sched = multicommodity_flow(topo, collective, root=3, nbytes=nbytes)
    verify(sched)
    assert sched.algorithm == "multicommodity-flow"
    base = ALGORITHMS[sched.info["base_algorithm"]](topo, collective, root=3, nbytes=nbytes)
    assert (sched.programs, sched.pattern, sched.root) == (base.programs, base.pattern, base.root)
    assert set(sched.routes) == set(pair_demands(base))
    again = Schedule.from_json(sched.to_json())
    assert again.routes == sched.routes and again.info == sched.info
    assert multicommodity_flow(topo, collective, root=3, nbytes=nbytes) is sched      # cached
    for key in ("lp_T", "base_T", "max_link_utilisation", "mean_link_utilisation", "phases"):
        assert key in sched.info


def test_single_path_topology_equals_base_prediction():
    topo = Topology.load("topologies/fat-tree-4x4-r4.yaml")
    for collective, nbytes in [("allreduce", 64 * MiB), ("broadcast", 8 * MiB), ("allgather", 1 << 12)]:
        sched = multicommodity_flow(topo, collective, nbytes=nbytes, bases=("ring", "hierarchical"))
        base = ALGORITHMS[sched.info["base_algorithm"]](topo, collective, nbytes=nbytes)
        assert sched.info["routing"] == "base"
        assert simulate(topo, sched, nbytes).seconds == pytest.approx(simulate(topo, base, nbytes).seconds,
                                                                      rel=1e-12)


# ---- (5) DGX-1: NVLink and PCIe together -------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [4 << 10, 256 * MiB])
def test_dgx1_ring_hops_stay_on_nvlink(nbytes):
    topo = Topology.load("topologies/dgx1-v100.yaml")
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=nbytes)
    t_ring = simulate(topo, ring, nbytes).seconds
    auto = multicommodity_flow(topo, "allreduce", nbytes=nbytes)          # best base, routed
    assert simulate(topo, auto, nbytes).seconds <= t_ring * (1 + 1e-9)
    sched = multicommodity_flow(topo, "allreduce", nbytes=nbytes, bases=("ring",))   # the ring's hops
    assert sched.programs == ring.programs
    t_mcf = simulate(topo, sched, nbytes).seconds
    assert t_mcf <= t_ring * (1 + 1e-9)
    # every hop of the ring joins GPUs linked by NVLink: a transport takes NVLink between them, so
    # the LP may not send part of a hop through their PCIe switch (62 GB/s per hop on paper)
    graph = topo.usable_graph()
    assert all(graph.has_edge(topo.ranks[a], topo.ranks[b]) for a, b in sched.routes)
    assert sched.info["routing"] == "base"
    assert all(paths == (((topo.ranks[a], topo.ranks[b]), 1.0),) for (a, b), paths in sched.routes.items())
    assert t_mcf == pytest.approx(t_ring, rel=1e-12)


# ---- size: 192 ranks ---------------------------------------------------------------------------------
def test_192_ranks_in_seconds():
    topo = Topology.load("topologies/ibm-3tier-192.yaml")
    ring = ALGORITHMS["ring"](topo, "allreduce")
    demands = pair_demands(ring, 256 * MiB)
    start = time.perf_counter()
    routing = solve_commodities(topo, demands)
    assert time.perf_counter() - start < 5
    assert routing.seconds == pytest.approx(widest_time(topo, demands), rel=1e-6)   # a tree: one path
    hier = ALGORITHMS["hierarchical"](topo, "allreduce")
    phases = schedule_phases(hier)
    assert len(phases) > 1                                  # stages follow one another
    start = time.perf_counter()
    phased = solve_commodities(topo, phases=phases)
    assert time.perf_counter() - start < 5
    check_routes(topo, pair_demands(hier), phased._replace(seconds=math.inf))
    start = time.perf_counter()
    sched = multicommodity_flow(topo, "broadcast", nbytes=256 * MiB)
    assert time.perf_counter() - start < 15
    assert sched.info["routing"] == "base"
