"""The planner's caches: a training step never re-plans, a restarted job reuses its plans from disk,
and plans chosen by another planner (other algorithms, another revision) or damaged files are not used."""
import json

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
    assert len(list(tmp_path.rglob("*.json"))) == 1
    assert json.loads(path.read_text())["nranks"] == 4                 # rewritten in place

    monkeypatch.setattr(planner_module, "algorithm_names", lambda: ["ring"])
    Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    assert len({p.parent.parent for p in tmp_path.rglob("*.json")}) == 2   # another generation folder
    monkeypatch.setattr(planner_module, "PLANNER_REVISION", planner_module.PLANNER_REVISION + 1)
    Planner(topo, cache_dir=tmp_path).schedule("allreduce", 1 << 20)
    assert len({p.parent.parent for p in tmp_path.rglob("*.json")}) == 3
