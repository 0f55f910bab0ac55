"""Build (JIT, cached) the kernels/cuda torch extension. Needs nvcc and a CUDA build of torch; never imported by
the package on machines without them. Env DEEPINFER_CUDA_ARCHS (default "90a;100a;103a") picks the targets."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = sorted(str(p) for p in (HERE / "csrc").rglob("*.cu")) + [str(HERE / "csrc" / "binding.cpp")]


def load(verbose: bool = False):
    from torch.utils.cpp_extension import load as _load

    archs = os.environ.get("DEEPINFER_CUDA_ARCHS", "90a;100a;103a").split(";")
    flags = ["-O3", "-std=c++17"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    return _load(name="deepinfer_cuda_kernels", sources=SOURCES, extra_cuda_cflags=flags, verbose=verbose)


if __name__ == "__main__":
    print(load(verbose=True))
