"""Ranks pinned as a launcher pins them, each to a CPU of its own or all to one: is the node oversubscribed?"""
import os
import sys

from mpi4py import MPI

import ddl

world = MPI.COMM_WORLD
cpus = sorted(set().union(*world.allgather(os.sched_getaffinity(0))))   # the launcher may have pinned already
os.sched_setaffinity(0, {cpus[world.rank % len(cpus)]} if sys.argv[1] == "own" else {cpus[0]})
with ddl.Communicator(world) as comm:
    print(f"RESULT rank {world.rank} on {sorted(os.sched_getaffinity(0))}: oversubscribed {comm.oversubscribed}",
          flush=True)
