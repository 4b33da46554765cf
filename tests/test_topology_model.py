"""The Topology model: graph, routes (widest, then fewest hops, ECMP, transit rules), hosts, tiers,
reduce bandwidth, identity (fingerprint, eq, hash), immutability and speed on large clusters."""
import math
import pickle
import time

import networkx as nx
import numpy as np
import pytest

from ddl import TopologyError
from ddl.topology import Link, Tier, Topology

GB = 1e9


def dgx_mini(ranks=("g0", "g1", "g2", "g3")):
    """A quarter of a DGX-1: NVLink g0=g1 (2 links), g2=g3 (2 links), g0-g2 (1 link); each GPU pair on
    a PCIe switch, both switches on one CPU. g1 and g3 share no NVLink."""
    return Topology.from_dict({
        "name": "dgx-mini",
        "nodes": [{"id": "g{i}", "kind": "gpu", "for": {"i": 4}}, {"id": "p{s}", "kind": "pcie", "for": {"s": 2}},
                  {"id": "cpu", "kind": "cpu"}],
        "links": [{"a": "g0", "b": "g1", "bandwidth": "25 GB/s", "count": 2},
                  {"a": "g2", "b": "g3", "bandwidth": "25 GB/s", "count": 2},
                  {"a": "g0", "b": "g2", "bandwidth": "25 GB/s"},
                  {"a": "g{p[0]}", "b": "p{p[1]}", "bandwidth": "12 GB/s",
                   "for": {"p": [[0, 0], [1, 0], [2, 1], [3, 1]]}},
                  {"a": "p{s}", "b": "cpu", "bandwidth": "16 GB/s", "latency": "2 us", "for": {"s": 2}}],
        "ranks": list(ranks)})


def two_spines():
    """Two hosts with one GPU each, each host linked to two spine switches: two equal routes."""
    return Topology.from_dict({
        "name": "ecmp",
        "nodes": [{"id": "s{k}", "kind": "switch", "for": {"k": 2}}, {"id": "h{h}", "kind": "host", "for": {"h": 2}},
                  {"id": "h{h}/gpu0", "kind": "gpu", "for": {"h": 2}}],
        "links": [{"a": "h{h}/gpu0", "b": "h{h}", "bandwidth": "16 GB/s", "for": {"h": 2}},
                  {"a": "h{h}", "b": "s{k}", "bandwidth": "100 Gbit/s", "latency": "3 us", "for": {"h": 2, "k": 2}}],
        "ranks": ["h0/gpu0", "h1/gpu0"]})


def three_tier(gpus=4, hosts=16, racks=3):
    return Topology.from_dict({"name": "ibm", "tiers": [
        {"name": "gpu", "count": gpus, "bandwidth": "150 GB/s"},
        {"name": "host", "count": hosts, "bandwidth": "100 Gbit/s"},
        {"name": "rack", "count": racks, "bandwidth": "400 Gbit/s"}]})


# ----------------------------------------------------------------------------------------- graph

def test_graph_collapses_links_into_capacities():
    topo = dgx_mini()
    assert topo.graph.nodes["p1"]["kind"] == "pcie"
    assert topo.graph["g0"]["g1"] == {"capacity": 50 * GB, "latency": pytest.approx(1e-6)}
    assert topo.capacity("g1", "g0") == 50 * GB
    assert topo.latency("cpu", "p1") == pytest.approx(2e-6)
    assert topo.capacity("g1", "g3") == 0.0 and topo.latency("g1", "g3") == math.inf
    assert nx.is_frozen(topo.graph) and nx.is_frozen(topo.usable_graph())


def test_usable_graph_drops_gpus_that_are_not_ranks():
    topo = dgx_mini(ranks=("g0", "g3"))
    assert set(topo.usable_graph()) == {"g0", "g3", "p0", "p1", "cpu"}
    assert topo.is_transit("cpu") and topo.is_transit("p0")
    assert not topo.is_transit("g1") and not topo.is_transit("g0")


def test_a_rank_on_a_transit_kind_is_not_transit():
    topo = Topology("hosts", [("sw", "switch"), ("a", "host"), ("b", "host"), ("c", "host")],
                    [Link("a", "b", 100 * GB), Link("b", "c", 100 * GB),
                     Link("a", "sw", 1 * GB), Link("c", "sw", 1 * GB), Link("b", "sw", 1 * GB)],
                    ["a", "b", "c"])
    assert not topo.is_transit("b")
    assert topo.routes(0, 2) == (("a", "sw", "c"),)  # not through rank b, although that is wider
    assert topo.route_bandwidth(0, 2) == 1 * GB


