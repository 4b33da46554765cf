"""Delegated allreduce: hosts behind slow links reduce at home and leave the rest to the fast core.

Why
===
On a cluster whose hosts have very different ways out (T4 hosts behind one 25 Gbit/s NIC beside DGX
boxes with four 100 Gbit/s NICs) the allreduce bound is set by the slow hosts alone: each must send
out its sum of the buffer (``N`` bytes) and take in the result (``N`` bytes), so both directions of its
link are busy from start to end (:func:`ddl.bounds.allreduce_bound`); the fast core could do its own
part many times over in that time. Schedules that treat every rank alike cross the slow link in many
messages at once (every tree with a rank on the slow host, every ring position there): the link's
bandwidth is shared among them, each result comes back only after a large part of the upload, and the
way in idles meanwhile. On the zoo's heterogeneous cluster tree packing stays at 1.029 of the bound
for that reason, and the hierarchical schedules, whose waves cross the slow link in one piece per
target, at 1.09 and more.

How
===
1. **Slow hosts** (:func:`slow_hosts`): hosts whose links to the fabric carry at most
   ``1/SLOW_RATIO`` of what the fastest host's do (:attr:`Topology.host_bandwidths`). The ranks on the
   other hosts (and on none) form the *core*.
2. **The core** plans its own allreduce, with each of :data:`CORE_BASES` (with the first alone where
   the size is latency-bound, since delegating only adds hops there), on the same fabric with the
   core's ranks only (and keeps the paths that plan pins). In its schedule every chunk's result first
   appears at a *target*: the core rank whose last write of the chunk is a reduction
   (:func:`core_facts`).
3. **A slow host**, chunk by chunk in the order the core completes them (where each chunk's last
   reduction stands in its target's program, as a fraction of it): its ranks send the chunk to
   one of them, its *owner*, which reduces them and sends the host's sum out; the target reduces that
   into its result right after its own last reduction of the chunk (before it passes the result on in
   the core), sends the result back to the owner, and the owner copies it to the host's other ranks.
   Chunks are dealt to owners by bytes, so the host's internal links carry as much each.
4. **Relay.** An owner sends all it uploads to one core rank, its *delegate*, which forwards each piece
   to its target. The messages of one rank pair leave one after another in program order (MPI's
   non-overtaking rule), so the host's uploads leave in the core's order, a few at a time instead of
   all at once, and a result can come back as soon as its own upload is through. A delegate can
   forward a chunk only while its own copy is free: after it has sent its part, before it receives the
   result. Where that is not so, the owner sends to the target directly.
5. **Pieces.** The slow side moves each chunk in pieces of at least :data:`PIECE_BYTES` (up to
   :data:`MAX_PIECES`), so that little is ever in flight on the slow link, while the core still moves
   whole chunks (one message for the pieces). The first and last :data:`RAMP_CHUNKS` chunks are cut
   into :data:`MAX_PIECES` in the core too (pieces of at least :data:`RAMP_PIECE_BYTES`): the first
   results come back sooner and the last ones reach the core's ranks sooner.

The base whose composed schedule simulates fastest is kept. On the heterogeneous cluster of the zoo
at 256 MiB this is 1.007 of the bound (tree packing: 1.029), with its T4 NICs at 50 Gbit/s 1.010
(1.117), with three T4 hosts 1.009 (1.091), with one 1.009 (1.016); see the README for the table and the
command.

Collectives: allreduce only. In reduce-scatter and allgather every rank owns a block of the result,
so a slow host cannot stand in for its ranks with one sum.
"""
import dataclasses

from ..bounds import lower_bound
from ..errors import PlanError
from ..schedule import RECV, REDUCE, SEND, Op, Schedule
from ..units import counted
from .ring import check_request
from .variants import tried, try_variant

