"""Optimal spanning-tree packing (``tree-packing``): ForestColl's throughput optimum on any topology.

What it optimises
=================
Bandwidth. For allgather every rank ``r`` owns a block of ``N/p`` bytes that must reach every rank; we
pack, for every root ``r``, spanning out-arborescences over the *ranks* whose edges are logical
rank-to-rank transfers routed over physical paths through switches/NICs/PCIe (never through another
rank), with weights summing to 1 per root, minimising the time ``T`` in which every physical link
carries its share::

    minimise T  s.t.  sum_trees weight * (N/p) * #(tree edges routed over e) <= capacity(e) * T.

The LP is solved exactly by column generation (:mod:`ddl.algorithms.arborescence`): HiGHS on the
master, Dijkstra + Chu-Liu/Edmonds minimum-cost arborescences as pricing, with a Lagrangian
certificate. Its optimum equals ForestColl's cut bound (Zhao et al., 2024): routing tree edges
through switches is exactly what ForestColl's edge splitting achieves. Ranks exchanged by an
automorphism of the fabric (found with Weisfeiler-Lehman hashes + VF2) share one set of trees, which
shrinks the LP by up to ``p``. Like Blink (Wang et al., MLSys'20), a second phase keeps ``T`` and
picks, among the optima, few shallow trees that also run well level by level (see the arborescence
module: store-and-forward trees under fair link sharing behave like their levels run in sequence).

Collectives
===========
* ``allgather``: block ``r`` is cut into pieces, one range of pieces per tree of root ``r`` (size
  proportional to its weight); every tree edge is a ``transfer(parent, child)`` in breadth-first order.
  ``Schedule.pattern`` is the same for every block, so the pieces are the merged breakpoints of all
  roots' cumulative weights; each piece follows the tree whose weight interval contains it. Weights
  are put on the coarsest grid (16, 64, 256, 1024 or 2**20 steps per block) that costs at most
  ``ROUNDING_SLACK`` (0.5%) of bandwidth, so that the pattern stays short.
* ``reduce_scatter``: the same on in-trees (the packing of the reversed fabric, i.e. the out-trees
  reversed on full-duplex fabrics): leaves first, every rank reduces its children's partials into its
  own and sends the sum to its parent; the root ends with the full block.
* ``allreduce``: reduce-scatter on the in-trees then allgather on the out-trees, for the same pieces
  (one block: the ``p`` logical blocks are consecutive groups of pieces). Time ``2x`` allgather's, which
  is the cut bound for allreduce as reduce-scatter + allgather.
* ``broadcast``: the same LP with the one root (its optimum is the rooted min cut, Edmonds).

Pipelining: when trees are deeper than 1 or the collective reduces, every piece is cut into
sub-chunks so that each tree carries ``MIN_PIPELINE`` (8) of them, more (up to ``MAX_PIPELINE``, 32)
when the LP's time for the buffer allows steps of ``PIPELINE_STEP_SECONDS`` (10 ms) each, each
sub-chunk >= 256 KiB (``nbytes`` defaults to 256 MiB), at most ``MAX_TRANSFERS`` transfers in all.
Deeper pipelines drain faster but every message costs the executor time that the model does not
count: on a fast fabric 32 sub-chunks made a 64 MiB host allreduce 2-3x slower than 8, so depth grows
only where each step is long. Between ``MIN_STEP_SECONDS`` (2.5 ms) and that, more sub-chunks per
tree (up to ``MAX_PIPELINE``) are kept where they are predicted at least 1% faster
(:mod:`ddl.algorithms.variants`; both are simulated when the size is given and the schedules are
small): the heterogeneous cluster's T4 NICs wait a step for the first sums and idle a step at the
end, and 32 sub-chunks instead of 15 take its 256 MiB allreduce from 1.046 to 1.029 of the bound.
(The fast fabric above had steps of about 0.4 ms at 32 sub-chunks.) Sub-chunks of a piece are equal
(a rank pair's messages leave one after the other, so each hop of a tree works on one sub-chunk while
the next hop forwards the one before).
Programs list transfers by pipeline step, then piece, then block, in
breadth-first order (leaves first for reductions), so an executor that serves a peer in program
order pipelines as well. ``Schedule.routes`` pins the physical paths the LP chose (byte shares per
rank pair), so the simulator and executors load the links the LP planned.

``direct-link-trees`` (:func:`direct_link_trees`) runs the same packing over the links that join two
ranks directly and nothing else, as Blink packs NVLink alone: on a DGX-1 the PCIe switches and CPUs
add 4% to the LP's bandwidth (156 against 150 GB/s bus bandwidth: PCIe carries the hops between GPUs
without NVLink) but take 232 trees instead of 52 to use it, and the trees then share links unevenly;
the planner simulates both and keeps the faster. In both, ranks joined by a direct link exchange over
it alone, as transports do (:meth:`ddl.topology.Topology.routes`).

Limits: at most :data:`MAX_RANKS` (64) ranks -- the LP grows as ``p`` roots x links; big symmetric
clusters are the ``hierarchical`` algorithm's job. A packing whose trees cut the blocks into so many
pieces that the schedule needs more than :data:`MAX_PLAN_TRANSFERS` transfers before pipelining
declines with a PlanError (on the zoo: the 2 x 8 and 4 x 8 DGX A100 and the interleaved 4:1 fat
tree), since such schedules take minutes to simulate and spend their time on per-message costs;
reducing the tree count there (Blink's second phase, or trees built from the fabric's automorphism
group) is open. Deterministic: everything is sorted and HiGHS runs a fixed dual simplex. The
packing is cached per (topology, direction, root) in the process.
"""
from __future__ import annotations

