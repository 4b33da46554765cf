"""Review of the multi-commodity-flow planner: numerics of the LP, size validation, small odd fabrics."""
import importlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ddl.algorithms import ALGORITHMS
from ddl.algorithms.multicommodity_flow import multicommodity_flow, solve_commodities
from ddl.bounds import lower_bound
from ddl.errors import PlanError
from ddl.simulate import simulate
from ddl.topology import Topology
from ddl.verify import verify

mcf = importlib.import_module("ddl.algorithms.multicommodity_flow")

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")


def topo(name, nodes, links, ranks):
    return Topology.from_dict({"name": name, "nodes": nodes, "links": links, "ranks": ranks})


def dual_homed(n, fast, slow):
    """``n`` ranks, each on switch ``f`` at ``fast`` and on switch ``s`` at ``slow``."""
    return topo(f"dual-{n}-{fast}-{slow}",
                [{"id": "f", "kind": "switch"}, {"id": "s", "kind": "switch"}]
                + [{"id": f"r{i}", "kind": "cpu"} for i in range(n)],
                [{"a": f"r{i}", "b": "f", "bandwidth": fast} for i in range(n)]
                + [{"a": f"r{i}", "b": "s", "bandwidth": slow} for i in range(n)],
                [f"r{i}" for i in range(n)])


def star(n):
    return topo(f"star{n}", [{"id": "sw", "kind": "switch"}] + [{"id": f"r{i}", "kind": "gpu"} for i in range(n)],
                [{"a": f"r{i}", "b": "sw", "bandwidth": "10 GB/s"} for i in range(n)], [f"r{i}" for i in range(n)])


def unequal_uplinks(n):
    """Ranks alternate between two switches joined directly (4 GB/s, 1 us) and through a third
    (1 GB/s, 20 us a hop): parallel paths of unequal width and latency."""
    return topo(f"uplinks{n}", [{"id": f"s{i}", "kind": "switch"} for i in range(3)]
                + [{"id": f"r{i}", "kind": "cpu"} for i in range(n)],
                [{"a": f"r{i}", "b": f"s{i % 2}", "bandwidth": "10 GB/s"} for i in range(n)]
                + [{"a": "s0", "b": "s1", "bandwidth": "4 GB/s"},
                   {"a": "s0", "b": "s2", "bandwidth": "1 GB/s", "latency": "20 us"},
                   {"a": "s2", "b": "s1", "bandwidth": "1 GB/s", "latency": "20 us"}],
                [f"r{i}" for i in range(n)])


def directed(n):
    """A duplex switch, and a second one that ranks reach at 3 GB/s and that reaches them at 7 GB/s."""
    return topo(f"directed{n}", [{"id": "s0", "kind": "switch"}, {"id": "s1", "kind": "switch"}]
                + [{"id": f"r{i}", "kind": "cpu"} for i in range(n)],
                [{"a": f"r{i}", "b": "s0", "bandwidth": "10 GB/s"} for i in range(n)]
                + [{"a": f"r{i}", "b": "s1", "bandwidth": "3 GB/s", "directed": True} for i in range(n)]
                + [{"a": "s1", "b": f"r{i}", "bandwidth": "7 GB/s", "directed": True} for i in range(n)],
                [f"r{i}" for i in range(n)])


def hosts(n):
    """Two GPUs joined by NVLink on host h0, the rest on h1; the hosts meet at a switch."""
    return topo(f"hosts{n}", [{"id": "h0", "kind": "host"}, {"id": "h1", "kind": "host"},
                              {"id": "sw", "kind": "switch"}]
                + [{"id": f"h0/gpu{i}", "kind": "gpu"} for i in range(2)]
                + [{"id": f"h1/gpu{i}", "kind": "gpu"} for i in range(n - 2)],
                [{"a": f"h0/gpu{i}", "b": "h0", "bandwidth": "16 GB/s"} for i in range(2)]
                + [{"a": f"h1/gpu{i}", "b": "h1", "bandwidth": "16 GB/s"} for i in range(n - 2)]
                + [{"a": "h0/gpu0", "b": "h0/gpu1", "bandwidth": "25 GB/s"},
                   {"a": "h0", "b": "sw", "bandwidth": "12 GB/s"}, {"a": "h1", "b": "sw", "bandwidth": "12 GB/s"}],
                [f"h0/gpu{i}" for i in range(2)] + [f"h1/gpu{i}" for i in range(n - 2)])


