"""Hierarchical (per-tier) collectives: reduce-scatter up the tiers, allgather back down.

Sources: M. Cho, U. Finkler, D. Kung and H. Hunter, "BlueConnect: decomposing all-reduce for deep
learning on heterogeneous network hierarchy", SysML 2019; M. Cho et al., "PowerAI DDL",
arXiv:1708.02188, 2017; A. Sergeev and M. Del Balso, "Horovod", arXiv:1802.05799, 2018 (hierarchical
allreduce); Thakur, Rabenseifner and Gropp, IJHPCA 2005 (reduce-scatter + allgather decomposition).

Stages are the distinct partitions of :attr:`Topology.tiers` (fastest first; all-singleton partitions
and repeats dropped; the last stage is every rank). Allreduce: stage 1 reduce-scatters the buffer by a
ring inside each stage-1 group; stage ``s`` reduce-scatters, by a ring among the ranks of a stage-``s``
group that hold the same share (one per stage-``s-1`` sub-group), what stage ``s-1`` left on them; then
allgathers run back down the stages. Every rank sends ``2 (1 - 1/p)`` of the buffer, as in a flat ring,
but only ``1/g_1...g_{s-1}`` of it crosses tier ``s``, in ``2 sum(g_s - 1)`` steps instead of
``2 (p - 1)``.

Which rank holds which share is a *target map*: every chunk has a target rank (the owner of its block
for reduce-scatter and allgather, the root for broadcast, rank ``c // k`` for allreduce). In a
group containing the target the chunk is held by the target; in another group by the rank "in the
same place": the sub-group with the target's sub-group index (modulo the group's size), recursively.
So a chunk's final value is always reduced at its target and only copied elsewhere, and groups of
*unequal* sizes (e.g. 8- and 4-GPU hosts) are handled exactly: the smaller group's ranks hold (and
move) proportionally more.

Collectives: allreduce, reduce_scatter (block r ends on rank r: it is r's chunks' target), allgather,
broadcast (a pipelined chain per group, top stage first). Each stage is a ring in the topology-aware
ring order. Chunks: with one stage ``k = pipeline_depth(nbytes, p)`` per target (see
ring.pipeline_depth; broadcast ``pipeline_depth(nbytes, 1)``), with several ``k = wave_depth(...)``
ramped waves (below).

Waves. A ring completes all its blocks together, so a stage cannot hand any share to the next
before it ends, and the stages' times add up: the fast tiers idle while the slow one works. With
several stages the programs therefore list the chunks in *waves*: chunk ``j`` of every target goes
through every stage (up and back down) before chunk ``j+1`` is listed, and since operations on
different chunks never wait on each other, wave ``j`` crosses the slow tier while wave ``j+1`` is
reduced inside the fast ones. ``k`` chunks make ``k`` waves. What remains exposed is the first
wave's way up to the slow tier and the last wave's way back down, so the waves *ramp*: chunk ``j``
of ``k`` weighs ``min(j + 1, k - j)`` (1, 2, ..., 2, 1): small waves fill and drain the pipeline,
large ones keep the slow tier busy, and the middle waves grow no faster than the slow tier absorbs
them. Chunks go down to ``WAVE_MIN_BYTES`` (256 KiB, the smallest, first and last; as tree-packing's
sub-chunks; see Floors for a steeper ramp) and the schedule to ``MAX_WAVE_OPS`` operations, which is
what simulating and verifying it cost (see Budget). Where the floor would cut the first and last waves
too small, the ramp is *lifted*: every weight plus one (2, 3, ..., 3, 2), up to ``MAX_LIFT``, since
more waves on a gentler ramp overlap the tiers better than fewer on a steep one (on the 192-rank
cluster four waves 2, 3, 3, 2 beat three waves 1, 2, 1; on the 32-rank three-tier test cluster at 64
MiB six lifted by two beat four). On the 192-rank three-tier cluster at 256 MiB this cuts the predicted
time from 82.5 ms (two chunks, stage after stage) to 71.7 ms (two equal waves), 64.6 ms (three ramped
waves) and 63.1 ms (four waves, lifted by one).

Lag. Among the messages of one rank pair that are ready, the earliest in the program leaves first
(MPI's non-overtaking order; the simulator follows it). Listing each wave's way up and then at once
its way back down therefore favours the down-sweep: a fast tier that is also the busiest (the
NVLink of a DGX A100 moves 7/8 of the buffer each way, its NIC 1/16) does wave ``j``'s allgather as
soon as the slow tier hands it back, has nothing left to do when the last wave goes through the slow
tier, and idles. An allreduce lists wave ``j``'s way down after the way up of waves ``j+1`` and
``j+2`` (:data:`WAVE_LAG`), so the up-sweep runs ahead and leaves a backlog of allgathers for the
end. On the 2 x 8 DGX A100 cluster at 256 MiB that takes the prediction from 1.034 of the bound to
1.012 (8 waves instead of 16); on 4 x 8, where the NICs are the busiest, from 1.045 to 1.039; a lag
of 1 gains less (1.035 on 2 x 8), 4 no more (1.012 there, 1.042 on 4 x 8). The data and the reduction
order are those without the lag: waves hold disjoint chunks.

Exchange. A ring of ``g`` ranks takes ``g - 1`` message latencies to reduce-scatter a wave (and as
many to gather it back), and the next stage waits for all of them. Through a switch the fastest
stage can *exchange directly* instead (:func:`exchange_reduce_scatter`): each rank sends every share
to its holder in one step, the same bytes on every link. On the 4 x 8 DGX A100 cluster the NICs idled
31 us at each end of a 2.09 ms allreduce while the eight GPUs of a box rang a wave through; with the
exchange 1.027 of the bound instead of 1.039. It is one more variant (below), tried last.

Split waves. Where the fastest tier's ranks share the next tier's link (the four GPUs of a host
its NIC), a wave's rings through that link carry every GPU's share at once, and the tier above
waits for all of them: on the 192-rank three-tier cluster the rack uplinks idled 4.4 ms of 63 ms
while the first wave went round the hosts of each rack. With three stages or more an allreduce
therefore lists each wave in parts (:func:`wave_parts`): the targets held by one GPU of every host,
and among them one *diagonal* across the racks, so that the part's in-rack rings carry one chunk
per member and its rings across the racks start from every rack alike; each part goes through
every stage before the next. The bytes are the same and the messages about as many (a first-stage
member sends a part's run in ``1/m`` of the spans, ``m`` racks; 310272 operations instead of 291840);
the uplinks start after 1.5 ms: 1.043 of the bound instead of 1.103, on the 32-rank three-tier test
cluster 1.019 instead of 1.032. ``g`` places and ``m`` racks make ``g m`` parts, so even a single
wave pipelines: at 512 ranks (8 racks), where the budget allows one wave, 32 parts take it from
1.330 to 1.068 of the bound (the ring: 1.141), and 1024 ranks to 1.036 (the ring: 1.065). With two
stages nothing waits that way (on the DGX A100 clusters the parts were predicted 0.2-2% slower), so
nothing is split. The parts make the simulation slower (the 192-rank schedule's 5 s instead of
2 s), since the rings no longer step together.

Leaders. The parts of a wave that different GPUs of a host hold still cross the host's NIC at once:
on the 192-rank cluster four GPUs' first parts went round each rack's hosts at a quarter of the NIC
each, and the rack uplinks idled 1.4 ms at the start and 0.95 ms at the end of 59.7 ms. With
*leaders* (``leaders=True``) only the first rank of each first-stage group (in ring order) holds
targets, its group's shares summed (:func:`leader_shares`): the first stage's rings pass the others'
partial sums along to it (a chain: each member sends the buffer once each way) and only leaders take
part in the later stages. A host's parts then cross its NIC one after another at its full rate, with
the same bytes on it, and a quarter of the targets make a quarter of the operations, so the budget
and the floor (on a leader's four times larger chunks) allow more waves: 12 waves on the 192-rank
cluster, its uplinks busy from 0.63 ms, 1.019 of the bound instead of 1.043 (exchanging to the
leaders in the first stage; 1.020 by ring). Leaders are tried only where they load no link more than
a share per rank does (:func:`ddl.simulate.load_seconds` of both, one chunk each): a DGX A100's GPUs
have a NIC each, and leaders would send the box's traffic through one of them. Small schedules
simulate them as variants, which must be predicted 1% faster to replace a share per rank (as
variants with more messages must: on the emulated one-switch cluster, 64 MiB at a fifth of the link
rate, twelve waves of leaders predicted 0.005% faster than eight of a share per rank ran 2.5% slower
in three alternating pairs, 472-485 ms against 464-479 ms); large ones (below) take them, with the
most waves under the highest cap, by ring or exchanging, whichever simulates faster, except where
the budget allows them one wave only: a wave of leaders goes in ``m`` parts where a share per rank
goes in ``g m``, and at 1024 ranks that one wave of 16 parts gave 1.060 of the bound against 1.036
for the 64 parts of a share per rank. On clusters built like the 192-rank one, a share per rank
against leaders: 128 ranks 1.057 and 1.024, 256 ranks 1.037 and 1.017, 512 ranks 1.068 and 1.019
(before the steep ramps; see Floors and Budget for what they are now).

Floors. A steeper ramp fills and drains faster but needs smaller first and last chunks. With every
chunk at least 256 KiB the 128-rank cluster built like the 192-rank one got 16 waves lifted by
three, its first wave's chunks 280 KiB: the rack uplinks waited 0.54 ms for the first sums, 1.024 of
the bound. Lifted by 0, 1, 2 and 3 its leaders are predicted 43.53, 43.65, 43.84 and 43.97 ms. So
``WAVE_MIN_BYTES`` (256 KiB) still sets how many waves there are, and ``RAMP_MIN_BYTES`` (128 KiB)
how steep their ramp may be (``wave_depth(steep=True)``): 1.016 there (16 waves lifted by one), 1.011
on 192 ranks (1.018), 1.011 on 256 (1.017), 1.013 on 512 (1.019). A floor of 128 KiB for the wave
count too gave the same or better predictions (192 ranks: 16 waves, 1.011), but more messages,
which the simulator does not charge: on the emulated two-rack cluster at 4 MiB six waves of leaders
instead of three, predicted 1.6% faster, ran 748 and 754 ms against 712 and 734 ms (two
alternating pairs at half the link rate). Steeper is not always better either: on the 4 x 8 DGX A100
cluster 12 waves lifted by one beat 12 lifted by none (2.073 against 2.084 ms). Where variants are
simulated both ramps are therefore tried (the same operations, so the faster is kept); large
schedules, which try no variants, take the steep one.

Budget. Where even one wave of a share per rank on every tier exceeds MAX_WAVE_OPS, it is built
anyway (a schedule needs one wave), so the budget is that wave's operations: 1.24 million at 1024
ranks in three tiers. Leaders, with a quarter of the targets, fit three waves in it (930816
operations; the floor allows no more) where MAX_WAVE_OPS allowed them one: 1.017 of the bound instead
of a share per rank's 1.036.

Handoff. A ring member of the top stage sends block ``i - 1`` first (``i`` its index), then
``i - 2``, ..., and gets its own block back first, then ``i - 1``, ... The stage below lists each
member's chunks in that order (:func:`_handoff_order`), so the top stage starts as soon as the
first block it needs is reduced, and the stage below passes on the first block it gets back, where
both used to go in one order in every group: on the 4 x 8 DGX A100 cluster each box's NICs waited
for the first wave's whole exchange through the NVSwitch, 33 us, and now start after 11 (1.027 of
the bound -> 1.023); on the 8:1 fat tree 1.016 -> 1.006, the leaf-spine 1.011 -> 1.004 (two stages
instead of three), the one-switch emulated cluster 1.028 -> 1.008. The bytes and the messages are
the same. Only the stage below the top is ordered: on the 192-rank cluster ordering the hosts' chunks
for the rack rings made the NICs start at 37 us instead of 177 but the rack uplinks finish later
(1.0200 of the bound against 1.0189), since a rack ring's fifteen steps, not its start, set when
the uplinks get the first sums.

Lead. The handoff leaves the top stage waiting where one wave's blocks cannot cover a message's
latency: a ring member sends the first block of a wave, then waits for its neighbour's sum of the
second, one message's way through PCIe, NIC and switch (8 us on the DGX A100 clusters). The next
wave's first block could fill that wait, but the stage below lists it after all of this wave's
blocks. With two stages an allreduce therefore lists, in the stage below the top, the next wave's
first blocks (those the top stage takes first) ahead of this wave's later ones. On the 4 x 8 DGX A100
cluster at 256 MiB that fills the 8.4 us the NICs idled after the first wave's first block: 1.023 of
the bound -> 1.017; 64 MiB 1.6% faster; the one-switch emulated cluster 0.4% faster at 64 MiB. The
next two waves' first blocks filled a later gap but left one at the end (1.018). Not for reduce-scatter
(on the 4 x 8 cluster 1.9% slower, 2 x 8 2.1% faster), nor with three stages, where the parts (Split
waves) pipeline the waves and the stage below the top needs the stages under it first.

Equal shares. An allreduce may cut its buffer among the targets in any proportion. With a share per
rank, a group of the stage below the top (a rack) reduces its ranks' share of the buffer and ships
the rest out: on racks of 16, 16 and 8 ranks the small rack sends 4/5 of the buffer through its
uplink each way, the large ones 3/5, and with uplinks alike the small rack's binds. Where those
groups are unequal the variants therefore end with one whose groups hold equal shares
(:func:`share_weights`: the small rack's ranks hold chunks twice as large), and every uplink carries
2/3 each way: 1.015 of the bound instead of 1.063 on those racks (4 GPUs per host). Large
schedules, which try no variants, take equal shares wherever the groups are unequal (racks of 32,
32 and 16 ranks: 1.026 instead of 1.072). The variant keeps the waves of the one kept so far, or
fewer where its smaller chunks would fall under the floor.

Weighted shares. Where one group below the top sits behind a much slower link than the others (the T4
hosts of the heterogeneous cluster behind 25 or 50 Gbit/s, the rest behind 100-400), no proportion of
one share per rank or per group serves it: with ``m`` groups exchanging directly at the top, a group
holding ``s`` of the buffer sends and takes ``1 + s (m - 2)`` buffers through its link, so the slow
group should hold nothing and only send its sums out and take the results in, as the bound counts.
What a target's chunks put on every link is the same whatever the other targets hold, and grows with
its share, so :func:`weighted_shares` builds each target's schedule alone (one chunk), and an LP
finds the shares that load the busiest link least, then the most even ones at that load. The variant
exchanges directly at the top stage, is tried after equal shares (where the variants are simulated,
see below) where the LP loads the busiest link at least 1% less than the schedule kept, and leaders
then keep its shares. On the heterogeneous
cluster with 50 Gbit/s T4 NICs (the zoo's file with its T4 NICs doubled) that takes hierarchical's
256 MiB allreduce from 58.5 ms, 1.361 times the bound, to 48.0 ms, 1.117 (and makes it ``auto``'s
choice there); with the zoo's 25 Gbit/s from 115.7 ms (1.347) to 93.4 ms (1.088), where tree-packing
(88.4 ms) stays faster. Every wave's way through the slow link is shared by as many rank pairs as
targets and ends as a whole before its sums come back, so more waves gain: 48 would reach 1.034 at
25 Gbit/s, but the 256 KiB floor allows 12 to 16.

How many waves overlap best depends on how the tiers' rates and latencies compare, and no rule
caught it: on the DGX A100 clusters sixteen waves (lifted) were predicted 1.4-2.2% faster than
eight before the lag, on the oversubscribed leaf-spine 3% slower; with the lag, eight are best on
the 2 x 8 cluster. Nor is every tier worth a stage: on the
leaf-spine a ring over all eight hosts (two crossings of each rack's uplinks per ring) overlaps with
the in-host stage better than a stage inside each rack and another across the racks, 1.016 of the
bound against 1.080. So where the schedules are small enough to simulate in a moment
(``CHOOSE_VARIANTS_OPS``), the variants are built and simulated on the topology: every tier,
then each tier left out in turn, with the most waves that fit under a cap of 8 (a tier left out
must be predicted 1% faster, since the later variants are tried only on the stages kept: on racks of
8, 8 and 4 GPUs leaving the hosts out was predicted 0.03% faster, and kept equal shares with
leaders out, 1.021 of the bound against 1.013); then, on the stages kept, the most waves under caps
of 12 and 16; then the fastest stage exchanging directly,
where its groups have more than two ranks; then leaders. Larger schedules take every tier: leaders
where they apply (see Leaders), else, untried, with the most waves under the cap of 8 that the
floor and the budget allow for those stages (the variants share one count, which fits the largest of
them; at 256 ranks in three tiers that was two waves, 1.071 of the bound, where the stages kept
allow three, 1.037). More waves are more messages, which the
simulator charges nothing for unless the file gives a ``message_cost``: a variant with more
operations replaces the one kept so far only where it is predicted 1% faster (see
:mod:`ddl.algorithms.variants`); one with no more (fewer tiers, or the exchange: as many messages as
the rings) wherever it is faster. Each variant after the first is simulated only until it provably
cannot replace the one kept; leaders exchanging at the first stage take the waves of the fastest
leaders by ring, so a ring variant stopped short is run out where its bound leaves it a chance of
being that fastest, and none is where the exchange's busiest link alone is slower than the one kept.
"""
import math
from itertools import combinations

