"""The topology zoo (topologies/*.yaml): every file loads, and each models what its comment says."""
import math
from pathlib import Path

import pytest

from ddl.topology import Topology

ZOO = Path(__file__).resolve().parent.parent / "topologies"
FILES = sorted(ZOO.glob("*.yaml"))

# file stem -> (ranks, hosts)
EXPECTED = {
    "dgx1-v100": (8, 1),
    "dgx-a100": (8, 1),
    "dgx-a100-2x8": (16, 2),
    "dgx-a100-4x8": (32, 4),
    "dgx-h100": (8, 1),
    "leaf-spine-2rack": (32, 8),
    "fat-tree-4x4-r1": (16, 0),
    "fat-tree-4x4-r4": (16, 0),
    "fat-tree-4x4-r8": (16, 0),
    "fat-tree-4x4-r16": (16, 0),
    "fat-tree-4x4-r4-interleaved": (16, 0),
    "ibm-3tier-192": (192, 48),
    "ibm-3tier-fragment": (40, 10),
    "hetero-cluster": (32, 6),
    "emulated-2rack": (8, 4),
    "emulated-2rack-interleaved": (8, 4),
    "emulated-flat": (8, 4),
}

GB = 1e9


def load(stem):
    return Topology.load(ZOO / f"{stem}.yaml")


