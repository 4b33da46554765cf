"""Fractional packing of rank-spanning arborescences by column generation (the LP behind tree packing).

Problem
=======
Given a directed capacitated graph (``capacity`` in bytes/s on every edge), the vertices of the ranks
and a set of roots, find for every root ``r`` a convex combination of *spanning out-arborescences over
the ranks* rooted at ``r`` that lets every root push one unit of data to every rank in the least time
``T``. A tree edge ``u -> v`` between ranks is a *logical* edge routed along a physical path whose
interior vertices are non-rank vertices (switches, NICs, ...: ranks never forward except as tree nodes,
and GPUs outside the job are not in the graph at all). The master LP over a set of columns (trees with
fixed paths) is

    minimise T   s.t.   sum_t use_t(e) x_t <= cap(e) T      for every physical edge e
                        sum_{t rooted at r} x_t = 1          for every root r,     x >= 0.

Its optimum, with all trees allowed, is ForestColl's cut bound for allgather (every root a root) and
the rooted min cut for broadcast (one root): edge splitting at the Eulerian switch vertices turns any
fabric into a direct-connect one with the same rank cuts, where Edmonds' branching theorem packs the
trees (Zhao et al., ForestColl, 2024; Bang-Jensen, Frank & Jackson, 1995).

Column generation
=================
With the duals ``y_e >= 0`` of the link rows (normalised so that ``sum_e cap(e) y_e = 1``) and
``mu_r`` of the root rows, a tree's reduced cost is ``sum_e y_e use_t(e) - mu_r``. The cheapest tree
for root ``r`` is a minimum-cost arborescence on the complete rank graph whose edge ``u -> v`` costs
the ``y``-shortest path from ``u`` to ``v`` that does not pass through a rank (Dijkstra on the graph
with every rank split into a send copy and a receive copy), found by Chu-Liu/Edmonds
(:func:`min_arborescence`, dense numpy). ``sum_r min-cost_r`` is a Lagrangian lower bound on the LP
optimum, so the loop stops with a certificate: when no tree has negative reduced cost, or the master
value is within ``tol`` of that bound (or of a known bound the caller passes, e.g. the cut bound).

Symmetry
========
When every rank is a root (allgather, reduce-scatter), ranks exchanged by an automorphism of the
fabric (capacities, kinds and the rank set preserved; candidates by Weisfeiler-Lehman hashes, each
confirmed by VF2) share one set of trees: a column of a class representative stands for its images at
every rank of the class, and it is priced with the sum of the images' link prices. Averaging any
optimum over the automorphism group gives one of that form, so this is exact; it shrinks the LP by up
to ``p`` (one class on a DGX A100 pod or a fat tree).

Phase 2: the same T, better trees
=================================
Blink and ForestColl stop at ``T*``; the LP has many optima and some run much better. After ``T*``:

1. the symmetric solution is re-expressed per root (images of its trees) and re-solved with
   ``T <= T*(1+1e-9)`` minimising ``sum_t x_t 4^depth(t)`` (depth first, then hops), with pricing
   by depth-limited Prim-like trees plus local search (:func:`greedy_tree`, :func:`improve_tree`);
   a basic solution has at most (#tight links + p) trees in all;
2. up to ``LEVELED_MAX_RANKS`` ranks, a *level-by-level* LP: with the load still within ``T*`` it
   minimises ``sum_l T_l``, ``T_l`` being the time the tree edges into depth ``l`` need on their own
   (rows per link and level). That is the makespan when levels do not overlap, which is what happens
   when all ready transfers share links fairly (the simulator's model): a relay can forward a chunk
   only once it has fully arrived, and fair sharing makes all chunks of a level arrive together. The
   lexicographic second solve then picks the shallowest trees at that level time. Pricing: level-
   dependent greedy trees with subtree-moving local search (:func:`greedy_levels`,
   :func:`improve_levels`); direct (depth-1) trees are always in the pool.

Everything is deterministic: vertices, links and columns are kept in sorted order, ties go to the
lowest index, and HiGHS runs its dual simplex with fixed options (no time limits anywhere).
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog
from scipy.sparse.csgraph import dijkstra

from ..errors import PlanError

__all__ = ["min_arborescence", "greedy_tree", "rank_symmetries", "Tree", "Packing", "pack_arborescences"]


# ----------------------------------------------------------------------------------------------------
# minimum-cost arborescence (Chu-Liu / Edmonds), dense


def min_arborescence(cost, root):
    """Minimum-cost spanning arborescence rooted at ``root`` of the complete digraph with edge costs
    ``cost[u, v]`` (``inf`` = no edge). Returns the parent array (``parent[root] = -1``).

    Chu-Liu/Edmonds with cycle contraction on dense matrices: every vertex takes its cheapest incoming
    edge; a cycle among those is contracted into one vertex whose incoming edges are charged the
    difference to the cycle edge they replace; recurse, then expand. Ties go to the smallest index,
    so the result is deterministic. Raises ``ValueError`` when some vertex cannot be reached.
    """
    cost = np.array(cost, dtype=float)
    n = cost.shape[0]
    if n == 1:
        return np.array([-1])
    return _edmonds(cost, int(root))


def _edmonds(cost, root):
    n = cost.shape[0]
    c = cost.copy()
    np.fill_diagonal(c, np.inf)
    c[:, root] = np.inf
    parent = np.argmin(c, axis=0)
    parent[root] = -1
    others = np.flatnonzero(np.arange(n) != root)
    incoming = np.zeros(n)
    incoming[others] = c[parent[others], others]
    if not np.all(np.isfinite(incoming)):
        raise ValueError("some vertex cannot be reached from the root")
    group, cycles = _cycles(parent, root)
    if not cycles:
        return parent
    # contract every cycle at once: an edge into a cycle vertex v is charged c[u, v] - c[parent v, v]
    in_cycle = np.zeros(n, dtype=bool)
    for cyc in cycles:
        in_cycle[cyc] = True
    adjusted = c - np.where(in_cycle, incoming, 0.0)[None, :]
    k = int(group.max()) + 1
    perm = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(group[perm]) != 0])
    reduced = np.minimum.reduceat(np.minimum.reduceat(adjusted[np.ix_(perm, perm)], starts, axis=1), starts, axis=0)
    np.fill_diagonal(reduced, np.inf)
    p2 = _edmonds(reduced, int(group[root]))
    # expand: each contracted vertex g enters through its cheapest edge from its parent group p2[g]
    parent_group = p2[group]                                  # per vertex v: the group feeding v's group
    masked = np.where(group[:, None] == parent_group[None, :], adjusted, np.inf)
    best_u = np.argmin(masked, axis=0)
    best_val = masked[best_u, np.arange(n)]
    result = parent.copy()
    singles = np.bincount(group, minlength=k) == 1
    idx = np.flatnonzero(singles[group])
    result[idx] = best_u[idx]
    for cyc in cycles:
        cyc = np.asarray(cyc)
        v = int(cyc[np.argmin(best_val[cyc])])
        result[v] = best_u[v]
    result[root] = -1
    return result


def _cycles(parent, root):
    """Cycles of the functional graph ``v -> parent[v]`` and a group id per vertex (one per cycle,
    one per other vertex, numbered in vertex order of their smallest member)."""
    n = len(parent)
    state = np.zeros(n, dtype=np.int8)  # 0 new, 1 on the current walk, 2 done
    cycles = []
    for start in range(n):
        if state[start]:
            continue
        walk = []
        v = start
        while v != -1 and v != root and state[v] == 0:
            state[v] = 1
            walk.append(v)
            v = int(parent[v])
        if v != -1 and v != root and state[v] == 1:
            cycles.append(sorted(walk[walk.index(v):]))
        for w in walk:
            state[w] = 2
    group = np.full(n, -1)
    for cyc in cycles:
        group[cyc] = cyc[0]
    rep = np.where(group >= 0, group, np.arange(n))
    _, group = np.unique(rep, return_inverse=True)
    return group, cycles


# ----------------------------------------------------------------------------------------------------
# the packing


def greedy_tree(cost, root, depth_limit):
    """Prim-like arborescence of depth <= ``depth_limit`` on the cost matrix: repeatedly attach the
    rank with the cheapest edge from an attached rank still above the limit (ties: lower index, the
    root first). Returns the parent array, or None when the limit cannot be met."""
    return greedy_levels([cost] * max(1, depth_limit), root, depth_limit)


def improve_tree(parent, cost, root, depth_limit):
    """Local search on an arborescence: move a rank (with its subtree) under the cheapest rank outside
    its subtree that keeps the depth within ``depth_limit``; repeat until no move saves cost."""
    p = len(parent)
    parent = np.array(parent)
    for _ in range(2 * p):
        depth = np.zeros(p, dtype=np.int64)
        order = _bfs_order(parent, root)
        for v in order:
            depth[v] = depth[parent[v]] + 1
        height = np.zeros(p, dtype=np.int64)      # levels below v
        for v in reversed(order):
            u = parent[v]
            height[u] = max(height[u], height[v] + 1)
        moved = False
        for v in order:
            inside = np.zeros(p, dtype=bool)       # v's subtree
            inside[v] = True
            for w in order:
                if inside[parent[w]]:
                    inside[w] = True
            ok = (~inside) & (depth + 1 + height[v] <= depth_limit)
            cand = np.where(ok, cost[:, v], np.inf)
            u = int(np.argmin(cand))
            if cand[u] < cost[parent[v], v] * (1 - 1e-12) - 1e-300:
                parent[v] = u
                moved = True
                break
        if not moved:
            break
    return parent


def greedy_levels(costs, root, depth_limit):
    """:func:`greedy_tree` with level-dependent costs: ``costs[l][u, v]`` is the cost of the edge
    ``u -> v`` when ``v`` lands at depth ``l + 1`` (the same matrix at every level: greedy_tree)."""
    p = costs[0].shape[0]
    parent = np.full(p, -1)
    depth = np.zeros(p, dtype=np.int64)
    attached = np.zeros(p, dtype=bool)
    attached[root] = True
    best = costs[0][root].copy()
    best[root] = np.inf
    arg = np.full(p, root)
    for _ in range(p - 1):
        cand = np.where(attached, np.inf, best)
        v = int(np.argmin(cand))
        if not np.isfinite(cand[v]):
            return None
        parent[v] = arg[v]
        depth[v] = depth[arg[v]] + 1
        attached[v] = True
        if depth[v] < depth_limit:
            row = costs[depth[v]][v]
            better = (row < best) & ~attached
            best[better] = row[better]
            arg[better] = v
    return parent


def improve_levels(parent, costs, root, depth_limit, max_moves=None):
    """Local search for :func:`greedy_levels`: move a rank with its subtree (whose levels shift) under
    the rank outside it that saves the most, within the depth limit; repeat until nothing saves."""
    p = len(parent)
    parent = np.array(parent)
    stack = np.stack(costs)                       # (levels, p, p)
    for _ in range(max_moves or 3 * p):
        order = _bfs_order(parent, root)
        depth = np.zeros(p, dtype=np.int64)
        for v in order:
            depth[v] = depth[parent[v]] + 1
        height = np.zeros(p, dtype=np.int64)
        for v in reversed(order):
            height[parent[v]] = max(height[parent[v]], height[v] + 1)
        moved = False
        for v in order:
            inside = np.zeros(p, dtype=bool)
            inside[v] = True
            for w in order:
                if inside[parent[w]]:
                    inside[w] = True
            sub = [w for w in order if inside[w] and w != v]
            top = depth_limit - int(height[v])   # deepest level v may take
            subcost = np.full(depth_limit + 2, np.inf)
            for nd in range(1, top + 1):
                subcost[nd] = sum(stack[nd + depth[w] - depth[v] - 1, parent[w], w] for w in sub)
            cur = stack[depth[v] - 1, parent[v], v] + subcost[depth[v]]
            ok = ~inside & (depth + 1 <= top)
            us = np.flatnonzero(ok)
            if not len(us):
                continue
            cand = stack[depth[us], us, v] + subcost[depth[us] + 1]
            k = int(np.argmin(cand))
            if cand[k] < cur - 1e-12 * abs(cur):
                parent[v] = us[k]
                moved = True
                break
        if not moved:
            break
    return parent


# ----------------------------------------------------------------------------------------------------
# results


class Tree(NamedTuple):
    """One arborescence of a packing.

    ``root``: rank index; ``weight``: its share of the root's data (weights of a root sum to 1);
    ``parent``: tuple, ``parent[v]`` the rank that sends to rank ``v`` (-1 for the root); ``paths``:
    tuple, ``paths[v]`` the physical path (vertex ids) of the edge ``parent[v] -> v`` (None for the
    root); ``depth``: the largest number of tree edges from the root to a rank."""
    root: int
    weight: float
    parent: tuple
    paths: tuple
    depth: int

    def bfs(self):
        """Non-root ranks in breadth-first order from the root (children in rank order)."""
        children = {}
        for v, u in enumerate(self.parent):
            if u >= 0:
                children.setdefault(u, []).append(v)
        order, frontier = [], [self.root]
        while frontier:
            nxt = []
            for u in frontier:
                for v in children.get(u, ()):
                    order.append(v)
                    nxt.append(v)
            frontier = nxt
        return order


class Packing(NamedTuple):
    """Result of :func:`pack_arborescences`.

    ``seconds_per_byte``: the LP optimum ``T``: seconds for every root to deliver one byte of its own
    data to every rank at once. ``lower_bound``: the best certified lower bound on it (Lagrangian or
    given). ``trees``: per root (in ``roots`` order), its trees with positive weight, heaviest first.
    ``links``: the physical edges; ``load``: bytes each carries per byte of every root's data.
    ``orbits``: number of root classes solved (roots related by an automorphism share one), plus
    statistics of the column generation."""
    roots: tuple
    seconds_per_byte: float
    lower_bound: float
    trees: tuple
    links: tuple
    load: tuple
    orbits: int
    iterations: int
    columns: int
    seconds: float
    leveled_seconds_per_byte: float = math.nan


# ----------------------------------------------------------------------------------------------------
# the fabric: physical graph with ranks split into send / receive copies


class _Fabric:
    def __init__(self, graph, ranks):
        self.ranks = list(ranks)
        self.rank_index = {v: i for i, v in enumerate(self.ranks)}
        p = len(self.ranks)
        if len(self.rank_index) != p:
            raise PlanError("tree packing needs every rank on its own vertex")
        others = sorted((v for v in graph.nodes if v not in self.rank_index), key=str)
        # split nodes: 0..p-1 send copies of the ranks, p..2p-1 receive copies, then the others
        other_index = {v: 2 * p + i for i, v in enumerate(others)}
        self.node_vertex = self.ranks + self.ranks + others

        def tail(u):
            return self.rank_index[u] if u in self.rank_index else other_index[u]

        def head(v):
            return p + self.rank_index[v] if v in self.rank_index else other_index[v]

        edges = sorted(((u, v, float(d.get("capacity", 0.0))) for u, v, d in graph.edges(data=True)
                        if u != v and float(d.get("capacity", 0.0)) > 0), key=lambda e: (str(e[0]), str(e[1])))
        self.links = tuple((u, v) for u, v, _ in edges)
        self.link_index = {e: i for i, e in enumerate(self.links)}
        self.cap = np.array([c for _, _, c in edges])
        tails = np.array([tail(u) for u, _, _ in edges], dtype=np.int64)
        heads = np.array([head(v) for _, v, _ in edges], dtype=np.int64)
        self.link_of = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(tails, heads))}
        # rank pairs joined by a direct link: (send copy, receive copy, link id)
        self.direct = np.array([(a, b, i) for (a, b), i in sorted(self.link_of.items())
                                if a < p and p <= b < 2 * p], dtype=np.int64).reshape(-1, 3)
        self.nnodes = len(self.node_vertex)
        self.p = p
        self._order = np.lexsort((heads, tails))
        self._indices = heads[self._order].astype(np.int32)
        self._indptr = np.concatenate(([0], np.cumsum(np.bincount(tails, minlength=self.nnodes)))).astype(np.int32)

    def shortest(self, price):
        """Rank-to-rank shortest paths under link ``price`` (> 0) that never pass through a rank:
        ``(cost matrix p x p with inf diagonal, predecessor matrix)``. Ranks joined by a direct link
        use it alone, whatever it costs: a transport between them takes that link (a CUDA peer copy
        between GPUs joined by NVLink never goes through their PCIe switch)."""
        mat = sp.csr_array((price[self._order], self._indices, self._indptr), shape=(self.nnodes, self.nnodes))
        dist, pred = dijkstra(mat, directed=True, indices=np.arange(self.p), return_predecessors=True)
        send, recv, link = self.direct.T
        dist[send, recv] = price[link]
        pred[send, recv] = send
        cost = dist[:, self.p:2 * self.p].copy()
        np.fill_diagonal(cost, np.inf)
        return cost, pred

    def path_links(self, pred, u, v):
        node, out = self.p + v, []
        while node != u:
            prev = int(pred[u, node])
            out.append(self.link_of[(prev, node)])
            node = prev
        out.reverse()
        return tuple(out)

    def path_vertices(self, link_ids):
        return (self.links[link_ids[0]][0],) + tuple(self.links[i][1] for i in link_ids)


class _Column(NamedTuple):
    root: int           # a representative root
    parent: tuple
    edge_links: tuple   # per rank: link ids of its incoming logical edge (() for the root)
    use: dict           # link id -> number of tree edges crossing it
    depth: int
    hops: int
    depths: tuple = ()  # per rank: its depth in the tree (0 for the root)

    def level_use(self):
        """``{(level, link id): count}``: the edges into ranks at depth ``level`` (1-based) per link."""
        out = {}
        for v, ids in enumerate(self.edge_links):
            for i in ids:
                key = (self.depths[v], i)
                out[key] = out.get(key, 0) + 1
        return out

    def cost(self, price):
        return float(sum(price[i] * k for i, k in self.use.items()))

    def objective(self, p):
        """Phase-2 cost: 4**depth (a deep tree costs more than several shallow ones: pipelines fill
        at the pace of the deepest tree), then a little for hops (logical edges x path length)."""
        return 4.0 ** self.depth + 1e-3 * self.hops / p


def _make_column(fabric, root, parent, pred):
    """The column of the arborescence ``parent``; ``pred``: the Dijkstra predecessors the edge paths
    follow, or a list of them indexed by the level of the edge (1-based, last one for deeper)."""
    p = fabric.p
    depth = np.zeros(p, dtype=np.int64)
    for v in _bfs_order(parent, root):
        depth[v] = depth[parent[v]] + 1
    edge_links, use = [], {}
    for v in range(p):
        if v == root:
            edge_links.append(())
            continue
        pr = pred[min(int(depth[v]), len(pred)) - 1] if isinstance(pred, list) else pred
        ids = fabric.path_links(pr, int(parent[v]), v)
        edge_links.append(ids)
        for i in ids:
            use[i] = use.get(i, 0) + 1
    return _Column(root, tuple(int(x) for x in parent), tuple(edge_links), use, int(depth.max()),
                   sum(len(e) for e in edge_links), tuple(int(d) for d in depth))


def _bfs_order(parent, root):
    children = {}
    for v, u in enumerate(parent):
        if u >= 0:
            children.setdefault(int(u), []).append(v)
    order, frontier = [], [root]
    while frontier:
        frontier = [v for u in frontier for v in children.get(u, ())]
        order.extend(frontier)
    return order


# ----------------------------------------------------------------------------------------------------
# symmetry


VF2_BUDGET = 20_000  # candidate vertex pairs VF2 may try per rank pair before giving up on it


class _OutOfBudget(Exception):
    pass


def rank_symmetries(graph, ranks):
    """Classes of ranks exchanged by automorphisms of ``graph`` (preserving capacities, vertex kinds
    and the rank set), with a witness: ``{rank index r: (representative s, vertex map g with g(s) = r
    or None for the identity)}``. Candidate pairs are filtered by Weisfeiler-Lehman hashes and
    confirmed by VF2 (networkx), so every pair it reports is exact; a rank no automorphism reaches from
    an earlier representative, or one for which VF2 exhausts :data:`VF2_BUDGET` (its search is
    exponential on fabrics with many look-alike parts), becomes a representative itself."""
    import warnings

    import networkx as nx
    from networkx.algorithms.isomorphism import DiGraphMatcher

    ranks = list(ranks)
    rset = set(ranks)
    # only the parts of the fabric that hold ranks: an automorphism maps them onto each other, and the
    # rest (vertices no link reaches) would only multiply VF2's look-alike candidates (2000 loose
    # switches made a 4-rank plan take 15 s)
    kept = set().union(*(c for c in nx.weakly_connected_components(graph) if not rset.isdisjoint(c)))
    fixed = {v: v for v in graph.nodes if v not in kept}       # (a witness leaves them where they are)
    graph = graph.subgraph(kept)
    # integer vertex ids: VF2 iterates over sets, and only integers hash the same in every process
    names = sorted(graph.nodes, key=str)
    ident = {v: i for i, v in enumerate(names)}
    h = nx.DiGraph()
    for v in names:
        # a rank keeps its kind too (a GPU rank is no CPU rank: they reduce at different rates)
        kind = str(graph.nodes[v].get("kind", ""))
        h.add_node(ident[v], lab="rank:" + kind if v in rset else kind)
    for u, v, d in sorted(graph.edges(data=True), key=lambda e: (ident[e[0]], ident[e[1]])):
        h.add_edge(ident[u], ident[v], cap=repr(float(d.get("capacity", 0.0))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hashes = nx.weisfeiler_lehman_subgraph_hashes(h, edge_attr="cap", node_attr="lab", iterations=4)
    # Automorphisms preserve WL colours, so VF2 may match only vertices of equal colour: exact, and it
    # prunes the search that otherwise explodes on fabrics with many look-alike but unequal parts.
    for v in names:
        h.nodes[ident[v]]["lab"] += "/" + hashes[ident[v]][-1]
    reps, out = [], {}
    for r, vr in enumerate(ranks):
        found = None
        for s in reps:
            vs = ranks[s]
            if hashes[ident[vs]][-1] != hashes[ident[vr]][-1]:
                continue
            h1, h2 = _starred(h, ident[vs]), _starred(h, ident[vr])
            budget = [VF2_BUDGET]

            def node_match(a, b):
                budget[0] -= 1
                if budget[0] < 0:
                    raise _OutOfBudget
                return a["lab"] == b["lab"]

            matcher = DiGraphMatcher(h2, h1, node_match=node_match, edge_match=lambda a, b: a["cap"] == b["cap"])
            try:
                iso = next(matcher.isomorphisms_iter(), None)  # h2 vertex -> h1 vertex
            except _OutOfBudget:
                iso = None  # undecided: r becomes a representative of its own (exact, only less sharing)
            if iso is not None:
                found = (s, {**fixed, **{names[b]: names[a] for a, b in iso.items()}})
                break
        if found is None:
            reps.append(r)
            out[r] = (r, None)
        else:
            out[r] = found
    return out


def _starred(h, start):
    """``h`` with ``start`` labelled ``*`` and its vertices in breadth-first order from ``start``
    (neighbours by id). VF2 extends a match in the order of the graph's vertices: from the pinned
    vertex outwards it meets every vertex beside one already matched. In id order it could begin at
    a switch that many look-alike vertices hang from (a fabric named 'core' sorts first) and try
    their orders one by one, which took minutes on a few DGX boxes and ran out of budget."""
    import networkx as nx

    undirected = h.to_undirected(as_view=True)
    order = [start] + [v for _, v in nx.bfs_edges(undirected, start, sort_neighbors=sorted)]
    order += sorted(set(h) - set(order))
    out = nx.DiGraph()
    out.add_nodes_from((v, dict(h.nodes[v])) for v in order)
    out.add_edges_from(h.edges(data=True))
    out.nodes[start]["lab"] = "*"
    return out


# ----------------------------------------------------------------------------------------------------
# the master LP


LEVELED_MAX_RANKS = 16   # beyond this the level-by-level phase costs more than it is worth
PHASE2_MAX_COLUMNS = 1024  # beyond this one depth-LP solve takes minutes: phase 1's trees are kept

_OPTIONS = {"presolve": False, "primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}


class _Master:
    """The restricted master LP. Variable 0 is T; every column is a tree of a representative root
    and stands for its images at every root of the representative's orbit (link permutations)."""

    def __init__(self, capn, orbit_perms):
        self.capn = capn
        self.reps = sorted(orbit_perms)
        self.orbit_perms = orbit_perms          # rep -> list of link-index permutations (np arrays)
        self.rep_pos = {s: i for i, s in enumerate(self.reps)}
        self.columns = []
        self._seen = set()
        nl = len(capn)
        self._rows = list(range(nl))
        self._cols = [0] * nl
        self._vals = (-capn).tolist()

    def add(self, col):
        key = (col.root, col.parent, col.edge_links)
        if key in self._seen:
            return False
        self._seen.add(key)
        self.columns.append(col)
        j = len(self.columns)
        ids = np.array(sorted(col.use), dtype=np.int64)
        cnt = np.array([col.use[i] for i in sorted(col.use)], dtype=float)
        load = {}
        for perm in self.orbit_perms[col.root]:
            for i, c in zip(perm[ids].tolist(), cnt.tolist()):
                load[i] = load.get(i, 0.0) + c
        for i in sorted(load):
            self._rows.append(i)
            self._cols.append(j)
            self._vals.append(load[i])
        return True

    def price(self, rep, y):
        """Price of each link for a column of ``rep``: the sum of the prices of its images."""
        return sum(y[perm] for perm in self.orbit_perms[rep])

    def solve(self, depth=False, tmax=None):
        k = len(self.columns)
        nl = len(self.capn)
        a_ub = sp.csc_array((self._vals, (self._rows, self._cols)), shape=(nl, k + 1))
        a_eq = sp.csc_array(([1.0] * k, ([self.rep_pos[c.root] for c in self.columns], list(range(1, k + 1)))),
                            shape=(len(self.reps), k + 1))
        if depth:
            p = len(self.columns[0].parent)
            c = np.array([0.0] + [col.objective(p) * len(self.orbit_perms[col.root]) for col in self.columns])
            bounds = [(0, tmax)] + [(0, None)] * k
        else:
            c = np.zeros(k + 1)
            c[0] = 1.0
            bounds = (0, None)
        res = linprog(c, A_ub=a_ub, b_ub=np.zeros(nl), A_eq=a_eq, b_eq=np.ones(len(self.reps)),
                      bounds=bounds, method="highs-ds", options=_OPTIONS)
        if res.status != 0:
            if depth:
                return None
            raise PlanError(f"tree packing LP failed: {res.message}")
        return res

    @staticmethod
    def duals(res):
        return np.maximum(-np.asarray(res.ineqlin.marginals), 0.0), np.asarray(res.eqlin.marginals)

    @staticmethod
    def weights(res):
        return np.asarray(res.x[1:])