import numpy as np

from ..errors import PlanError
from ..schedule import ScheduleBuilder
from ..simulate import link_totals, load_seconds, simulate
from .ring import (MAX_PIPELINE, MAX_SCHEDULE_OPS, check_request, nested_order, pipeline_depth, rank_partitions,
                   ring_allgather, ring_reduce_scatter)
from .variants import CHOOSE_VARIANTS_OPS, replaces, to_beat, tried, try_variant

NAME = "hierarchical"
# With several stages, chunks go down to this size so that there are waves to overlap ...
WAVE_MIN_BYTES = 256 << 10
# ... and a steeper ramp of as many waves, down to this size, is taken or tried as well (see Floors).
RAMP_MIN_BYTES = 128 << 10
# ... as long as the schedule keeps within this many operations (plan time grows with them).
MAX_WAVE_OPS = MAX_SCHEDULE_OPS
# An allreduce ring member sends its share of a wave in spans: as many per step as the operation
# budget (MAX_WAVE_OPS) allows of these, once the waves are chosen. A message per target is four
# million operations at 1024 ranks; one per step leaves the receiver's reduction and the next stage
# waiting for the whole share. At 256 MiB on three-tier clusters of 4 x 16 x R ranks (R = 3, 8, 16),
# against a message per target: 16 spans predict 1.000, 1.002 and 1.011 times its time with 2.0, 2.9
# and 3.4 times fewer operations; 4 spans 1.003, 1.040 and 1.074; one span 1.036 at R = 3.
SPAN_PIECES = (16, 8, 4)
# An allreduce lists each wave's way back down after the way up of this many later waves (see Lag).
WAVE_LAG = 2
# The ramp of the waves may be lifted by up to this much where its smallest waves would be too small.
MAX_LIFT = 3
# Variants (tiers left out, more waves under these caps) are simulated to choose among them
# (:mod:`ddl.algorithms.variants`).
WAVE_CAPS = (MAX_PIPELINE, 12, 16)
# Weighted shares (see Weighted shares) are rounded to steps of 1/SHARE_STEPS of the largest, and tried
# where they load the busiest link at least WEIGHTED_GAIN less than the schedule kept so far.
SHARE_STEPS = 64
WEIGHTED_GAIN = 0.01


