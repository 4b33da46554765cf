"""ddl: topology-aware collective communication for distributed deep learning.

Data flows one way: a topology file becomes a :class:`Topology`; the planner turns it and a collective
into a :class:`Schedule`; the verifier proves the schedule; an executor runs it on buffers.
"""
__version__ = "0.1.0"

from .errors import Error, MismatchError, PlanError, ScheduleError, StallError, TopologyError  # noqa: F401

# ---- MPI execution API (ddl.communicator / ddl.ops / ddl.buffers) ------------------------------------
# Importing ddl never imports mpi4py: ops and buffers need numpy only, and the Communicator class is
# loaded on first use (mpi4py is imported when one is constructed).
from .buffers import IN_PLACE  # noqa: E402,F401
from .ops import AVG, BAND, BOR, BXOR, LAND, LOR, LXOR, MAX, MIN, PROD, SUM  # noqa: E402,F401


def __getattr__(name):
    if name in ("Communicator", "Request"):
        from . import communicator
        return getattr(communicator, name)
    if name == "Topology":           # loaded on first use too (networkx is a heavy import)
        from .topology import Topology
        return Topology
    raise AttributeError(f"module 'ddl' has no attribute {name!r}")
