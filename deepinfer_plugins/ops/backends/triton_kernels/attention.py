"""Sparse MQA with a sink over per-query key sets: single-token decode and multi-token (DSpark) verification.

One program per (query row, block of heads, key split); keys are gathered by index from the pool (K = V, one
latent shared by all heads), with an online softmax. Rows of any number of queries per sequence are
independent, so verification of s_q draft tokens is the same launch with s_q rows.

Decode batches are small: T rows x H/HB head blocks can leave most multiprocessors idle, so the key set is
split (flash-decoding): each split writes its unnormalised partial output with its running max and sum, and a
combine kernel folds the splits and the sink together. With one split the sink seeds the running max and sum
(its value vector is zero) and the output is written directly.

``sparse_attention_records`` runs the same online softmax over keys decoded in registers from the quantised
cache records (fp8_window for the window, nvfp4 for the selected compressed entries), so a decode step reads
528 or 288 bytes per key instead of a bf16 row's 1024.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (INTERPRETED, TRITON_ASCEND, cut_launch_jit, e2m1_decode, e4m3_decode, empty, next_pow2, run_kernel,
                     split_count, ue8m0_decode)

# Running max of a split that has seen no valid key yet: finite, so exp(EMPTY_MAX - m) = 0 rather than NaN.
EMPTY_MAX = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch shape. ``splits`` = 0 picks a split count from the grid size."""

    head_block: int = 16
    key_block: int = 32
    num_warps: int = 4
    num_stages: int = 2
    splits: int = 0


# Compiled defaults, from the H200 sweep (benchmarks/results/kernels_h200.md; H=64, D=512, K=640): below ~128 rows
# 16-head tiles with key splits win (T=1: 9.3 us, T=8: 16.3 us, T=64 unsplit: 61 us); at 384 rows 64-head tiles
# with 8 warps take 224 us against 370 us. benchmarks/kernels.py --sweep times every candidate on the GPU at hand;
# each fits the shared memory of sm_90 and sm_100 (python -m tests.ops.triton_aot; CI compiles the defaults only).
DEFAULT_CONFIG = AttentionConfig()
WIDE_CONFIG = AttentionConfig(head_block=64, key_block=32, num_warps=8, num_stages=2)
WIDE_FROM_ROWS = 128
# Attention over cache records decodes each key tile in registers: with 4 warps or wider head tiles that spills
# on sm_90 (tests/ops/triton_aot.py); 16 heads x 32 keys over 8 warps compiles without spills (244 registers).
# Not yet timed on a GPU.
RECORDS_CONFIG = AttentionConfig(head_block=16, key_block=32, num_warps=8, num_stages=2)
CANDIDATE_CONFIGS = tuple(
    AttentionConfig(hb, bk, warps, stages, splits)
    for hb, bk, warps, stages in ((16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (16, 16, 4, 2), (32, 32, 4, 2),
                                  (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1), (64, 16, 8, 2))
    for splits in (0, 1))


@triton.jit
def _initial_state(sink_ptr, h, hmask, HB: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr):
    """(running max, running sum, accumulator). Unsplit, the sink seeds them (its value vector is zero); a split
    starts empty and the combine kernel adds the sink once."""
    if SPLIT:
        m = tl.full([HB], EMPTY_MAX, tl.float32)
        l = tl.zeros([HB], tl.float32)
    else:
        m = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
        l = tl.full([HB], 1.0, tl.float32)  # exp(sink - m) = 1
    return m, l, tl.zeros([HB, DP], tl.float32)


@triton.jit
def _online_step(q, keys, valid, m, l, acc, softmax_scale, PV_FP32: tl.constexpr):
    """Fold one key tile (keys [BK, DP] = values, valid [BK]) into the online softmax of q [HB, DP]."""
    if PV_FP32:
        keys = keys.to(tl.float32)
        s = tl.dot(q, tl.trans(keys), input_precision="ieee") * softmax_scale  # [HB, BK]
    else:
        s = tl.dot(q, tl.trans(keys)) * softmax_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if PV_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, keys, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys)
    return m_new, l, acc


