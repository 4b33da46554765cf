"""``ddl topo probe``: which rank pairs it measures (no MPI), how it judges and reports, and real runs
under mpiexec on this machine. The run on an emulated cluster slower than its file is in test_emulate.py."""
import json
import math
import os
import subprocess
import sys

import pytest

from ddl import probe
from ddl.probe import Finding, pair_classes, placement_problems, transfer_bytes
from ddl.topology import Topology
from mpi_cases._launch import ROOT, job_env, mpi_command, needs_mpi

ZOO = ROOT / "topologies"


def zoo(name):
    return Topology.load(ZOO / f"{name}.yaml")


# ---- what is measured ---------------------------------------------------------------------------------
def test_two_rack_classes_are_the_host_the_rack_and_the_spine():
    classes = pair_classes(zoo("emulated-2rack"))
    assert [(c.label, c.rate, c.hops) for c in classes] == [
        ("same host", 5e9, 2), ("between hosts", 50e6, 4), ("between hosts", 12.5e6, 6)]
    assert [c.pairs for c in classes] == [[(0, 1)], [(0, 2)], [(0, 4)]]
    # the links that bound each route, to name in a fix
    topo = zoo("emulated-2rack")
    assert [(u, v) for u, v, _ in probe.route_bottleneck(topo, *classes[1].pairs[0])] == [("h0", "rack0"), ("rack0", "h1")]
    assert [(u, v) for u, v, _ in probe.route_bottleneck(topo, *classes[2].pairs[0])] == [("rack0", "spine"), ("spine", "rack1")]
    assert all(c.skip is None for c in classes)
    assert sum(c.size for c in classes) == 8 + 12 + 24    # every pair from or to a host's first rank


def test_more_pairs_per_class_cover_new_hosts_first():
    topo = zoo("emulated-2rack")
    across = pair_classes(topo, per_class=4)[2]
    assert across.pairs == [(0, 4), (0, 6), (2, 4), (4, 0)]          # h0-h2, h0-h3, h1-h2: every host
    assert {topo.host_of(r) for pair in across.pairs[:3] for r in pair} == {"h0", "h1", "h2", "h3"}
    spine = pair_classes(zoo("fat-tree-4x4-r4"), per_class=16)[1]     # 16 hosts: every NIC is in a pair
    assert len({r for pair in spine.pairs for r in pair}) == 16


def test_gpus_on_one_host_are_not_measured_through_host_memory():
    classes = pair_classes(zoo("dgx-a100-2x8"))
    inside = [c for c in classes if c.same_host]
    between = [c for c in classes if not c.same_host]
    assert inside and all(c.skip == probe.GPU_PAIR_SKIP for c in inside)
    assert between and all(c.skip is None for c in between)
    assert probe.reduce_groups(zoo("dgx-a100-2x8")) == []                 # GPU reductions: not measured
    assert probe.reduce_groups(zoo("emulated-2rack"))[0] == ("host h0", (0, 1))


@pytest.mark.parametrize("r, near, far", [(1, 4e9, 4e9), (4, 4e9, 1e9), (16, 1e9, 0.25e9)])
def test_hosts_all_at_once_load_the_uplinks_as_oversubscribed(r, near, far):
    """16 hosts, 4 per leaf, uplinks at 16/r GB/s: shifted by 1 one flow per uplink crosses, by 8 every
    host's flow does, 4 per uplink: 1 GB/s each at r = 4 where a pair alone gets its NIC's 4 GB/s."""
    shift1, shift8 = probe.host_patterns(zoo(f"fat-tree-4x4-r{r}"))
    assert (shift1.shift, shift8.shift) == (1, 8) and len(shift8.flows) == 16
    assert shift8.flows[0] == (0, 8) and shift8.flows[8] == (8, 0)
    assert shift1.rate == pytest.approx(near) and shift8.rate == pytest.approx(far)
    if r > 1:
        assert ("leaf0", "spine", 16e9 / r, 4.0) in shift8.busiest


def test_hosts_all_at_once_on_the_two_racks():
    one, two = probe.host_patterns(zoo("emulated-2rack"))
    assert one.flows == [(0, 2), (2, 4), (4, 6), (6, 0)] and one.rate == pytest.approx(12.5e6)
    assert two.flows == [(0, 4), (2, 6), (4, 0), (6, 2)] and two.rate == pytest.approx(6.25e6)
    assert {(u, v) for u, v, _, n in two.busiest if n == 2} >= {("rack0", "spine"), ("spine", "rack1")}
    assert probe.host_patterns(Topology.load(ZOO / "dgx-a100.yaml")) == []       # one host: nothing to load


