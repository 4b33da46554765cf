"""The best rings a small fabric holds, each hop routed over every path it may take: ring packing.

``ring-channels`` runs rings as NCCL does: each hop of a ring takes its pair's usual route, and the
rings are a few candidates. Here the rings are chosen among all Hamiltonian cycles, and a hop
between two ranks without a link of their own may be split over every path between them (the
widest route is one of them). Ranks joined by a direct link keep to it: transports take that link
and no other (a CUDA peer copy between GPUs joined by NVLink goes over NVLink, never through their
PCIe switch), so a plan that split such a pair could not run as planned. On a DGX-1 that leaves
PCIe the hops between GPUs without an NVLink, through switch uplinks that two GPUs share: 6 GB/s per
GPU beside NVLink's 150, 156 GB/s of bus bandwidth at most: the bound (:func:`ddl.bounds.transfer_bound`
counts transfers routed the same way).

The programme, over rings ``j`` (rates ``x_j``) and paths ``t`` between rank pairs (flows ``y_t``)::

    maximise sum_j x_j   s.t.   sum_{j uses pair q} x_j <= sum_{t of q} y_t     every rank pair q
                                sum_{t uses link l} y_t <= capacity(l)          every directed link l

There are far too many rings to list, so they are generated (column generation: P. C. Gilmore and
R. E. Gomory, "A linear programming approach to the cutting-stock problem", 1961). Start from the
channels ``ring-channels`` picks; solve; price every rank pair at its row's dual value; the ring
that would raise the optimum is the Hamiltonian cycle of least total price below 1, which the
Held-Karp dynamic programme finds exactly (M. Held and R. M. Karp, 1962; ``2^p p^2`` steps, hence
:data:`MAX_RANKS`). Ties between rings of equal price go to hops over fewer links. When no ring
prices below 1, the optimum over *all* rings is reached.

Every ring is a channel that pays its own latencies and cuts its share into its own chunks, so a
mixed integer programme (HiGHS) then keeps the fewest rings that hold a share of that optimum
(each of :data:`KEEPS`; the LP counts rates, but links are shared fairly between the rings on them,
so the selection whose allreduce simulates fastest is kept). A last LP keeps the rates and sends
each pair's traffic over the fewest links, and pins that split in :attr:`Schedule.routes`. Shares
follow the rates to 1/64 of the fastest (:data:`RATE_STEPS`): a ring of 6 GB/s beside ones of 50 is
not rounded to an eighth. On the DGX-1 the optimum needs many
thin PCIe rings: 15 rings, predicted at 153.4 GB/s (1.017 of the bound), 2% faster than
ring-channels. On six ranks joined in a cycle by 25 GB/s links and, in pairs, under the leaves of
a tree of 10 GB/s switches, it finds 55 GB/s of rings in four, against ring-channels' 50.

Collectives: all four. It declines beyond :data:`MAX_RANKS`, where the fabric has one path per rank
pair, and where it gains less than ring-channels' :data:`~ddl.algorithms.ring_channels.MIN_GAIN`
over ring-channels' own channels (it would repeat them).
"""
import contextlib
import functools
import itertools
import os
import sys

import networkx as nx
import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..errors import PlanError
from ..simulate import simulate
from ..units import counted, format_bandwidth
from .multicommodity_flow import repeats_a_base
from .ring import check_request
from .ring_channels import MAX_CHANNELS, MIN_GAIN, candidate_orders, choose_channels, rated_channels

NAME = "ring-packing"
MAX_RANKS = 12            # Held-Karp prices a ring in 2^(p-1) p^2 steps
MAX_PATH_LINKS = 6        # paths between two ranks of at most this many links (or PATH_DETOUR more
PATH_DETOUR = 2           # than their shortest, where that is longer: gpu-pcie-host-nic-switch and back is 8)...
MAX_PATHS = 16            # ... the shortest this many of them
MAX_ROUNDS = 64           # rings generated at most
KEEPS = (0.995, 0.99, 0.985, 0.98)   # the fewest rings holding each share of the optimum are tried ...
SELECT_BYTES = 256 << 20  # ... by simulating an allreduce of this size, and the fastest are kept
SELECT_NODES = 300        # branch-and-bound nodes for choosing the rings (the best found by then is kept)
RATE_STEPS = 64           # channel shares are fractions of the fastest with denominators up to this
PRICE_TOL = 1e-7          # a ring must price below 1 by this much to join
TIE = 1e-4                # tie-break weight per link of a pair's shortest path (relative to price 1)