@triton.jit
def _write_result(o_ptr, part_ptr, stat_ptr, t, h, d, hmask, qmask, m, l, acc, T, H, D, SPLIT: tl.constexpr):
    if SPLIT:
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        row = (t * n_splits + split) * H + h  # partials [T, splits, H, D], stats [2, T, splits, H]
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(stat_ptr + row, m, mask=hmask)
        tl.store(stat_ptr + T * n_splits * H + row, l, mask=hmask)
    else:
        o = acc / l[:, None]
        tl.store(o_ptr + (t * H + h)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qmask)


@cut_launch_jit
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, part_ptr, stat_ptr, H, D, K, keys_per_split,
                             softmax_scale, T, first_program, HB: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr,
                             PV_FP32: tl.constexpr, SPLIT: tl.constexpr):
    t = (tl.program_id(0) + first_program).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    d = tl.arange(0, DP)
    hmask = h < H
    qmask = hmask[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=qmask, other=0.0)  # [HB, DP]
    if PV_FP32:
        q = q.to(tl.float32)
    m, l, acc = _initial_state(sink_ptr, h, hmask, HB, DP, SPLIT)
    k_begin = tl.program_id(2) * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, K)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + t * K + kk, mask=kk < k_end, other=-1).to(tl.int64)  # [BK]
        valid = idx >= 0
        keys = tl.load(kv_ptr + tl.maximum(idx, 0)[:, None] * D + d[None, :],
                       mask=valid[:, None] & (d[None, :] < D), other=0.0)  # [BK, DP]
        m, l, acc = _online_step(q, keys, valid, m, l, acc, softmax_scale, PV_FP32)
    _write_result(o_ptr, part_ptr, stat_ptr, t, h, d, hmask, qmask, m, l, acc, T, H, D, SPLIT)


@triton.jit
def _fp8_values(codes, HW_FP8: tl.constexpr):
    """E4M3 bytes (uint8) -> fp32. Compiled, the hardware conversion (exact, and far fewer registers than the
    integer decode over a [keys, 512] tile); the interpreter has no fp8 type and triton-ascend rejects it, so
    both take the integer decode."""
    if HW_FP8:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_decode(codes.to(tl.int32))