# ----------------------------------------------------------------------------------------------------
# the packing


def pack_arborescences(graph, ranks, roots=None, *, known_bound=None, tol=1e-9, max_iterations=1000,
                       shallow="levels", shallow_iterations=15, symmetry=True):
    """Pack spanning arborescences over ``ranks`` (vertex ids) from every root in ``roots`` (rank
    indices; default all) on ``graph`` (DiGraph with edge attr ``capacity``); see the module docstring.

    ``known_bound``: a lower bound on the optimum in seconds per byte (e.g. ForestColl's cut bound
    times p); column generation stops once the master is within ``tol`` of it. ``shallow``: run the
    second phase that trades no bandwidth for shallower trees. ``symmetry``: when every rank is a
    root, solve one root per class of ranks exchanged by automorphisms (exact: averaging an optimum
    over the automorphism group gives one of that form). Returns a :class:`Packing`; raises
    :class:`ddl.PlanError` when some rank cannot be reached from a root, or when link capacities lie
    further apart than :data:`CAPACITY_SPAN` (see :func:`_capacity_unit`).
    """
    start = time.perf_counter()
    fabric = _Fabric(graph, ranks)
    p = fabric.p
    roots = tuple(range(p)) if roots is None else tuple(int(r) for r in roots)
    if p < 2:
        return Packing(roots, 0.0, 0.0, tuple(() for _ in roots), fabric.links, (), len(roots), 0, 0, 0.0, 0.0)
    nl = len(fabric.links)
    if nl == 0:
        raise PlanError("the graph has no links between the ranks")

    # orbits: representative root -> [(root, vertex map)], with link permutations
    if symmetry and sorted(roots) == list(range(p)) and p > 2:
        sym = rank_symmetries(graph, fabric.ranks)
    else:
        sym = {r: (r, None) for r in roots}
    members = {}
    for r in roots:
        members.setdefault(sym[r][0], []).append((r, sym[r][1]))
    orbit_perms = {}
    for s, lst in members.items():
        perms = []
        for _r, g in lst:
            if g is None:
                perms.append(np.arange(nl))
            else:
                perms.append(np.array([fabric.link_index[(g[u], g[v])] for u, v in fabric.links]))
        orbit_perms[s] = perms
    reps = sorted(members)
    nclasses = len(reps)

    scale = _capacity_unit(fabric.cap)
    master = _Master(fabric.cap / scale, orbit_perms)

    # initial columns: hop-shortest trees (Edmonds on hop counts) and breadth-first trees
    cost, pred = fabric.shortest(np.ones(nl))
    for s in reps:
        try:
            master.add(_make_column(fabric, s, min_arborescence(cost, s), pred))
        except ValueError:
            raise PlanError(f"no spanning tree from rank {s}: some rank cannot be reached") from None
        master.add(_make_column(fabric, s, greedy_tree(cost, s, p), pred))

    # phase 1: minimise T
    iterations = 0
    best_lb = 0.0 if known_bound is None else known_bound * scale
    while True:
        iterations += 1
        res = master.solve()
        value = res.fun
        if value <= best_lb * (1 + tol) or iterations > max_iterations:
            break
        y, mu = master.duals(res)
        lagrange, added = 0.0, 0
        for s in reps:
            price = master.price(s, y)
            cost, pred = fabric.shortest(price + _eps(price))
            col = _make_column(fabric, s, min_arborescence(cost, s), pred)
            true_cost = col.cost(price)
            lagrange += true_cost
            if true_cost - mu[master.rep_pos[s]] < -tol * value / len(reps):
                added += master.add(col)
        best_lb = max(best_lb, lagrange)
        if not added or value <= best_lb * (1 + tol):
            break
    tstar = value
    weights = master.weights(res)

    if any(len(v) > 1 for v in members.values()):
        # leave the symmetric space: every root gets the images of its representative's columns,
        # and the solution is re-expressed per root (a basic solution then has few trees per root)
        full = _Master(fabric.cap / scale, {r: [np.arange(nl)] for r in roots})
        keep = [(w, c) for c, w in zip(master.columns, weights) if w > 1e-12]
        keep.sort(key=lambda wc: -wc[0])
        start_w = []
        for s in reps:
            for r, g in members[s]:
                perm = orbit_perms[s][[m[0] for m in members[s]].index(r)]
                rank_map = [fabric.rank_index[g.get(v, v)] if g else i for i, v in enumerate(fabric.ranks)]
                for w, col in keep:
                    if col.root == s and full.add(_image(col, rank_map, perm)):
                        start_w.append(w)
        master = full
        weights = np.array(start_w)
        members = {r: [(r, None)] for r in roots}
        orbit_perms = master.orbit_perms
        reps = list(roots)

    # phase 2: the same T, trees that also work level by level / shallow trees
    columns = master.columns
    leveled = math.nan
    if shallow and len(members) == len(roots) and len(master.columns) <= PHASE2_MAX_COLUMNS:
        big = p > LEVELED_MAX_RANKS
        weights = _phase2(fabric, master, tstar * (1 + tol), 1 if big else shallow_iterations, weights,
                          pricing=not big)
        if shallow == "levels" and not big:
            columns, weights, leveled = _phase2_levels(fabric, master.columns, weights, list(roots),
                                                       fabric.cap / scale, tstar * (1 + tol), shallow_iterations)

    trees = _trees(fabric, columns, weights, members)
    loads = np.zeros(nl)
    for tree_list in trees.values():
        for t in tree_list:
            for path in t.paths:
                if path is not None:
                    for e in zip(path[:-1], path[1:]):
                        loads[fabric.link_index[e]] += t.weight
    return Packing(roots, tstar / scale, min(best_lb, tstar) / scale, tuple(trees[r] for r in roots), fabric.links,
                   tuple(float(x) for x in loads), nclasses, iterations, len(columns),
                   time.perf_counter() - start, leveled / scale)


