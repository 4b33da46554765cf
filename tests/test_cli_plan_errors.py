"""``ddl plan`` on wrong input: one line on stderr naming the file, the entry and the fix, exit status 2;
what ``--save`` may replace; the ``--timeline`` strip; the hello example's arguments and path."""
import json
import os
import stat

import pytest

from ddl.cli import main
from ddl.schedule import ScheduleBuilder
from test_schedule import device_or_fifo

T4 = """name: t4
nodes:
  - {id: sw, kind: switch}
  - {id: "h{h}", kind: host, for: {h: 2}}
  - {id: "h{h}/cpu{c}", kind: cpu, for: {h: 2, c: 2}}
links:
  - {a: "h{h}/cpu{c}", b: "h{h}", bandwidth: 1 GB/s, for: {h: 2, c: 2}}
  - {a: "h{h}", b: sw, bandwidth: 100 MB/s, for: {h: 2}}
ranks:
  - {id: "h{h}/cpu{c}", for: {h: 2, c: 2}}
"""


@pytest.fixture
def t4(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "t4.yaml"
    path.write_text(T4)
    return str(path)


def ring(p):
    b = ScheduleBuilder("allreduce", p, (1,) * p, algorithm="ring")
    for phase, reduce in ((1, True), (0, False)):
        for t in range(p - 1):
            for i in range(p):
                b.transfer(i, (i + 1) % p, (i - t - phase) % p, reduce=reduce)
    return b.build()


def one_error(capsys, argv):
    """Run ``ddl ARGV``: it must fail as a user error, one line on stderr; returns that line."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddl: error: "), err
    return err.strip()


# ---- --save: a symlink is written through, a device is left alone ------------------------------------
def test_save_refuses_a_device_a_fifo_or_a_link_to_one(t4, tmp_path, capsys):
    null, fifo, link = tmp_path / "null", tmp_path / "fifo", tmp_path / "to-null"
    kind = device_or_fifo(null)
    os.mkfifo(fifo)
    link.symlink_to(null)
    for path, says in ((null, f"--save {null} is {kind}, not a regular file: name a file to write, e.g. "
                              f"--save plan.json"),
                       (fifo, f"--save {fifo} is a FIFO (named pipe), not a regular file"),
                       (link, f"--save {link} links to {null}, which is {kind}, not a regular file")):
        assert one_error(capsys, ["plan", t4, "--save", path]).startswith(f"ddl: error: {says}")
    assert not stat.S_ISREG(null.stat().st_mode) and stat.S_ISFIFO(fifo.stat().st_mode) and link.is_symlink()


def test_save_writes_where_a_symlink_points_and_keeps_the_link(t4, tmp_path, capsys):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real.name)
    assert main(["plan", t4, "--save", str(link), "--workers", "1"]) == 0
    assert f"schedule written to {link}" in capsys.readouterr().out
    assert link.is_symlink() and json.loads(real.read_text())["nranks"] == 4
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "missing" / "plan.json")
    assert one_error(capsys, ["plan", t4, "--save", dangling]) == (
        f"ddl: error: --save {dangling}: folder {tmp_path / 'missing'} does not exist")


# ---- --schedule: a wrong file is named, with its entry ------------------------------------------------
def test_a_schedule_for_another_rank_count_names_its_file(t4, tmp_path, capsys):
    s8 = tmp_path / "s8.json"
    ring(8).save(s8)
    assert one_error(capsys, ["plan", t4, "--schedule", s8]) == (
        f"ddl: error: {s8}: the schedule is for 8 ranks; t4 has 4")


@pytest.mark.parametrize("edit,says", [
    (lambda d: d["routes"][0]["paths"][0].__setitem__("via", [{"a": 1}]),
     "routes[0].paths[0].via must be a list of node names (strings), got [{'a': 1}]"),
    (lambda d: d["routes"][0]["paths"][0].__setitem__("via", [["a"]]),
     "routes[0].paths[0].via must be a list of node names (strings), got [['a']]"),
    (lambda d: d["routes"][0]["paths"][0].__setitem__("share", "1e308"),
     "routes[0].paths[0].share must be a finite number >= 0"),
    (lambda d: d["programs"][2].__setitem__(5, ["send", 3]),
     "programs[2][5]: an operation is [kind, chunk, peer], a string and two integers, got ['send', 3]"),
    (lambda d: d.__setitem__("spans", [[0]]), "spans[0]: a span is [first, count], two integers, got [0]"),
    (lambda d: d.__setitem__("routes", "x"), "routes must be a list of"),
    (lambda d: d.__setitem__("pattern", 4), "pattern must be a list of chunk weights, got 4"),
    (lambda d: d.__setitem__("programs", {"0": []}), "programs must be a list of programs, one per rank"),
    (lambda d: d.__setitem__("format", "ddl.schedule/9"),           # (was: "not a ddl schedule")
     "a ddl schedule of format 'ddl.schedule/9', which this version of ddl does not read"),
])
def test_a_wrong_schedule_entry_is_one_line_naming_file_and_entry(t4, tmp_path, capsys, edit, says):
    """These gave a traceback (TypeError: unhashable type, from the simulator) or a bare Python exception
    (ValueError('not enough values to unpack (expected 3, got 2)')) naming no entry."""
    d = ring(4).to_dict()
    d["routes"] = [{"src": 0, "dst": 1, "paths": [{"via": ["h0/cpu0", "h0", "h0/cpu1"], "share": 1}]}]
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert one_error(capsys, ["plan", t4, "--schedule", path, "--workers", "1"]).startswith(
        f"ddl: error: {path}: {says}")


def test_save_that_fails_as_it_writes_names_the_option(t4, capsys):
    """A folder that takes no new file though it looks writable (/proc) failed with the bare OSError."""
    if not os.path.isdir("/proc") or not os.access("/proc", os.W_OK):
        pytest.skip("no /proc that looks writable here")
    assert one_error(capsys, ["plan", t4, "--save", "/proc/ddl-plan.json", "--workers", "1"]).startswith(
        "ddl: error: --save /proc/ddl-plan.json: cannot write it (")


# ---- --timeline ---------------------------------------------------------------------------------------
def test_a_busy_slice_is_never_shown_blank():
    """The legend says blank is idle: a slice under 1/18 busy rounded to blank."""
    from ddl.cli.plan import TIMELINE_LEVELS, _strip

    assert _strip([0.0, 1e-6, 0.02, 0.055, 0.06, 0.5, 0.95, 1.0]) == " ...." + "+@@"
    loads = [i / 1000 for i in range(1001)]
    strip = _strip(loads)
    assert strip[0] == " " and " " not in strip[1:]
    assert [TIMELINE_LEVELS.index(c) for c in strip] == sorted(TIMELINE_LEVELS.index(c) for c in strip)


# ---- examples/allreduce_hello.py ----------------------------------------------------------------------
def test_hello_refuses_zero_iterations_once():
    from mpi_cases._launch import run_mpi

    rc, out, _ = run_mpi(2, "examples/allreduce_hello.py", "--iters", "0", timeout=60)
    assert rc == 2 and out.count("argument --iters: at least 1, got 0") == 1, out
    assert "Traceback" not in out


def test_hello_says_a_small_allreduce_goes_inline():
    """At 4 KiB on 2 ranks the call rides on the shared-memory board: no schedule runs, so none is shown."""
    from mpi_cases._launch import run_ok

    out = run_ok(2, "examples/allreduce_hello.py", "--size", "4KiB", "--iters", "2", timeout=60)
    assert "path: inline on the shared-memory agreement board" in out and "result check: OK" in out
    assert "plan: " not in out and "messages between ranks" not in out and "predicted" not in out
    out = run_ok(2, "examples/allreduce_hello.py", "--size", "4KiB", "--iters", "1", timeout=60,
                 env={"DDL_INLINE_BYTES": "0"})
    assert "plan: " in out and "path: inline" not in out
