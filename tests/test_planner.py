"""The planner's choice: which candidates it builds, and that simulating them in parallel changes nothing."""
import concurrent.futures
import functools
import json
import os
import re
import time
from pathlib import Path

import pytest

import ddl.planner as planner_module
from ddl.bounds import Bound
from ddl.errors import ScheduleError
from ddl.schedule import Schedule
from ddl.simulate import Outpaced, simulate
from ddl.cli import main
from ddl.planner import Planner, flat_topology
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
    assert MCF in plan.baselines or MCF in plan.outpaced or plan.algorithm == MCF


def test_simulating_in_parallel_gives_the_serial_plan(monkeypatch):
    serial = _planner("fat-tree-4x4-r8").plan("allreduce", 16 << 20, exhaustive=True)
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    parallel = _planner("fat-tree-4x4-r8", workers=2).plan("allreduce", 16 << 20, exhaustive=True)
    assert parallel.algorithm == serial.algorithm
    assert parallel.predicted_seconds == serial.predicted_seconds
    assert parallel.baselines == serial.baselines and not parallel.outpaced
    assert parallel.busiest == serial.busiest
    assert parallel.verified


@functools.cache
def _exhaustive_plan(name):
    """The plan that runs every candidate to its end (shared by both worker counts below)."""
    return _planner(name).plan("allreduce", 256 << 20, exhaustive=True)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name", ["fat-tree-4x4-r8", "emulated-2rack-interleaved", "dgx-a100"])
def test_stopping_losers_early_changes_no_choice(name, workers, monkeypatch):
    # a candidate is stopped only once a lower bound on its time exceeds the best time so far: the
    # choice and its prediction are the exhaustive plan's, and every reported "at least" is a true
    # lower bound of the full simulation, above the chosen time
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    full = _exhaustive_plan(name)
    plan = _planner(name, workers=workers).plan("allreduce", 256 << 20)
    assert (plan.algorithm, plan.predicted_seconds, plan.busiest) == (full.algorithm, full.predicted_seconds, full.busiest)
    assert plan.verified
    assert plan.outpaced, "nothing was stopped early"
    assert set(plan.baselines) | set(plan.outpaced) == set(full.baselines)
    assert not set(plan.baselines) & set(plan.outpaced)
    for other, at_least in plan.outpaced.items():
        assert plan.predicted_seconds < at_least <= full.baselines[other] * (1 + 1e-9), other
    for other, secs in plan.baselines.items():
        assert secs == full.baselines[other]


def test_tree_packing_is_built_last_told_the_time_to_beat(monkeypatch):
    # it simulates variants of its own: built after the others were simulated, it is told the
    # fastest of them, stops once it cannot win, and the plan reports it stopped (the exhaustive plan
    # tells it nothing, and builds it with the others)
    from ddl.algorithms import ALGORITHMS, TAKES_BEAT
    assert "tree-packing" in TAKES_BEAT
    told, build = [], ALGORITHMS["tree-packing"]

    def spy(*args, beat=None, **kw):
        told.append(beat)
        return build(*args, beat=beat, **kw)

    monkeypatch.setitem(ALGORITHMS, "tree-packing", spy)
    plan = _planner("fat-tree-4x4-r8").plan("allreduce", 256 << 20)
    assert plan.algorithm != "tree-packing" and told == [plan.predicted_seconds]
    assert plan.predicted_seconds < plan.outpaced["tree-packing"] <= _exhaustive_plan("fat-tree-4x4-r8").baselines["tree-packing"]
    told.clear()
    _planner("fat-tree-4x4-r8").plan("allreduce", 1 << 20, exhaustive=True)
    assert told == [None]


