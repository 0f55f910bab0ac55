"""Per-op kernel benchmark at V4.1-Flash shapes: bytes and FLOPs moved, time per backend, roofline fractions.

On CPU only the reference is timed (the Triton interpreter says nothing about speed). On CUDA every registered
backend is timed and, with --check, first compared with the reference (bit-exact for quantisers, records, RoPE
and top-k ids; per row within two bf16 roundings for the routed experts, see ``agrees_by_row``; 2e-2 and
cosine > 0.9999 elsewhere). Both ceilings are measured in the same run: a device copy for the memory-bound ops
and a dense bf16 8192^3 matrix product for sparse attention. GPU times are CUDA-graph replays of back-to-back
calls (launch overhead excluded); inputs of the sparse-attention cases rotate over several copies so that they
do not sit in L2. ``--sweep`` also times every Triton tile configuration and both CUDA attention kernels. Writes
a markdown table (default benchmarks/results/kernels.md) and one JSON line per row.

  python benchmarks/kernels.py [--device cuda] [--check] [--sweep] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_plugins import ops

EXACT_OPS = {"fp8_fake_quant", "nvfp4_fake_quant", "mxfp4_fake_quant", "cache_write", "topk_indices",
             "indexer_topk", "indexer_topk_records", "engram_gather", "rope"}
SPARSE_ROWS = (1, 8, 64, 384)  # decode batches, and 64 sequences x 6 DSpark verification rows


@dataclass
class Case:
    name: str
    args_list: list  # rotating argument sets: call i uses args_list[i % len]
    nbytes: int
    flops: int = 0
    compute_bound: bool = False
    in_place: bool = False  # first argument is written: the check runs on a clone
    notes: dict = field(default_factory=dict)
    rounding: torch.dtype | None = None  # the dtype every path rounds its intermediates to: see agrees_by_row


def time_gpu(fn, args_list, calls: int = 20, repeats: int = 5) -> float:
    """Seconds per call: a CUDA graph of ``calls`` back-to-back calls, best of ``repeats`` replays. Ops that
    synchronise with the host (cannot be captured) fall back to event timing of an unsynchronised loop. A call
    slower than 5 ms (a reference looping over hundreds of experts) gets fewer calls, so that the device
    script's time limit holds."""
    for args in args_list:
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args_list[0])
    torch.cuda.synchronize()
    once = time.perf_counter() - start
    if once > 5e-3:
        calls, repeats = max(1, min(calls, int(0.1 / once))), 2
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*args_list[i % len(args_list)])
        replay = graph.replay
    except Exception:  # host synchronisation inside fn: time it eagerly
        torch.cuda.synchronize()

        def replay():
            for i in range(calls):
                fn(*args_list[i % len(args_list)])
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def time_cpu(fn, args_list, min_time: float = 0.2, max_iters: int = 50) -> float:
    fn(*args_list[0])
    iters, start = 0, time.perf_counter()
    while True:
        fn(*args_list[iters % len(args_list)])
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed > min_time or iters >= max_iters:
            return elapsed / iters


