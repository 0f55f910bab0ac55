"""Ships kernels/cuda (the CUDA extension's sources, JIT-built on first use) inside the wheel as
deepinfer_plugins/cuda_sources, so that ``pip install deepinfer`` has them; an editable install reads the checkout.

Builds write deepinfer.egg-info under build/, not at the top of the checkout: code run from the checkout has the
checkout on sys.path, where importlib.metadata would read that copy of the entry points first, and every
install (scripts/test.sh builds several virtualenvs while the unit suite runs) rewrites it file by file. A copy
left there by an earlier install is removed, since it would shadow the current entry points.
Everything else about the package is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CUDA_SOURCES = ROOT / "kernels" / "cuda"
EGG_BASE = ROOT / "build"


class BuildPyWithCudaSources(build_py):
    def run(self):
        super().run()
        shutil.copytree(CUDA_SOURCES, Path(self.build_lib) / "deepinfer_plugins" / "cuda_sources", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("tests", "__pycache__", "*.pyc"))


EGG_BASE.mkdir(exist_ok=True)
shutil.rmtree(ROOT / "deepinfer.egg-info", ignore_errors=True)
setup(cmdclass={"build_py": BuildPyWithCudaSources}, options={"egg_info": {"egg_base": str(EGG_BASE)}})
