"""Allreduce on a weighted packing of spanning trees, each reducing to its centre and broadcasting back.

Source: G. Wang, S. Venkataraman, A. Phanishayee, J. Thelin, N. Devanur and I. Stoica, "Blink: Fast
and Generic Collectives for Distributed ML", MLSys 2020 (spanning-tree packing; reduce + broadcast per
tree); the packing LP by column generation follows the fractional Nash-Williams/Tutte packing, priced
by minimum spanning trees.

Why beside ``tree-packing``: reduce-scatter + allgather trees (ForestColl) carry every block once up
and once down each tree, so allreduce costs twice allgather. A reduce-broadcast tree instead carries
its share of the *whole* buffer up (reducing) and back down, and both directions of every link work at
once. Where ranks are uneven that overlap is worth up to 2x: a rank behind a slow link only uploads
its vector and downloads the result (``N/B``), instead of ``2(p-1)/p · N/B``. Without switches the
packing attains the partition bound of :func:`ddl.bounds.allreduce_bound` exactly.

Packing. A tree is a spanning tree on the ranks; its edge ``{u, v}`` carries the tree's share ``w`` on
the topology's routes ``u -> v`` and ``v -> u`` (split evenly among equal routes, as the simulator and
executors do). The LP maximises ``sum w_T`` subject to every directed link's capacity; the buffer then
takes ``N / sum w_T``. Columns are generated: given the link prices ``y`` of the LP's dual, the tree of
least ``sum_e sum_l y_l load_e(l)`` is a minimum spanning tree; it enters while that sum is below 1.
HiGHS solves each restricted LP. The optimum uses at most as many trees as there are links.

Schedule. Every tree is rooted at a centre (least depth; with a size to plan for, the centre the
simulator predicts fastest) and its share cut into ``k`` equal pieces
(see :mod:`ddl.algorithms.tree_packing` for the depth rule; with a size to plan for, the count then
doubles while the simulator predicts each doubling faster, see :func:`_deeper_while_faster`); programs
list, piece by piece, every tree's reductions leaves first and then its broadcast root first, so each
hop forwards one piece while the next crosses the hop below.

Collectives: allreduce only, up to :data:`MAX_RANKS` ranks.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_array
from scipy.sparse.csgraph import breadth_first_order, minimum_spanning_tree

from ..errors import PlanError
from ..schedule import ScheduleBuilder
from ..simulate import simulate
from .ring import check_request
from .tree_packing import DEFAULT_NBYTES, MAX_TRANSFERS, MIN_CHUNK_BYTES, pipeline_target
from .variants import CHOOSE_VARIANTS_OPS, replaces, to_beat, tried, try_variant

NAME = "reduce-broadcast-trees"
MAX_RANKS = 64
MAX_ITERATIONS = 400       # column generation stops here even if not converged (the LP stays feasible)
TOLERANCE = 1e-9           # a tree enters when its priced cost is below 1 - TOLERANCE
WEIGHT_GRID = 1 << 16      # tree shares become integers out of this (chunk pattern weights)
MIN_TREE_SHARE = 1e-3      # trees carrying less than this share of the buffer are dropped
ROOT_CHOICE_OPS = 2_000_000  # operations simulated, at most, to choose the trees' roots among their centres


def _edge_loads(topo, p):
    """Directed links (index) and, per rank pair ``u < v``, the load a unit share puts on each link
    (both directions, split evenly among equal routes): ``loads[(u, v)] = {link index: load}``."""
    links, loads = {}, {}
    for u in range(p):
        for v in range(u + 1, p):
            load = {}
            for a, b in ((u, v), (v, u)):
                paths = topo.routes(a, b)
                for path in paths:
                    for x, y in zip(path[:-1], path[1:]):
                        i = links.setdefault((x, y), len(links))
                        load[i] = load.get(i, 0.0) + 1.0 / len(paths)
            loads[(u, v)] = load
    return links, loads


def _spanning_tree(p, cost):
    """Minimum spanning tree of the complete graph on ``p`` ranks under ``cost`` (p x p, symmetric):
    a tuple of edges ``(u, v)`` with ``u < v``. Costs are shifted to be positive (scipy reads 0 as no
    edge) and ties broken by index, so the tree is a fixed function of the costs."""
    scale = float(np.abs(cost).max()) or 1.0
    shift = cost / scale - cost.min() / scale + 1.0
    tie = np.arange(p * p, dtype=float).reshape(p, p) * (1e-9 / (p * p))
    tree = minimum_spanning_tree(np.triu(shift + tie, 1)).tocoo()
    return tuple(sorted((min(int(a), int(b)), max(int(a), int(b))) for a, b in zip(tree.row, tree.col)))


def pack_trees(topo):
    """The LP's packing: ``(trees, weights, rate)`` with ``rate = sum(weights)`` in bytes/s of buffer
    (trees below :data:`MIN_TREE_SHARE` of the optimum left out)."""
    p = topo.nranks
    links, loads = _edge_loads(topo, p)
    caps = np.empty(len(links))
    for (x, y), i in links.items():
        caps[i] = float(topo.capacity(x, y))
    unit = caps.max()          # the LP runs on capacities scaled to at most 1: HiGHS likes O(1) numbers
    pairs = list(loads)

    def column(tree):
        col = np.zeros(len(links))
        for e in tree:
            for i, x in loads[e].items():
                col[i] += x
        return col

    hops = np.zeros((p, p))
    for (u, v), load in loads.items():
        hops[u, v] = hops[v, u] = sum(load.values())
    trees = [_spanning_tree(p, hops)]
    cols = [column(trees[0])]
    for _ in range(MAX_ITERATIONS):
        a = np.array(cols).T
        res = linprog(-np.ones(len(trees)), A_ub=a, b_ub=caps / unit, bounds=(0, None), method="highs")
        if res.status != 0:
            raise PlanError(f"{NAME}: the packing LP failed ({res.message})")
        prices = -res.ineqlin.marginals
        cost = np.zeros((p, p))
        for (u, v) in pairs:
            cost[u, v] = cost[v, u] = sum(prices[i] * x for i, x in loads[(u, v)].items())
        tree = _spanning_tree(p, cost)
        if sum(cost[u, v] for u, v in tree) >= 1 - TOLERANCE or tree in trees:
            break
        trees.append(tree)
        cols.append(column(tree))
    # Blink's pruning: a tree with a sliver of the data costs a message per edge and piece, and may
    # run over a link the LP barely uses; dropping it gives up at most its share of the bandwidth
    weights = res.x * unit
    if not weights.sum() > 0:   # links a billion-fold apart: the slowest is zero within HiGHS's tolerance
        raise PlanError(f"{NAME}: the packing LP gives no tree any bandwidth (link capacities from "
                        f"{caps.min():.3g} to {unit:.3g} B/s are too far apart for it)")
    keep = [i for i, w in enumerate(weights) if w >= MIN_TREE_SHARE * weights.sum()]
    kept = [float(weights[i]) for i in keep]
    return [trees[i] for i in keep], kept, sum(kept)


def _centred(p, tree):
    """The tree rooted at each of its centres (the roots of least depth), as ``(root, parent, order,
    depth)``; ``order`` lists the ranks by depth. A path of even length has one centre, of odd length
    two, and so on: which one is the root changes which links carry reductions first and which
    broadcasts, not the tree's depth."""
    rows = [u for u, v in tree] + [v for u, v in tree]
    cols = [v for u, v in tree] + [u for u, v in tree]
    adj = csr_array((np.ones(len(rows)), (rows, cols)), shape=(p, p))
    found = []
    for r in range(p):
        order, pred = breadth_first_order(adj, r, directed=False)
        depth = np.zeros(p, dtype=int)
        for v in order[1:]:
            depth[v] = depth[pred[v]] + 1
        found.append((int(depth.max()), r, {int(v): int(pred[v]) for v in order[1:]}, [int(v) for v in order]))
    least = min(f[0] for f in found)
    return [(r, parent, order, d) for d, r, parent, order in found if d == least]


