"""The planner's caches: a training step never re-plans, a restarted job reuses its plans from disk,
and plans chosen by another planner (other algorithms, another revision) or damaged files are not used."""
import json
from pathlib import Path

import ddl.planner as planner_module
from ddl.planner import Planner, flat_topology


def test_plans_are_cached_in_memory_and_on_disk(tmp_path, monkeypatch):
    topo = flat_topology(4)
    first = Planner(topo, cache_dir=tmp_path)
    sched = first.schedule("allreduce", 1000)
    assert first.schedule("allreduce", 1000) is sched                 # memory
    assert first.schedule("allreduce", 1024) is sched                 # same size class
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1 and topo.fingerprint[:16] in str(files[0])

    def no_planning(*args, **kwargs):
        raise AssertionError("re-planned although the plan is on disk")
    restarted = Planner(topo, cache_dir=tmp_path)
    monkeypatch.setattr(restarted, "plan", no_planning)
    monkeypatch.setattr(restarted, "_build", no_planning)
    assert restarted.schedule("allreduce", 1000) == sched              # disk


def test_another_planner_or_a_damaged_file_plans_afresh(tmp_path, monkeypatch):
    topo = flat_topology(4)
    Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    (path,) = tmp_path.rglob("*.json")
    path.write_text("{not json")
    again = Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    assert again.nranks == 4
    path.write_bytes(b"\xff\xfe\x00 not text")
    assert Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20) == again
    assert len(list(tmp_path.rglob("*.json"))) == 1
    assert json.loads(path.read_text())["nranks"] == 4                 # rewritten in place

    monkeypatch.setattr(planner_module, "algorithm_names", lambda: ["ring"])
    Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    assert len({p.parent.parent for p in tmp_path.rglob("*.json")}) == 2   # another generation folder
    monkeypatch.setattr(planner_module, "PLANNER_REVISION", planner_module.PLANNER_REVISION + 1)
    Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    assert len({p.parent.parent for p in tmp_path.rglob("*.json")}) == 3


def test_a_plan_made_ahead_is_what_the_job_runs(tmp_path, monkeypatch, capsys):
    """``ddl plan`` stores its choice where a job's planner looks first: ranks that share the cache
    folder load it for any size of the class instead of planning (seconds per rank at 192 ranks)."""
    from ddl.cli import main
    from ddl.topology import Topology

    path = "topologies/emulated-2rack.yaml"
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", path, "--bytes", "48MiB", "--workers", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    saved = Path(record["cache_file"])
    assert saved.exists() and saved.name == "allreduce-root0-auto-67108864.json"
    assert main(["plan", path, "--bytes", "48MiB", "--workers", "1"]) == 0
    assert f"cached      {saved}" in capsys.readouterr().out

    job = Planner(Topology.load(path))                      # what a ddl.Communicator builds

    def no_planning(*args, **kwargs):
        raise AssertionError("a rank planned although the plan was made ahead")
    monkeypatch.setattr(job, "plan", no_planning)
    monkeypatch.setattr(job, "_build", no_planning)
    for nbytes in (33 << 20, 48 << 20, 64 << 20):
        sched = job.schedule("allreduce", nbytes)
        assert sched.algorithm == record["algorithm"] and sched.nops == record["operations"]
    assert job.cache_file("allreduce", 40 << 20) == saved
    # a job's several bucket sizes, planned ahead in one command
    assert main(["plan", path, "--bytes", "4MiB,48MiB", "--workers", "1", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["bytes"] for r in records] == [4 << 20, 48 << 20]
    assert Path(records[0]["cache_file"]).name == "allreduce-root0-auto-4194304.json"
    assert records[1]["cache_file"] == str(saved) and all(Path(r["cache_file"]).exists() for r in records)
    # without a disk cache nothing is stored, and the record says so
    monkeypatch.setenv("DDL_PLAN_CACHE", "0")
    assert main(["plan", path, "--bytes", "1MiB", "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache_file"] is None


def test_a_cache_file_holding_another_calls_plan_is_a_miss(tmp_path):
    """A file (copied, hand-edited) whose schedule is for another collective or root is planned afresh
    and overwritten, instead of reaching the executor (which refuses it on every call)."""
    topo = flat_topology(4)
    planner = Planner(topo, cache_dir=tmp_path)
    planner.schedule("allgather", 8000).save(planner.cache_file("allreduce", 8000))
    got = Planner(topo, cache_dir=tmp_path).schedule("allreduce", 8000)
    assert got.collective == "allreduce"
    assert Planner(topo, cache_dir=tmp_path)._load(("allreduce", 0, "auto", 8192)) == got    # rewritten
    planner.schedule("broadcast", 8000, root=2).save(planner.cache_file("broadcast", 8000, root=1))
    assert Planner(topo, cache_dir=tmp_path).schedule("broadcast", 8000, root=1).root == 1


def test_the_first_plan_of_a_size_class_stays_and_later_ones_say_so(tmp_path, monkeypatch, capsys):
    """Sizes of one class share a cache file. The plan stored first stays, made in the same command or
    another, and a plan that differs says it was not stored instead of naming a file that holds
    something else."""
    from ddl.cli import main
    from ddl.schedule import Schedule

    path = tmp_path / "t4.yaml"
    path.write_text("name: t4\ntiers:\n  - {name: gpu, count: 2, bandwidth: 10 GB/s}\n"
                    "  - {name: host, count: 2, bandwidth: 1 GB/s}\n")
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["plan", str(path), "--bytes", "129KiB,256KiB", "--workers", "1", "--json"]) == 0
    first, second = json.loads(capsys.readouterr().out)
    assert first["algorithm"] != second["algorithm"], "the two sizes should plan differently here"
    stored = first["cache_file"]
    assert Schedule.load(stored).algorithm == first["algorithm"]
    assert second["cache_file"] is None
    assert second["cache_holds_other"] == {"file": stored, "algorithm": first["algorithm"]}
    # another command: the same answer, and the file is left as it was
    assert main(["plan", str(path), "--bytes", "256KiB", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"not cached  {stored}" in out
    assert f"up to 256 KiB; {first['algorithm']}), which a job's ranks run" in out
    assert Schedule.load(stored).algorithm == first["algorithm"]
    # and the planner of a job runs the stored plan for either size
    from ddl.topology import Topology
    job = Planner(Topology.load(path))
    assert job.schedule("allreduce", 256 << 10) == job.held("allreduce", 129 << 10) == Schedule.load(stored)


def test_only_broadcast_plans_are_kept_per_root(tmp_path):
    """The other collectives have no root: any root asks for the plan a job (root 0) runs."""
    planner = Planner(flat_topology(4), cache_dir=tmp_path)
    assert planner.cache_file("allreduce", 8000, root=2) == planner.cache_file("allreduce", 8000)
    assert planner.schedule("allgather", 8000, root=3) is planner.schedule("allgather", 8000)
    assert planner.cache_file("broadcast", 8000, root=2) != planner.cache_file("broadcast", 8000)
    assert planner.schedule("broadcast", 8000, root=2).root == 2
