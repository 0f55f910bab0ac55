"""Lower every Triton kernel for Ascend NPUs with triton-ascend's own compiler, on a machine without an NPU or CANN.

triton-ascend (which replaces the triton package; CI installs it in .venv-triton-ascend) compiles a kernel in
three stages: Triton IR; then its ``triton-adapter-opt`` passes into the HIVM / HFusion / Linalg dialects, where
the access patterns an NPU cannot take are rejected; then CANN's ``bishengir-compile`` to a device binary. The
first two ship in the wheel. Here the launchers of tests/ops/triton_aot.py (the tests' shapes and V4.1's) run
under a compile-only driver that reports an NPU target, so every kernel specialises and lowers as it would on the
NPU, once per code path of the wheel: Atlas A2/A3 (its default) and 910_95 (``compile_on_910_95``, the Ascend
950 family; the released wheel ships with that path off). The third stage needs CANN, so the adapter's output is
kept instead: what only ``bishengir-compile`` rejects (an on-chip buffer overflow, say) is not caught here, and the
Triton backend declines such an op at runtime. Each launch's program count is also checked against
``ASCEND_MAX_PROGRAMS``.

``python -m tests.ops.triton_ascend_lowering`` prints one row per lowered kernel and path and exits 1 on any
failure, 3 when the installed triton is not triton-ascend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import traceback
from collections import defaultdict

import torch
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from .triton_aot import _launches, run_targets, uncovered

SKIPPED = 3

# code path -> (the SoC name the driver reports, the option values triton-ascend's 910_95 build defaults to).
# Which of the wheel's 910_95 SoC names (9579, 9581, 9589, 9599) is the 950PR or the 950DT is not documented there;
# the name reaches only the CANN stage, which does not run here.
PATHS = {
    "A2/A3": ("Ascend910B3", {}),
    "910_95": ("Ascend910_9589", dict(compile_on_910_95=True, multibuffer=False, enable_auto_bind_sub_block=False,
                                      enable_select_analysis=True)),
}


class _CompileOnlyUtils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 1}  # the NPU compiler reports shared = 1; on-chip buffers are CANN's to check

    def load_binary(self, name, kernel, shared, device):
        return None, kernel, 0, 0


class CompileOnlyNpuDriver:
    """Stands in for triton-ascend's NPUDriver: an NPU target and no device. Launches only record their grid. The
    device number is the path's, so that kernels lowered for different paths do not share a JITFunction cache."""

    def __init__(self, arch: str, device: int):
        self.target = GPUTarget("npu", arch, 0)
        self.device = device
        self.utils = _CompileOnlyUtils()
        self.programs: list[int] = []

    def launcher_cls(self, src, metadata):
        def launch(grid_x, grid_y, grid_z, *args):
            self.programs.append(grid_x * grid_y * grid_z)

        return launch

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def lowering_only(path: str, lowered: list[dict]):
    """The NPU compiler of ``path`` with its CANN stage replaced: the adapter's output is parsed for the kernel's
    metadata (as the CANN stage does first) and recorded in ``lowered``; the binary is empty."""
    arch, options = PATHS[path]
    backend = backends["ascend"].compiler
    add_stages, parse_options = backend.add_stages, backend.parse_options
    parse_linalg_metadata = add_stages.__globals__["_parse_linalg_metadata"]

    def stop_before_cann(self, stages, opts):
        add_stages(self, stages, opts)

        def keep_adapter_output(linalg, metadata):
            parse_linalg_metadata(linalg, metadata)
            lowered.append(dict(metadata))
            return b""

        stages["npubin"] = keep_adapter_output

    def with_path_options(self, opts):
        return dataclasses.replace(parse_options(self, opts), **options)

    npu = CompileOnlyNpuDriver(arch, device=list(PATHS).index(path))
    backend.add_stages, backend.parse_options = stop_before_cann, with_path_options
    driver.set_active(npu)
    try:
        yield npu
    finally:
        driver.reset_active()
        backend.add_stages, backend.parse_options = add_stages, parse_options


def lower_all(path: str) -> tuple[list[str], list[str]]:
    """Runs every launch under the compile-only NPU driver for ``path``; returns (report rows, failures)."""
    from deepinfer_plugins.ops.backends.triton_kernels.common import ASCEND_MAX_PROGRAMS

    failures, lowered = [], []
    with lowering_only(path, lowered) as npu:
        for launch in _launches():
            before = len(npu.programs)
            try:
                launch.call()
            except Exception as exc:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                text = [line for line in str(exc).splitlines() if line.strip() and not line.lstrip().startswith("#")]
                causes = [line for line in text if re.search(r"error|assertion|failed", line, re.IGNORECASE)]
                message = "\n".join((causes or text)[-12:])  # the adapter's own words, not its stack dump
                failures.append(f"{path} {launch.label}: {type(exc).__name__} (raised at {where.filename}:"
                                f"{where.lineno}):\n{message}\n")
                continue
            too_many = [n for n in npu.programs[before:] if n > ASCEND_MAX_PROGRAMS]
            if too_many:
                failures.append(f"{path} {launch.label}: a launch of {max(too_many)} programs (NPU limit "
                                f"{ASCEND_MAX_PROGRAMS})")
    modes = defaultdict(set)
    for metadata in lowered:
        modes[metadata["kernel_name"]].add(f"{metadata['mix_mode']}/{metadata['parallel_mode']}")
    failures += [f"{path} {name}: never lowered (no launch covers it)" for name in uncovered(set(modes))]
    rows = [f"{path:<7} {name:<40} {sum(m['kernel_name'] == name for m in lowered):>5}  {', '.join(sorted(kinds))}"
            for name, kinds in sorted(modes.items())]
    return rows, failures


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1: the kernels would pick interpreter block sizes; unset it", file=sys.stderr)
        return 2
    if "ascend" not in backends:
        print("SKIP: the installed triton is not triton-ascend (no ascend backend)")
        return SKIPPED
    print(f"triton {triton.__version__} (ascend backend), torch {torch.__version__}")
    print(f"{'path':<7} {'kernel':<40} {'specs':>5}  core / parallel mode")
    with tempfile.TemporaryDirectory(prefix="triton-ascend-lowering-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # every kernel lowers anew
        return run_targets(PATHS, lower_all, "lowered")


if __name__ == "__main__":
    sys.exit(main())