def test_with_workers_tree_packing_is_told_the_fastest_time_as_it_falls(monkeypatch, tmp_path):
    # With two workers every candidate is built and simulated in a forked process, and tree-packing,
    # started last, beside the others, is told the fastest time the workers have simulated so far (a
    # function: it falls while the packing is built). The choice is the exhaustive plan's.
    from ddl.algorithms import ALGORITHMS
    build, seen = ALGORITHMS["tree-packing"], tmp_path / "told"

    def spy(*args, beat=None, **kw):       # (runs in a worker: what it was told goes through a file)
        seen.write_text(repr(beat() if callable(beat) else beat))
        return build(*args, beat=beat, **kw)

    monkeypatch.setitem(ALGORITHMS, "tree-packing", spy)
    plan = _planner("fat-tree-4x4-r8", workers=2).plan("allreduce", 256 << 20)
    told = float(seen.read_text())
    times = {plan.algorithm: plan.predicted_seconds, **plan.baselines}
    assert told in times.values() and told >= plan.predicted_seconds      # a time some candidate takes
    full = _exhaustive_plan("fat-tree-4x4-r8")
    assert (plan.algorithm, plan.predicted_seconds) == (full.algorithm, full.predicted_seconds)
    seen.unlink()
    _planner("fat-tree-4x4-r8", workers=2).plan("allreduce", 1 << 20, exhaustive=True)
    assert seen.read_text() == "None"


def test_an_algorithm_asked_for_by_name_is_compared_with_every_other_in_full():
    plan = _planner("fat-tree-4x4-r8").plan("allreduce", 256 << 20, "ring")
    assert plan.algorithm == "ring" and not plan.outpaced
    assert "hierarchical" in plan.baselines


def test_workers_prove_the_fastest_schedule(monkeypatch):
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    planner = _planner("fat-tree-4x4-r8")
    schedules = {name: planner._build(name, "allreduce", 16 << 20, 0)
                 for name in ("ring", "halving-doubling", "hierarchical")}
    sims, outpaced, proved = planner_module._predict(planner.topo, schedules, 16 << 20, 2)
    assert set(sims) == set(schedules) and not outpaced
    assert proved[min(sims, key=lambda n: sims[n].seconds)] is True
    assert set(proved) <= set(sims) and all(p is True for p in proved.values())


def test_one_process_simulates_the_quickest_first_so_that_large_losers_stop(monkeypatch):
    # hierarchical's run is already known (it simulated its variants to choose one), halving-doubling
    # has half the ring's operations: simulated in that order, hierarchical's time is the ceiling
    # from the start and the two others, both slower, are stopped instead of run to their end
    planner, nbytes = _planner("fat-tree-4x4-r8"), 256 << 20
    schedules = {name: planner._build(name, "allreduce", nbytes, 0)
                 for name in ("ring", "halving-doubling", "hierarchical")}
    assert schedules["halving-doubling"].nops < schedules["ring"].nops
    order, simulated = [], planner_module._simulated
    names = {id(sched): name for name, sched in schedules.items()}

    def spy(topo, sched, size, ceiling):
        order.append(names[id(sched)])
        return simulated(topo, sched, size, ceiling)

    monkeypatch.setattr(planner_module, "_simulated", spy)
    sims, outpaced, _ = planner_module._predict(planner.topo, schedules, nbytes, 1, prune=True)
    assert order == ["hierarchical", "halving-doubling", "ring"]
    assert set(sims) == {"hierarchical"} and set(outpaced) == {"halving-doubling", "ring"}
    full = {name: simulate(planner.topo, sched, nbytes).seconds for name, sched in schedules.items()}
    for name, at_least in outpaced.items():
        assert sims["hierarchical"].seconds < at_least <= full[name] * (1 + 1e-9), name


def _shared_prediction(monkeypatch, prune=True):
    """The state forked workers of a prediction share, set up in this process for one ring."""
    planner = _planner("fat-tree-4x4-r8")
    ring = planner._build("ring", "allreduce", 16 << 20, 0)
    shared = planner_module._Shared(planner.topo, {"ring": ring}, 16 << 20, prune, ["ring"])
    monkeypatch.setattr(planner_module, "_FORKED", shared)
    return shared