import bisect
import functools
import math

import networkx as nx
import numpy as np

from ..errors import PlanError
from ..schedule import ScheduleBuilder
from ..simulate import simulate
from ..units import whole_number
from .arborescence import pack_arborescences
from .variants import CHOOSE_VARIANTS_OPS, replaces, to_beat, tried, try_variant

NAME = "tree-packing"
DIRECT = "direct-link-trees"
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
MAX_RANKS = 64
GRID = 1 << 20                    # tree weights are integers out of GRID per block
ROUNDING_SLACK = 5e-3             # bandwidth we give up to put tree weights on a coarse grid
MIN_CHUNK_BYTES = 256 << 10       # sub-chunks stay at least this large
DEFAULT_NBYTES = 256 << 20        # pipelining assumes this buffer when nbytes is not given
MIN_PIPELINE = 8                  # sub-chunks per tree (when sizes allow) ...
MAX_PIPELINE = 32                 # ... up to this many on slow fabrics, where
PIPELINE_STEP_SECONDS = 10e-3     # ... one step of the pipeline then still lasts this long
MIN_STEP_SECONDS = 2.5e-3         # a deeper pipeline is tried where its steps last at least this long
MAX_TRANSFERS = 1 << 16           # pipelining stops short of this many transfers per schedule
MAX_PIECE_TRANSFERS = 1 << 16     # weight grids whose pieces need more transfers than this are not used
MAX_PLAN_TRANSFERS = 1 << 15      # packings that need more transfers than this (before pipelining) decline


# ----------------------------------------------------------------------------------------------------
# packings (cached)


class _Forest:
    """Trees of every root: ``trees[r]`` = tuple of (integer weight out of GRID, parent tuple, edge paths,
    depth); ``inward``: edges point child -> parent (reduce) and ``paths[v]`` runs from v to its parent."""

    def __init__(self, packing, inward, roots, graph):
        self.inward = inward
        self.seconds_per_byte = packing.seconds_per_byte
        self.lower_bound = packing.lower_bound
        self.orbits = packing.orbits
        self.iterations = packing.iterations
        self.columns = packing.columns
        self.plan_seconds = packing.seconds
        ints, self.grid, self.rounding_loss = _round_weights(packing, roots, graph)
        self.trees = {}
        for r, trees in zip(roots, packing.trees):
            kept = []
            for w, t in zip(ints[r], trees):
                if w > 0:
                    paths = t.paths if not inward else tuple(None if x is None else tuple(reversed(x))
                                                             for x in t.paths)
                    kept.append((w, t.parent, paths, t.depth, _bfs(t)))
            self.trees[r] = tuple(kept)

    @property
    def ntrees(self):
        return sum(len(t) for t in self.trees.values())

    @property
    def depth(self):
        return max((d for trees in self.trees.values() for _, _, _, d, _ in trees), default=0)


