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

    path = tmp_path / "t6.yaml"
    path.write_text("name: t6\ntiers:\n  - {name: gpu, count: 2, bandwidth: 10 GB/s}\n"
                    "  - {name: host, count: 3, bandwidth: 1 GB/s}\n")
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




def test_a_plan_stored_by_another_process_while_planning_is_the_one_run(tmp_path, monkeypatch):
    """Rank A plans a size class while another process (``ddl plan``, another job) stores its plan of
    that class: A runs the stored plan, as every rank that starts later will (they load the file),
    instead of its own. Before, A ran its own and later ranks the file's: a MismatchError."""
    topo = flat_topology(4)
    a, b = Planner(topo, cache_dir=tmp_path), Planner(topo, cache_dir=tmp_path)
    theirs = b.schedule("allreduce", 1 << 20, algorithm="ring")
    (path,) = tmp_path.rglob("*.json")
    real = planner_module._predict

    def meanwhile(*args, **kwargs):          # while A simulates, B's plan lands in A's class file
        monkeypatch.setattr(planner_module, "_predict", real)
        path.rename(path.with_name(path.name.replace("-ring-", "-auto-")))
        return real(*args, **kwargs)
    monkeypatch.setattr(planner_module, "_predict", meanwhile)
    mine = a.schedule("allreduce", 1 << 20)
    assert mine == theirs and mine.algorithm == "ring"
    assert Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20) == mine   # a later rank


def test_cache_files_are_readable_as_the_umask_allows_and_never_half_written(tmp_path):
    import os
    import stat

    from ddl.schedule import write_file

    old = os.umask(0o022)
    try:
        Planner(flat_topology(4), cache_dir=tmp_path).schedule("allreduce", 1000)
        (path,) = tmp_path.rglob("*.json")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644          # other users of a shared cache read it
        assert not write_file(path, "other", replace=False)       # the first stored stays
        assert json.loads(path.read_text())["nranks"] == 4
        assert write_file(path, "{}") and path.read_text() == "{}"
        assert [p.name for p in path.parent.iterdir()] == [path.name]    # no temporary file left
    finally:
        os.umask(old)