@cut_launch_jit
def _sparse_attention_records_kernel(q_ptr, win_ptr, win_slot_ptr, comp_ptr, comp_slot_ptr, sink_ptr, o_ptr,
                                     part_ptr, stat_ptr, H, D, W, C, win_stride, comp_stride, keys_per_split,
                                     softmax_scale, T, first_program, HB: tl.constexpr, DP: tl.constexpr,
                                     BK: tl.constexpr, PV_FP32: tl.constexpr, SPLIT: tl.constexpr,
                                     HW_FP8: tl.constexpr):
    """As ``_sparse_attention_kernel``, with each query row's keys decoded from the cache records in registers:
    keys [0, W) are fp8_window records (D E4M3 bytes, then D / 32 UE8M0 scales), keys [W, W + C) nvfp4 records
    (D / 2 bytes of E2M1 pairs, even channel low, then D / 16 E4M3 scales), rows win_stride / comp_stride bytes
    apart. A split may span both segments."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, DP)
    hmask = h < H
    dmask = d < D
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=qmask, other=0.0)
    if PV_FP32:
        q = q.to(tl.float32)
    m, l, acc = _initial_state(sink_ptr, h, hmask, HB, DP, SPLIT)
    k_begin = tl.program_id(2) * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, W + C)
    groups32 = tl.arange(0, DP // 32)
    for k0 in range(k_begin, tl.minimum(k_end, W), BK):
        kk = k0 + tl.arange(0, BK)
        slot = tl.load(win_slot_ptr + t * W + kk, mask=kk < tl.minimum(k_end, W), other=-1).to(tl.int64)
        valid = slot >= 0
        record = win_ptr + tl.maximum(slot, 0)[:, None] * win_stride
        codes = tl.load(record + d[None, :], mask=valid[:, None] & dmask[None, :], other=0)
        scales = ue8m0_decode(tl.load(record + D + groups32[None, :], mask=valid[:, None] & (groups32 < D // 32),
                                      other=127).to(tl.int32))  # [BK, DP / 32]
        keys = (_fp8_values(codes, HW_FP8).reshape(BK, DP // 32, 32) * scales[:, :, None]).reshape(BK, DP)
        keys = keys.to(q_ptr.dtype.element_ty)
        m, l, acc = _online_step(q, keys, valid, m, l, acc, softmax_scale, PV_FP32)
    for k0 in range(tl.maximum(k_begin, W), k_end, BK):
        kk = k0 - W + tl.arange(0, BK)
        slot = tl.load(comp_slot_ptr + t * C + kk, mask=kk < k_end - W, other=-1).to(tl.int64)
        valid = slot >= 0
        record = comp_ptr + tl.maximum(slot, 0)[:, None] * comp_stride
        lanes = valid[:, None] & dmask[None, :]
        pairs = tl.load(record + d[None, :] // 2, mask=lanes, other=0).to(tl.int32)  # each byte read twice (L1)
        values = e2m1_decode((pairs >> ((d[None, :] % 2) * 4)) & 15)  # even channel in the low nibble
        scales = _fp8_values(tl.load(record + D // 2 + d[None, :] // 16, mask=lanes, other=56), HW_FP8)
        keys = (values * scales).to(q_ptr.dtype.element_ty)
        m, l, acc = _online_step(q, keys, valid, m, l, acc, softmax_scale, PV_FP32)
    _write_result(o_ptr, part_ptr, stat_ptr, t, h, d, hmask, qmask, m, l, acc, T, H, D, SPLIT)


@cut_launch_jit
def _combine_splits_kernel(part_ptr, stat_ptr, sink_ptr, o_ptr, T, H, D, first_program, SPLITS: tl.constexpr,
                           SP: tl.constexpr, DP: tl.constexpr):
    """o[t, h] = sum_s exp(m_s - M) acc_s / (exp(sink - M) + sum_s exp(m_s - M) l_s), M = max(sink, m_s)."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    smask = s < SPLITS
    row = (t * SPLITS + s) * H + h  # [SP]
    m = tl.load(stat_ptr + row, mask=smask, other=EMPTY_MAX)
    l = tl.load(stat_ptr + T * SPLITS * H + row, mask=smask, other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - top)  # [SP]
    denominator = tl.exp(sink - top) + tl.sum(w * l, axis=0)
    acc = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / denominator
    tl.store(o_ptr + (t * H + h) * D + d, o.to(o_ptr.dtype.element_ty), mask=d < D)


def _plan(q: torch.Tensor, k: int, config: AttentionConfig | None) -> tuple[dict, tuple, int]:
    """-> (kernel constexprs and launch options, grid, keys per split) for T = q rows and k keys per row."""
    t, h, d = q.shape
    if INTERPRETED:  # the interpreter's cost is per program: one wide tile, no splits unless asked
        config = config or AttentionConfig(head_block=64, key_block=512, splits=1)
    config = config or (WIDE_CONFIG if t >= WIDE_FROM_ROWS else DEFAULT_CONFIG)
    hb = max(16, min(next_pow2(h), config.head_block))
    bk = max(16, min(next_pow2(k), config.key_block))
    head_blocks = triton.cdiv(h, hb)
    splits = config.splits or split_count(t * head_blocks, k // bk, min_blocks_per_split=2)
    splits = max(1, min(splits, triton.cdiv(k, bk)))
    keys_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, keys_per_split)
    launch = dict(HB=hb, DP=max(16, next_pow2(d)), BK=bk, PV_FP32=INTERPRETED or q.dtype == torch.float32,
                  SPLIT=splits > 1)
    if not INTERPRETED:
        launch.update(num_warps=config.num_warps, num_stages=config.num_stages)
    return launch, (t, head_blocks, splits), keys_per_split


