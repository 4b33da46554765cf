"""``ddl topo validate | show | draw`` through the real command line (a subprocess each)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddl import Error
from ddl.cli import main
from ddl.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "topologies"


def ddl(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "ddl", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=240)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


@pytest.fixture
def bad_files(tmp_path):
    files = {
        "unknown-node.yaml": "name: x\nnodes: [{id: a, kind: gpu}]\n"
                             "links: [{a: a, b: zz, bandwidth: 1 GB/s}]\nranks: [a]\n",
        "syntax.yaml": "name: [unclosed\n",
        "bad-unit.yaml": "name: x\nnodes: [{id: a, kind: gpu}, {id: b, kind: gpu}]\n"
                         "links: [{a: a, b: b, bandwidth: fast}]\nranks: [a, b]\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return [tmp_path / name for name in files]


def test_validate_whole_zoo_ok():
    files = sorted(ZOO.glob("*.yaml"))
    proc = ddl("topo", "validate", *files)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(files)
    assert f"{ZOO / 'dgx1-v100.yaml'}: ok (8 ranks, 1 host)" in lines
    assert f"{ZOO / 'ibm-3tier-192.yaml'}: ok (192 ranks, 48 hosts)" in lines
    assert proc.stderr == ""


def test_validate_reports_each_bad_file_on_one_line(bad_files, tmp_path):
    missing = tmp_path / "missing.yaml"
    good = ZOO / "emulated-2rack.yaml"
    proc = ddl("topo", "validate", good, *bad_files, missing)
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == [f"{good}: ok (8 ranks, 4 hosts)"]
    errors = proc.stderr.splitlines()
    assert len(errors) == len(bad_files) + 1
    for path, line in zip(bad_files + [missing], errors):
        assert line.startswith(str(path))
    assert "zz" in errors[0]          # names the bad link end
    assert "fast" in errors[2]        # names the bad bandwidth


def test_validate_only_good_files_after_bad_ones_still_checked(bad_files):
    proc = ddl("topo", "validate", bad_files[0], ZOO / "dgx-a100.yaml")
    assert proc.returncode == 2
    assert "ok (8 ranks, 1 host)" in proc.stdout


def test_show_prints_hosts_tiers_links_and_cut():
    proc = ddl("topo", "show", ZOO / "emulated-2rack.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "emulated-2rack" in out
    assert "ranks: 8" in out and "hosts: 4" in out and "h3: ranks 6-7" in out
    assert "tiers" in out
    tier_lines = [l for l in out.splitlines() if l.strip()[:2] in ("0:", "1:", "2:")]
    assert len(tier_lines) == 3
    assert "5 GB/s" in tier_lines[0] and "4 groups of 2" in tier_lines[0]
    assert "50 MB/s" in tier_lines[1] and "2 groups of 4" in tier_lines[1]
    assert "12.5 MB/s" in tier_lines[2]
    assert "ranks 0-7: 5 GB/s out, 5 GB/s in, 1 link" in out
    pytest.importorskip("ddl.bounds")
    assert "limiting cut" in out and "algbw <= 25 MB/s" in out


def test_show_names_the_direct_link_bound():
    proc = ddl("topo", "show", ZOO / "dgx1-v100.yaml")
    assert proc.returncode == 0, proc.stderr
    allreduce = [line for line in proc.stdout.splitlines() if "allreduce algbw <=" in line]
    assert len(allreduce) == 1
    assert "busbw <= 156 GB/s" in allreduce[0] and "direct link over it alone" in allreduce[0]


    assert "ranks 0-7: 162 GB/s out, 162 GB/s in, 7 links (out: 150 GB/s to gpu, 12 GB/s to pcie)" in proc.stdout


def test_show_counts_only_the_links_a_fragment_can_use(tmp_path):
    """GPUs {0, 1, 4, 5} of a DGX-1: the NVLinks to the other four GPUs carry nothing (a GPU outside the job
    forwards no data), so gpu0 has 100 GB/s of NVLink, gpu1 75 GB/s (it once showed 150 GB/s for every one)."""
    text = (ZOO / "dgx1-v100.yaml").read_text()
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(text.split("\nranks:")[0] + "\nranks: [dgx1/gpu0, dgx1/gpu1, dgx1/gpu4, dgx1/gpu5]\n")
    proc = ddl("topo", "show", fragment)
    assert proc.returncode == 0, proc.stderr
    assert "to vertices that can carry the job's traffic" in proc.stdout, proc.stdout
    assert "ranks 0,2: 112 GB/s out, 112 GB/s in, 5 links (out: 100 GB/s to gpu, 12 GB/s to pcie)" in proc.stdout
    assert "ranks 1,3: 87 GB/s out, 87 GB/s in, 4 links (out: 75 GB/s to gpu, 12 GB/s to pcie)" in proc.stdout


def test_show_gives_reduce_scatter_its_own_cut_where_links_differ_by_direction(tmp_path):
    # GPUs 1-3 send to GPU 0 at 10 GB/s and hear from it at 1 GB/s: allgather is held by what leaves
    # GPU 0, reduce-scatter by the reversed fabric's cut, which is 3x wider (both as lower_bound says)
    hub = tmp_path / "hub.yaml"
    hub.write_text("""name: hub