CAPACITY_RANGE = 1e6   # capacities within this ratio of the largest one are measured in units of it
CAPACITY_SPAN = 1e15   # the LP cannot tell capacities further apart than this


def _capacity_unit(cap):
    """The capacity the LP measures capacities in: the largest one, so that they lie in (0, 1], unless
    the smallest is below 1 / CAPACITY_RANGE of it; then the geometric mean of the two, so that they
    lie in [sqrt(min/max), sqrt(max/min)]. HiGHS drops matrix entries below 1e-9 (its
    small_matrix_value): with 1 GB/s and 1 EB/s links in one fabric (the topology format allows
    1 B/s to 1 EB/s) the slow links' entries vanished from the T column and the LP came back
    "infeasible". Beyond CAPACITY_SPAN even the geometric mean leaves entries that small: PlanError."""
    top, low = float(cap.max()), float(cap.min())
    if low >= top / CAPACITY_RANGE:
        return top
    if low < top / CAPACITY_SPAN:
        raise PlanError(f"tree packing: link capacities span {low:g} to {top:g} bytes/s, more than the "
                        f"{CAPACITY_SPAN:g}:1 its LP solver can tell apart")
    return math.sqrt(top * low)


def _image(col, rank_map, perm):
    """The column mapped by an automorphism (rank map and link permutation)."""
    p = len(col.parent)
    parent = [-1] * p
    edges = [()] * p
    for v in range(p):
        if col.parent[v] >= 0:
            parent[rank_map[v]] = rank_map[col.parent[v]]
            edges[rank_map[v]] = tuple(int(perm[i]) for i in col.edge_links[v])
    use = {int(perm[i]): k for i, k in col.use.items()}
    depths = [0] * p
    for v in range(p):
        depths[rank_map[v]] = col.depths[v]
    return _Column(rank_map[col.root], tuple(parent), tuple(edges), use, col.depth, col.hops, tuple(depths))


