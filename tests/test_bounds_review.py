"""Lower bounds on fabrics whose capacities lie up to 1e15 apart (ddl.bounds).

Max flows used to be quantised to int32 at the fastest link, and the transfer LP solved in its units:
a link 3e8 times slower rounded to nothing, and the bounds came out at a half or a third of the
optimum (the cut bound, broadcast / reduce) or infinite (the transfer LP came back 0). The stars and
chains below have bounds written by hand.
"""
import random

import pytest

from ddl.algorithms import ALGORITHMS
from ddl.bounds import (allreduce_bound_graph, broadcast_bandwidth_graph, cut_bound_graph, lower_bound,
                        reduce_bandwidth_graph, transfer_bound_graph)
from ddl.simulate import simulate
from ddl.topology import Topology
from ddl.verify import verify

SLOW = 1e3                                  # bytes/s; the fastest link is SLOW * spread <= 1 EB/s
SPREADS = (1e3, 1e6, 1e9, 1e12, 1e15)


def fabric(nodes, links, ranks):
    """``nodes``: (id, kind); ``links``: (a, b, bytes/s), full duplex."""
    return Topology.from_dict({"name": "review", "nodes": [{"id": v, "kind": k} for v, k in nodes],
                               "links": [{"a": a, "b": b, "bandwidth": f"{c!r} B/s"} for a, b, c in links],
                               "ranks": ranks})


def star(caps):
    """One rank per link to a switch, at the given rates."""
    ids = [f"g{i}" for i in range(len(caps))]
    topo = fabric([("sw", "switch")] + [(v, "gpu") for v in ids], [(v, "sw", c) for v, c in zip(ids, caps)], ids)
    return topo.usable_graph(), list(topo.ranks)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("p", [3, 4])
def test_allgather_star_with_one_slow_rank(p, spread):
    """The slow rank takes in (p - 1)/p of the buffer over its link: (p - 1)/(p · SLOW) s/byte."""
    graph, ranks = star([SLOW] + [SLOW * spread] * (p - 1))
    assert cut_bound_graph(graph, ranks).seconds_per_byte == pytest.approx((p - 1) / (p * SLOW), rel=1e-12)
    assert allreduce_bound_graph(graph, ranks).seconds_per_byte == pytest.approx(1 / SLOW, rel=1e-12)


@pytest.mark.parametrize("spread", SPREADS)
def test_broadcast_and_reduce_star_with_two_slow_ranks(spread):
    """From a fast root to ranks at 2·SLOW and SLOW: the slower one sets the rate, either order."""
    fast = SLOW * spread
    for caps in ([fast, 2 * SLOW, SLOW, fast], [fast, SLOW, 2 * SLOW, fast], [fast, fast, 2 * SLOW, SLOW]):
        graph, ranks = star(caps)
        assert broadcast_bandwidth_graph(graph, ranks, 0)[0] == pytest.approx(SLOW, rel=1e-12)
        assert reduce_bandwidth_graph(graph, ranks, 0)[0] == pytest.approx(SLOW, rel=1e-12)


@pytest.mark.parametrize("spread", SPREADS)
def test_chain_of_switches_with_slow_trunks(spread):
    """g0 -F- s0 -2S- s1 -F- g1 and s0 -S- s2 -F- g2: broadcast from g0 at S, and allgather limited by
    the two ranks that send their blocks to g2 over S: 2/(3S) s/byte."""
    fast = SLOW * spread
    topo = fabric([("s0", "switch"), ("s1", "switch"), ("s2", "switch"), ("g0", "gpu"), ("g1", "gpu"), ("g2", "gpu")],
                  [("g0", "s0", fast), ("s0", "s1", 2 * SLOW), ("s1", "g1", fast), ("s0", "s2", SLOW),
                   ("s2", "g2", fast)], ["g0", "g1", "g2"])
    graph, ranks = topo.usable_graph(), list(topo.ranks)
    assert broadcast_bandwidth_graph(graph, ranks, 0)[0] == pytest.approx(SLOW, rel=1e-12)
    assert cut_bound_graph(graph, ranks).seconds_per_byte == pytest.approx(2 / (3 * SLOW), rel=1e-12)


@pytest.mark.parametrize("spread", SPREADS)
def test_transfer_bound_of_pairs_joined_by_a_slow_direct_link(spread):
    """Pairs {a0, a1} and {b0, b1} on fast direct links, a1 - b0 directly at S, every rank on a switch
    at S: between the pairs 4 S through the switch plus 2 S over the direct link, so 6 S (the LP came
    back 0 at 1e15, an infinite bound)."""
    fast = SLOW * spread
    topo = fabric([("sw", "switch")] + [(v, "gpu") for v in ("a0", "a1", "b0", "b1")],
                  [("a0", "a1", fast), ("b0", "b1", fast), ("a1", "b0", SLOW)]
                  + [(v, "sw", SLOW) for v in ("a0", "a1", "b0", "b1")], ["a0", "a1", "b0", "b1"])
    tb = transfer_bound_graph(topo.usable_graph(), list(topo.ranks))
    assert tb.bandwidth == pytest.approx(6 * SLOW, rel=1e-9)
    assert tb.seconds_per_byte == pytest.approx(1 / (6 * SLOW), rel=1e-9)


def random_fabric(rng):
    """Two to three switches in a chain, 3 to 5 ranks on them, a few direct links between ranks;
    capacities log-uniform over 1e3 to 1e18 B/s."""
    def cap():
        return float(f"{10 ** rng.uniform(3, 18):.6g}")
    nsw, p = rng.randint(1, 3), rng.randint(3, 5)
    nodes = [(f"s{j}", "switch") for j in range(nsw)] + [(f"g{i}", "gpu") for i in range(p)]
    links = [(f"s{j}", f"s{j + 1}", cap()) for j in range(nsw - 1)]
    links += [(f"g{i}", f"s{rng.randrange(nsw)}", cap()) for i in range(p)]
    pairs = {tuple(sorted(rng.sample(range(p), 2))) for _ in range(rng.randint(0, 2))}
    links += [(f"g{a}", f"g{b}", cap()) for a, b in sorted(pairs)]
    return fabric(nodes, links, [f"g{i}" for i in range(p)])


def test_bounds_never_exceed_a_simulated_ring():
    """Seeded random fabrics with capacities up to 1e15 apart: no bound is above the simulated time of
    a verified ring schedule at 256 MiB."""
    rng = random.Random(20261125)
    nbytes = 256 << 20
    checked = 0
    for _ in range(25):
        topo = random_fabric(rng)
        for collective in ("allreduce", "allgather", "reduce_scatter", "broadcast"):
            sched = ALGORITHMS["ring"](topo, collective, nbytes=nbytes)
            verify(sched)
            t = simulate(topo, sched, nbytes).seconds
            bound = lower_bound(topo, collective, nbytes).seconds
            assert bound <= t * (1 + 1e-9), (topo.to_dict(), collective, bound, t)
            checked += 1
    assert checked == 100
