"""Recursive-doubling allreduce: the fewest rounds, for latency-bound (small) messages.

Source: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective communication operations
in MPICH", IJHPCA 19(1), 2005, sec. 4.4 (recursive doubling for short messages).

``m = 2**floor(log2 p)`` ranks take part; the ``r = p - m`` extra ranks fold in first as in
halving-doubling (the odd rank of each of the first ``r`` pairs sends its vector to the even one, which
reduces it, and receives the result at the end). Then, for each bit ``x`` of ``m``, position ``j``
swaps its *whole* vector with position ``j ^ x`` and both reduce: ``log2 m`` rounds instead of the
``2 log2 m`` of halving-doubling, at the price of moving the whole vector every round, so it only wins
while latency dominates. Both partners of a round compute ``a op b`` from the same two operands, and the
reductions ddl offers are commutative, so every rank ends with the same expression (the verifier checks
this): results stay bitwise identical.

Topology: positions follow the topology-aware ring order and bits run from the lowest, so the first
rounds stay inside the fastest tier.

Collectives: allreduce only (recursive doubling of allgather is halving-doubling's second half).
Chunks: the buffer is cut into ``k = pipeline_depth(nbytes)`` chunks, so a larger vector pipelines
through the rounds.
"""
from ..schedule import ScheduleBuilder
from .halving_doubling import fold
from .ring import check_request, nested_order, pipeline_depth, rank_partitions

NAME = "recursive-doubling"
SUPPORTED = ("allreduce",)


def recursive_doubling_schedule(order, collective="allreduce", k=1, algorithm=NAME, **info):
    """Recursive-doubling ``collective`` with positions ``order`` (a permutation of ``range(p)``)."""
    order = [int(r) for r in order]
    p = len(order)
    check_request(algorithm, collective, p, 0, SUPPORTED)
    b = ScheduleBuilder(collective, p, (1,) * k, algorithm=algorithm)
    active, folded, bits = doubling(b, order, range(k))
    return b.build(order=order, active=active, folded_pairs=[[o, e] for e, o in folded.items()],
                   doubling_bits=bits, **info)


def doubling(b, order, chunks):
    """Append to builder ``b`` a recursive-doubling allreduce of ``chunks`` among the ranks ``order``
    (positions); returns ``(active, folded, bits)``. Every rank ends with the same expression, a
    function of the positions alone."""
    active, folded = fold(order)        # even -> odd of each folded pair
    m = len(active)
    for even, odd in folded.items():
        for c in chunks:
            b.transfer(odd, even, c, reduce=True)
    bits = [1 << i for i in range(m.bit_length() - 1)]
    for x in bits:
        for j in range(m):
            if j < j ^ x:
                for c in chunks:
                    b.exchange(active[j], active[j ^ x], c)
    for even, odd in folded.items():
        for c in chunks:
            b.transfer(even, odd, c)
    return active, folded, bits


def recursive_doubling(topo, collective, *, root=0, nbytes=None):
    """Recursive doubling on the topology-aware ring order (see the module docstring)."""
    check_request(NAME, collective, topo.nranks, root, SUPPORTED)
    order, _ = nested_order(topo.nranks, rank_partitions(topo), topo.route_bandwidth)
    return recursive_doubling_schedule(order, collective, pipeline_depth(nbytes))