def test_transfer_sizes_take_a_quarter_second_within_limits():
    assert transfer_bytes(12.5e6) == int(12.5e6 * probe.TARGET_SECONDS) // 4096 * 4096
    assert transfer_bytes(1e3) == probe.MIN_BYTES
    assert transfer_bytes(1e12) == transfer_bytes(math.inf) == probe.MAX_BYTES


# ---- judging and reporting -------------------------------------------------------------------------------
def test_placement_as_the_file_says_or_not():
    topo = zoo("emulated-2rack")              # h0: 0-1, h1: 2-3, h2: 4-5, h3: 6-7
    assert placement_problems(topo, ["a", "a", "b", "b", "c", "c", "d", "d"]) == []
    split = placement_problems(topo, ["a", "x", "b", "b", "c", "c", "d", "d"])
    assert len(split) == 1 and "ranks 0, 1 on host h0" in split[0] and "2 machines" in split[0]
    merged = placement_problems(topo, ["a", "a", "a", "a", "c", "c", "d", "d"])
    assert len(merged) == 1 and "machine a runs ranks of 2 hosts" in merged[0] and "(h0, h1)" in merged[0]


def test_a_finding_is_ok_within_the_tolerance_either_way():
    def f(measured):
        return Finding("bandwidth", "between hosts", "0 -> 4", 100.0, measured, 0.15,
                       bottleneck=[("rack0", "spine", 100.0)])
    assert f(86).ok and f(114).ok and f(100).verdict == "ok"
    assert not f(84).ok and f(84).verdict == "SLOWER than the file"
    assert not f(116).ok and f(116).verdict == "FASTER than the file"
    assert "rack0 -> spine (100 B/s)" in f(50).fix() and "measured 50 B/s" in f(50).fix()
    assert Finding("reduce", "reduce", "host h0", None, 5.0, 0.15).verdict == "not judged"
    shared = Finding("pattern", "all at once", "4 hosts to +2", 100.0, 50.0, 0.15,
                     bottleneck=[("rack0", "spine", 200.0, 2.0)])
    assert not shared.ok and "rack0 -> spine (200 B/s, 2 flows)" in shared.fix()


def test_report_text_and_json(capsys):
    topo = zoo("emulated-2rack")
    classes = pair_classes(topo)
    pairs = {(0, 1): (5.1e9, 3e-6), (0, 2): (49e6, 1e-5), (0, 4): (6.2e6, 1e-5)}   # the uplink at half
    reduces = dict.fromkeys(range(8), 2.05e9)
    found = probe.findings(topo, classes, pairs, reduces)
    assert probe.report(topo, classes, found, [], sys.stdout) is False
    text = capsys.readouterr().out
    assert text.count("SLOWER than the file") == 1 and "placement: as the file says" in text
    assert "# fix: between hosts 0 -> 4" in text and "rack0 -> spine (12.5 MB/s)" in text
    assert probe.report(topo, classes, found, [], sys.stdout, as_json=True) is False
    doc = json.loads(capsys.readouterr().out)
    bad = [f for f in doc["findings"] if not f["ok"]]
    assert doc["ok"] is False and len(bad) == 1 and bad[0]["where"].startswith("0 -> 4")
    assert bad[0]["ratio"] == pytest.approx(0.496) and bad[0]["bottleneck"][0][:2] == ["rack0", "spine"]
    assert [f["where"] for f in doc["findings"] if f["what"] == "reduce"][0] == "host h0 (ranks 0, 1)"
    pairs[(0, 4)] = (12.4e6, 1e-5)
    assert probe.report(topo, classes, probe.findings(topo, classes, pairs, reduces), [], sys.stdout) is True
    assert "all as the file says" in capsys.readouterr().out


# ---- real runs on this machine ---------------------------------------------------------------------------
ONE_HOST = """name: one-host
nodes:
  - {id: m, kind: host}
  - {id: "m/cpu{i}", kind: cpu, for: {i: 2}}
links:
  - {a: "m/cpu{i}", b: m, bandwidth: BW, for: {i: 2}}
ranks:
  - {id: "m/cpu{i}", for: {i: 2}}
"""


@pytest.fixture()
def env():
    return job_env()


def one_host(tmp_path, bandwidth):
    path = tmp_path / "one-host.yaml"
    path.write_text(ONE_HOST.replace("BW", bandwidth))
    return str(path)