def ring_packing(topo, collective, *, root=0, nbytes=None):
    """Rings chosen among all Hamiltonian cycles, hops routed over every path (module docstring)."""
    p = topo.nranks
    check_request(NAME, collective, p, root)
    packed = pack_rings(topo)
    if isinstance(packed, PlanError):
        # a new error each time: the cached one, raised again, would pile every call's traceback onto
        # itself and carry the exception an earlier caller was handling as its __context__
        raise PlanError(str(packed))
    cycles, rates, routes, generated = packed
    return rated_channels(cycles, rates, collective, nbytes, root, RATE_STEPS, NAME, routes=routes,
                          rings_generated=generated)


@functools.lru_cache(maxsize=16)
def pack_rings(topo):
    """``(cycles, rates, routes, rings generated)`` for ``topo``, or the :class:`PlanError` saying why
    not: the same for every collective and size, so worked out once per topology."""
    p = topo.nranks
    if p < 3:
        return PlanError(f"{NAME}: {counted(p, 'rank')} {'has' if p == 1 else 'have'} one ring at most (both directions "
                         f"are the same pair)")
    if p > MAX_RANKS:
        return PlanError(f"{NAME}: pricing rings is exponential in the ranks; up to {MAX_RANKS} ranks, "
                         f"not {p} ('ring-channels' and 'hierarchical' plan this size)")
    single = repeats_a_base(topo)
    if single:
        return PlanError(f"{NAME}: {single.split(':')[0]}: the rings of 'ring-channels' are all there is")
    start, start_rates = choose_channels(topo, candidate_orders(topo))
    packing = RingPacking(topo, rank_paths(topo))
    cycles, rates, routes = packing.solve([[int(r) for r in order] for order in start])
    if sum(rates) <= sum(start_rates) * (1 + MIN_GAIN):
        return PlanError(f"{NAME}: routing rings over every path gains less than {MIN_GAIN:.0%} over the "
                         f"rings of 'ring-channels' (it would repeat 'ring-channels')")
    return tuple(tuple(c) for c in cycles), tuple(rates), routes, packing.generated


def rank_paths(topo):
    """``{(a, b): (path, ...)}``: for every ordered rank pair, the :data:`MAX_PATHS` shortest paths
    that pass through no other rank (ties in node order), of at most :data:`MAX_PATH_LINKS` links, or
    :data:`PATH_DETOUR` more than the pair's shortest where that is longer; only the direct link
    where the two ranks have one. Transports take that link and no other (a CUDA peer
    copy between GPUs joined by NVLink goes over NVLink, never through their shared PCIe switch), so a
    plan that split such a pair's traffic could not be run as planned."""
    graph = topo.usable_graph()
    ranks = list(topo.ranks)
    others = set(ranks)
    paths = {}
    for a, b in itertools.permutations(range(len(ranks)), 2):
        if graph.has_edge(ranks[a], ranks[b]):
            paths[(a, b)] = ((ranks[a], ranks[b]),)
            continue
        allowed = graph.subgraph([v for v in graph if v not in others or v in (ranks[a], ranks[b])])
        found = _shortest_paths(allowed, ranks[a], ranks[b])
        if not found:
            raise PlanError(f"{NAME}: no path from rank {a} to rank {b} avoids the other ranks")
        paths[(a, b)] = found
    return paths


def _shortest_paths(graph, a, b):
    """The :data:`MAX_PATHS` shortest simple paths from ``a`` to ``b``, ties in node order, none longer
    than the limit :func:`rank_paths` states. Paths come in order of length (Yen's algorithm), so only
    those that can make the cut are found: a fabric's longer detours are never listed."""
    found, limit = [], None
    try:
        for path in nx.shortest_simple_paths(graph, a, b):
            links = len(path) - 1
            limit = limit or max(MAX_PATH_LINKS, links + PATH_DETOUR)
            if links > limit or (len(found) >= MAX_PATHS and links > len(found[MAX_PATHS - 1]) - 1):
                break
            found.append(tuple(path))
    except nx.NetworkXNoPath:
        pass
    return tuple(sorted(found, key=lambda x: (len(x), x))[:MAX_PATHS])


