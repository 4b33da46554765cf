"""The wheel a user installs holds what the package reads at run time."""
import shutil
import subprocess
import sys
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
    # build_py lays out the package as a wheel holds it (setup.py's own command, so that no wheel
    # package or build isolation is needed)
    built = tmp_path / "built"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(built)], cwd=source,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (built / "ddl" / "native" / "reduce.cuh").is_file() and (built / "ddl" / "gpu" / "kernels.py").is_file()
    found = subprocess.run([sys.executable, "-c", "import ddl.gpu.kernels as k; print(len(k.native_source()))"],
                           cwd=tmp_path, env={"PYTHONPATH": str(built), "PATH": ""}, capture_output=True,
                           text=True, timeout=60)
    assert found.returncode == 0 and int(found.stdout) == len((ROOT / "native" / "reduce.cuh").read_text()), \
        found.stdout + found.stderr
