"""Multi-commodity-flow routing: a base schedule's transfers spread over every path of the fabric.

Sources: M. Cho et al., "PowerAI DDL", arXiv:1708.02188, 2017 (collectives on multi-tier networks as a
flow problem over the links of every tier); X. Liu et al., "Rethinking machine learning collective
communication as a multi-commodity flow problem" (TE-CCL), SIGCOMM 2024; the edge-based LP and path
decomposition are textbook (Ahuja, Magnanti & Orlin, "Network Flows", 1993, ch. 17 and 3.5).

Idea
====
A schedule fixes *what* moves between which ranks (ring hops, tree edges); the topology's routes fix
*how*: the widest, then shortest, paths. On fabrics with several paths of different widths -- two
spines of unequal uplinks, several rails, GPUs without NVLink between them over PCIe and the CPUs
-- widest-path routing leaves the narrower paths idle. Ranks joined by a direct link exchange over it
alone, as transports do (a CUDA peer copy between GPUs joined by NVLink never goes through their
PCIe switch), so the LP never splits such a pair. This planner keeps the programs of a base schedule and routes its
traffic with a linear program, pinning the result in :attr:`Schedule.routes`.

The LP (:func:`solve_commodities`)
==================================
Commodities are the bytes each rank pair exchanges over the whole collective (the *demands*). One
commodity per source rank (its destinations aggregated: ``p * E`` flow variables instead of
``p^2 * E``). For source ``s`` the flow lives on the usable graph in which rank vertices other than
``s`` have no outgoing edges (ranks never forward data, and GPUs outside the job are not in the usable
graph at all), ``s`` has no incoming ones, and only the destinations of ``s`` may be entered among the
ranks, a destination joined to ``s`` by a direct link over that link alone. Then::

    minimise T   s.t.   out_s(v) - in_s(v) = b_s(v)            every source s, vertex v
                        sum_s x_s(e) <= cap(e) * T              every directed link e,     x >= 0

with ``b_s(s) = sum of s's demands``, ``b_s(t) = -demand(s, t)``. ``T`` is the time in which all
demands could cross the fabric if every link were busy all the time: the completion time of the
traffic, and exactly the time of a ring's bandwidth term (a ring repeats one traffic pattern).
A second LP fixes ``T <= T* (1 + 1e-6)`` and minimises ``sum_e cost(e) x(e)``, ``cost(e) = 1 +
latency(e)/min latency + min capacity/capacity(e)``: no bandwidth is lost, non-bottleneck traffic takes
few hops on fast tiers, and flow cycles vanish. Each commodity's flow is then decomposed into paths per
destination (widest edge first, cycles and numerical dust cancelled); shares below 1e-6 are dropped
and the rest renormalised. HiGHS' simplex returns a vertex of the polytope, so few pairs are split.

Numerics. HiGHS works to absolute tolerances (1e-7) and drops matrix entries below 1e-9, so the LP is
solved in well-scaled units: each commodity's flow as fractions of its total (destinations of a source
a thousandfold apart in demand form separate commodities), capacity rows as link times (divided by
``cap(e)``; rows in bytes where capacities are over 1e15 apart). Routes that come out more than 1e-3
slower than the LP's optimum, or a failed solve, raise :class:`PlanError` naming the ranges involved.

Phases. A hierarchical schedule's stages run one after the other, so what matters is the sum of the
stages' bottleneck times, not the bottleneck of their sum. :func:`schedule_phases` places every
transfer in its earliest synchronous round of the dataflow and merges rounds with proportional
traffic; the LP then has one ``T_k`` and one set of capacity rows per phase and minimises
``sum_k weight_k T_k`` (a pair keeps one routing for all phases; destinations of a source whose traffic
has the same phase profile still share a commodity). A ring has one phase: the plain LP above.

Size: only edges that can lie on a simple path from the source to one of its destinations take part
(the blocks of the block-cut tree of the undirected fabric on the way between them, then directed
reachability), which on tree-shaped tiers leaves exactly the one path. The matrices are
``scipy.sparse``; at 192 ranks an LP takes a fraction of a second (see the tests).

The schedule (:func:`multicommodity_flow`)
==========================================
Base schedules: ring (for broadcast, its pipelined chain), hierarchical, and tree packing when it is
registered. Each base's traffic is routed; the base is chosen by the synchronous-rounds estimate
(:func:`rounds_estimate`: a round lasts its most loaded link's bytes over capacity plus its longest
path latency). The LP routes replace the base's own routing only when they beat it in the LP's
objective without loading any link more over the whole collective (a base that routes itself
optimally, like tree packing, keeps its routes), and when they predict faster -- by the simulator when
the schedule is small enough to simulate cheaply, by the rounds estimate otherwise. So with one path
per pair, or for small latency-bound messages where spreading only adds hops, the result *is* the
base (its routes spelled out), and its prediction the base's.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from ..errors import PlanError, ScheduleError
from ..schedule import OP_KINDS, SEND, Schedule
from .ring import check_request

NAME = "multicommodity-flow"
BASES = ("ring", "hierarchical", "tree-packing")
MIN_SHARE = 1e-6           # path shares below this are dropped (and the rest renormalised)
T_SLACK = 1e-6             # second LP: T <= T* (1 + T_SLACK)
SIM_OPS_LIMIT = 6000       # schedules with at most this many ops are simulated to decide the routing
IMPROVEMENT = 1e-6         # the LP must beat the base routing's bottleneck by this much (relative)
REFERENCE_BYTES = 1 << 30  # buffer size assumed for decisions when nbytes is None (bandwidth regime)
MAX_PHASES = 64            # more distinct traffic phases than this: one aggregate phase
DEMAND_DECADES = 3         # a source's destinations share a commodity within this many orders of magnitude
MAX_EXCESS = 1e-3          # LP routes slower than the LP's optimum by more than this: a numerical failure
_CACHE_SIZE = 64           # routings and fabrics kept per process
_PLAN_CACHE_SIZE = 16      # schedules kept per process (a 192-rank ring has ~150k operations)

__all__ = ["Routing", "route_commodities", "solve_commodities", "pair_demands", "schedule_phases",
           "multicommodity_flow", "default_routes", "rounds_estimate", "repeats_a_base"]


class Routing(NamedTuple):
    """Result of :func:`solve_commodities`.

    ``routes``: ``{(src, dst): ((path, share), ...)}`` (shares sum to 1, largest first). ``seconds``:
    the LP's optimum ``T`` (demand units over bytes/s: seconds when demands are bytes). ``link_load``:
    ``{(u, v): demand units}`` that the routes put on every loaded directed link (all phases).
    ``max_utilisation``: the routes' bottleneck time (per phase, weighted) over ``T``: 1 up to the
    dropped shares.
    """
    routes: dict
    seconds: float
    link_load: dict
    max_utilisation: float


_ROUTE_CACHE = OrderedDict()    # (fingerprint, phases) -> Routing
_PLAN_CACHE = OrderedDict()     # (fingerprint, collective, root, nbytes, bases) -> Schedule
_FABRICS = OrderedDict()        # fingerprint -> _Fabric


def _remember(cache, key, value, size=None):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > (size or _CACHE_SIZE):
        cache.popitem(last=False)
    return value


# ----------------------------------------------------------------------------------------------------
# the LP


def route_commodities(topo, demands):
    """``{(src, dst): ((path, share), ...)}`` routing ``demands`` (``{(src_rank, dst_rank): bytes}``)
    over ``topo`` in the least completion time; see the module docstring and :func:`solve_commodities`."""
    return solve_commodities(topo, demands).routes


def solve_commodities(topo, demands=None, *, phases=None):
    """The multi-commodity-flow LP on ``topo``; returns a :class:`Routing` (cached per topology and
    demands). Raises :class:`PlanError` when a demand has no path or the LP fails.

    ``demands``: ``{(src, dst): bytes}`` that are all in flight together: minimise their completion
    time ``T``. Or ``phases``: ``[(weight, {(src, dst): bytes}), ...]``, traffic patterns that follow
    one another (``weight`` times each): minimise ``sum weight * T_phase``, one route per pair for all
    phases. Destinations of a source whose traffic is spread over the phases in the same proportions
    form one commodity; with a single phase that is one commodity per source."""
    if (demands is None) == (phases is None):
        raise PlanError(f"{NAME}: give either demands or phases")
    if phases is None:
        phases = [(1.0, demands)]
    clean = []
    for weight, pattern in phases:
        weight = float(weight)
        if not weight >= 0 or math.isinf(weight):
            raise PlanError(f"{NAME}: phase weight must be finite and non-negative, got {weight!r}")
        out = {}
        for (s, d), b in pattern.items():
            s, d, b = int(s), int(d), float(b)
            if not (0 <= s < topo.nranks and 0 <= d < topo.nranks):
                raise PlanError(f"{NAME}: demand {s} -> {d} names a rank outside 0..{topo.nranks - 1}")
            if not b >= 0 or math.isinf(b):
                raise PlanError(f"{NAME}: demand {s} -> {d} must be a finite non-negative size, got {b!r}")
            if s != d and b > 0 and weight > 0:
                out[(s, d)] = out.get((s, d), 0.0) + b
        if out:
            clean.append((weight, tuple(sorted(out.items()))))
    if not clean:
        return Routing({}, 0.0, {}, 0.0)
    key = (topo.fingerprint, tuple(clean))
    if key in _ROUTE_CACHE:
        _ROUTE_CACHE.move_to_end(key)
        return _ROUTE_CACHE[key]
    return _remember(_ROUTE_CACHE, key, _Problem(topo, [(w, dict(p)) for w, p in clean]).solve())


class _Fabric:
    """The usable graph as arrays, with the block-cut tree used to prune each commodity's edges."""

    def __init__(self, topo):
        import networkx as nx

        graph = topo.usable_graph()
        self.vertices = list(graph.nodes)
        self.vindex = {v: i for i, v in enumerate(self.vertices)}
        self.edges = [(u, v) for u, v in graph.edges() if u != v]
        self.eindex = {e: i for i, e in enumerate(self.edges)}
        self.cap = np.array([float(graph[u][v]["capacity"]) for u, v in self.edges])
        self.lat = np.array([float(graph[u][v].get("latency", 0.0)) for u, v in self.edges])
        rank_vertices = set(topo.ranks)
        self.is_rank = np.array([v in rank_vertices for v in self.vertices])
        self.tail = np.array([self.vindex[u] for u, _ in self.edges], dtype=np.int64)
        self.head = np.array([self.vindex[v] for _, v in self.edges], dtype=np.int64)
        # blocks (biconnected components) of the undirected fabric and its block-cut tree: the edges of
        # every simple path between two vertices lie in the blocks on their tree path
        undirected = nx.Graph()
        undirected.add_nodes_from(range(len(self.vertices)))
        undirected.add_edges_from(zip(self.tail.tolist(), self.head.tolist()))
        blocks = [list(b) for b in nx.biconnected_component_edges(undirected)]
        block_of_pair = {}
        vertex_blocks = [set() for _ in self.vertices]
        for bi, block in enumerate(blocks):
            for a, b in block:
                block_of_pair[(a, b)] = block_of_pair[(b, a)] = bi
                vertex_blocks[a].add(bi)
                vertex_blocks[b].add(bi)
        nb = len(blocks)
        self.block_edges = [[] for _ in range(nb)]
        for e, (a, b) in enumerate(zip(self.tail.tolist(), self.head.tolist())):
            self.block_edges[block_of_pair[(a, b)]].append(e)
        self.tree_node = []           # vertex -> node of the block-cut tree
        tree = [[] for _ in range(nb)]
        for v, bs in enumerate(vertex_blocks):
            if len(bs) > 1:           # articulation point
                node = len(tree)
                tree.append(sorted(bs))
                for bi in bs:
                    tree[bi].append(node)
                self.tree_node.append(node)
            else:
                self.tree_node.append(next(iter(bs)) if bs else None)
        self.tree, self.nblocks = tree, nb

    def candidate_edges(self, source, targets):
        """Edge indices that may lie on a simple path from vertex ``source`` to one of ``targets``:
        the blocks on the block-cut-tree paths between them."""
        root = self.tree_node[source]
        parent = {root: None}
        queue = deque([root])
        while queue:
            x = queue.popleft()
            for y in self.tree[x]:
                if y not in parent:
                    parent[y] = x
                    queue.append(y)
        blocks = set()
        for t in targets:
            x = self.tree_node[t]
            if x not in parent:
                continue
            while x is not None:
                if x < self.nblocks:
                    if x in blocks:
                        break
                    blocks.add(x)
                x = parent[x]
        return sorted(e for b in blocks for e in self.block_edges[b])


