"""``ddl bench``: real small runs under mpiexec (table, JSON, plot, gloo or its absence), argument errors."""
import json
import os
import re
import subprocess
import sys

import pytest

from ddl import Error
from ddl.bench import expected, parse_sizes, pattern
from ddl.cli import main
from ddl.launcher import OPEN_MPI, flavor
from mpi_cases._launch import MPIEXEC, ROOT, job_env, mpi_command, needs_mpi, without_launcher_report

TWO_RANKS = """name: flat-2
nodes:
  - {id: sw, kind: switch}
  - {id: "r{i}", kind: cpu, for: {i: 2}}
links:
  - {a: "r{i}", b: sw, bandwidth: 10 Gbit/s, latency: 10 us, for: {i: 2}}
ranks:
  - {id: "r{i}", for: {i: 2}}
"""
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(\S+)\s+([\d.]+ (?:ns|us|ms|s))\s+(\S+)\s+(\S+)\s+(\d+)\s")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Environment of the runs: no MPI launcher variables, a private plan cache."""
    return job_env(DDL_CACHE_DIR=str(tmp_path_factory.mktemp("plans")), PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def topo_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "flat-2.yaml"
    path.write_text(TWO_RANKS)
    return str(path)


def bench(args, env, mpi=2, timeout=90):
    cmd = (mpi_command(mpi) if mpi else []) + [sys.executable, "-m", "ddl", "bench", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- real runs --------------------------------------------------------------------------------------------
@needs_mpi
def test_table_and_plot_under_mpiexec(topo_file, env, tmp_path):
    png = tmp_path / "busbw.png"
    p = bench([topo_file, "--bytes", "8:4KiB:8", "--iters", "2", "--warmup", "1", "--peers", "mpi",
               "--algorithms", "ring", "--plot", str(png)], env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    head = next(line for line in lines if line.startswith("#") and "#wrong" in line)
    assert head.split()[1:10] == ["size", "count", "type", "redop", "impl", "time", "algbw", "busbw", "#wrong"]
    rows = [ROW.match(line) for line in lines if not line.startswith("#")]
    assert rows and all(rows), p.stdout
    got = {(int(m.group(1)), m.group(5)) for m in rows}
    assert got == {(n, impl) for n in (8, 64, 512, 4096) for impl in ("ddl", "ddl:ring", "mpi")}
    for m in rows:
        assert int(m.group(2)) == int(m.group(1)) // 4 and m.group(3) == "float" and m.group(4) == "sum"
        assert m.group(9) == "0"  # #wrong
        assert float(m.group(7)) > 0 and float(m.group(8)) > 0  # algbw, busbw (busbw = algbw on 2 ranks)
    assert "# wrong values (#wrong, all rows; nccl-tests' out of bounds values): 0 OK" in p.stdout
    assert "topology flat-2" in p.stdout
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@needs_mpi
def test_json_fields_launching_mpiexec_itself(topo_file, env):
    p = bench([topo_file, "--bytes", "64", "--max-bytes", "1KiB", "--factor", "4", "--iters", "3",
               "--algorithms", "ring", "--peers", "mpi", "--json"], env, mpi=None)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "launching 2 ranks on this machine" in p.stderr
    rows = json.loads(p.stdout)
    assert [(r["impl"], r["bytes"]) for r in rows] == [(i, n) for n in (64, 256, 1024)
                                                       for i in ("ddl", "ddl:ring", "mpi")]
    for r in rows:
        for key in ("impl", "bytes", "seconds", "algbw", "busbw", "correct", "wrong", "count", "times",
                    "predicted_seconds", "bound_seconds"):
            assert key in r
        assert r["correct"] is True and r["wrong"] == 0 and r["nranks"] == 2 and r["topology"] == "flat-2"
        assert len(r["times"]) == 3 and r["seconds"] == sorted(r["times"])[1]
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"])  # 2(p-1)/p = 1 on 2 ranks
        assert r["bound_seconds"] > 0
        if r["impl"] == "ddl":         # auto on one node: these sizes go inline, no schedule to predict
            assert r["algorithm"] == "inline" and r["predicted_seconds"] is None
        elif r["impl"] == "ddl:ring":
            assert r["predicted_seconds"] >= r["bound_seconds"] * 0.999 and r["algorithm"] == "ring"
        else:
            assert r["predicted_seconds"] is None


@needs_mpi
def test_gloo_skipped_with_a_note_without_torch(topo_file, env, tmp_path):
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    e = dict(env, PYTHONPATH=os.pathsep.join([str(stub.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = bench([topo_file, "--bytes", "1KiB", "--iters", "1", "--peers", "mpi,gloo", "--json"], e)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.count("gloo skipped: torch cannot be imported") == 1, p.stderr
    assert "pip install torch" in p.stderr
    assert sorted(r["impl"] for r in json.loads(p.stdout)) == ["ddl", "mpi"]


@needs_mpi
def test_an_algorithm_that_cannot_plan_a_size_is_skipped_once_and_named_once(topo_file, env):
    """(It was said on stderr and again under the table, as 'ddl:ring-packing: skipped: ring-packing: ...'.)"""
    args = [topo_file, "--bytes", "1MiB", "--iters", "1", "--algorithms", "ring,ring-packing", "--peers", "none"]
    p = bench(args, env)
    assert p.returncode == 0, p.stdout + p.stderr
    skips = [line for line in (p.stdout + p.stderr).splitlines() if "skipped" in line]
    assert skips == ["# 1 MiB ddl:ring-packing: skipped: 2 ranks have one ring at most (both directions are the same pair)"]
    p = bench(args + ["--json"], env)
    assert p.returncode == 0 and [r["impl"] for r in json.loads(p.stdout)] == ["ddl", "ddl:ring"], p.stderr
    assert p.stderr.count("ddl:ring-packing skipped at 1 MiB: 2 ranks have one ring at most") == 1, p.stderr


@needs_mpi
def test_gloo_peer_with_torch(topo_file, env):
    pytest.importorskip("torch.distributed")
    p = bench([topo_file, "--bytes", "4KiB", "--iters", "2", "--peers", "gloo", "--json"], env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["impl"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {"ddl", "gloo"} and rows["gloo"]["correct"] and rows["gloo"]["seconds"] > 0
    assert "gloo" in rows["gloo"]["algorithm"]


@needs_mpi
def test_rank_count_mismatch_is_one_clean_error(env):
    p = bench([str(ROOT / "topologies/emulated-flat.yaml"), "--bytes", "8"], env)
    assert p.returncode == 2
    assert p.stderr.count("ddl: error:") == 1 and "has 8 ranks but this MPI job has 2" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert "DDL_TOPOLOGY" not in p.stderr
    named = bench(["--bytes", "8"], {**env, "DDL_TOPOLOGY": str(ROOT / "topologies/emulated-flat.yaml")})
    assert named.returncode == 2 and "emulated-flat.yaml, named by environment variable DDL_TOPOLOGY) has 8 ranks" in named.stderr, named.stderr


# ---- --device gpu ---------------------------------------------------------------------------------------
_DEVICE_LOOP = """
import json, sys
import numpy as np
from mpi4py import MPI
from ddl import bench
from ddl.gpu.executor import HostRuntime, NcclExecutor
sys.path.insert(0, "tests/mpi_cases")   # run from the repository root
from _host_array import HostArray

class PosingMemory(bench.HostMemory):
    # the benchmark's device memory interface on host arrays, with ddl's device executor on host memory
    name, label = "gpu", "host memory posing as a GPU"
    comms = []
    def upload(self, host):
        return HostArray(host.copy())
    def empty_like(self, a):
        return HostArray(np.empty_like(a.a))
    def download(self, a, out=None):
        return super().download(a.a, out)
    def upload_into(self, dst, host):
        np.copyto(dst.a, host)
    def poison(self, a):
        bench.poison(a.a)
    def mpi_staging(self):
        return True
    def attach(self, comm):
        comm._device = NcclExecutor(comm, runtime=HostRuntime(), path="cuda-aware-mpi")
        self.comms.append(comm)

world = MPI.COMM_WORLD
opts = bench.options(bytes="8,4KiB,1MiB", iters="2", peers="mpi", algorithms="auto,ring", json=True,
                     device="gpu", progress=False)
memory = PosingMemory()
rows, notes, header = bench.measure(opts, world, memory=memory)
paths = world.gather([c.last_path for c in memory.comms], root=0)
if world.rank == 0:
    print("RESULT " + json.dumps({"rows": rows, "paths": paths, "header": header["lines"]}))
"""


@needs_mpi
@pytest.mark.timeout(300)
def test_device_benchmark_loop_on_host_memory(env, tmp_path):
    """``--device gpu``'s loop without a GPU: buffers that only offer ``__cuda_array_interface__``
    reach ddl's device executor (run on host memory), MPI gets host-staged copies, every result is
    checked exactly, and the header says where the buffers lived."""
    script = tmp_path / "device_loop.py"
    script.write_text(_DEVICE_LOOP)
    p = subprocess.run([*mpi_command(3), sys.executable, str(script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.split("RESULT ", 1)[1])
    rows = result["rows"]
    assert {(r["impl"], r["bytes"]) for r in rows} == {(i, n) for i in ("ddl", "ddl:ring", "mpi")
                                                       for n in (8, 4096, 1 << 20)}
    assert all(r["correct"] and r["wrong"] == 0 and r["seconds"] > 0 for r in rows), rows
    assert all(paths == ["cuda-aware-mpi", "cuda-aware-mpi"] for paths in result["paths"]), result["paths"]
    assert any("buffers in host memory posing as a GPU" in line for line in result["header"])
    assert any("host-staged" in line for line in result["header"])


@needs_mpi
def test_device_gpu_without_a_usable_gpu_is_one_clear_error(env):
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present: --device gpu runs for real here")
    except Exception:
        pass
    p = bench(["--bytes", "8", "--device", "gpu"], env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("ddl: error: --device gpu:") == 1 and "Traceback" not in p.stderr, p.stderr


# ---- argument errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--bytes", "lots"], "cannot parse size"),
    (["--bytes", "1MiB:8"], "below its start"),
    (["--bytes", "8", "--max-bytes", "64", "--factor", "1"], "--factor must be at least 2"),
    (["--bytes", "8,64", "--max-bytes", "1MiB"], "--max-bytes needs a single"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--warmup", "x"], "--warmup must be a whole number"),
    (["--dtype", "float8"], "--dtype 'float8' is not supported"),
    (["--op", "prod"], "--op 'prod' is not supported"),
    (["--peers", "magic"], "--peers: unknown name 'magic'"),
    (["--peers", "none,mpi"], "--peers: 'none' stands alone"),
    (["--peers", "mpi,"], "--peers: an empty entry in 'mpi,'"),
    (["--algorithms", ","], "--algorithms: an empty entry in ','"),
    (["--peers", "nccl"], "--peers nccl compares GPU buffers: add --device gpu"),
    (["--device", "tpu"], "--device 'tpu': choose cpu or gpu"),
    (["--device", "gpu", "--peers", "mpi,gloo"], "--peers gloo runs on host buffers"),
    (["--algorithms", "magic"], "--algorithms: unknown name 'magic'"),
    (["--plot", "/nonexistent-dir/x.png"], "does not exist"),
    (["--plot", "out.txt"], "write a .png"),
    (["--scale", "-1"], "--scale must be a positive number"),
    (["--no-rate-check"], "--no-rate-check applies to --emulate only"),
    (["--mtu", "9000"], "--mtu applies to --emulate only"),
    (["--emulate", "--mtu", "jumbo"], "--mtu must be a whole number of bytes from 1280 to 65535"),
    (["--emulate", "--mtu", "70000"], "--mtu must be a whole number of bytes from 1280 to 65535"),
    (["--links"], "--links reads the counters of emulated links: add --emulate"),
    (["--trace", "/nonexistent-dir/t.json"], "--trace /nonexistent-dir/t.json: folder /nonexistent-dir does not exist"),
    (["--device", "gpu", "--trace", "t.json"], "--trace follows the messages of ddl's host executor"),
])
def test_argument_errors_exit_2_with_one_line(args, message, topo_file, capsys, monkeypatch):
    for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "DDL_EMULATED_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    assert main(["bench", topo_file, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddl: error:") and err.count("\n") == 1 and message in err, err


def test_names_are_read_in_any_case_alike():
    """(--peers MPI and --algorithms RING were accepted, --op MAX and --dtype FLOAT32 refused.)"""
    from ddl.bench import options
    opts = options(peers="MPI", algorithms="RING", op="MAX", dtype="Float64", device="CPU")
    assert (opts.peers, opts.algorithms, opts.op, opts.dtype, opts.device) == (["mpi"], ["auto", "ring"], "max",
                                                                              "float64", "cpu")


def test_missing_file_and_emulate_under_mpi(capsys, monkeypatch, tmp_path):
    assert main(["bench", "no-such.yaml"]) == 2
    assert "no-such.yaml: no such topology file" in capsys.readouterr().err
    assert main(["bench", str(tmp_path)]) == 2
    assert "is a folder: name a topology file in it" in capsys.readouterr().err
    monkeypatch.setenv("PMI_RANK", "0")
    assert main(["bench", str(ROOT / "topologies/emulated-flat.yaml"), "--emulate"]) == 2
    assert "without mpiexec" in capsys.readouterr().err
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("DDL_TOPOLOGY", raising=False)
    for args in (["--emulate"], ["--nranks", "2", "--emulate"]):     # (the second was told --nranks is wrong)
        assert main(["bench", *args]) == 2
        assert "ddl: error: --emulate needs a topology FILE" in capsys.readouterr().err


def test_a_launched_job_killed_by_a_signal_exits_as_a_shell_says():
    from ddl.cli.bench import _child
    assert _child([sys.executable, "-c", "import os, signal; signal.signal(signal.SIGPIPE, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGPIPE)"]) == 141


def test_cli_error_has_no_traceback(env):
    p = subprocess.run([sys.executable, "-m", "ddl", "bench", "--bytes", "8:", "--iters", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("ddl: error: --bytes") and p.stderr.count("\n") == 1, p.stderr


# ---- pure helpers ------------------------------------------------------------------------------------------
def test_size_ranges():
    assert parse_sizes("8:64") == [8, 16, 32, 64]
    assert parse_sizes("8", "32MiB", "4")[-1] == 32 << 20 and parse_sizes("8", "64MiB", "4")[:3] == [8, 32, 128]
    assert parse_sizes("1KiB:4KiB:4,64MiB,1KiB") == [1024, 4096, 64 << 20]
    assert parse_sizes("8:100") == [8, 16, 32, 64]
    with pytest.raises(Error, match="at most 64"):
        parse_sizes("1:1GiB,3:3GiB,5:5GiB")
    with pytest.raises(Error, match="start above 0"):
        parse_sizes("0:8")
    with pytest.raises(Error, match="nothing to measure"):
        parse_sizes("8,0")


def test_sizes_are_whole_elements_rounded_down_once():
    from ddl.bench import element_counts
    assert element_counts([8, 7, 1000, 1 << 20], 8) == [1, 125, 1 << 17]     # 7 B is no float64
    assert element_counts([1, 3, 4, 7, 8], 4) == [1, 2]                      # 4 and 7 B: one row


def test_pattern_sums_are_exact():
    import numpy as np
    for dtype in ("float32", "int32"):
        total = sum(pattern(1000, r, dtype).astype(np.float64) for r in range(8))
        assert np.array_equal(total, expected(1000, 8, dtype, "sum"))
        assert np.array_equal(np.maximum.reduce([pattern(1000, r, dtype) for r in range(8)]),
                              expected(1000, 8, dtype, "max"))


@needs_mpi
@pytest.mark.parametrize("args,says", [(["--iters", "0"], "--iters"), (["--peers", "nobody"], "nobody"),
                                       (["--dtype", "float99"], "float99"), (["--bogus"], "--bogus")])
def test_an_option_error_under_mpiexec_is_said_once(topo_file, env, args, says):
    out = bench([topo_file, *args], env, mpi=3)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and says in lines[0], out.stderr


def test_plot_targets_are_checked_before_the_run(tmp_path):
    from ddl.bench import check_plot_path
    folder = tmp_path / "taken.png"
    folder.mkdir()
    with pytest.raises(Error, match="is a folder"):
        check_plot_path(str(folder))
    check_plot_path(str(tmp_path / "fine.png"))


def test_every_algorithm_name_fits_its_column():
    """Rows are printed as they come, so the columns are sized for every name from the start."""
    from ddl.algorithms import ALGORITHMS
    from ddl.bench_report import format_row, table_header, widths_for
    widths = widths_for(["ddl", "ddl:reduce-broadcast-trees", "mpi"])
    header = table_header(widths).splitlines()[0]
    for name in ALGORITHMS:
        row = {"bytes": 1 << 20, "count": 1 << 18, "dtype": "float32", "op": "sum", "impl": "ddl", "seconds": 1e-3,
               "algbw": 1e9, "busbw": 1e9, "wrong": 0, "algorithm": name, "predicted_seconds": 1e-3,
               "bound_seconds": 1e-3}
        line = format_row(row, widths)
        assert len(line) == len(header), (name, line, header)
        assert line.index(name) + len(name) < header.index("predicted"), (name, line)


def test_a_time_under_the_bound_is_footnoted_with_its_cause():
    """On an emulated cluster small sizes pass the shapers' buckets unshaped; elsewhere a fabric faster
    than its file, or SHARP, can beat a bound made for point-to-point transfers."""
    import io
    from ddl.bench_report import print_summary

    def row(impl, seconds, bound=1e-3):
        return {"bytes": 16384, "count": 4096, "dtype": "float32", "op": "sum", "impl": impl, "seconds": seconds,
                "algbw": 1e6, "busbw": 1e6, "wrong": 0, "algorithm": "ring" if impl == "ddl" else "-",
                "predicted_seconds": None, "bound_seconds": bound}

    def summary(rows, emulated):
        out = io.StringIO()
        print_summary(rows, out, emulated=emulated)
        return [line for line in out.getvalue().splitlines() if "under the bound" in line]

    rows = [row("ddl", 2.65e-3), row("mpi", 0.68e-3), row("gloo", 0.99e-3)]
    emulated, = summary(rows, True)
    assert "mpi at 16 KiB (0.68)" in emulated and "gloo" not in emulated and "token bucket" in emulated
    real, = summary(rows, False)
    assert "mpi at 16 KiB (0.68)" in real and "SHARP" in real
    assert summary([row("ddl", 1e-3), row("mpi", 0.99e-3), row("x", 0.5e-3, bound=None)], True) == []


def test_a_time_far_over_its_prediction_points_at_the_probe():
    """From 1 MiB up, a ddl time 1.5 times its prediction or more says how to check the file's rates."""
    import io
    from ddl.bench_report import print_summary

    def notes(nbytes, seconds, impl="ddl", file="cluster.yaml"):
        r = {"bytes": nbytes, "count": nbytes // 4, "dtype": "float32", "op": "sum", "impl": impl,
             "seconds": seconds, "algbw": 1e6, "busbw": 1e6, "wrong": 0, "algorithm": "ring",
             "predicted_seconds": 1.0, "bound_seconds": 0.9}
        out = io.StringIO()
        print_summary([r], out, topology_file=file)
        return [line for line in out.getvalue().splitlines() if "slower than predicted" in line]
    note, = notes(64 << 20, 2.1)
    assert "ddl at 64 MiB (2.10)" in note and "`ddl topo probe cluster.yaml`" in note and "--write OUT" in note
    flat, = notes(64 << 20, 2.1, file=None)
    assert "no topology file" in flat and "10 GB/s per rank" in flat and "--write OUT" in flat
    assert notes(64 << 20, 1.4) == [] and notes(512 << 10, 3.0) == [] and notes(64 << 20, 3.0, "mpi") == []


def test_a_slow_run_under_open_mpi_points_at_its_tcp_eager_limit(monkeypatch):
    """ddl's pieces above Open MPI's TCP eager limit ran at 0.6 times the links' rate (README, "Another
    MPI"); a slow run under Open MPI with the limit left alone says so, and only then."""
    import io
    from ddl.bench_report import print_summary

    def hint(seconds, library="Open MPI v5.0.11, package: Open MPI"):
        r = {"bytes": 64 << 20, "count": 16 << 20, "dtype": "float32", "op": "sum", "impl": "ddl",
             "seconds": seconds, "algbw": 1e6, "busbw": 1e6, "wrong": 0, "algorithm": "ring",
             "predicted_seconds": 1.0, "bound_seconds": 0.9}
        out = io.StringIO()
        print_summary([r], out, topology_file="cluster.yaml", mpi_library=library)
        return [line for line in out.getvalue().splitlines() if "eager limit" in line]
    monkeypatch.delenv("OMPI_MCA_btl_tcp_eager_limit", raising=False)
    note, = hint(1.7)
    assert "export OMPI_MCA_btl_tcp_eager_limit=1048576" in note and "Another MPI" in note
    assert hint(1.2) == [] and hint(1.7, "MPICH Version:      5.0.2") == []
    monkeypatch.setenv("OMPI_MCA_btl_tcp_eager_limit", "1048576")
    assert hint(1.7) == []
    monkeypatch.delenv("OMPI_MCA_btl_tcp_eager_limit")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_flags", "send,inplace,need-ack,need-csum")     # the other remedy
    assert hint(1.7) == []


# ---- a job's ranks end together --------------------------------------------------------------------------
def _descendants(pid):
    """Every process below ``pid`` (Linux /proc): MPI launchers start the ranks in sessions of their
    own, so a hung job's process group would not take them with it."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_job(proc):
    """SIGKILL mpiexec and every process it started (so that a hung test leaves none spinning)."""
    import signal
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def job(cmd, env, timeout=45, cwd=ROOT):
    """Run an MPI job; one still running after ``timeout`` s has hung: it is killed, the test fails."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        out, err = proc.communicate()
        pytest.fail(f"the job hung (killed after {timeout} s): {' '.join(cmd)}\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, without_launcher_report(err))


_IN_MY_FOLDER = """import os, sys
from ddl.cli import launcher_rank, main
rank = launcher_rank()
os.chdir(f"r{rank}")          # each rank in a folder of its own, as on hosts that differ
status = main(["bench", *sys.argv[1:]])
open("status", "w").write(str(status))
sys.exit(status)
"""


@needs_mpi
def test_ranks_given_different_options_are_told_once(env):
    """An MPMD launch gives each rank its own command line: the ranks compare the options that decide what
    they send before anything runs (they used to meet in the first allreduce, each reporting its mismatch)."""
    ddl_bench = [sys.executable, "-m", "ddl", "bench", "--iters", "1"]
    cmd = [*mpi_command(1), *ddl_bench, "--bytes", "1MiB", ":", "-n", "1", *ddl_bench, "--bytes", "2MiB", "--op", "max"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    lines = without_launcher_report(p.stderr).splitlines()
    assert p.returncode == 2 and lines == ["ddl: error: the ranks were given different options (rank 0: --bytes "
                                           "1MiB --op sum; rank 1: --bytes 2MiB --op max); give every rank the "
                                           "same command line"], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == "", p.stdout


def bench_in_rank_folders(tmp_path, env, args, files):
    """``ddl bench ARGS`` on 2 ranks, rank r working in ``tmp_path/r<r>`` where ``files`` (path: text,
    or None for a folder) are made; returns the run and each rank's exit status (None: it never said)."""
    for path, text in files.items():
        target = tmp_path / path
        if text is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    for r in (0, 1):
        (tmp_path / f"r{r}").mkdir(exist_ok=True)
    script = tmp_path / "in_my_folder.py"
    script.write_text(_IN_MY_FOLDER)
    e = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = job([*mpi_command(2), sys.executable, str(script), *args], e, cwd=tmp_path)
    statuses = []
    for r in (0, 1):
        status = tmp_path / f"r{r}" / "status"
        statuses.append(int(status.read_text()) if status.exists() else None)
    return p, statuses


@needs_mpi
@pytest.mark.parametrize("files, args, says", [
    ({"r1/sub": None}, ["--plot", "sub/x.png"], "--plot sub/x.png: folder"),                # rank 0 lacks it
    ({"r0/t.yaml": TWO_RANKS}, ["t.yaml"], "t.yaml: no such topology file"),               # rank 1 lacks it
    ({"r0/t.yaml": TWO_RANKS, "r1/t.yaml": "ranks: [\n"}, ["t.yaml"], "t.yaml"),           # rank 1 cannot load it
], ids=["plot-folder-on-rank-1-only", "topology-on-rank-0-only", "topology-broken-on-rank-1"])
def test_an_error_on_one_rank_ends_every_rank_said_once(tmp_path, env, files, args, says):
    p, statuses = bench_in_rank_folders(tmp_path, env, ["--bytes", "64", "--iters", "1", *args], files)
    assert p.returncode == 2 and statuses == [2, 2], (statuses, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddl: error:") and says in lines[0], p.stderr
    assert p.stdout == "", p.stdout


@needs_mpi
def test_only_rank_0_checks_the_plot_folder(tmp_path, env):
    """Rank 0 alone writes the plot, in its own working folder: another rank's folders do not matter."""
    p, statuses = bench_in_rank_folders(tmp_path, env, ["--bytes", "64", "--iters", "1", "--plot", "sub/x.png"],
                                        {"r0/sub": None})
    assert p.returncode == 0 and statuses == [0, 0], (statuses, p.stdout, p.stderr)
    assert (tmp_path / "r0" / "sub" / "x.png").stat().st_size > 1000


def _wait_for_output(stream, marker, seconds):
    """Read ``stream`` (a pipe) until ``marker`` has come (True) or ``seconds`` have passed (False)."""
    import select
    import time
    deadline, seen = time.monotonic() + seconds, b""
    while marker not in seen and time.monotonic() < deadline:
        if select.select([stream], [], [], max(deadline - time.monotonic(), 0))[0]:
            chunk = os.read(stream.fileno(), 1 << 16)
            if not chunk:
                break
            seen += chunk
    return marker in seen


def _interrupted_in_its_table(argv, env, signal_it, limit):
    """Start ``argv``, wait until its table has started and a second more, ``signal_it(proc)``; return
    its exit status and stderr once it ended (failing the test if it did not within ``limit`` s)."""
    import time
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert _wait_for_output(proc.stdout, b"(elements)", 60), "the table never started"
        time.sleep(1)                                    # into the timed iterations
        signal_it(proc)
        status = proc.wait(timeout=limit)
    except (subprocess.TimeoutExpired, AssertionError) as exc:
        _kill_job(proc)
        pytest.fail(f"{exc or f'the job did not end within {limit} s of the signal'}: "
                    f"{proc.stderr.read()[-2000:]!r}")
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    return status, err


@needs_mpi
def test_sigint_to_mpiexec_ends_the_whole_job_at_once(env):
    """``kill -INT`` of mpiexec (a job script's way to stop a job): MPICH's mpiexec passes SIGINT on to
    the ranks; the rank that notices first must end the job, not leave the others waiting for it in a
    collective. The ranks sit in different places each time, so a few rounds. (Open MPI's kills the
    ranks itself: the job must still end at once.)"""
    import signal
    peers = "mpi,gloo" if not torch_problem_here() else "mpi"
    for _round in range(4):
        status, err = _interrupted_in_its_table(
            [*mpi_command(2), sys.executable, "-m", "ddl", "bench", "--bytes", "4MiB", "--iters", "20000",
             "--peers", peers, "--no-progress"], env, lambda proc: proc.send_signal(signal.SIGINT), 10)
        if flavor(MPIEXEC) == OPEN_MPI:      # it does not pass SIGINT on but kills the ranks: ended, silently
            assert status != 0, (status, err)
        else:
            assert status == 130 and "ddl: interrupted" in err, (status, err)


@needs_mpi
def test_ctrl_c_to_a_bench_that_launched_its_ranks_says_interrupted_once(env):
    """Ctrl-C in a terminal reaches the whole foreground process group: ``ddl bench``, the mpiexec it
    launched and the ranks. The job ends with 130, and ddl says so once (the rank that ended the job
    used to say it too), last."""
    import signal
    status, err = _interrupted_in_its_table(
        [sys.executable, "-m", "ddl", "bench", "--nranks", "2", "--bytes", "4MiB", "--iters", "20000",
         "--peers", "mpi", "--no-progress"], env, lambda proc: os.killpg(proc.pid, signal.SIGINT), 30)
    assert status == 130, (status, err)
    assert err.count("ddl: interrupted") == 1 and err.rstrip().endswith("ddl: interrupted"), err


def test_an_aborting_rank_waits_until_the_launcher_has_read_its_last_line(tmp_path):
    """MPI_Abort makes mpiexec kill the job at once: a last line still in the rank's stderr pipe would
    be lost, leaving a status and no reason. The rank waits for the pipe to be read, boundedly."""
    import threading
    import time
    from ddl.emulate.launch import _wait_until_read
    r, w = os.pipe()
    with os.fdopen(w, "w") as writer, os.fdopen(r, "rb") as reader:
        writer.write("ddl: interrupted\n")
        writer.flush()
        reads = threading.Timer(0.3, lambda: reader.read1(100))
        start = time.monotonic()
        reads.start()
        _wait_until_read(writer, seconds=10)
        waited = time.monotonic() - start
        reads.join()
        assert 0.3 <= waited < 5, waited                   # until the reader took the line, no longer
        writer.write("never read\n")
        writer.flush()
        start = time.monotonic()
        _wait_until_read(writer, seconds=0.2)              # a reader that has stopped: bounded
        assert 0.2 <= time.monotonic() - start < 2
    with open(tmp_path / "log", "w") as file:              # a file has no reader to wait for
        file.write("x")
        start = time.monotonic()
        _wait_until_read(file, seconds=10)
        assert time.monotonic() - start < 1


def torch_problem_here():
    from ddl.bench import torch_problem
    return torch_problem()


# ---- usage errors are one line, before anything else -------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("args, says", [
    (["--bytes", "1"], "ddl: error: --bytes: every size is below one float32 element (4 B)"),
    (["--bytes", "MEMORY"], "of memory on one machine"),
    (["--plot", ""], "ddl: error: --plot needs a file name"),
    (["-b", "1", "-e", "1:2"], "--max-bytes '1:2': one size"),
    (["--bytes", "8,16", "-f", "4"], "--factor 4 is the step of a range MIN:MAX"),
])
def test_usage_errors_under_mpiexec_are_one_line_and_nothing_else(env, args, says):
    if "MEMORY" in args:       # three buffers of the machine's whole memory cannot fit
        args = [str(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4 * 4 + 4) if a == "MEMORY" else a
                for a in args]
    p = job([*mpi_command(2), sys.executable, "-m", "ddl", "bench", "--iters", "1", *args], env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and says in p.stderr, (p.stdout, p.stderr)


def test_size_options_that_would_be_ignored_are_refused():
    with pytest.raises(Error, match=r"--max-bytes '64:4': one size.*--factor"):
        parse_sizes("8", "64:4")
    with pytest.raises(Error, match=r"--factor 4 is the step of a range MIN:MAX.*--bytes 8:64MiB --factor 4"):
        parse_sizes("8,16", None, "4")
    with pytest.raises(Error, match="--factor 2 is the step"):
        parse_sizes("8:64:4", None, "2")               # the range has its own step
    assert parse_sizes("8:64,1KiB", None, "4") == [8, 32, 1024]


def test_memory_is_checked_for_the_ranks_that_share_a_machine(monkeypatch):
    from ddl.bench import check_sizes
    pages = {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 1 << 20}          # 1000 MiB
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    check_sizes([200 << 20], "float32", "cpu", ranks_here=1)
    with pytest.raises(Error, match=r"200 MiB per buffer needs about 1.17.? GiB .*2 ranks"):
        check_sizes([200 << 20], "float32", "cpu", ranks_here=2)
    check_sizes([200 << 20], "float32", "gpu", ranks_here=2)        # device buffers: not host memory
    with pytest.raises(Error, match="below one float64 element"):
        check_sizes([1, 7], "float64")


def test_links_go_on_to_the_emulated_job_and_their_block_lists_the_busiest_first(topo_file):
    from ddl.bench import options
    from ddl.bench_report import LINK_LINES, link_lines
    from ddl.cli.bench import forward_argv
    assert "--links" in forward_argv(options(topology=topo_file, links=True))
    assert "--links" not in forward_argv(options(topology=topo_file))
    argv = forward_argv(options(topology=topo_file, trace="t.json"))
    assert argv[argv.index("--trace") + 1] == os.path.abspath("t.json")
    assert "--trace" not in forward_argv(options(topology=topo_file))
    names = [f"l{i}" for i in range(LINK_LINES + 2)]
    ddl_row = {"impl": "ddl", "link_bytes": {n: 1000.0 * i for i, n in enumerate(names)},
               "link_bytes_planned": {n: 900.0 * i for i, n in enumerate(names)}}
    mpi_row = {"impl": "mpi", "link_bytes": {n: 20000.0 if n == "l0" else 0.0 for n in names}}
    lines = link_lines([ddl_row, mpi_row])
    assert lines[0].startswith("# bytes per iteration on the emulated links") and "plan:" in lines[0]
    assert lines[1].split() == ["#", "link", "ddl", "mpi", "ddl", "plan"]
    body = [line.split() for line in lines[2:-1]]
    # l0 first (mpi's 20000 B are the most on any link), then by ddl's bytes, busiest first
    assert [b[1] for b in body] == ["l0", "l11", "l10", "l9", "l8", "l7", "l6", "l5", "l4", "l3"]
    assert body[0][2:] == ["0", "B", "19.53", "KiB", "0", "B"] and body[1][2:4] == ["10.74", "KiB"]
    assert lines[-1] == "#   ... and 2 less busy links (--json lists every link)"
    assert link_lines([{"impl": "ddl"}]) == []          # no --links: no block
    assert "plan" not in link_lines([mpi_row])[0]
