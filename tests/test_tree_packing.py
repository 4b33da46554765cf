"""Tests of the tree-packing planner: the LP reaches ForestColl's cut bound on the known answers the
zoo files state, its schedules are correct (symbolic verifier), load the links exactly as planned, and
simulate at the bound where the trees are direct (depth 1)."""

import importlib

import networkx as nx
import numpy as np
import pytest

from ddl.algorithms import arborescence as arb
from ddl.algorithms.arborescence import min_arborescence, pack_arborescences
from ddl.algorithms.tree_packing import tree_packing
from ddl.algorithms.variants import MIN_VARIANT_GAIN, replaces
from ddl.bounds import bandwidth_bound, cut_bound, cut_bound_graph, lower_bound
from ddl.errors import PlanError
from ddl.simulate import Outpaced, simulate
from ddl.topology import Topology
from ddl.verify import verify
from test_bounds import DGX1_DOUBLE, DGX1_SINGLE
from test_bounds import dgx1 as dgx1_nvlink

# the module, not the function of the same name that ddl.algorithms exports
tp = importlib.import_module("ddl.algorithms.tree_packing")

GB = 1e9
N = 256 << 20


# ---------------------------------------------------------------------------------------------------
# builders


def link(g, a, b, capacity):
    g.add_edge(a, b, capacity=capacity)
    g.add_edge(b, a, capacity=capacity)


def star(p, bandwidth=10 * GB, kind="gpu"):
    nodes = [{"id": "sw", "kind": "switch"}] + [{"id": f"r{i}", "kind": kind} for i in range(p)]
    links = [{"a": f"r{i}", "b": "sw", "bandwidth": bandwidth} for i in range(p)]
    return Topology(f"star{p}", nodes, links, [f"r{i}" for i in range(p)])


def fat_tree(r, interleaved=True):
    """4 leaves x 4 ranks, 4 GB/s rank links, leaf uplinks 16/r GB/s; rank 4k+l on leaf l if interleaved."""
    nodes = ([{"id": "spine", "kind": "switch"}] + [{"id": f"leaf{l}", "kind": "switch"} for l in range(4)]
             + [{"id": f"l{l}n{k}", "kind": "gpu"} for l in range(4) for k in range(4)])
    links = ([{"a": f"l{l}n{k}", "b": f"leaf{l}", "bandwidth": 4 * GB} for l in range(4) for k in range(4)]
             + [{"a": f"leaf{l}", "b": "spine", "bandwidth": 16 * GB / r} for l in range(4)])
    order = ([(l, k) for k in range(4) for l in range(4)] if interleaved
             else [(l, k) for l in range(4) for k in range(4)])
    return Topology(f"fat-tree-r{r}", nodes, links, [f"l{l}n{k}" for l, k in order])


def two_hosts():
    """2 hosts x 2 GPUs: fast GPU pairs, a slow NIC link between hosts (symmetric, with transit)."""
    nodes = [{"id": "sw", "kind": "switch"}] + [{"id": f"h{h}", "kind": "host"} for h in range(2)] + [
        {"id": f"h{h}/gpu{g}", "kind": "gpu"} for h in range(2) for g in range(2)]
    links = ([{"a": f"h{h}/gpu0", "b": f"h{h}/gpu1", "bandwidth": 50 * GB} for h in range(2)]
             + [{"a": f"h{h}/gpu{g}", "b": f"h{h}", "bandwidth": 16 * GB} for h in range(2) for g in range(2)]
             + [{"a": f"h{h}", "b": "sw", "bandwidth": 12.5 * GB} for h in range(2)])
    return Topology("two-hosts", nodes, links, [f"h{h}/gpu{g}" for h in range(2) for g in range(2)])


def asymmetric():
    """A directed ring with uneven capacities plus a slow switch: reduce-scatter != allgather trees."""
    nodes = [{"id": "sw", "kind": "switch"}] + [{"id": f"g{i}", "kind": "gpu"} for i in range(4)]
    links = ([{"a": f"g{i}", "b": f"g{(i + 1) % 4}", "bandwidth": (10 + 5 * i) * GB, "directed": True}
              for i in range(4)]
             + [{"a": f"g{i}", "b": "sw", "bandwidth": 2 * GB} for i in range(4)])
    return Topology("asym", nodes, links, [f"g{i}" for i in range(4)])


