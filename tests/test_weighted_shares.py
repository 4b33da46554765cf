"""Weighted shares in ``hierarchical``: where one host is behind a much slower NIC than the others, an
allreduce's shares are weighted by an LP so that the slow host holds none and its NIC carries the
buffer once each way (the bound), instead of a share per rank that sends more through it."""
import importlib

import pytest

from ddl.algorithms.ring import nested_order, rank_partitions
from ddl.bounds import lower_bound
from ddl.simulate import link_totals, load_seconds, simulate
from ddl.topology import Topology
from ddl.verify import verify

hier = importlib.import_module("ddl.algorithms.hierarchical")    # (the package shadows it with a function)
N = 64 << 20


def uneven(slow="10 Gbit/s", fast="100 Gbit/s"):
    """Two hosts of 4 GPUs behind ``fast`` NICs and two of 2 GPUs behind ``slow`` NICs, on one switch: the
    stage below the top has three groups (the fast hosts together, each slow host alone)."""
    nodes, links, ranks = [{"id": "sw", "kind": "switch"}], [], []
    for host, gpus, nic in (("f0", 4, fast), ("f1", 4, fast), ("s0", 2, slow), ("s1", 2, slow)):
        nodes.append({"id": host, "kind": "host"})
        links.append({"a": host, "b": "sw", "bandwidth": nic, "latency": "2 us"})
        for g in range(gpus):
            ranks.append(f"{host}/gpu{g}")
            nodes.append({"id": ranks[-1], "kind": "gpu"})
            links.append({"a": ranks[-1], "b": host, "bandwidth": "40 GB/s"})
    return Topology.from_dict({"name": f"uneven-{slow}", "defaults": {"latency": "1 us"}, "nodes": nodes,
                               "links": links, "ranks": ranks})


def stages_of(topo):
    parts = rank_partitions(topo)
    order, _ = nested_order(topo.nranks, parts, topo.route_bandwidth)
    return order, parts, len(hier.stage_partitions(topo.nranks, parts))


def test_link_totals_are_what_the_simulation_carries():
    topo = uneven()
    order, parts, top = stages_of(topo)
    sched = hier.hierarchical_schedule(order, parts, "allreduce", 4, waves=4, exchange=(top,))
    totals = link_totals(topo, sched, N)
    carried = simulate(topo, sched, N).link_bytes
    assert totals.keys() == carried.keys()
    assert all(totals[link] == pytest.approx(carried[link], rel=1e-12) for link in totals)
    assert load_seconds(topo, sched, N) == pytest.approx(max(b / topo.capacity(*l) for l, b in totals.items()))


def test_the_slow_host_holds_nothing_and_its_nic_carries_the_buffer_once_each_way():
    topo = uneven()
    order, parts, top = stages_of(topo)
    shares, seconds_per_byte = hier.weighted_shares(topo, order, parts, (top,))
    slow = [r for r, v in enumerate(topo.ranks) if v.startswith("s")]
    assert [shares[r] for r in slow] == [0, 0, 0, 0]
    assert all(shares[r] > 0 for r in range(topo.nranks) if r not in slow)
    sched = hier.hierarchical_schedule(order, parts, "allreduce", 4, waves=4, exchange=(top,), shares=shares)
    verify(sched)
    totals = link_totals(topo, sched, N)
    assert totals[("s0", "sw")] == pytest.approx(N) and totals[("sw", "s0")] == pytest.approx(N)
    # the NIC binds, at the bound's load: no link carries more than it does
    assert seconds_per_byte * N == pytest.approx(N / topo.capacity("s0", "sw"), rel=1e-6)
    assert seconds_per_byte * N == pytest.approx(lower_bound(topo, "allreduce", N).seconds, rel=1e-6)
    # a share per rank sends more than the buffer through the slow NIC
    plain = hier.hierarchical_schedule(order, parts, "allreduce", 4, waves=4, exchange=(top,))
    assert link_totals(topo, plain, N)[("s0", "sw")] > 1.1 * N
    assert hier.weighted_shares(topo, order, parts, (top,)) == (shares, seconds_per_byte)   # deterministic


def test_where_every_share_loads_the_slow_nic_alike_a_share_per_rank_stays():
    # two groups below the top: whatever the slow host holds, its NIC carries the buffer once each way
    data = uneven().to_dict()
    data["name"] = "two-groups"
    data["ranks"] = [v for v in data["ranks"] if not v.startswith("s1/")]
    topo = Topology.from_dict(data)
    order, parts, top = stages_of(topo)
    assert len(hier.stage_partitions(topo.nranks, parts)[-2]) == 2
    assert hier.weighted_shares(topo, order, parts, (top,)) is None


def test_hierarchical_takes_weighted_shares_where_they_are_faster():
    topo = uneven()
    sched = hier.hierarchical(topo, "allreduce", nbytes=N)
    verify(sched)
    tried = sched.info["variants_tried"]      # a variant stopped once it could not win says how slow at least
    least = [v["seconds"] if v["seconds"] is not None else v["at_least"] for v in tried]
    weighted = [t for t, v in zip(least, tried) if v["shares"] is not None]
    others = [t for t, v in zip(least, tried) if v["shares"] is None]
    assert weighted and min(weighted) < 0.95 * min(others)
    assert sched.info["shares"] is not None
    assert simulate(topo, sched, N).seconds == pytest.approx(min(least))
    assert simulate(topo, sched, N).seconds <= 1.15 * lower_bound(topo, "allreduce", N).seconds
