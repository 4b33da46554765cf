"""A rank that raises in the middle of training must take the job down, not hang the others.

    mpiexec -n N python -m mpi4py tests/mpi_cases/abort.py

Rank 1 raises after a few steps while the others are inside Allreduce. With ``-m mpi4py`` the uncaught
exception calls MPI_Abort: mpiexec exits non-zero and its output names the failing rank.
"""
import numpy as np
from mpi4py import MPI

import ddl

import sys

comm = ddl.Communicator(MPI.COMM_WORLD, stall_warning=1, stall_timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 120)
buf = np.ones(1000, np.float32)
for step in range(10):
    if step == 3 and comm.rank == 1:
        raise RuntimeError(f"simulated failure on rank {comm.rank} at step {step}")
    comm.Allreduce(ddl.IN_PLACE, buf, op=ddl.AVG)
print(f"rank {comm.rank} finished", flush=True)
