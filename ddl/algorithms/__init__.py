"""Collective algorithms: each turns a Topology and a collective into a verified-able Schedule.

``ALGORITHMS`` maps a name to ``fn(topo, collective, *, root=0, nbytes=None) -> Schedule``; ``fn``
raises :class:`ddl.PlanError` when it does not apply. ``nbytes`` only chooses the pipelining depth.
Each family also offers a topology-free builder on a rank order (``ring_schedule``,
``halving_doubling_schedule``, ``recursive_doubling_schedule``, ``dbt_schedule``,
``hierarchical_schedule``) for tests and tools.

* ``ring`` -- topology-aware ring (NCCL-style order), all four collectives;
* ``ring-channels`` -- NCCL's channels: several rings at once (other directions, other ways out of
  each host), rates from an LP; all four collectives;
* ``ring-packing`` -- the rings that carry the most on a small fabric, chosen among all Hamiltonian
  cycles (column generation), each hop routed over every path; all four collectives, up to 12 ranks;
* ``halving-doubling`` -- Rabenseifner; allreduce, reduce_scatter, allgather;
* ``recursive-doubling`` -- whole-vector swaps, ``log2 p`` rounds for latency-bound sizes; allreduce;
* ``double-binary-tree`` -- NCCL's two complementary trees; allreduce, broadcast;
* ``hierarchical`` -- BlueConnect / Horovod per-tier rings; all four collectives;
* ``tiered-exchange`` -- recursive doubling in which a host takes in the sums of up to one host
  per rank at once, for latency-bound sizes on tiered clusters; allreduce;
* ``tree-packing`` -- ForestColl's optimal packing of spanning trees (Blink-style few, shallow trees);
  all four collectives, up to 64 ranks;
* ``direct-link-trees`` -- tree-packing over the links that join two ranks directly (Blink's NVLink-only
  trees), where the ranks are joined by them and the fabric also has shared paths; up to 64 ranks;
* ``reduce-broadcast-trees`` -- Blink's packing of spanning trees, each reducing to its centre and
  broadcasting back (both directions of every link at work); allreduce, up to 64 ranks;
* ``multicommodity-flow`` -- the best base schedule with its transfers routed by a min-cost
  multi-commodity flow LP over every physical path (IBM DDL, TE-CCL);
* ``delegated`` -- hosts behind slow links reduce at home, send their sum out in order through one
  relay each and take the result back, while the fast hosts plan their own allreduce; allreduce.

Simpler algorithms are listed first: the planner breaks ties in favour of the earlier one.
"""
from .delegated import delegated, delegated_schedule
from .double_binary_tree import dbt_schedule, double_binary_tree
from .halving_doubling import halving_doubling, halving_doubling_schedule
from .hierarchical import hierarchical, hierarchical_schedule
from .multicommodity_flow import multicommodity_flow, repeats_a_base
from .recursive_doubling import recursive_doubling, recursive_doubling_schedule
from .reduce_broadcast_trees import reduce_broadcast_trees
from .ring import ring, ring_order, ring_schedule
from .ring_channels import ring_channels
from .ring_packing import ring_packing
from .tiered_exchange import repeats_doubling, tiered_exchange, tiered_exchange_schedule
from .tree_packing import direct_link_trees, tree_packing

ALGORITHMS = {
    "ring": ring,
    "ring-channels": ring_channels,
    "ring-packing": ring_packing,
    "halving-doubling": halving_doubling,
    "recursive-doubling": recursive_doubling,
    "double-binary-tree": double_binary_tree,
    "hierarchical": hierarchical,
    "tiered-exchange": tiered_exchange,
    "tree-packing": tree_packing,
    "direct-link-trees": direct_link_trees,
    "reduce-broadcast-trees": reduce_broadcast_trees,
    "multicommodity-flow": multicommodity_flow,
    "delegated": delegated,
}

# ``auto`` need not build an algorithm whose schedule can only equal another candidate's: these say why
# (a reason) on a given topology, or None. An explicit request still builds it.
REDUNDANT = {
    "multicommodity-flow": repeats_a_base,
    "tiered-exchange": repeats_doubling,
}

# Algorithms that take the time the planner's fastest candidate so far takes (``beat=seconds``) and
# stop simulating their own variants once those provably cannot win: the planner builds them after
# the others have been simulated, so that they know it (see Planner._plan).
TAKES_BEAT = frozenset({"tree-packing", "direct-link-trees"})
__all__ = ["ALGORITHMS", "REDUNDANT", "TAKES_BEAT", "delegated", "delegated_schedule", "ring", "ring_channels", "ring_packing", "halving_doubling",
           "double_binary_tree", "hierarchical", "multicommodity_flow", "tree_packing", "direct_link_trees",
           "reduce_broadcast_trees", "recursive_doubling", "ring_order", "ring_schedule",
           "halving_doubling_schedule", "recursive_doubling_schedule", "dbt_schedule", "hierarchical_schedule",
           "tiered_exchange", "tiered_exchange_schedule"]
