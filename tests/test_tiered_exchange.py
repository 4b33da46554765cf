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


def test_radices():
    assert te.radices(16, 4) == [4, 4]
    assert te.radices(3, 4) == [3]
    assert sorted(te.radices(12, 4)) == [3, 4]
    assert te.radices(1, 4) == []
    assert te.radices(8, 2) == [2, 2, 2]
    assert te.radices(9, 2) == [3, 3]                      # a host of 2 takes in 2 sums per round
    assert te.radices(4, 1) == [2, 2]                      # single-rank hosts: recursive doubling
    assert te.radices(5, 4) == [5]
    with pytest.raises(PlanError, match="radices"):
        te.radices(7, 4)                                   # radix 7 needs hosts of 6 ranks
    with pytest.raises(PlanError, match="radices"):
        te.radices(3, 1)


def test_chain_keeps_the_own_sum_only_where_it_leads():
    assert te._chain(range(2), 1) == [(1, True), (0, False)]
    assert te._chain(range(3), 0) == [(0, True), (1, False), (2, False)]
    assert te._chain(range(3), 2) == [(0, False), (1, False), (2, False)]      # from the keeper
    assert te._chain(range(3, 5), 0) == [(3, False), (4, False)]


@pytest.mark.parametrize("hosts,m,k", [(4, 4, 1), (12, 4, 2), (8, 2, 1), (6, 4, 3), (5, 4, 1), (3, 2, 1),
                                       (4, 1, 1), (6, 3, 1), (9, 8, 2), (7, 6, 1)])
def test_builder_verifies(hosts, m, k):
    ranks = list(range(hosts * m))[::-1]                   # any rank numbering
    groups = [ranks[i * m:(i + 1) * m] for i in range(hosts)]
    sched = tiered_exchange_schedule(groups, [[[[h] for h in range(hosts)]]], "allreduce", k)
    verify(sched)
    assert sched.nchunks == k
    assert sched.info["radices"] == [te.radices(hosts, m)]


def test_a_host_takes_in_at_most_m_sums_per_round():
    """The latency bound lets a host of m ranks take in m messages per cross-host latency; the cross
    round of a radix-5 block on hosts of 4 needs exactly that, and one rank at most 3."""
    hosts = [list(range(i, i + 4)) for i in range(0, 20, 4)]
    sched = tiered_exchange_schedule(hosts, [[[[h] for h in range(5)]]])
    host_of = {r: i for i, h in enumerate(hosts) for r in h}
    per_rank = [sum(1 for op in program if op.kind != "send" and host_of[op.peer] != host_of[r])
                for r, program in enumerate(sched.programs)]
    assert all(sum(per_rank[r] for r in h) == 4 for h in hosts)
    assert max(per_rank) == 3                   # the low half's lane of a high host receives all 3


def test_a_wrong_chain_order_is_caught():
    """Lanes must add the sums in digit order on every host, or hosts of one block combine the same
    sums in different orders: the verifier rejects that (results would differ in the last bit)."""
    chain = te._chain

    def scrambled(half, own):
        terms = chain(half, own)
        return terms[::-1] if own == 4 and not terms[0][1] else terms

    te._chain = scrambled
    try:
        sched = tiered_exchange_schedule([list(range(i, i + 4)) for i in range(0, 20, 4)],
                                         [[[[0], [1], [2], [3], [4]]]])
    finally:
        te._chain = chain
    with pytest.raises(Exception, match="different orders"):
        verify(sched)


def test_three_tier_cluster_at_8_bytes():
    """4 GPUs x 16 hosts x 3 racks: in-host doubling, radix 4 twice in each rack, radix 3 across racks,
    each a cross-host latency and one in-host merge: within 2x of the latency bound."""
    topo = Topology.load(ZOO / "ibm-3tier-192.yaml")
    sched = ALGORITHMS[NAME](topo, "allreduce", nbytes=8)
    verify(sched)
    assert sched.info["radices"] == [[4, 4]] * 3 + [[3]]
    mine = simulate(topo, sched, 8).seconds
    doubling = simulate(topo, ALGORITHMS["recursive-doubling"](topo, "allreduce", nbytes=8), 8).seconds
    assert mine == pytest.approx(4e-6 + 2 * (6e-6 + 2e-6) + (10e-6 + 2e-6), rel=0.01)
    assert mine < 0.65 * doubling
    assert latency_bound(topo, "allreduce") <= mine < 2 * latency_bound(topo, "allreduce")
    plan = Planner(topo, use_disk_cache=False).plan("allreduce", 8)
    assert plan.algorithm == NAME and plan.predicted_seconds == pytest.approx(mine)


@pytest.mark.parametrize("stem,why", [("dgx-a100", "one tier"), ("hetero-cluster", "the groups of its fastest tier have unequal sizes")])
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
