"""Emulate a topology on one Linux machine: namespaces as hosts, bridges as switches, tbf as links.

``Cluster`` builds and tears down (:mod:`.netns`), ``launch`` runs MPI programs on it with ranks placed
as the topology says, ``selfcheck`` proves the links run at their shaped rates.
"""
from .netns import Cluster, NetworkPlan, check_can_emulate, plan_network  # noqa: F401

