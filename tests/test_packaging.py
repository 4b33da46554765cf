"""The wheel a user installs holds what the package reads at run time."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_cuda_sources_where_the_kernels_look_for_them(tmp_path):
    """``ddl.gpu.kernels`` compiles ``reduce.cuh`` at run time, from ``ddl/native/`` of an installed package
    (a wheel once held no copy of it: only an editable install could run the device kernels)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in ("ddl", "native"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           str(source), "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel, = (tmp_path / "wheel").glob("ddl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ddl/native/reduce.cuh" in names and "ddl/gpu/kernels.py" in names, sorted(names)
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    found = subprocess.run([sys.executable, "-c", "import ddl.gpu.kernels as k; print(len(k.native_source()))"],
                           cwd=tmp_path, env={"PYTHONPATH": str(installed), "PATH": ""}, capture_output=True,
                           text=True, timeout=60)
    assert found.returncode == 0 and int(found.stdout) == len((ROOT / "native" / "reduce.cuh").read_text()), \
        found.stdout + found.stderr
