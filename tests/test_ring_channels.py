"""ring-channels: several rings at once, as NCCL runs them, with rates from an LP."""
from pathlib import Path

import pytest

from ddl.algorithms import ALGORITHMS
from ddl.algorithms.ring import ring_order
from ddl.algorithms.ring_channels import (MAX_OPS, THIN, candidate_orders, channels_schedule, choose_channels,
                                          integer_weights, other_cycles, rotate_groups)
from ddl.bounds import busbw
from ddl.errors import PlanError
from ddl.simulate import simulate
from ddl.topology import Topology
from ddl.verify import verify

ZOO = Path(__file__).resolve().parent.parent / "topologies"
N = 256 << 20
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")


def zoo(name):
    return Topology.load(ZOO / f"{name}.yaml")


def predicted_busbw(topo, sched):
    return busbw("allreduce", N, simulate(topo, sched, N).seconds, topo.nranks)


def test_dgx1_gets_both_directions_of_the_double_and_the_single_nvlink_rings():
    # the widest ring takes the eight double NVLinks (50 GB/s a hop), a second cycle the eight single
    # ones (25 GB/s); both ways round each, that is every NVLink in both directions: NCCL's 150 GB/s
    topo = zoo("dgx1-v100")
    sched = ALGORITHMS["ring-channels"](topo, "allreduce", nbytes=N)
    rates = sorted(sched.info["channel_rates"])
    assert rates == pytest.approx([25e9, 25e9, 50e9, 50e9])
    assert sorted(sched.info["channel_weights"]) == [1, 1, 2, 2]
    hops = {frozenset((o[i], o[(i + 1) % 8])) for o in sched.info["channels"] for i in range(8)}
    assert len(hops) == 16                                  # all 16 GPU pairs joined by NVLink
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=N)
    assert predicted_busbw(topo, sched) == pytest.approx(150e9, rel=0.01)
    assert predicted_busbw(topo, ring) == pytest.approx(50e9, rel=0.01)


def test_a100_hosts_leave_through_every_nic():
    # one ring leaves each DGX A100 through one of its eight NICs; rotated rings leave through the
    # others, so eight channels carry eight times what one ring does (NCCL's ~200 GB/s on 2 x 8)
    topo = zoo("dgx-a100-2x8")
    sched = ALGORITHMS["ring-channels"](topo, "allreduce", nbytes=N)
    channels = sched.info["channels"]
    assert len(channels) == 8
    exits = set()
    for order in channels:
        for i in range(16):
            a, b = order[i], order[(i + 1) % 16]
            if a // 8 != b // 8:
                exits.add(a)
    assert len(exits) == 16                                # every GPU's NIC sends to the other host
    ring = ALGORITHMS["ring"](topo, "allreduce", nbytes=N)
    assert predicted_busbw(topo, sched) > 7.5 * predicted_busbw(topo, ring)


def test_dgx1_pcie_ring_is_found_but_too_thin_to_keep():
    # after the double and the single NVLink cycles, the next cycle avoids every NVLink pair: it goes
    # over PCIe and the CPUs, where the LP gives it 6 GB/s; below a quarter of 50 it is dropped, and
    # with it the plan would be slower
    topo = zoo("dgx1-v100")
    nvlink = {frozenset((a, b)) for a in range(8) for b in range(8) if a != b and topo.route_bandwidth(a, b) >= 25e9}
    first = ring_order(topo)
    second, third, *_ = other_cycles(topo, first)
    assert all(frozenset((second[i], second[(i + 1) % 8])) in nvlink for i in range(8))
    assert not any(frozenset((third[i], third[(i + 1) % 8])) in nvlink for i in range(8))
    candidates = candidate_orders(topo)
    assert third in candidates
    orders, rates = choose_channels(topo, candidates)
    assert third not in orders and len(orders) == 4
    with_pcie = channels_schedule(orders + [third], [8, 8, 4, 4, 1], "allreduce", [8, 8, 5, 5, 1])
    kept = ALGORITHMS["ring-channels"](topo, "allreduce", nbytes=N)
    assert simulate(topo, kept, N).seconds < simulate(topo, with_pcie, N).seconds
    assert 6e9 < THIN * 50e9


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_collective_verifies_on_the_zoo(collective):
    for name in ("dgx1-v100", "dgx-a100-2x8"):
        topo = zoo(name)
        for nbytes in (4096, N):
            verify(ALGORITHMS["ring-channels"](topo, collective, root=topo.nranks - 1, nbytes=nbytes))


def test_declines_where_one_ring_uses_every_way_out():
    # one NIC per host: rotations and the reverse ring cross the same NIC links, so the LP gains nothing
    for name in ("leaf-spine-2rack", "fat-tree-4x4-r4", "dgx-h100"):
        with pytest.raises(PlanError, match="repeat 'ring'"):
            ALGORITHMS["ring-channels"](zoo(name), "allreduce", nbytes=N)


def test_declines_where_two_channels_are_too_many_operations():
    topo = Topology.from_dict({"name": "big", "tiers": [
        {"name": "gpu", "count": 8, "bandwidth": "300 GB/s"},
        {"name": "host", "count": 48, "bandwidth": "25 GB/s"}]})
    assert 2 * 4 * topo.nranks * (topo.nranks - 1) > MAX_OPS
    with pytest.raises(PlanError, match="operations"):
        ALGORITHMS["ring-channels"](topo, "allreduce", nbytes=N)


def test_channels_are_kept_only_when_they_add_bandwidth():
    topo = zoo("dgx-a100-2x8")
    candidates = candidate_orders(topo)
    assert candidates[0] == ring_order(topo) and candidates[1] == ring_order(topo)[::-1]
    orders, rates = choose_channels(topo, candidates)
    # 16 candidates (8 rotations, both ways round) but 8 NICs a host: once 8 rings leave through all
    # of them, the other 8 would only share their links
    assert len(candidates) == 16
    assert len(orders) == 8 and min(rates) > 0.99 * max(rates)
    assert choose_channels(topo, candidates, max_channels=3)[0] == orders[:3]


def test_rotate_groups_moves_each_group_segment():
    order = [0, 1, 2, 3, 4, 5, 6]
    assert rotate_groups(order, [(0, 1, 2), (3, 4, 5, 6)], 1) == [1, 2, 0, 4, 5, 6, 3]
    assert rotate_groups(order, [(0, 1, 2), (3, 4, 5, 6)], 3) == [0, 1, 2, 6, 3, 4, 5]


def test_integer_weights_keep_the_proportions():
    assert integer_weights([50e9, 50e9, 25e9, 25e9]) == [2, 2, 1, 1]
    assert integer_weights([3.0, 1.0]) == [3, 1]
    assert integer_weights([1.0, 1.0, 1.0]) == [1, 1, 1]
    w = integer_weights([1.0, 0.001])
    assert w[1] >= 1 and w[0] / w[1] == 8               # the smallest share is 1/8 of the largest