def _phase2_levels(fabric, columns, weights, roots, capn, tmax, iterations, max_levels=6):
    """Keep every link's load within ``tmax`` and minimise ``sum_l T_l``, where ``T_l`` is the time the
    tree edges into depth ``l`` need on their own: the makespan when the levels run one after the
    other, which is how store-and-forward trees behave when all ready transfers share links fairly.
    Columns as in phase 1; pricing by level-dependent greedy trees with local search.
    Returns ``(columns, weights, sum_l T_l)``."""
    p = fabric.p
    nl = len(capn)
    used = [c for c, w in zip(columns, weights) if w > 1e-12]
    levels = min(max_levels, max(c.depth for c in used))
    pool = [c for c in columns if c.depth <= levels]
    if len(pool) < len(columns) and any(c.depth > levels for c in used):
        return columns, weights, math.inf
    root_pos = {r: i for i, r in enumerate(roots)}
    seen = set()
    cols = []
    rows, cidx, vals = [], [], []
    for l in range(levels):                        # -capn * T_l in the level rows
        rows.extend(range(nl + l * nl, nl + (l + 1) * nl))
        cidx.extend([l] * nl)
        vals.extend((-capn).tolist())

    def add(col):
        key = (col.root, col.parent, col.edge_links)
        if key in seen or col.depth > levels:
            return False
        seen.add(key)
        cols.append(col)
        j = levels + len(cols) - 1
        for i, k in sorted(col.use.items()):
            rows.append(i)
            cidx.append(j)
            vals.append(float(k))
        for (l, i), k in sorted(col.level_use().items()):
            rows.append(nl + (l - 1) * nl + i)
            cidx.append(j)
            vals.append(float(k))
        return True

    for c in pool:
        add(c)
    # the direct trees (root to every rank over hop-shortest paths) are always candidates
    hop_cost, hop_pred = fabric.shortest(np.ones(nl))
    for r in roots:
        star = greedy_tree(hop_cost, r, 1)
        if star is not None:
            add(_make_column(fabric, r, star, hop_pred))
    tiny = 1e-7 * tmax

    def solve(limit=None):
        k = len(cols)
        nrows = nl * (levels + 1)
        a_ub = sp.csc_array((vals, (rows, cidx)), shape=(nrows, levels + k))
        b_ub = np.concatenate((capn * tmax, np.zeros(nl * levels)))
        a_eq = sp.csc_array(([1.0] * k, ([root_pos[c.root] for c in cols], list(range(levels, levels + k)))),
                            shape=(len(roots), levels + k))
        if limit is None:
            obj = np.concatenate((np.ones(levels), [tiny * (c.depth + c.hops / (p * p)) for c in cols]))
        else:   # lexicographic second pass: the level time fixed, the shallowest trees
            obj = np.concatenate((np.zeros(levels), [c.objective(p) for c in cols]))
            a_ub = sp.vstack([a_ub, sp.csc_array(np.concatenate((np.ones(levels), np.zeros(k)))[None, :])]).tocsc()
            b_ub = np.concatenate((b_ub, [limit]))
        res = linprog(obj, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(len(roots)), bounds=(0, None),
                      method="highs-ds", options=_OPTIONS)
        return res if res.status == 0 else None

    best = None
    for _ in range(iterations):
        res = solve()
        if res is None:
            break
        value = float(np.sum(res.x[:levels]))
        if best is not None and value >= best[2] * (1 - 1e-6):
            best = (list(cols), np.asarray(res.x[levels:]), value)
            break
        best = (list(cols), np.asarray(res.x[levels:]), value)
        y = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)
        mu = np.asarray(res.eqlin.marginals)
        y_tot = y[:nl]
        prices = [y_tot + y[nl + l * nl: nl + (l + 1) * nl] for l in range(levels)]
        costs, preds = [], []
        for price in prices:
            c, pr = fabric.shortest(price + _eps(price) + 1e-12 * tmax)
            costs.append(c)
            preds.append(pr)
        added = 0
        for r in roots:
            found = []
            for d in range(1, levels + 1):
                parent = greedy_levels(costs, r, d)
                if parent is None:
                    continue
                parent = improve_levels(parent, costs, r, d)
                col = _make_column(fabric, r, parent, preds)
                rc = (tiny * (col.depth + col.hops / (p * p)) + col.cost(y_tot)
                      + sum(prices[l - 1][i] * n - y_tot[i] * n for (l, i), n in col.level_use().items())
                      - mu[root_pos[r]])
                if rc < -1e-9 * (abs(mu[root_pos[r]]) + tmax):
                    found.append((rc, d, col))
            for _rc, _d, col in sorted(found, key=lambda f: (f[0], f[1]))[:2]:
                added += add(col)
        if not added:
            break
    if best is None:
        return columns, weights, math.inf
    res = solve(limit=best[2] * (1 + 1e-6))
    if res is not None:
        best = (list(cols), np.asarray(res.x[levels:]), float(np.sum(res.x[:levels])))
    return best