def test_an_unusable_cache_is_said_not_silent(tmp_path, monkeypatch, capsys):
    from ddl.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("DDL_CACHE_DIR", str(afile))
    assert main(["plan", "topologies/emulated-2rack.yaml", "--bytes", "4MiB", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "not cached  " in out and "cannot store the plan (Not a directory)" in out and "\ncached" not in out
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv("DDL_PLAN_CACHE", off)
        assert Planner(flat_topology(2)).cache_dir is None
    monkeypatch.setenv("DDL_PLAN_CACHE", "1")
    monkeypatch.setenv("DDL_CACHE_DIR", "~/plans")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Planner(flat_topology(2)).cache_dir.parts[:len(tmp_path.parts) + 1] == (*tmp_path.parts, "plans")


def test_a_plan_for_one_algorithm_says_which_jobs_load_it(tmp_path, monkeypatch, capsys):
    from ddl.cli import main

    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", "topologies/emulated-2rack.yaml", "--bytes", "4MiB", "--algorithm", "ring"]) == 0
    assert "(a job's ranks that ask for algorithm='ring' on this topology load it" in capsys.readouterr().out


def test_explain_describes_what_runs_and_pins_name_their_file(tmp_path):
    import pytest

    from ddl.errors import PlanError, ScheduleError

    topo = flat_topology(4)
    planner = Planner(topo, cache_dir=tmp_path)
    held = planner.schedule("allreduce", 1 << 20, algorithm="ring")
    (path,) = tmp_path.rglob("*.json")
    path.rename(path.with_name(path.name.replace("-ring-", "-auto-")))
    fresh = Planner(topo, cache_dir=tmp_path)
    assert fresh.explain("allreduce", 1 << 20).schedule == held                  # the held plan, evaluated
    reason = fresh.explain("allreduce", 1 << 20).reason
    auto = Planner(topo, use_disk_cache=False).plan("allreduce", 1 << 20).algorithm
    assert reason.startswith("ring runs (the plan held for this size class, made at another of its sizes or by "
                             "another process")
    assert (f"a plan made now picks {auto}" in reason) == (auto != "ring"), reason
    ring = tmp_path / "ring.json"
    held.save(ring)
    fresh.pin(str(ring))
    assert "pinned" in fresh.explain("allreduce", 64).reason and fresh.pinned("allreduce") == held
    with pytest.raises(ScheduleError, match=r"missing\.json: cannot read the schedule \(No such file"):
        fresh.pin(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match=r"ring\.json: the schedule is for 4 ranks"):
        Planner(flat_topology(3), cache_dir=tmp_path).pin(str(ring))


def test_ddl_plan_proves_its_plan_once_also_where_the_cache_holds_it(tmp_path, monkeypatch, capsys):
    """``ddl plan`` proves the schedule it chose; the same schedule read back from the cache (to say
    whether the file holds it, or found there by a second run) is not proved again."""
    from ddl.cli import main

    proofs = []
    real = planner_module._verified
    monkeypatch.setattr(planner_module, "_verified", lambda sched, stop=None: proofs.append(sched) or real(sched, stop))
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    for run in range(2):
        proofs.clear()
        assert main(["plan", "topologies/emulated-2rack.yaml", "--bytes", "4MiB", "--workers", "1"]) == 0
        assert "cached      " in capsys.readouterr().out
        assert len(proofs) == 1, run


PLAN_ONCE = """
import hashlib, sys, time
import ddl.planner as pm
real = pm.Planner._plan
def slow(self, *args):                  # a plan that takes long enough for every process to miss it
    print("PLANNED", flush=True)
    time.sleep(2.0)
    return real(self, *args)
pm.Planner._plan = slow
sched = pm.Planner(pm.flat_topology(8), cache_dir=sys.argv[1]).schedule("allreduce", 64 << 20)
print("DIGEST", hashlib.sha256(sched.to_json().encode()).hexdigest(), flush=True)
"""


def test_ranks_that_miss_the_same_plan_make_it_once(tmp_path):
    """Three processes (a node's ranks) ask for a plan no one has made: one plans, the others wait for
    it and load it, and all run the same schedule."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", PLAN_ONCE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(out.count("PLANNED") for out in outs) == 1, outs
    digests = {line for out in outs for line in out.splitlines() if line.startswith("DIGEST")}
    assert len(digests) == 1, outs
    assert [p.suffix for p in tmp_path.rglob("*") if p.is_file()] == [".json"]   # no lock in a shared cache
    lock = planner_module._lock_path(Planner(planner_module.flat_topology(8), cache_dir=tmp_path)
                                     .cache_file("allreduce", 64 << 20))
    assert not lock.exists()                                                 # nor left where it was


def test_a_holder_that_does_not_finish_delays_the_others_only_so_long(tmp_path, monkeypatch):
    """A process that holds a plan's lock and never stores it (stopped in a debugger, say) costs the
    others :data:`PLAN_WAIT_SECONDS` at most: then they plan alone."""
    import fcntl
    import os
    import time

    monkeypatch.setattr(planner_module, "PLAN_WAIT_SECONDS", 0.5)
    planner = Planner(flat_topology(4), cache_dir=tmp_path)
    lock = planner_module._lock_path(planner.cache_file("allreduce", 1 << 20))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        sched = planner.schedule("allreduce", 1 << 20)
        assert 0.5 <= time.monotonic() - t0 < 30
    finally:
        lock.unlink()
        os.close(fd)
    assert planner.stored("allreduce", 1 << 20) == sched


def test_a_lock_folder_of_another_user_is_not_used(tmp_path, monkeypatch):
    """Someone else's folder where ddl keeps its plan locks could hold them for ever: not used, the
    plan is made alone."""
    import os

    other = os.getuid() + 1
    monkeypatch.setattr(planner_module.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(planner_module.os, "getuid", lambda: other)
    folder = tmp_path / f"ddl-plan-locks-{other}"       # this user's, so not the one ddl asks for
    folder.mkdir()
    assert Planner(flat_topology(4), cache_dir=tmp_path / "cache").schedule("allreduce", 1000).nranks == 4
    assert not any(folder.iterdir())