def _bfs(tree):
    return tuple(tree.bfs())


def _integer_weights(weights, grid=GRID):
    """Multiples of GRID / grid summing to GRID, proportional to ``weights`` (largest remainder, ties
    by position)."""
    total = sum(weights)
    raw = [w / total * grid for w in weights]
    ints = [int(math.floor(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - ints[i]), i))
    for i in order[:grid - sum(ints)]:
        ints[i] += 1
    return [k * (GRID // grid) for k in ints]


def _round_weights(packing, roots, graph):
    """Integer tree weights on a coarse grid (16, 64, 256, 1024 or GRID steps per block): the merged pieces
    (the chunk pattern) stay few. The coarsest grid that costs at most ROUNDING_SLACK of bandwidth,
    unless its pieces would exceed the transfer budget (MAX_PIECE_TRANSFERS), in which case the grid within
    the budget that loses least. Returns ``({root: [ints]}, grid, relative bandwidth loss)``."""
    index = {e: i for i, e in enumerate(packing.links)}
    cap = np.array([graph[u][v]["capacity"] for u, v in packing.links], dtype=float)
    uses = []
    for trees in packing.trees:
        per = []
        for t in trees:
            use = np.zeros(len(cap))
            for path in t.paths:
                if path is not None:
                    for e in zip(path[:-1], path[1:]):
                        use[index[e]] += 1
            per.append(use)
        uses.append(per)
    p = len(packing.trees[0][0].parent) if packing.trees and packing.trees[0] else 1
    max_pieces = max(1, MAX_PIECE_TRANSFERS // (len(roots) * max(1, p - 1)))
    target = packing.seconds_per_byte
    options = []
    grid = 16
    while grid <= GRID:
        ints = {r: _integer_weights([t.weight for t in trees], grid) for r, trees in zip(roots, packing.trees)}
        load = np.zeros(len(cap))
        cuts = set()
        for r, per in zip(roots, uses):
            acc = 0
            for w, use in zip(ints[r], per):
                load += w / GRID * use
                acc += w
                cuts.add(acc)
        loss = max(float((load / cap).max() / target - 1), 0.0) if target > 0 and len(cap) else 0.0
        options.append((grid, loss, len(cuts), ints))
        if loss <= ROUNDING_SLACK or len(cuts) > max_pieces:
            break
        grid *= 4 if grid < 1024 else GRID // grid
    fits = [o for o in options if o[2] <= max_pieces] or options[:1]
    good = [o for o in fits if o[1] <= ROUNDING_SLACK]
    grid, loss, _, ints = good[0] if good else min(fits, key=lambda o: (o[1], o[0]))
    return ints, grid, loss


def _symmetric(graph):
    succ = graph.succ
    return all(u in succ[v] and succ[v][u].get("capacity") == d.get("capacity") for u, v, d in graph.edges(data=True))


@functools.lru_cache(maxsize=64)
def _forest(topo, direction, root=None, direct=False):
    """``direction``: "out" (allgather trees from every root), "in" (reduce-scatter trees into every
    root), "bcast" (out-trees from ``root``); ``direct``: on :func:`direct_links` only."""
    graph = direct_links(topo)[0] if direct else topo.usable_graph()
    p = topo.nranks
    if direction == "in":
        if _symmetric(graph):
            out = _forest(topo, "out", None, direct)
            forest = object.__new__(_Forest)
            forest.__dict__.update(out.__dict__)
            forest.inward = True
            forest.trees = {r: tuple((w, par, tuple(None if x is None else tuple(reversed(x)) for x in paths), d, b)
                                     for w, par, paths, d, b in trees) for r, trees in out.trees.items()}
            return forest
        graph = nx.DiGraph(graph).reverse(copy=True)
    roots = tuple(range(p)) if root is None else (root,)
    known = None
    if direction != "bcast" and not direct:
        from ..bounds import cut_bound

        known = cut_bound(topo, reverse=(direction == "in")).seconds_per_byte * p
    packing = pack_arborescences(graph, topo.ranks, roots, known_bound=known)
    return _Forest(packing, direction == "in", roots, graph)


# ----------------------------------------------------------------------------------------------------
# schedule


@functools.lru_cache(maxsize=16)
def direct_links(topo):
    """``(graph, why_not)``: the links that join two ranks directly (NVLink between GPUs) as a frozen
    DiGraph, or None and the reason when the ranks do not all reach each other over them or every
    traffic-carrying link is one of them."""
    graph = topo.usable_graph()
    ranks = set(topo.ranks)
    direct = nx.DiGraph()
    direct.add_nodes_from(ranks)
    direct.add_edges_from((u, v, d) for u, v, d in graph.edges(data=True) if u in ranks and v in ranks)
    if direct.number_of_edges() == graph.number_of_edges():
        return None, f"every link joins two ranks, so it would repeat {NAME}"
    if not nx.is_strongly_connected(direct):
        return None, "the ranks are not all joined by links from rank to rank (NVLink between GPUs)"
    return nx.freeze(direct), None


def direct_link_trees(topo, collective, *, root=0, nbytes=None, beat=None):
    """:func:`tree_packing` over the links that join two ranks directly (:func:`direct_links`) and
    nothing else: Blink's NVLink-only trees. Where slower shared paths (PCIe switches, CPUs) add a
    little bandwidth, the full packing needs many more trees to use it, and trees that share links
    lose to fair sharing what the LP gained (DGX-1 at 256 MiB: 232 trees predicted at 1.091 times the
    bound, against 52 trees at 1.079); the planner's simulation decides. Raises PlanError where there
    is no such sub-fabric."""
    return tree_packing(topo, collective, root=root, nbytes=nbytes, direct=True, beat=beat)


def tree_packing(topo, collective, *, root=0, nbytes=None, direct=False, beat=None):
    """Schedule ``collective`` on ``topo`` over an optimal packing of spanning trees (module docstring);
    ``direct``: over :func:`direct_links` only (see :func:`direct_link_trees`); ``beat``: the time the
    planner's fastest candidate takes, or a function returning it as it falls (see :func:`_deeper_if_faster`).

    Raises :class:`ddl.PlanError` for an unknown collective, a bad root, more than :data:`MAX_RANKS`
    ranks, or a packing too fine-grained to run (:data:`MAX_PLAN_TRANSFERS`)."""
    name = DIRECT if direct else NAME
    if collective not in COLLECTIVES:
        raise PlanError(f"{name} does not support the collective {collective!r}; it plans {', '.join(COLLECTIVES)}")
    p = topo.nranks
    # A root is a rank number (numpy's integers too), never a bool, a float or text: 1.5 or True
    # passed the range check and became the schedule's root, None or "0" raised a bare TypeError.
    rank = whole_number(root)
    if rank is None:
        raise PlanError(f"{name}: root must be a rank number, got {root!r}")
    root = rank
    if not 0 <= root < p:
        raise PlanError(f"root {root} is not a rank (there are {p})")
    if direct and p > 1 and (why_not := direct_links(topo)[1]):
        raise PlanError(f"{name}: {why_not}")
    if p > MAX_RANKS:
        raise PlanError(f"{name} solves an LP over {p} roots x {len(topo.usable_graph().edges)} links; it is "
                        f"limited to {MAX_RANKS} ranks (use 'hierarchical' for large symmetric clusters)")
    b = ScheduleBuilder(collective, p, (1,), root=root, algorithm=name)
    if p == 1:
        return b.build(trees=0)
    sized = bool(nbytes)
    nbytes = DEFAULT_NBYTES if not sized else int(nbytes)

    if collective == "allgather":
        forests = [_forest(topo, "out", None, direct)]
        blocks = list(range(p))
    elif collective == "reduce_scatter":
        forests = [_forest(topo, "in", None, direct)]
        blocks = list(range(p))
    elif collective == "allreduce":
        forests = [_forest(topo, "in", None, direct), _forest(topo, "out", None, direct)]
        blocks = list(range(p))
    else:
        forests = [_forest(topo, "bcast", root, direct)]
        blocks = [root]
    block_bytes = nbytes / len(blocks)

    # pieces: merged breakpoints of every (forest, block)'s cumulative tree weights
    cuts = {0, GRID}
    for forest in forests:
        for r in blocks:
            acc = 0
            for w, *_ in forest.trees[r]:
                acc += w
                cuts.add(acc)
    cuts = sorted(cuts)
    pieces = [(a, c - a) for a, c in zip(cuts, cuts[1:])]
    transfers = len(pieces) * len(blocks) * (p - 1) * len(forests)
    if transfers > MAX_PLAN_TRANSFERS:
        # Too fine-grained: simulating it takes minutes and an executor spends its time on message
        # overheads. The optimum is kept in the error so that users see what was given up.
        raise PlanError(f"{name}: the packing's trees cut every block into {len(pieces)} pieces, {transfers} "
                        f"transfers before pipelining (limit {MAX_PLAN_TRANSFERS}); 'hierarchical' and "
                        f"'multicommodity-flow' plan this fabric")
    # tree of each (forest, block, piece), and the smallest tree weight over each piece
    tree_of = []
    smallest = [GRID] * len(pieces)
    for forest in forests:
        per_block = {}
        for r in blocks:
            ends = []
            acc = 0
            for w, *_ in forest.trees[r]:
                acc += w
                ends.append(acc)
            idx = [bisect.bisect_right(ends, start) for start, _ in pieces]
            per_block[r] = idx
            for i, k in enumerate(idx):
                smallest[i] = min(smallest[i], forest.trees[r][k][0])
        tree_of.append(per_block)
    depth = max(f.depth for f in forests)
    per = p if collective != "broadcast" else 1
    seconds = sum(f.seconds_per_byte for f in forests) / per * nbytes   # the LP's time for the buffer
    pipelined = depth > 1 or collective in ("allreduce", "reduce_scatter")
    max_chunks = MAX_TRANSFERS // ((p - 1) * len(forests))
    info = dict(
        trees=[f.ntrees for f in forests],
        trees_per_root=[round(f.ntrees / len(blocks), 2) for f in forests],
        depth=depth,
        pieces=len(pieces),
        # LP optimum (seconds per byte of the whole buffer) and its certified lower bound
        seconds_per_byte=sum(f.seconds_per_byte for f in forests) / per,
        lp_lower_bound=sum(f.lower_bound for f in forests) / per,
        rounding_loss=round(max(f.rounding_loss for f in forests), 6),
        symmetry_classes=forests[-1].orbits,
        lp_iterations=[f.iterations for f in forests],
    )

    def build(target):
        split = _pipeline(pieces, smallest, target, block_bytes, len(blocks), max_chunks)
        return _emit(name, collective, p, root, forests, blocks, pieces, tree_of, split, pipeline=target, **info)

    if not pipelined:
        return build(1)
    target = pipeline_target(seconds)
    sched = build(target)
    deeper = min(MAX_PIPELINE, int(seconds / MIN_STEP_SECONDS))
    if sized and deeper > target:
        sched = _deeper_if_faster(topo, sched, build(deeper), nbytes, beat)
    return sched


def _deeper_if_faster(topo, sched, deeper, nbytes, beat=None):
    """``deeper`` (the same trees, more sub-chunks, steps of at least MIN_STEP_SECONDS) where it is
    predicted faster by the margin that more messages must earn (:mod:`ddl.algorithms.variants`),
    else ``sched``; both small enough to simulate in a moment. A packing fills and drains for about
    one pipeline step at each end; on the heterogeneous cluster, whose T4 hosts' NICs wait for the
    first step's sums, 32 sub-chunks per tree are predicted 1.7% faster than 15 (88.4 ms against
    89.9 ms at 256 MiB).

    ``deeper`` is simulated only until it provably cannot earn that margin, and with ``beat`` (the
    time the planner's fastest candidate so far takes) both only until they provably cannot win the
    plan: then the one with the lower bound is returned, its simulation stopped (the planner's own
    stops at once, see :func:`ddl.simulate.simulate`), and the choice is the one full simulations give."""
    if deeper.nops <= sched.nops or deeper.nops > CHOOSE_VARIANTS_OPS:
        return sched
    cost = topo.message_cost
    seconds, at_least = try_variant(topo, sched, nbytes, beat)
    if seconds is not None:
        other, other_least = try_variant(topo, deeper, nbytes, to_beat(deeper.nops, seconds, sched.nops, cost))
    else:                      # sched cannot win the plan, nor deeper unless it is faster than that
        other, other_least = try_variant(topo, deeper, nbytes, beat)
        if other is not None and not replaces(other, deeper.nops, at_least, sched.nops, cost):
            seconds, at_least = try_variant(topo, sched, nbytes)    # it may or may not beat sched: run sched out
    if seconds is not None:
        kept = deeper if replaces(other, deeper.nops, seconds, sched.nops, cost) else sched
    elif other is not None:
        kept = deeper          # faster than sched can be, by the margin
    else:                      # neither can win the plan: the lower bound holds for whichever would be kept
        kept = sched if at_least <= other_least else deeper
    kept.info["pipelines_tried"] = [tried(seconds, at_least, pipeline=sched.info["pipeline"], operations=sched.nops),
                                    tried(other, other_least, pipeline=deeper.info["pipeline"], operations=deeper.nops)]
    return kept


def _emit(name, collective, p, root, forests, blocks, piece_ranges, tree_of, split, **info):
    """The schedule of ``forests`` over ``blocks``, every piece cut into ``split`` sub-chunks, listed
    by pipeline step (sub-chunk index), then piece, then block, in breadth-first order."""
    # pattern: every piece cut into its sub-chunks
    pattern, sub_of = [], []
    for i, ((_, width), m) in enumerate(zip(piece_ranges, split)):
        for j, part in enumerate(_split(width, m)):
            pattern.append(part)
            sub_of.append((i, j))
    per_block = len(pattern)
    if collective == "allreduce" or collective == "broadcast":
        pattern = pattern * len(blocks)           # one buffer: the logical blocks side by side
    b = ScheduleBuilder(collective, p, pattern, root=root, algorithm=name)
    route_bytes = {}

    def chunk_id(bi, c):
        return bi * per_block + c

    # emit by pipeline step j (sub-chunk index within its piece), so early sub-chunks go first
    order = sorted(range(per_block), key=lambda c: (sub_of[c][1], sub_of[c][0]))
    for c in order:
        i = sub_of[c][0]
        for fi, forest in enumerate(forests):
            for bi, r in enumerate(blocks):
                w, parent, paths, _d, bfs = forest.trees[r][tree_of[fi][r][i]]
                chunk = chunk_id(bi, c)
                weight = pattern[c]
                if forest.inward:
                    for v in reversed(bfs):
                        b.transfer(v, parent[v], chunk, reduce=True)
                        _add_route(route_bytes, v, parent[v], paths[v], weight)
                else:
                    for v in bfs:
                        b.transfer(parent[v], v, chunk)
                        _add_route(route_bytes, parent[v], v, paths[v], weight)
    for (u, v), paths in sorted(route_bytes.items()):
        total = sum(paths.values())
        b.routes[(u, v)] = tuple((path, share / total) for path, share in sorted(paths.items()))
    return b.build(chunks=len(pattern) * (len(blocks) if collective in ("allgather", "reduce_scatter") else 1),
                   **info)


def pipeline_target(seconds):
    """Sub-chunks per tree for a collective the LP says takes ``seconds``: MIN_PIPELINE, more (up to
    MAX_PIPELINE) while each pipeline step still lasts PIPELINE_STEP_SECONDS."""
    return min(MAX_PIPELINE, max(MIN_PIPELINE, int(seconds / PIPELINE_STEP_SECONDS)))


def _pipeline(pieces, smallest, target, block_bytes, nblocks, max_chunks):
    """Sub-chunks per piece: every tree gets >= ``target`` of them (a piece is cut in proportion to
    its width over the smallest tree covering it), none below MIN_CHUNK_BYTES, ``max_chunks`` in all."""
    if target <= 1:
        return [1] * len(pieces)
    split = []
    for (_, width), small in zip(pieces, smallest):
        m = math.ceil(target * width / small - 1e-9)
        m = min(m, max(1, int(block_bytes * width / GRID // MIN_CHUNK_BYTES)), width)
        split.append(max(1, m))
    while sum(split) * nblocks > max_chunks and max(split) > 1:
        split = [max(1, m // 2) for m in split]
    return split


def _split(width, m):
    """``width`` cut into ``m`` positive integers, as equal as they can be: messages of one rank pair
    leave one after the other, so equal sub-chunks keep every hop of a tree busy in turn."""
    base, extra = divmod(width, m)
    return [base + (1 if j < extra else 0) for j in range(m)]


def _add_route(route_bytes, u, v, path, weight):
    pair = route_bytes.setdefault((u, v), {})
    pair[path] = pair.get(path, 0) + weight
