"""Compile every Triton kernel for real NVIDIA targets on a machine without a GPU.

The launchers in ``deepinfer_plugins.ops.backends.triton_kernels`` are called with CPU tensors and the interpreter
off while a compile-only driver is active: it reports a CUDA target, device and stream, so ``JITFunction.run``
specialises and compiles each kernel exactly as on the GPU (TTIR -> TTGIR -> LLIR -> PTX -> cubin with the
wheel's ptxas, and Triton's own shared-memory and thread-count limits), while loading the binary reads its
resource usage with the wheel's cuobjdump and launching does nothing.

Must run in a process where ``TRITON_INTERPRET`` was never "1" (``common.INTERPRETED`` picks block sizes at
import). ``python -m tests.ops.triton_aot [--arch 90 100] [--no-sweep] [--one-per-path]`` prints one row per
compiled specialisation and exits 1 if any launch failed to compile or a kernel was never compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

MAX_SHARED_BYTES = 232448  # per-block opt-in limit of sm_90 (H100/H200) and sm_100 (B200): 227 KiB
MAX_THREADS = 1024


def nvidia_tool(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def toolchain_problem() -> str | None:
    """Why the NVIDIA backend cannot compile here, or None when it can."""
    from triton.backends import backends

    if "nvidia" not in backends:
        return "triton has no nvidia backend"
    for tool in ("ptxas", "cuobjdump"):
        path = nvidia_tool(tool)
        try:
            subprocess.run([str(path), "--version"], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{path} is unusable: {exc}"
    return None


def cubin_resources(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, from ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(nvidia_tool("cuobjdump")), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


class _CompileOnlyUtils:
    def get_device_properties(self, device):
        return {"max_shared_mem": MAX_SHARED_BYTES, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, cubin, shared, device):
        """No module is loaded; reports (module, function, registers, local bytes per thread, max threads). Local
        memory holds the register spills (and any stack), so it stands in for ``n_spills``."""
        usage = cubin_resources(cubin)
        return None, None, usage.get("reg", 0), usage.get("local", 0) + usage.get("stack", 0), MAX_THREADS

    def unload_module(self, module):
        pass


class CompileOnlyDriver:
    """Stands in for triton's CudaDriver: a current CUDA target, no device behind it. The device number is the
    architecture so that kernels compiled for different targets do not share a JITFunction cache."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _CompileOnlyUtils()

    @staticmethod
    def launcher_cls(src, metadata):
        return lambda *args, **kwargs: None

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("compile-only driver builds no launcher")


@contextlib.contextmanager
def compile_only(arch: int):
    previous = driver._active
    driver.set_active(CompileOnlyDriver(arch))
    try:
        yield
    finally:
        driver._active = previous


# ---- launches ----------------------------------------------------------------------------------------------------
@dataclass
class Launch:
    label: str
    call: object  # zero-argument callable that runs one launcher


