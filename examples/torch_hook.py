"""Data-parallel PyTorch training with ddl gradient hooks (Horovod's DistributedOptimizer pattern).

    mpiexec -n 4 python -m mpi4py examples/torch_hook.py [--steps 30] [--device cuda] [--topology FILE]

A hook on every parameter starts a nonblocking AVG allreduce of its gradient as soon as backward has
accumulated it, so communication overlaps with the rest of backward; before the optimizer step the
script waits for all of them. CPU tensors share memory with numpy (``tensor.numpy()``), so no copy is
needed to hand a gradient to ddl (``comm.iallreduce``). With ``--device cuda`` the model lives on the
rank's GPU and each gradient is averaged in place on the device (``comm.Iallreduce(ddl.IN_PLACE, grad)``
on torch's current stream): NCCL with a GPU per rank, else CUDA-aware MPI or host staging
(``comm.last_path`` says which, and the script prints it).

Needs PyTorch; without it the script exits with a message saying so.
"""
try:
    import torch
except ImportError:           # said after the arguments are read: --help works without it
    torch = None

import os
import sys

import numpy as np
from mpi4py import MPI

import ddl
from ddl.cli.argtypes import MPIParser, at_least, fail

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mlp import communicator  # noqa: E402


class GradientAverager:
    """Registers hooks that average every parameter's .grad across ranks with ddl."""

    def __init__(self, comm, model, on_device=False):
        self.comm = comm
        self.on_device = on_device
        self.path = "host"
        self.pending = []
        for param in model.parameters():
            if param.requires_grad:
                if hasattr(param, "register_post_accumulate_grad_hook"):   # torch >= 2.1
                    param.register_post_accumulate_grad_hook(self._hook)
                else:
                    param.register_hook(lambda grad, p=param: self._grad_hook(p, grad))

    def _hook(self, param):
        grad = param.grad.detach()
        if self.on_device:   # in place, ordered after backward's work on torch's current stream
            stream = torch.cuda.current_stream()
            self.pending.append((None, self.comm.Iallreduce(ddl.IN_PLACE, grad, op=ddl.AVG, stream=stream)))
            return
        self.pending.append((param, self.comm.iallreduce(grad.cpu().numpy(), op=ddl.AVG)))

    def _grad_hook(self, param, grad):
        self.pending.append((param, self.comm.iallreduce(grad.detach().cpu().numpy(), op=ddl.AVG)))
        return grad

    def synchronize(self):
        """Wait for every gradient allreduce of this step and install the averages."""
        for param, req in self.pending:
            if param is None:
                req.Wait()
                self.path = self.comm.last_path     # where the gradients went (the loss goes by host)
                continue
            avg = torch.from_numpy(req.wait())
            param.grad.copy_(avg.to(param.grad.device))
        self.pending.clear()


def main():
    ap = MPIParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=at_least(1), default=30, help="training steps (default 30)")
    ap.add_argument("--topology", default=None, help="topology file (default: $DDL_TOPOLOGY, else one flat switch)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and its gradients live (default cpu; cuda: GPU node-local rank %% GPUs)")
    args = ap.parse_args()
    if torch is None:
        fail("needs PyTorch (pip install torch); it is not installed, nothing to run")
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda: torch sees no CUDA device")
        from ddl.gpu.executor import select_device
        device = torch.device("cuda", select_device(MPI.COMM_WORLD))  # CuPy's device and torch's agree
        torch.cuda.set_device(device)
    comm = communicator(args.topology)        # a file for another rank count, a bad $DDL_CHECK: said once

    def make_model():
        torch.manual_seed(0)                   # same initial model everywhere
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 1)).double().to(device)

    model, reference = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    averager = GradientAverager(comm, model, on_device=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(240, 16, generator=gen, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(16, 1, generator=gen, dtype=torch.float64))
    x, y = x.to(device), y.to(device)
    if 240 % comm.size:
        comm.Free()
        fail(f"the batch of 240 does not split evenly over {comm.size} ranks")
    shard = slice(comm.rank * 240 // comm.size, (comm.rank + 1) * 240 // comm.size)
    worst = 0.0
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        loss.backward()                        # hooks start the gradient allreduces
        averager.synchronize()
        opt.step()
        global_loss = comm.allreduce(np.array(loss.item()), op=ddl.AVG).item()
        ref_opt.zero_grad()                    # single process, whole batch
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        worst = max(worst, abs(global_loss - ref_loss.item()) / ref_loss.item())
        if comm.rank == 0 and step % 10 == 0:
            print(f"step {step:3d} loss {global_loss:.8f}  single-process {ref_loss.item():.8f}")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
    same = len(set(MPI.COMM_WORLD.allgather(flat.tobytes()))) == 1
    if comm.rank == 0:
        if device.type == "cuda":
            print(f"gradients averaged on the GPU, path: {averager.path}")
        print(f"max relative difference of the loss curves: {worst:.2e}; replicas identical: {same}")
        print("TORCH_HOOK OK" if same and worst < 1e-6 else "TORCH_HOOK MISMATCH")
    comm.Free()
    if not (same and worst < 1e-6):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
