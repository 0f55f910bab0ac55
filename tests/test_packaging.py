"""What ``pip install deepinfer`` gets: the CUDA extension's sources travel in the sdist and the wheel (the CUDA
backend JIT-builds them from ``deepinfer_plugins/cuda_sources``), without their tests."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory):
    """The repository's files (tracked and new, not ignored) copied out, so building leaves the checkout alone."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path_factory.mktemp("source")
    for name in listed:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes((REPO / name).read_bytes())
    return tree


def _cuda_files() -> set[str]:
    sources = REPO / "kernels" / "cuda"
    return {str(p.relative_to(sources)) for p in sources.rglob("*") if p.is_file() and "tests" not in p.parts
            and "__pycache__" not in p.parts}


def test_wheel_ships_the_cuda_sources(source_tree, tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source_tree), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("deepinfer-*.whl"))).namelist()
    shipped = {name.removeprefix("deepinfer_plugins/cuda_sources/") for name in names
               if name.startswith("deepinfer_plugins/cuda_sources/")}
    assert "build.py" in shipped and any(name.endswith(".cu") for name in shipped)
    assert shipped == _cuda_files()


def test_sdist_carries_the_cuda_sources(source_tree, tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=source_tree, check=True,
                   capture_output=True)
    with tarfile.open(next(tmp_path.glob("deepinfer-*.tar.gz"))) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {f"kernels/cuda/{name}" for name in _cuda_files()} <= names
    assert not any(name.startswith("kernels/cuda/tests") for name in names)


def test_metadata_is_written_under_build(source_tree):
    """Not at the top of the checkout, where code run from the checkout would read that copy of the entry points
    first while another install rewrites it (setup.py)."""
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info"], cwd=source_tree, check=True, capture_output=True)
    assert (source_tree / "build" / "deepinfer.egg-info" / "entry_points.txt").is_file()
    assert not (source_tree / "deepinfer.egg-info").exists()
