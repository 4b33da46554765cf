"""Safety nets under real mpiexec: mismatch errors on every rank, argument errors, stall watchdog,
a dying rank taking the job down."""
import re

import pytest

from mpi_cases._launch import run_mpi, run_ok


@pytest.mark.parametrize("n,agreement", [(2, "auto"), (5, "auto"), (3, "mpi")])
def test_mismatch_and_argument_errors(n, agreement):
    """auto: the shared-memory agreement (one node); mpi: MPI_Iallreduce + MPI_Iallgather on mismatch."""
    out = run_ok(n, "errors.py", timeout=180, env={"DDL_AGREEMENT": agreement})
    m = re.search(r"RESULT errors: (\d+) checks passed on (\d+) ranks", out)
    assert m and int(m.group(2)) == n and int(m.group(1)) >= 40 * n, out[-3000:]
    # the message names the odd rank out and both counts
    assert f"rank {n - 1} called Allreduce with 1001 float32" in out
    assert "called Allreduce with 1000 float32" in out


@pytest.mark.parametrize("agreement", ["auto", "mpi"])
def test_stall_watchdog_names_the_sleeping_rank(agreement):
    n = 3
    out = run_ok(n, "stall.py", timeout=120, mpi4py_main=False, env={"DDL_AGREEMENT": agreement})
    assert "DONE" in out
    assert "ddl WARNING" in out                       # the early warning on stderr
    for scenario, before in ((1, 2.9), (2, 2.9), (3, 5.9)):
        for rank in range(n - 1):                     # every waiting rank raised StallError ...
            line = re.search(rf"STALL{scenario} rank {rank} after ([\d.]+)s: (.*)", out)
            assert line, f"rank {rank} did not raise StallError in scenario {scenario}:\n{out[-4000:]}"
            assert float(line.group(1)) < before      # ... at the stall timeout (1 s; 2.5 s while polling),
            #                                               before the sleeper woke (3 s; 6 s)
            # ... naming the sleeping rank (shared-memory agreement: "for rank 2, which has not entered it";
            # MPI agreement or data phase: "no word from rank 2")
            assert re.search(r"no word from rank 2|for rank 2, which has not entered it", line.group(2)), line.group(2)
            # no waiting rank finishes; the sleeper may, when all it needs had arrived before it slept
            assert f"NOSTALL{scenario} rank {rank}\n" not in out
    # the rank that arrives after the others gave up raises too, naming them (it once agreed, on the shared-memory
    # board, with the rows they had abandoned and returned a sum computed alone)
    others = "ranks 0, 1"
    for scenario in (1, 3):
        line = re.search(rf"STALL{scenario} rank 2 after [\d.]+s: (.*)", out)
        assert line and f"{others} gave up on it" in line.group(1), \
            f"scenario {scenario}: the late rank 2 did not raise StallError naming {others}:\n{out[-4000:]}"
    # a reduction that raises on rank 2: its own call raises that error, its communicator refuses the next call
    # at once, and the others' StallError says that rank 2 failed in it
    assert "FAILED4 rank 2: simulated failure of a reduction" in out, out[-4000:]
    assert re.search(r"REFUSED4 rank 2 after 0\.\ds: this ddl communicator is unusable after an earlier failure: "
                     r"RuntimeError in collective #0", out), out[-4000:]
    for rank in range(n - 1):
        assert re.search(rf"STALL4 rank {rank} after [\d.]+s: .*rank 2 failed in it with an error of its own",
                         out), out[-4000:]
    # the data-phase stall names the steps (op index, chunk, peer) it waits for
    assert re.search(r"STALL2 rank \d after [\d.]+s: .*waiting for rank \d .*op \d+ \((reduce|recv) chunk \d+ from rank \d\)", out)
    assert re.search(r"STALL1 rank 0 .*agreement step", out)
    if agreement == "auto":     # on the board: the rank not heard from is away, not in some other call of ours
        assert re.search(r"STALL1 rank 0 .*rank 2: busy outside this communicator \(computing, in another ddl "
                         r"communicator's collective or another MPI call\) or dead", out), out[-4000:]
    # an unchecked call (scenario 2: check="off") may stall for want of matching arguments: it says so
    unchecked = "this call was not checked against the other ranks' (check='new' checks a signature"
    assert all(unchecked in line for line in re.findall(r"STALL2 rank [01] .*", out)), out[-4000:]
    assert not any(unchecked in line for line in re.findall(r"STALL[13] rank \d .*", out))
    # a post that cannot start yet returns at once; waiting for it, the others name the rank that holds it up
    # (through MPI, whose agreement needs no board slot, they wait in the first call's data for the sleeper)
    for rank in range(n - 1):
        line = re.search(rf"STALL7 rank {rank} after ([\d.]+)s: (.*)", out)
        assert line and float(line.group(1)) < 2.9, out[-4000:]
        if agreement == "auto":
            assert "NOSTALL7 rank 2" in out, out[-4000:]
            assert "not started: rank 2 has not finished ddl collective #0, whose slot on the shared agreement " \
                   "board this one takes" in line.group(2), line.group(2)
    # a rank that waits only after the others gave up ends at once, and so does its next call: told that they gave
    # up, it does not wait a stall_timeout for them (it did; and when all it needed had arrived before they gave up,
    # its call completed and the next one waited the timeout, calling them "stuck" in the call they had left)
    for rank in range(n - 1):
        line = re.search(rf"STALL8 rank {rank} after ([\d.]+)s: .*no word from rank 2", out)
        assert line and float(line.group(1)) < 2.9, out[-4000:]
    wait = re.search(r"LATE8 rank 2 wait (ok|after 0\.[0-4]s: StallError: .*cannot complete.*ranks 0, 1 gave up on it "
                     r"\(StallError\) and will not take part; this communicator is unusable now)", out)
    assert wait, out[-4000:]
    later = (r"StallError: .*ranks 0, 1 gave up on ddl collective #0 \(StallError\) and will not take part in any "
             r"later one" if wait.group(1) == "ok" else "Error: this ddl communicator is unusable after an earlier failure")
    assert re.search(rf"LATE8 rank 2 next after 0\.[0-4]s: {later}", out), out[-4000:]
    # the first warning of a waiting rank does not count a rank that waits in the same collective as silent (every
    # waiting rank once heard from no one before its own warning): scenario 2, check="off", says "not checked"
    for rank in range(n - 1):
        other = 1 - rank
        warning = re.search(rf"ddl WARNING: .*on rank {rank} has made no progress.*this call was not checked.*", out)
        assert warning and f"rank {other} is stuck in it too" in warning.group(0) and \
            "no word from ranks" not in warning.group(0), out[-4000:]
    # Free is collective, and no rank hangs in MPI's frees (the last rank once did, for ever): freeing where the
    # others call Allreduce is a mismatch on every rank at once; the rank that freed is gone, so the others'
    # communicator is unusable (they once waited stall_timeout in their own Free for it) and their Free lets go
    for rank in range(n):
        what = "free" if rank == n - 1 else "call"
        assert re.search(rf"FREE5 rank {rank} {what} after 0\.\ds: MismatchError: .*rank 2 called Free; ranks 0, 1 "
                         rf"called Allreduce", out), out[-4000:]
    for rank in range(n - 1):
        assert re.search(rf"FREE5 rank {rank} again after 0\.\ds: Error: this ddl communicator is unusable after an "
                         rf"earlier failure: MismatchError in collective #0, where rank 2 freed the communicator", out), \
            out[-4000:]
        assert f"FREE5 rank {rank} free ok" in out, out[-4000:]
    # ... and a rank that frees after the others gave up on it is told so, while they let go at once
    assert re.search(r"FREE6 rank 2 free after [\d.]+s: StallError: Free\(\) .*ranks 0, 1 gave up on it", out), out[-4000:]
    assert all(f"FREE6 rank {rank} free ok" in out for rank in range(n - 1)), out[-4000:]


def test_a_dying_rank_takes_the_job_down():
    rc, out, secs = run_mpi(3, "abort.py", timeout=90, mpi4py_main=True)
    assert rc != 0
    assert "simulated failure on rank 1" in out
    assert re.search(r"process 1|rank 1", out)
    assert secs < 60
    assert "finished" not in out


def test_a_dying_rank_without_mpi4py_main_ends_in_stall_error():
    """Without ``-m mpi4py`` nobody aborts; the survivors' watchdog ends the job, naming the rank."""
    rc, out, secs = run_mpi(3, "abort.py", 3, timeout=90, mpi4py_main=False)
    assert rc != 0
    assert "simulated failure on rank 1" in out
    assert "StallError" in out or "process 1" in out
    assert secs < 60