def ddl_probe(args, env, mpi=2, timeout=120):
    cmd = (mpi_command(mpi) if mpi else []) + [sys.executable, "-m", "ddl", "topo", "probe", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@needs_mpi
def test_a_file_faster_than_the_machine_fails_and_names_the_link(tmp_path, env):
    """... and ``--write`` gives those links the rate measured (the report on stdout stays JSON)."""
    fixed = tmp_path / "fixed.yaml"
    res = ddl_probe([one_host(tmp_path, "1000 TB/s"), "--json", "--write", str(fixed)], env)
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    [pair] = [f for f in doc["findings"] if f["what"] == "bandwidth"]
    assert not pair["ok"] and pair["ratio"] < 0.01 and pair["measured"] > 1e6
    assert [b[:2] for b in pair["bottleneck"]] == [["m/cpu0", "m"], ["m", "m/cpu1"]]
    assert doc["placement"] == [] and pair["latency"] > 0
    assert f"# wrote {fixed}: " in res.stderr and "#   link m/cpu0 - m: 1000 TB/s -> " in res.stderr
    written = Topology.load(fixed)
    assert written.route_bandwidth(0, 1) == pytest.approx(pair["measured"], rel=1e-3)
    assert "ddl topo probe --write" in written.description


@needs_mpi
def test_write_leaves_nothing_where_the_placement_differs(tmp_path, env):
    """Two hosts in the file, one machine in the job: what was measured is another layout's."""
    two = tmp_path / "two-hosts.yaml"
    two.write_text("name: two-hosts\nnodes:\n  - {id: sw, kind: switch}\n  - {id: \"h{i}\", kind: host, for: {i: 2}}\n"
                   "  - {id: \"h{i}/cpu0\", kind: cpu, for: {i: 2}}\nlinks:\n"
                   "  - {a: \"h{i}/cpu0\", b: \"h{i}\", bandwidth: 5 GB/s, for: {i: 2}}\n"
                   "  - {a: \"h{i}\", b: sw, bandwidth: 1 GB/s, for: {i: 2}}\n"
                   "ranks:\n  - {id: \"h{i}/cpu0\", for: {i: 2}}\n")
    out = tmp_path / "out.yaml"
    res = ddl_probe([str(two), "--write", str(out)], env)
    assert res.returncode == 1 and "placement: DIFFERS" in res.stdout, res.stdout + res.stderr
    assert f"# not written: {out}: the ranks ran otherwise" in res.stdout and not out.exists()


@needs_mpi
def test_write_refuses_a_folder_it_cannot_write_and_the_file_itself(tmp_path, env):
    """Checked before anything is measured: one clean error, exit 2, on every rank."""
    file = one_host(tmp_path, "5 GB/s")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)                       # (it once measured, then hung opening it)
    for out, says in ((tmp_path / "no-such-folder" / "x.yaml", "does not exist"),
                      (file, "is the file being probed"),
                      (tmp_path, "is a folder: name the file, e.g."),
                      (fifo, "is a FIFO"),
                      ("/dev/null", "not a regular file")):
        for mpi in (2, 0):                # under mpiexec, and before it launches the ranks itself
            res = ddl_probe([file, "--write", str(out)], env, mpi=mpi)
            assert res.returncode == 2 and says in res.stderr, res.stdout + res.stderr
            assert "Traceback" not in res.stderr and "same host" not in res.stdout
            assert "launching" not in res.stderr


@needs_mpi
def test_a_file_within_a_wide_tolerance_passes_launching_mpiexec_itself(tmp_path, env):
    """Without mpiexec it launches the file's ranks itself; a tolerance of 9.9 accepts anything from
    0 to 10.9 times the file, so only a working run can pass."""
    res = ddl_probe([one_host(tmp_path, "5 GB/s"), "--tolerance", "990%"], env, mpi=0)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "launching 2 ranks on this machine" in res.stderr
    assert "same host" in res.stdout and "all as the file says" in res.stdout


@needs_mpi
def test_a_job_of_the_wrong_size_is_one_clean_error(tmp_path, env):
    res = ddl_probe([one_host(tmp_path, "5 GB/s")], env, mpi=3)
    assert res.returncode == 2
    assert "has 2 ranks but the job has 3" in res.stderr and "Traceback" not in res.stderr


def test_usage_errors_exit_2_without_a_traceback(tmp_path, env):
    missing = subprocess.run([sys.executable, "-m", "ddl", "topo", "probe"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "give the topology FILE" in missing.stderr
    bad = subprocess.run([sys.executable, "-m", "ddl", "topo", "probe", one_host(tmp_path, "5 GB/s"),
                          "--tolerance", "-3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tolerance" in bad.stderr and "Traceback" not in bad.stderr
    word = subprocess.run([sys.executable, "-m", "ddl", "topo", "probe", one_host(tmp_path, "5 GB/s"),
                           "--tolerance", "abc"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert word.returncode == 2 and "a fraction above 0 such as 0.15 or 15%, got 'abc'" in word.stderr, word.stderr