NAME = "delegated"
SUPPORTED = ("allreduce",)
CORE_BASES = ("hierarchical", "tree-packing")   # the first: quick to plan, for small sizes
SLOW_RATIO = 2               # a slow host's links carry at most half what the fastest host's do
PIECE_BYTES = 256 << 10      # the slow side's messages, as tree packing's and hierarchical's smallest
MAX_PIECES = 8               # pieces per chunk (a power of two: chunk weights are scaled by it)
RAMP_CHUNKS = 16             # chunks at either end cut in the core as well ...
RAMP_PIECE_BYTES = 32 << 10  # ... into pieces of at least this much


def slow_hosts(topo):
    """``(slow, core)``: the ranks of every slow host (a tuple each) and the core's ranks, ascending;
    :class:`PlanError` when no host is slow or fewer than two ranks would be left in the core."""
    bandwidths = topo.host_bandwidths
    if len(bandwidths) < 2:
        raise PlanError(f"{NAME}: needs two hosts or more (a slow host delegates to the others); {topo.name} has "
                        f"{counted(len(bandwidths), 'host')} with ranks")
    fastest = max(bandwidths.values())
    slow = [topo.hosts[h] for h, b in bandwidths.items() if b * SLOW_RATIO <= fastest]
    if not slow:
        raise PlanError(f"{NAME}: no host's links are {SLOW_RATIO}x slower than the fastest host's, so none "
                        f"would gain by delegating")
    held = {r for ranks in slow for r in ranks}
    core = tuple(r for r in range(topo.nranks) if r not in held)
    if len(core) < 2:
        raise PlanError(f"{NAME}: the fast hosts hold {len(core)} rank(s); at least 2 must form the core")
    return slow, core


def core_facts(schedule):
    """``(targets, free)`` of an allreduce schedule: ``targets[c] = (rank, op index)`` of the first rank
    (lowest) whose last write of chunk ``c`` is a reduction, and the op that makes it; ``free[r][c]``
    the index of rank ``r``'s first plain receive of ``c`` after its first send of ``c``, where no
    reduction comes between (``c``'s copy on ``r`` is not needed in between). On one rank, which
    holds every result from the start, the op index is -1."""
    if schedule.nranks == 1:
        return dict.fromkeys(range(schedule.nchunks), (0, -1)), [{}]
    members = [schedule.members(c) for c in range(schedule.nids)]
    targets = {}
    free = []
    for r, program in enumerate(schedule.programs):
        sent, written, last = set(), set(), {}
        mine = {}
        for i, (kind, cid, _) in enumerate(program):
            for c in members[cid]:
                if kind == SEND:
                    sent.add(c)
                    continue
                last[c] = (i, kind)
                if c in sent and c not in written:
                    written.add(c)
                    if kind == RECV:
                        mine[c] = i
        free.append(mine)
        for c, (i, kind) in last.items():
            if kind == REDUCE and c not in targets:
                targets[c] = (r, i)
    if len(targets) < schedule.nchunks:
        raise PlanError(f"{NAME}: the core's {schedule.algorithm} schedule reduces no chunk last at any rank")
    return targets, free


def pieces_per_chunk(schedule, order, nbytes):
    """``(pieces, ramp)``: how many pieces every chunk of ``schedule`` is cut into for the slow side
    (powers of two up to MAX_PIECES, none below PIECE_BYTES), and the chunks (the first and last
    RAMP_CHUNKS of ``order``) cut in the core as well. Without a size, none is cut."""
    pieces = [1] * schedule.nchunks
    if not nbytes:
        return pieces, set()
    ends = set(order[:RAMP_CHUNKS] + order[-RAMP_CHUNKS:])
    for c in range(schedule.nchunks):
        size = schedule.chunk_fraction(c) * nbytes
        floor = RAMP_PIECE_BYTES if c in ends else PIECE_BYTES
        while pieces[c] < MAX_PIECES and size >= 2 * pieces[c] * floor:
            pieces[c] *= 2
    return pieces, {c for c in ends if pieces[c] > 1}


