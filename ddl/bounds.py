"""Lower bounds on the time of a collective on a topology, and nccl-tests bandwidth figures.

A plan is only as good as the distance to what no plan can beat. This module computes that distance
from the topology alone:

* **Bandwidth** (:func:`cut_bound`, :func:`bandwidth_bound`). For allgather and reduce-scatter we use
  the cut bound of ForestColl (Zhao, Maleki, Yang, Pourreza & Krishnamurthy, "ForestColl:
  Throughput-Optimal Collective Communications on Heterogeneous Network Fabrics", 2024): every vertex
  set ``S`` that holds at least one rank but not all of them must ship the ``|S ∩ ranks| · N/p`` bytes
  its ranks contribute across the edges leaving it, so

      time >= (N/p) · max_S |S ∩ ranks| / B+(S),        B+(S) = capacity of the edges leaving S.

  ForestColl shows the bound is attained by packing spanning out-trees, so it is *the* optimum of
  allgather, not merely a bound. We never enumerate subsets: with a super source ``s`` feeding every
  rank at rate ``x``, the bound holds at ``x`` iff every rank ``v`` can draw ``x·p`` from ``s``
  (max-flow/min-cut), and the optimum ``x*`` is found exactly by a Dinkelbach (Newton) iteration on the
  violated min cuts. Broadcast and reduce use Edmonds' branching theorem: a root can stream to every
  rank at the smallest root-to-rank min cut.
* **Allreduce** (:func:`allreduce_bound`) is *not* reduce-scatter's bound plus allgather's: a pipelined
  schedule overlaps the two on the two directions of every link, and a rank behind a slow link needs
  about ``N/B``, not ``2(p-1)/p · N/B``. Its bound is the larger of the min cut (``N`` each way) and a
  partition bound (the groups of a partition gossip: ``2(j-1)`` crossings per byte), which is exact
  where Blink's reduce-broadcast tree packing runs without switches, and equals twice the allgather
  bound on every uniform fabric and tier.
* **Direct links** (:func:`transfer_bound`). Transports take the direct link between two ranks that
  have one (a CUDA peer copy between GPUs joined by NVLink never goes through their PCIe switch), and
  switches forward without copying. So between the groups of a partition only so many bytes can move
  per second: an LP routes one commodity per sending rank, and allgather needs ``j - 1`` transfers per
  byte between ``j`` groups, allreduce ``2(j - 1)``. Where two ranks of different groups share a
  direct link this can beat the bounds above, which let their traffic take the paths beside the link
  too (DGX-1 with its PCIe: 156 GB/s of bus bandwidth, not 162; tree packing reaches it).
* **Latency** (:func:`latency_bound`): in the round model, ``ceil(log2 p)`` rounds of the smallest
  rank-to-rank latency, and no fewer rounds across each latency tier (hosts, racks) than the tier's
  groups need to hear from everyone, each as slow as the tier.
* **Bus bandwidth** (:func:`busbw`): the nccl-tests convention, so our numbers read like theirs.

All work is done on ``topo.usable_graph()`` (ranks plus transit vertices; a GPU outside the job cannot
forward data). The core functions take ``(graph, rank_vertices)`` so that they can be used and tested
without a :class:`~ddl.topology.Topology`; the public functions are thin, cached wrappers.

Max flows are computed with :func:`scipy.sparse.csgraph.maximum_flow`, which needs int32 capacities.
Capacities are scaled to integers exactly when they share a common unit that fits (every realistic
topology: 25 GB/s, 100 Gbit/s, ...). Where none fits, each flow clamps capacities at the cut value it
tests (an edge above it cannot be in a cut that matters) and scales them in that unit, not the
fastest link's, so links up to 1e15 apart stay exact; only edges below about 2**-30 of the tested cut
are rounded. The transfer LP is solved in units of its own upper bound and reports a dual value made
feasible, an upper bound on its optimum. Whatever happens inside, every figure we report is computed
in floating point from a *real* cut of the graph, so it is always a valid bound; in the exact case it
is also the optimum.
"""
from __future__ import annotations

import functools
import math
from collections import Counter, OrderedDict
from fractions import Fraction
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import (breadth_first_order, connected_components, dijkstra, maximum_flow,
                                  minimum_spanning_tree)

from .errors import PlanError

__all__ = [
    "COLLECTIVES", "CutBound", "AllreduceBound", "Bound",
    "cut_bound", "allreduce_bound", "allreduce_bound_graph", "transfer_bound", "transfer_bound_graph",
    "TransferBound", "bandwidth_bound", "latency_bound",
    "lower_bound", "min_rank_latency", "latency_rounds", "rank_latency_matrix",
    "cut_bound_graph", "broadcast_bandwidth_graph", "reduce_bandwidth_graph", "min_rank_latency_graph",
    "bandwidth_bound_graph", "latency_bound_graph", "lower_bound_graph",
    "algbw", "busbw", "busbw_factor",
]

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce")

# Largest capacity we hand to scipy's int32 max flow. The residual capacity of an edge can reach the
# sum of both directions' capacities, so stay below 2**30 to leave room for that.
_LIMIT = 2**30 - 1


class CutBound(NamedTuple):
    """ForestColl's cut bound for allgather / reduce-scatter.

    ``seconds_per_byte`` is per byte of the *total* buffer ``N`` (allgather output, reduce-scatter
    input): time >= ``N * seconds_per_byte``. ``cut`` is the limiting vertex set ``S`` (frozenset of
    vertex ids), ``ranks_in_cut`` = ``|S ∩ ranks|`` (counting ranks that share a vertex), and
    ``bandwidth_out`` = ``B+(S)`` in bytes/s. With p == 1 there is no cut: 0 s/byte, empty cut.
    """
    seconds_per_byte: float
    cut: frozenset
    ranks_in_cut: int
    bandwidth_out: float

    @property
    def rate(self):
        """ForestColl's ``x*``: bytes/s at which every rank's own block can be spread to all others."""
        return self.bandwidth_out / self.ranks_in_cut if self.ranks_in_cut else math.inf

    @property
    def algbw(self):
        """Best allgather / reduce-scatter algorithm bandwidth ``N / time`` (bytes/s)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf


class Bound(NamedTuple):
    """A lower bound on a collective's time: ``seconds = max(bandwidth_seconds, latency_seconds)``."""
    seconds: float
    bandwidth_seconds: float
    latency_seconds: float


