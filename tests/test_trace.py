"""Message timelines (``ddl.trace``, ``ddl bench --trace``): pairing, clocks, the Chrome trace, the
summary, and a real traced run under mpiexec whose every message is in the file."""
import collections
import json
import subprocess
import sys

import pytest
from mpi_cases._launch import ROOT, job_env, mpi_command, needs_mpi, run_ok

from ddl import trace
from ddl.trace import ARRIVE, CALL, DATA, END, POST



def _two_rank_call(label="c", skew=0.0):
    """Rank 0 sends two messages with one tag and one with another to rank 1; rank 1's clock is
    ``skew`` ahead of rank 0's."""
    r0 = [(label, 1.0, CALL, -1, 0, 0), (label, 1.1, DATA, -1, 0, 0),
          (label, 1.2, POST, 1, 100, 7), (label, 1.2, POST, 1, 50, 9), (label, 1.3, POST, 1, 100, 7),
          (label, 2.0, END, -1, 0, 0)]
    r1 = [(label, 1.05 + skew, CALL, -1, 0, 0), (label, 1.15 + skew, DATA, -1, 0, 0),
          (label, 1.5 + skew, ARRIVE, 0, 100, 7), (label, 1.6 + skew, ARRIVE, 0, 50, 9),
          (label, 1.9 + skew, ARRIVE, 0, 100, 7), (label, 1.95 + skew, END, -1, 0, 0)]
    return [r0, r1]


def test_the_kth_send_of_a_tag_pairs_with_its_kth_arrival():
    found = sorted(trace.messages(_two_rank_call())["c"])
    assert found == [(0, 1, 50, 1.2, 1.6), (0, 1, 100, 1.2, 1.5), (0, 1, 100, 1.3, 1.9)]
    # a post that never arrived (the call was cut short) is left out, not paired with a wrong arrival
    r0, r1 = _two_rank_call()
    assert len(trace.messages([r0, r1[:3]])["c"]) == 1


def test_times_are_put_on_rank_0s_clock():
    shifted = trace.aligned(_two_rank_call(skew=5.0), [0.0, 5.0])
    for mine, want in zip(shifted, _two_rank_call()):
        assert [e[1] for e in mine] == pytest.approx([e[1] for e in want])
        assert [e[:1] + e[2:] for e in mine] == [e[:1] + e[2:] for e in want]


def test_summary_moments_after_the_first_call():
    s = trace.summary(_two_rank_call(), ["a", "b"])["c"]
    assert s["agreement"] == pytest.approx(0.15)            # rank 1's, the later one
    assert s["first_message"] == pytest.approx(0.5) and s["last_message"] == pytest.approx(0.9)
    assert s["end"] == pytest.approx(1.0) and s["between"] == "hosts"
    one_host = trace.summary(_two_rank_call(), ["a", "a"])["c"]
    assert one_host["between"] == "ranks" and one_host["first_message"] == pytest.approx(0.5)
    # messages only between ranks of one host do not count as between hosts
    r0, r1 = _two_rank_call()
    three = [r0, r1, [("c", 1.0, CALL, -1, 0, 0), ("c", 1.2, END, -1, 0, 0)]]
    assert trace.summary(three, ["a", "a", "b"])["c"]["first_message"] is None
    # no agreement (an unchecked call): None, not a number
    assert trace.summary([[e for e in r if e[2] != DATA] for r in _two_rank_call()], ["a", "b"])["c"]["agreement"] is None


