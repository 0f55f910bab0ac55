"""Ships kernels/cuda (the CUDA extension's sources, JIT-built on first use) inside the wheel as
deepinfer_plugins/cuda_sources, so that ``pip install deepinfer`` has them; an editable install reads the checkout.
Everything else about the package is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CUDA_SOURCES = Path(__file__).resolve().parent / "kernels" / "cuda"


class BuildPyWithCudaSources(build_py):
    def run(self):
        super().run()
        shutil.copytree(CUDA_SOURCES, Path(self.build_lib) / "deepinfer_plugins" / "cuda_sources", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("tests", "__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithCudaSources})