def test_zoo_is_complete():
    assert {f.stem for f in FILES} == set(EXPECTED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_loads_with_counts_and_a_cited_header(path):
    topo = Topology.load(path)
    ranks, hosts = EXPECTED[path.stem]
    assert topo.nranks == ranks
    assert len(topo.hosts) == hosts
    assert topo.name == path.stem
    assert all(topo.kind(v) in ("gpu", "cpu") for v in topo.ranks)
    # every rank reaches every other
    assert all(topo.route_bandwidth(0, j) > 0 for j in range(1, topo.nranks))
    # the file opens with a comment block saying where its numbers come from
    head = path.read_text().split("\nname:")[0]
    assert head.startswith("#") and len(head.splitlines()) >= 5
    # the explicit form loads back equal
    assert Topology.from_dict(topo.to_dict()) == topo


def _tiers(topo):
    return [(t.bandwidth, t.groups) for t in topo.tiers]


def _leaf_groups():
    return tuple(tuple(range(4 * l, 4 * l + 4)) for l in range(4))


@pytest.mark.parametrize("r", [1, 4])
def test_fat_tree_without_oversubscription_is_one_tier(r):
    assert _tiers(load(f"fat-tree-4x4-r{r}")) == [(4 * GB, (tuple(range(16)),))]


@pytest.mark.parametrize("r", [8, 16])
def test_fat_tree_oversubscribed_has_leaf_tier(r):
    assert _tiers(load(f"fat-tree-4x4-r{r}")) == [(4 * GB, _leaf_groups()),
                                                  (16 / r * GB, (tuple(range(16)),))]


def test_fat_tree_rank_placement():
    contiguous, interleaved = load("fat-tree-4x4-r4"), load("fat-tree-4x4-r4-interleaved")
    assert contiguous.routes(0, 1) == (("l0n0", "leaf0", "l0n1"),)
    assert interleaved.ranks[:5] == ("l0n0", "l1n0", "l2n0", "l3n0", "l0n1")
    assert interleaved.routes(0, 1) == (("l0n0", "leaf0", "spine", "leaf1", "l1n0"),)
    assert interleaved.routes(0, 4) == (("l0n0", "leaf0", "l0n1"),)
    # same fabric, other rank order
    assert set(interleaved.ranks) == set(contiguous.ranks)
    assert set(interleaved.links) == set(contiguous.links)
    assert sorted(interleaved.nodes) == sorted(contiguous.nodes)


def test_ibm_three_tiers():
    topo = load("ibm-3tier-192")
    tiers = topo.tiers
    assert [t.bandwidth for t in tiers] == [80 * GB, 12.5 * GB, 6.25 * GB]
    assert tiers[0].groups == tuple(tuple(range(4 * h, 4 * h + 4)) for h in range(48))
    assert tiers[1].groups == tuple(tuple(range(64 * r, 64 * r + 64)) for r in range(3))
    assert tiers[2].groups == (tuple(range(192)),)
    assert all(len(members) == 4 for members in topo.hosts.values())
    assert topo.host_of(5) == "r0/h1" and topo.host_of(191) == "r2/h15"


def test_ibm_fragment_plans_equal_rack_shares():
    # racks of 16, 16 and 8 ranks: auto's allreduce gives every rack an equal share of the buffer, so
    # the three uplinks carry the same bytes, and comes within 2% of the bound
    from ddl.planner import Planner

    topo = load("ibm-3tier-fragment")
    tiers = topo.tiers
    assert [sorted(len(g) for g in t.groups) for t in tiers] == [[4] * 10, [8, 16, 16], [40]]
    plan = Planner(topo, use_disk_cache=False).plan("allreduce", 256 << 20)
    assert plan.algorithm == "hierarchical" and plan.schedule.info["balanced"]
    assert plan.gap <= 1.02


def test_emulated_two_racks():
    topo = load("emulated-2rack")
    assert topo.ranks == tuple(f"h{h}/cpu{c}" for h in range(4) for c in range(2))
    assert topo.hosts == {"h0": (0, 1), "h1": (2, 3), "h2": (4, 5), "h3": (6, 7)}
    assert _tiers(topo) == [
        (5 * GB, ((0, 1), (2, 3), (4, 5), (6, 7))),
        (400e6 / 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
        (100e6 / 8, (tuple(range(8)),)),
    ]
    assert topo.capacity("h0", "rack0") == pytest.approx(50e6)
    assert topo.capacity("rack1", "spine") == pytest.approx(12.5e6)
    assert topo.latency("h0", "rack0") == pytest.approx(50e-6)
    assert topo.latency("h0/cpu0", "h0") == pytest.approx(1e-6)
    assert all(topo.reduce_bandwidth(i) == pytest.approx(2 * GB) for i in range(8))
    assert topo.routes(0, 7) == (("h0/cpu0", "h0", "rack0", "spine", "rack1", "h3", "h3/cpu1"),)


def test_emulated_interleaved_is_the_same_cluster_in_host_order_0_2_1_3():
    base, inter = load("emulated-2rack"), load("emulated-2rack-interleaved")
    assert inter.ranks == ("h0/cpu0", "h0/cpu1", "h2/cpu0", "h2/cpu1",
                           "h1/cpu0", "h1/cpu1", "h3/cpu0", "h3/cpu1")
    assert inter.hosts == {"h0": (0, 1), "h2": (2, 3), "h1": (4, 5), "h3": (6, 7)}
    assert inter.tiers[1].groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert sorted(inter.nodes) == sorted(base.nodes) and set(inter.links) == set(base.links)


def test_emulated_flat():
    topo = load("emulated-flat")
    assert _tiers(topo) == [(5 * GB, ((0, 1), (2, 3), (4, 5), (6, 7))), (1.25 * GB, (tuple(range(8)),))]


DOUBLE = [(0, 1), (0, 4), (1, 3), (2, 3), (2, 6), (4, 5), (5, 7), (6, 7)]
SINGLE = [(0, 2), (0, 3), (1, 2), (1, 5), (3, 7), (4, 6), (4, 7), (5, 6)]


@pytest.mark.parametrize("pair", DOUBLE + SINGLE)
def test_dgx1_nvlink_neighbours_route_directly(pair):
    topo = load("dgx1-v100")
    i, j = pair
    for a, b in ((i, j), (j, i)):
        assert topo.routes(a, b) == ((f"dgx1/gpu{a}", f"dgx1/gpu{b}"),)
        assert topo.route_bandwidth(a, b) == (50 * GB if pair in DOUBLE else 25 * GB)


def test_dgx1_nvlink_degree_and_host():
    topo = load("dgx1-v100")
    for g in range(8):
        nvlinks = sum(l.count for l in topo.links
                      if f"dgx1/gpu{g}" in (l.a, l.b) and topo.kind(l.a) == topo.kind(l.b) == "gpu")
        assert nvlinks == 6
    assert topo.hosts == {"dgx1": tuple(range(8))}


@pytest.mark.parametrize("i,j", [(0, 6), (6, 0), (0, 5), (1, 4), (3, 6), (2, 7)])
def test_dgx1_non_neighbours_never_transit_a_gpu(i, j):
    topo = load("dgx1-v100")
    routes = topo.routes(i, j)
    assert routes
    for path in routes:
        assert path[0] == f"dgx1/gpu{i}" and path[-1] == f"dgx1/gpu{j}"
        assert all(topo.kind(v) != "gpu" for v in path[1:-1])
    assert topo.route_bandwidth(i, j) == pytest.approx(12 * GB)  # PCIe Gen3 (and QPI)


def test_dgx_a100_routes():
    topo = load("dgx-a100-2x8")
    assert topo.routes(0, 1) == (("dgx0/gpu0", "dgx0/nvswitch", "dgx0/gpu1"),)
    assert topo.route_bandwidth(0, 1) == 300 * GB
    assert topo.route_bandwidth(0, 8) == 25 * GB
    path = topo.routes(0, 8)[0]
    assert "ib" in path and all(topo.kind(v) != "gpu" for v in path[1:-1])
    assert topo.hosts == {"dgx0": tuple(range(8)), "dgx1": tuple(range(8, 16))}


def test_dgx_h100_links():
    topo = load("dgx-h100")
    assert topo.capacity("dgx/gpu0", "dgx/nvswitch") == 450 * GB
    assert topo.route_bandwidth(0, 7) == 450 * GB


# Known answers: ForestColl's cut bound (allgather algorithm bandwidth).
KNOWN_ALLGATHER_ALGBW = {
    "dgx-a100-2x8": 16 * 325 / 15 * GB,   # ForestColl (Zhao et al., 2024): 346.67 GB/s
    "dgx-a100-4x8": 32 * 200 / 24 * GB,   # ForestColl: 266.67 GB/s
    "fat-tree-4x4-r1": 16 * 4 / 15 * GB,  # the file's known answer: 4.27 / 4.27 / 2.67 / 1.33 GB/s
    "fat-tree-4x4-r4": 16 * 4 / 15 * GB,
    "fat-tree-4x4-r4-interleaved": 16 * 4 / 15 * GB,
    "fat-tree-4x4-r8": 16 * 2 / 12 * GB,
    "fat-tree-4x4-r16": 16 * 1 / 12 * GB,
    "dgx1-v100": 8 * 162 / 7 * GB,
    "emulated-2rack": 25e6,
    "emulated-flat": 8 * 1.25 / 6 * GB,
    "ibm-3tier-192": 9.375 * GB,
    "ibm-3tier-fragment": 40 * 6.25 / 32 * GB,
    "leaf-spine-2rack": 32 * 12.5 / 28 * GB,
    "hetero-cluster": 32 * 3.125 / 28 * GB,
}


@pytest.mark.parametrize("stem", sorted(KNOWN_ALLGATHER_ALGBW))
def test_known_cut_bounds(stem):
    bounds = pytest.importorskip("ddl.bounds")
    cb = bounds.cut_bound(load(stem))
    assert 1.0 / cb.seconds_per_byte == pytest.approx(KNOWN_ALLGATHER_ALGBW[stem], rel=1e-9)
    assert not math.isinf(cb.bandwidth_out)
    if stem.startswith("dgx-a100-"):  # the published figures, to their two decimals
        published = {"dgx-a100-2x8": 346.67, "dgx-a100-4x8": 266.67}[stem]
        assert round(1.0 / cb.seconds_per_byte / GB, 2) == published