def stage_partitions(nranks, partitions):
    """The stages: ``partitions`` (fastest first; rank groups) normalised to sorted tuples, with
    all-singleton and repeated partitions dropped and the partition of every rank appended if missing.
    Raises PlanError when a partition does not cover the ranks or is not nested in the next."""
    stages = []
    prev = tuple((r,) for r in range(nranks))
    for part in list(partitions) + [[range(nranks)]]:
        groups = tuple(sorted((tuple(sorted(int(r) for r in g)) for g in part), key=min))
        if sorted(r for g in groups for r in g) != list(range(nranks)):
            raise PlanError(f"{NAME} does not support tiers that are not a partition of the ranks: {groups}")
        if groups == prev:
            continue
        owner = {r: gi for gi, g in enumerate(groups) for r in g}
        if any(len({owner[r] for r in g}) != 1 for g in prev):
            raise PlanError(f"{NAME} does not support tiers that are not nested: {prev} vs {groups}")
        stages.append(groups)
        prev = groups
    return stages


def ramp(k, lift=0):
    """Weights of a target's ``k`` chunks when every chunk is a wave: 1, 2, ..., 2, 1, each plus
    ``lift`` (a gentler ramp: its first and last waves are a larger share)."""
    return tuple(min(j + 1, k - j) + lift for j in range(k))


