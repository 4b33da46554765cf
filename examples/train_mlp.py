"""Data-parallel SGD of a small numpy MLP with ddl: the loss curve matches single-process training.

    mpiexec -n 4 python -m mpi4py examples/train_mlp.py [--steps 50] [--topology FILE]

Every rank holds a full replica of the model and an equal shard of the (synthetic) batch, computes the
gradient of the mean loss over its shard, and averages the gradients with ONE fused collective
(``comm.grouped_allreduce(grads, op=ddl.AVG)``): the mean of equal-size shard means is the full-batch
mean, so every step equals a step of single-process training on the whole batch, up to float
rounding. Each rank also trains the single-process reference locally and the script checks the two
loss curves agree to 1e-6 (relative), that the replicas stay bitwise identical, and that the loss fell.
"""
import hashlib

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, fail, positive_float
from ddl.units import counted

D_IN, HIDDEN, BATCH = 16, 32, 240  # 240 splits evenly over 1, 2, 3, 4, 5, 6, 8 ranks


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN), np.zeros(HIDDEN),
            rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN), np.zeros(1)]


def synthetic_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, D_IN))
    w = rng.standard_normal((D_IN, 1))
    y = np.tanh(x @ w) + 0.1 * rng.standard_normal((BATCH, 1))
    return x, y


def loss_and_grads(params, x, y):
    """Mean squared error of a tanh MLP and its gradients (mean over the rows of x)."""
    w1, b1, w2, b2 = params
    h = np.tanh(x @ w1 + b1)
    pred = h @ w2 + b2
    err = pred - y
    n = x.shape[0]
    loss = float(np.mean(err ** 2))
    dpred = 2 * err / n
    gw2 = h.T @ dpred
    gb2 = dpred.sum(axis=0)
    dh = (dpred @ w2.T) * (1 - h ** 2)
    gw1 = x.T @ dh
    gb1 = dh.sum(axis=0)
    return loss, [gw1, gb1, gw2, gb2]


def communicator(topology):
    """``ddl.Communicator`` on COMM_WORLD; a bad topology (no such file, wrong rank count) is one line.

    Without ``--topology`` the argument is left out, so that ``$DDL_TOPOLOGY`` (which ``ddl emulate
    run`` sets) names the file; an explicit ``topology=None`` would mean one flat switch.
    """
    given = {"topology": topology} if topology else {}
    try:
        return ddl.Communicator(MPI.COMM_WORLD, **given)
    except ddl.Error as exc:
        fail(exc)


def main():
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=at_least(2), default=50,
                    help="training steps, at least 2: the check compares the first and last loss (default 50)")
    ap.add_argument("--lr", type=positive_float, default=0.1, help="learning rate (default 0.1)")
    ap.add_argument("--topology", default=None, help="topology file (default: $DDL_TOPOLOGY, else one flat switch)")
    args = ap.parse_args()

    comm = communicator(args.topology)
    rank, size = comm.rank, comm.size
    if BATCH % size:
        comm.Free()
        fail(f"the batch of {BATCH} does not split evenly over {size} ranks")
    x, y = synthetic_data()
    shard = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    xs, ys = x[shard], y[shard]

    params = init_params()
    reference = init_params()
    curve, ref_curve = [], []
    for step in range(args.steps):
        local_loss, grads = loss_and_grads(params, xs, ys)
        grads = comm.grouped_allreduce(grads, op=ddl.AVG)         # one fused collective
        curve.append(comm.allreduce(np.array(local_loss), op=ddl.AVG).item())
        params = [p - args.lr * g for p, g in zip(params, grads)]
        ref_loss, ref_grads = loss_and_grads(reference, x, y)      # single process, whole batch
        ref_curve.append(ref_loss)
        reference = [p - args.lr * g for p, g in zip(reference, ref_grads)]

    curve, ref_curve = np.array(curve), np.array(ref_curve)
    rel = float(np.max(np.abs(curve - ref_curve) / np.abs(ref_curve)))
    digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).hexdigest()
    digests = MPI.COMM_WORLD.gather(digest, root=0)
    if rank == 0:
        for s in sorted({0, args.steps // 4, args.steps // 2, args.steps - 1}):
            print(f"step {s:4d}  loss {curve[s]:.8f}  single-process {ref_curve[s]:.8f}")
        same = len(set(digests)) == 1
        print(f"max relative difference of the loss curves over {args.steps} steps on {counted(size, 'rank')}: "
              f"{rel:.2e}")
        print(f"replicas bitwise identical: {same}")
        failed = [why for why, bad in (
            ("the loss curves differ by 1e-6 or more", not rel < 1e-6), ("the replicas differ", not same),
            (f"the loss did not fall ({curve[0]:.4g} -> {curve[-1]:.4g}): a smaller --lr?", not curve[-1] < curve[0]))
            if bad]
        ok = not failed
        print("TRAIN_MLP OK" if ok else f"TRAIN_MLP FAILED: {'; '.join(failed)}")
    else:
        ok = True
    ok = MPI.COMM_WORLD.bcast(ok, root=0)
    comm.Free()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
