"""The example and benchmark scripts as README.md runs them, and three small planners on odd fabrics.

Scripts: every one answers ``--help``; a bad argument (or a topology file that is missing or made for
another rank count) is one line on stderr and exit status 2, said once under mpiexec, never a
traceback; the GPU benchmark says it has no device and exits non-zero. Planners:
``recursive-doubling``, ``reduce-broadcast-trees`` and ``ring-packing`` on 2, 3, 5, 6 and 7 ranks,
every collective and broadcast root, tiny sizes: proved, simulated, deterministic, or a PlanError.
"""
import concurrent.futures
import math
import os
import subprocess
import sys
import traceback

import pytest

from ddl.algorithms import ALGORITHMS
from ddl.errors import PlanError
from ddl.simulate import simulate
from ddl.topology import Topology
from ddl.verify import verify
from mpi_cases._launch import ROOT, plan_cache, run_mpi
from test_algorithms import cluster, ring_beside_pairs

SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("examples", "benchmarks") for p in (ROOT / d).glob("*.py"))

# (script, arguments, what the error line says); every one must exit 2 with "<script>: error: ..."
BAD_ARGUMENTS = [
    ("examples/allreduce_hello.py", ["--size", "abc"], "cannot parse size 'abc'"),
    ("examples/allreduce_hello.py", ["missing-topology.yaml"], "no such file"),
    ("examples/allreduce_hello.py", ["--size", "1000001"], "not a whole number of float32 elements"),  # was: rounded
    ("examples/allreduce_hello.py", ["--size", "0"], "not a whole number of float32 elements"),      # was: 4 B
    ("examples/allreduce_hello.py", ["--size", "1EiB"], "a rank has not enough memory"),             # a traceback
    ("examples/train_mlp.py", ["--steps", "0"], "at least 2"),
    ("examples/train_mlp.py", ["--steps", "1"], "at least 2"),          # was: TRAIN_MLP MISMATCH, status 1
    ("examples/train_mlp.py", ["--topology", "missing-topology.yaml"], "no such file"),
    ("examples/local_sgd.py", ["--rounds", "0"], "at least 1"),
    ("examples/local_sgd.py", ["--tau", "0"], "at least 1"),
    ("examples/torch_hook.py", ["--steps", "0"], "at least 1"),          # was: TORCH_HOOK OK on no steps
    ("benchmarks/bench_overhead.py", ["--sizes", "abc"], "cannot parse size 'abc'"),
    ("benchmarks/bench_overhead.py", ["--iters", "x"], "not an integer"),
    ("benchmarks/bench_overhead.py", ["--rounds", "0"], "at least 1"),
    ("benchmarks/bench_overhead.py", ["--dtype", "foo"], "not a numpy dtype"),
    ("benchmarks/bench_overhead.py", ["--sizes", "8", "--iters", "5,6"], "2 values for 1 size"),
    ("benchmarks/bench_alternation.py", ["--cycles", "0"], "at least 1"),
    ("benchmarks/bench_alternation.py", ["--bytes", "abc"], "cannot parse size 'abc'"),
    ("benchmarks/bench_small.py", ["--bytes", "abc"], "cannot parse size 'abc'"),
    ("benchmarks/bench_small.py", ["--rounds", "0"], "at least 1"),
    ("benchmarks/bench_plan_scale.py", ["--racks", "x"], "not an integer"),
    ("benchmarks/bench_plan_scale.py", ["--bytes", "x"], "cannot parse size 'x'"),
    ("benchmarks/bench_plan_scale.py", ["--workers", "0"], "at least 1"),
    ("benchmarks/bench_gpu_kernels.py", ["--sizes", "abc"], "cannot parse size 'abc'"),
    ("benchmarks/bench_gpu_kernels.py", ["--op", "band"], "BAND needs an integer"),
]
CASES = [(s, ["--help"]) for s in SCRIPTS] + [(s, a) for s, a, _ in BAD_ARGUMENTS] \
    + [("benchmarks/bench_gpu_kernels.py", ["--iters", "1", "--sizes", "1MiB"])]


def _run(script, args):
    env = dict(os.environ, DDL_CACHE_DIR=plan_cache(), PYTHONUNBUFFERED="1")
    env.pop("DDL_TOPOLOGY", None)
    try:
        return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired as exc:     # e.g. `demo.py --help` running the whole demo
        return subprocess.CompletedProcess(exc.cmd, None, "", f"did not finish within {exc.timeout} s")


