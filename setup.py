"""ddl: topology-aware collective communication for distributed deep learning."""
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent


class BuildPy(build_py):
    """Also puts the CUDA sources (``native/`` of the checkout) into the built package as ``ddl/native/``,
    where ``ddl.gpu.kernels`` looks first; an editable install finds them in the checkout instead."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / "ddl" / "native"
            target.mkdir(parents=True, exist_ok=True)
            for source in (HERE / "native").iterdir():
                if source.suffix in (".cuh", ".md"):
                    shutil.copy2(source, target / source.name)


VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "ddl" / "__init__.py").read_text()).group(1)

setup(
    name="ddl",
    version=VERSION,
    description="Topology-aware collective communication (allreduce and friends) for distributed deep learning",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ddl", "ddl.*"]),
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.11",
        "networkx>=3.0",
        "pyyaml>=6.0",
        "mpi4py>=3.1",
        "mpich; platform_system == 'Linux'",
        "matplotlib>=3.7",
    ],
    extras_require={
        "gpu": ["cupy-cuda12x", "ml_dtypes"],      # CUDA 12 drivers
        "gpu-cuda13": ["cupy-cuda13x", "ml_dtypes"],  # CUDA 13 drivers
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "hypothesis"],
        "bf16": ["ml_dtypes"],
    },
    entry_points={"console_scripts": ["ddl = ddl.cli:main"]},
    cmdclass={"build_py": BuildPy},
    classifiers=["Programming Language :: Python :: 3", "Topic :: System :: Distributed Computing"],
)
