"""Ring collectives with a topology-aware rank order, plus the helpers every family shares.

Allreduce is a ring reduce-scatter followed by a ring allgather (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; the form in Baidu's ring-allreduce and
NCCL). Each rank sends ``2 (p-1)/p`` of the buffer, the bandwidth optimum, in ``2 (p-1)`` steps.
Broadcast is a pipelined chain from the root along the ring (NCCL's ring broadcast).

The ring order follows NCCL's topology search (Jeaugey, "NCCL 2.0", GTC 2017; ``graph/search.cc``):
cross the slowest tier as few times as possible, so every group of every tier of
:attr:`Topology.tiers` is contiguous (nested, slowest tier outermost); inside the smallest groups
(<= 16 ranks) a depth-first search with pruning finds the Hamiltonian cycle (or path, when the group is
only a segment of the ring) whose narrowest hop is widest -- e.g. the 50 GB/s double-NVLink ring of a
DGX-1 -- falling back to index order.

Pipelining: every ring block is cut into ``k`` chunks, ``k = pipeline_depth(nbytes, blocks)``: as many
as keep each chunk >= 1 MiB, at most 8 and at most 512 chunks in all; 1 when ``nbytes`` is unknown or
small.
"""
from ..errors import PlanError
from ..schedule import COLLECTIVES, ScheduleBuilder
from ..units import whole_number

NAME = "ring"
MIN_CHUNK_BYTES = 1 << 20
MAX_PIPELINE = 8
MAX_CHUNKS = 512         # cap on chunks in flight: pieces * k
MAX_SCHEDULE_OPS = 600_000  # operations an algorithm's options may cost: plan time grows with them
SEARCH_LIMIT = 16          # largest group whose order is searched for the widest Hamiltonian cycle
SEARCH_BUDGET = 5000       # DFS nodes per bandwidth threshold before giving up on it


