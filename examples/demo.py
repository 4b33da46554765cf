"""The main demo (`make demo`): from a topology file to a verified, planned allreduce running under mpiexec.

1. validate every shipped topology; 2. summarise and draw the two-rack cluster; 3. plan an allreduce on
it and compare with the classic algorithms across the zoo; 4. run the planned allreduce on 8 MPI ranks
on this machine and check the result.
"""
import argparse
import subprocess
import sys
from pathlib import Path

from ddl import Error
from ddl.launcher import local_command

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "topologies" / "emulated-2rack-interleaved.yaml"
OUT = ROOT / "demo-out"


def step(title, *argv):
    print(f"\n=== {title}\n$ {' '.join(str(a) for a in argv)}", flush=True)
    subprocess.run([str(a) for a in argv], check=True, cwd=ROOT)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)   # --help; no options
    ddl = [sys.executable, "-m", "ddl"]
    OUT.mkdir(exist_ok=True)
    zoo = sorted((ROOT / "topologies").glob("*.yaml"))
    step("1. validate the zoo", *ddl, "topo", "validate", *zoo)
    step("2. what ddl sees in a two-rack cluster", *ddl, "topo", "show", TOPOLOGY)
    step("   drawn", *ddl, "topo", "draw", TOPOLOGY, "-o", OUT / "emulated-2rack-interleaved.png")
    step("3. plan a 64 MiB allreduce and explain the choice", *ddl, "plan", TOPOLOGY, "--bytes", "64MiB")
    step("   the planner against ring / halving-doubling / double binary tree",
         *ddl, "plan", "--compare", "--bytes", "256MiB",
         *(ROOT / "topologies" / f for f in ("dgx1-v100.yaml", "fat-tree-4x4-r4-interleaved.yaml",
                                              "hetero-cluster.yaml", "emulated-2rack-interleaved.yaml")))
    step("4. run it: 8 MPI ranks on this machine", *local_command(8), sys.executable, "-m", "mpi4py",
         ROOT / "examples" / "allreduce_hello.py", TOPOLOGY)
    print(f"\ndemo done; pictures in {OUT.relative_to(ROOT)}/")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        sys.exit(f"demo step failed with exit status {exc.returncode}")
    except (OSError, Error) as exc:     # e.g. no mpiexec: the mpich wheel is not installed
        sys.exit(f"demo step could not start: {exc}")
