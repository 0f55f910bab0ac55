"""Lower every Triton kernel for Ascend NPUs with triton-ascend's own compiler, on a machine without an NPU or CANN.

triton-ascend (which replaces the triton package; CI installs it in .venv-triton-ascend) compiles a kernel in
three stages: Triton IR; then its ``triton-adapter-opt`` passes into the HIVM / HFusion / Linalg dialects, where
the access patterns an NPU cannot take are rejected; then CANN's ``bishengir-compile`` to a device binary. The
first two ship in the wheel. Here the launchers of tests/ops/triton_aot.py (the tests' shapes and V4.1's) run
under a compile-only driver that reports an NPU target, so every kernel specialises and lowers as it would on the
NPU, once per code path of the wheel: Atlas A2/A3 (its default) and 910_95 (``compile_on_910_95``, the Ascend
950 family; the released wheel ships with that path off). The third stage needs CANN, so the adapter's output is
kept instead: what only ``bishengir-compile`` rejects (an on-chip buffer overflow, say) is not caught here, and the
Triton backend declines such an op at runtime. Then the launchers run again at a V4.1 prefill chunk
(``PREFILL_TOKENS``, the largest chunk vLLM schedules by default), whose grids ``common.launch_chunks`` cuts into
launches of at most ``ASCEND_MAX_PROGRAMS`` programs: every NPU launch is checked against that limit, the launches
of one grid must share one binary, and the report names the grids that were cut (one launch each with
``TRITON_ALL_BLOCKS_PARALLEL=1``).

``python -m tests.ops.triton_ascend_lowering [--one-per-path]`` prints one row per lowered kernel and path and
exits 1 on any failure, 3 when the installed triton is not triton-ascend.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import re
import sys
import tempfile
import traceback
from collections import defaultdict
from unittest import mock

import torch
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from .triton_aot import Launch, _launches, run_targets, uncovered

SKIPPED = 3
# vLLM's default max_num_batched_tokens on a device of 70 GB or more (offline; the API server's default is 8192);
# 128K tokens of context before the chunk, so 32K compressed keys at ratio 4
PREFILL_TOKENS, PREFILL_CONTEXT = 16384, 131072

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
        return name, kernel, 0, 0  # a module that is not None: Triton then keeps the kernel's launcher


class CompileOnlyNpuDriver:
    """Stands in for triton-ascend's NPUDriver: an NPU target and no device. Launches only record their grid and
    which compiled binary they ran (Triton makes a launcher per binary). The device number is the path's, so that
    kernels lowered for different paths do not share a JITFunction cache."""

    def __init__(self, arch: str, device: int):
        self.target = GPUTarget("npu", arch, 0)
        self.device = device
        self.utils = _CompileOnlyUtils()
        self.launches: list[tuple[int, int]] = []  # (programs, binary) per launch
        self._binaries = itertools.count()

    def launcher_cls(self, src, metadata):
        binary = next(self._binaries)

        def launch(grid_x, grid_y, grid_z, *args):
            self.launches.append((grid_x * grid_y * grid_z, binary))

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


def prefill_launches(tokens: int = PREFILL_TOKENS, context: int = PREFILL_CONTEXT) -> list[Launch]:
    """The launchers whose grids grow with the tokens of a step, at V4.1's shapes for a prefill chunk of ``tokens``.
    The tensors are made at call time, one launch's at a time. The routed experts are 8 of V4.1's 256 (top-6 of
    them): the expert count adds at most one row block per expert to the grid, and 256 would take 4.5 GB."""
    from deepinfer_plugins import ops
    from deepinfer_plugins.ops.backends.triton_kernels import attention, gemm, indexer, mhc, misc, moe, quant

    bf16, u8, i64, z, t = torch.bfloat16, torch.uint8, torch.int64, torch.zeros, tokens
    keys = context // 4

    def experts():
        fp4, e8m0 = torch.int8, torch.float8_e8m0fnu
        return ops.ExpertWeights(z(8, 2304, 2560, dtype=fp4), z(8, 2304, 160, dtype=e8m0),
                                 z(8, 2304, 2560, dtype=fp4), z(8, 2304, 160, dtype=e8m0),
                                 z(8, 5120, 1152, dtype=fp4), z(8, 5120, 72, dtype=e8m0))

    def streams():
        return z(t, 4, 5120, dtype=bf16)

    calls = {
        "mxfp4_fake_quant indexer q": lambda: quant.mxfp4_fake_quant(z(t * 32, 128, dtype=bf16)),
        "cache_write nvfp4": lambda: quant.cache_write(z(t, 288, dtype=u8), torch.arange(t), z(t, 512, dtype=bf16),
                                                       "nvfp4"),
        "cache_gather (distinct keys)": lambda: quant.cache_gather(z(2 * t, 528, dtype=u8), torch.arange(2 * t),
                                                                   "fp8_window", 512, bf16),
        "sparse_attention": lambda: attention.sparse_attention(z(t, 64, 512, dtype=bf16), z(640, 512, dtype=bf16),
                                                               z(t, 640, dtype=i64), z(64), 512 ** -0.5),
        "sparse_attention_records": lambda: attention.sparse_attention_records(
            z(t, 64, 512, dtype=bf16), z(128, 528, dtype=u8), z(t, 128, dtype=i64), z(512, 288, dtype=u8),
            z(t, 512, dtype=i64), z(64), 512 ** -0.5),
        "linear_fp8 5120x2304": lambda: gemm.linear_fp8(z(t, 2304, dtype=bf16),
                                                        z(5120, 2304, dtype=torch.float8_e4m3fn),
                                                        z(160, 72, dtype=torch.float8_e8m0fnu)),
        "linear_fp8_grouped wo_a": lambda: gemm.linear_fp8_grouped(z(t, 8, 4096, dtype=bf16),
                                                                   z(8192, 4096, dtype=torch.float8_e4m3fn),
                                                                   z(256, 128, dtype=torch.float8_e8m0fnu)),
        "linear_to_fp32 router": lambda: gemm.linear_to_fp32(z(t, 5120, dtype=bf16), z(384, 5120, dtype=bf16)),
        "moe_experts": lambda: moe.moe_experts(z(t, 5120, dtype=bf16), z(t, 6), torch.randint(0, 8, (t, 6)),
                                               experts(), 10.0),
        "indexer_scores_records": lambda: indexer.indexer_scores_records(
            z(t, 32, 128, dtype=bf16), z(t, 32), z(keys, 68, dtype=u8), torch.arange(keys)),
        "topk_indices": lambda: indexer.topk_indices(z(t, keys), 512),
        "candidate_mask": lambda: indexer.candidate_mask(z(t, keys), torch.full((t,), keys), 64, 32),
        "hc_coefficients": lambda: mhc.hc_coefficients(streams(), z(24, 4 * 5120), z(24), z(3), 20, 1e-6, 1e-20),
        "hc_collapse": lambda: mhc.hc_collapse(streams(), z(t, 4)),
        "hc_collapse_norm": lambda: mhc.hc_collapse_norm(streams(), z(t, 4), z(5120, dtype=bf16), 1e-20),
        "hc_expand": lambda: mhc.hc_expand(streams(), z(t, 5120, dtype=bf16), z(t, 4), z(t, 4, 4)),
        "rms_norm q heads": lambda: misc.rms_norm(z(t, 64, 512, dtype=bf16), None, 1e-20),
        "rope q heads": lambda: misc.rope(z(t, 64, 512, dtype=bf16), torch.arange(t), torch.rand(32)),
        "swiglu": lambda: misc.swiglu(z(t, 2304, dtype=bf16), z(t, 2304, dtype=bf16), 10.0),
        "sqrtsoftplus_route": lambda: misc.sqrtsoftplus_route(z(t, 384), z(384), 6, 1.5),
        "engram_hash": lambda: misc.engram_hash(z(t, 4, dtype=i64), z(4, dtype=i64), torch.ones(3, 8, dtype=i64),
                                                z(3, 8, dtype=i64)),
        "engram_gate": lambda: misc.engram_gate(streams(), z(t, 4, 5120, dtype=bf16), z(t, 5120, dtype=bf16),
                                                z(4, 5120), 1e-20),
        "csa2_compress": lambda: misc.csa2_compress(z(t, 512), z(t, 512), 4, z(512), 1e-20, bf16),
    }
    return [Launch(f"{label} T={tokens}", call) for label, call in calls.items()]


def _lower(path: str, npu, launches: list[Launch], failures: list[str]) -> list[tuple[str, int, list[int]]]:
    """Runs ``launches``, adding to ``failures`` what failed to lower and every grid whose launches ran more than
    one binary; -> (label, programs of the grid, programs of each NPU launch it took) of every grid:
    ``common.launch_chunks`` cuts one past the limit into several."""
    from deepinfer_plugins.ops.backends.triton_kernels import common

    grids, label = [], None
    whole = common.launch_chunks

    def recording(*dims):
        chunks = whole(*dims)
        grids.append((label, math.prod(dims), [math.prod(grid) for _, grid in chunks]))
        return chunks

    with mock.patch.object(common, "launch_chunks", recording):
        for launch in launches:
            label, recorded = launch.label, len(grids)
            try:
                launch.call()
            except Exception as exc:
                del grids[recorded:], npu.launches[sum(len(launched) for _, _, launched in grids):]
                where = traceback.extract_tb(exc.__traceback__)[-1]
                text = [line for line in str(exc).splitlines() if line.strip() and not line.lstrip().startswith("#")]
                causes = [line for line in text if re.search(r"error|assertion|failed", line, re.IGNORECASE)]
                message = "\n".join((causes or text)[-12:])  # the adapter's own words, not its stack dump
                failures.append(f"{path} {launch.label}: {type(exc).__name__} (raised at {where.filename}:"
                                f"{where.lineno}):\n{message}\n")
    if [n for _, _, launched in grids for n in launched] != [programs for programs, _ in npu.launches]:
        failures.append(f"{path}: the driver saw other launches than launch_chunks made")
    else:
        binaries = iter(binary for _, binary in npu.launches)
        for label, _, launched in grids:
            taken = {next(binaries) for _ in launched}
            if len(taken) > 1:
                failures.append(f"{path} {label}: the {len(launched)} launches of one grid took {len(taken)} "
                                "binaries (the kernel specialises on first_program)")
    npu.launches.clear()
    return grids


def lower_all(path: str, each_path_once: bool = False) -> tuple[list[str], list[str]]:
    """Runs ``_launches(each_path_once=...)`` under the compile-only NPU driver for ``path``, then the prefill
    chunk's; returns (report rows, failures)."""
    from deepinfer_plugins.ops.backends.triton_kernels.common import ASCEND_MAX_PROGRAMS, BLOCKS_PARALLEL_ENV

    failures, lowered = [], []
    with lowering_only(path, lowered) as npu, mock.patch.dict(os.environ):
        os.environ.pop(BLOCKS_PARALLEL_ENV, None)
        grids = _lower(path, npu, _launches(each_path_once=each_path_once), failures)
        prefill = _lower(path, npu, prefill_launches(), failures)
    failures += [f"{path} {label}: a launch of {n} programs (NPU limit {ASCEND_MAX_PROGRAMS})"
                 for label, _, launched in grids + prefill for n in launched if n > ASCEND_MAX_PROGRAMS]
    modes = defaultdict(set)
    for metadata in lowered:
        modes[metadata["kernel_name"]].add(f"{metadata['mix_mode']}/{metadata['parallel_mode']}")
    failures += [f"{path} {name}: never lowered (no launch covers it)" for name in uncovered(set(modes))]
    rows = [f"{path:<7} {name:<40} {sum(m['kernel_name'] == name for m in lowered):>5}  {', '.join(sorted(kinds))}"
            for name, kinds in sorted(modes.items())]
    cut = {}  # label -> (its largest grid that was cut, the launches that took)
    for label, programs, launched in prefill:
        if len(launched) > 1 and programs > cut.get(label, (0, 0))[0]:
            cut[label] = (programs, len(launched))
    listed = ", ".join(f"{label} ({programs} programs in {n} launches)" for label, (programs, n) in cut.items())
    rows.append(f"{path:<7} prefill chunk: {len({label for label, _, _ in prefill})} launchers lowered; grids cut "
                f"into launches of at most {ASCEND_MAX_PROGRAMS} programs (one launch each with "
                f"{BLOCKS_PARALLEL_ENV}=1): {listed or 'none'}")
    return rows, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one-per-path", action="store_true",
                        help="lower each code path of each kernel once, at the latest launch that reaches it "
                             "(CI's check); the prefill chunk's launches all run")
    args = parser.parse_args(argv)
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
        return run_targets(PATHS, lambda path: lower_all(path, args.one_per_path), "lowered")


if __name__ == "__main__":
    sys.exit(main())
