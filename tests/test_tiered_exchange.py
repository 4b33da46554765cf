"""Tiered exchange: hosts swap sums with several hosts at once, one rank per peer, then merge inside."""
import importlib
from pathlib import Path

import pytest

from ddl.algorithms import ALGORITHMS, REDUNDANT, recursive_doubling_schedule, tiered_exchange_schedule
from ddl.bounds import latency_bound
from ddl.errors import PlanError
from ddl.planner import Planner
from ddl.simulate import simulate
from ddl.topology import Topology
from ddl.verify import verify

ZOO = Path(__file__).resolve().parent.parent / "topologies"
NAME = "tiered-exchange"
te = importlib.import_module("ddl.algorithms.tiered_exchange")


@pytest.mark.parametrize("r", range(2, 10))
def test_colouring_is_proper(r):
    colour = te.colouring(r)
    assert all(colour[d, e] == colour[e, d] for d in range(r) for e in range(r) if d != e)
    for d in range(r):
        mine = [colour[d, e] for e in range(r) if e != d]
        assert len(set(mine)) == r - 1                     # one port per peer
    assert len(set(colour.values())) == (r - 1 if r % 2 == 0 else r)
    assert te.ports_needed(r) == 1 + len(set(colour.values()))


def test_radices():
    assert te.radices(16, 4) == [4, 4]
    assert te.radices(3, 4) == [3]
    assert sorted(te.radices(12, 4)) == [3, 4]
    assert te.radices(1, 4) == []
    assert te.radices(8, 2) == [2, 2, 2]
    with pytest.raises(PlanError, match="radices"):
        te.radices(7, 4)                                   # radix 7 needs 8 ranks per host
    with pytest.raises(PlanError, match="radices"):
        te.radices(3, 3)                                   # odd radix 3 needs 4


@pytest.mark.parametrize("hosts,m,k", [(4, 4, 1), (12, 4, 2), (8, 2, 1), (6, 4, 3), (9, 5, 1)])
def test_builder_verifies(hosts, m, k):
    ranks = list(range(hosts * m))[::-1]                   # any rank numbering
    groups = [ranks[i * m:(i + 1) * m] for i in range(hosts)]
    sched = tiered_exchange_schedule(groups, [[[[h] for h in range(hosts)]]], "allreduce", k)
    verify(sched)
    assert sched.nchunks == k


def test_a_wrong_merge_order_is_caught():
    """The merge must follow the slots' digit order on every host, or hosts of one block combine the
    same sums in different orders: the verifier rejects that (results would differ in the last bit)."""
    merge = te._merge

    def scrambled(b, slots, spare, chunks):
        if 0 in slots:                                 # host 0 only
            slots = [slots[0], slots[2], slots[1], slots[3]]
        merge(b, slots, spare, chunks)

    te._merge = scrambled
    try:
        sched = tiered_exchange_schedule([list(range(i, i + 4)) for i in range(0, 16, 4)], [[[[0], [1], [2], [3]]]])
    finally:
        te._merge = merge
    with pytest.raises(Exception, match="different orders"):
        verify(sched)


def test_three_tier_cluster_at_8_bytes():
    """4 GPUs x 16 hosts x 3 racks: in-host doubling, radix 4 twice in each rack, radix 3 across racks."""
    topo = Topology.load(ZOO / "ibm-3tier-192.yaml")
    sched = ALGORITHMS[NAME](topo, "allreduce", nbytes=8)
    verify(sched)
    assert sched.info["radices"] == [[4, 4]] * 3 + [[3]]
    mine = simulate(topo, sched, 8).seconds
    doubling = simulate(topo, ALGORITHMS["recursive-doubling"](topo, "allreduce", nbytes=8), 8).seconds
    assert mine == pytest.approx(4e-6 + 2 * (6e-6 + 4e-6) + (10e-6 + 4e-6), rel=0.01)
    assert mine < 0.8 * doubling
    assert latency_bound(topo, "allreduce") <= mine < 2.2 * latency_bound(topo, "allreduce")
    plan = Planner(topo, use_disk_cache=False).plan("allreduce", 8)
    assert plan.algorithm == NAME and plan.predicted_seconds == pytest.approx(mine)


@pytest.mark.parametrize("stem,why", [("dgx-a100", "one tier"), ("hetero-cluster", "hosts of unequal sizes")])
def test_where_tiers_do_not_fit_it_is_recursive_doubling_and_auto_skips_it(stem, why):
    topo = Topology.load(ZOO / f"{stem}.yaml")
    assert why in REDUNDANT[NAME](topo)
    sched = ALGORITHMS[NAME](topo, "allreduce", nbytes=8)
    assert sched.programs == ALGORITHMS["recursive-doubling"](topo, "allreduce", nbytes=8).programs
    if stem == "dgx-a100":          # (planning the heterogeneous cluster solves packing LPs: slow)
        plan = Planner(topo, use_disk_cache=False).plan("allreduce", 8)
        assert NAME in plan.skipped and NAME not in plan.baselines


def test_one_host_is_recursive_doubling():
    order = [3, 0, 2, 1, 4]
    assert tiered_exchange_schedule([order], []).programs == recursive_doubling_schedule(order, "allreduce").programs