class RingPacking:
    """The ring-packing programme on one fabric: columns are rings, rows rank pairs and links."""

    def __init__(self, topo, paths):
        self.topo = topo
        self.p = topo.nranks
        self.pairs = sorted(paths)
        self.pair_index = {q: i for i, q in enumerate(self.pairs)}
        self.paths = [(i, path) for i, q in enumerate(self.pairs) for path in paths[q]]
        links = {}
        rows, cols = [], []
        for t, (_, path) in enumerate(self.paths):
            for link in zip(path[:-1], path[1:]):
                rows.append(links.setdefault(link, len(links)))
                cols.append(t)
        cap = np.array([float(topo.capacity(u, v)) for u, v in links])
        self.unit = float(cap.max())           # rates in units of the widest link: a well-scaled LP
        self.cap = cap / self.unit
        self.link_paths = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(links), len(self.paths)))
        pair_of = [i for i, _ in self.paths]
        self.pair_paths = sp.csr_matrix((np.ones(len(pair_of)), (pair_of, range(len(pair_of)))),
                                        shape=(len(self.pairs), len(pair_of)))
        self.length = np.array([len(path) - 1 for _, path in self.paths], dtype=float)
        fewest = {}
        for (i, _), n in zip(self.paths, self.length):
            fewest[i] = min(fewest.get(i, np.inf), n)
        self.tie = np.zeros((self.p, self.p))
        for i, (a, b) in enumerate(self.pairs):
            self.tie[a, b] = TIE * fewest[i] / MAX_PATH_LINKS
        self.generated = 0

    def solve(self, cycles):
        """``(cycles, rates, routes)``: of the selections :meth:`_selections` makes among the rings
        generated from ``cycles`` up to the optimum over all rings, the one that runs fastest; rates in
        bytes/s per hop, routes as :attr:`Schedule.routes`."""
        cycles = [list(c) for c in cycles]
        seen = {tuple(c) for c in cycles}
        while True:
            best, _, prices = self._lp(cycles)
            if self.generated == MAX_ROUNDS:
                break
            cycle, price = self.cheapest_ring(prices)
            if price >= 1 - PRICE_TOL or tuple(cycle) in seen:
                break
            cycles.append(cycle)
            seen.add(tuple(cycle))
            self.generated += 1
        return min(self._selections(cycles, best), key=lambda x: x[0])[1:]

    def _selections(self, cycles, best):
        """``(simulated seconds, cycles, rates, routes)`` of the rings kept at every share of
        :data:`KEEPS`. The LP counts rates; the fabric shares each link fairly between the rings on it,
        so selections of equal rate run differently (DGX-1: 152.7 and 137 GB/s of bus bandwidth
        for 154 and 152 in the LP): the allreduce of :data:`SELECT_BYTES` is simulated on each."""
        done = set()
        for keep in KEEPS:
            kept = self._fewest(cycles, best, keep)
            if tuple(kept) in done:
                continue
            done.add(tuple(kept))
            chosen = [cycles[j] for j in kept]
            _, x, _ = self._lp(chosen)
            rates = [float(r) * self.unit for r in x]
            if max(rates) <= 0:     # every ring's rate under the LP's tolerance, in units of the widest link
                raise PlanError(f"{NAME}: the rings' links are too slow beside the widest link "
                                f"({format_bandwidth(self.unit)}) for the LP to rate them")
            routes = self._routes(self._shortest_routing(chosen, x))
            trial = rated_channels(chosen, rates, "allreduce", SELECT_BYTES, 0, RATE_STEPS, NAME, routes=routes)
            yield simulate(self.topo, trial, SELECT_BYTES).seconds, chosen, rates, routes

    # ---- the programmes ----------------------------------------------------------------------------
    def _uses(self, cycles):
        """Pairs x rings: how many hops of each ring join each ordered pair (0 or 1)."""
        rows, cols = [], []
        for j, c in enumerate(cycles):
            for i in range(len(c)):
                rows.append(self.pair_index[(c[i], c[(i + 1) % len(c)])])
                cols.append(j)
        return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(self.pairs), len(cycles)))

    def _rows(self, cycles):
        """``(A, b)`` over columns ``[x (rings), y (paths)]``: pair rows, then link rows."""
        a = sp.vstack([sp.hstack([self._uses(cycles), -self.pair_paths]),
                       sp.hstack([sp.csr_matrix((self.link_paths.shape[0], len(cycles))), self.link_paths])]).tocsr()
        return a, np.concatenate([np.zeros(len(self.pairs)), self.cap])

    def _lp(self, cycles):
        """``(optimum, x, pair prices)``, the prices as a p x p matrix."""
        a, b = self._rows(cycles)
        c = np.concatenate([-np.ones(len(cycles)), np.zeros(len(self.paths))])
        res = linprog(c, A_ub=a, b_ub=b, bounds=(0, None), method="highs")
        if res.status != 0:
            raise PlanError(f"{NAME}: the ring LP failed ({res.message})")
        prices = np.zeros((self.p, self.p))
        for (s, d), u in zip(self.pairs, -res.ineqlin.marginals[:len(self.pairs)]):
            prices[s, d] = max(u, 0.0)
        return -res.fun, res.x[:len(cycles)], prices

    def cheapest_ring(self, prices):
        """The Hamiltonian cycle (from rank 0) of least total price, ties to fewer links; and its price."""
        order = held_karp(prices + self.tie)
        return order, float(sum(prices[order[i], order[(i + 1) % self.p]] for i in range(self.p)))

    def _fewest(self, cycles, best, keep):
        """Indices of the fewest rings whose packing reaches ``keep * best`` (a MILP: one binary per
        ring), every ring where the MILP finds no selection, cut to the first :data:`MAX_CHANNELS`
        either way (the rings of ``ring-channels`` come first). The MILP stops after
        :data:`SELECT_NODES` branch-and-bound nodes, not after a time, so every rank keeps the same
        rings whatever its load. (Keeping, among the selections of at most ``MAX_CHANNELS`` rings, the
        one that carries the most gains 1% more in the LP on a DGX-1 and loses 15% in the simulator:
        its many thin rings share PCIe links fairly, not by their rates.)"""
        a, b = self._rows(cycles)
        nj, nt = len(cycles), len(self.paths)
        on = sp.hstack([sp.identity(nj), sp.csr_matrix((nj, nt)), -best * sp.identity(nj)])   # x_j <= best z_j
        total = np.concatenate([np.ones(nj), np.zeros(nt + nj)])
        constraints = [LinearConstraint(sp.hstack([a, sp.csr_matrix((a.shape[0], nj))]), -np.inf, b),
                       LinearConstraint(on, -np.inf, 0),
                       LinearConstraint(total, keep * best, np.inf)]
        cost = np.concatenate([np.zeros(nj + nt), np.ones(nj)])
        upper = np.concatenate([np.full(nj + nt, np.inf), np.ones(nj)])
        with _native_stdout_silenced():    # no presolve: on the DGX-1 its selections ran 0.5% slower
            res = milp(cost, constraints=constraints, integrality=cost, bounds=Bounds(0, upper),
                       options={"node_limit": SELECT_NODES, "presolve": False})
        kept = [] if res.x is None else [j for j in range(nj) if res.x[nj + nt + j] > 0.5]
        # No ring kept: rates are fractions of the widest link's, and where links differ a million-fold
        # ``best`` falls below the solver's feasibility tolerance, so x_j <= best z_j holds with every
        # z_j = 0. Then, as where the MILP finds nothing, every ring.
        return (kept or list(range(nj)))[:MAX_CHANNELS]

    def _shortest_routing(self, cycles, rates):
        """Path flows that carry the rings at ``rates`` over the fewest links."""
        a, b = self._rows(cycles)
        nj = len(cycles)
        res = linprog(np.concatenate([np.zeros(nj), self.length]), A_ub=a, b_ub=b,
                      bounds=[(r, r) for r in rates] + [(0, None)] * len(self.paths), method="highs")
        if res.status != 0:
            raise PlanError(f"{NAME}: the routing LP failed ({res.message})")
        return res.x[nj:]

    def _routes(self, flows):
        """``{(a, b): ((path, share), ...)}`` for every pair that carries flow."""
        by_pair = {}
        for (i, path), f in zip(self.paths, flows):
            if f > 1e-9:
                by_pair.setdefault(self.pairs[i], []).append((path, f))
        routes = {}
        for pair, found in by_pair.items():
            total = sum(f for _, f in found)
            routes[pair] = tuple(sorted(((path, f / total) for path, f in found), key=lambda x: (-x[1], x[0])))
        return routes