def allgather_rate(graph, ranks):
    """LP optimum as allgather algorithm bandwidth N / T (bytes/s)."""
    pk = pack_arborescences(graph, ranks)
    return len(ranks) / pk.seconds_per_byte, pk


# ---------------------------------------------------------------------------------------------------
# Edmonds


def test_min_arborescence_matches_networkx():
    rng = np.random.default_rng(1)
    for trial in range(150):
        n = int(rng.integers(2, 10))
        cost = rng.integers(1, 9, size=(n, n)).astype(float)
        if trial % 2:
            cost[rng.random((n, n)) < 0.3] = np.inf
        root = int(rng.integers(n))
        g = nx.DiGraph()
        g.add_nodes_from(range(n))
        g.add_weighted_edges_from((u, v, cost[u, v]) for u in range(n) for v in range(n)
                                  if u != v and v != root and np.isfinite(cost[u, v]))
        try:
            ref = nx.minimum_spanning_arborescence(g).size(weight="weight")
        except nx.NetworkXException:
            ref = None
        try:
            parent = min_arborescence(cost, root)
        except ValueError:
            assert ref is None
            continue
        assert ref is not None
        assert parent[root] == -1
        for v in range(n):            # a tree: every rank reaches the root
            w, steps = v, 0
            while w != root:
                w, steps = parent[w], steps + 1
                assert steps <= n
        assert sum(cost[parent[v], v] for v in range(n) if v != root) == pytest.approx(ref)


# ---------------------------------------------------------------------------------------------------
# the LP reaches the cut bound (known answers)


@pytest.mark.parametrize("p", range(2, 9))
def test_uniform_star_reaches_bound(p):
    topo = star(p)
    rate, pk = allgather_rate(topo.usable_graph(), topo.ranks)
    assert rate == pytest.approx(cut_bound(topo).algbw, rel=1e-6)
    assert rate == pytest.approx(p / (p - 1) * 10 * GB, rel=1e-6)      # (p-1)/p N/B
    assert pk.lower_bound == pytest.approx(pk.seconds_per_byte, rel=1e-6, abs=0)


@pytest.mark.parametrize("members, busbw", [(range(8), 150), ([0, 1, 4, 5], 75), ([0, 4, 6, 7], 50),
                                            ([0, 1, 2, 3, 7], 25)])
def test_dgx1_nvlink_allreduce_busbw(members, busbw):
    g, ranks = dgx1_nvlink(members)
    rate, pk = allgather_rate(g, ranks)
    p = len(ranks)
    assert rate == pytest.approx(cut_bound_graph(g, ranks).algbw, rel=1e-6)
    # allreduce = reduce-scatter + allgather on a full-duplex fabric: twice the allgather time
    assert rate / 2 * 2 * (p - 1) / p == pytest.approx(busbw * GB, rel=1e-6)
    # a basic LP solution: at most one tree per tight (link, level) row plus one per root
    depth = max(t.depth for trees in pk.trees for t in trees)
    assert sum(len(t) for t in pk.trees) <= g.number_of_edges() * (depth + 1) + p
    shallow = pack_arborescences(g, ranks, shallow="depth")
    assert shallow.seconds_per_byte == pytest.approx(pk.seconds_per_byte, rel=1e-6, abs=0)
    assert sum(len(t) for t in shallow.trees) <= g.number_of_edges() + p


@pytest.mark.parametrize("r", [1, 4])
def test_fat_tree_interleaved_loses_nothing(r):
    topo = fat_tree(r)
    sched = tree_packing(topo, "allgather", nbytes=N)
    algbw = 1 / sched.info["seconds_per_byte"]
    assert algbw == pytest.approx(64 / 15 * GB, rel=1e-6)                 # 4.27 GB/s
    assert algbw == pytest.approx(cut_bound(topo).algbw, rel=1e-6)


@pytest.mark.parametrize("name", ["dgx1-v100", "fat-tree-4x4-r8", "emulated-2rack", "dgx-a100"])
def test_zoo_lp_reaches_the_bound(name):
    """ForestColl's cut bound, or on the DGX-1, where NVLinked GPUs never exchange through their PCIe
    switch, the transfer bound that knows it (156 GB/s of bus bandwidth, not the cut's 162)."""
    topo = Topology.load(f"topologies/{name}.yaml")
    sched = tree_packing(topo, "allgather", nbytes=N)
    bound = bandwidth_bound(topo, "allgather", N) / N
    assert sched.info["seconds_per_byte"] == pytest.approx(bound, rel=1e-6, abs=0)
    cut = cut_bound(topo).seconds_per_byte
    assert (bound > cut * 1.03) == (name == "dgx1-v100")


