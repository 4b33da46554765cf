"""Choosing among variants of one algorithm (more waves, a deeper pipeline) by simulating them.

The simulator charges nothing per message unless the topology file gives a ``message_cost``, yet every
message costs a real executor time: on the emulated one-switch cluster (64 MiB, links at a fifth)
sixteen hierarchical waves predicted 0.25% faster than eight ran 7% slower (544-558 ms against
507-515 ms, two paired runs). So a variant that sends more messages replaces the one kept only where
it is predicted :data:`MIN_VARIANT_GAIN` faster; one with no more messages wherever it is faster, as
is any variant where the messages are charged. Only schedules of up to :data:`CHOOSE_VARIANTS_OPS`
operations (about a second of simulation each) are worth the plan time of trying another.

A variant is simulated only until it provably cannot replace the one kept (:func:`try_variant`): its
simulation gets the time it has to beat as a ceiling and stops once the simulated time plus the bytes
its busiest links have yet to carry exceed it (:func:`ddl.simulate.simulate`). The choice is the one
full simulations give, since a variant stopped so is at least that slow; only what it is not asked to
tell, how much slower, is left unknown (``at_least`` in the variants tried).
"""
from ..simulate import Outpaced, simulate

# A variant with more operations than the one kept must be predicted this much faster ...
MIN_VARIANT_GAIN = 0.01
# ... and variants are simulated only where the largest has at most this many operations.
CHOOSE_VARIANTS_OPS = 200_000


def variant_gain(ops, kept_ops, message_cost=0.0):
    """How much faster (relative) a variant of ``ops`` operations must be predicted than the one kept
    so far, of ``kept_ops``: :data:`MIN_VARIANT_GAIN` if it sends more messages and the topology gives
    no ``message_cost`` (the simulator then charges nothing for them), else any gain beyond rounding."""
    return MIN_VARIANT_GAIN if ops > kept_ops and not message_cost else 1e-9


def to_beat(ops, kept_seconds, kept_ops, message_cost=0.0, margin=False):
    """The time a variant of ``ops`` operations must be predicted under to replace the one kept, of
    ``kept_ops`` predicted at ``kept_seconds``; ``margin``: :data:`MIN_VARIANT_GAIN` under it, whatever
    its messages (a choice that narrows what is tried next must earn it)."""
    gain = MIN_VARIANT_GAIN if margin else variant_gain(ops, kept_ops, message_cost)
    return kept_seconds * (1 - gain)


def replaces(seconds, ops, kept_seconds, kept_ops, message_cost=0.0, margin=False):
    """Whether a variant predicted at ``seconds`` (None: stopped, see :func:`try_variant`) with ``ops``
    operations replaces the one kept (see :func:`to_beat`)."""
    return seconds is not None and seconds < to_beat(ops, kept_seconds, kept_ops, message_cost, margin)


def try_variant(topo, sched, nbytes, beat=None):
    """``(seconds, at_least)``: the predicted time of ``sched`` and None, or, where its simulation
    stopped because it provably cannot come in under ``beat`` seconds, None and the bound that proved
    it. ``beat``: seconds, or a function returning them, which may fall while the simulation runs (the
    fastest time of a plan's candidates so far); without it the variant is simulated to its end."""
    ceiling = None if beat is None else beat if callable(beat) else (lambda: beat)
    try:
        return simulate(topo, sched, nbytes, ceiling).seconds, None
    except Outpaced as stopped:
        return None, stopped.at_least


def tried(seconds, at_least, **fields):
    """An entry of a schedule's list of variants tried: ``fields``, ``seconds`` (None where the
    simulation stopped) and, then, ``at_least``."""
    return {**fields, "seconds": seconds, **({} if seconds is not None else {"at_least": at_least})}