def bottleneck_time(t, demands, routes):
    load = {}
    for pair, b in demands.items():
        for path, share in routes[pair]:
            for e in zip(path[:-1], path[1:]):
                load[e] = load.get(e, 0.0) + b * share
    return max(v / t.capacity(*e) for e, v in load.items())


def check_routing(t, demands, routing):
    assert set(routing.routes) == set(demands)
    for (s, d), paths in routing.routes.items():
        assert math.isclose(sum(w for _, w in paths), 1.0, rel_tol=1e-9) and all(w > 0 for _, w in paths)
        for path, _ in paths:
            assert (path[0], path[-1]) == (t.ranks[s], t.ranks[d])
            assert all(t.capacity(u, v) > 0 for u, v in zip(path[:-1], path[1:]))
    assert bottleneck_time(t, demands, routing.routes) <= routing.seconds * (1 + 1e-4)


# ---- the LP's numerics ---------------------------------------------------------------------------------
def slow_rank(fast, slow, n=4):
    """Ranks 1.. on switch ``f`` at ``fast`` and on switch ``s`` at ``slow``; rank 0 on ``s`` alone."""
    return topo(f"slow-rank-{fast}-{slow}",
                [{"id": "f", "kind": "switch"}, {"id": "s", "kind": "switch"}]
                + [{"id": f"r{i}", "kind": "cpu"} for i in range(n)],
                [{"a": f"r{i}", "b": "f", "bandwidth": fast} for i in range(1, n)]
                + [{"a": f"r{i}", "b": "s", "bandwidth": slow} for i in range(n)],
                [f"r{i}" for i in range(n)])


def test_capacities_a_billion_apart_still_solve():
    """HiGHS drops matrix entries below 1e-9: with capacities normalised by the fastest link, a link a
    billion times slower lost its capacity term, and where it was needed (rank 0's only link) the
    feasible LP came back "infeasible"."""
    t = slow_rank("1 TB/s", "1 kB/s")
    demands = {(i, (i + 1) % 4): 1e9 for i in range(4)}
    routing = solve_commodities(t, demands)
    check_routing(t, demands, routing)
    assert routing.seconds == pytest.approx(1e9 / 1e3, rel=1e-5)     # rank 0's 1 kB/s binds
    # 18 orders of magnitude where the slow links are not needed: still solved (they drop out)
    t = slow_rank("1000000 TB/s", "1 B/s")
    demands = {(1, 2): 1e9, (2, 3): 1e9}
    routing = solve_commodities(t, demands)
    check_routing(t, demands, routing)
    assert routing.seconds == pytest.approx(1e9 / 1e18, rel=1e-5)


def test_demands_a_trillion_apart_route_every_pair():
    """Demands were scaled by the largest: a 1-byte demand next to a terabyte was below HiGHS'
    tolerances, routed nowhere, and the planner raised "the LP routed no flow"."""
    t = dual_homed(4, "10 GB/s", "10 kB/s")
    demands = {(0, 1): 1e12, (2, 3): 1.0, (0, 2): 1.0}     # (0, 2) shares a source with the terabyte
    routing = solve_commodities(t, demands)
    check_routing(t, demands, routing)
    assert routing.seconds == pytest.approx(1e12 / (10e9 + 10e3), rel=1e-5)


def test_wrong_lp_routes_raise_instead_of_passing_silently(monkeypatch):
    """A solution HiGHS returns past its tolerances (here: all traffic forced onto the slow path) must
    not become routes that are slower than the optimum the LP reports."""
    t = dual_homed(2, "10 GB/s", "1 GB/s")
    real = mcf.linprog
    calls = []

    def past_tolerance(c, **kw):
        calls.append(1)
        if len(calls) == 2:     # the second LP: drop its bound on T and prefer the costliest links
            kw["b_ub"] = np.concatenate([kw["b_ub"][:-1], [1e30]])
            c = -np.asarray(c)
        return real(c, **kw)

    monkeypatch.setattr(mcf, "linprog", past_tolerance)
    mcf._ROUTE_CACHE.clear()
    with pytest.raises(PlanError, match="numerically unreliable"):
        solve_commodities(t, {(0, 1): 1e9})
    mcf._ROUTE_CACHE.clear()