def test_broadcast_reaches_rooted_min_cut():
    for topo in (star(6), two_hosts(), fat_tree(8)):
        for root in (0, topo.nranks - 1):
            pk = tp._forest(topo, "bcast", root)
            bound = bandwidth_bound(topo, "broadcast", 1, root=root)
            assert pk.seconds_per_byte == pytest.approx(bound, rel=1e-6, abs=0)


def test_asymmetric_fabric_packs_each_direction():
    topo = asymmetric()
    out, inward = tp._forest(topo, "out"), tp._forest(topo, "in")
    assert out.seconds_per_byte / 4 == pytest.approx(cut_bound(topo).seconds_per_byte, rel=1e-6, abs=0)
    assert inward.seconds_per_byte / 4 == pytest.approx(cut_bound(topo, reverse=True).seconds_per_byte, rel=1e-6, abs=0)


def test_symmetry_classes():
    assert arb.rank_symmetries(star(5).usable_graph(), star(5).ranks)[4][0] == 0
    g, ranks = dgx1_nvlink([0, 1, 4, 5])            # a 4-cycle 0-1-5-4 with one slow edge 1-5
    sym = arb.rank_symmetries(g, ranks)
    assert {s for s, _ in sym.values()} == {0, 1}
    s, g_map = sym[2]                                # rank 2 is GPU 4, the mirror image of GPU 0
    assert s == 0 and g_map[0] == 4 and g_map[1] == 5


# ---------------------------------------------------------------------------------------------------
# schedules


TOPOS = {"star5": lambda: star(5), "two-hosts": two_hosts, "fat-tree-r8": lambda: fat_tree(8),
         "asym": asymmetric, "dgx1": lambda: Topology.load("topologies/dgx1-v100.yaml"),
         "2rack": lambda: Topology.load("topologies/emulated-2rack-interleaved.yaml")}


@pytest.mark.parametrize("name", sorted(TOPOS))
@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter", "allreduce", "broadcast"])
@pytest.mark.parametrize("nbytes", [1 << 16, N])
def test_schedules_verify(name, collective, nbytes):
    topo = TOPOS[name]()
    if name == "dgx1" and collective in ("allreduce", "reduce_scatter") and nbytes == N:
        nbytes = 16 << 20          # keep the verifier fast; pipelining still on
    root = topo.nranks - 1 if collective == "broadcast" else 0
    sched = tree_packing(topo, collective, root=root, nbytes=nbytes)
    verify(sched)
    assert sched.algorithm == "tree-packing"
    for (u, v), paths in sched.routes.items():
        assert sum(share for _, share in paths) == pytest.approx(1.0)
        for path, _ in paths:
            assert path[0] == topo.ranks[u] and path[-1] == topo.ranks[v]
            assert all(topo.capacity(a, b) > 0 for a, b in zip(path, path[1:]))
            assert all(topo.is_transit(x) for x in path[1:-1])


def test_fat_tree_r4_allreduce_verifies(monkeypatch):
    monkeypatch.setattr(tp, "MAX_PLAN_TRANSFERS", 1 << 17)
    verify(tree_packing(fat_tree(4), "allreduce", nbytes=1 << 16))


def test_too_fine_grained_packing_declines():
    """69 pieces per block on the r=4 fat tree: 33120 transfers, over the limit; the planner then
    uses the other algorithms (a ring is optimal there)."""
    with pytest.raises(PlanError, match=r"69 pieces, 33120 transfers before pipelining \(limit 32768\)"):
        tree_packing(fat_tree(4), "allreduce", nbytes=1 << 16)


def test_pipelining_follows_nbytes():
    topo = fat_tree(8)
    small = tree_packing(topo, "allgather", nbytes=1 << 16)
    big = tree_packing(topo, "allgather", nbytes=N)
    assert len(big.pattern) > len(small.pattern) == small.info["pieces"]


def test_deterministic():
    topo = fat_tree(8)
    first = tree_packing(topo, "allreduce", nbytes=N).to_json()
    tp._forest.cache_clear()
    assert tree_packing(topo, "allreduce", nbytes=N).to_json() == first