# ---- shared helpers ---------------------------------------------------------------------------------
def pipeline_depth(nbytes, pieces=1, min_bytes=MIN_CHUNK_BYTES, max_k=MAX_PIPELINE, max_chunks=MAX_CHUNKS):
    """Chunks per piece: each chunk of ``nbytes / (pieces * k)`` stays >= ``min_bytes``; 1..``max_k``,
    and ``pieces * k <= max_chunks`` (with hundreds of pieces the pieces themselves pipeline, and the
    op count -- what verification and simulation cost -- grows with ``pieces * k``)."""
    if not nbytes or pieces < 1:
        return 1
    return max(1, min(max_k, max_chunks // pieces, int(nbytes) // (pieces * min_bytes)))


def check_request(name, collective, nranks, root, supported=COLLECTIVES):
    """Raise :class:`PlanError` unless ``name`` can plan ``collective`` rooted at ``root``. A root must
    be a rank number, as the planner requires (an integer, numpy's included; not a bool, a float or
    text): a float or None would otherwise fail deep in a builder with a ValueError or TypeError, and
    ``1.0`` or ``True`` become a schedule's root. Builders take ``int(root)`` after this check."""
    if collective not in supported:
        raise PlanError(f"{name} does not support {collective!r} (it plans {', '.join(supported)})")
    if nranks < 1:
        raise PlanError(f"{name} does not support an empty communicator")
    if whole_number(root) is None:
        raise PlanError(f"{name}: root must be a rank number, got {root!r}")
    if not 0 <= root < nranks:
        raise PlanError(f"{name}: root {root} is not a rank of {nranks}")


def chunk_blocks(owners, k):
    """Chunk lists of blocks ``owners`` (block b = chunks b*k .. b*k+k-1)."""
    return [list(range(o * k, (o + 1) * k)) for o in owners]


def ring_reduce_scatter(builder, ranks, blocks):
    """Ring reduce-scatter among ``ranks`` (ring order): ``blocks[j]`` ends fully reduced on ``ranks[j]``.

    Position ``i`` sends block ``i - t - 1`` at step ``t``; its successor reduces it into its own copy
    and forwards it at step ``t + 1``, so block ``j`` starts at ``j + 1`` and ends, after ``g - 1``
    steps, on ``j``: each block is reduced along one chain, in one order.
    """
    rings_reduce_scatter(builder, [ranks], [blocks])


def ring_allgather(builder, ranks, blocks):
    """Ring allgather among ``ranks``: ``ranks[j]`` starts with ``blocks[j]``; everyone ends with all.

    With a single non-empty block this is the pipelined chain broadcast from its owner.
    """
    rings_allgather(builder, [ranks], [blocks])


def rings_reduce_scatter(builder, rings, blocks):
    """:func:`ring_reduce_scatter` on several rings of the same length at once (``blocks[c]`` for
    ``rings[c]``), their steps interleaved in the programs so that they advance side by side."""
    _ring_steps(builder, rings, blocks, 1, True)


def rings_allgather(builder, rings, blocks):
    """:func:`ring_allgather` on several rings at once (see :func:`rings_reduce_scatter`)."""
    _ring_steps(builder, rings, blocks, 0, False)


def _ring_steps(builder, rings, blocks, lag, reduce):
    g = len(rings[0])
    for t in range(g - 1):
        for ranks, owned in zip(rings, blocks):
            for i in range(g):
                src, dst = ranks[i], ranks[(i + 1) % g]
                for c in owned[(i - t - lag) % g]:
                    builder.transfer(src, dst, c, reduce=reduce)


# ---- the topology-aware order -----------------------------------------------------------------------
def nested_order(nranks, partitions, bandwidth=None, limit=SEARCH_LIMIT):
    """Ranks ordered so every group of every partition is contiguous.

    ``partitions``: fastest tier first, each a sequence of groups (rank sequences); ranks a partition
    omits count as singletons. Groups are nested slowest-outermost and sorted by their smallest rank.
    A group whose sub-groups are all single ranks (or the fastest tier's groups) is ordered by
    :func:`widest_ring` when ``bandwidth(i, j)`` is given and it has at most ``limit`` ranks.
    Returns ``(order, bottlenecks)``: bottlenecks lists the narrowest hop found in each searched group.
    """
    found = []
    levels = []
    for part in partitions:
        owner = {}
        for gi, group in enumerate(part):
            for r in group:
                owner.setdefault(int(r), gi)
        levels.append(owner)

    def split(members, level):
        owner = levels[level]
        groups = {}
        for r in members:
            groups.setdefault(owner.get(r, ("single", r)), []).append(r)
        return sorted(groups.values(), key=min)

    def order(members, level):
        members = sorted(members)
        if level < 0 or len(members) <= 2:
            return leaf(members)
        subs = split(members, level)
        if len(subs) == 1:
            return order(members, level - 1)
        if all(len(s) == 1 for s in subs):
            return leaf(members)
        return [r for s in subs for r in order(s, level - 1)]

    def leaf(members):
        if bandwidth is None or not 2 < len(members) <= limit:
            return members
        seq, bottleneck = widest_ring(members, bandwidth, cycle=len(members) == nranks)
        found.append(bottleneck)
        return seq

    return order(range(nranks), len(levels) - 1), found


def widest_ring(members, bandwidth, cycle=True, budget=SEARCH_BUDGET):
    """Hamiltonian cycle (or path) through ``members`` whose narrowest hop ``bandwidth(a, b)`` is widest.

    Binary search over the distinct bandwidths for the widest threshold at which a DFS (Warnsdorff
    order, dead-end pruning, ``budget`` nodes per threshold) finds a cycle (path) on the hops at least
    that wide.
    Returns ``(sequence, bottleneck)``; index order when nothing better is found.
    """
    n = len(members)
    w = [[bandwidth(a, b) if a != b else 0.0 for b in members] for a in members]
    index_bottleneck = min(w[i][(i + 1) % n] for i in range(n if cycle else n - 1))
    levels = sorted({x for row in w for x in row if x > index_bottleneck})
    best, bottleneck = list(range(n)), index_bottleneck
    lo, hi = 0, len(levels) - 1            # binary search: the widest level that still has a cycle
    while lo <= hi:
        mid = (lo + hi) // 2
        adj = [sum(1 << j for j in range(n) if j != i and w[i][j] >= levels[mid]) for i in range(n)]
        seq = _hamilton(n, adj, cycle, budget)
        if seq is None:
            hi = mid - 1
        else:
            best, bottleneck, lo = seq, levels[mid], mid + 1
    return [members[i] for i in best], bottleneck


class _Budget(Exception):
    pass


def _hamilton(n, adj, cycle, budget):
    """A Hamiltonian cycle (from vertex 0) or path on bitmask adjacency ``adj``, or None."""
    full = (1 << n) - 1
    radj = [sum(1 << i for i in range(n) if adj[i] >> j & 1) for j in range(n)]
    steps = [0]

    def viable(v, visited, start):
        rest = full & ~visited
        ends = rest | (1 << start if cycle else 0)
        for u in range(n):
            if rest >> u & 1:
                if not radj[u] & ((rest & ~(1 << u)) | 1 << v):
                    return False
                if cycle and not adj[u] & (ends & ~(1 << u)):
                    return False
        return True

    def dfs(path, visited, start):
        v = path[-1]
        if visited == full:
            return not cycle or adj[v] >> start & 1
        steps[0] += 1
        if steps[0] > budget:
            raise _Budget
        rest = full & ~visited
        nxt = [u for u in range(n) if (adj[v] & rest) >> u & 1]
        nxt.sort(key=lambda u: (bin(adj[u] & rest).count("1"), u))
        for u in nxt:
            if viable(u, visited | 1 << u, start):
                path.append(u)
                if dfs(path, visited | 1 << u, start):
                    return True
                path.pop()
        return False

    try:
        for start in ([0] if cycle else range(n)):
            path = [start]
            if dfs(path, 1 << start, start):
                return path
    except _Budget:
        return None
    return None


def rank_partitions(topo):
    """Partitions of ``topo``'s ranks, fastest first: :attr:`Topology.tiers`, preceded by the fastest
    tier's groups split by attachment when that splits any (ranks that share no switch, NIC, host, CPU
    or PCIe vertex and no direct link, e.g. the leaves of a fat tree whose links are all alike)."""
    parts = [tuple(tuple(g) for g in t.groups) for t in topo.tiers]
    refined = _split_by_attachment(topo, parts[0])
    return [refined] + parts if refined != parts[0] else parts


def _split_by_attachment(topo, groups):
    graph = topo.usable_graph()
    vertex_of = topo.ranks
    out = []
    for group in groups:
        parent = {r: r for r in group}

        def find(r):
            while parent[r] != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        members = {vertex_of[r] for r in group}
        first = {}   # vertex -> first rank of the group that is on it or next to it
        for r in group:
            v = vertex_of[r]
            near = {v} | {u for u in set(graph.successors(v)) | set(graph.predecessors(v))
                          if topo.is_transit(u) or u in members}   # direct links between members join too
            for u in sorted(near):
                if u in first:
                    parent[find(r)] = find(first[u])
                else:
                    first[u] = r
        parts = {}
        for r in group:
            parts.setdefault(find(r), []).append(r)
        out.extend(tuple(sorted(p)) for p in parts.values())
    return tuple(sorted(out, key=min))


def ring_order(topo):
    """The topology-aware ring order of ``topo``'s ranks (see the module docstring)."""
    order, _ = nested_order(topo.nranks, rank_partitions(topo), topo.route_bandwidth)
    return order


# ---- the ring schedules -----------------------------------------------------------------------------
def ring_schedule(order, collective, k=1, root=0, algorithm=NAME, **info):
    """Ring ``collective`` over ``order`` (a permutation of ``range(p)``), ``k`` chunks per ring block."""
    order = [int(r) for r in order]
    p = len(order)
    check_request(algorithm, collective, p, root)
    root = int(root)
    if collective == "allreduce":
        b = ScheduleBuilder(collective, p, (1,) * (p * k), algorithm=algorithm)
        blocks = chunk_blocks(range(p), k)       # ring position j ends owning buffer block j
        ring_reduce_scatter(b, order, blocks)
        ring_allgather(b, order, blocks)
    elif collective in ("reduce_scatter", "allgather"):
        b = ScheduleBuilder(collective, p, (1,) * k, algorithm=algorithm)
        blocks = chunk_blocks(order, k)           # position j owns rank order[j]'s block
        (ring_reduce_scatter if collective == "reduce_scatter" else ring_allgather)(b, order, blocks)
    else:
        b = ScheduleBuilder(collective, p, (1,) * k, root=root, algorithm=algorithm)
        start = order.index(root)
        chain = order[start:] + order[:start]
        ring_allgather(b, chain, [list(range(k))] + [[]] * (p - 1))
    return b.build(order=order, chunks_per_block=k, **info)


def ring(topo, collective, *, root=0, nbytes=None):
    """Topology-aware ring (see the module docstring)."""
    check_request(NAME, collective, topo.nranks, root)
    order, bottlenecks = nested_order(topo.nranks, rank_partitions(topo), topo.route_bandwidth)
    pieces = 1 if collective == "broadcast" else topo.nranks
    k = pipeline_depth(nbytes, pieces)
    hops = [float(topo.route_bandwidth(order[i], order[(i + 1) % len(order)])) for i in range(len(order))]
    return ring_schedule(order, collective, k, root, bottleneck_bandwidth=min(hops) if len(order) > 1 else 0.0,
                         searched_group_bottlenecks=[float(x) for x in bottlenecks])