def test_a_worker_proves_a_schedule_still_simulated_only_once_it_has_passed_a_check(monkeypatch):
    # a large loser is usually stopped at its first check, once set up: a free worker that began its
    # proof sooner would spend its own set-up (the dataflow: 7 s for the 1024-rank ring) on a loser
    proving = []
    monkeypatch.setattr(planner_module._Shared, "prove", lambda self, name: proving.append(name) or True)
    shared = _shared_prediction(monkeypatch)
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    waiting = waiter.submit(planner_module._prove_forked, "ring")
    time.sleep(0.2)
    assert not waiting.done() and proving == []
    shared.lost[0] = 1                       # stopped at its first check: no proof at all
    assert waiting.result(timeout=5) is None and proving == []
    shared = _shared_prediction(monkeypatch)
    waiting = waiter.submit(planner_module._prove_forked, "ring")
    time.sleep(0.2)
    assert not waiting.done()
    shared.contending[0] = 1                 # it passed a check: it may win, prove it beside its run
    assert waiting.result(timeout=5) is True and proving == ["ring"]
    _shared_prediction(monkeypatch, prune=False)    # nothing is stopped: no reason to wait
    assert planner_module._prove_forked("ring") is True and proving == ["ring", "ring"]
    waiter.shutdown()


def test_a_simulation_in_a_worker_contends_from_its_second_check(monkeypatch):
    shared = _shared_prediction(monkeypatch)
    seen = []

    def run(topo, sched, nbytes, ceiling):   # a run that checks three times
        for _ in range(3):
            ceiling()
            seen.append(shared.contending[0])
        return simulate(topo, sched, nbytes)

    monkeypatch.setattr(planner_module, "_simulated", run)
    result, proof = planner_module._simulate_forked("ring")
    assert seen == [0, 1, 1] and proof is True           # it led, so it proved itself
    shared = _shared_prediction(monkeypatch)
    monkeypatch.setattr(planner_module, "_simulated", lambda topo, sched, nbytes, ceiling: ceiling() and Outpaced(1.0))
    result, proof = planner_module._simulate_forked("ring")
    assert isinstance(result, Outpaced) and proof is None
    assert shared.lost[0] == 1 and shared.contending[0] == 1     # ended: a waiting worker moves on
    shared = _shared_prediction(monkeypatch)

    def fails(topo, sched, nbytes, ceiling):
        raise ScheduleError("deadlock")

    monkeypatch.setattr(planner_module, "_simulated", fails)
    with pytest.raises(ScheduleError):
        planner_module._simulate_forked("ring")
    assert shared.lost[0] == 1 and shared.contending[0] == 1     # failed: nobody waits to prove it


def test_workers_raise_when_a_simulation_fails(monkeypatch):
    # ranks 0 and 1 each receive chunk 0 before they send it: the simulation raises (deadlock) in its
    # worker, and the prediction with it (see the next tests for what a waiting prover hears)
    from ddl.schedule import Op
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    planner = _planner("fat-tree-4x4-r8")
    programs = [()] * planner.topo.nranks
    programs[0] = (Op("recv", 0, 1), Op("send", 0, 1))
    programs[1] = (Op("recv", 0, 0), Op("send", 0, 0))
    stuck = Schedule("allreduce", planner.topo.nranks, (1,), tuple(programs))
    schedules = {"stuck": stuck, "ring": planner._build("ring", "allreduce", 16 << 20, 0)}
    with pytest.raises(ScheduleError, match="deadlock"):
        planner_module._predict(planner.topo, schedules, 16 << 20, 2, prune=True)


