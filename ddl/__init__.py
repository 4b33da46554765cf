"""ddl: topology-aware collective communication for distributed deep learning.

Data flows one way: a topology file becomes a :class:`Topology`; the planner turns it and a collective
into a :class:`Schedule`; the verifier proves the schedule; an executor runs it on buffers.
"""
__version__ = "0.1.0"

from .errors import Error, MismatchError, PlanError, ScheduleError, StallError, TopologyError  # noqa: F401
