"""The planner's choice: which candidates it builds, and that simulating them in parallel changes nothing."""
from pathlib import Path

import pytest

import ddl.planner as planner_module
from ddl.errors import ScheduleError
from ddl.schedule import Schedule
from ddl.cli import main
from ddl.planner import Planner
from ddl.topology import Topology

ZOO = Path(__file__).resolve().parent.parent / "topologies"
MCF = "multicommodity-flow"


def _planner(name, **kw):
    return Planner(Topology.load(ZOO / f"{name}.yaml"), use_disk_cache=False, **kw)


def test_auto_skips_routing_where_every_rank_pair_has_one_path():
    planner = _planner("emulated-2rack")
    plan = planner.plan("allreduce", 64 << 20)
    assert MCF not in plan.baselines and plan.algorithm != MCF
    assert "one path per rank pair" in plan.skipped[MCF]
    # asked for by name it is still built, and it is one of its bases with the same prediction
    routed = planner.plan("allreduce", 64 << 20, MCF)
    assert routed.algorithm == MCF and routed.verified
    bases = {name: secs for name, secs in routed.baselines.items() if name in ("ring", "hierarchical", "tree-packing")}
    assert routed.schedule.info["base_algorithm"] in bases
    assert routed.predicted_seconds == pytest.approx(bases[routed.schedule.info["base_algorithm"]], rel=1e-9)
    assert routed.predicted_seconds >= plan.predicted_seconds


def test_auto_routes_where_the_fabric_has_several_paths():
    plan = _planner("dgx-h100").plan("allreduce", 64 << 20)
    assert MCF not in plan.skipped
    assert MCF in plan.baselines or plan.algorithm == MCF


def test_simulating_in_parallel_gives_the_serial_plan(monkeypatch):
    serial = _planner("fat-tree-4x4-r8").plan("allreduce", 16 << 20)
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    parallel = _planner("fat-tree-4x4-r8", workers=2).plan("allreduce", 16 << 20)
    assert parallel.algorithm == serial.algorithm
    assert parallel.predicted_seconds == serial.predicted_seconds
    assert parallel.baselines == serial.baselines
    assert parallel.busiest == serial.busiest
    assert parallel.verified


def test_workers_prove_the_fastest_schedule(monkeypatch):
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    planner = _planner("fat-tree-4x4-r8")
    schedules = {name: planner._build(name, "allreduce", 16 << 20, 0)
                 for name in ("ring", "halving-doubling", "hierarchical")}
    sims, proved = planner_module._predict(planner.topo, schedules, 16 << 20, 2)
    assert set(sims) == set(schedules)
    assert proved == {min(sims, key=lambda n: sims[n].seconds)}


def test_workers_raise_when_the_fastest_schedule_fails_its_proof(monkeypatch):
    # a ring allreduce cut after its reduce-scatter half simulates (every send has its receive) and
    # is the fastest, but leaves ranks without the sum: the proof fails, and the plan with it
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    planner = _planner("fat-tree-4x4-r8")
    ring = planner._build("ring", "allreduce", 16 << 20, 0)
    half = Schedule(ring.collective, ring.nranks, ring.pattern,
                    tuple(prog[:len(prog) // 2] for prog in ring.programs), algorithm="half-ring")
    schedules = {"half-ring": half, "hierarchical": planner._build("hierarchical", "allreduce", 16 << 20, 0)}
    with pytest.raises(ScheduleError, match="lacks the contribution"):
        planner_module._predict(planner.topo, schedules, 16 << 20, 2)


def test_plan_text_says_what_was_not_planned(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(ZOO / "emulated-2rack.yaml"), "--bytes", "1MiB", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"not planned: {MCF} (one path per rank pair" in out


def test_plan_text_flags_a_prediction_below_the_latency_bound(capsys, tmp_path, monkeypatch):
    """At 8 bytes on one NVSwitch box a packing of trees has ranks receive from several trees at once:
    faster than the round model's latency bound allows. The text says so instead of a bare gap < 1;
    a schedule above the bound gets no such note."""
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(ZOO / "dgx-a100.yaml"), "--bytes", "8", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "below the latency bound" in out and "gap 0." in out
    assert main(["plan", str(ZOO / "dgx-a100.yaml"), "--bytes", "64MiB", "--workers", "1"]) == 0
    assert "below the latency bound" not in capsys.readouterr().out
