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


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode().splitlines()


def test_the_sdist_pair_builds_wheels_that_install_together(source_tree, tmp_path):
    """The plugin imports deepinfer_recipe, so its distribution must pull that one in; built from the two sdists
    (what the README's "from built distributions" installs), the recipe wheel satisfies the plugin's requirement,
    and neither build warns about our own packaging metadata."""
    from packaging.requirements import Requirement

    sdists, wheels = tmp_path / "sdist", tmp_path / "wheel"
    output = ""
    for project in (source_tree, source_tree / "recipe"):
        build_sdist = f"import setuptools.build_meta as b; b.build_sdist({str(sdists)!r})"
        built = subprocess.run([sys.executable, "-c", build_sdist], cwd=project, capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-3000:]
        output += built.stdout + built.stderr
    for sdist in sorted(sdists.glob("*.tar.gz")):
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(sdist), "--no-deps", "--no-build-isolation",
                                "-w", str(wheels)], capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-3000:]
        output += built.stdout + built.stderr
    assert "project.license" not in output and "License classifiers are deprecated" not in output
    plugin = _metadata(next(wheels.glob("deepinfer-*.whl")))
    recipe = _metadata(next(wheels.glob("deepinfer_recipe-*.whl")))
    recipe_version = next(line.split(": ", 1)[1] for line in recipe if line.startswith("Version: "))
    wanted = [Requirement(line.split(": ", 1)[1]) for line in plugin if line.startswith("Requires-Dist: ")]
    recipe_requirement = next(r for r in wanted if r.name == "deepinfer-recipe")
    assert recipe_requirement.marker is None and recipe_requirement.specifier.contains(recipe_version)
    assert "License-Expression: MIT" in plugin and "License-Expression: MIT" in recipe