# ----------------------------------------------------------------------------------------------------
# integer flow networks


def _integer_capacities(caps, headroom):
    """Integer capacities ``q`` (int64 array) with ``q * unit ~= caps`` and ``max(q) * headroom <= 2**30``.

    ``headroom`` is how much the caller will multiply the largest value by. Exact when the capacities
    are integer multiples of a common unit that leaves that room (their exact rational gcd); otherwise
    rounded to about 2**-29 of the largest, relative. ``caps`` may hold exact :class:`~fractions.Fraction`
    values (sums and ratios of capacities), which are then taken exactly. Returns ``(q, exact)``.
    """
    fracs = [c if isinstance(c, Fraction) else Fraction(float(c)) for c in caps]
    caps = [float(c) for c in fracs]
    if not caps:
        return np.zeros(0, dtype=np.int64), True
    den = 1
    for f in fracs:
        den = den * f.denominator // math.gcd(den, f.denominator)
        if den > 2**64:
            break
    else:
        nums = [f.numerator * (den // f.denominator) for f in fracs]
        g = 0
        for n in nums:
            g = math.gcd(g, n)
        if g == 0:
            return np.zeros(len(caps), dtype=np.int64), True
        q = [n // g for n in nums]
        if max(q) * headroom <= _LIMIT:
            return np.array(q, dtype=np.int64), True
    top = max(caps)
    if top <= 0:
        return np.zeros(len(caps), dtype=np.int64), True
    unit = top * headroom / (_LIMIT // 2)
    return np.array([round(c / unit) for c in caps], dtype=np.int64), False


class _Network:
    """A DiGraph as index arrays: edge tails, heads, float capacities, in CSR order, plus a super source.

    Vertex ``n`` (one past the graph's vertices) is the super source; its edges go to ``sources``.
    """

    def __init__(self, graph, sources=()):
        self.vertices = list(graph.nodes)
        self.index = {v: i for i, v in enumerate(self.vertices)}
        n = self.n = len(self.vertices)
        tails, heads, caps = [], [], []
        for u, v, d in graph.edges(data=True):
            c = float(d.get("capacity", 0.0))
            if u != v and c > 0:
                tails.append(self.index[u])
                heads.append(self.index[v])
                caps.append(c)
        self.m = len(caps)
        self.sources = [self.index[v] for v in sources]
        tails = np.array(tails + [n] * len(self.sources), dtype=np.int64)
        heads = np.array(heads + self.sources, dtype=np.int64)
        order = np.lexsort((heads, tails))
        # position of edge e (graph edges first, then source edges) in the CSR data array
        self.pos = np.empty(len(order), dtype=np.int64)
        self.pos[order] = np.arange(len(order))
        self.tail, self.head = tails, heads
        self.cap = np.array(caps, dtype=float)
        self.indices = heads[order].astype(np.int32)
        self.indptr = np.concatenate(([0], np.cumsum(np.bincount(tails, minlength=n + 1)))).astype(np.int32)
        self.out_cap = np.bincount(self.tail[:self.m], weights=self.cap, minlength=n)
        self.in_cap = np.bincount(self.head[:self.m], weights=self.cap, minlength=n)

    def matrix(self, edge_values, source_values=()):
        """CSR matrix (int32) with the given integer capacities for graph edges and source edges."""
        data = np.empty(len(self.pos), dtype=np.int64)
        data[self.pos[:self.m]] = edge_values
        data[self.pos[self.m:]] = source_values
        if data.size and (data.max() > _LIMIT or data.min() < 0):  # pragma: no cover - guarded by scaling
            raise OverflowError("flow capacities exceed int32 range")
        return sp.csr_array((data.astype(np.int32), self.indices, self.indptr), shape=(self.n + 1, self.n + 1))

    def source_side(self, matrix, result, source):
        """Boolean mask of the vertices reachable from ``source`` in the residual graph of ``result``."""
        residual = (matrix - result.flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reach = breadth_first_order(residual, source, directed=True, return_predecessors=False)
        mask = np.zeros(self.n + 1, dtype=bool)
        mask[reach] = True
        return mask[:self.n]

    def leaving(self, mask):
        """Boolean mask of the graph edges leaving the vertex set ``mask``."""
        return mask[self.tail[:self.m]] & ~mask[self.head[:self.m]]

    def cut_capacity(self, mask):
        """Float capacity of the graph edges leaving the vertex set ``mask`` (exact sum)."""
        return math.fsum(self.cap[self.leaving(mask)])

    @functools.cached_property
    def exact_cap(self):
        """The graph edges' capacities as exact fractions (for flows that no common unit fits)."""
        return [Fraction(c) for c in self.cap.tolist()]

    def exact_cut(self, mask):
        """:meth:`cut_capacity` as an exact fraction."""
        return sum((self.exact_cap[i] for i in np.flatnonzero(self.leaving(mask)).tolist()), Fraction(0))


def _twin_representatives(graph, vertices, weight=None, exclude=()):
    """One vertex of each class of interchangeable rank vertices, in first-seen order.

    Two vertices with no edge between them, the same weight and the same in- and out-edges (neighbour
    and capacity) are swapped by an automorphism of the graph that fixes every other vertex, so a max
    flow from a fixed source to either has the same value: only one of them needs a flow. This turns
    the per-rank flows of a hierarchical cluster into per-host ones.
    """
    seen = {}
    for v in vertices:
        if v in exclude:
            continue
        key = (weight[v] if weight else 1,
               frozenset((w, d.get("capacity")) for w, d in graph.succ[v].items() if w != v),
               frozenset((w, d.get("capacity")) for w, d in graph.pred[v].items() if w != v))
        seen.setdefault(key, v)
    return list(seen.values())


# ----------------------------------------------------------------------------------------------------
# cut bound (allgather, reduce-scatter)


def cut_bound_graph(graph, ranks):
    """ForestColl's allgather cut bound on ``graph`` (DiGraph, edge attr ``capacity`` in bytes/s).

    ``ranks`` lists the vertex of each rank (a vertex may hold several ranks; they count with
    multiplicity and exchange data for free). Returns a :class:`CutBound`.

    Method (no subset enumeration). Let ``x`` be the rate at which each rank's block leaves it. Add a
    super source ``s`` with an edge ``s -> c`` of capacity ``x`` per rank on ``c``. For a rank vertex
    ``v`` and a cut ``{s} ∪ S`` with ``v ∉ S`` the cut capacity is ``x (p - |S∩R|) + B+(S)``, so
    ``maxflow(s, v) >= x p`` for every ``v`` iff ``B+(S) >= x |S∩R|`` for every ``S`` that misses a
    rank: exactly ForestColl's condition. ``x* = min_S B+(S)/|S∩R|`` is then found by Dinkelbach's
    method: start at the ratio of the best single-rank cut (an upper bound), and while some ``v`` has
    ``maxflow(s, v) < x p`` replace ``x`` by the ratio of that min cut's source side (strictly smaller).
    Feasibility at ``x`` implies feasibility at every smaller ``x`` (the condition is monotone), so each
    sink is checked once and stays checked: about ``#classes + #improvements`` max flows in total,
    where interchangeable ranks (twins, e.g. the GPUs of one host) share one class. ``x`` is kept as an
    exact fraction: in the capacities' common integer unit where one fits, else of the capacities
    themselves with each flow solved in integer units of the current ``x·p`` (see below), so capacities
    1e15 apart stay exact where the cuts that matter are within 2**30 of it.
    """
    mult = Counter(ranks)
    p = len(ranks)
    if len(mult) < 2:
        return CutBound(0.0, frozenset(), 0, math.inf)
    rank_vertices = list(mult)
    net = _Network(graph, rank_vertices)
    n = net.n
    weight = np.zeros(n, dtype=np.int64)
    for v, k in mult.items():
        weight[net.index[v]] = k
    src_w = np.array([mult[v] for v in rank_vertices], dtype=np.int64)

    # best single-rank cut: S = {v}; its ratio bounds x* from above and starts the iteration
    def single(v):
        return net.out_cap[net.index[v]] / mult[v]
    v0 = min(rank_vertices, key=single)
    best = (net.out_cap[net.index[v0]] / mult[v0], frozenset([v0]), mult[v0], float(net.out_cap[net.index[v0]]))
    if best[0] == 0.0:
        return CutBound(math.inf, best[1], best[2], 0.0)

    reps = _twin_representatives(graph, rank_vertices, mult)
    # sinks: one per twin class, the least-fed first (they tend to lie outside the worst cut)
    reps.sort(key=lambda v: net.in_cap[net.index[v]] / mult[v])
    # Integer capacities in one common unit, as every realistic fabric allows (25 GB/s, 100 Gbit/s,
    # ...): graph edges get multiplied by k <= p, source edges carry B * mult(c) with B/k <= x0, i.e.
    # at most x0 * p * max(mult); x = B/k is kept in that unit.
    x0 = best[0]
    headroom = max(p, math.ceil(p * max(mult.values()) * x0 / net.cap.max()) + p) if net.m else p
    q, exact = _integer_capacities(net.cap, headroom)
    if exact:
        def cut_value(mask):
            return Fraction(int(q[net.leaving(mask)].sum()))

        def flow_network(x):
            return net.matrix(q * x.denominator, src_w * x.numerator), x.numerator * p
    else:
        # No common unit fits: each max flow runs on integer capacities taken at the current x (an
        # exact fraction of capacities), every graph edge clamped at x·p: a cut through such an edge is
        # worth at least x·p, as much as the cut {s}, so it violates nothing, and every cut below x·p
        # (the violated ones) keeps its exact capacity. Quantising at the top capacity instead rounded a
        # link 3e8 times slower than the fastest to nothing (int32), and the cut it closes was never
        # seen: half the optimum on a 3-rank star with one slow link. Clamped, the scale is x·p, which
        # no cut that matters exceeds; only edges below about 2**-30 of it are rounded.
        cut_value = net.exact_cut

        def flow_network(x):
            scaled, _ = _integer_capacities([min(c, x * p) for c in net.exact_cap] + [x * int(k) for k in src_w], 1)
            return net.matrix(scaled[:net.m], scaled[net.m:]), int(scaled[net.m:].sum())
    x = min(cut_value(np.arange(n) == net.index[v]) / mult[v] for v in rank_vertices)
    s = n
    for v in reps:
        t = net.index[v]
        while x > 0:
            mat, demand = flow_network(x)
            res = maximum_flow(mat, s, t)
            if int(res.flow_value) >= demand:
                break
            mask = net.source_side(mat, res, s)
            ks = int(weight[mask].sum())
            new_x = cut_value(mask) / ks
            bout = net.cut_capacity(mask)
            if bout / ks < best[0]:
                best = (bout / ks, frozenset(net.vertices[i] for i in np.flatnonzero(mask)), ks, bout)
            if new_x >= x:  # only possible with rounded capacities; cannot improve further
                break
            x = new_x
        if best[0] == 0.0:
            break
    rate, cut, ks, bout = best
    spb = math.inf if rate == 0 else ks / (p * bout)
    return CutBound(spb, cut, ks, bout)


# ----------------------------------------------------------------------------------------------------
# allreduce (partition bound)


class AllreduceBound(NamedTuple):
    """A lower bound on allreduce: time >= ``N * seconds_per_byte``.

    ``groups`` is the limiting partition of the rank vertices (a tuple of frozensets of vertices; the
    vertices in no group are switches and links), ``bandwidth`` the smaller of the capacities leaving
    and entering the groups, summed over the groups, and ``crossings`` how many times each byte must
    cross a group boundary: ``seconds_per_byte = crossings / bandwidth``.
    """
    seconds_per_byte: float
    groups: tuple
    bandwidth: float
    crossings: int

    @property
    def algbw(self):
        """Best allreduce algorithm bandwidth ``N / time`` (bytes/s)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf


def _partition_candidates(net):
    """Vertex labellings to try as partitions: the rank vertices on their own, then, for every
    capacity ``t`` of the graph, the connected components of the links of capacity >= ``t`` (GPUs
    with their NVLink switch, hosts, racks: the tiers a topology is built of)."""
    yield np.arange(net.n)
    caps = net.cap
    for t in sorted(set(caps.tolist()), reverse=True):
        keep = caps >= t
        adj = sp.coo_array((np.ones(int(keep.sum())), (net.tail[:net.m][keep], net.head[:net.m][keep])),
                           shape=(net.n, net.n))
        yield connected_components(adj, directed=True, connection="weak")[1]


def _partition_bound(net, rank_idx):
    """Best ``(crossings / bandwidth, groups, bandwidth, crossings)`` over :func:`_partition_candidates`."""
    tail, head, cap = net.tail[:net.m], net.head[:net.m], net.cap
    best = (0.0, (), math.inf, 0)
    seen = set()
    for labels in _partition_candidates(net):
        group_labels = np.unique(labels[rank_idx])
        j = len(group_labels)
        key = tuple(labels[rank_idx])
        if j < 2 or key in seen:
            continue
        seen.add(key)
        is_group = np.zeros(labels.max() + 1, dtype=bool)
        is_group[group_labels] = True
        crossing = labels[tail] != labels[head]
        out = math.fsum(cap[crossing & is_group[labels[tail]]])
        inn = math.fsum(cap[crossing & is_group[labels[head]]])
        bandwidth = min(out, inn)
        spb = math.inf if bandwidth == 0 else 2 * (j - 1) / bandwidth
        if spb > best[0]:
            groups = tuple(frozenset(net.vertices[i] for i in np.flatnonzero(labels == g)) for g in group_labels)
            best = (spb, groups, bandwidth, 2 * (j - 1))
    return best


def _min_rank_cut(graph, ranks):
    """Smallest capacity of a cut with ranks on both sides, in either direction, and the side it
    leaves. Any such cut separates rank 0 from some rank, one way or the other, so it is the smaller
    of rank 0's broadcast and reduce min cuts (Edmonds, below)."""
    out_rate, out_side = broadcast_bandwidth_graph(graph, ranks, 0)
    in_rate, in_side = reduce_bandwidth_graph(graph, ranks, 0)
    if out_rate <= in_rate:
        return out_rate, out_side
    return in_rate, frozenset(graph.nodes) - in_side   # in_side holds rank 0 and the cut enters it


def allreduce_bound_graph(graph, ranks):
    """A lower bound on allreduce on ``graph`` that holds for every algorithm, pipelined or not.

    Allreduce is *not* bounded by reduce-scatter's bound plus allgather's: the two can overlap on the
    two directions of a full-duplex link (a rank behind a slow link uploads its vector while the
    result of earlier chunks comes down, in about ``N/B``, not ``2(p-1)/p · N/B``). What does hold:

    * **Partition bound.** Split the rank vertices into ``j >= 2`` groups ``S_1..S_j`` of vertices
      (the rest, holding no rank, only forwards). Per byte of the buffer, the groups must gossip: each
      needs the contribution of all the others and no group can learn it in fewer calls than the
      one-way gossip problem allows, ``2(j-1)`` transfers between groups (every transfer leaves one
      group and, the rest only forwarding, enters another). So ``time >= 2(j-1) N / min(Σ B+(S_i),
      Σ B-(S_i))``. With every rank on its own this is the classic ``2(p-1)/p · N/B`` of a uniform
      star (Patarasuk & Yuan, 2009); with hosts, racks or boxes as groups it is the tier bound.
    * **Min cut.** Across any cut with ranks on both sides, the far side needs the sum of the near
      side's contributions: ``N`` bytes each way, ``time >= N / min cut``.

    We take the larger of the min cut and the partition bound over the partitions a topology is built
    of (:func:`_partition_candidates`); any partition gives a valid bound, so this is never above the
    optimum. On full-duplex fabrics where every rank, or every tier, is alike it equals twice
    ForestColl's allgather bound (DGX-1: 150 GB/s bus bandwidth; fat trees; DGX A100 boxes).
    """
    mult = Counter(ranks)
    if len(mult) < 2:
        return AllreduceBound(0.0, (), math.inf, 0)
    rank_vertices = list(mult)
    net = _Network(graph)
    rank_idx = np.array([net.index[v] for v in rank_vertices])
    spb, groups, bandwidth, crossings = _partition_bound(net, rank_idx)
    cut_cap, side = _min_rank_cut(graph, ranks)
    if cut_cap == 0 or 1.0 / cut_cap > spb:
        rest = frozenset(net.vertices) - side
        spb = math.inf if cut_cap == 0 else 1.0 / cut_cap
        groups, bandwidth, crossings = (side, rest), cut_cap, 1
    return AllreduceBound(spb, groups, bandwidth, crossings)


# ----------------------------------------------------------------------------------------------------
# transfers over direct links (the routed partition bound)

TRANSFER_BOUND_MAX_RANKS = 64      # above this many rank vertices the LP is skipped (the bound stays valid)


class TransferBound(NamedTuple):
    """A partition bound in which transfers are routed as transports route them.

    Every transfer between the ``groups`` (a tuple of frozensets of vertices) is a message from a rank
    of one group to a rank of another: it passes through no rank, switches forward it without copying
    it, and ranks joined by a direct link exchange over that link alone (a CUDA peer copy between GPUs
    joined by NVLink never goes through their PCIe switch). ``bandwidth`` is the largest total rate of
    such messages the fabric carries at once. Allgather needs ``j - 1`` transfers per byte of the
    buffer between ``j`` groups (every group must take in what the others contribute) and allreduce
    ``2(j - 1)`` (the gossip count of :func:`allreduce_bound_graph`): ``seconds_per_byte`` is allgather's
    ``(j - 1) / bandwidth``, allreduce's is twice that. 0 where no two ranks of different groups share
    a direct link: the other bounds then say all this one could.
    """
    seconds_per_byte: float
    groups: tuple
    bandwidth: float


def _direct_pairs(net, rank_idx):
    """``({(tail, head)}, is_rank)``: vertex indices of the links that join two rank vertices, and a
    mask of the rank vertices."""
    is_rank = np.zeros(net.n, dtype=bool)
    is_rank[rank_idx] = True
    tail, head = net.tail[:net.m], net.head[:net.m]
    both = is_rank[tail] & is_rank[head]
    return set(zip(tail[both].tolist(), head[both].tolist())), is_rank


def _transfer_bandwidth(net, rank_idx, labels, direct, is_rank):
    """Largest total rate of messages between ranks of different groups (``labels`` per vertex), one
    commodity per sending rank vertex, as :class:`TransferBound` routes them: an LP solved by HiGHS."""
    from scipy.optimize import linprog

    tail, head, cap = net.tail[:net.m], net.head[:net.m], net.cap
    var_k, var_edge = [], []
    for k, s in enumerate(rank_idx.tolist()):
        # s sends, transit vertices forward, ranks of other groups receive: those s has a direct
        # link to over that link alone
        ok = ((tail == s) | ~is_rank[tail]) & (head != s)
        ok &= ~is_rank[head] | (labels[head] != labels[s])
        linked = np.isin(head, [h for t, h in direct if t == s])
        ok &= ~linked | (tail == s)
        edges = np.flatnonzero(ok)
        var_k.append(np.full(len(edges), k))
        var_edge.append(edges)
    src_k, var_edge = np.concatenate(var_k), np.concatenate(var_edge)
    nvar = len(var_edge)
    if nvar == 0:
        return 0.0
    vt, vh = tail[var_edge], head[var_edge]
    # conservation at every transit vertex, per sender
    rows_out = src_k * net.n + vt
    rows_in = src_k * net.n + vh
    keep_out, keep_in = ~is_rank[vt], ~is_rank[vh]
    rows = np.concatenate([rows_out[keep_out], rows_in[keep_in]])
    cols = np.concatenate([np.flatnonzero(keep_out), np.flatnonzero(keep_in)])
    vals = np.concatenate([np.ones(int(keep_out.sum())), -np.ones(int(keep_in.sum()))])
    used, rows = np.unique(rows, return_inverse=True)
    a_eq = sp.csr_array((vals, (rows, cols)), shape=(len(used), nvar))
    a_ub = sp.csr_array((np.ones(nvar), (var_edge, np.arange(nvar))), shape=(net.m, nvar))
    # Units. Every message leaves its sender's group and enters another's, so the total rate is at most
    # top = min(capacity leaving the groups, entering them), and an acyclic optimum puts at most that on
    # any edge: capacities clamped at top lose nothing, and the LP is solved in units of top, not of the
    # fastest link (HiGHS' absolute tolerances, 1e-7, swallowed groups joined by links 1e15 times
    # slower: the LP came back 0, an infinite "bound").
    crossing = labels[tail] != labels[head]
    is_group = np.zeros(int(labels.max()) + 1, dtype=bool)
    is_group[labels[rank_idx]] = True
    top = min(math.fsum(cap[crossing & is_group[labels[tail]]]), math.fsum(cap[crossing & is_group[labels[head]]]))
    if top <= 0:
        return 0.0
    b_ub = np.minimum(cap, top) / top
    gain = is_rank[vh].astype(float)
    res = linprog(-gain, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.zeros(len(used)),
                  bounds=(0, None), method="highs")
    if res.status != 0:     # pragma: no cover - the LP is feasible (0) and bounded (capacities)
        raise PlanError(f"the transfer bound's LP failed: {res.message}")
    # Report the value of a dual solution made feasible, not the primal one: by weak duality it is at
    # least the optimum whatever HiGHS' tolerances did, so the bound (its inverse) is never too high.
    # Each variable sits in one capacity row, so raising that row's price covers any reduced cost
    # HiGHS left negative.
    price = np.maximum(-res.ineqlin.marginals, 0.0)
    short = gain - a_ub.T @ price + a_eq.T @ res.eqlin.marginals
    need = np.zeros(net.m)
    np.maximum.at(need, var_edge, short)
    price = price + np.maximum(need, 0.0)
    return float(b_ub @ price) * top


def transfer_bound_graph(graph, ranks):
    """:class:`TransferBound` on ``(graph, ranks)``: the largest ``(j - 1) / bandwidth`` over the
    partitions of :func:`_partition_candidates` in which two ranks of different groups share a direct
    link. Any partition gives a valid bound; with those links it can beat the cut and partition bounds,
    which let such a pair's traffic take the slower paths beside its link too (on a DGX-1 the PCIe
    switch two NVLinked GPUs share: 156 GB/s of allreduce bus bandwidth instead of 162)."""
    mult = Counter(ranks)
    none = TransferBound(0.0, (), math.inf)
    if len(mult) < 2 or len(mult) > TRANSFER_BOUND_MAX_RANKS:
        return none
    net = _Network(graph)
    rank_idx = np.array([net.index[v] for v in mult])
    direct, is_rank = _direct_pairs(net, rank_idx)
    if not direct:
        return none
    best, seen = none, set()
    for labels in _partition_candidates(net):
        key = tuple(labels[rank_idx])
        j = len(set(key))
        if j < 2 or key in seen or all(labels[a] == labels[b] for a, b in direct):
            continue
        seen.add(key)
        bandwidth = _transfer_bandwidth(net, rank_idx, labels, direct, is_rank)
        spb = math.inf if bandwidth <= 0 else (j - 1) / bandwidth
        if spb > best.seconds_per_byte:
            groups = tuple(frozenset(net.vertices[i] for i in np.flatnonzero(labels == g))
                           for g in sorted(set(key)))
            best = TransferBound(spb, groups, bandwidth)
    return best


# ----------------------------------------------------------------------------------------------------
# broadcast / reduce (Edmonds: rooted min cut)


def broadcast_bandwidth_graph(graph, ranks, root=0):
    """Largest rate (bytes/s) at which rank ``root`` can stream to every other rank: by Edmonds'
    branching theorem it is ``min_v maxflow(root, v)`` over the other ranks' vertices, and packing
    out-trees attains it, so a broadcast of ``N`` bytes takes at least ``N`` over this rate.

    Returns ``(rate, cut)``: the rate (``inf`` when no other rank has its own vertex) and the source
    side of the limiting cut. The rate is the float capacity of that real cut.
    """
    rv = ranks[root]
    targets = [v for v in dict.fromkeys(ranks) if v != rv]
    if not targets:
        return math.inf, frozenset()
    net = _Network(graph)
    s = net.index[rv]
    reps = _twin_representatives(graph, targets, exclude={rv})
    q, exact = _integer_capacities(net.cap, 1)
    if exact:           # one common integer unit (every realistic fabric): one flow per target class
        mat = net.matrix(q)
        best_t = min(reps, key=lambda v: (int(maximum_flow(mat, s, net.index[v]).flow_value), reps.index(v)))
        mask = net.source_side(mat, maximum_flow(mat, s, net.index[best_t]), s)
        return net.cut_capacity(mask), frozenset(net.vertices[i] for i in np.flatnonzero(mask))
    # Each flow runs on integer capacities clamped at twice a bound the min cut to t cannot exceed
    # (the root's out-capacity, t's in-capacity, the best cut so far): a cut through a clamped edge is
    # then worth more than the min cut and every cut at or below the bound keeps its exact capacity.
    # Quantised at the top capacity instead, links 1e12 times slower than the fastest rounded to
    # nothing and all looked alike (a third of the rate on a star with ranks at 1 and 2 kB/s). Where
    # rounding remains (edges below about 2**-30 of the bound), the flow is repeated at the better cut
    # found until it finds none.
    exact_cut = net.exact_cut
    root_out = exact_cut(np.arange(net.n) == s)
    best = None                 # (exact capacity, source side)
    for v in reps:
        t = net.index[v]
        while True:
            bound = min(root_out, exact_cut(np.arange(net.n) != t))
            improves = best is None or bound < best[0]     # then t's min cut beats the best one
            if not improves:
                bound = best[0]
            q, exact = _integer_capacities([min(c, 2 * bound) for c in net.exact_cap] + [bound], 1)
            mat = net.matrix(q[:-1])
            res = maximum_flow(mat, s, t)
            if not improves and int(res.flow_value) >= int(q[-1]):
                break
            mask = net.source_side(mat, res, s)
            value = exact_cut(mask)
            if best is not None and value >= best[0]:   # only possible with rounded capacities
                break
            best = (value, mask)
            if exact:
                break
    mask = best[1]
    return net.cut_capacity(mask), frozenset(net.vertices[i] for i in np.flatnonzero(mask))


def reduce_bandwidth_graph(graph, ranks, root=0):
    """Like :func:`broadcast_bandwidth_graph` for a reduce to ``root``: ``min_v maxflow(v, root)``,
    i.e. a broadcast on the reversed graph (the returned cut is then the sink side)."""
    return broadcast_bandwidth_graph(graph.reverse(copy=False), ranks, root)


# ----------------------------------------------------------------------------------------------------
# latency


def min_rank_latency_graph(graph, ranks):
    """Smallest latency (s) of a path from one rank to a *different* rank on ``graph`` (edge attr
    ``latency``), whose interior vertices are not ranks (ranks never forward): the smallest
    off-diagonal entry of :func:`rank_latency_matrix`. 0 when two ranks share a vertex; ``inf`` when
    no rank can reach another."""
    lat = rank_latency_matrix(graph, ranks)
    off = lat[~np.eye(len(lat), dtype=bool)]
    return float(off.min()) if off.size else math.inf


def rank_latency_matrix(graph, ranks):
    """``lat[i, j]``: smallest latency (s) of a path from rank ``i`` to rank ``j`` whose interior
    vertices are not ranks (ranks never forward); 0 between two ranks on one vertex and on the
    diagonal, ``inf`` without a path.

    One Dijkstra per rank vertex on a copy of the graph in which every rank vertex is split into an
    exit (its out-edges) and an entry (its in-edges): a path from an exit to an entry cannot pass
    through a third rank."""
    verts = list(dict.fromkeys(ranks))
    pos = {v: i for i, v in enumerate(verts)}
    index = {v: i for i, v in enumerate(graph.nodes)}
    n, k = len(index), len(verts)
    rows, cols, vals = [], [], []
    for u, v, d in graph.edges(data=True):
        rows.append(index[u])
        cols.append(n + pos[v] if v in pos else index[v])      # into a rank: its entry
        vals.append(float(d.get("latency", 0.0)))
    # a csr matrix keeps explicit zeros, and csgraph takes them for edges: zero-latency links stay links
    mat = sp.csr_matrix((vals, (rows, cols)), shape=(n + k, n + k))
    dist = dijkstra(mat, indices=[index[v] for v in verts])[:, n:]
    at = np.array([pos[v] for v in ranks], dtype=np.int64)
    lat = dist[np.ix_(at, at)]
    lat[at[:, None] == at[None, :]] = 0.0              # the diagonal, and ranks sharing a vertex
    return lat


def latency_rounds(lat):
    """``[(latency, rounds), ...]``: for each latency tier, how many rounds any schedule needs that
    are at least that slow, in the round model of :func:`latency_bound`.

    ``lat`` is :func:`rank_latency_matrix`. For a latency ``L``, the *groups* are the ranks joined by
    transfers faster than ``L`` (single linkage: hosts, racks, ...), the largest of ``g`` ranks. What
    a group's ranks know together grows only by messages from outside it, each at least ``L`` long;
    a rank receives one message at a time, so while one such message travels the group takes in at
    most ``g``, each carrying at most what one group knew. The largest group's knowledge therefore
    grows at most ``(1 + g)``-fold per ``L``, and all ``p`` contributions take at least ``k`` such
    steps, the least ``k`` with ``g (1 + g)^k >= p``. (Broadcast, counting the groups that hold the
    data: each of their at most ``g`` ranks per group sends to at most one new group per ``L``.)
    Below the smallest latency the groups are single ranks: ``ceil(log2 p)``. Groups only change where
    a minimum spanning tree of ``lat`` has an edge, so those latencies are the tiers."""
    p = len(lat)
    if p <= 1:
        return []
    sym = np.minimum(lat, lat.T)
    off = sym[~np.eye(p, dtype=bool)]
    finite = off[np.isfinite(off)]
    if not finite.size:
        return [(math.inf, 1)]
    # minimum_spanning_tree reads 0 as "no edge": zero latencies become a positive value below every
    # other one (the tree depends only on the order), unreachable pairs become 0; merges read exact values
    positive = finite[finite > 0]
    weights = np.where(sym > 0, sym, positive.min() / 2 if positive.size else 1.0)
    weights[~np.isfinite(sym)] = 0.0
    np.fill_diagonal(weights, 0.0)
    tree = minimum_spanning_tree(weights).tocoo()
    merges = sorted(zip(sym[tree.row, tree.col].tolist(), tree.row.tolist(), tree.col.tolist()))
    parent = list(range(p))
    size = [1] * p

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    tiers, largest, done = [], 1, 0
    for latency in sorted({float(finite.min())} | {w for w, _, _ in merges}):
        while done < len(merges) and merges[done][0] < latency:
            a, b = root(merges[done][1]), root(merges[done][2])
            if a != b:
                parent[a] = b
                size[b] += size[a]
                largest = max(largest, size[b])
            done += 1
        rounds, reach = 0, largest
        while reach < p:
            reach *= 1 + largest
            rounds += 1
        tiers.append((latency, rounds))
    return tiers


# ----------------------------------------------------------------------------------------------------
# Topology wrappers

_CACHE = OrderedDict()
_CACHE_SIZE = 256


def _cached(key, compute):
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    value = compute()
    _CACHE[key] = value
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def _check(collective):
    if collective not in COLLECTIVES:
        raise PlanError(f"no bound for collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")


def _is_symmetric(graph):
    """True when every edge has a reverse edge of the same capacity (every full-duplex fabric)."""
    succ = graph.succ
    return all(u == v or (u in succ[v] and succ[v][u].get("capacity") == d.get("capacity"))
               for u, v, d in graph.edges(data=True))


def _cut_for(graph, ranks, reverse):
    if reverse and not _is_symmetric(graph):
        return cut_bound_graph(graph.reverse(copy=False), ranks)
    return cut_bound_graph(graph, ranks)


def cut_bound(topo, reverse=False):
    """:class:`CutBound` of ``topo`` (ForestColl's allgather optimum), cached per topology fingerprint.

    ``reverse=True`` gives reduce-scatter's bound: the same computation on the reversed graph, so that
    ``cut`` is a set whose *incoming* capacity ``bandwidth_out`` limits it (each rank in it needs its
    block reduced over the ranks outside). On full-duplex fabrics both are the same.
    """
    def compute():
        graph = topo.usable_graph()
        if reverse and _is_symmetric(graph):
            return cut_bound(topo, False)
        return _cut_for(graph, list(topo.ranks), reverse)
    return _cached((topo.fingerprint, "cut", bool(reverse)), compute)


def allreduce_bound(topo):
    """:class:`AllreduceBound` of ``topo``, cached per topology fingerprint."""
    return _cached((topo.fingerprint, "allreduce"),
                   lambda: allreduce_bound_graph(topo.usable_graph(), list(topo.ranks)))


def transfer_bound(topo):
    """:class:`TransferBound` of ``topo``, cached per topology fingerprint. The same on the reversed
    fabric (reverse every message), so it bounds reduce-scatter as it bounds allgather."""
    return _cached((topo.fingerprint, "transfers"),
                   lambda: transfer_bound_graph(topo.usable_graph(), list(topo.ranks)))


def min_rank_latency(topo):
    """Smallest rank-to-rank path latency of ``topo`` (s), cached per fingerprint."""
    return _cached((topo.fingerprint, "latency"),
                   lambda: min_rank_latency_graph(topo.usable_graph(), list(topo.ranks)))


def _bandwidth_seconds(collective, nbytes, p, cut, root_rate, allreduce, transfers):
    """Shared by the graph and Topology forms; ``cut(reverse)``, ``root_rate()``, ``allreduce()`` and
    ``transfers()`` compute lazily."""
    _check(collective)
    if p <= 1 or nbytes == 0:
        return 0.0
    if collective in ("broadcast", "reduce"):
        rate = root_rate()
        return 0.0 if math.isinf(rate) else (math.inf if rate == 0 else nbytes / rate)
    if collective == "allreduce":
        return nbytes * max(allreduce().seconds_per_byte, 2 * transfers().seconds_per_byte)
    return nbytes * max(cut(collective == "reduce_scatter").seconds_per_byte, transfers().seconds_per_byte)


def _latency_seconds(collective, p, tiers):
    _check(collective)
    return 0.0 if p <= 1 else max(rounds * latency if rounds else 0.0 for latency, rounds in tiers())


def _check_root(root, p):
    if not 0 <= root < p:
        raise PlanError(f"root {root} is not a rank (there are {p})")


def bandwidth_bound_graph(graph, ranks, collective, nbytes, root=0):
    """:func:`bandwidth_bound` on a bare ``(graph, ranks)``, uncached."""
    _check_root(root, len(ranks))
    fn = broadcast_bandwidth_graph if collective == "broadcast" else reduce_bandwidth_graph
    memo = {}

    def cut(reverse):
        if reverse and _is_symmetric(graph):
            reverse = False
        if reverse not in memo:
            memo[reverse] = _cut_for(graph, ranks, reverse)
        return memo[reverse]
    return _bandwidth_seconds(collective, nbytes, len(ranks), cut, lambda: fn(graph, ranks, root)[0],
                              lambda: allreduce_bound_graph(graph, ranks), lambda: transfer_bound_graph(graph, ranks))


def latency_bound_graph(graph, ranks, collective):
    """:func:`latency_bound` on a bare ``(graph, ranks)``."""
    return _latency_seconds(collective, len(ranks), lambda: latency_rounds(rank_latency_matrix(graph, ranks)))


def lower_bound_graph(graph, ranks, collective, nbytes, root=0):
    """:func:`lower_bound` on a bare ``(graph, ranks)``."""
    bw = bandwidth_bound_graph(graph, ranks, collective, nbytes, root=root)
    lat = latency_bound_graph(graph, ranks, collective) if nbytes > 0 else 0.0
    return Bound(max(bw, lat), bw, lat)


def bandwidth_bound(topo, collective, nbytes, root=0):
    """Seconds that a ``collective`` of ``nbytes`` takes at least on ``topo``, from capacities alone.

    ``nbytes`` is the total buffer ``N``: allgather output / reduce-scatter input (each rank owns N/p),
    the allreduce buffer, the broadcast/reduce buffer. allgather:
    ``N * cut_bound(topo).seconds_per_byte``; reduce_scatter: the same on the reversed graph (it is
    allgather with every transfer reversed and a reduction at each receive; ForestColl uses this
    duality), identical on full-duplex fabrics. allreduce: ``N * allreduce_bound(topo).seconds_per_byte``
    (see :func:`allreduce_bound_graph`; with uniform ranks the classic ``2(p-1)/p · N/B``).
    broadcast / reduce: ``N`` over the rooted min cut (Edmonds), ``root`` being a rank index.
    """
    _check_root(root, topo.nranks)

    def root_rate():
        fn = broadcast_bandwidth_graph if collective == "broadcast" else reduce_bandwidth_graph
        return _cached((topo.fingerprint, collective, root),
                       lambda: fn(topo.usable_graph(), list(topo.ranks), root))[0]
    return _bandwidth_seconds(collective, nbytes, topo.nranks, lambda rev: cut_bound(topo, rev), root_rate,
                              lambda: allreduce_bound(topo), lambda: transfer_bound(topo))


def latency_bound(topo, collective):
    """Seconds of latency any algorithm pays in the round (single-port) model.

    The model, as in the cost models of Thakur, Rabenseifner & Gropp (2005): a rank sends one message
    and receives one message at a time, each taking at least its rank-to-rank latency; ranks need not
    move in lock-step. In allgather every rank
    needs data from every other; a received message adds at most what one peer knew, so the
    contributions a rank holds at most double per smallest latency: ``ceil(log2 p)`` of them. On a
    tiered fabric the same holds for groups (hosts, racks; :func:`latency_rounds`): a host's ranks
    hear from other hosts only through cross-host messages, so a host of ``g`` ranks at most
    ``(1 + g)``-folds what it knows per cross-host latency. The bound is the largest of these
    tier by tier. On 4 GPUs x 16 hosts x 3 racks with 2, 6 and 10 us: ``max(8 * 2, 3 * 6, 1 * 10) =
    18`` us. (Charging the tiers one after the other, ``10 + 2*6 + 5*2 = 32`` us, would hold only if
    every rank moved in lock-step rounds; ranks run ahead of one another, so it is no bound.)
    Reduce-scatter is the dual (each result block combines p contributions); allreduce contains that
    combination; broadcast and reduce spread one rank's data, and the ranks (groups) holding it grow
    by the same factors. 0 for a single rank.

    A schedule in which a rank receives several messages at once is outside the model: the simulator
    charges such fan-out no per-message cost, so at tiny sizes it can predict packings of many trees
    below this bound (a gap under 1 in ``ddl plan``).
    """
    return _latency_seconds(collective, topo.nranks, lambda: _cached(
        (topo.fingerprint, "latency-tiers"),
        lambda: latency_rounds(rank_latency_matrix(topo.usable_graph(), list(topo.ranks)))))


def lower_bound(topo, collective, nbytes, root=0):
    """:class:`Bound` for ``collective`` of ``nbytes`` on ``topo``: the larger of the bandwidth and the
    latency bounds (each is a bound on its own; their sum is not). Nothing to move (0 bytes) takes no
    time: no message need be sent, so the latency bound is 0 too."""
    bw = bandwidth_bound(topo, collective, nbytes, root=root)
    lat = latency_bound(topo, collective) if nbytes > 0 else 0.0
    return Bound(max(bw, lat), bw, lat)


# ----------------------------------------------------------------------------------------------------
# nccl-tests bandwidths


def algbw(nbytes, seconds):
    """Algorithm bandwidth ``nbytes / seconds`` (bytes/s) as nccl-tests report it; inf for 0 s."""
    return math.inf if seconds == 0 else nbytes / seconds


def busbw_factor(collective, p):
    """nccl-tests' bus bandwidth factor: allreduce ``2(p-1)/p``; allgather, reduce_scatter and alltoall
    ``(p-1)/p``; broadcast and reduce 1. It makes a perfect ring's busbw equal its link bandwidth."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reduce_scatter", "alltoall"):
        return (p - 1) / p
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise PlanError(f"no bus bandwidth factor for collective {collective!r}")


def busbw(collective, nbytes, seconds, p):
    """Bus bandwidth (bytes/s): :func:`algbw` times :func:`busbw_factor`."""
    return algbw(nbytes, seconds) * busbw_factor(collective, p)