@pytest.fixture(scope="module")
def ran():
    """Every single-process case at once (each is a Python start-up, mostly), keyed by (script, args)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = {(s, tuple(a)): pool.submit(_run, s, a) for s, a in CASES}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(ran, script):
    """examples/demo.py took no arguments: ``--help`` ran the whole demo."""
    proc = ran[(script, ("--help",))]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ") and "-h, --help" in proc.stdout


@pytest.mark.parametrize("script, args, says", BAD_ARGUMENTS, ids=[f"{s.split('/')[1]}:{' '.join(a)}"
                                                                   for s, a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_and_status_2(ran, script, args, says):
    proc = ran[(script, tuple(args))]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{os.path.basename(script)}: error: ") and says in last, proc.stderr


def test_gpu_kernel_benchmark_without_a_device_fails_clearly(ran):
    """It printed 'no CUDA device ... nothing to benchmark' on stdout and exited 0, as if it had measured."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present")
    except Exception:
        pass
    proc = ran[("benchmarks/bench_gpu_kernels.py", ("--iters", "1", "--sizes", "1MiB"))]
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


# ---- under mpiexec: a mistake is said once and every rank exits 2 -------------------------------------

def _said_once(out, text):
    return out.count(text) == 1 and "Traceback" not in out


def test_mpi_topology_for_another_rank_count_is_one_line():
    """An 8-rank topology on 2 processes: the Communicator's error was a traceback on every rank."""
    rc, out, _ = run_mpi(2, "examples/allreduce_hello.py", "topologies/emulated-2rack.yaml", timeout=120)
    assert rc == 2 and _said_once(out, "allreduce_hello.py: error: topology 'emulated-2rack'"), out


def test_mpi_bad_arguments_are_said_once():
    """train_mlp.py printed argparse's error once per rank; bench_overhead.py's unknown --algorithm was
    a traceback on every rank."""
    rc, out, _ = run_mpi(2, "examples/train_mlp.py", "--steps", "x", timeout=120)
    assert rc == 2 and _said_once(out, "train_mlp.py: error: argument --steps"), out
    rc, out, _ = run_mpi(2, "benchmarks/bench_overhead.py", "--algorithm", "nope", "--sizes", "8", "--iters", "2",
                         timeout=120, mpi4py_main=False)
    assert rc == 2 and _said_once(out, "bench_overhead.py: error: unknown algorithm 'nope'"), out


def test_mpi_help_is_said_once():
    rc, out, _ = run_mpi(3, "examples/train_mlp.py", "--help", timeout=120)
    assert rc == 0 and out.count("usage: ") == 1 and "--topology" in out, out


def test_mpi_a_training_example_that_fails_says_which_check():
    """The loss diverging at --lr 5 was 'TRAIN_MLP MISMATCH', though the replicas matched bitwise."""
    rc, out, _ = run_mpi(2, "examples/train_mlp.py", "--steps", "3", "--lr", "5", timeout=120)
    assert rc == 1 and "TRAIN_MLP FAILED: the loss did not fall" in out and "a smaller --lr?" in out, out
    rc, out, _ = run_mpi(2, "examples/local_sgd.py", "--rounds", "1", "--tau", "1", timeout=120)
    assert rc == 1 and "LOCAL_SGD FAILED: the loss did not fall below half its start in 1 local step" in out, out


def test_mpi_torch_hook_takes_a_topology_and_says_a_wrong_one_once():
    pytest.importorskip("torch")
    rc, out, _ = run_mpi(2, "examples/torch_hook.py", "--topology", "topologies/emulated-2rack.yaml", timeout=120)
    assert rc == 2 and _said_once(out, "torch_hook.py: error: topology 'emulated-2rack'"), out


