"""How planning time grows with the cluster: auto's full plan (every algorithm built, verified and
simulated) of a 256 MiB allreduce on three-tier clusters of 4 GPUs x 16 hosts x R racks.

    python benchmarks/bench_plan_scale.py [--racks 3,4,8,16] [--bytes 256MiB] [--workers N]

No plan cache is used, so every row is a cold plan. Prints ranks, seconds, the choice, its size, and
its predicted time over the lower bound (the clusters are built like the zoo's 192-rank one).
"""
import argparse
import os
import time

from ddl.cli.argtypes import at_least, list_of, size
from ddl.planner import Planner
from ddl.topology import Topology


def three_tier(racks):
    return Topology.from_dict({"name": f"three-tier-{racks}", "tiers": [
        {"name": "gpu", "count": 4, "bandwidth": "80 GB/s"},
        {"name": "host", "count": 16, "bandwidth": "100 Gbit/s"},
        {"name": "rack", "count": racks, "bandwidth": "50 Gbit/s"}]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--racks", type=list_of(at_least(1)), default="3,4,8,16",
                    help="comma-separated rack counts (64 ranks per rack)")
    ap.add_argument("--bytes", type=size, default="256MiB")
    ap.add_argument("--workers", type=at_least(1), default=os.cpu_count() or 1,
                    help="processes that simulate the candidates (default: one per core)")
    args = ap.parse_args(argv)
    nbytes = args.bytes
    print(f"{'ranks':>6} {'plan (s)':>9}  {'auto picks':<22} {'operations':>10} {'gap':>7}")
    for racks in args.racks:
        topo = three_tier(racks)
        t0 = time.perf_counter()
        plan = Planner(topo, use_disk_cache=False, workers=args.workers).plan("allreduce", nbytes)
        seconds = time.perf_counter() - t0
        print(f"{topo.nranks:>6} {seconds:>9.1f}  {plan.algorithm:<22} {plan.schedule.nops:>10} {plan.gap:>6.3f}x",
              flush=True)


if __name__ == "__main__":
    main()
