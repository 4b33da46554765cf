"""Topologies built like the zoo's, planned the way the zoo is: ``ddl plan --compare`` on fat trees,
leaf-spines and heterogeneous clusters of other sizes and rates, so that a gain measured on the zoo
is seen not to hang on its exact numbers.

    python benchmarks/bench_like_zoo.py [--bytes 256MiB] [--only NAME,...] [--keep DIR]

The files are written to a temporary folder (``--keep DIR``: to DIR, to look at or plan again) and
planned cold (no plan cache). Prints the same table as ``ddl plan --compare``: auto's choice, its
predicted time over the lower bound (gap) and the baselines' predicted times over auto's.
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ZOO = Path(__file__).resolve().parent.parent / "topologies"


def fat_tree(name, leaves, per_leaf, uplink):
    """``leaves`` leaf switches of ``per_leaf`` ranks at 4 GB/s under one spine, uplinks at ``uplink``."""
    return {"name": name, "defaults": {"latency": "1 us"},
            "nodes": [{"id": "spine", "kind": "switch"},
                      {"id": "leaf{l}", "kind": "switch", "for": {"l": leaves}},
                      {"id": "l{l}n{k}", "kind": "gpu", "for": {"l": leaves, "k": per_leaf}}],
            "links": [{"a": "l{l}n{k}", "b": "leaf{l}", "bandwidth": "4 GB/s", "for": {"l": leaves, "k": per_leaf}},
                      {"a": "leaf{l}", "b": "spine", "bandwidth": uplink, "for": {"l": leaves}}],
            "ranks": [{"id": "l{l}n{k}", "for": {"l": leaves, "k": per_leaf}}]}


def leaf_spine(name, racks, hosts):
    """``leaf-spine-2rack.yaml`` with ``racks`` racks of ``hosts`` hosts (4 GPUs each)."""
    data = yaml.safe_load((ZOO / "leaf-spine-2rack.yaml").read_text())
    data["name"] = name
    for entry in data["nodes"] + data["links"] + data["ranks"]:
        loops = entry.get("for", {})
        if "r" in loops:
            loops["r"] = racks
        if "h" in loops:
            loops["h"] = hosts
    return data


def hetero(name, t4_hosts=2, t4_nic="25 Gbit/s"):
    """``hetero-cluster.yaml`` with ``t4_hosts`` T4 hosts behind ``t4_nic`` NICs."""
    data = yaml.safe_load((ZOO / "hetero-cluster.yaml").read_text())
    data["name"] = name
    for entry in data["nodes"] + data["links"] + data["ranks"]:
        text = " ".join(str(entry.get(k, "")) for k in ("id", "a", "b"))
        if "t{h}" in text:
            entry["for"]["h"] = t4_hosts
            if "nic0" in text and entry.get("bandwidth") == "25 Gbit/s":
                entry["bandwidth"] = t4_nic
    return data


VARIANTS = [
    fat_tree("fat-tree-4x4-uplink2", 4, 4, "2 GB/s"),
    fat_tree("fat-tree-4x4-uplink1.33", 4, 4, "1.333 GB/s"),
    fat_tree("fat-tree-8x4-uplink1", 8, 4, "1 GB/s"),
    fat_tree("fat-tree-3x4-uplink0.5", 3, 4, "0.5 GB/s"),
    fat_tree("fat-tree-4x8-uplink2", 4, 8, "2 GB/s"),
    leaf_spine("leaf-spine-3x4", 3, 4),
    leaf_spine("leaf-spine-2x3", 2, 3),
    hetero("hetero-one-t4-host", t4_hosts=1),
    hetero("hetero-t4-50g", t4_nic="50 Gbit/s"),
    hetero("hetero-three-t4-hosts", t4_hosts=3),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--bytes", default="256MiB", help="message size (default 256MiB)")
    ap.add_argument("--only", default="", help="comma-separated names of the variants to plan (default all)")
    ap.add_argument("--keep", metavar="DIR", help="write the files to DIR and leave them there")
    args = ap.parse_args(argv)
    wanted = [n for n in args.only.split(",") if n]
    known = [v["name"] for v in VARIANTS]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [v for v in VARIANTS if not wanted or v["name"] in wanted]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for data in chosen:
            path = folder / f"{data['name']}.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            files.append(str(path))
        env = dict(os.environ, DDL_PLAN_CACHE="0")
        return subprocess.run([sys.executable, "-m", "ddl", "plan", "--compare", "--bytes", args.bytes, *files],
                              env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