def _phase2(fabric, master, tmax, iterations, weights, pricing=True):
    """Keep T <= tmax and minimise the depth objective; pricing by depth-limited greedy trees (or
    none: one solve over the columns at hand)."""
    p = fabric.p
    reps = master.reps
    for _ in range(iterations):
        res = master.solve(depth=True, tmax=tmax)
        if res is None:
            break
        weights = master.weights(res)
        if not pricing:
            break
        y, mu = master.duals(res)
        added = 0
        limits = {}
        for c, w in zip(master.columns, weights):
            if w > 0:
                limits[c.root] = max(limits.get(c.root, 0), c.depth)
        for s in reps:
            price = master.price(s, y)
            cost, pred = fabric.shortest(price + _eps(price) + 1e-6)
            found = []
            for d in range(1, limits.get(s, 1) + 1):
                parent = greedy_tree(cost, s, d)
                if parent is None:
                    continue
                parent = improve_tree(parent, cost, s, d)
                col = _make_column(fabric, s, parent, pred)
                rc = col.objective(p) * len(master.orbit_perms[s]) + col.cost(price) - mu[master.rep_pos[s]]
                if rc < -1e-9 * (1 + abs(mu[master.rep_pos[s]])):
                    found.append((rc, d, col))
            for _rc, _d, col in sorted(found, key=lambda f: (f[0], f[1]))[:2]:
                added += master.add(col)
        if not added:
            break
    return weights