# ---------------------------------------------------------------------------------------- routes

def test_routes_prefer_nvlink_and_never_relay_through_a_gpu():
    topo = dgx_mini()
    assert topo.routes(0, 1) == (("g0", "g1"),)
    assert topo.route_bandwidth(0, 1) == 50 * GB
    assert topo.routes(0, 2) == (("g0", "g2"),) and topo.route_bandwidth(0, 2) == 25 * GB
    # g1 -> g3 has no NVLink; g1 -> g0 -> g2 -> g3 would be 25 GB/s but GPUs do not forward
    assert topo.routes(1, 3) == (("g1", "p0", "cpu", "p1", "g3"),)
    assert topo.route_bandwidth(1, 3) == 12 * GB
    assert topo.route_latency(1, 3) == pytest.approx(1e-6 + 2e-6 + 2e-6 + 1e-6)


def test_gpus_outside_the_job_do_not_forward_either():
    topo = dgx_mini(ranks=("g1", "g2"))
    assert topo.routes(0, 1) == (("g1", "p0", "cpu", "p1", "g2"),)


def test_ecmp_two_spines_give_two_routes():
    topo = two_spines()
    assert topo.routes(0, 1) == (("h0/gpu0", "h0", "s0", "h1", "h1/gpu0"),
                                 ("h0/gpu0", "h0", "s1", "h1", "h1/gpu0"))
    assert topo.route_bandwidth(0, 1) == pytest.approx(12.5 * GB)
    assert topo.route_latency(1, 0) == pytest.approx(1e-6 + 3e-6 + 3e-6 + 1e-6)


def test_widest_beats_shortest_and_fewest_hops_break_ties():
    topo = Topology("wide", [("g0", "gpu"), ("g1", "gpu")] + [(x, "switch") for x in "stuvw"],
                    [Link("g0", "v", 1 * GB), Link("v", "g1", 1 * GB),                        # 2 hops, narrow
                     Link("g0", "s", 10 * GB), Link("s", "w", 10 * GB), Link("w", "g1", 10 * GB),  # 3 hops
                     Link("g0", "t", 10 * GB), Link("t", "u", 10 * GB), Link("u", "w", 10 * GB)],  # 4 hops
                    ["g0", "g1"])
    assert topo.routes(0, 1) == (("g0", "s", "w", "g1"),)
    assert topo.route_bandwidth(0, 1) == 10 * GB


def test_a_direct_link_is_the_route_even_when_narrow():
    # a CUDA peer copy between GPUs joined by NVLink takes NVLink, never the switch beside it
    topo = Topology("direct", [("g0", "gpu"), ("g1", "gpu"), ("s", "switch")],
                    [Link("g0", "g1", 1 * GB), Link("g0", "s", 10 * GB), Link("s", "g1", 10 * GB)],
                    ["g0", "g1"])
    assert topo.routes(0, 1) == (("g0", "g1"),) and topo.routes(1, 0) == (("g1", "g0"),)
    assert topo.route_bandwidth(0, 1) == 1 * GB


def test_directed_links_make_routes_asymmetric():
    topo = Topology("oneway", [("g0", "gpu"), ("g1", "gpu"), ("s", "switch")],
                    [Link("g0", "g1", 20 * GB, directed=True), Link("g0", "s", 5 * GB), Link("s", "g1", 5 * GB)],
                    ["g0", "g1"])
    assert topo.routes(0, 1) == (("g0", "g1"),) and topo.route_bandwidth(0, 1) == 20 * GB
    assert topo.routes(1, 0) == (("g1", "s", "g0"),) and topo.route_bandwidth(1, 0) == 5 * GB


def test_route_to_self_and_bad_indices():
    topo = dgx_mini()
    assert topo.routes(2, 2) == (("g2",),)
    assert topo.route_bandwidth(2, 2) == math.inf and topo.route_latency(2, 2) == 0
    with pytest.raises(IndexError, match="0..3"):
        topo.routes(0, 4)
    with pytest.raises(IndexError):
        topo.routes(-1, 0)
    with pytest.raises(IndexError):
        topo.routes(1.0, 0)
    assert topo.routes(np.int64(0), np.int32(1)) == topo.routes(0, 1)


def test_routes_are_cached():
    topo = two_spines()
    assert topo.routes(0, 1) is topo.routes(0, 1)