nodes:
  - {id: sw, kind: switch}
  - {id: "g{i}", kind: gpu, for: {i: 4}}
links:
  - {a: "g{i}", b: g0, bandwidth: 10 GB/s, directed: true, for: {i: [1, 2, 3]}}
  - {a: g0, b: "g{i}", bandwidth: 1 GB/s, directed: true, for: {i: [1, 2, 3]}}
  - {a: "g{i}", b: sw, bandwidth: 10 MB/s, for: {i: 4}}
ranks:
  - {id: "g{i}", for: {i: 4}}
""")
    proc = ddl("topo", "show", hub)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(" algbw")[0].strip(): line for line in proc.stdout.splitlines() if " algbw <=" in line}
    assert set(lines) == {"allgather", "reduce-scatter", "allreduce"}
    assert "1.347 GB/s" in lines["allgather"] and "4.013 GB/s" in lines["reduce-scatter"]
    bounds = pytest.importorskip("ddl.bounds")
    topo = Topology.load(hub)
    for name, collective in (("allgather", "allgather"), ("reduce-scatter", "reduce_scatter")):
        seconds = bounds.lower_bound(topo, collective, 1 << 30).bandwidth_seconds
        assert f"{(1 << 30) / seconds / 1e9:.4g} GB/s" in lines[name]

def test_show_large_hierarchy_is_compact():
    proc = ddl("topo", "show", ZOO / "ibm-3tier-192.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "48 groups of 4" in out and "3 groups of 64" in out and "1 group of 192" in out
    assert len(out.splitlines()) < 40


def test_show_of_one_rank_names_no_rate(tmp_path):
    single = tmp_path / "one.yaml"
    single.write_text("name: one\nnodes:\n  - {id: g0, kind: gpu}\nlinks: []\nranks: [g0]\n")
    proc = ddl("topo", "show", single)
    assert proc.returncode == 0 and "  0:           -  1 group of 1" in proc.stdout and "inf" not in proc.stdout


def test_show_bad_file_is_one_error_line(bad_files):
    proc = ddl("topo", "show", bad_files[0])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "zz" in proc.stderr


@pytest.mark.parametrize("stem", ["dgx1-v100", "ibm-3tier-192"])
def test_draw_writes_png(tmp_path, stem):
    out = tmp_path / f"{stem}.png"
    proc = ddl("topo", "draw", ZOO / f"{stem}.yaml", "-o", out)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_draw_default_output_name(tmp_path):
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "emulated-flat.png").read_bytes()[:4] == b"\x89PNG"


def test_draw_errors_are_one_line(tmp_path, bad_files):
    proc = ddl("topo", "draw", bad_files[1], "-o", tmp_path / "x.png")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", tmp_path / "no" / "such" / "x.png")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    proc = ddl("topo", "draw", tmp_path / "missing.yaml")
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr


def test_draw_says_the_file_it_wrote_and_refuses_a_folder_or_a_huge_dpi(tmp_path):
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", tmp_path / "picture")
    assert proc.returncode == 0 and f"wrote {tmp_path / 'picture.png'}" in proc.stdout, proc.stderr
    assert (tmp_path / "picture.png").read_bytes()[:4] == b"\x89PNG"
    for folder in (str(tmp_path), str(tmp_path / "new") + os.sep):   # an existing folder, or a name ending in /
        proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", folder)
        assert proc.returncode == 2 and "is a folder: name the file" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", tmp_path / "x.png", "--dpi", "100000")
    assert proc.returncode == 2 and "--dpi 100000: from 1 to 1200" in proc.stderr
    assert not (tmp_path / "x.png").exists()
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", "", cwd=tmp_path)   # not the default name
    assert proc.returncode == 2 and "-o needs a file name" in proc.stderr and not (tmp_path / "emulated-flat.png").exists()


@pytest.mark.parametrize("args", [("topo",), ("topo", "validate"), ("topo", "show"), ("topo", "draw")])
def test_help(args):
    proc = ddl(*args, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: ddl " + " ".join(args))


def test_topo_without_subcommand_shows_usage():
    proc = ddl("topo")
    assert proc.returncode == 2
    assert "validate" in proc.stderr


def test_reader_that_stops_early_gets_no_traceback():
    """``ddl ... | head``: when the reader has gone, ddl stops quietly with a broken pipe's status."""
    proc = subprocess.Popen([sys.executable, "-m", "ddl", "topo", "show", ZOO / "ibm-3tier-192.yaml"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                # gone before ddl writes its first line
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 141, err
    assert err == b"", err


def test_every_option_that_writes_a_file_checks_it_in_the_same_words(tmp_path):
    """``ddl plan --save``, ``ddl bench --plot`` and ``ddl topo draw -o`` share one check, run before the work."""
    from ddl.cli import check_output_file
    a_file = tmp_path / "taken.txt"
    a_file.write_text("x")
    cases = [("", "--save needs a file name, e.g. --save plan.json"),
             (str(tmp_path), f"--save {tmp_path} is a folder: name the file, e.g. {tmp_path / 'plan.json'}"),
             (str(tmp_path / "new") + os.sep, "is a folder: name the file"),
             (str(tmp_path / "missing" / "p.json"), f"folder {tmp_path / 'missing'} does not exist"),
             (str(a_file / "p.json"), f"folder {a_file} is not a folder")]
    for path, says in cases:
        with pytest.raises(Error, match=re.escape(says)):
            check_output_file("--save", path, "plan.json")
    check_output_file("--save", str(tmp_path / "fine.json"), "plan.json")
    assert not (tmp_path / "fine.json").exists()         # checked, not created
    missing = tmp_path / "missing" / "t.png"
    proc = ddl("topo", "draw", ZOO / "emulated-flat.yaml", "-o", missing)
    assert proc.returncode == 2 and proc.stderr.strip() == f"ddl: error: -o {missing}: folder {missing.parent} does not exist"


@pytest.mark.parametrize("argv,usage", [(["topo", "show", "a.yaml", "b.yaml"], "usage: ddl topo show [-h] FILE"),
                                        (["plan", "a.yaml", "--bogus"], "usage: ddl plan [-h]"),
                                        (["--bogus"], "usage: ddl [-h]")])
def test_words_left_over_are_refused_with_the_usage_of_their_command(capsys, argv, usage):
    """(``ddl topo show a b`` showed ddl's own usage, as if no command had been given.)"""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(usage) and "error: unrecognized arguments: " in err, err


@pytest.mark.parametrize("option,value,says", [("--gpus", "0,1,0", "0 is listed twice in '0,1,0'"),
                                               ("--nics", "mlx5_0, mlx5_0", "mlx5_0 is listed twice"),
                                               ("--gpus", "", "an empty list"),
                                               ("--gpus", "0,,1", "an empty entry in '0,,1'"),
                                               ("--nics", "mlx5_0,", "an empty entry in 'mlx5_0,'"),
                                               ("--gpus", "a", "not an integer: 'a'"),
                                               ("--gpus", "0,-1", "at least 0, got -1")])
def test_import_refuses_a_gpu_or_nic_list_with_a_typo(capsys, tmp_path, option, value, says):
    """(A duplicate was dropped without a word: one GPU fewer than the user listed; an empty entry was
    Python's int() message.)"""
    with pytest.raises(SystemExit) as info:
        main(["topo", "import", str(Path(__file__).parent / "nvidia_smi" / "dgx-a100.txt"), "--gpu", "a100", option, value,
              "-o", str(tmp_path / "x.yaml")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {option}: {says}" in err and not (tmp_path / "x.yaml").exists()


def test_import_refuses_to_write_over_the_file_it_imports(capsys, tmp_path):
    """(`-o` naming the input replaced the matrix with YAML, as `ddl plan --save` refuses to.)"""
    matrix = tmp_path / "m.txt"
    original = (Path(__file__).parent / "nvidia_smi" / "dgx-a100.txt").read_text()
    matrix.write_text(original)
    assert main(["topo", "import", str(matrix), "--gpu", "a100", "-o", str(matrix)]) == 2
    assert f"-o {matrix} is the file being imported" in capsys.readouterr().err
    assert matrix.read_text() == original


def test_import_of_a_topology_file_says_it_is_one_already(capsys, tmp_path):
    zoo = str(Path(__file__).parent.parent / "topologies" / "emulated-2rack.yaml")
    assert main(["topo", "import", zoo, "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "it reads as a ddl topology file already" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.yaml").exists()
