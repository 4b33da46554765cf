"""The examples run under mpiexec and report success."""
import importlib.util
import re
import subprocess
import sys

import pytest

from mpi_cases._launch import ROOT, run_mpi, run_ok


@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_hello(n):
    out = run_ok(n, "examples/allreduce_hello.py", "--size", "2MiB")
    assert f"on {n} ranks" in out
    assert "plan: " in out and "result check: OK" in out
    assert re.search(r"time: best [\d.]+ (us|ms|s)", out)


def test_allreduce_hello_writes_a_trace_of_its_timed_calls(tmp_path):
    import json
    out = run_ok(4, "examples/allreduce_hello.py", "--size", "2MiB", "--iters", "3", "--trace",
                 str(tmp_path / "t.json"))
    assert "result check: OK" in out and f"written to {tmp_path / 't.json'}" in out
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    calls = [e for e in events if e["ph"] == "X" and e["tid"] == 0 and e["name"].startswith("allreduce #")]
    assert sorted((e["pid"], e["name"]) for e in calls) == sorted((r, f"allreduce #{i}") for r in range(4)
                                                                  for i in (1, 2, 3))
    msgs = [e for e in events if e["ph"] == "X" and e["tid"] > 0]
    assert {e["pid"] for e in msgs} == set(range(4)) and all(e["dur"] >= 0 for e in msgs)
    # every rank receives, over the three calls, at least the (p - 1) / p of the buffer a reduction needs
    for r in range(4):
        assert sum(e["args"]["bytes"] for e in msgs if e["pid"] == r) >= 3 * (2 << 20) * 3 // 4


def test_allreduce_hello_refuses_a_trace_it_cannot_write_before_it_runs(tmp_path):
    rc, out, _ = run_mpi(2, "examples/allreduce_hello.py", "--trace", str(tmp_path / "no-such" / "t.json"))
    assert rc == 2 and "Traceback" not in out
    assert out.count(f"error: --trace {tmp_path / 'no-such' / 't.json'}: folder") == 1 and "does not exist" in out
    assert "ddl allreduce of" not in out


def test_allreduce_hello_on_a_zoo_topology():
    out = run_ok(8, "examples/allreduce_hello.py", "topologies/emulated-2rack.yaml", "--size", "64KiB",
                 "--iters", "2", timeout=180)
    assert "topology emulated-2rack" in out and "result check: OK" in out


def test_the_readme_training_script_block_runs_as_written(tmp_path):
    """The API block under "Using it from a training script" is a script: it runs on the 8 ranks of its
    file and prints the plan and why it was chosen (it once used names it never defined)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it from a training script"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "train.py").write_text(block)
    out = run_ok(8, str(tmp_path / "train.py"), timeout=240)
    assert out.count("Schedule(") == 1 and re.search(r"^Schedule\([\w-]+ allreduce, 8 ranks, ", out, re.M), out
    assert re.search(r"^allreduce of 4 MiB: [\w-]+ \(verified: ", out, re.M) and "\nwhy        " in out, out


@pytest.mark.parametrize("script", ["examples/allreduce_hello.py", "examples/train_mlp.py",
                                    "examples/local_sgd.py"])
def test_examples_take_the_file_ddl_emulate_run_names(script):
    """``ddl emulate run`` names the cluster's file in DDL_TOPOLOGY; an example given no file must plan
    for that one, not for a flat switch: an 8-rank file under 2 ranks is read and refused."""
    rc, out, _ = run_mpi(2, script, env={"DDL_TOPOLOGY": "topologies/emulated-flat.yaml"}, timeout=60)
    assert rc != 0 and "Traceback" not in out
    assert "'emulated-flat'" in out and "has 8 ranks but the communicator has 2" in out, out


@pytest.mark.parametrize("n", [2, 4])
def test_train_mlp_matches_single_process(n):
    out = run_ok(n, "examples/train_mlp.py", "--steps", "30")
    m = re.search(r"max relative difference of the loss curves over 30 steps on (\d) ranks: ([\d.e+-]+)", out)
    assert m and int(m.group(1)) == n and float(m.group(2)) < 1e-6, out
    assert "replicas bitwise identical: True" in out and "TRAIN_MLP OK" in out


@pytest.mark.parametrize("n", [2, 4])
def test_local_sgd(n):
    out = run_ok(n, "examples/local_sgd.py", "--rounds", "10", "--tau", "4")
    assert "replicas identical after every average: True" in out and "LOCAL_SGD OK" in out


def test_torch_hook():
    """With PyTorch: gradient hooks average .grad across 2 ranks, matching single-process training.
    Without: the example exits non-zero with a message saying PyTorch is needed."""
    if importlib.util.find_spec("torch") is None:
        proc = subprocess.run([sys.executable, "examples/torch_hook.py"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 0 and "needs PyTorch" in proc.stderr
        return
    out = run_ok(2, "examples/torch_hook.py", "--steps", "12", timeout=180)
    assert "TORCH_HOOK OK" in out and "replicas identical: True" in out