def reduce_broadcast_trees(topo, collective, *, root=0, nbytes=None):
    """Blink-style allreduce on ``topo`` (see the module docstring)."""
    p = topo.nranks
    check_request(NAME, collective, p, root, ("allreduce",))
    if p > MAX_RANKS:
        raise PlanError(f"{NAME} plans up to {MAX_RANKS} ranks (the packing LP grows with p^2 rank pairs); "
                        f"'hierarchical' and 'halving-doubling' scale to {p}")
    if p == 1:
        return ScheduleBuilder(collective, 1, (1,), algorithm=NAME).build(trees=0)
    trees, weights, rate = pack_trees(topo)
    centres = [_centred(p, t) for t in trees]
    rooted = [c[0] for c in centres]
    sized = bool(nbytes)
    nbytes = DEFAULT_NBYTES if not sized else max(int(nbytes), 1)
    target = pipeline_target(nbytes / rate)
    most = max(len(trees), min(MAX_TRANSFERS // (2 * (p - 1)), max(1, nbytes // MIN_CHUNK_BYTES)))
    sched = _emit(collective, p, rooted, weights, rate, min(target * len(trees), most), target)
    if sized:
        sched, seconds, rooted = _roots_by_simulation(topo, sched, centres, rooted, weights, rate, target, nbytes)
        sched = _deeper_while_faster(topo, sched, seconds, rooted, weights, rate, target, most, nbytes)
    return sched


def _roots_by_simulation(topo, sched, centres, rooted, weights, rate, target, nbytes):
    """``(schedule, seconds, rooted)`` with each tree rooted at whichever of its centres the simulator
    predicts fastest, one tree at a time (the others as chosen so far), within :data:`ROOT_CHOICE_OPS`
    simulated operations. The same messages either way, only where reductions meet: where a pair
    carries pieces of several trees, its messages go one after the other and share a link with the
    other pairs evenly, not in the proportions the LP planned, and the root decides which direction's
    pieces wait on slow reductions. On the DGX-1's GPUs {0, 4, 6, 7} rooting the two trees that cross
    the PCIe/CPU path at gpu6 instead of gpu0 takes the 256 MiB allreduce from 1.18 to 1.02 of the
    bound. A trial is simulated only until it provably cannot replace the rooting kept
    (:func:`~ddl.algorithms.variants.try_variant`)."""
    seconds = simulate(topo, sched, nbytes).seconds
    budget = ROOT_CHOICE_OPS
    total = sched.info["pieces"]
    for t, options in enumerate(centres):
        for option in options:
            if option[0] == rooted[t][0]:
                continue
            budget -= sched.nops
            if budget < 0:
                return sched, seconds, rooted
            trial = rooted[:t] + [option] + rooted[t + 1:]
            other = _emit(sched.collective, sched.nranks, trial, weights, rate, total, target)
            other_seconds, _ = try_variant(topo, other, nbytes, to_beat(other.nops, seconds, sched.nops,
                                                                       topo.message_cost))
            if replaces(other_seconds, other.nops, seconds, sched.nops, topo.message_cost):
                sched, seconds, rooted = other, other_seconds, trial
    return sched, seconds, rooted


def _emit(collective, p, rooted, weights, rate, total, target):
    """The schedule with about ``total`` pieces, shared among the trees by weight."""
    total = max(len(rooted), total)
    # pieces of (about) one size for every tree, as many per tree as its share asks for: links are
    # shared fairly among the messages on them, so equal messages share them as the LP planned
    pieces = [max(1, round(total * w / rate)) for w in weights]
    pattern, first = [], []
    for w, k in zip(weights, pieces):
        first.append(len(pattern))
        pattern += [max(1, round(WEIGHT_GRID * w / rate / k))] * k
    b = ScheduleBuilder(collective, p, pattern, algorithm=NAME)
    # trees advance in step with their share: piece j of tree t goes at fraction (j + 1/2) / pieces[t]
    for _frac, t, j in sorted(((j + 0.5) / k, t, j) for t, k in enumerate(pieces) for j in range(k)):
        _root, parent, order, _d = rooted[t]
        chunk = first[t] + j
        for v in reversed(order[1:]):
            b.transfer(v, parent[v], chunk, reduce=True)
        for v in order[1:]:
            b.transfer(parent[v], v, chunk)
    return b.build(trees=len(rooted), depth=max(d for *_, d in rooted), pipeline=target, pieces=sum(pieces),
                   tree_pieces=pieces, seconds_per_byte=1.0 / rate, tree_weights=[round(w / rate, 6) for w in weights])


def _deeper_while_faster(topo, sched, seconds, rooted, weights, rate, target, most, nbytes):
    """Twice the pieces, again and again, while that is predicted faster by the margin more messages
    must earn (:mod:`ddl.algorithms.variants`), up to ``most`` pieces (none below MIN_CHUNK_BYTES,
    MAX_TRANSFERS in all). A piece reduces up its tree and comes back down, so the pipeline fills and
    drains through twice the tree's depth: on the DGX-1's fragments (ranks {0, 1, 4, 5}, {0, 1, 2, 3, 7}
    and {0, 4, 6, 7}, PCIe and CPUs included) the pieces of about 8 per tree came to 1.13, 1.28 and
    1.46 of the bound at 256 MiB, 32 times as many to 1.01, 1.01 and 1.18 (the last 1.02 once its trees
    are rooted as :func:`_roots_by_simulation` says). Each doubling is simulated only until it provably
    cannot earn its margin."""
    kept, kept_seconds = sched, seconds
    attempts = [tried(seconds, None, pieces=sched.info["pieces"], operations=sched.nops)]
    total = sched.info["pieces"]
    while total < most:
        total = min(2 * total, most)
        other = _emit(sched.collective, sched.nranks, rooted, weights, rate, total, target)
        if other.nops > CHOOSE_VARIANTS_OPS:
            break
        seconds, at_least = try_variant(topo, other, nbytes, to_beat(other.nops, kept_seconds, kept.nops,
                                                                     topo.message_cost))
        attempts.append(tried(seconds, at_least, pieces=other.info["pieces"], operations=other.nops))
        if not replaces(seconds, other.nops, kept_seconds, kept.nops, topo.message_cost):
            break
        kept, kept_seconds = other, seconds
    kept.info["pipelines_tried"] = attempts
    return kept