def test_chrome_trace_tracks_calls_and_messages_without_overlap():
    doc = trace.chrome_trace(_two_rank_call(), ["h0", "h1"], name_of=lambda label: f"allreduce {label}")
    events = doc["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["name"] in ("process_name", "thread_name")}
    assert names[(0, None)] == "rank 0 (h0)" and names[(1, 0)] == "calls" and names[(1, 1)] == "from rank 0 (h0)"
    calls = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert {(e["pid"], e["name"]) for e in calls} == {(0, "allreduce c"), (0, "agreement"), (1, "allreduce c"),
                                                      (1, "agreement")}
    whole = next(e for e in calls if e["pid"] == 0 and e["name"] == "allreduce c")
    assert whole["ts"] == 0 and whole["dur"] == pytest.approx(1e6)
    msgs = sorted((e for e in events if e["ph"] == "X" and e["tid"] == 1), key=lambda e: e["ts"])
    # each message runs from when the pair was free (its post, or the previous arrival) to its arrival
    assert [(e["ts"], e["ts"] + e["dur"]) for e in msgs] == [
        pytest.approx((2e5, 5e5)), pytest.approx((5e5, 6e5)), pytest.approx((6e5, 9e5))]
    assert [e["args"]["bytes"] for e in msgs] == [100, 50, 100]
    assert msgs[2]["args"]["posted_ms"] == pytest.approx(300.0) and msgs[0]["pid"] == 1
    json.dumps(doc)


@needs_mpi
def test_a_traced_run_records_every_message_of_every_timed_call(tmp_path):
    from ddl.planner import Planner, flat_topology
    from ddl.topology import Topology

    topo_file = tmp_path / "flat-4.yaml"
    flat_topology(4, "10 Gbit/s", "10 us").dump(topo_file)
    out = tmp_path / "t.json"
    env = job_env(DDL_CACHE_DIR=str(tmp_path / "plans"))
    nbytes, iters = 8 << 20, 2
    p = subprocess.run([*mpi_command(4), sys.executable, "-m", "ddl", "bench", str(topo_file), "--bytes",
                        str(nbytes), "--iters", str(iters), "--peers", "mpi", "--json", "--trace", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"trace written to {out}" in p.stderr
    row = next(r for r in json.loads(p.stdout) if r["impl"] == "ddl")
    assert "trace" not in next(r for r in json.loads(p.stdout) if r["impl"] == "mpi")
    t = row["trace"]
    assert t["between"] == "ranks" and 0 < t["first_message"] <= t["last_message"] <= t["end"]
    assert 0 < t["agreement"] < t["end"]

    sched = Planner(Topology.load(str(topo_file))).schedule("allreduce", nbytes)
    assert sched.algorithm == row["algorithm"]
    ranges = sched.chunk_ranges(nbytes // 4)
    sends = collections.Counter((r, op.peer) for r, prog in enumerate(sched.programs) for op in prog
                                if op.kind == "send" and ranges[op.chunk, 1] > ranges[op.chunk, 0])
    doc = json.loads(out.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    msgs = [e for e in events if e["tid"] > 0]
    got = collections.Counter((e["tid"] - 1, e["pid"]) for e in msgs)
    assert got == collections.Counter({pair: iters * n for pair, n in sends.items()})
    assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in msgs)
    early = [e for e in msgs if e["ts"] + e["dur"] < e["args"]["posted_ms"] * 1e3 - 1e-3]
    assert not early, early[:3]         # one machine, one clock: nothing arrives before it was posted
    calls = collections.Counter(e["pid"] for e in events if e["tid"] == 0 and e["name"].startswith("ddl 8 MiB #"))
    assert calls == {r: iters for r in range(4)}
    for track in {(e["pid"], e["tid"]) for e in msgs}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in msgs if (e["pid"], e["tid"]) == track)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:])), (track, spans)


def test_an_untraced_communicator_is_left_as_it_was(tmp_path):
    script = tmp_path / "untrace.py"
    script.write_text("""import numpy as np
from mpi4py import MPI
import ddl
from ddl.trace import MessageTrace, POST
comm = ddl.Communicator(MPI.COMM_WORLD, algorithm="ring", check="always")
engine = comm._engine
isend = engine._isend
x = np.ones(1 << 18, np.float32); y = np.empty_like(x)
t = MessageTrace(comm)
comm.Allreduce(x, y)                       # outside recording: nothing kept
assert t.take() == []
with t.recording("one"):
    comm.Allreduce(x, y)
kinds = [e[2] for e in t.take()]
assert kinds[0] == "call" and kinds[-1] == "end" and POST in kinds, kinds
t.close()
assert not {"start", "_start_data", "_dispatch", "_finish"} & set(vars(engine)) and engine._isend == isend
comm.Allreduce(x, y)
assert t.take() == [] and np.all(y == MPI.COMM_WORLD.size)
print("UNTRACED OK")
""")
    assert run_ok(2, str(script)).count("UNTRACED OK") == 2


@needs_mpi
def test_ranks_of_one_clock_have_offset_zero_and_another_clock_is_measured(tmp_path):
    """Ranks of one machine read one clock: their offsets are 0 exactly (ping-pong between ranks that
    share two cores measured milliseconds of scheduling and drew arrivals before their posts). A rank
    that reports another clock is measured, once for all the ranks of that clock."""
    script = tmp_path / "clocks.py"
    script.write_text("""from mpi4py import MPI
from ddl import trace
world = MPI.COMM_WORLD
assert trace.clock_offsets(world) == [0.0] * world.size
real = trace._clock_id
trace._clock_id = lambda: ("elsewhere",) if world.rank >= 2 else real()
offsets = trace.clock_offsets(world)
assert offsets[:2] == [0.0, 0.0] and offsets[2] == offsets[3] and abs(offsets[2]) < 1.0, offsets
print("CLOCKS OK")
""")
    assert run_ok(4, str(script)).count("CLOCKS OK") == 4