def _eps(price):
    """Tiny per-hop price: breaks ties toward fewer hops, keeps Dijkstra's weights positive."""
    top = float(price.max())
    return 1e-9 * top if top > 0 else 1e-12


def _trees(fabric, columns, weights, members):
    """Trees with positive weight of every root: the representative's, mapped by the automorphism."""
    out = {}
    for s, lst in members.items():
        mine = [(w, col) for col, w in zip(columns, weights) if col.root == s and w > 1e-9]
        total = sum(w for w, _ in mine)
        mine.sort(key=lambda wc: (-wc[0], wc[1].depth, wc[1].parent, wc[1].edge_links))
        for r, g in lst:
            if g is None:
                g = {}
            rank_map = [fabric.rank_index[g.get(v, v)] for v in fabric.ranks]
            trees = []
            for w, col in mine:
                parent = [-1] * fabric.p
                paths = [None] * fabric.p
                for v in range(fabric.p):
                    if v != s:
                        parent[rank_map[v]] = rank_map[col.parent[v]]
                        paths[rank_map[v]] = tuple(g.get(x, x) for x in fabric.path_vertices(col.edge_links[v]))
                trees.append(Tree(r, w / total, tuple(parent), tuple(paths), col.depth))
            out[r] = tuple(trees)
    return out