def cut_chunks(schedule, pieces, ramp=()):
    """``schedule`` with chunk ``c`` cut into ``pieces[c]`` equal pieces (each a divisor of MAX_PIECES),
    and ``{old chunk: its pieces}``. An operation on a cut chunk moves all its pieces in one message
    (a span), except on the chunks of ``ramp``, where it becomes one operation per piece."""
    n = schedule.nchunks
    pattern, split = [], []
    for c in range(n):
        q = pieces[c]
        split.append(range(len(pattern), len(pattern) + q))
        pattern += [int(schedule.pattern[c % len(schedule.pattern)]) * MAX_PIECES // q] * q
    spans = {}

    def renamed(cid):
        chunks = split[cid] if cid < n else range(split[schedule.members(cid)[0]][0],
                                                   split[schedule.members(cid)[-1]][-1] + 1)
        if len(chunks) == 1:
            return chunks[0]
        return len(pattern) + spans.setdefault((chunks[0], len(chunks)), len(spans))

    programs = tuple(tuple(op for kind, cid, peer in program
                           for op in ([Op(kind, x, peer) for x in split[cid]] if cid in ramp else
                                      [Op(kind, renamed(cid), peer)]))
                     for program in schedule.programs)
    cut = Schedule("allreduce", schedule.nranks, tuple(pattern), programs, algorithm=schedule.algorithm,
                   info=schedule.info, routes=schedule.routes, spans=tuple(spans))
    return cut, {c: list(split[c]) for c in range(n)}


def spread(topo, ranks):
    """``ranks`` in the order that takes one from every host before a second from any (delegates on
    different hosts and NICs)."""
    by_host = {}
    for r in ranks:
        by_host.setdefault(topo.host_of(r), []).append(r)
    columns = list(by_host.values())
    return [column[j] for j in range(max(map(len, columns))) for column in columns if j < len(column)]


def delegated_schedule(base, core, slow, delegates, nbytes=None):
    """The allreduce of ``base`` (an allreduce schedule of ``len(core)`` ranks; position ``i`` is rank
    ``core[i]``) with the hosts of ``slow`` (each a list of ranks) reducing at home and delegating, as
    the module docstring says. ``delegates[h][j]``: the core position that relays what rank ``j`` of
    slow host ``h`` uploads. ``nbytes`` sizes the pieces (none without it)."""
    if base.collective not in SUPPORTED:
        raise PlanError(f"{NAME} does not support {base.collective!r} (it plans {', '.join(SUPPORTED)})")
    p = len(core) + sum(len(ranks) for ranks in slow)
    targets, _ = core_facts(base)
    when = {c: i / max(1, len(base.programs[r])) for c, (r, i) in targets.items()}
    order = sorted(range(base.nchunks), key=when.__getitem__)
    pieces, ramp = pieces_per_chunk(base, order, nbytes)
    core_schedule, split = cut_chunks(base, pieces, ramp)
    targets, free = core_facts(core_schedule)
    order = [x for c in order for x in split[c]]
    fractions = core_schedule.chunk_fractions

    programs = [[] for _ in range(p)]
    before = [{} for _ in core]        # core position -> op index -> ops to insert before it
    after = [{} for _ in core]         # ... after it: the hosts' sums reduced in ...
    back = [{} for _ in core]          # ... then the results sent back
    for ranks, relays in zip(slow, delegates):
        loads = [0.0] * len(ranks)
        for c in order:
            j = min(range(len(ranks)), key=loads.__getitem__)
            loads[j] += fractions[c]
            owner, delegate = ranks[j], relays[j]
            target, last = targets[c]
            others = [x for x in ranks if x != owner]
            for x in others:
                programs[x].append(Op(SEND, c, owner))
            programs[owner] += [Op(REDUCE, c, x) for x in others]
            slot = free[delegate].get(c)
            if delegate != target and slot is not None:      # relayed: leaves in the delegate's queue order
                programs[owner].append(Op(SEND, c, core[delegate]))
                before[delegate].setdefault(slot, []).extend((Op(RECV, c, owner), Op(SEND, c, core[target])))
                after[target].setdefault(last, []).append(Op(REDUCE, c, core[delegate]))
            else:
                programs[owner].append(Op(SEND, c, core[target]))
                after[target].setdefault(last, []).append(Op(REDUCE, c, owner))
            programs[owner].append(Op(RECV, c, core[target]))
            back[target].setdefault(last, []).append(Op(SEND, c, owner))
            programs[owner] += [Op(SEND, c, x) for x in others]
            for x in others:
                programs[x].append(Op(RECV, c, owner))
    for i, rank in enumerate(core):
        program = programs[rank]
        program += [*after[i].get(-1, ()), *back[i].get(-1, ())]     # a core of one rank
        for k, (kind, cid, peer) in enumerate(core_schedule.programs[i]):
            program += before[i].get(k, ())
            program.append(Op(kind, cid, core[peer]))
            program += after[i].get(k, ())
            program += back[i].get(k, ())
    routes = {(core[a], core[b]): paths for (a, b), paths in core_schedule.routes.items()}   # the core's own
    return Schedule("allreduce", p, core_schedule.pattern, tuple(map(tuple, programs)), algorithm=NAME,
                    routes=routes, spans=core_schedule.spans,
                    info={"core_algorithm": base.algorithm, "core": list(core), "slow_hosts": [list(r) for r in slow],
                          "delegates": [[core[d] for d in relays] for relays in delegates],
                          "pieces": sorted(set(pieces)), "ramp_chunks": len(ramp)})


def _routes_avoiding(sched, vertices):
    """``sched`` without the pinned routes that pass through one of ``vertices`` (the slow ranks'): the
    core was planned on a fabric where they were no ranks, so their hosts forwarded, but a rank forwards
    nothing. Such a pair takes the topology's own routes (pinned routes steer the model, not the data)."""
    keep = {pair: paths for pair, paths in sched.routes.items()
            if not any(v in vertices for path, _share in paths for v in path[1:-1])}
    return sched if len(keep) == len(sched.routes) else dataclasses.replace(sched, routes=keep)


def delegated(topo, collective, *, root=0, nbytes=None, bases=CORE_BASES):
    """Slow hosts reduce at home and delegate to a core planned by ``bases`` (see the module
    docstring); the composed schedule that simulates fastest at ``nbytes``, each after the first
    simulated only until it provably cannot be (:func:`~ddl.algorithms.variants.try_variant`); without
    a size, or at a size where the bound is latency's, the first base that plans the core."""
    check_request(NAME, collective, topo.nranks, root, SUPPORTED)
    slow, core = slow_hosts(topo)
    bound = lower_bound(topo, collective, nbytes) if nbytes else None
    # where latency binds, delegating only adds hops: the first base will do, unsimulated (no LP to solve)
    first_only = not nbytes or bound.bandwidth_seconds < bound.latency_seconds
    from . import ALGORITHMS

    core_topo = topo.with_ranks([topo.ranks[r] for r in core])
    order = spread(core_topo, range(len(core)))
    delegates, k = [], 0
    for ranks in slow:
        delegates.append([order[(k + j) % len(order)] for j in range(len(ranks))])
        k += len(ranks)
    kept, attempts, reasons = None, [], {}
    for name in bases:
        try:
            base = ALGORITHMS[name](core_topo, "allreduce", nbytes=nbytes)
        except PlanError as exc:
            reasons[name] = str(exc)
            continue
        sched = _routes_avoiding(delegated_schedule(base, core, slow, delegates, nbytes),
                                 {topo.ranks[r] for ranks in slow for r in ranks})
        if first_only:
            return sched
        seconds, at_least = try_variant(topo, sched, nbytes, None if kept is None else kept[0])
        attempts.append(tried(seconds, at_least, core_algorithm=name, operations=sched.nops))
        if kept is None or seconds is not None and seconds < kept[0]:
            kept = (seconds, sched)
    if kept is None:
        raise PlanError(f"{NAME}: no base plans the core: {reasons}")
    kept[1].info["variants_tried"] = attempts
    return kept[1]
