"""Sparse MQA with a sink over per-query key sets: single-token decode and multi-token (DSpark) verification.

One program per (query row, block of heads, key split); keys are gathered by index from the pool (K = V, one
latent shared by all heads), with an online softmax. Rows of any number of queries per sequence are
independent, so verification of s_q draft tokens is the same launch with s_q rows.

Decode batches are small: T rows x H/HB head blocks can leave most multiprocessors idle, so the key set is
split (flash-decoding): each split writes its unnormalised partial output with its running max and sum, and a
combine kernel folds the splits and the sink together. With one split the sink seeds the running max and sum
(its value vector is zero) and the output is written directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, empty, next_pow2

EMPTY_MAX = tl.constexpr(-1.0e30)  # running max of a split that has seen no valid key yet: finite, so exp(EMPTY_MAX - m) = 0


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
# each fits the shared memory of sm_90 and sm_100 (tests/ops/test_triton_gpu_compile.py compiles them all).
DEFAULT_CONFIG = AttentionConfig()
WIDE_CONFIG = AttentionConfig(head_block=64, key_block=32, num_warps=8, num_stages=2)
WIDE_FROM_ROWS = 128
CANDIDATE_CONFIGS = tuple(
    AttentionConfig(hb, bk, warps, stages, splits)
    for hb, bk, warps, stages in ((16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (16, 16, 4, 2), (32, 32, 4, 2),
                                  (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1), (64, 16, 8, 2))
    for splits in (0, 1))
SPLIT_BELOW_PROGRAMS = 132  # one wave of an H200's multiprocessors: fewer programs leave SMs idle
TARGET_PROGRAMS = 264  # what a split launch aims for: two waves


@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, part_ptr, stat_ptr, H, D, K, keys_per_split,
                             softmax_scale, HB: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr,
                             PV_FP32: tl.constexpr, SPLIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    split = tl.program_id(2)
    d = tl.arange(0, DP)
    hmask = h < H
    qmask = hmask[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=qmask, other=0.0)  # [HB, DP]
    if PV_FP32:
        q = q.to(tl.float32)
    if SPLIT:
        m = tl.full([HB], EMPTY_MAX, tl.float32)
        l = tl.zeros([HB], tl.float32)
    else:
        m = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)  # running max starts at the sink logit
        l = tl.full([HB], 1.0, tl.float32)  # exp(sink - m) = 1
    acc = tl.zeros([HB, DP], tl.float32)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, K)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + t * K + kk, mask=kk < k_end, other=-1).to(tl.int64)  # [BK]
        valid = idx >= 0
        keys = tl.load(kv_ptr + tl.maximum(idx, 0)[:, None] * D + d[None, :],
                       mask=valid[:, None] & (d[None, :] < D), other=0.0)  # [BK, DP]
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
        m = m_new
    if SPLIT:
        n_splits = tl.num_programs(2)
        row = (t * n_splits + split) * H + h  # partials [T, splits, H, D], stats [T, splits, H, 2]
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(stat_ptr + row * 2, m, mask=hmask)
        tl.store(stat_ptr + row * 2 + 1, l, mask=hmask)
    else:
        o = acc / l[:, None]
        tl.store(o_ptr + (t * H + h)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _combine_splits_kernel(part_ptr, stat_ptr, sink_ptr, o_ptr, H, D, SPLITS: tl.constexpr, SP: tl.constexpr,
                           DP: tl.constexpr):
    """o[t, h] = sum_s exp(m_s - M) acc_s / (exp(sink - M) + sum_s exp(m_s - M) l_s), M = max(sink, m_s)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    smask = s < SPLITS
    row = (t * SPLITS + s) * H + h  # [SP]
    m = tl.load(stat_ptr + row * 2, mask=smask, other=EMPTY_MAX)
    l = tl.load(stat_ptr + row * 2 + 1, mask=smask, other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - top)  # [SP]
    denominator = tl.exp(sink - top) + tl.sum(w * l, axis=0)
    acc = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / denominator
    tl.store(o_ptr + (t * H + h) * D + d, o.to(o_ptr.dtype.element_ty), mask=d < D)


def split_count(t: int, head_blocks: int, k: int, key_block: int) -> int:
    """Key splits for launches under one wave: enough to reach TARGET_PROGRAMS, each at least two key blocks."""
    programs = t * head_blocks
    if programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    return max(1, min(-(-TARGET_PROGRAMS // programs), k // (2 * key_block)))


def sparse_attention(q: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float, config: AttentionConfig | None = None) -> torch.Tensor:
    """q [T, H, D]; kv_pool [P, D]; indices [T, K] (-1 = unused); sink [H] -> o [T, H, D] in q's dtype."""
    t, h, d = q.shape
    out = empty(q.shape, q.dtype, q.device)
    if t == 0:
        return out
    k = indices.shape[1]
    kv_pool = kv_pool.to(q.dtype).contiguous()
    sink = sink.float().contiguous()
    dp = max(16, next_pow2(d))
    pv_fp32 = INTERPRETED or q.dtype == torch.float32
    if INTERPRETED:  # the interpreter's cost is per program: one wide tile, no splits unless asked
        config = config or AttentionConfig(head_block=64, key_block=512, splits=1)
    config = config or (WIDE_CONFIG if t >= WIDE_FROM_ROWS else DEFAULT_CONFIG)
    hb = max(16, min(next_pow2(h), config.head_block))
    bk = max(16, min(next_pow2(k), config.key_block))
    head_blocks = triton.cdiv(h, hb)
    splits = config.splits or split_count(t, head_blocks, k, bk)
    splits = max(1, min(splits, triton.cdiv(k, bk)))
    keys_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, keys_per_split)
    launch = dict(HB=hb, DP=dp, BK=bk, PV_FP32=pv_fp32, SPLIT=splits > 1)
    if not INTERPRETED:
        launch.update(num_warps=config.num_warps, num_stages=config.num_stages)
    q, indices = q.contiguous(), indices.contiguous()
    if splits == 1:
        _sparse_attention_kernel[(t, head_blocks, 1)](q, kv_pool, indices, sink, out, out, sink, h, d, k, k,
                                                      float(softmax_scale), **launch)
        return out
    partials = torch.empty(t, splits, h, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(t, splits, h, 2, dtype=torch.float32, device=q.device)
    _sparse_attention_kernel[(t, head_blocks, splits)](q, kv_pool, indices, sink, out, partials, stats, h, d, k,
                                                       keys_per_split, float(softmax_scale), **launch)
    _combine_splits_kernel[(t, h)](partials, stats, sink, out, h, d, SPLITS=splits, SP=next_pow2(splits),
                                   DP=dp)
    return out