def test_mpi_benchmarks_print_their_tables():
    """The README's benchmark commands, small: bench_overhead's and bench_small's tables, ddl against MPI."""
    rc, out, _ = run_mpi(2, "benchmarks/bench_overhead.py", "--sizes", "8,256KiB", "--iters", "6,6", "--rounds", "2",
                         timeout=180, mpi4py_main=False)    # (iterations per size may repeat, as README's do)
    assert rc == 0, out
    lines = out.strip().splitlines()
    assert lines[-3].split()[:4] == ["size", "iters", "algorithm", "chunks"] and "ddl/MPI" in lines[-3], out
    assert lines[-3].split()[-4:] == ["ddl", "CPU", "MPI", "CPU"], out
    row = lines[-2].split()
    assert row[:4] == ["8", "B", "6", "inline"] and row[-1] == "us" and float(row[-2]) > 0, out
    # --board: the bare exchange through ddl's board, checked against MPI's result, then timed beside them;
    # ddl's own calls go on after it (its sequence numbers), so a later size still agrees
    rc, out, _ = run_mpi(2, "benchmarks/bench_overhead.py", "--sizes", "8,4KiB", "--iters", "6,6", "--rounds",
                         "2", "--board", timeout=180, mpi4py_main=False)
    assert rc == 0, out
    lines = out.strip().splitlines()
    assert lines[-3].split()[-6:] == ["MPI", "CPU", "board", "board/MPI", "board", "CPU"], out
    assert [line.split()[:4] for line in lines[-2:]] == [["8", "B", "6", "inline"], ["4", "KiB", "6", "inline"]]
    assert all(float(line.split()[-5]) > 0 and float(line.split()[-3]) > 0 for line in lines[-2:]), out
    # --api functional: ddl's side is comm.allreduce(send), its result checked against MPI's first
    rc, out, _ = run_mpi(2, "benchmarks/bench_overhead.py", "--sizes", "8,256KiB", "--iters", "6,6", "--rounds",
                         "2", "--api", "functional", timeout=180, mpi4py_main=False)
    assert rc == 0 and "ddl allreduce (functional) vs MPI_Allreduce" in out, out
    assert [line.split()[:4] for line in out.strip().splitlines()[-2:]] == [["8", "B", "6", "inline"],
                                                                             ["256", "KiB", "6", "inline"]], out
    rc, out, _ = run_mpi(2, "benchmarks/bench_overhead.py", "--sizes", "2MiB", "--iters", "2", "--board",
                         timeout=180, mpi4py_main=False)
    assert rc == 2 and out.count("--board needs every rank on one host") == 1, out
    rc, out, _ = run_mpi(2, "benchmarks/bench_small.py", "--iters", "4", "--rounds", "2", "--inflight", "3",
                         timeout=180, mpi4py_main=False)
    assert rc == 0 and "2 ranks, 8 B per rank (inline" in out, out
    rows = out.strip().splitlines()[-6:]
    assert [r.split()[0] for r in rows] == ["Allreduce", "Bcast", "Allgather", "Reduce_scatter_block", "Iallreduce",
                                            "iallreduce"], out
    assert "x3 in flight" in rows[4] and "x3 (functional)" in rows[5], out


# ---- planners on small and odd fabrics --------------------------------------------------------------

def _star(bandwidths):
    return Topology.from_dict({
        "name": f"uneven-star-{len(bandwidths)}",
        "nodes": [{"id": "sw", "kind": "switch"}] + [{"id": f"g{i}", "kind": "gpu"} for i in range(len(bandwidths))],
        "links": [{"a": f"g{i}", "b": "sw", "bandwidth": f"{bw} GB/s"} for i, bw in enumerate(bandwidths)],
        "ranks": [f"g{i}" for i in range(len(bandwidths))]})


def _fabrics(p):
    out = [_star([10 + 3 * i for i in range(p)]), ring_beside_pairs(p)]
    if p % 2 == 0:
        out.append(cluster(2, p // 2, interleave=True))
    return out


PLANNERS = {"recursive-doubling": ("allreduce",), "reduce-broadcast-trees": ("allreduce",),
            "ring-packing": ("allreduce", "reduce_scatter", "allgather", "broadcast")}
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_small_planners_on_odd_fabrics(name):
    planned = 0
    for p in (2, 3, 5, 6, 7):
        for topo in _fabrics(p):
            for collective in COLLECTIVES:
                for root in (range(p) if collective == "broadcast" else (0,)):
                    for nbytes in (None, 1, 3, 7):
                        where = (topo.name, collective, root, nbytes)
                        try:
                            sched = ALGORITHMS[name](topo, collective, root=root, nbytes=nbytes)
                        except PlanError as exc:
                            assert str(exc).startswith(name) and len(str(exc)) > len(name) + 10, where
                            assert collective not in PLANNERS[name] or name == "ring-packing", (where, exc)
                            continue
                        assert collective in PLANNERS[name], where
                        verify(sched)
                        for size in {1, 3, 7, nbytes or 4096}:
                            seconds = simulate(topo, sched, size).seconds
                            assert math.isfinite(seconds) and seconds > 0, (where, size, seconds)
                        again = ALGORITHMS[name](topo, collective, root=root, nbytes=nbytes)
                        assert again.to_json() == sched.to_json(), where
                        planned += 1
    assert planned > 0


def test_ring_packing_declines_with_a_new_error_each_time():
    """ring-packing caches why it declines a fabric and raised that one PlanError object again on every
    call: its traceback grew by two frames a call, and it kept as ``__context__`` whatever exception
    the first caller was handling, which later callers' tracebacks then showed."""
    topo = cluster(2, 1)                       # two ranks: one ring

    def declined():
        with pytest.raises(PlanError, match="2 ranks have one ring at most") as info:
            ALGORITHMS["ring-packing"](topo, "allreduce", nbytes=8)
        return info.value

    try:
        raise KeyError("an unrelated error the first caller is handling")
    except KeyError:
        first = declined()
    later = [declined() for _ in range(3)]
    assert len({id(e) for e in [first, *later]}) == 4
    assert all(e.__context__ is None for e in later)
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in later}) == 1