def test_deterministic_across_processes():
    """Hash randomisation must not leak into the plan (set orders, VF2's search order)."""
    import os
    import subprocess
    import sys

    code = ("import hashlib; from ddl.topology import Topology; from ddl.algorithms.tree_packing import tree_packing;"
            "t = Topology.load('topologies/fat-tree-4x4-r8.yaml');"
            "print(hashlib.sha256(tree_packing(t, 'allreduce', nbytes=1 << 24).to_json().encode()).hexdigest())")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(out) == 1


def test_single_rank_and_errors():
    one = Topology("one", [{"id": "g", "kind": "gpu"}], [], ["g"])
    verify(tree_packing(one, "allreduce"))
    with pytest.raises(PlanError, match="collective"):
        tree_packing(star(3), "alltoall")
    with pytest.raises(PlanError, match="root"):
        tree_packing(star(3), "broadcast", root=3)
    with pytest.raises(PlanError, match="64 ranks"):
        tree_packing(star(65), "allgather")


# ---------------------------------------------------------------------------------------------------
# the simulator sees the planned loads


@pytest.mark.parametrize("name", ["two-hosts", "fat-tree-r8", "2rack", "asym"])
def test_links_loaded_as_planned(name):
    """Pinned routes make the simulator load every link exactly as the LP did: the busiest link's
    busy time is the cut bound (up to the weight rounding)."""
    from ddl.simulate import simulate

    topo = TOPOS[name]()
    sched = tree_packing(topo, "allgather", nbytes=1 << 16)
    sim = simulate(topo, sched, N)
    busiest = max(b / topo.capacity(u, v) for (u, v), b in sim.link_bytes.items())
    bound = bandwidth_bound(topo, "allgather", N)
    assert bound <= busiest * (1 + 1e-9)
    assert busiest <= bound * (1 + tp.ROUNDING_SLACK + 1e-9)


@pytest.mark.parametrize("topo", [star(8), fat_tree(1), Topology.load("topologies/dgx-a100.yaml")],
                         ids=["star8", "fat-tree-r1", "dgx-a100"])
@pytest.mark.parametrize("collective", ["allgather", "allreduce"])
def test_simulated_at_bound_with_direct_trees(topo, collective):
    from ddl.simulate import simulate

    sched = tree_packing(topo, collective, nbytes=N)
    ratio = simulate(topo, sched, N).seconds / lower_bound(topo, collective, N).seconds
    assert 1 - 1e-9 <= ratio <= 1.02


# ---------------------------------------------------------------------------------------------------
# direct-link-trees: the same packing over rank-to-rank links only (Blink's NVLink-only trees)


def test_direct_link_trees_use_nvlink_only_on_the_dgx1():
    from ddl.simulate import simulate

    topo = Topology.load("topologies/dgx1-v100.yaml")
    graph, why_not = tp.direct_links(topo)
    assert why_not is None
    assert graph.number_of_edges() == 2 * (len(DGX1_DOUBLE) + len(DGX1_SINGLE))
    sched = tp.direct_link_trees(topo, "allreduce", nbytes=N)
    assert sched.algorithm == "direct-link-trees"
    # the NVLink optimum (150 GB/s bus bandwidth), not the 156 GB/s that PCIe and QPI add between
    # GPUs without NVLink (the full packing reaches the bound: GPUs with NVLink exchange over it alone)
    assert 2 * 7 / 8 / sched.info["seconds_per_byte"] == pytest.approx(150 * GB, rel=1e-3)
    ranks = set(topo.ranks)
    assert all(len(path) == 2 and set(path) <= ranks for routes in sched.routes.values() for path, _ in routes)
    full = tree_packing(topo, "allreduce", nbytes=N)
    assert 2 * 7 / 8 / full.info["seconds_per_byte"] == pytest.approx(156 * GB, rel=1e-3)
    assert full.info["seconds_per_byte"] * N == pytest.approx(lower_bound(topo, "allreduce", N).seconds, rel=1e-3)
    assert sum(sched.info["trees"]) < sum(full.info["trees"]) / 4
    # fewer trees lose less to links shared fairly among them: faster although the LP is slower
    seconds = simulate(topo, sched, N).seconds
    assert seconds < simulate(topo, full, N).seconds
    assert seconds < 1.13 * lower_bound(topo, "allreduce", N).seconds
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
        verify(tp.direct_link_trees(topo, collective, root=5, nbytes=8 << 20))