@contextlib.contextmanager
def _native_stdout_silenced():
    """HiGHS' MIP heuristics (scipy 1.17) print debug lines straight to file descriptor 1, whatever
    the output options say; ``ddl plan --json`` must print its JSON and nothing else."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def held_karp(cost):
    """The Hamiltonian cycle from vertex 0 of least total ``cost[a][b]``: the exact dynamic programme
    over subsets of the other vertices, ``dp[S, k]`` = the cheapest path from 0 through ``S`` ending
    at ``k``, computed for all subsets of one size at a time (numpy over the subsets)."""
    n = len(cost)
    cost = np.asarray(cost, dtype=float)
    if n < 3:
        return list(range(n))
    m = n - 1                                   # vertex k (1..n-1) is bit k-1
    masks = np.arange(1 << m)
    size = sum((masks >> i) & 1 for i in range(m))
    dp = np.full((1 << m, n), np.inf)
    parent = np.zeros((1 << m, n), dtype=np.int64)
    for k in range(1, n):
        dp[1 << (k - 1), k] = cost[0, k]
    for count in range(2, m + 1):
        layer = masks[size == count]
        for k in range(1, n):
            bit = 1 << (k - 1)
            ending = layer[(layer & bit) != 0]
            through = dp[ending ^ bit] + cost[:, k]    # the path without k, then on to k
            best = through.argmin(axis=1)
            dp[ending, k] = through[np.arange(len(ending)), best]
            parent[ending, k] = best
    s = (1 << m) - 1
    last = int(np.argmin(dp[s, 1:] + cost[1:, 0])) + 1
    order = []
    while s:
        order.append(last)
        prev = int(parent[s, last])
        s &= ~(1 << (last - 1))
        last = prev
    return [0] + order[::-1]