class _Problem:
    def __init__(self, topo, phases):
        self.topo = topo
        self.phases = phases
        self.demands = {}
        for w, pattern in phases:
            for pair, b in pattern.items():
                self.demands[pair] = self.demands.get(pair, 0.0) + w * b
        self.fabric = _FABRICS.get(topo.fingerprint) or _remember(_FABRICS, topo.fingerprint, _Fabric(topo))

    # ---- per-commodity edge sets ---------------------------------------------------------------
    def _commodity_edges(self, s, dests):
        fab = self.fabric
        vs = fab.vindex[self.topo.ranks[s]]
        targets = {fab.vindex[self.topo.ranks[d]] for d in dests}
        cand = fab.candidate_edges(vs, targets)
        # a destination joined to the source by a direct link is reached over that link alone
        linked = {t for t in targets if (self.topo.ranks[s], fab.vertices[t]) in fab.eindex}
        keep = []
        for e in cand:
            u, v = fab.tail[e], fab.head[e]
            if v == vs or (fab.is_rank[u] and u != vs) or (fab.is_rank[v] and v not in targets):
                continue
            if v in linked and u != vs:
                continue
            keep.append(e)
        # directed reachability: forward from the source, backward from the destinations
        out, inc = {}, {}
        for e in keep:
            out.setdefault(int(fab.tail[e]), []).append(e)
            inc.setdefault(int(fab.head[e]), []).append(e)
        fwd = _reach(vs, out, fab.head)
        bwd = set()
        for t in sorted(targets):
            bwd |= _reach(t, inc, fab.tail)
        missing = sorted(d for d in dests if fab.vindex[self.topo.ranks[d]] not in fwd)
        if missing:
            raise PlanError(f"{NAME}: rank {s} cannot reach rank {missing[0]} without passing through "
                            f"another rank or a GPU")
        return [e for e in keep if int(fab.tail[e]) in fwd and int(fab.head[e]) in bwd]

    def _commodities(self):
        """``[(source, {dst: total bytes}, (per-instance share of the total in every phase))]``:
        destinations of one source with proportional phase profiles share a commodity."""
        groups = {}
        for (s, d), total in sorted(self.demands.items()):
            profile = tuple(pattern.get((s, d), 0.0) / total for _, pattern in self.phases)
            # destinations a thousandfold apart in demand do not share a commodity: the LP's rows are
            # in fractions of a commodity's total, and a destination at a billionth of it would be lost
            # within HiGHS' tolerances (routed nowhere)
            magnitude = math.floor(math.log10(total) / DEMAND_DECADES)
            key = (s, tuple(float(f"{x:.9g}") for x in profile), magnitude)
            groups.setdefault(key, ({}, profile))[0][d] = total
        return [(s, dests, profile) for (s, _, _), (dests, profile) in groups.items()]

    # ---- the two LPs ---------------------------------------------------------------------------
    def solve(self):
        fab, topo = self.fabric, self.topo
        coms = self._commodities()
        weights = np.array([w for w, _ in self.phases])
        nphase = len(weights)
        totals = np.array([sum(dests.values()) for _, dests, _ in coms])
        scale = float(totals.max())
        cmax = float(fab.cap.max())
        ncap = fab.cap / cmax
        weight_of = totals / scale             # a commodity's flow variables are fractions of its total

        com_edges = [np.array(self._commodity_edges(s, dests), dtype=np.int64) for s, dests, _ in coms]
        sizes = np.array([len(x) for x in com_edges], dtype=np.int64)
        var_edge = np.concatenate(com_edges)
        var_com = np.repeat(np.arange(len(coms)), sizes)
        nx_ = len(var_edge)
        nvar = nx_ + nphase                    # flows, then one T per phase

        # conservation rows: (commodity, vertex) pairs that occur, numbered
        nv = len(fab.vertices)
        key_t = var_com * nv + fab.tail[var_edge]
        key_h = var_com * nv + fab.head[var_edge]
        row_keys, inverse = np.unique(np.concatenate([key_t, key_h]), return_inverse=True)
        rt, rh = inverse[:nx_], inverse[nx_:]
        a_eq = sp.csr_matrix((np.concatenate([np.ones(nx_), -np.ones(nx_)]),
                              (np.concatenate([rt, rh]), np.concatenate([np.arange(nx_)] * 2))),
                             shape=(len(row_keys), nvar))
        b_eq = np.zeros(len(row_keys))
        row_of = {int(k): i for i, k in enumerate(row_keys)}
        for k, (s, dests, _) in enumerate(coms):
            b_eq[row_of[k * nv + fab.vindex[topo.ranks[s]]]] = 1.0
            for d, b in dests.items():
                b_eq[row_of[k * nv + fab.vindex[topo.ranks[d]]]] = -b / totals[k]

        # capacity rows, per phase: sum_c profile_c(phase) x_c(e) <= cap(e) T_phase, for the links
        # that the commodities active in the phase may use. First each row divided by cap(e) (T's
        # coefficient -1): HiGHS drops matrix entries below 1e-9, so a link a billion times slower
        # than the fastest would lose its capacity term, the LP turning "infeasible" where that link is
        # needed; and its tolerances then bound every link's time rather than its bytes. Where that
        # form's entries pass HiGHS' ceiling (1e15: capacities that far apart), rows in bytes: the
        # slowest links drop out, harmless where faster paths exist (the check below catches the rest)
        profiles = np.array([profile for _, _, profile in coms]).reshape(len(coms), nphase)
        c1 = np.zeros(nvar)
        c1[nx_:] = weights
        for per_time in (True, False):
            rows, cols, vals, nrows = [], [], [], 0
            for ph in range(nphase):
                beta = profiles[var_com, ph] * weight_of[var_com]
                active = np.flatnonzero(beta > 0)
                used, erow = np.unique(var_edge[active], return_inverse=True)
                rows += [erow + nrows, np.arange(len(used)) + nrows]
                cols += [active, np.full(len(used), nx_ + ph)]
                if per_time:
                    vals += [beta[active] / ncap[var_edge[active]], -np.ones(len(used))]
                else:
                    vals += [beta[active], -ncap[used]]
                nrows += len(used)
            a_ub = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                                 shape=(nrows, nvar))
            b_ub = np.zeros(nrows)
            res = linprog(c1, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
            if res.status == 0 and res.x is not None:
                break
        else:
            # every demand has a path and T is free: the LP is feasible and bounded, so a failure is
            # numerical (or a limit), and the ranges involved say why
            raise PlanError(f"{NAME}: the routing LP failed ({res.message.strip()}); {self._ranges()}")
        opt = float(res.fun)
        x = res.x

        # second LP: no slower than the optimum, fewest hops on the fastest links
        lat = fab.lat
        pos = lat[lat > 0]
        lat_ref = float(pos.min()) if len(pos) else 1.0
        cost = 1.0 + lat / lat_ref + float(fab.cap.min()) / fab.cap
        c2 = np.concatenate([cost[var_edge] * weight_of[var_com], np.zeros(nphase)])
        a_ub2 = sp.vstack([a_ub, sp.csr_matrix(c1)]).tocsr()
        b_ub2 = np.concatenate([b_ub, [opt * (1 + T_SLACK) + 1e-12]])
        res2 = linprog(c2, A_ub=a_ub2, b_ub=b_ub2, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
        if res2.status == 0 and res2.x is not None:
            x = res2.x

        routes = {}
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for k, (s, dests, _) in enumerate(coms):
            routes.update(_decompose(fab, topo, s, dests, totals[k], com_edges[k], x[offsets[k]:offsets[k + 1]]))

        seconds = opt * scale / cmax
        util = _phased_time(topo, self.phases, routes) / seconds if seconds > 0 else 0.0
        # the routes must realise the optimum they were solved for (up to the dropped shares and the
        # second LP's slack): anything else is HiGHS working past its tolerances, and a route that
        # puts a sliver of traffic on a link a billion times slower would be silently wrong
        if not (seconds > 0 and util <= 1 + MAX_EXCESS):
            raise PlanError(f"{NAME}: the routing LP is numerically unreliable (its routes take "
                            f"{util:.6g} times its optimum); {self._ranges()}")
        return Routing(routes, seconds, _link_loads(self.demands, routes), float(util))

    def _ranges(self):
        """What makes the LP hard for a floating-point solver: the spread of capacities and demands."""
        cap = self.fabric.cap
        dem = np.array(list(self.demands.values()))
        return (f"link capacities span {cap.min():.3g} to {cap.max():.3g} bytes/s and demands "
                f"{dem.min():.3g} to {dem.max():.3g}: {math.log10(cap.max() / cap.min()):.0f} and "
                f"{math.log10(dem.max() / dem.min()):.0f} orders of magnitude")


def _reach(start, adjacency, other_end):
    seen = {start}
    stack = [start]
    while stack:
        u = stack.pop()
        for e in adjacency.get(u, ()):
            w = int(other_end[e])
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return seen


def _decompose(fab, topo, s, dests, scale, edges, flows):
    """Paths (with shares) per destination from one commodity's edge flows.

    Walk from the source along the edge with the most remaining flow, never revisiting a vertex of the
    walk; on reaching a destination with demand left, carry the walk's bottleneck (at most that demand)
    and subtract it. A dead end (flow that goes nowhere: a cycle or numerical dust) loses the edge that
    led into it. Every step zeroes an edge or a demand, so at most ``|edges| + |dests|`` walks."""
    total = sum(dests.values()) / scale
    tol = 1e-9 * total
    vs = fab.vindex[topo.ranks[s]]
    target_of = {fab.vindex[topo.ranks[d]]: d for d in dests}
    remaining = {d: b / scale for d, b in dests.items()}
    out = {}
    flow = {}
    for e, f in zip(edges.tolist(), flows.tolist()):
        if f > tol:
            out.setdefault(int(fab.tail[e]), []).append(e)
            flow[e] = f
    found = {d: {} for d in dests}
    left = total
    for _ in range(2 * (len(edges) + len(dests)) + 2):
        if left <= tol * len(dests):
            break
        path_v, path_e, on = [vs], [], {vs}
        u = vs
        reached = None
        while True:
            best = None
            for e in out.get(u, ()):
                f = flow.get(e, 0.0)
                if f <= tol:
                    continue
                w = int(fab.head[e])
                if w in on:
                    continue
                if w in target_of:
                    if remaining[target_of[w]] <= tol:
                        continue
                elif fab.is_rank[w]:
                    continue
                if best is None or f > flow[best]:
                    best = e
            if best is None:
                if not path_e:
                    left = 0.0    # nothing leaves the source any more
                    break
                flow[path_e[-1]] = 0.0
                break
            w = int(fab.head[best])
            path_e.append(best)
            path_v.append(w)
            on.add(w)
            if w in target_of:
                reached = target_of[w]
                break
            u = w
        if reached is None:
            continue
        amount = min(min(flow[e] for e in path_e), remaining[reached])
        for e in path_e:
            flow[e] -= amount
        remaining[reached] -= amount
        left -= amount
        key = tuple(fab.vertices[i] for i in path_v)
        found[reached][key] = found[reached].get(key, 0.0) + amount
    routes = {}
    for d, paths in found.items():
        tot = sum(paths.values())
        if not tot > 0:
            raise PlanError(f"{NAME}: the LP routed no flow from rank {s} to rank {d}")
        kept = {p: a / tot for p, a in paths.items() if a / tot >= MIN_SHARE}
        norm = sum(kept.values())
        routes[(s, d)] = tuple(sorted(((p, a / norm) for p, a in kept.items()), key=lambda x: (-x[1], x[0])))
    return routes


# ----------------------------------------------------------------------------------------------------
# schedules: demands, default routes, the rounds estimate


def pair_demands(schedule, nbytes=None):
    """``{(src, dst): bytes}`` a schedule moves between every rank pair over the whole collective
    (``chunk_fraction * nbytes`` per transfer; fractions of the buffer when ``nbytes`` is None)."""
    frac = schedule.chunk_fractions
    scale = 1.0 if nbytes is None else float(nbytes)
    out = {}
    for r, prog in enumerate(schedule.programs):
        for op in prog:
            if op.kind == SEND:
                out[(r, op.peer)] = out.get((r, op.peer), 0.0) + float(frac[op.chunk]) * scale
    return {k: v for k, v in out.items() if v > 0}


def default_routes(topo, schedule, pairs):
    """The routing a schedule gets without the LP: its own pinned routes, else the topology's routes
    split evenly (what :func:`ddl.simulate.simulate` does)."""
    out = {}
    for s, d in pairs:
        pinned = schedule.routes.get((s, d))
        if pinned is not None:
            total = sum(w for _, w in pinned)
            out[(s, d)] = tuple((tuple(p), w / total) for p, w in pinned if w > 0)
        else:
            paths = topo.routes(s, d)
            out[(s, d)] = tuple((tuple(p), 1.0 / len(paths)) for p in paths)
    return out


def _transfer_rounds(schedule):
    """``(round, src, dst, chunk)`` of every transfer, ``round`` being its earliest start in a
    synchronous execution of the dataflow (a transfer takes one round; see :mod:`ddl.schedule`)."""
    try:
        df = schedule.dataflow
    except ScheduleError as exc:
        raise PlanError(f"{NAME}: the base schedule is not a valid schedule: {exc}") from None
    kind, rank, chunk, partner, dependents = df.kind, df.rank, df.chunk, df.partner, df.dependents
    send = OP_KINDS.index(SEND)
    waiting = [w + (k != send) for w, k in zip(df.waiting, kind)]   # a receive also waits for its send
    ready_at = [0] * len(kind)   # round at which every dependency (and, for a receive, the data) is there
    queue = deque(g for g, w in enumerate(waiting) if not w)
    out = []
    while queue:
        g = queue.popleft()
        done = ready_at[g]
        followers = dependents[g]
        if kind[g] == send:
            h = partner[g]
            out.append((done, rank[g], rank[h], chunk[g]))
            done += 1            # the data arrives one round later; the send completes then too
            followers = followers + [h]
        for h in followers:
            if done > ready_at[h]:
                ready_at[h] = done
            waiting[h] -= 1
            if not waiting[h]:
                queue.append(h)
    if len(out) != kind.count(send):
        raise PlanError(f"{NAME}: the base schedule deadlocks")
    return out


def rounds_estimate(topo, schedule, nbytes, routes, rounds=None):
    """Seconds a schedule takes in the synchronous-rounds model: every transfer in its earliest round
    (:func:`_transfer_rounds`), a round lasting its most loaded link's bytes over capacity plus the
    longest path latency among its transfers. Reductions and pipelining across rounds are ignored: a
    coarse, cheap figure for comparing routings and base schedules (the simulator is the reference)."""
    rounds = _transfer_rounds(schedule) if rounds is None else rounds
    if not rounds:
        return 0.0
    graph = topo.graph
    pairs = sorted({(s, d) for _, s, d, _ in rounds})
    pindex = {p: i for i, p in enumerate(pairs)}
    eindex = {}
    rows, cols, vals, plat = [], [], [], []
    for i, pair in enumerate(pairs):
        worst = 0.0
        for path, share in routes[pair]:
            if share <= 0:
                continue
            lat = 0.0
            for e in zip(path[:-1], path[1:]):
                j = eindex.setdefault(e, len(eindex))
                rows.append(i)
                cols.append(j)
                vals.append(share)
                lat += graph[e[0]][e[1]]["latency"]
            worst = max(worst, lat)
        plat.append(worst)
    caps = np.array([graph[u][v]["capacity"] for u, v in eindex])
    incidence = sp.csr_matrix((vals, (rows, cols)), shape=(len(pairs), len(eindex)))
    frac = schedule.chunk_fractions
    arr = np.array([(t, pindex[(s, d)], c) for t, s, d, c in rounds], dtype=np.int64)
    nrounds = int(arr[:, 0].max()) + 1
    per_round = sp.csr_matrix((frac[arr[:, 2]] * float(nbytes), (arr[:, 0], arr[:, 1])),
                              shape=(nrounds, len(pairs)))
    load = (per_round @ incidence).toarray() / caps[None, :]
    bandwidth = load.max(axis=1).sum()
    plat = np.array(plat)
    active = per_round.tocsr()
    latency = sum(float(plat[active.indices[active.indptr[t]:active.indptr[t + 1]]].max())
                  for t in range(nrounds) if active.indptr[t + 1] > active.indptr[t])
    return float(bandwidth + latency)


def _utilisation(topo, demands, routes):
    """``(bottleneck time, max, mean utilisation)`` of the links that ``routes`` load with the whole
    collective's ``demands``, utilisation being ``load / (capacity * bottleneck time)``: the mean
    says how evenly the traffic is spread (1 = every loaded link equally busy)."""
    load = _link_loads(demands, routes)
    if not load:
        return 0.0, 0.0, 0.0
    busy = np.array([v / topo.capacity(*e) for e, v in load.items()])
    top = float(busy.max())
    return top, 1.0, float(busy.mean() / top) if top > 0 else 0.0


def _link_loads(demands, routes):
    load = {}
    for pair, b in demands.items():
        for path, share in routes[pair]:
            for e in zip(path[:-1], path[1:]):
                load[e] = load.get(e, 0.0) + b * share
    return load


def _phased_time(topo, phases, routes):
    """``sum_phase weight * max_e load_phase(e) / cap(e)``: the bandwidth time of ``phases`` (see
    :func:`solve_commodities`) under ``routes``."""
    return sum(w * _max_load_time(topo, pattern, routes) for w, pattern in phases)


def _max_load_time(topo, demands, routes):
    """Bottleneck time ``max_e load(e) / cap(e)`` of ``demands`` under ``routes``."""
    load = _link_loads(demands, routes)
    return max((v / topo.capacity(*e) for e, v in load.items()), default=0.0)


# ----------------------------------------------------------------------------------------------------
# the planner


def schedule_phases(schedule, rounds=None, max_phases=None):
    """The traffic phases of a schedule for :func:`solve_commodities`: its transfers by synchronous
    round (:func:`_transfer_rounds`), rounds with proportional traffic merged into one phase
    ``(weight, {pair: fraction of the buffer})``. More than ``max_phases`` (default ``MAX_PHASES``)
    distinct phases collapse into one, the whole collective's demands: the plain completion-time LP."""
    max_phases = MAX_PHASES if max_phases is None else max_phases
    rounds = _transfer_rounds(schedule) if rounds is None else rounds
    frac = schedule.chunk_fractions
    per_round = {}
    for t, s, d, c in rounds:
        if frac[c] > 0:
            pattern = per_round.setdefault(t, {})
            pattern[(s, d)] = pattern.get((s, d), 0.0) + float(frac[c])
    phases = {}
    for t in sorted(per_round):
        pattern = per_round[t]
        top = max(pattern.values())
        norm = tuple(sorted((pair, float(f"{b / top:.12g}")) for pair, b in pattern.items()))
        phases[norm] = phases.get(norm, 0.0) + top
    if len(phases) > max_phases:
        return [(1.0, pair_demands(schedule))]
    return [(w, dict(norm)) for norm, w in phases.items()]


def multicommodity_flow(topo, collective, *, root=0, nbytes=None, bases=BASES):
    """A base schedule (ring/chain, hierarchical, tree packing) with its traffic routed by the
    multi-commodity-flow LP; see the module docstring. ``bases``: the names in
    :data:`ddl.algorithms.ALGORITHMS` to consider (those not registered are skipped). Cached per
    topology, collective, root, size and bases."""
    check_request(NAME, collective, topo.nranks, root)
    nbytes = _check_nbytes(nbytes)
    bases = tuple(bases)
    key = (topo.fingerprint, collective, int(root), nbytes, bases)
    if key in _PLAN_CACHE:
        _PLAN_CACHE.move_to_end(key)
        return _PLAN_CACHE[key]
    from . import ALGORITHMS

    size = float(nbytes) if nbytes else float(REFERENCE_BYTES)
    candidates = []
    reasons = {}
    for name in bases:
        fn = ALGORITHMS.get(name)
        if fn is None:
            continue
        try:
            # decide on the unpipelined form (same pairs and bytes, rounds alike, far fewer ops)
            probe = fn(topo, collective, root=root, nbytes=None)
        except PlanError as exc:
            reasons[name] = str(exc)
            continue
        candidates.append(_evaluate(topo, name, probe, size))
    if not candidates:
        raise PlanError(f"{NAME}: no base schedule for {collective} among {', '.join(bases)}: {reasons}")
    best = min(candidates, key=lambda c: c["estimate"])   # ties: the earlier (simpler) base
    probe = best["base"]
    if nbytes:
        base = ALGORITHMS[best["name"]](topo, collective, root=root, nbytes=nbytes)
        if (base.programs, base.pattern, base.spans) == (probe.programs, probe.pattern, probe.spans):
            base = probe
        elif base.routes != probe.routes or not _same_demands(pair_demands(base), best["demands"]):
            best = _evaluate(topo, best["name"], base, size)    # other traffic: route it afresh
    else:
        base = probe
    routing, demands = best["routing"], best["demands"]

    # The LP must beat the base's own routing in its objective (the phases' bottleneck times) without
    # loading the busiest link more over the whole collective (the steady state of a pipeline: a base
    # that already routes itself optimally for it, like tree packing, keeps its routes).
    improves = (best["lp_T"] < best["base_T"] * (1 - IMPROVEMENT)
                and best["lp_total_T"] <= best["base_total_T"] * (1 + IMPROVEMENT))
    use_lp, decided_by = improves and best["lp_estimate"] < best["base_estimate"], "rounds estimate"
    check = base if base.nops <= SIM_OPS_LIMIT else probe if probe.nops <= SIM_OPS_LIMIT else None
    if improves and check is not None:
        from ..simulate import simulate

        lp_s = simulate(topo, _with_routes(check, routing.routes), size).seconds
        base_s = simulate(topo, _with_routes(check, best["base_routes"]), size).seconds
        use_lp, decided_by = lp_s < base_s * (1 - 1e-9), "simulation"
    if not improves:
        decided_by = "the LP finds no routing faster per phase and no slower overall"
    routes = routing.routes if use_lp else best["base_routes"]
    unit = float(nbytes) if nbytes else 1.0
    bottleneck, max_util, mean_util = _utilisation(topo, demands, routes)
    info = {
        "base_algorithm": best["name"],
        "base_info": base.info,
        "routing": "lp" if use_lp else "base",
        "routing_decided_by": decided_by,
        "phases": len(best["phases"]),
        "lp_T": best["lp_T"] * unit,
        "base_T": best["base_T"] * unit,
        "T_unit": "seconds" if nbytes else "seconds per byte of buffer",
        "bottleneck_T": bottleneck * unit,
        "max_link_utilisation": max_util,
        "mean_link_utilisation": mean_util,
        "split_pairs": sum(1 for paths in routes.values() if len(paths) > 1),
        "paths": sum(len(paths) for paths in routes.values()),
        "estimates": {c["name"]: {"lp": c["lp_estimate"], "base": c["base_estimate"]} for c in candidates},
    }
    sched = _with_routes(base, routes, NAME, _jsonable(info))
    return _remember(_PLAN_CACHE, key, sched, _PLAN_CACHE_SIZE)


def _check_nbytes(nbytes):
    """``nbytes`` as a Python int (None stays None), or :class:`PlanError`. A size must be a whole,
    finite, non-negative number of bytes: NaN or infinity failed in ``int()`` with a ValueError or
    OverflowError, a negative size reached the simulator (a ScheduleError), text a TypeError deep in a
    base, and 1.5 shared the cache entry of 1 (the key held ``int(nbytes)``) while the bases saw 1.5."""
    if nbytes is None:
        return None
    if isinstance(nbytes, (bool, str, bytes)):
        raise PlanError(f"{NAME}: nbytes must be a number of bytes, got {nbytes!r}")
    try:
        value = float(nbytes)
        whole = int(nbytes)
    except (TypeError, ValueError, OverflowError):
        raise PlanError(f"{NAME}: nbytes must be a finite number of bytes, got {nbytes!r}") from None
    if not value >= 0 or whole != nbytes:
        raise PlanError(f"{NAME}: nbytes must be a whole non-negative number of bytes, got {nbytes!r}")
    return whole


def repeats_a_base(topo):
    """Why this algorithm can only repeat one of its bases on ``topo``, or None.

    When the fabric's undirected graph is a forest there is one path between any two ranks: the LP has
    nothing to choose and the result is a base schedule with its own routes. The planner builds and
    simulates every base anyway, so ``auto`` skips this one there (the three-tier trees of large
    clusters, where routing their traffic costs seconds and can gain nothing)."""
    import networkx as nx

    if nx.is_forest(nx.Graph(topo.usable_graph())):
        return "one path per rank pair (a tree-shaped fabric): nothing to route, it would repeat its base"
    return None


def _evaluate(topo, name, base, size):
    """Route one base schedule's traffic and estimate it both ways (LP routes, its own routing)."""
    rounds = _transfer_rounds(base)
    phases = schedule_phases(base, rounds)
    demands = pair_demands(base)                    # fractions of the buffer
    routing = solve_commodities(topo, phases=phases)
    base_routes = default_routes(topo, base, demands)
    lp_T = routing.seconds                          # seconds per byte of buffer
    base_T = _phased_time(topo, phases, base_routes)
    base_est = rounds_estimate(topo, base, size, base_routes, rounds)
    lp_est = rounds_estimate(topo, base, size, routing.routes, rounds) if lp_T < base_T else base_est
    return {"name": name, "base": base, "phases": phases, "demands": demands, "routing": routing,
            "base_routes": base_routes, "lp_T": lp_T, "base_T": base_T,
            "lp_total_T": _max_load_time(topo, demands, routing.routes),
            "base_total_T": _max_load_time(topo, demands, base_routes), "lp_estimate": lp_est,
            "base_estimate": base_est, "estimate": min(lp_est, base_est)}


def _same_demands(a, b):
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 * a[k] for k in a)


def _with_routes(base, routes, algorithm=NAME, info=None):
    """``base``'s programs with ``routes``; the derived structure (dependencies, matches, dataflow) is
    shared, being a function of the programs alone."""
    sched = Schedule(base.collective, base.nranks, base.pattern, base.programs, root=base.root,
                     algorithm=algorithm, info=info or {}, routes=dict(routes), spans=base.spans)
    for attr in ("dependencies", "matches", "dataflow", "chunk_fractions"):
        if attr in base.__dict__:
            sched.__dict__[attr] = base.__dict__[attr]
    return sched


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x)
    return x