def test_direct_link_trees_decline_without_a_sub_fabric():
    with pytest.raises(PlanError, match="not all joined by links from rank to rank"):
        tp.direct_link_trees(Topology.load("topologies/dgx-a100.yaml"), "allreduce", nbytes=N)
    mesh = Topology("mesh3", [{"id": f"g{i}", "kind": "gpu"} for i in range(3)],
                    [{"a": f"g{i}", "b": f"g{j}", "bandwidth": 10 * GB} for i in range(3) for j in range(i)],
                    [f"g{i}" for i in range(3)])
    with pytest.raises(PlanError, match="would repeat tree-packing"):
        tp.direct_link_trees(mesh, "allreduce", nbytes=N)


@pytest.mark.parametrize("make", [asymmetric, lambda: star(5)])
def test_the_planners_time_to_beat_changes_no_choice(make):
    """Told the time the planner's fastest candidate takes (``beat``), tree-packing stops simulating
    its pipelines once they provably cannot win. Where the packing can win, it returns the schedule it
    returns without ``beat`` (deeper on the asymmetric ring, where it earns its messages, the shallow
    one on the star); where it cannot, one whose simulation stopped, with a bound that is above
    ``beat`` and no more than the time the schedule chosen without ``beat`` takes."""
    topo = make()
    full = tree_packing(topo, "allreduce", nbytes=N)
    t = simulate(topo, full, N).seconds
    for beat in (0.5 * t, 0.999 * t, t, 1.001 * t, 2 * t):
        sched = tree_packing(topo, "allreduce", nbytes=N, beat=beat)
        verify(sched)
        if t <= beat:
            assert (sched.info["pipeline"], sched.nops) == (full.info["pipeline"], full.nops), beat
            assert simulate(topo, sched, N, ceiling=lambda: beat).seconds == t
        else:
            with pytest.raises(Outpaced) as stopped:
                simulate(topo, sched, N, ceiling=lambda: beat)
            assert beat < stopped.value.at_least <= t * (1 + 1e-9), beat
        for tried in sched.info["pipelines_tried"]:   # each run out, or stopped above the time it had to beat
            assert tried["seconds"] is not None or tried["at_least"] > min(beat, (1 - MIN_VARIANT_GAIN) * t)


def test_deeper_pipeline_kept_only_where_it_earns_its_messages():
    """Beside the sub-chunks its step-length rule gives (8 here), tree-packing simulates as many more
    per tree as keep each step MIN_STEP_SECONDS long, and keeps them only where they are predicted
    1% faster: more messages, which the simulator does not charge for. Where the fabric is not
    symmetric a shallow pipeline fills and drains for a step at each end (deeper: 1.1% faster); on a
    star every rank reaches every other in one hop and depth gains nothing."""
    for topo, deeper in ((asymmetric(), True), (star(5), False)):
        sched = tree_packing(topo, "allreduce", nbytes=N)
        tried = sched.info["pipelines_tried"]
        steps = min(tp.MAX_PIPELINE, int(sched.info["seconds_per_byte"] * N / tp.MIN_STEP_SECONDS))
        assert [t["pipeline"] for t in tried] == [tp.MIN_PIPELINE, steps] and steps > tp.MIN_PIPELINE
        assert tried[0]["operations"] < tried[1]["operations"]
        wins = replaces(tried[1]["seconds"], tried[1]["operations"], tried[0]["seconds"], tried[0]["operations"])
        assert wins == deeper
        kept = tried[1] if deeper else tried[0]
        assert (sched.info["pipeline"], sched.nops) == (kept["pipeline"], kept["operations"])
        assert simulate(topo, sched, N).seconds == kept["seconds"]
        verify(sched)
    assert "pipelines_tried" not in tree_packing(asymmetric(), "allreduce").info   # no size: nothing simulated
    # steps shorter than MIN_STEP_SECONDS (the DGX-1's NVLinks: 0.4 ms at 8 per tree): nothing tried
    dgx1 = tree_packing(Topology.load("topologies/dgx1-v100.yaml"), "allreduce", nbytes=N)
    assert dgx1.info["seconds_per_byte"] * N / tp.MIN_PIPELINE < tp.MIN_STEP_SECONDS
    assert "pipelines_tried" not in dgx1.info and dgx1.info["pipeline"] == tp.MIN_PIPELINE