def test_routes_in_three_tiers_climb_only_as_far_as_needed():
    topo = three_tier(racks=2, hosts=2, gpus=2)
    assert topo.routes(0, 1) == (("r0/h0/gpu0", "r0/h0", "r0/h0/gpu1"),)
    assert topo.routes(0, 2) == (("r0/h0/gpu0", "r0/h0", "r0", "r0/h1", "r0/h1/gpu0"),)
    assert topo.routes(0, 7) == (("r0/h0/gpu0", "r0/h0", "r0", "spine", "r1", "r1/h1", "r1/h1/gpu1"),)
    assert topo.route_bandwidth(0, 7) == pytest.approx(12.5 * GB)


def test_ring_routes_of_192_ranks_are_fast():
    topo = three_tier()
    start = time.process_time()
    routes = [topo.routes(i, (i + 1) % 192) for i in range(192)]
    assert time.process_time() - start < 1.0
    assert all(len(r) == 1 for r in routes)
    assert len(routes[3][0]) == 5 and len(routes[191][0]) == 7  # host to host, rack to rack


def test_1024_ranks_load_tiers_and_routes_quickly():
    start = time.process_time()
    topo = three_tier(gpus=8, hosts=16, racks=8)
    tiers = topo.tiers
    for i in range(0, 1024, 8):
        topo.routes(i, (i * 37 + 11) % 1024)
    assert time.process_time() - start < 4.0
    assert [len(t.groups) for t in tiers] == [128, 1]


# ----------------------------------------------------------------------------------- hosts, tiers

def test_host_rules():
    topo = Topology("hosts", [
        {"id": "n0", "kind": "host"}, {"id": "n0/gpu0", "kind": "gpu"},            # id prefix
        {"id": "box", "kind": "host"}, {"id": "x1", "kind": "gpu"},                 # linked directly
        {"id": "x2", "kind": "gpu", "host": "n0"},                                 # attribute wins
        {"id": "sw/gpu9", "kind": "gpu"}, {"id": "sw", "kind": "switch"},          # prefix not a host: none
        {"id": "cpuhost", "kind": "host"}],                                       # a host rank: itself
        [Link("n0/gpu0", "n0", GB), Link("x1", "box", GB), Link("x2", "box", GB), Link("n0", "sw", GB),
         Link("box", "sw", GB), Link("sw/gpu9", "sw", GB), Link("cpuhost", "sw", GB)],
        ["n0/gpu0", "x1", "x2", "sw/gpu9", "cpuhost"])
    assert [topo.host_of(i) for i in range(5)] == ["n0", "box", "n0", None, "cpuhost"]
    assert topo.hosts == {"n0": (0, 2), "box": (1,), "cpuhost": (4,)}


def test_hosts_follow_rank_order():
    topo = three_tier(gpus=2, hosts=2, racks=1).with_ranks(["r0/h1/gpu0", "r0/h0/gpu1", "r0/h1/gpu1"])
    assert topo.hosts == {"r0/h1": (0, 2), "r0/h0": (1,)}


def test_tiers_of_three_tier_cluster():
    tiers = three_tier().tiers
    # GPUs join their host at 150 GB/s; rack uplinks (50 GB/s) join switches only, no ranks; everything
    # joins through the 12.5 GB/s host links: single linkage records the bottleneck of the chain.
    assert [t.bandwidth for t in tiers] == [150 * GB, 12.5 * GB]
    assert tiers[0].groups[:2] == ((0, 1, 2, 3), (4, 5, 6, 7)) and len(tiers[0].groups) == 48
    assert tiers[1].groups == (tuple(range(192)),)


def test_tiers_nest_and_slow_down():
    topo = Topology.from_dict({"name": "t", "tiers": [
        {"count": 2, "bandwidth": "100 GB/s"}, {"count": 2, "bandwidth": "10 GB/s"},
        {"count": 2, "bandwidth": "1 GB/s"}]})
    assert topo.tiers == (Tier(100 * GB, ((0, 1), (2, 3), (4, 5), (6, 7))),
                          Tier(10 * GB, ((0, 1, 2, 3), (4, 5, 6, 7))),
                          Tier(1 * GB, ((0, 1, 2, 3, 4, 5, 6, 7),)))