def _run(kernel, q: torch.Tensor, sink: torch.Tensor, keys_args: tuple, k: int, softmax_scale: float,
         config: AttentionConfig | None, **constexprs) -> torch.Tensor:
    """Launch ``kernel`` (q, *keys_args, sink, o, partials, stats, H, D, *sizes, keys_per_split, scale) and, for
    a split launch, the combine kernel. keys_args = (pointer tensors..., sizes...) as the kernel takes them."""
    t, h, d = q.shape
    out = empty(q.shape, q.dtype, q.device)
    if t == 0:
        return out
    launch, grid, keys_per_split = _plan(q, k, config)
    launch.update(constexprs)
    pointers, sizes = keys_args
    sink = sink.float().contiguous()
    splits = grid[2]
    if splits == 1:
        run_kernel(kernel, grid, q.contiguous(), *pointers, sink, out, out, sink, h, d, *sizes, keys_per_split,
                   float(softmax_scale), t, **launch)
        return out
    partials = torch.empty(t, splits, h, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, t, splits, h, dtype=torch.float32, device=q.device)  # running max, then running sum
    run_kernel(kernel, grid, q.contiguous(), *pointers, sink, out, partials, stats, h, d, *sizes, keys_per_split,
               float(softmax_scale), t, **launch)
    run_kernel(_combine_splits_kernel, (t, h), partials, stats, sink, out, t, h, d, SPLITS=splits, SP=next_pow2(splits),
               DP=launch["DP"])
    return out


def sparse_attention(q: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float, config: AttentionConfig | None = None) -> torch.Tensor:
    """q [T, H, D]; kv_pool [P, D]; indices [T, K] (-1 = unused); sink [H] -> o [T, H, D] in q's dtype."""
    k = indices.shape[1]
    keys = ((kv_pool.to(q.dtype).contiguous(), indices.contiguous()), (k,))
    return _run(_sparse_attention_kernel, q, sink, keys, k, softmax_scale, config)


def sparse_attention_records(q: torch.Tensor, window_cache: torch.Tensor, window_slots: torch.Tensor,
                             compressed_cache: torch.Tensor, compressed_slots: torch.Tensor, sink: torch.Tensor,
                             softmax_scale: float, config: AttentionConfig | None = None) -> torch.Tensor:
    """q [T, H, D] with D a multiple of 32; fp8_window records [Pw, D + D/32] at window_slots [T, W]; nvfp4
    records [Pc, D/2 + D/16] at compressed_slots [T, C]; slot -1 = unused -> o [T, H, D] in q's dtype. Cache
    rows may be strided (an engine's row holds more than the record); only the bytes within a row must be dense."""
    if q.shape[-1] % 32:
        raise ValueError(f"cache records hold 32-channel scale blocks; head dim {q.shape[-1]} is not a multiple of 32")
    w, c = window_slots.shape[1], compressed_slots.shape[1]
    if window_cache.stride(-1) != 1 or compressed_cache.stride(-1) != 1:
        raise ValueError("cache records must be dense within a row (stride 1 over the bytes of a record)")
    pointers = (window_cache, window_slots.contiguous(), compressed_cache, compressed_slots.contiguous())
    config = config or (None if INTERPRETED else RECORDS_CONFIG)
    sizes = (w, c, window_cache.stride(0), compressed_cache.stride(0))
    return _run(_sparse_attention_records_kernel, q, sink, (pointers, sizes), w + c, softmax_scale, config,
                HW_FP8=not INTERPRETED and not TRITON_ASCEND)
