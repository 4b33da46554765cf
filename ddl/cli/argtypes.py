"""Argument types for argparse, shared by the example and benchmark scripts (``examples/``, ``benchmarks/``).

Each type reads one option's text and turns a mistake into argparse's one-line error
(``prog: error: argument --x: why``, exit status 2) instead of a traceback, in the same words
wherever the option appears. A script that every MPI rank runs reads the same arguments on every
rank, so :class:`MPIParser` and :func:`fail` report a mistake once, from rank 0, and exit with
status 2 on every rank. They import mpi4py only when they need the rank, so importing this module
does not initialise MPI.
"""
import argparse
import functools
import math
import os
import sys
import time

import numpy as np

from ..errors import Error
from ..units import parse_size


def _world_rank():
    from mpi4py import MPI
    return MPI.COMM_WORLD.rank


EXIT_WAIT = 10.0      # seconds a rank leaving on a shared mistake waits for the others at most


class MPIParser(argparse.ArgumentParser):
    """Every rank reads the same arguments: a mistake in them, or ``--help``, is said once, by rank 0."""

    def error(self, message):
        if _world_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        _exit_together(2)

    def print_help(self, file=None):
        if _world_rank() == 0:
            super().print_help(file)

    def exit(self, status=0, message=None):
        if message and _world_rank() == 0:
            print(message, end="", file=sys.stderr, flush=True)
        sys.stdout.flush()
        _exit_together(status)


def fail(message):
    """A mistake every rank finds alike (a topology file that is missing or has the wrong number of
    ranks): one line on stderr from rank 0, exit status 2 on every rank, no traceback."""
    if _world_rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    _exit_together(2)


def _exit_together(status):
    """Leave once every rank is here, so once rank 0 has said why. Under ``python -m mpi4py`` the first
    rank to exit with a non-zero status aborts the job, which could end rank 0 before its message is
    out. Bounded: a rank that never comes is waited for ``EXIT_WAIT`` seconds."""
    from mpi4py import MPI
    request = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + EXIT_WAIT
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(0.002)
    raise SystemExit(status)


def reported(parse):
    """An argparse type from a plain parser: its ValueError or ddl.Error becomes argparse's error."""
    @functools.wraps(parse)
    def parse_reported(text):
        try:
            return parse(text)
        except (ValueError, Error) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse_reported


@reported
def size(text):
    """A size in bytes, or with a unit (64KiB, 4MiB)."""
    return parse_size(text)


def at_least(low):
    """An argparse type: an integer >= ``low``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"at least {low}, got {value}")
        return value
    return parse


def positive_float(text):
    """A finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a positive number, got {text}")
    return value


def comma_separated(text):
    """The entries of a comma-separated list, stripped of spaces; [] for blank text. An empty entry is a
    ValueError (``0,,1`` or ``mpi,`` is a typo, not a list that means less)."""
    items = [item.strip() for item in str(text).split(",")]
    if items == [""]:
        return []
    if "" in items:
        raise ValueError(f"an empty entry in {text!r}: separate the entries by single commas")
    return items


def list_of(parse, unique=True):
    """An argparse type: comma-separated values, each stripped of spaces and read by ``parse`` (a plain
    parser or an argparse type); an empty entry is refused (``0,,1`` is a typo, not two GPUs), and so is
    a value given twice (``--gpus 0,0`` would otherwise lose a GPU without a word) unless the list is
    not a set (``unique=False``: iterations per size, ``1000,1000``)."""
    parse = reported(parse)

    def parse_all(text):
        items = reported(comma_separated)(text)
        if not items:
            raise argparse.ArgumentTypeError("an empty list: name at least one")
        values = [parse(item) for item in items]
        twice = next((v for i, v in enumerate(values) if v in values[:i]), None) if unique else None
        if twice is not None:
            raise argparse.ArgumentTypeError(f"{twice} is listed twice in {text!r}")
        return values
    return parse_all


def numeric_dtype(text):
    """A numpy dtype of numbers (bool, integer, float or complex)."""
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"not a numpy dtype: {text!r}") from None
    if dtype.kind not in "biufc":
        raise argparse.ArgumentTypeError(f"not a numeric dtype: {text!r}")
    return dtype


@reported
def gpu_dtype(text):
    """A dtype ddl's GPU buffers hold (bfloat16 included); naming one needs no CuPy."""
    from ..gpu.buffers import device_dtype
    return device_dtype(text)