def test_tiers_sort_groups_by_smallest_rank():
    topo = three_tier(gpus=2, hosts=2, racks=1).with_ranks(["r0/h1/gpu0", "r0/h0/gpu0", "r0/h1/gpu1", "r0/h0/gpu1"])
    assert topo.tiers[0].groups == ((0, 2), (1, 3))


def test_tiers_of_dgx_mini_group_the_nvlink_island():
    assert dgx_mini().tiers == (Tier(50 * GB, ((0, 1), (2, 3))), Tier(25 * GB, ((0, 1, 2, 3),)))


def test_tiers_of_one_rank_and_of_a_one_way_ring():
    assert dgx_mini(ranks=("g0",)).tiers == (Tier(math.inf, ((0,),)),)
    # g0 -> g1 -> s -> g0, every link one way only: each counts with its one direction
    ring = Topology("ring", [("g0", "gpu"), ("g1", "gpu"), ("s", "switch")],
                    [Link("g0", "g1", 5 * GB, directed=True), Link("g1", "s", 5 * GB, directed=True),
                     Link("s", "g0", 5 * GB, directed=True)], ["g0", "g1"])
    assert ring.routes(1, 0) == (("g1", "s", "g0"),)
    assert ring.tiers == (Tier(5 * GB, ((0, 1),)),)


def test_reduce_bandwidth_defaults():
    topo = Topology("r", [("g", "gpu"), ("c", "cpu"), {"id": "f", "kind": "gpu", "reduce_bandwidth": "7 GB/s"},
                          ("s", "switch")],
                    [Link("g", "s", GB), Link("c", "s", GB), Link("f", "s", GB)], ["g", "c", "f"])
    assert [topo.reduce_bandwidth(i) for i in range(3)] == [1000 * GB, 5 * GB, 7 * GB]
    data = topo.to_dict()
    data["defaults"] = {"reduce_bandwidth": "20 GB/s"}
    again = Topology.from_dict(data)
    assert [again.reduce_bandwidth(i) for i in range(3)] == [20 * GB, 20 * GB, 7 * GB]


# ---------------------------------------------------------------------------------------- with_ranks

def test_with_ranks_takes_a_fragment_of_the_same_fabric():
    full = dgx_mini()
    part = full.with_ranks(["g3", "g1"])
    assert part.ranks == ("g3", "g1") and part.nranks == 2
    assert part.links == full.links and part.nodes == full.nodes
    assert part.routes(1, 0) == (("g1", "p0", "cpu", "p1", "g3"),)
    assert part != full and part.with_ranks(full.ranks) == full


def test_with_ranks_validates():
    with pytest.raises(TopologyError, match=r"ranks\[1\]: rank 'g9' names no node"):
        dgx_mini().with_ranks(["g0", "g9"])
    with pytest.raises(TopologyError, match="already rank 0"):
        dgx_mini().with_ranks(["g0", "g0"])


# ------------------------------------------------------------------------------- identity, immutability

def test_equality_and_hash_follow_the_fingerprint():
    a, b = dgx_mini(), Topology.from_dict(dgx_mini().to_dict())
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert len(a.fingerprint) == 64 and int(a.fingerprint, 16) >= 0
    renamed = a.to_dict()
    renamed["name"] = "other"
    assert Topology.from_dict(renamed) != a
    assert a != "dgx-mini" and a != a.to_dict()


def test_repr_is_short():
    text = repr(three_tier())
    assert text.startswith("<Topology 'ibm': 192 ranks") and len(text) < 100


def test_no_public_mutation():
    topo = dgx_mini()
    with pytest.raises(AttributeError):
        topo.ranks = ("g0",)
    with pytest.raises(nx.NetworkXError):
        topo.graph.add_edge("g1", "g3", capacity=1.0)
    with pytest.raises(nx.NetworkXError):
        topo.usable_graph().remove_node("cpu")
    assert isinstance(topo.ranks, tuple) and isinstance(topo.links, tuple) and isinstance(topo.nodes, tuple)
    topo.hosts.clear()  # a copy
    topo.to_dict()["ranks"].append("p0")
    assert topo.ranks == ("g0", "g1", "g2", "g3")


def test_pickle_round_trip():
    topo = two_spines()
    back = pickle.loads(pickle.dumps(topo))
    assert back == topo and back.routes(0, 1) == topo.routes(0, 1)


def test_the_package_exports_topology():
    """``ddl.Topology`` is what the README and the Communicator's errors name."""
    import ddl

    assert ddl.Topology is Topology and ddl.Topology.load("topologies/emulated-2rack.yaml").nranks == 8