def wave_depth(nbytes, pieces, ops_per_wave, most=MAX_PIPELINE, steep=False, budget=MAX_WAVE_OPS):
    """``(k, lift)``: the most ramped waves per target (up to ``most``) whose schedule, of
    ``ops_per_wave`` operations per wave, stays within ``budget`` and whose smallest chunk (of
    ``pieces`` per wave) stays >= WAVE_MIN_BYTES with the steepest ramp (lift 0 to MAX_LIFT) that
    allows it; ``(1, 0)`` if none does. More waves overlap the tiers better even where the floor
    makes them ramp gentler. ``steep``: those ``k`` waves on the steepest ramp whose smallest chunk
    stays >= RAMP_MIN_BYTES (see Floors)."""
    def smallest(k, lift):
        return (nbytes or 0) * (1 + lift) // (pieces * sum(ramp(k, lift)))
    for k in range(most, 1, -1):
        if k * ops_per_wave > budget:
            continue
        for lift in range(MAX_LIFT + 1):
            if smallest(k, lift) >= WAVE_MIN_BYTES:
                if steep:
                    lift = min(up for up in range(lift + 1) if smallest(k, up) >= RAMP_MIN_BYTES)
                return k, lift
    return 1, 0


def hierarchical_schedule(order, partitions, collective, k=1, root=0, algorithm=NAME, waves=1, ramped=False,
                          lift=0, span_pieces=SPAN_PIECES[0], lag=0, exchange=(), split=False, balanced=False,
                          leaders=False, handoff=True, lead=True, shares=None, **info):
    """Hierarchical ``collective``: rings in ``order`` (a permutation of ``range(p)``) inside the groups
    of ``partitions`` (fastest first; see :func:`stage_partitions`). The ``k`` chunks of every target
    are split into ``waves`` (1..k) groups, each listed through every stage before the next;
    ``ramped``: chunk ``j`` of a target weighs ``ramp(k, lift)[j]`` instead of 1. An allreduce's ring
    members send their shares in up to ``span_pieces`` spans per step (other collectives: a message
    per chunk, since their chunks of one target are its pipeline), and list a wave's way back down
    after the way up of the ``lag`` waves that follow it. The stages numbered in ``exchange`` (1 is
    the fastest) exchange directly instead of by ring (:func:`exchange_reduce_scatter`). ``split``: an
    allreduce's waves go in parts (:func:`wave_parts`, see Split waves), each listed through every stage
    before the next. ``balanced``: an allreduce's groups below the top stage hold equal shares
    (:func:`share_weights`, see Equal shares) instead of one per rank. ``lead``: with two stages and the
    handoff, an allreduce's first stage lists the next wave's first blocks for the top stage ahead of
    this wave's later ones (see Lead). ``shares``: an allreduce's integer weight per target (0: it
    holds nothing), in place of ``balanced`` or one per rank (see Weighted shares)."""
    order = [int(r) for r in order]
    p = len(order)
    check_request(algorithm, collective, p, root)
    stages = stage_partitions(p, partitions)
    pos = {r: i for i, r in enumerate(order)}
    holders, children = _holders(p, stages, pos)
    weights = ramp(k, lift) if ramped else (1,) * k
    if collective == "allreduce":
        # chunk j of every target, targets in span order: what a stage's ring member holds is a run
        share = target_shares(p, stages, balanced, shares)
        leaders = bool(leaders and stages)      # (a single rank has no stage, nor a group to lead)
        if leaders:
            share = leader_shares(share, stages[0], pos)
        chosen = [t for t in range(p) if share[t]]
        if split and len(stages) > 2:
            parts = wave_parts(p, stages, holders, pos, chosen)
        else:
            parts = [_span_order(p, stages, holders, pos, chosen)]
        slots = [t for part in parts for t in part]
        b = ScheduleBuilder(collective, p, tuple(w * share[t] for w in weights for t in slots), algorithm=algorithm)
        slot = {t: i for i, t in enumerate(slots)}
        targets = {t: [j * len(slots) + slot[t] for j in range(k)] for t in slots}
    elif collective == "broadcast":
        b = ScheduleBuilder(collective, p, weights, root=root, algorithm=algorithm)
        targets = {root: list(range(k))}
    else:
        b = ScheduleBuilder(collective, p, weights, algorithm=algorithm)
        targets = {t: list(range(t * k, (t + 1) * k)) for t in range(p)}
    waves = max(1, min(int(waves), k))
    spans = span_pieces if collective == "allreduce" else None
    lag = max(0, int(lag)) if collective == "allreduce" else 0

    wave = [{t: chunks[w * k // waves:(w + 1) * k // waves] for t, chunks in targets.items()} for w in range(waves)]
    if collective == "allreduce" and len(parts) > 1:
        wave = [{t: whole[t] for t in part} for whole in wave for part in parts]
        lag *= len(parts)
        spans = -(-spans // len(stages[-2]))

    exchange = tuple(sorted({int(s) for s in exchange}))
    up_ops = {s: exchange_reduce_scatter if s in exchange else ring_reduce_scatter for s in range(1, len(stages) + 1)}
    down_ops = {s: exchange_allgather if s in exchange else ring_allgather for s in range(1, len(stages) + 1)}

    below_top = len(stages) - 1          # the stage that hands the top stage its chunks (see Handoff)
    ahead = (_handoff_order(stages, holders, children, pos, targets)
             if handoff and below_top > 0 and len(stages) not in exchange else None)
    owner = {c: t for t, chunks in targets.items() for c in chunks} if ahead else None

    def down(w):
        for s in range(len(stages), 0, -1):
            _stage(b, s, holders, children, wave[w], pos, down_ops[s], spans, ahead if s == below_top else None,
                   owner, 1)

    # the next wave's first blocks for the top stage go ahead of this wave's later ones (see Lead)
    lead = bool(lead and ahead and below_top == 1 and len(wave) == waves and collective == "allreduce")

    def up(w, s):
        if s != below_top or not lead:
            _stage(b, s, holders, children, wave[w], pos, up_ops[s], spans, ahead if s == below_top else None,
                   owner, 0)
            return
        for v in (w, w + 1) if w == 0 else (w + 1,):
            if v < len(wave):
                _stage(b, s, holders, children, wave[v], pos, up_ops[s], spans, ahead, owner, 0, first=True)
        _stage(b, s, holders, children, wave[w], pos, up_ops[s], spans, ahead, owner, 0, first=False)

    for w in range(len(wave)):
        if collective in ("allreduce", "reduce_scatter"):
            for s in range(1, len(stages) + 1):
                up(w, s)
        if collective != "reduce_scatter" and w >= lag:
            down(w - lag)
    if collective != "reduce_scatter":
        for w in range(max(0, len(wave) - lag), len(wave)):
            down(w)
    return b.build(order=order, chunks_per_target=k, waves=waves, ramped=ramped, lift=lift if ramped else 0,
                   span_pieces=spans, lag=lag, exchange_stages=list(exchange), wave_parts=len(wave) // waves,
                   balanced=bool(balanced and collective == "allreduce"),
                   shares=list(shares) if shares is not None and collective == "allreduce" else None,
                   leaders=bool(leaders and collective == "allreduce"), handoff=ahead is not None, lead=lead,
                   stages=[{"groups": [list(g) for g in groups], "group_sizes": [len(g) for g in groups]}
                           for groups in stages], **info)


def exchange_reduce_scatter(builder, ranks, blocks):
    """Reduce-scatter among ``ranks`` by direct exchange: every rank sends ``blocks[j]`` straight to
    ``ranks[j]``, which reduces the ``g - 1`` partials in a fixed order (from the rank before it, then
    the one before that, round the group). The same bytes leave and enter every rank as in a ring, but
    in one step instead of ``g - 1``: through a switch, a wave's blocks are done after one message
    latency rather than ``g - 1``, and that is what the next stage waits for before it can start."""
    g = len(ranks)
    for t in range(1, g):
        for i in range(g):
            j = (i + t) % g
            for c in blocks[j]:
                builder.transfer(ranks[i], ranks[j], c, reduce=True)


def exchange_allgather(builder, ranks, blocks):
    """Allgather among ``ranks`` by direct exchange: ``ranks[j]`` sends ``blocks[j]`` to every other
    rank (see :func:`exchange_reduce_scatter`)."""
    g = len(ranks)
    for t in range(1, g):
        for j in range(g):
            for c in blocks[j]:
                builder.transfer(ranks[j], ranks[(j + t) % g], c)


def _holders(p, stages, pos):
    """``holders[s][X][t]``: the rank of stage-``s`` group ``X`` that holds target ``t``'s chunks after
    stage ``s`` (stage 0: every rank is its own group); ``children[s][X]``: the stage-``s-1`` groups
    inside ``X``, in ring order."""
    levels = [tuple((r,) for r in range(p))] + list(stages)
    group_of = [{r: gi for gi, g in enumerate(groups) for r in g} for groups in levels]
    holders = [[[x[0]] * p for x in levels[0]]]
    children = [None]
    for s in range(1, len(levels)):
        kids = [[] for _ in levels[s]]
        for gi, g in enumerate(levels[s - 1]):
            kids[group_of[s][g[0]]].append(gi)
        for ks in kids:
            ks.sort(key=lambda gi: min(pos[r] for r in levels[s - 1][gi]))
        index = {gi: i for ks in kids for i, gi in enumerate(ks)}
        below = holders[s - 1]
        level = []
        for X, ks in enumerate(kids):
            row = []
            for t in range(p):
                if group_of[s][t] == X:
                    row.append(t)
                else:
                    row.append(below[ks[index[group_of[s - 1][t]] % len(ks)]][t])
            level.append(row)
        holders.append(level)
        children.append(kids)
    return holders, children


def _stage(b, s, holders, children, targets, pos, ring_op, span_pieces, ahead=None, owner=None, way=0, first=None):
    """One stage's rings: in every stage-``s`` group, the sub-groups' holders of the same targets form
    a ring (in ring order); each target's chunks end on (reduce-scatter) or start from (allgather) the
    group's holder of that target; with ``span_pieces``, each member's chunks go as up to that many spans.
    ``ahead``: ``{(group, target): (up, down)}``, the order in which the next stage's rings take a
    group's targets on the way up and hand them back on the way down (``way`` 0 or 1; see
    :func:`_handoff_order`): each member's chunks go in that order (``owner``: chunk -> target).
    ``first``: True for only the targets the next stage takes first from the group, False for only
    the others (see Lead), None for all."""
    for X, kids in enumerate(children[s]):
        if len(kids) < 2:
            continue
        rings = {}
        for t, chunks in targets.items():
            if first is not None and (ahead[X, t][way] == 0) != first:
                continue
            members = tuple(sorted({holders[s - 1][Y][t] for Y in kids}, key=pos.get))
            rings.setdefault(members, {}).setdefault(holders[s][X][t], []).extend(chunks)
        for members, blocks in rings.items():
            if span_pieces:                    # a few messages per run of chunks (see _span_order)
                blocks = {r: b.runs(chunks, span_pieces) for r, chunks in blocks.items()}
            if ahead:
                def due(c):
                    return ahead[X, owner[b.first_chunk(c)]][way]
                blocks = {r: sorted(chunks, key=due) for r, chunks in blocks.items()}
            ring_op(b, list(members), [blocks.get(r, []) for r in members])


def _handoff_order(stages, holders, children, pos, targets):
    """``{(X, t): (up, down)}`` for the groups ``X`` of the stage below the top: when the top stage's
    ring needs target ``t``'s chunks from ``X``'s holder on the way up (a ring member at index ``i``
    sends block ``i - k - 1`` at step ``k``) and when it hands them back on the way down (it holds its
    own block ``i`` first, then receives ``i - 1``, ``i - 2``, ...), 0 first (see Handoff)."""
    top, below = len(stages), len(stages) - 1
    order = {}
    for P, kids in enumerate(children[top]):
        for t in targets:
            members = sorted({holders[below][Y][t] for Y in kids}, key=pos.get)
            g, held = len(members), members.index(holders[top][P][t])
            for Y in kids:
                i = members.index(holders[below][Y][t])
                order[Y, t] = ((i - 1 - held) % g, (i - held) % g)
    return order


def wave_parts(p, stages, holders, pos, chosen=None):
    """The parts an allreduce's waves are split into (see Split waves), in the order they are listed:
    targets whose first-stage holder has the same place in its group (the same GPU of every host) and,
    among them, the same *diagonal* of the stage below the top: ``(i + j) mod m`` for the ``j``-th
    target (in span order) of sub-group ``i`` of ``m`` (of rack ``i`` of ``m``). Every ring member of
    that stage then holds one target of each diagonal (one per rack), so a part's rings there carry one
    chunk per member, and each part's top-stage rings start from every rack alike. Each part is in span
    order."""
    spanned = _span_order(p, stages, holders, pos, chosen)
    index = {t: i for i, t in enumerate(spanned)}
    subs = stages[-2]
    diagonal = {t: (i + j) % len(subs) for i, g in enumerate(subs)
                for j, t in enumerate(sorted((t for t in g if t in index), key=index.get))}
    first = holders[1][0]
    parts = {}
    for t in spanned:
        parts.setdefault((pos[first[t]], diagonal[t]), []).append(t)
    return [parts[key] for key in sorted(parts)]


def share_weights(p, stages):
    """Integer weight of every target's chunks in a balanced allreduce (see Equal shares): the groups
    of the stage below the top hold equal shares of the buffer, split evenly among their ranks."""
    if len(stages) < 2:
        return (1,) * p
    groups = stages[-2]
    whole = math.lcm(*(len(g) for g in groups))
    weight = [0] * p
    for g in groups:
        for t in g:
            weight[t] = whole // len(g)
    return tuple(weight)


def target_shares(p, stages, balanced=False, shares=None):
    """An allreduce's integer weight per target: ``shares`` where given (see Weighted shares), else equal
    shares per group below the top where ``balanced`` (:func:`share_weights`), else one per rank."""
    if shares is not None:
        return tuple(shares)
    return share_weights(p, stages) if balanced else (1,) * p


def weighted_shares(topo, order, tiers, exchange=()):
    """``(shares, seconds per byte)``: an integer weight per target of an allreduce on ``tiers``' stages
    (ring order ``order``, exchanging directly at the stages in ``exchange``) that leaves its busiest
    link the least loaded, and that load per byte of the buffer; None where one share per rank is as
    good. The bytes a target's chunks put on each link are the same whatever the other targets hold
    and grow with its share, so an LP (HiGHS) finds the shares: least ``T`` with every link's load
    over its capacity at most ``T``; then, at that ``T``, the most even shares (least largest share),
    since every target that holds nothing or little leaves its ranks' links idle in the pipeline. Shares
    are rounded to steps of 1/SHARE_STEPS of the largest, so one below half a step becomes none (see
    Weighted shares)."""
    from scipy.optimize import linprog

    p = topo.nranks
    loads = [link_totals(topo, hierarchical_schedule(order, tiers, "allreduce", span_pieces=1, exchange=exchange,
                                                     shares=[int(r == t) for r in range(p)]), 1.0)
             for t in range(p)]
    links = sorted({link for load in loads for link in load})
    row = {link: i for i, link in enumerate(links)}
    use = np.zeros((len(links), p))
    for t, load in enumerate(loads):
        for link, nbytes in load.items():
            use[row[link], t] = nbytes / topo.capacity(*link)
    scale = use.max()               # seconds per byte are ~1e-10: below HiGHS's tolerances unless scaled
    use /= scale
    ones = np.ones((1, p))

    def solve(cost, a_ub, b_ub):
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=np.hstack([ones, [[0.0]]]), b_eq=[1.0],
                      bounds=[(0, None)] * (p + 1), method="highs")
        if res.status != 0:
            raise PlanError(f"{NAME}: the LP of weighted shares failed: {res.message}")
        return res.x
    x = solve(np.r_[np.zeros(p), 1.0], np.hstack([use, -np.ones((len(links), 1))]), np.zeros(len(links)))
    least = float(x[-1])
    x = solve(np.r_[np.zeros(p), 1.0],             # at that load: the largest share as small as it can be
              np.vstack([np.hstack([use, np.zeros((len(links), 1))]), np.hstack([np.eye(p), -np.ones((p, 1))])]),
              np.r_[np.full(len(links), least * (1 + 1e-9)), np.zeros(p)])
    weight = np.rint(x[:p] / x[:p].max() * SHARE_STEPS).astype(int)
    shares = weight // math.gcd(*weight)
    if len(set(shares.tolist())) == 1:
        return None
    shares = tuple(int(w) for w in shares)
    return shares, float((use @ np.array(shares, dtype=float)).max() / sum(shares) * scale)


def leader_shares(share, groups, pos):
    """``share`` (a weight per rank) moved onto the *leader* of every group of ``groups`` (its first
    rank in ring order, by ``pos``): the leader holds the sum of its group's weights, the others none
    (see Leaders)."""
    moved = [0] * len(share)
    for g in groups:
        moved[min(g, key=pos.get)] = sum(share[r] for r in g)
    return tuple(moved)


def _span_order(p, stages, holders, pos, chosen=None):
    """Targets ordered so that the targets a stage's ring member holds are consecutive, at every stage:
    by the position of their holder in one group of every stage, lowest stage first (on a uniform
    cluster: by rank within the host, then host within the rack, then rack). The allreduce numbers
    its chunks in this order, so each ring step sends a member's share as a few spans
    (:meth:`ScheduleBuilder.runs`) rather than a chunk per target; on uneven groups, where no order
    serves every group, as a few more."""
    reference = [holders[s][0] for s in range(1, len(stages) + 1)]
    return sorted(range(p) if chosen is None else chosen,
                  key=lambda t: tuple(pos[row[t]] for row in reference) + (pos[t],))


def hierarchical(topo, collective, *, root=0, nbytes=None):
    """BlueConnect-style per-tier reduce-scatter/allgather on ``topo`` (see the module docstring)."""
    p = topo.nranks
    check_request(NAME, collective, p, root)
    parts = rank_partitions(topo)
    order, _ = nested_order(p, parts, topo.route_bandwidth)
    stages = stage_partitions(p, parts)
    waved = len(stages) > 1          # stages to overlap: one ramped wave per chunk (see the module docstring)
    pieces = 1 if collective == "broadcast" else p
    tier_bw = {tuple(tuple(g) for g in stage_partitions(p, [t.groups])[0]): t.bandwidth
               for t in topo.tiers if len(t.groups) < p}

    pos = {r: i for i, r in enumerate(order)}
    # Operations the schedule may have: MAX_WAVE_OPS, or what the fewest a share per rank can have (one
    # wave, the fewest spans) where that is more, as it is taken then anyway (see Budget).
    budget = max(MAX_WAVE_OPS, _ops_per_wave(p, stages, collective, SPAN_PIECES[-1]))

    def chunks_per_wave(staged, balanced=False, leaders=False, shares=None):
        """The ``pieces`` :func:`wave_depth` counts in a wave of ``staged``'s stages: the smallest
        target's share of the whole."""
        share = target_shares(p, staged, balanced, shares)
        if leaders:
            share = leader_shares(share, staged[0], pos)
        held = [w for w in share if w]
        return pieces if collective != "allreduce" else -(-sum(held) // min(held))

    def build(tiers, k, lift=0, exchange=(), balanced=False, leaders=False, shares=None):
        """The schedule with the most spans (SPAN_PIECES) that keep its ``k`` waves within ``budget``, or
        with fewer waves where even the fewest spans do not. :func:`_ops_per_wave` only estimates (it
        counts too few where groups are unequal or the lead splits a run: 617040 operations for 15 waves
        on 2 GPUs x 96 hosts at 1 TiB), so the schedule built has the last word; every wave has as many
        operations, so its count per wave tells how many waves fit."""
        staged = stage_partitions(p, tiers)
        bandwidths = [None if bw is None else float(bw) for bw in (tier_bw.get(groups) for groups in staged)]
        per_wave = {}                   # spans -> operations per wave, as built
        while True:
            for spans in SPAN_PIECES:
                ops = per_wave.get(spans) or _ops_per_wave(p, staged, collective, spans, leaders)
                if k * ops > budget and spans != SPAN_PIECES[-1]:
                    continue
                sched = hierarchical_schedule(order, tiers, collective, k, root, waves=k if waved else 1,
                                              ramped=waved, lift=lift, span_pieces=spans,
                                              lag=WAVE_LAG if waved else 0, exchange=exchange, split=True,
                                              balanced=balanced, leaders=leaders, shares=shares,
                                              stage_bandwidths=bandwidths)
                if not waved or k == 1 or sched.nops <= budget:
                    return sched
                per_wave[spans] = -(-sched.nops // k)
            k, lift = wave_depth(nbytes, chunks_per_wave(staged, balanced, leaders, shares), per_wave[SPAN_PIECES[-1]],
                                 k - 1, budget=budget)

    if not waved:
        return build(parts, pipeline_depth(nbytes, pieces))

    def uneven(tiers):
        """Whether ``tiers``' groups below the top are of unequal sizes (an allreduce's equal shares
        then differ from one per rank)."""
        return collective == "allreduce" and len(set(share_weights(p, stage_partitions(p, tiers)))) > 1

    def depth(tiers, balanced=False, leaders=False, most=MAX_PIPELINE, shares=None, steep=False):
        """:func:`wave_depth` for ``tiers``' stages: its smallest chunk is the smallest target's share."""
        staged = stage_partitions(p, tiers)
        return wave_depth(nbytes, chunks_per_wave(staged, balanced, leaders, shares),
                          _ops_per_wave(p, staged, collective, SPAN_PIECES[-1], leaders), most, steep, budget)

    def depths_under(caps, ramps, tiers, **kw):
        """The distinct :func:`depth` of ``tiers`` under each of ``caps`` on each of ``ramps`` (steep or
        not), fewest waves first."""
        return sorted({depth(tiers, most=most, steep=steep, **kw) for most in caps for steep in ramps})

    def funnels(tiers, balanced, shares=None):
        """``{first stage: seconds}``: the first stages (by ring ``()``, then exchanging ``(1,)`` where its
        groups have more than two ranks) with which leaders (see Leaders) load no link of ``topo`` more
        than a share per rank does, on ``tiers``' stages, each with its busiest link's time, a bound on
        theirs whatever their waves; none where leaders by ring already do. One-chunk schedules compared
        link by link (the bytes on a link do not depend on the waves or the spans); a share per rank's once."""
        staged = stage_partitions(p, tiers)
        if collective != "allreduce" or max(len(g) for g in staged[0]) < 2:
            return {}

        def load(leaders, exchange=()):
            return load_seconds(topo, hierarchical_schedule(order, tiers, collective, span_pieces=1, exchange=exchange,
                                                            balanced=balanced, leaders=leaders,
                                                            shares=shares), nbytes)
        regular, fits = load(False), {}
        for exchange in ((), (1,)) if max(len(g) for g in staged[0]) > 2 else ((),):
            fits[exchange] = load(True, exchange)
            if fits[exchange] > regular * (1 + 1e-9):
                del fits[exchange]
                break
        return fits

    tier_sets = _tier_sets(p, parts)
    most_ops = max(_ops_per_wave(p, stage_partitions(p, tiers), collective, SPAN_PIECES[-1])
                   for tiers in tier_sets or [parts])
    ramps = (True, False)               # steep, then not (see Floors)
    depths = sorted({wave_depth(nbytes, pieces, most_ops, most, steep, budget)
                     for most in WAVE_CAPS for steep in ramps})
    attempts, kept = [], None

    def consider(tiers, k, lift, exchange=(), balanced=False, leaders=False, margin=False, shares=None):
        """Build a variant and simulate it until it provably cannot replace the one kept (with ``margin``,
        only if :data:`~ddl.algorithms.variants.MIN_VARIANT_GAIN` faster, whatever its messages); keep it
        if it does. Returns its entry in the variants tried and its schedule."""
        nonlocal kept
        sched = build(tiers, k, lift, exchange, balanced, leaders, shares)
        beat = None if kept is None else to_beat(sched.nops, kept[0], kept[2].nops, topo.message_cost, margin)
        seconds, at_least = try_variant(topo, sched, nbytes, beat)
        k, lift = sched.info["chunks_per_target"], sched.info["lift"]      # (fewer where the budget says so)
        attempts.append(tried(seconds, at_least, stages=[len(g) for g in stage_partitions(p, tiers)], waves=k,
                              lift=lift, exchange=list(exchange), wave_parts=sched.info["wave_parts"],
                              balanced=balanced, leaders=leaders, shares=None if shares is None else list(shares),
                              operations=sched.nops))
        if kept is None or replaces(seconds, sched.nops, kept[0], kept[2].nops, topo.message_cost, margin):
            kept = (seconds, tiers, sched)
        return attempts[-1], sched

    def fastest(considered):
        """The ``(seconds, key)`` least of ``considered``, ``[((entry, schedule), key)]`` from
        :func:`consider`, as full simulations would find it: a variant stopped short is run out only
        where its bound leaves it a chance of being the fastest (its entry then gets the time)."""
        known = [(entry["seconds"], key) for (entry, _), key in considered if entry["seconds"] is not None]
        stopped = sorted(((entry["at_least"], key, entry, sched) for (entry, sched), key in considered
                          if entry["seconds"] is None), key=lambda s: s[:2])
        for at_least, key, entry, sched in stopped:
            if known and at_least > min(known)[0]:
                break
            entry["seconds"] = simulate(topo, sched, nbytes).seconds
            del entry["at_least"]
            known.append((entry["seconds"], key))
        return min(known)

    def consider_leaders(tiers, balanced, caps, ramps, shares=None):
        """Leaders on ``tiers``' stages, where they load no link more (see Leaders): with the most waves
        under each of ``caps`` on each of ``ramps``, then exchanging to the leaders with the fastest, where
        its busiest link leaves it a chance (a variant whose link alone takes longer than the one kept
        cannot replace it, and the fastest by ring then need not be known)."""
        fits = funnels(tiers, balanced, shares)
        if not fits:
            return

        def led(k, lift, exchange=()):       # replacing a share per rank takes the margin (see Leaders)
            return consider(tiers, k, lift, exchange, balanced, True,
                            margin=kept is not None and not kept[2].info["leaders"], shares=shares)
        by_ring = [(led(*kl), kl) for kl in depths_under(caps, ramps, tiers, balanced=balanced, leaders=True,
                                                         shares=shares)]
        if (1,) in fits and fits[(1,)] <= kept[0] * (1 + 1e-9):     # else its busiest link alone makes it slower
            _, (k, lift) = fastest(by_ring)
            led(k, lift, (1,))

    def consider_weighted(tiers):
        """Shares weighted by :func:`weighted_shares`, exchanging directly at the top stage (as well as
        where the one kept does), with the most waves under each cap, where their busiest link is
        WEIGHTED_GAIN less loaded than the kept schedule's (see Weighted shares)."""
        info = kept[2].info
        top = len(stage_partitions(p, tiers))
        exchange = tuple(sorted(set(info["exchange_stages"]) | {top}))
        weighted = weighted_shares(topo, order, tiers, exchange)
        if weighted is None:
            return
        shares, seconds_per_byte = weighted
        if seconds_per_byte > load_seconds(topo, kept[2], 1.0) * (1 - WEIGHTED_GAIN):
            return
        for k, lift in depths_under(WAVE_CAPS, ramps, tiers, shares=shares):
            consider(tiers, k, lift, exchange, shares=shares)

    if not nbytes or depths[-1][0] * most_ops > CHOOSE_VARIANTS_OPS:      # every tier, as many waves as they allow
        balanced = uneven(parts)
        if nbytes and depth(parts, balanced, True, WAVE_CAPS[-1])[0] > 1:   # leaders where they get waves
            consider_leaders(parts, balanced, WAVE_CAPS[-1:], ramps[:1])
        if kept is None:
            return build(parts, *depth(parts, balanced, steep=True), balanced=balanced)
    else:
        for tiers in tier_sets:            # every tier, then fewer (each must earn the margin), at the fewest waves
            consider(tiers, *depths[0], margin=kept is not None)
        for k, lift in depths[1:]:         # then more waves on the stages kept
            consider(kept[1], k, lift)
        info = kept[2].info
        if max(info["stages"][0]["group_sizes"]) > 2:   # then the fastest stage exchanging directly
            consider(kept[1], info["chunks_per_target"], info["lift"], (1,))
        if uneven(kept[1]):                # then equal shares for unequal groups, as many waves as they allow
            info = kept[2].info
            consider(kept[1], *depth(kept[1], True, most=info["chunks_per_target"]),
                     tuple(info["exchange_stages"]), True)
        if collective == "allreduce":      # then shares weighted to load the busiest link least
            consider_weighted(kept[1])
        info = kept[2].info
        consider_leaders(kept[1], info["balanced"], WAVE_CAPS, ramps,          # then leaders
                         None if info["shares"] is None else tuple(info["shares"]))
    kept[2].info["variants_tried"] = attempts
    return kept[2]


def _ops_per_wave(p, stages, collective, span_pieces, leaders=False):
    """Operations one wave adds to the schedule: a send and a receive per message. An allreduce ring
    member sends its share in up to ``span_pieces`` spans per step (:func:`_span_order`), to each of
    the other members of its ring, up and back down; other collectives send a chunk per target. With
    three stages or more the waves go in parts (:func:`wave_parts`): a first-stage member then sends
    each of its ``m`` diagonals (``m`` groups below the top) in ``1/m`` of the spans, a member of a
    later stage a message per target it holds (a part has one of them). With ``leaders`` only the
    leader of each first-stage group holds targets (all of them in the first stage's rings), and only
    the leaders take part in the later stages. An estimate, not short on equal groups without the lead: a
    rank of a small group holds targets of several places and joins as many rings (a one-GPU host among
    hosts of eight: 1.4 times the count with 4 spans), and the lead sends a member's first block apart
    from the rest of its run, which it may cut in two; ``build`` (in :func:`hierarchical`) counts the
    schedule it builds."""
    if collective != "allreduce":
        return 2 * (p - 1) * (1 if collective == "broadcast" else p)
    m = len(stages[-2]) if len(stages) > 2 else 0
    total, below = 0, [(r,) for r in range(p)]
    for s, groups in enumerate(stages):
        for group in groups:
            kids = sum(1 for g in below if g[0] in group)
            held = -(-p // len(group))
            members = len(group)
            if leaders:         # one member of a first-stage ring holds every target; later rings join leaders
                held, members = (len(stages[0]), 1) if s == 0 else (held, sum(g[0] in group for g in stages[0]))
            if not m:          # one part per wave: the member's run in up to span_pieces spans
                messages = min(span_pieces, held)
            elif s:            # a later stage of a part: a message per target held
                messages = held
            else:              # the first stage: each of the m diagonals in 1/m of the spans
                messages = min(m * -(-span_pieces // m), held)
            total += members * (kids - 1) * messages
        below = groups
    return 4 * total


def _tier_sets(p, parts):
    """The tiers to run stages on: all of ``parts``, then all but one (each tier left out in turn),
    where that leaves a stage below the top one; each set of stages once."""
    seen, sets = set(), []
    for size in (len(parts), len(parts) - 1):
        for subset in combinations(parts, size):
            stages = tuple(stage_partitions(p, subset))
            if len(stages) > 1 and stages not in seen:
                seen.add(stages)
                sets.append(list(subset))
    return sets
