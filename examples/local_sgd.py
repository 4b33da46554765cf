"""Local SGD / model averaging (SparkNet-style) with ddl.

    mpiexec -n 4 python -m mpi4py examples/local_sgd.py [--rounds 20] [--tau 5]

Each rank trains its own replica for ``tau`` local SGD steps on its own data shard (no communication),
then the replicas are averaged with one fused collective (``comm.grouped_allreduce(params,
op=ddl.AVG)``): ``tau`` times fewer collectives than synchronous data parallelism (SparkNet, Moritz
et al., ICLR 2016; "local SGD"). The script prints the global loss after some averaging rounds (about
five, and the last) and checks that it fell below half the initial loss (and is not rising at the end), and
that the replicas are bitwise identical after every average; a failed check is named.
"""
import hashlib
import os
import sys

from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, positive_float
from ddl.units import counted

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mlp import BATCH, communicator, init_params, loss_and_grads, synthetic_data  # noqa: E402


def main():
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=at_least(1), default=20, help="averaging rounds (default 20)")
    ap.add_argument("--tau", type=at_least(1), default=5, help="local steps between averaging (default 5)")
    ap.add_argument("--lr", type=positive_float, default=0.1, help="learning rate (default 0.1)")
    ap.add_argument("--topology", default=None, help="topology file (default: $DDL_TOPOLOGY, else one flat switch)")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    comm = communicator(args.topology)
    rank, size = comm.rank, comm.size
    x, y = synthetic_data()
    shard = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    xs, ys = x[shard], y[shard]

    params = init_params()
    initial, _ = loss_and_grads(params, x, y)
    losses = []
    identical = True
    for rnd in range(args.rounds):
        for _ in range(args.tau):
            _, grads = loss_and_grads(params, xs, ys)
            params = [p - args.lr * g for p, g in zip(params, grads)]
        params = comm.grouped_allreduce(params, op=ddl.AVG)         # model averaging
        digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).digest()
        identical &= len(set(world.allgather(digest))) == 1
        loss, _ = loss_and_grads(params, x, y)                       # the averaged model on all data
        losses.append(loss)
        if rank == 0 and (rnd % max(1, args.rounds // 5) == 0 or rnd == args.rounds - 1):
            print(f"round {rnd:3d} ({(rnd + 1) * args.tau:4d} local steps): loss {loss:.6f}")
    failed = [why for why, bad in (
        ("the replicas differed after an average", not identical),
        (f"the loss did not fall below half its start in {counted(args.rounds * args.tau, 'local step')} "
         f"(more --rounds or --tau, or another --lr?)", not losses[-1] < 0.5 * initial),
        ("the last loss is more than 5% above the least (diverging: a smaller --lr?)",
         not losses[-1] <= min(losses) * 1.05)) if bad]
    if rank == 0:
        print(f"{counted(args.rounds, 'averaging round')} of {counted(args.tau, 'local step')} on "
              f"{counted(size, 'rank')}: loss {initial:.4f} -> {losses[-1]:.4f}; replicas identical after every "
              f"average: {identical}")
        print("LOCAL_SGD OK" if not failed else f"LOCAL_SGD FAILED: {'; '.join(failed)}")
    comm.Free()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
