"""Sparse MQA with a sink over per-query key sets: single-token decode and multi-token (DSpark) verification.

One program per (query row, block of heads); keys are gathered by index from the pool (K = V, one latent
shared by all heads), with an online softmax whose running max and sum start at the sink logit (its value
vector is zero). Rows of any number of queries per sequence are independent, so verification of s_q draft
tokens is the same launch with s_q rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, empty, next_pow2


@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, H, D, K, softmax_scale,
                             HB: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr, PV_FP32: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    d = tl.arange(0, DP)
    hmask = h < H
    qmask = hmask[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=qmask, other=0.0)  # [HB, DP]
    if PV_FP32:
        q = q.to(tl.float32)
    m = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)  # running max starts at the sink logit
    l = tl.full([HB], 1.0, tl.float32)  # exp(sink - m) = 1
    acc = tl.zeros([HB, DP], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + t * K + kk, mask=kk < K, other=-1).to(tl.int64)  # [BK]
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
    o = acc / l[:, None]
    tl.store(o_ptr + (t * H + h)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qmask)


def sparse_attention(q: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """q [T, H, D]; kv_pool [P, D]; indices [T, K] (-1 = unused); sink [H] -> o [T, H, D] in q's dtype."""
    t, h, d = q.shape
    out = empty(q.shape, q.dtype, q.device)
    if t == 0:
        return out
    k = indices.shape[1]
    kv_pool = kv_pool.to(q.dtype).contiguous()
    hb = max(16, min(next_pow2(h), 16 if not INTERPRETED else 64))
    dp = max(16, next_pow2(d))
    bk = max(16, min(next_pow2(k), 32 if not INTERPRETED else 512))
    pv_fp32 = INTERPRETED or q.dtype == torch.float32
    _sparse_attention_kernel[(t, triton.cdiv(h, hb))](
        q.contiguous(), kv_pool, indices.contiguous(), sink.float().contiguous(), out, h, d, k, float(softmax_scale),
        HB=hb, DP=dp, BK=bk, PV_FP32=pv_fp32)
    return out