def test_unsolvable_ranges_say_why():
    """Capacities 18 orders of magnitude apart are beyond a floating-point LP: the PlanError names the
    ranges, not just HiGHS' "infeasible" for a problem that is feasible by construction."""
    t = slow_rank("1000000 TB/s", "1 B/s")
    with pytest.raises(PlanError, match="link capacities span 1 to 1e\\+18 bytes/s .* 18 and 0 orders of magnitude"):
        solve_commodities(t, {(i, (i + 1) % 4): 1e9 for i in range(4)})


# ---- the planner's arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [float("nan"), float("inf"), -1, 1.5, "12", True])
def test_bad_sizes_are_plan_errors(nbytes):
    """NaN and infinity failed in int() (ValueError, OverflowError), -1 in the simulator (ScheduleError),
    text deep in a base (TypeError); 1.5 shared the cache entry of 1."""
    with pytest.raises(PlanError, match="nbytes"):
        multicommodity_flow(star(3), "allreduce", nbytes=nbytes)


def test_whole_sizes_of_any_integer_type_are_one_request():
    t = star(3)
    a = multicommodity_flow(t, "allgather", nbytes=3 << 20)
    assert multicommodity_flow(t, "allgather", nbytes=np.int64(3 << 20)) is a
    assert multicommodity_flow(t, "allgather", nbytes=float(3 << 20)) is a


# ---- every collective on small, odd fabrics -----------------------------------------------------------
@pytest.mark.parametrize("build", [star, unequal_uplinks, directed, hosts,
                                   lambda n: dual_homed(n, "10 GB/s", "10 kB/s")])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_small_fabrics_verify_and_respect_the_bound(build, n):
    if build is hosts and n == 2:
        n = 3
    t = build(n)
    for collective in COLLECTIVES:
        for root in range(n) if collective == "broadcast" else [0]:
            for nbytes in (None, 7, 1 << 40):
                sched = multicommodity_flow(t, collective, root=root, nbytes=nbytes)
                verify(sched)
                for (s, d), paths in sched.routes.items():
                    assert math.isclose(sum(w for _, w in paths), 1.0, rel_tol=1e-9)
                    assert all(w > 0 for _, w in paths)
                    for path, _ in paths:
                        assert (path[0], path[-1]) == (t.ranks[s], t.ranks[d])
                        assert all(t.capacity(u, v) > 0 for u, v in zip(path[:-1], path[1:]))
                size = (nbytes or 1 << 20) * (n if collective in ("reduce_scatter", "allgather") else 1)
                seconds = simulate(t, sched, size).seconds
                bound = lower_bound(t, collective, size, root=root)
                assert 0 < seconds < math.inf
                assert seconds >= bound.bandwidth_seconds * (1 - 1e-9)
                if size >= 1 << 20:
                    assert seconds >= bound.seconds * (1 - 1e-9)
                else:
                    # tiny sizes: bases that fan out may beat the single-port latency bound (see
                    # ddl.bounds.latency_bound); the routing must then be the base's own
                    base = ALGORITHMS[sched.info["base_algorithm"]](t, collective, root=root, nbytes=nbytes)
                    assert seconds <= simulate(t, base, size).seconds * (1 + 1e-9)


def test_deterministic_across_caches_and_hash_seeds():
    t = unequal_uplinks(5)
    first = multicommodity_flow(t, "allreduce", nbytes=1 << 24).to_json()
    mcf._PLAN_CACHE.clear()
    mcf._ROUTE_CACHE.clear()
    mcf._FABRICS.clear()
    assert multicommodity_flow(t, "allreduce", nbytes=1 << 24).to_json() == first
    code = ("import sys; sys.path.insert(0, 'tests'); import test_mcf_review as r; "
            "from ddl.algorithms.multicommodity_flow import multicommodity_flow as m; "
            "sys.stdout.write(m(r.unequal_uplinks(5), 'allreduce', nbytes=1 << 24).to_json())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout == first