def _launches(sweep: bool = True, each_path_once: bool = False) -> list[Launch]:
    """Every launcher at the shapes and dtypes of tests/ops/test_triton_kernels.py and benchmarks/kernels.py
    (V4.1: b = 64 decode tokens, 8 with --quick). Only dtypes, shapes and constexprs reach the compiler, so the
    tensors are zeros and the pools small. ``sweep``: also every candidate tiling of the attention, GEMM and MoE
    kernels at V4.1 shapes (only benchmarks/kernels.py --sweep launches them; the ops run the defaults).
    ``each_path_once``: only ``one_per_code_path`` of them. Call it under the driver that compiles them."""
    from deepinfer_plugins import ops
    from deepinfer_plugins.ops.backends.triton_kernels import attention, gemm, indexer, mhc, misc, moe, quant

    f32, bf16 = torch.float32, torch.bfloat16
    z = torch.zeros
    out: list[Launch] = []

    def add(label, fn, *args, **kwargs):
        out.append(Launch(label, lambda: fn(*args, **kwargs)))

    def configs(candidates):  # None: the launcher picks its default
        return (None, *candidates) if sweep else (None,)

    # quantisers and records
    for name in ("fp8_fake_quant", "nvfp4_fake_quant", "mxfp4_fake_quant"):
        for shape in ((6, 512), (3, 4, 32), (5, 8)):
            for dtype in (f32, bf16):
                add(f"{name}{shape} {dtype}", getattr(quant, name), z(shape, dtype=dtype))
    for b in (64, 8):
        add(f"fp8_fake_quant V4.1 b={b}", quant.fp8_fake_quant, z(b * 64, 512, dtype=bf16))
        add(f"nvfp4_fake_quant V4.1 b={b}", quant.nvfp4_fake_quant, z(b * 64, 512, dtype=bf16))
        add(f"mxfp4_fake_quant V4.1 b={b}", quant.mxfp4_fake_quant, z(b * 32, 128, dtype=bf16))
    add("fp8_block_quant (4, 256)", quant.fp8_block_quant, z(4, 256))
    for fmt, dim in (("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 32), ("fp8_window", 64)):
        rlen = ops.record_bytes(fmt, dim)
        records = z(7, rlen, dtype=torch.uint8)
        add(f"pack_cache_records {fmt} d={dim}", quant.pack_cache_records, z(7, dim, dtype=bf16), fmt)
        add(f"unpack_cache_records {fmt} d={dim}", quant.unpack_cache_records, records, fmt, dim, f32)
        add(f"cache_write {fmt} d={dim}", quant.cache_write, z(12, rlen, dtype=torch.uint8),
            torch.arange(7), z(7, dim, dtype=bf16), fmt)
        add(f"cache_write {fmt} d={dim} fp32", quant.cache_write, z(8, rlen, dtype=torch.uint8), torch.arange(6),
            z(6, dim), fmt)
        add(f"cache_gather {fmt} d={dim}", quant.cache_gather, z(12, rlen, dtype=torch.uint8),
            torch.tensor([[3, -1, 9], [0, 0, -1]]), fmt, dim, bf16)
        for b in (64, 8):
            add(f"cache_write {fmt} d={dim} V4.1 b={b}", quant.cache_write, z(4 * b, rlen, dtype=torch.uint8),
                torch.arange(b), z(b, dim, dtype=bf16), fmt)
    q8, s8 = ops.quantize_fp8_weight(torch.randn(70, 96))
    q4, s4 = ops.quantize_fp4_weight(torch.randn(70, 96))
    add("dequant_fp8_weight e8m0 scale", quant.dequant_fp8_weight, q8, s8, bf16)
    add("dequant_fp8_weight fp32 scale", quant.dequant_fp8_weight, q8, s8.float(), bf16)
    add("dequant_fp4_weight e8m0 scale", quant.dequant_fp4_weight, q4, s4, f32)
    ids = torch.randint(0, 50, (5, 6))
    for width, rows in ((64, 50), (8, 20), (256, 1000)):
        table, scale = ops.quantize_fp8_rows(torch.randn(rows, width))
        add(f"engram_gather w={width}", quant.engram_gather, table, scale, ids % rows, f32)
    for b in (64, 8):
        add(f"engram_gather V4.1 b={b}", quant.engram_gather, table, scale, torch.randint(0, 1000, (b, 48)), bf16)

    # sparse attention
    for dtype in (f32, bf16):
        for t, h, d, k in ((2, 16, 64, 40), (3, 4, 32, 12), (6, 20, 48, 70), (4, 16, 32, 13)):
            add(f"sparse_attention t={t} h={h} d={d} k={k} {dtype}", attention.sparse_attention,
                z(t, h, d, dtype=dtype), z(90, d, dtype=dtype), z(t, k, dtype=torch.int64), z(h), d ** -0.5)
    for splits, hb, bk in ((3, 16, 16), (2, 32, 16), (5, 16, 16)):
        config = attention.AttentionConfig(head_block=hb, key_block=bk, splits=splits)
        add(f"sparse_attention splits={splits} hb={hb} bk={bk}", attention.sparse_attention, z(3, 20, 64), z(50, 64),
            z(3, 75, dtype=torch.int64), z(20), 0.2, config=config)
    for dtype in (f32, bf16):
        for splits in (1, 3):
            add(f"sparse_attention_records d=64 splits={splits} {dtype}", attention.sparse_attention_records,
                z(4, 20, 64, dtype=dtype), z(12, 66, dtype=torch.uint8), z(4, 9, dtype=torch.int64),
                z(30, 36, dtype=torch.uint8), z(4, 14, dtype=torch.int64), z(20), 0.125,
                config=attention.AttentionConfig(head_block=16, key_block=16, splits=splits))
    for rows in (1, 8, 64, 384):
        for config in configs(attention.CANDIDATE_CONFIGS):
            add(f"sparse_attention_records V4.1 T={rows} {config or 'default'}", attention.sparse_attention_records,
                z(rows, 64, 512, dtype=bf16), z(rows * 128, 528, dtype=torch.uint8),
                z(rows, 128, dtype=torch.int64), z(rows * 512, 288, dtype=torch.uint8),
                z(rows, 512, dtype=torch.int64), z(64), 512 ** -0.5, config=config)
    for rows in (1, 8, 64, 384):
        for config in configs(attention.CANDIDATE_CONFIGS):
            add(f"sparse_attention V4.1 T={rows} {config or 'default'}", attention.sparse_attention,
                z(rows, 64, 512, dtype=bf16), z(640, 512, dtype=bf16), z(rows, 640, dtype=torch.int64), z(64),
                512 ** -0.5, config=config)

    # fused dequantise + GEMM: the tests' shapes, then V4.1's dense / expert projections with every candidate tiling
    for out_features, in_features in ((70, 96), (64, 160)):
        w8, s8 = ops.quantize_fp8_weight(torch.randn(out_features, in_features))
        w4, s4 = ops.quantize_fp4_weight(torch.randn(out_features, in_features))
        for dtype in (f32, bf16):
            for rows in (1, 5, 64):
                add(f"linear_fp8 {out_features}x{in_features} M={rows} {dtype}", gemm.linear_fp8,
                    z(rows, in_features, dtype=dtype), w8, s8)
                add(f"linear_fp4 {out_features}x{in_features} M={rows} {dtype}", gemm.linear_fp4,
                    z(rows, in_features, dtype=dtype), w4, s4)
        add(f"linear_fp8 {out_features}x{in_features} fp32 scale", gemm.linear_fp8, z(3, in_features), w8, s8.float())
    for out_features, in_features in ((2304, 5120), (5120, 2304)):
        w8 = z(out_features, in_features, dtype=torch.float8_e4m3fn)
        s8 = z(-(-out_features // 32), in_features // 32, dtype=torch.float8_e8m0fnu)
        w4 = z(out_features, in_features // 2, dtype=torch.int8)
        s4 = z(out_features, in_features // 32, dtype=torch.float8_e8m0fnu)
        for rows in (1, 8, 64, 384):
            for config in configs(gemm.CANDIDATE_CONFIGS):
                label = f"V4.1 {out_features}x{in_features} M={rows} {config or 'default'}"
                add(f"linear_fp8 {label}", gemm.linear_fp8, z(rows, in_features, dtype=bf16), w8, s8, config=config)
                add(f"linear_fp4 {label}", gemm.linear_fp4, z(rows, in_features, dtype=bf16), w4, s4, config=config)
    # router and LM head (bf16 weights, fp32 logits), and an fp32-activation case as in the tests
    for out_features in (384, 129280):
        weight = z(out_features, 5120, dtype=bf16)  # one 1.3 GB head for its four launches
        for rows in (1, 8, 64, 384):
            add(f"linear_to_fp32 V4.1 {out_features}x5120 M={rows}", gemm.linear_to_fp32, z(rows, 5120, dtype=bf16),
                weight)
    add("linear_to_fp32 fp32 x", gemm.linear_to_fp32, z(5, 160), z(384, 160, dtype=bf16))
    # wo_a: 8 groups of 1024 rows over 4096 columns (64 heads x 512 / 8)
    wo_a, wo_a_scale = z(8192, 4096, dtype=torch.float8_e4m3fn), z(256, 128, dtype=torch.float8_e8m0fnu)
    for rows in (1, 8, 64, 384):
        for dtype in (f32, bf16):
            add(f"linear_fp8_grouped V4.1 wo_a M={rows} {dtype}", gemm.linear_fp8_grouped,
                z(rows, 8, 4096, dtype=dtype), wo_a, wo_a_scale)

    # grouped routed experts: the tests' shapes, then V4.1's d = 5120, I = 2304 at top-6 with every candidate tiling
    # (8 experts: the expert count changes only the launch grid, not the compiled kernels)
    def experts(n_experts, dim, inter):
        return ops.ExpertWeights(z(n_experts, inter, dim // 2, dtype=torch.int8),
                                 z(n_experts, inter, dim // 32, dtype=torch.float8_e8m0fnu),
                                 z(n_experts, inter, dim // 2, dtype=torch.int8),
                                 z(n_experts, inter, dim // 32, dtype=torch.float8_e8m0fnu),
                                 z(n_experts, dim, inter // 2, dtype=torch.int8),
                                 z(n_experts, dim, inter // 32, dtype=torch.float8_e8m0fnu))

    for dim, inter in ((64, 96), (96, 32)):
        for dtype in (f32, bf16):
            for limit in (10.0, None):
                add(f"moe_experts d={dim} I={inter} {dtype} limit={limit}", moe.moe_experts, z(5, dim, dtype=dtype),
                    z(5, 3), torch.arange(15).reshape(5, 3) % 8, experts(8, dim, inter), limit)
    v41_experts = experts(8, 5120, 2304)
    for tokens in (1, 8, 64, 384):
        for config in configs(moe.CANDIDATE_CONFIGS):
            add(f"moe_experts V4.1 T={tokens} {config or 'default'}", moe.moe_experts, z(tokens, 5120, dtype=bf16),
                z(tokens, 6), torch.arange(tokens * 6).reshape(tokens, 6) % 8, v41_experts, 10.0, config=config)
    # indexer, top-k, pre-filter
    add("indexer_scores fp32", indexer.indexer_scores, z(3, 32, 128), z(3, 32), z(200, 128))
    add("indexer_scores_records fp32", indexer.indexer_scores_records, z(3, 32, 128), z(3, 32),
        z(209, 68, dtype=torch.uint8), torch.arange(200))
    add("indexer_scores_records d=16", indexer.indexer_scores_records, z(3, 32, 16, dtype=bf16), z(3, 32),
        z(209, 9, dtype=torch.uint8), torch.arange(200))
    for b, n_keys in ((64, 32768), (8, 8192)):
        add(f"indexer_scores V4.1 b={b}", indexer.indexer_scores, z(b, 32, 128, dtype=bf16), z(b, 32),
            z(n_keys, 128, dtype=bf16))
        add(f"indexer_scores_records V4.1 b={b}", indexer.indexer_scores_records, z(b, 32, 128, dtype=bf16),
            z(b, 32), z(n_keys, 68, dtype=torch.uint8), torch.arange(n_keys))
        add(f"indexer_scores_records V4.1 b={b} vLLM rows", indexer.indexer_scores_records,
            z(b, 32, 128, dtype=bf16), z(b, 32), z(n_keys, 384, dtype=torch.uint8)[:, 288:356], torch.arange(n_keys))
        add(f"indexer_scores_records V4.1 {b} sequences", indexer.indexer_scores_records,
            z(b, 32, 128, dtype=bf16), z(b, 32), z(n_keys, 68, dtype=torch.uint8),
            torch.zeros(b, n_keys // b, dtype=torch.long), [1] * b)
        add(f"topk_indices V4.1 b={b}", indexer.topk_indices, z(b, n_keys), 512)
    add("indexer_scores_records prefill among decodes", indexer.indexer_scores_records, z(8, 32, 128, dtype=bf16),
        z(8, 32), z(200, 68, dtype=torch.uint8), torch.zeros(4, 50, dtype=torch.long), [5, 1, 1, 1])
    for k in (1, 5, 16, 300):
        add(f"topk_indices k={k}", indexer.topk_indices, z(6, 130), k)
    add("candidate_mask", indexer.candidate_mask, z(4, 70), torch.tensor([70, 33, 0, 1]), 8, 3)

    # mHC
    add("sinkhorn", mhc.sinkhorn, z(5, 4, 4), 20, 1e-6)
    add("hc_coefficients", mhc.hc_coefficients, z(3, 4, 64, dtype=bf16), z(24, 256), z(24), z(3), 20, 1e-6, 1e-20)
    for dtype in (f32, bf16):
        add(f"hc_collapse {dtype}", mhc.hc_collapse, z(5, 4, 96, dtype=dtype), z(5, 4))
        add(f"hc_collapse_norm {dtype}", mhc.hc_collapse_norm, z(5, 4, 96, dtype=dtype), z(5, 4), None, 1e-20)
        add(f"hc_expand {dtype}", mhc.hc_expand, z(5, 4, 96, dtype=dtype), z(5, 96, dtype=dtype), z(5, 4),
            z(5, 4, 4))
    for b in (64, 8):
        streams = z(b, 4, 5120, dtype=bf16)
        add(f"hc_coefficients V4.1 b={b}", mhc.hc_coefficients, streams, z(24, 4 * 5120), z(24), z(3), 20, 1e-6,
            1e-20)
        add(f"hc_collapse V4.1 b={b}", mhc.hc_collapse, streams, z(b, 4))
        add(f"hc_collapse_norm V4.1 b={b}", mhc.hc_collapse_norm, streams, z(b, 4), z(5120, dtype=bf16), 1e-20)
        add(f"hc_expand V4.1 b={b}", mhc.hc_expand, streams, z(b, 5120, dtype=bf16), z(b, 4), z(b, 4, 4))

    # small ops
    add("rms_norm fp32 weighted", misc.rms_norm, z(4, 3, 80), z(80), 1e-20)
    add("rms_norm bf16 unweighted", misc.rms_norm, z(4, 3, 80, dtype=bf16), None, 1e-6)
    for dtype in (f32, bf16):
        add(f"rope {dtype}", misc.rope, z(4, 3, 80, dtype=dtype), torch.arange(4), torch.rand(8))
    for limit in (10.0, None):
        add(f"swiglu limit={limit}", misc.swiglu, z(6, 40), z(6, 40), limit)
    for top_k in (6, 2):
        add(f"sqrtsoftplus_route top_k={top_k}", misc.sqrtsoftplus_route, z(9, 384), z(9, 384), top_k, 1.5)
    add("engram_hash", misc.engram_hash, z(11, 4, dtype=torch.int64), z(4, dtype=torch.int64),
        torch.ones(3, 8, dtype=torch.int64), z(3, 8, dtype=torch.int64))
    add("engram_gate", misc.engram_gate, z(3, 4, 64, dtype=bf16), z(3, 4, 64), z(3, 64), z(4, 64), 1e-6)
    add("csa2_compress V4.1", misc.csa2_compress, z(128, 512), z(128, 512), 2, z(512), 1e-20, bf16)
    for b in (1, 64):  # key and value as slices of the [b, 5 * 5120] wkv output, as the model passes them
        kv = z(b, 5 * 5120, dtype=bf16)
        add(f"engram_gate V4.1 b={b}", misc.engram_gate, z(b, 4, 5120, dtype=bf16),
            kv[:, : 4 * 5120].unflatten(-1, (4, 5120)), kv[:, 4 * 5120:], z(4, 5120), 1e-20)
    for ratio in (2, 4):
        for dtype in (f32, bf16):
            add(f"csa2_compress ratio={ratio} {dtype}", misc.csa2_compress, z(8, 48), z(8, 48), ratio, z(48), 1e-20,
                dtype)
    q_heads = z(1024, 64, 512, dtype=bf16)  # a 1024-token prefill's queries: 65536 rows, past one NPU launch
    add("rms_norm V4.1 q heads T=1024", misc.rms_norm, q_heads, None, 1e-20)
    add("rope V4.1 q heads T=1024", misc.rope, q_heads, torch.arange(1024), torch.rand(32))
    for b in (64, 8):
        add(f"rms_norm V4.1 b={b}", misc.rms_norm, z(b, 5120, dtype=bf16), z(5120, dtype=bf16), 1e-20)
        add(f"sqrtsoftplus_route V4.1 b={b}", misc.sqrtsoftplus_route, z(b, 384), z(384), 6, 1.5)
    return one_per_code_path(out) if each_path_once else out


# Constexprs that size tiles, padded extents and split counts: they change a kernel's specialisation but not which
# of its code paths compiles. Every other constexpr (formats, modes, flags) selects code and counts as a path.
TILE_CONSTEXPRS = frozenset({"BB", "BC", "BD", "BH", "BK", "BLK", "BLK_P", "BLOCK", "BM", "BN", "BS", "BT", "CP",
                             "DP", "EP", "HB", "HP", "KP", "MP", "NB", "RB", "RP", "SB", "SP", "SPLIT", "SPLITS",
                             "SPLITS_P", "TB", "TILES"})


def code_paths(launch: Launch) -> frozenset[tuple]:
    """The code paths a launch reaches, found without compiling: per kernel it runs, the constexprs that select code
    and the dtypes of its tensor arguments (each kernel's ``run`` records them instead of compiling)."""
    reached = set()

    def record(kernel, *args, grid=None, warmup=False, **kwargs):
        bound = {**dict(zip(kernel.arg_names, args)), **kwargs}
        modes = tuple((p.name, repr(bound.get(p.name))) for p in kernel.params
                      if p.is_constexpr and p.name not in TILE_CONSTEXPRS)
        dtypes = tuple(str(value.dtype) for value in bound.values() if isinstance(value, torch.Tensor))
        reached.add((kernel.__name__, modes, dtypes))

    with mock.patch.object(triton.runtime.jit.JITFunction, "run", record):
        launch.call()
    return frozenset(reached)


def one_per_code_path(launches: list[Launch]) -> list[Launch]:
    """For every code path of every kernel, the latest of ``launches`` that reaches it: V4.1's shapes come after the
    tests' shapes, so a path compiles at a tiling it runs at in deployment where it has one. About a third of the
    launches, so that the check on every fresh machine (CI) stays short; the other tilings compile where all
    launches are asked for."""
    chosen, covered = [], set()
    for launch in reversed(launches):
        reached = code_paths(launch)
        if not reached <= covered:
            chosen.append(launch)
            covered |= reached
    return chosen[::-1]


# ---- compile and report -------------------------------------------------------------------------------------------
def _jit_functions() -> dict[str, triton.runtime.jit.JITFunction]:
    from deepinfer_plugins.ops.backends.triton_kernels import attention, common, gemm, indexer, mhc, misc, moe, quant

    return {f"{module.__name__.rsplit('.', 1)[1]}.{name}": obj
            for module in (attention, common, gemm, indexer, mhc, misc, moe, quant)
            for name, obj in vars(module).items()
            if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == module.__name__}


def _specialisation(kernel) -> str:
    meta = kernel.metadata
    names = kernel.src.fn.arg_names
    text = " ".join(f"{names[path[0]]}={value}" for path, value in kernel.src.constants.items()
                    if len(path) == 1 and names[path[0]].isupper())
    dtypes = ",".join(sorted({ty for ty in kernel.src.signature.values() if ty.startswith("*")}))
    return f"{text} warps={meta.num_warps} stages={meta.num_stages} {dtypes}"


def compile_all(arch: int, sweep: bool = True, each_path_once: bool = False) -> tuple[list[str], list[str]]:
    """Runs ``_launches(sweep, each_path_once)`` under the compile-only driver for ``arch``; returns (report rows,
    failures)."""
    failures = []
    with compile_only(arch):
        for launch in _launches(sweep, each_path_once):
            try:
                launch.call()
            except Exception as exc:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                message = "\n".join(str(exc).splitlines()[-14:])
                failures.append(f"sm_{arch} {launch.label}: {type(exc).__name__} (raised at {where.filename}:"
                                f"{where.lineno}):\n{message}\n")
    rows, compiled = [], set()
    for name, fn in sorted(_jit_functions().items()):
        cache = fn.device_caches[arch][0] if arch in fn.device_caches else {}
        for kernel in (k for k in cache.values() if hasattr(k, "metadata")):
            compiled.add(fn.__name__)
            regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
            rows.append(f"sm_{arch:<4} {name:<40} {regs!s:>5} {kernel.metadata.shared:>7} {spills!s:>6}  "
                        f"{_specialisation(kernel)}")
    failures += [f"sm_{arch} {name}: never compiled (no launch covers it)" for name in uncovered(compiled)]
    return rows, failures


def uncovered(compiled: set[str]) -> list[str]:
    """The JIT functions (module.name) that were neither compiled nor are called by another kernel (a helper
    inlined into its caller): every kernel must be reached by some launch."""
    functions = _jit_functions()
    return [name for name, fn in sorted(functions.items())
            if fn.__name__ not in compiled
            and not any(other is not fn and re.search(rf"\b{re.escape(fn.__name__)}\b", other.src)
                        for other in functions.values())]


def run_targets(targets, compile_target, done: str) -> int:
    """Prints each target's report rows, then the failures of all; 0 when there are none."""
    failures = []
    for target in targets:
        rows, target_failures = compile_target(target)
        print("\n".join(rows), flush=True)
        failures += target_failures
    if failures:
        print(f"\n{len(failures)} FAILED:\n" + "\n".join(failures))
        return 1
    print(f"\nall kernels {done}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    parser.add_argument("--no-sweep", action="store_true",
                        help="leave out the candidate tilings that only benchmarks/kernels.py --sweep launches")
    parser.add_argument("--one-per-path", action="store_true",
                        help="compile each code path of each kernel once, at the latest launch that reaches it "
                             "(CI's check)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1: the kernels would pick interpreter block sizes; unset it", file=sys.stderr)
        return 2
    problem = toolchain_problem()
    if problem:
        print(f"SKIP: {problem}")
        return 3
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'target':<7} {'kernel':<40} {'regs':>5} {'smem':>7} {'local':>6}  specialisation")
    return run_targets(args.arch, lambda arch: compile_all(arch, sweep=not args.no_sweep,
                                                           each_path_once=args.one_per_path), "compiled")


if __name__ == "__main__":
    sys.exit(main())