def copy_bandwidth(device: str) -> float:
    """fp32 elements: torch's copy kernel issues 16-byte accesses for them (4-byte ones for uint8, ~35% slower)."""
    nbytes = (2 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = time_gpu if device == "cuda" else time_cpu
    return 2 * nbytes / timer(lambda a, b: b.copy_(a), [(src, dst)])  # read + write


def same_size_copy(nbytes: int, copies: int, device: str, timer) -> float | None:
    """Seconds of a device copy moving a case's bytes (read + write) over as many buffers as the case rotates:
    the fastest any memory-bound op of that size runs, launch and ramp-up included (at decode sizes far below
    the large-copy bandwidth). None above 1 GB, where the large copy is that anchor already."""
    if nbytes > (1 << 30):
        return None
    n = max(1, nbytes // 8)
    pairs = [(torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device))
             for _ in range(copies)]
    return timer(lambda a, b: b.copy_(a), pairs)


def matrix_rate(device: str) -> float:
    n = 8192 if device == "cuda" else 1024
    g = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    timer = time_gpu if device == "cuda" else time_cpu
    return 2 * n ** 3 / timer(torch.matmul, [(a, b)])


def sparse_attention_case(rows: int, device: str, g, rotations: int) -> Case:
    """V4.1 decode / verify: 64 heads x 512, 128 window keys + 512 selected entries per row, every row's keys
    distinct (as for distinct sequences), bf16 pool."""
    heads, dim, keys = 64, 512, 640
    args_list = []
    for _ in range(rotations):
        pool = torch.randn(rows * keys, dim, generator=g).to(device, torch.bfloat16)
        idx = (torch.arange(rows)[:, None] * keys + torch.stack([torch.randperm(keys, generator=g)
                                                                  for _ in range(rows)])).to(device)
        q = torch.randn(rows, heads, dim, generator=g).to(device, torch.bfloat16)
        sink = torch.randn(heads, generator=g).to(device)
        args_list.append((q, pool, idx, sink, dim ** -0.5))
    nbytes = rows * (keys * dim * 2 + 2 * heads * dim * 2 + keys * 8)
    return Case(f"sparse_attention[T={rows}]", args_list, nbytes, rows * 2 * 2 * heads * keys * dim, True)


def sparse_attention_records_case(rows: int, device: str, g, rotations: int, shared: bool = False) -> Case:
    """The same attention reading the caches as stored: 128 fp8_window records (528 B) and 512 nvfp4 records
    (288 B) per row. Every row's records are distinct (a batch of decodes), or with ``shared`` the rows are one
    sequence's (prefill / DSpark verify): row t sees window positions t..t + 127 and 512 of 1024 entries, so
    keys are shared and the CUDA backend pools them. Bytes count each row's reads either way."""
    heads, dim, window, selected = 64, 512, 128, 512
    window_rows, entries = (rows + window - 1, 2 * selected) if shared else (rows * window, rows * selected)
    args_list = []
    for _ in range(rotations):
        window_cache = ops.pack_cache_records(torch.randn(window_rows, dim, generator=g), "fp8_window").to(device)
        compressed_cache = ops.pack_cache_records(torch.randn(entries, dim, generator=g), "nvfp4").to(device)
        first_key = torch.arange(rows)[:, None] * (1 if shared else window)
        window_slots = (first_key + torch.arange(window)[None, :]).to(device)
        picks = [torch.randperm(entries if shared else selected, generator=g)[:selected] for _ in range(rows)]
        compressed_slots = torch.stack(picks) + (0 if shared else torch.arange(rows)[:, None] * selected)
        compressed_slots = compressed_slots.sort(dim=1).values.to(device)
        q = torch.randn(rows, heads, dim, generator=g).to(device, torch.bfloat16)
        sink = torch.randn(heads, generator=g).to(device)
        args_list.append((q, window_cache, window_slots, compressed_cache, compressed_slots, sink, dim ** -0.5))
    nbytes = rows * (window * 528 + selected * 288 + 2 * heads * dim * 2 + (window + selected) * 8)
    flops = rows * 2 * 2 * heads * (window + selected) * dim
    return Case(f"sparse_attention_records[T={rows}{', shared' if shared else ''}]", args_list, nbytes, flops, True)


def moe_experts_case(tokens: int, experts: ops.ExpertWeights, g) -> Case:
    """One MoE layer's routed experts at V4.1 shapes (top-6 of the stack, router-like weights): bytes are the
    touched experts' FP4 weights and scales (17/32 B per parameter) plus activations."""
    n_experts, inter, half_dim = experts.w1.shape
    dim = 2 * half_dim
    device = experts.w1.device
    ids = torch.rand(tokens, n_experts, generator=g).argsort(dim=1)[:, :6].to(device)
    weights = torch.rand(tokens, 6, generator=g).to(device)
    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(device)
    touched = int(ids.unique().numel())
    nbytes = touched * 3 * dim * inter * 17 // 32 + tokens * dim * (2 + 4)
    return Case(f"moe_experts[T={tokens}, E={n_experts}]", [(x, weights, ids, experts, 10.0)], nbytes,
                tokens * 6 * 3 * 2 * dim * inter, notes=dict(touched=touched), rounding=x.dtype)


def v41_experts(n_experts: int, device: str, dim: int = 5120, inter: int = 2304) -> ops.ExpertWeights:
    """A stack of random FP4 experts (V4.1: d = 5120, I = 2304) made on the device (a full layer's 384 are 6.8 GB).
    Random codes and scales 2^-9..2^-5 give V4.1-sized outputs: magnitudes up to ~130, rms ~25 per token."""
    torch.manual_seed(0)

    def codes(*shape):
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=device)

    def scales(*shape):
        return torch.randint(118, 123, shape, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)

    return ops.ExpertWeights(codes(n_experts, inter, dim // 2), scales(n_experts, inter, dim // 32),
                             codes(n_experts, inter, dim // 2), scales(n_experts, inter, dim // 32),
                             codes(n_experts, dim, inter // 2), scales(n_experts, dim, inter // 32))


def cases(device: str, quick: bool) -> list[Case]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    b = 8 if quick else 64  # decode tokens
    out = []
    x = rnd(b * 64, 512)
    n = x.numel()
    out.append(Case("fp8_fake_quant", [(x,)], 2 * n * 2))
    out.append(Case("nvfp4_fake_quant", [(x,)], 2 * n * 2))
    out.append(Case("mxfp4_fake_quant", [(rnd(b * 32, 128),)], 2 * b * 32 * 128 * 2))
    slots = torch.randperm(4 * b, generator=g)[:b].to(device)
    for fmt, dim in (("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128)):
        cache = torch.zeros(4 * b, ops.record_bytes(fmt, dim), dtype=torch.uint8, device=device)
        out.append(Case(f"cache_write[{fmt}]", [(cache, slots, rnd(b, dim), fmt)],
                        b * (dim * 2 + ops.record_bytes(fmt, dim)), in_place=True))
    n_keys = 8192 if quick else 32768
    qi = ops.mxfp4_fake_quant(rnd(b, 32, 128))
    keys = ops.mxfp4_fake_quant(rnd(n_keys, 128))
    out.append(Case("indexer_scores", [(qi, rnd(b, 32, dtype=torch.float32), keys)],
                    n_keys * 128 * 2 + b * n_keys * 4, b * 2 * 32 * 128 * n_keys))
    scores = torch.randn(b, n_keys, generator=g).to(device)
    out.append(Case("topk_indices", [(scores, 512)], b * n_keys * 4 + b * 512 * 8))
    visible = torch.full((b,), n_keys, device=device)
    out.append(Case("indexer_topk", [(qi, rnd(b, 32, dtype=torch.float32), keys, visible, 512)],
                    n_keys * 128 * 2 + b * 512 * 8, b * 2 * 32 * 128 * n_keys))
    # the model's indexer call: every decode row of a batch scores its own sequence's mxfp4 key records
    per_sequence = n_keys // 8
    key_table = ops.pack_cache_records(ops.mxfp4_fake_quant(rnd(b * per_sequence, 128)), "mxfp4")
    key_slots = torch.randperm(b * per_sequence, generator=g).view(b, per_sequence).to(device)
    out.append(Case("indexer_topk_records[batch]", [(qi, rnd(b, 32, dtype=torch.float32), key_table, key_slots,
                                                     torch.full((b,), per_sequence, device=device), 512, None,
                                                     [1] * b)],
                    b * per_sequence * 68 + b * 512 * 8, b * 2 * 32 * 128 * per_sequence))
    # shared-expert up projection (FP8, 32x32 block scales) and a routed expert's (FP4): 5120 -> 2304
    w8, s8 = ops.quantize_fp8_weight(torch.randn(2304, 5120, generator=g) * 0.02)
    w4, s4 = ops.quantize_fp4_weight(torch.randn(2304, 5120, generator=g) * 0.02)
    act = rnd(b, 5120)
    out.append(Case("linear_fp8", [(act, w8.to(device), s8.to(device))], 2304 * 5120 + b * (5120 + 2304) * 2,
                    2 * b * 5120 * 2304))
    out.append(Case("linear_fp4", [(act, w4.to(device), s4.to(device))], 2304 * 5120 * 17 // 32
                    + b * (5120 + 2304) * 2, 2 * b * 5120 * 2304))
    # the router and the LM head: bf16 weights, fp32 logits (the model made an fp32 copy of each weight per call);
    # the CPU times an eighth of the vocabulary
    vocab = 129280 if device == "cuda" else 129280 // 8
    for label, out_features in (("router", 384), ("head", vocab)):
        weight = (torch.randn(out_features, 5120, generator=g) * 0.02).bfloat16().to(device)
        out.append(Case(f"linear_to_fp32[{label}]", [(rnd(b, 5120), weight)],
                        out_features * 5120 * 2 + b * (5120 * 2 + out_features * 4), 2 * b * out_features * 5120))
    # wo_a: 8 groups of 1024 rows over 4096 columns (64 heads x 512 / 8); the model dequantised it every call
    wo_a, wo_a_scale = ops.quantize_fp8_weight(torch.randn(8192, 4096, generator=g) * 0.02)
    out.append(Case("linear_fp8_grouped", [(rnd(b, 8, 4096), wo_a.to(device), wo_a_scale.to(device))],
                    8192 * 4096 + b * 8 * (4096 + 1024) * 2, 2 * b * 8192 * 4096))
    streams = rnd(b, 4, 5120)
    kv = rnd(b, 5 * 5120)  # Engram's wkv output: the key of every stream, then the value
    out.append(Case("engram_gate", [(streams, kv[:, : 4 * 5120].unflatten(-1, (4, 5120)), kv[:, 4 * 5120:],
                                     rnd(4, 5120, dtype=torch.float32), 1e-20)],
                    b * (4 + 5 + 4) * 5120 * 2 + 4 * 5120 * 4))
    out.append(Case("csa2_compress", [(rnd(b * 2, 512, dtype=torch.float32), rnd(b * 2, 512, dtype=torch.float32), 2,
                                       rnd(512, dtype=torch.float32), 1e-20, torch.bfloat16)],
                    b * 2 * 2 * 512 * 4 + b * 512 * 2))
    out.append(Case("hc_coefficients", [(streams, rnd(24, 4 * 5120, dtype=torch.float32),
                                         rnd(24, dtype=torch.float32), rnd(3, dtype=torch.float32), 20, 1e-6, 1e-20)],
                    b * 4 * 5120 * 2 + 24 * 4 * 5120 * 4, b * 2 * 24 * 4 * 5120))
    out.append(Case("hc_collapse", [(streams, rnd(b, 4, dtype=torch.float32))], b * 5 * 5120 * 2))
    out.append(Case("hc_collapse_norm", [(streams, rnd(b, 4, dtype=torch.float32), rnd(5120), 1e-20)],
                    b * 5 * 5120 * 2 + 5120 * 2))
    out.append(Case("hc_expand", [(streams, rnd(b, 5120), rnd(b, 4, dtype=torch.float32),
                                   rnd(b, 4, 4, dtype=torch.float32))], b * 9 * 5120 * 2))
    out.append(Case("rms_norm", [(rnd(b, 5120), rnd(5120), 1e-20)], b * 2 * 5120 * 2))
    out.append(Case("sqrtsoftplus_route", [(rnd(b, 384, dtype=torch.float32), rnd(384, dtype=torch.float32), 6,
                                            1.5)], b * 384 * 4))
    table, tscale = ops.quantize_fp8_rows(torch.randn(100_000 if quick else 1_000_000, 256, generator=g))
    ids = torch.randint(0, table.shape[0], (b, 48), generator=g)
    out.append(Case("engram_gather", [(table.to(device), tscale.to(device), ids.to(device), torch.bfloat16)],
                    b * 48 * (264 + 512)))
    # a layer's routed experts: all 384 on a GPU (decode, a batch, a prefill chunk); 8 on a CPU, where the
    # reference dequantises every touched expert per call
    experts = v41_experts(384 if device == "cuda" and not quick else 8, device)
    for tokens in ((1, b, 512) if device == "cuda" else (b,)):
        out.append(moe_experts_case(tokens, experts, g))
    rotations = 1 if device == "cpu" else 4  # last: with --sweep these are most of the run
    for rows in ((8,) if quick or device == "cpu" else SPARSE_ROWS):
        out.append(sparse_attention_case(rows, device, g, rotations))
        out.append(sparse_attention_records_case(rows, device, g, rotations))
        if rows >= 32:
            out.append(sparse_attention_records_case(rows, device, g, rotations, shared=True))
    return out


def agrees(got, want, exact: bool) -> tuple[bool, str]:
    got = got if isinstance(got, torch.Tensor) else got[0]
    want = want if isinstance(want, torch.Tensor) else want[0]
    if exact or not got.dtype.is_floating_point:
        same = torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)
        return same, "bit-exact" if same else "bits differ"
    a, b = got.double().flatten(), want.double().flatten()
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    cos = torch.nn.functional.cosine_similarity(a[None], b[None]).item() if a.numel() else 1.0
    ok = torch.allclose(a, b, atol=2e-2, rtol=2e-2) and cos > 0.9999
    return ok, f"max abs {max_abs:.2e}, cos {cos:.6f}"


def in_float64(value):
    """Float tensors (fp32 and wider-than-byte formats; FP8 / E8M0 codes stay as stored) in float64, through tuples
    and NamedTuples: the arguments of a reference run without rounding to bf16."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.dtype.is_floating_point and value.dtype.itemsize > 1 else value
    if isinstance(value, tuple):
        converted = [in_float64(v) for v in value]
        return type(value)(*converted) if hasattr(value, "_fields") else tuple(converted)
    return value


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| of every row (last dimension), in float64."""
    a, b = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=torch.finfo(torch.float64).tiny)


def agrees_by_row(got, want, want64, rounding: torch.dtype) -> tuple[bool, str]:
    """For an op whose every path rounds the same intermediates to ``rounding`` as the reference does (the routed
    experts: projections, SwiGLU, weighted activation and down projection in x's bf16) and differs only in the
    fp32 summation order of its dot products. An order difference moves a rounding by one bf16 step wherever the
    exact value lies near a boundary, and at V4.1's output magnitudes (up to ~130) one step is 0.25 to 0.5: two
    correct paths fail any fixed elementwise tolerance, with cosine 1.000000. Per row, each path is within about
    one unit roundoff u = 2^-8 of the unrounded result (the reference against its own run on float64 inputs:
    3.6e-3 to 4.0e-3 per row at V4.1 width, 5.6e-3 at 512), so two correct paths are within 2u = 7.8e-3 of each
    other, and in practice far closer, as they round alike almost everywhere (worst rows 3e-4 to 6e-4). Pass:
    every row within 2u of the reference. A wrong expert, a dropped assignment, swapped nibbles or an expert's
    scales off by a binade move a row by 0.2 to 0.8 of its norm (tests/ops/test_kernel_benchmark_check.py), one
    wrong scale column of an expert by 2.4e-2. A single misread 32-weight block moves one element per row and can
    hide in the rounding at these magnitudes: tests/ops/test_triton_moe.py checks the indexing elementwise at
    small ones. ``want64``, the reference on float64 inputs, is reported: the table then shows how far the
    reference itself is from the unrounded result."""
    got = got if isinstance(got, torch.Tensor) else got[0]
    want = want if isinstance(want, torch.Tensor) else want[0]
    tol = torch.finfo(rounding).eps  # 2u
    worst = row_errors(got, want).max().item() if want.numel() else 0.0
    max_abs = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    text = f"row err {worst:.1e} (tol {tol:.1e}), max abs {max_abs:.2e}"
    if want64 is not None and want.numel():
        text += (f"; vs fp64: reference {row_errors(want, want64).max().item():.1e}, "
                 f"this {row_errors(got, want64).max().item():.1e}")
    return bool(worst <= tol), text


def attention_variants(device: str) -> dict:
    """Named sparse-attention implementations to sweep: Triton tile configurations and the CUDA kernels this
    device's architecture runs (mma and simt everywhere, wgmma on sm_90, tcgen05 on sm_100 / sm_103)."""
    variants = {}
    if device != "cuda":
        return variants
    from deepinfer_plugins.ops.backends.triton_kernels import attention as triton_attention

    for c in triton_attention.CANDIDATE_CONFIGS:
        name = (f"triton hb{c.head_block} bk{c.key_block} w{c.num_warps} s{c.num_stages} "
                f"{'auto-split' if c.splits == 0 else 'no-split'}")
        variants[name] = lambda *a, c=c: triton_attention.sparse_attention(*a, config=c)
    try:
        from deepinfer_plugins.ops.backends import cuda_backend
    except Exception as exc:  # reported in the table instead of the CUDA rows
        variants["cuda"] = exc
        return variants
    major = torch.cuda.get_device_capability()[0]
    for kind in ("mma", "simt") + {9: ("wgmma",), 10: ("tcgen05",)}.get(major, ()):
        variants[f"cuda {kind}"] = getattr(cuda_backend, f"sparse_attention_{kind}")
    return variants


def gemm_variants(device: str) -> dict:
    """Named linear_fp8 / linear_fp4 implementations to sweep: every Triton tile configuration of both ops."""
    variants = {}
    if device != "cuda":
        return variants
    from deepinfer_plugins.ops.backends.triton_kernels import gemm as triton_gemm

    for op_name in ("linear_fp8", "linear_fp4"):
        launcher = getattr(triton_gemm, op_name)
        for c in triton_gemm.CANDIDATE_CONFIGS:
            name = (f"{op_name} triton bm{c.block_m} bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages} "
                    f"{'auto-split' if c.split_k == 0 else 'no-split'}")
            variants[name] = lambda *a, c=c, launcher=launcher: launcher(*a, config=c)
    return variants


def moe_variants(sweep: bool) -> dict:
    """The path the model took before the grouped kernel (one registry linear_fp4 call per projection and
    expert, the expert counts read on the host) and, with --sweep, every Triton tile configuration."""
    from deepinfer_plugins.ops.moe import experts_one_by_one

    variants = {"per-expert linear_fp4 loop": lambda *a: experts_one_by_one(*a, ops.linear_fp4)}
    if sweep:
        from deepinfer_plugins.ops.backends.triton_kernels import moe as triton_moe

        for c in triton_moe.CANDIDATE_CONFIGS:
            name = f"triton bm{c.block_m} bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}"
            variants[name] = lambda *a, c=c: triton_moe.moe_experts(*a, config=c)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="compare each backend with the reference first")
    parser.add_argument("--sweep", action="store_true",
                        help="also time every sparse-attention and linear_fp8 / linear_fp4 variant")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], metavar="LABEL",
                        help="backend / variant labels to leave out (e.g. 'cuda wgmma' after its tests failed)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.md"))
    args = parser.parse_args()
    device = args.device
    timer = time_gpu if device == "cuda" else time_cpu
    bw, mm = copy_bandwidth(device), matrix_rate(device)
    print(json.dumps(dict(copy_GBps=round(bw / 1e9, 1), bf16_matmul_TFLOPs=round(mm / 1e12, 1))), flush=True)
    sweep = attention_variants(device) if args.sweep else {}
    gemm_sweep = gemm_variants(device) if args.sweep else {}
    rows, failures = [], []
    for case in cases(device, args.quick):
        op_name = case.name.split("[")[0]
        op = getattr(ops, op_name)
        impls = {"reference": op.reference}
        if device != "cpu":
            impls.update((b, ops.registry.ops[op_name].backends[b]) for b in ops.registry.backends_of(op_name)[1:])
            if op_name == "sparse_attention":
                impls.update(sweep)
            if op_name in ("linear_fp8", "linear_fp4"):
                impls.update((name, fn) for name, fn in gemm_sweep.items() if name.startswith(op_name + " "))
            if op_name == "moe_experts":
                impls.update(moe_variants(args.sweep))
            if op_name == "hc_collapse_norm":  # the two launches the model made before the fused op
                impls["hc_collapse then rms_norm"] = lambda s, p, w, e: ops.rms_norm(ops.hc_collapse(s, p), w, e)
        first = case.args_list[0]
        ref_out = ref64 = None
        reference_seconds = None
        copy_seconds = None if case.compute_bound else same_size_copy(case.nbytes, len(case.args_list), device, timer)
        for label, fn in impls.items():
            if label in args.skip:
                continue
            if isinstance(fn, Exception):
                rows.append(dict(op=case.name, backend=label, error=f"{type(fn).__name__}: {fn}"[:160]))
                continue
            try:
                check_args = (first[0].clone(),) + tuple(first[1:]) if case.in_place else first
                result = fn(*check_args)
                if result is NotImplemented:
                    rows.append(dict(op=case.name, backend=label, error="declines this call (the next choice runs it)"))
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                if device == "cuda":
                    torch.cuda.synchronize()
                verdict = ""
                if label == "reference":
                    ref_out = result
                    if args.check and case.rounding is not None:
                        ref64 = op.reference(*in_float64(first))
                elif args.check and ref_out is not None:
                    ok, verdict = (agrees_by_row(result, ref_out, ref64, case.rounding) if case.rounding is not None
                                   else agrees(result, ref_out, op_name in EXACT_OPS))
                    if not ok:
                        failures.append(f"{case.name}/{label} ({verdict})")
                        verdict = "MISMATCH " + verdict
                seconds = timer(fn, case.args_list)
            except Exception as exc:  # a backend or configuration that cannot run this shape is reported
                rows.append(dict(op=case.name, backend=label, error=f"{type(exc).__name__}: {exc}"[:160]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            if label == "reference":
                reference_seconds = seconds
            frac = (case.flops / seconds) / mm if case.compute_bound else (case.nbytes / seconds) / bw
            row = dict(op=case.name, backend=label, us=round(seconds * 1e6, 2), MB=round(case.nbytes / 1e6, 3),
                       GFLOP=round(case.flops / 1e9, 3), GBps=round(case.nbytes / seconds / 1e9, 1),
                       TFLOPs=round(case.flops / seconds / 1e12, 1),
                       ceiling="matrix" if case.compute_bound else "copy bw", fraction=round(frac, 3),
                       vs_reference=round(reference_seconds / seconds, 2) if reference_seconds else None,
                       vs_copy=round(copy_seconds / seconds, 3) if copy_seconds else None, check=verdict)
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    header = (f"# Kernel benchmark ({device}, {name})\n\n"
              f"Measured in this run: copy bandwidth {bw / 1e9:.1f} GB/s (read + write), dense bf16 matmul "
              f"{mm / 1e12:.1f} TFLOP/s (8192^3 on a GPU, 1024^3 on a CPU). fraction = achieved / ceiling "
              f"(matrix for sparse attention, copy bandwidth otherwise); speed-up = reference time / this time; "
              f"vs copy = time of a device copy of the same bytes / this time (1.0: as fast as any memory-bound op "
              f"of that size can be; blank for compute-bound cases and above 1 GB). "
              f"Generated by "
              f"benchmarks/kernels.py{' --quick' if args.quick else ''}{' --sweep' if args.sweep else ''}"
              f"{' --check' if args.check else ''}.\n\n"
              "| op | backend | time (us) | MB moved | GFLOP | GB/s | TFLOP/s | ceiling | fraction | vs copy "
              "| speed-up | check |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['op']} | {r['backend']} | " + (f"error: {r['error']} | | | | | | | | | |\n" if "error" in r else
        f"{r['us']} | {r['MB']} | {r['GFLOP']} | {r['GBps']} | {r['TFLOPs']} | {r['ceiling']} | {r['fraction']} | "
        f"{r['vs_copy'] or ''} | {r['vs_reference']} | {r['check']} |\n") for r in rows)
    if failures:
        body += f"\nMISMATCH vs reference: {', '.join(failures)}\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(header + body)
    print(f"wrote {args.out}")
    if failures:
        raise SystemExit(f"backends disagree with the reference: {failures}")


if __name__ == "__main__":
    main()