def test_workers_raise_when_the_fastest_schedule_fails_its_proof(monkeypatch):
    # a ring allreduce cut after its reduce-scatter half simulates (every send has its receive) and
    # is the fastest, but leaves ranks without the sum: the proof fails, and the plan with it
    monkeypatch.setattr(planner_module, "PARALLEL_MIN_OPS", 0)
    planner = _planner("fat-tree-4x4-r8")
    ring = planner._build("ring", "allreduce", 16 << 20, 0)
    half = Schedule(ring.collective, ring.nranks, ring.pattern,
                    tuple(prog[:len(prog) // 2] for prog in ring.programs), algorithm="half-ring")
    schedules = {"half-ring": half, "hierarchical": planner._build("hierarchical", "allreduce", 16 << 20, 0)}
    _, _, proved = planner_module._predict(planner.topo, schedules, 16 << 20, 2)
    assert isinstance(proved["half-ring"], ScheduleError) and "lacks the contribution" in str(proved["half-ring"])
    build = Planner._build                # the plan that picks it raises
    monkeypatch.setattr(Planner, "_build", lambda self, name, *a: half if name == "ring" else build(self, name, *a))
    planner = Planner(planner.topo, use_disk_cache=False, workers=2)
    with pytest.raises(ScheduleError, match="lacks the contribution"):
        planner.plan("allreduce", 16 << 20)


def test_workers_build_the_candidates_with_the_serial_outcome(monkeypatch):
    # with workers, each candidate is built in a forked process: the plan, and what was skipped and
    # why (an algorithm that refuses, one that builds an invalid schedule), are the serial plan's
    build = Planner._build

    def built_where(self, name, *a):
        if name == "ring":
            raise ScheduleError(f"built in process {os.getpid()}")
        if name == "halving-doubling":
            raise planner_module.PlanError(f"refused in process {os.getpid()}")
        return build(self, name, *a)

    monkeypatch.setattr(Planner, "_build", built_where)
    serial, parallel = (_planner("fat-tree-4x4-r8", workers=w).plan("allreduce", 16 << 20, exhaustive=True)
                        for w in (1, 2))
    assert (parallel.algorithm, parallel.predicted_seconds, parallel.baselines) == (
        serial.algorithm, serial.predicted_seconds, serial.baselines)
    assert set(parallel.skipped) == set(serial.skipped) and {"ring", "halving-doubling"} <= set(serial.skipped)
    here = f"process {os.getpid()}"
    assert here in serial.skipped["ring"] and here in serial.skipped["halving-doubling"]
    assert "a bug to report: built in process" in parallel.skipped["ring"] and here not in parallel.skipped["ring"]
    assert "refused in process" in parallel.skipped["halving-doubling"]
    assert here not in parallel.skipped["halving-doubling"]


def test_an_algorithm_that_builds_an_invalid_schedule_is_skipped_by_auto_and_named(monkeypatch):
    build = Planner._build

    def faulty(self, name, *a):
        if name == "ring":
            raise ScheduleError("chunk pattern weights sum to too much")
        return build(self, name, *a)

    monkeypatch.setattr(Planner, "_build", faulty)
    plan = Planner(flat_topology(4), use_disk_cache=False).plan("allreduce", 1 << 20)
    assert plan.algorithm != "ring" and "a bug to report: chunk pattern" in plan.skipped["ring"]
    with pytest.raises(ScheduleError, match="chunk pattern"):       # asked for by name: its error
        Planner(flat_topology(4), use_disk_cache=False).plan("allreduce", 1 << 20, "ring")


def test_plan_text_says_what_was_not_planned(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(ZOO / "emulated-2rack.yaml"), "--bytes", "1MiB", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"not planned: {MCF} (one path per rank pair" in out
    assert main(["plan", str(ZOO / "dgx-a100-4x8.yaml"), "--bytes", "64MiB", "--workers", "1"]) == 0
    skips = [line for line in capsys.readouterr().out.splitlines() if "not planned: " in line]
    assert skips and all(f"({line.split()[2]}: " not in line for line in skips), skips   # the name once


@pytest.mark.parametrize("runner_s, says", [(2.0, "2.00x faster than the next best"),
                                            (1.002, "0.2% faster than the next best"),
                                            (1.0001, "as fast as the next best"), (1.0, "as fast as the next best")])
def test_the_lead_over_the_next_best_is_never_a_printed_tie_called_faster(runner_s, says):
    bound = Bound(seconds=0.5, bandwidth_seconds=0.5, latency_seconds=0.001)
    text = planner_module._explain("ring", "auto", 1.0, {"tree": runner_s}, [], bound, 1 << 20)
    assert says in text and "1.00x" not in text


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
    assert main(["plan", str(ZOO / "dgx-a100.yaml"), str(ZOO / "dgx1-v100.yaml"), "--compare", "--bytes", "8",
                 "--workers", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()
    a100, v100 = (next(row for row in rows if row.startswith(name + " ")) for name in ("dgx-a100", "dgx1-v100"))
    assert re.search(r" 0\.\d+x\*", a100) and "x*" not in v100 and rows[-1].startswith("* below the latency bound")
    assert rows[0] == "allreduce of 8 B"                  # what the table compares, above it
    assert main(["plan", str(ZOO / "dgx-a100.yaml"), "--bytes", "8", "--workers", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["below_latency_bound"] is True and record["gap"] < 1 and record["root"] is None


def test_a_broadcast_plan_says_its_root(capsys, tmp_path, monkeypatch):
    """(The root appeared only in the cache file's name.)"""
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    args = ["plan", str(ZOO / "dgx1-v100.yaml"), "--collective", "broadcast", "--root", "2", "--bytes", "1MiB",
            "--workers", "1"]
    assert main(args) == 0
    assert "collective  broadcast of 1 MiB from rank 2\n" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["root"] == 2
    args[args.index("broadcast")] = "Bcast"             # the method's name, as comm.plan takes it
    assert main(args) == 0 and "collective  broadcast of 1 MiB from rank 2\n" in capsys.readouterr().out


def test_nothing_to_move_has_a_zero_bound_and_is_not_cached(capsys, tmp_path, monkeypatch):
    """At 0 bytes every algorithm takes no time and no message need be sent: the bound is 0 (not the
    latency of one), the gap 1, and the arbitrary choice is not stored as the 1-byte class's plan."""
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(ZOO / "emulated-2rack.yaml"), "--bytes", "0", "--workers", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["predicted_seconds"] == record["bound_seconds"] == record["latency_bound_seconds"] == 0
    assert record["gap"] == 1.0 and record["cache_file"] is None and not list(tmp_path.rglob("*.json"))


def test_plan_text_and_json_show_what_was_stopped_early(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    def why(name):
        assert main(["plan", str(ZOO / f"{name}.yaml"), "--workers", "1", "--bytes", "16MiB"]) == 0
        out = capsys.readouterr().out
        assert "vs ring" in out and "stopped once it could not win" in out
        return next(line for line in out.splitlines() if line.startswith("why"))

    # some candidates run to their end, some stopped; every one stopped (hierarchical's own run,
    # known from its build, is the ceiling of all the others there)
    assert re.search(r"next best run to its end \(.*\d+ more were stopped once", why("dgx-a100"))
    assert "; every other was stopped once it could not win" in why("fat-tree-4x4-r8")
    args = ["plan", str(ZOO / "fat-tree-4x4-r8.yaml"), "--workers", "1", "--bytes", "16MiB"]
    assert main(args + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["outpaced"] and set(record["outpaced"]).isdisjoint(record["baselines"])
    # the comparison table runs every candidate to its end
    assert main(args + ["--json", "--compare"]) == 0
    [record] = json.loads(capsys.readouterr().out)
    assert record["outpaced"] == {} and "ring" in record["baselines"]


def test_the_garbage_collector_is_paused_while_planning_and_restored_after(monkeypatch):
    # every collection during a plan walks all the candidates' operations again (seconds each at a
    # thousand ranks), so none may run until the plan returns; the caller's setting is restored
    import gc

    seen = []
    build, predict = Planner._build, planner_module._predict
    monkeypatch.setattr(Planner, "_build", lambda self, *a: seen.append(gc.isenabled()) or build(self, *a))
    monkeypatch.setattr(planner_module, "_predict", lambda *a: seen.append(gc.isenabled()) or predict(*a))
    planner = _planner("fat-tree-4x4-r8")
    assert gc.isenabled()
    planner.plan("allreduce", 16 << 20)
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        planner.plan("allreduce", 1 << 20)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_plan_timeline_shows_how_busy_the_busiest_links_are(capsys, tmp_path, monkeypatch):
    """--timeline: a strip per busiest link (blank idle ... @ full), and the same profile in the JSON;
    the GPUs' links into the NVSwitch of a DGX A100, the busiest, are full from the start and drain at
    the end."""
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    args = ["plan", str(ZOO / "dgx-a100.yaml"), "--workers", "1", "--bytes", "32MiB", "--timeline"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(next(line for line in out if line.startswith("busiest links")))
    strips = [line.strip() for line in out[at + 1:] if line.strip().startswith("|")]
    assert len(strips) == 5 and all(s[61] == "|" and "idle" in s[62:] for s in strips)
    assert main(args + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    busiest = record["busiest_links"]
    for link in busiest:
        timeline = record["timeline"][link["link"]]
        profile = timeline["profile"]
        assert len(profile) == 60 and all(0.0 <= x <= 1.0 for x in profile)
        assert sum(profile) / 60 == pytest.approx(link["utilisation"], rel=1e-6)
        assert profile[0] == pytest.approx(1.0) and profile[-1] < 0.99
        assert timeline["idle_start"] == 0.0 < timeline["idle_end"] < record["predicted_seconds"] / 60
        assert timeline["idle_between"] >= 0.0
    assert main(["plan", str(ZOO / "dgx-a100.yaml"), "--workers", "1", "--json"]) == 0
    assert "timeline" not in json.loads(capsys.readouterr().out)       # only when asked for


def test_plan_of_one_rank_says_nothing_moves(capsys, tmp_path, monkeypatch):
    """Every algorithm takes no time on one rank: the explanation says so (it used to divide by zero)."""
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    one = tmp_path / "one.yaml"
    one.write_text("name: one\nnodes: [{id: g0, kind: gpu}]\nlinks: []\nranks: [g0]\n")
    assert main(["plan", str(one), "--workers", "1", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "nothing moves" in out and "predicted   0 s" in out and "nan" not in out


@pytest.mark.parametrize("args,message", [
    (["--workers", "0"], "--workers 0: at least 1"),
    (["--bytes", "12XB"], "--bytes"),
    (["--collective", "broadcast", "--root", "9"], "--root 9 is not a rank of " + str(ZOO / "emulated-2rack.yaml") + " (8 ranks: give 0 to 7)"),
    (["--root", "2"], "--root 2: allreduce has no root"),
    (["--save", ""], "--save needs a file name"),
    (["--save", str(ZOO / "emulated-2rack.yaml")], "is the topology file itself"),
    (["--algorithm", "fastest"], "unknown algorithm 'fastest'"),
    (["--bytes", "4MiB,64MiB", "--compare"], "--compare takes one size"),
    (["--bytes", "4MiB,64MiB", "--save", "s.json"], "--save takes one size"),
    (["--bytes", "1e400"], "beyond 1 EiB"),
    (["--save", "plans" + os.sep], "is a folder"),
    (["--save", str(ZOO / "emulated-2rack.yaml" / "x.json")], "is not a folder"),
    (["--compare", "--algorithm", "ring"], "drop --algorithm ring"),
    (["--compare", "--timeline"], "--timeline goes with one plan's report")])
def test_plan_user_errors_are_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(ZOO / "emulated-2rack.yaml"), "--workers", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddl: error: ") and message in err and err.count("\n") == 1, err


def test_save_takes_one_file_and_an_empty_message_has_no_cache_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    flat = str(ZOO / "emulated-flat.yaml")
    assert main(["plan", flat, flat, "--compare", "--save", str(tmp_path / "s.json"), "--workers", "1"]) == 2
    assert "--save writes one schedule" in capsys.readouterr().err
    assert main(["plan", flat, "--compare", "--save", str(tmp_path / "s.json"), "--workers", "1"]) == 0
    assert f"schedule written to {tmp_path / 's.json'}" in capsys.readouterr().out      # (it said nothing)
    assert Schedule.load(str(tmp_path / "s.json")).nranks == 8
    # 0 bytes shares the 1-byte class, whose plan is stored; a 0-byte plan never is (it crashed here)
    assert main(["plan", flat, "--bytes", "1", "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["plan", flat, "--bytes", "0", "--workers", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["cache_file"] is None and record["cache_holds_other"] is None


def test_a_given_schedule_is_proved_and_predicted_not_planned(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    topo, saved = str(ZOO / "emulated-flat.yaml"), tmp_path / "ring.json"
    assert main(["plan", topo, "--bytes", "1MiB", "--algorithm", "ring", "--save", str(saved), "--workers", "1"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(Planner, "plan", lambda *a, **k: pytest.fail("planned instead of evaluating"))
    assert main(["plan", topo, "--bytes", "1MiB,4MiB", "--schedule", str(saved), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["bytes"] for r in records] == [1 << 20, 4 << 20] and {r["algorithm"] for r in records} == {"ring"}
    assert all(r["verified"] and r["gap"] >= 1 and r["cache_file"] is None for r in records)
    assert records[1]["predicted_seconds"] > records[0]["predicted_seconds"]
    data = json.loads(saved.read_text())
    data["programs"][0] = data["programs"][0][1:]                   # a hand edit that drops an operation
    saved.write_text(json.dumps(data))
    assert main(["plan", topo, "--schedule", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddl: error: {saved}: ") and err.count("\n") == 1, err
    for args, message in ((["--compare"], "not with --compare"), (["--collective", "broadcast"], "holds a schedule of allreduce"),
                          ([], "is for 8 ranks")):
        other = str(ZOO / "dgx-a100-2x8.yaml") if not args else topo
        assert main(["plan", other, "--schedule", str(tmp_path / "ring.json"), *args]) == 2
        assert message in capsys.readouterr().err


def test_compare_reads_every_file_before_planning_any(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nnodes: [{id: g0, kind: gpu}]\nlinks: []\nranks: [g9]\n")
    monkeypatch.setattr(Planner, "plan", lambda *a, **k: pytest.fail("planned before reading every file"))
    assert main(["plan", str(ZOO / "dgx1-v100.yaml"), str(bad), "--compare", "--workers", "1"]) == 2
    assert "bad.yaml" in capsys.readouterr().err


def _star(p, message_cost=None):
    nodes = [("sw", "switch")] + [(f"g{i}", "gpu") for i in range(p)]
    links = [{"a": f"g{i}", "b": "sw", "bandwidth": "10 GB/s", "latency": "2 us"} for i in range(p)]
    defaults = None if message_cost is None else {"message_cost": message_cost}
    return Topology("star", nodes, links, [f"g{i}" for i in range(p)], defaults)


def test_a_message_cost_makes_auto_prefer_fewer_messages(tmp_path, capsys, monkeypatch):
    from ddl.simulate import simulate
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    free = Planner(_star(8), use_disk_cache=False).plan("allreduce", 64 << 10)
    costly_topo = _star(8, "5 us")
    costly = Planner(costly_topo, use_disk_cache=False).plan("allreduce", 64 << 10)
    assert costly.verified and costly.schedule.nops < free.schedule.nops
    # what was best with free messages is slower once each costs 5 us, and the choice beats it
    slower = simulate(costly_topo, free.schedule, 64 << 10).seconds
    assert slower > costly.predicted_seconds > free.predicted_seconds
    path = tmp_path / "star.yaml"
    costly_topo.dump(path)
    assert main(["plan", str(path), "--bytes", "64KiB"]) == 0
    assert "(5 us per message)" in capsys.readouterr().out
    assert main(["plan", str(path), "--bytes", "64KiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["message_cost_seconds"] == pytest.approx(5e-6)


@pytest.mark.parametrize("call,says", [
    (lambda pl: pl.plan("allreduce", "1MiB"), None),                       # a size as text is fine
    (lambda pl: pl.plan("allreduce", 1 << 20, root=None), None),           # only broadcast has a root
    (lambda pl: pl.plan("allreduce", 1.5), "not a whole, non-negative number of bytes"),
    (lambda pl: pl.plan("allreduce", True), "cannot parse size True"),
    (lambda pl: pl.plan("allreduce", float("nan")), "cannot parse size nan"),
    (lambda pl: pl.plan("allreduce", float("inf")), "cannot parse size inf"),
    (lambda pl: pl.plan("allreduce", -5), "non-negative number of bytes, got -5"),
    (lambda pl: pl.schedule("allreduce", "lots"), "cannot parse size 'lots'"),
    (lambda pl: pl.plan("broadcast", 100, root=1.0), "root must be a rank number, got 1.0"),
    (lambda pl: pl.plan("broadcast", 100, root=3), "root 3 is not a rank of flat-3 (ranks 0..2)"),
    (lambda pl: pl.schedule("broadcast", 100, root=-1), "root -1 is not a rank"),
    (lambda pl: pl.evaluate(pl.schedule("allreduce", 100), "x"), "cannot parse size 'x'"),
    (lambda pl: pl.plan("allgatherv", 100), "unknown collective 'allgatherv'")])
def test_planner_arguments_are_checked_with_one_plan_error(call, says):
    from ddl.errors import PlanError
    pl = Planner(flat_topology(3), workers=1)
    if says is None:
        assert call(pl).nbytes == 1 << 20
        return
    with pytest.raises(PlanError) as info:
        call(pl)
    assert says in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 200, str(info.value)


@pytest.mark.parametrize("nranks", [4, 8])
def test_without_a_file_auto_takes_fewer_messages_within_the_margin(nranks):
    """On the assumed flat network `auto` takes the candidate of fewest messages among those predicted
    within FLAT_MESSAGE_MARGIN of the fastest, and says why; the same network read from a file (a
    network the user vouches for) gets the fastest."""
    from ddl.simulate import simulate

    nbytes = 64 << 20
    flat = flat_topology(nranks)
    plan = Planner(flat, use_disk_cache=False).plan("allreduce", nbytes, exhaustive=True)
    sims = {name: simulate(flat, Planner(flat, use_disk_cache=False).schedule("allreduce", nbytes, name), nbytes)
            for name in [plan.algorithm, *plan.baselines]}
    fastest = min(sims, key=lambda n: sims[n].seconds)
    near = [n for n in sims if sims[n].seconds <= sims[fastest].seconds * (1 + planner_module.FLAT_MESSAGE_MARGIN)]
    assert plan.algorithm != fastest                                # the case this rule is for
    assert plan.algorithm in near
    assert sims[plan.algorithm].transfers == min(sims[n].transfers for n in near) < sims[fastest].transfers
    assert f"sends the fewest messages ({sims[plan.algorithm].transfers})" in plan.reason
    assert fastest in plan.reason and "without a topology file" in plan.reason
    assert Planner(flat, use_disk_cache=False).plan("allreduce", nbytes).algorithm == plan.algorithm  # pruned alike

    vouched = Topology.from_dict(flat.to_dict(), source="flat.yaml")
    assert Planner(vouched, use_disk_cache=False).plan("allreduce", nbytes).algorithm == fastest


def _die(name):
    os._exit(9)


def test_a_worker_that_dies_is_a_plan_error_that_says_what_to_do(monkeypatch):
    """A worker ended by the system (for memory, say) broke the pool: the traceback of BrokenProcessPool."""
    monkeypatch.setattr(planner_module, "_build_forked", _die)
    monkeypatch.setattr(planner_module, "_simulate_forked", _die)
    with pytest.raises(planner_module.PlanError, match=r"a planner worker process died .* plan with fewer workers"):
        _planner("fat-tree-4x4-r8", workers=2).plan("allreduce", 1 << 20)
