"""NCCL's double binary tree: two complementary binary trees, each carrying half the data.

Sources: P. Sanders, J. Speck and J. L. Träff, "Two-tree algorithms for full bandwidth broadcast,
reduction and scan", Parallel Computing 35(12), 2009; S. Jeaugey, "Massively scale your deep learning
training with NCCL 2.4" (NVIDIA blog, 2019) and NCCL ``src/graph/trees.cc`` (``ncclGetBtree``,
``ncclGetDtree``), whose construction is reproduced here.

Tree 1 is NCCL's bit-pattern binary tree on positions ``0..n-1``: node ``x`` with lowest set bit ``b``
has parent ``(x ^ b) | (b << 1)`` (or ``x ^ b`` when that is out of range); its leaves are the odd
positions. Tree 2 mirrors tree 1 (``x -> n-1-x``) when ``n`` is even and shifts it by one when ``n``
is odd, so (almost) every interior node of one tree is a leaf of the other and every rank sends and
receives about one half of the data per direction.

Allreduce: each half is reduced up its tree to its root (children in a fixed order, so the result is
computed once) and broadcast back down. Broadcast: the trees are built on the ``p - 1`` non-root ranks
and the root feeds each tree's root its half. Positions are the ranks in the topology-aware ring order,
so the short, frequent edges near the leaves stay inside fast tiers. Reduce-scatter and allgather are
not tree collectives: PlanError.

Chunks: each half is cut into ``k = pipeline_depth(nbytes, 2)`` chunks (see ring.pipeline_depth);
chunks ``0..k-1`` ride tree 1, ``k..2k-1`` tree 2, and pipeline through the tree independently.
"""
from ..schedule import ScheduleBuilder
from .ring import check_request, nested_order, pipeline_depth, rank_partitions

NAME = "double-binary-tree"
SUPPORTED = ("allreduce", "broadcast")


def btree_parents(n):
    """NCCL's binary tree on ``n`` positions: ``parents[x]`` (-1 for the root, position 0)."""
    parents = [-1] * n
    for x in range(1, n):
        bit = x & -x
        up = (x ^ bit) | (bit << 1)
        parents[x] = up if up < n else x ^ bit
    return parents


def dtree_parents(n):
    """NCCL's two complementary trees on ``n`` positions: (tree 1 parents, tree 2 parents)."""
    t1 = btree_parents(n)
    if n % 2:   # shift by one
        t2 = [-1 if t1[(x - 1) % n] < 0 else (t1[(x - 1) % n] + 1) % n for x in range(n)]
    else:       # mirror
        t2 = [-1 if t1[n - 1 - x] < 0 else n - 1 - t1[n - 1 - x] for x in range(n)]
    return t1, t2


def _depths(parents):
    depth = [None] * len(parents)

    def d(x):
        if depth[x] is None:
            depth[x] = 0 if parents[x] < 0 else d(parents[x]) + 1
        return depth[x]

    return [d(x) for x in range(len(parents))]


def _reduce_up(b, ranks, parents, chunks):
    """Every non-root node reduces its subtree's value into its parent, deepest nodes first."""
    depth = _depths(parents)
    for c in chunks:
        for x in sorted(range(len(parents)), key=lambda x: (-depth[x], x)):
            if parents[x] >= 0:
                b.transfer(ranks[x], ranks[parents[x]], c, reduce=True)


def _broadcast_down(b, ranks, parents, chunks):
    depth = _depths(parents)
    for c in chunks:
        for x in sorted(range(len(parents)), key=lambda x: (depth[x], x)):
            if parents[x] >= 0:
                b.transfer(ranks[parents[x]], ranks[x], c)


def dbt_schedule(order, collective, k=1, root=0, algorithm=NAME, **info):
    """Double binary tree ``collective`` on positions ``order`` (a permutation of ``range(p)``)."""
    order = [int(r) for r in order]
    p = len(order)
    check_request(algorithm, collective, p, root, SUPPORTED)
    root = int(root)           # a numpy integer would reach info["tree_parents"], which JSON cannot write
    halves = (list(range(k)), list(range(k, 2 * k)))
    if collective == "allreduce":
        b = ScheduleBuilder(collective, p, (1,) * (2 * k), algorithm=algorithm)
        trees = dtree_parents(p)
        for parents, chunks in zip(trees, halves):
            _reduce_up(b, order, parents, chunks)
        for parents, chunks in zip(trees, halves):
            _broadcast_down(b, order, parents, chunks)
        rank_parents = [_to_ranks(order, t) for t in trees]
    else:
        b = ScheduleBuilder(collective, p, (1,) * (2 * k), root=root, algorithm=algorithm)
        start = order.index(root)
        rest = order[start + 1:] + order[:start]
        trees = dtree_parents(len(rest))
        rank_parents = []
        for parents, chunks in zip(trees, halves):
            if rest:
                top = rest[parents.index(-1)]
                for c in chunks:
                    b.transfer(root, top, c)
                _broadcast_down(b, rest, parents, chunks)
            rank_parents.append(_to_ranks(rest, parents, p, root))
    return b.build(order=order, tree_parents=rank_parents, chunks_per_half=k, **info)


def _to_ranks(ranks, parents, p=None, root=None):
    """Parents by rank (-1: the tree's root); a broadcast's sub-trees hang under ``root``."""
    out = [-1] * (p if p is not None else len(ranks))
    for x, parent in enumerate(parents):
        out[ranks[x]] = ranks[parent] if parent >= 0 else (-1 if root is None else root)
    return out


def double_binary_tree(topo, collective, *, root=0, nbytes=None):
    """NCCL's double binary tree on the topology-aware ring order (see the module docstring)."""
    check_request(NAME, collective, topo.nranks, root, SUPPORTED)
    order, _ = nested_order(topo.nranks, rank_partitions(topo), topo.route_bandwidth)
    return dbt_schedule(order, collective, pipeline_depth(nbytes, 2), root)
