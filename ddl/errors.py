"""Exceptions raised by ddl.

Every error a user can cause derives from :class:`Error`, so a training script (or the CLI) can catch
one type and print a message without a traceback.
"""


class Error(Exception):
    """Base class of every error ddl raises on purpose."""


class TopologyError(Error, ValueError):
    """A topology file or object is malformed.

    The message names the file, the entry (``links[3]``, ``ranks[2]``), what is wrong and how to fix it.
    """

    def __init__(self, message, source=None, entry=None):
        self.source = source
        self.entry = entry
        where = ": ".join(str(p) for p in (source, entry) if p)
        super().__init__(f"{where}: {message}" if where else message)


class PlanError(Error, ValueError):
    """A collective cannot be planned (unknown algorithm, algorithm not applicable, ...)."""


class ScheduleError(Error):
    """A schedule is malformed or fails symbolic verification; the message names the broken chunk."""


class MismatchError(Error):
    """Ranks called a collective with different arguments (raised on every rank)."""


class StallError(Error):
    """A collective waited on its peers for longer than the stall limit, or a peer gave up on it (or on
    an earlier one) with an error of its own: it cannot complete."""
