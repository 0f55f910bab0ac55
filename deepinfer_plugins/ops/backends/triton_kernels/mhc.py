"""mHC: site coefficients (projection + RMS + sigmoid gains), Sinkhorn 4x4, stream collapse (alone or with the
sublayer's RMSNorm) and expand."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, cut_launch_jit, empty, next_pow2, run_kernel, split_count


@triton.jit
def _sinkhorn_tile(x, valid, iters, eps):
    """x [SP, SP] logits (rows: input streams, columns: output streams; entries outside ``valid`` ignored) -> the
    mixing matrix, 0 outside ``valid``: softmax over outputs + eps, then column / row normalisations."""
    x = tl.where(valid, x, -1.0e30)  # finite: a padding row stays NaN-free; exp() of a padding column is 0
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    m = tl.where(valid, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)  # softmax over outputs, + eps
    m = m / (tl.sum(m, axis=0)[None, :] + eps)  # input-sum normalisation
    for _ in range(1, iters):
        m = m / (tl.sum(m, axis=1)[:, None] + eps)
        m = m / (tl.sum(m, axis=0)[None, :] + eps)
    return m


@cut_launch_jit
def _sinkhorn_kernel(x_ptr, out_ptr, S, iters, eps, first_program, SP: tl.constexpr):
    t = (tl.program_id(0) + first_program).to(tl.int64)
    i = tl.arange(0, SP)[:, None]
    o = tl.arange(0, SP)[None, :]
    valid = (i < S) & (o < S)
    x = tl.load(x_ptr + t * S * S + i * S + o, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * S * S + i * S + o, _sinkhorn_tile(x, valid, iters, eps), mask=valid)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, S, S] -> fp32 [T, S, S]."""
    t, s, _ = logits.shape
    out = empty(logits.shape, torch.float32, logits.device)
    if t:
        run_kernel(_sinkhorn_kernel, (t,), logits.float().contiguous(), out, s, iters, float(eps),
                   SP=max(2, next_pow2(s)))
    return out


@cut_launch_jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, K, M, k_per_split, first_program, MP: tl.constexpr,
                           BK: tl.constexpr):
    """One token, one slice of the S*d inputs: partial x . fn[m] for every mixing logit m and partial sum(x^2).
    Products accumulate elementwise and are reduced once at the end (a cross-thread reduction per step costs
    more than the loads); slices let a decode batch of a few tokens fill the GPU."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    m = tl.arange(0, MP)
    acc = tl.zeros([MP, BK], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + t * K + k, mask=k < k_end, other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < k_end), other=0.0)
        acc += f.to(tl.float32) * x[None, :]
        sq += x * x
    tl.store(part_ptr + (t * splits + split) * MP + m, tl.sum(acc, axis=1))
    tl.store(sq_ptr + t * splits + split, tl.sum(sq, axis=0))


@cut_launch_jit
def _hc_mix_finish_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, S, K, iters, hc_eps,
                          norm_eps, first_program, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, MP: tl.constexpr,
                          SP: tl.constexpr):
    """mix[m] = (x . fn[m]) * rsqrt(mean(x^2) + eps) from the slices; logits -> pre, post, and the comb logits,
    taken as an [S, S] tile and Sinkhorn-normalised in registers (no separate Sinkhorn launch)."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    m = tl.arange(0, MP)
    split = tl.arange(0, SPLITS_P)
    parts = tl.load(part_ptr + (t * SPLITS + split[:, None]) * MP + m[None, :], mask=split[:, None] < SPLITS,
                    other=0.0)
    sq = tl.sum(tl.load(sq_ptr + t * SPLITS + split, mask=split < SPLITS, other=0.0), axis=0)
    inv_rms = 1.0 / tl.sqrt(sq / K + norm_eps)
    mix = tl.sum(parts, axis=0) * inv_rms
    g0 = tl.load(scale_ptr)
    g1 = tl.load(scale_ptr + 1)
    g2 = tl.load(scale_ptr + 2)
    gain = tl.where(m < S, g0, g1)
    sig = 1.0 / (1.0 + tl.exp(-(tl.load(base_ptr + m, mask=m < 2 * S, other=0.0) + mix * gain)))
    tl.store(pre_ptr + t * S + m, sig + hc_eps, mask=m < S)
    tl.store(post_ptr + t * S + (m - S), 2.0 * sig, mask=(m >= S) & (m < 2 * S))
    i = tl.arange(0, SP)[:, None]
    o = tl.arange(0, SP)[None, :]
    valid = (i < S) & (o < S)
    logit_at = 2 * S + i * S + o  # [SP, SP]: row of fn / base of comb logit (i, o)
    # mix[logit_at] as a select over the [MP] vector in registers: a second load of the partials as an
    # [SPLITS, SP, SP] tile crashes triton-ascend's adapter for some split counts (4, 20)
    comb_mix = tl.sum(tl.where(m[None, None, :] == logit_at[:, :, None], mix[None, None, :], 0.0), axis=2)
    comb_logits = tl.load(base_ptr + logit_at, mask=valid, other=0.0) + comb_mix * g2
    tl.store(comb_ptr + t * S * S + i * S + o, _sinkhorn_tile(comb_logits, valid, iters, hc_eps), mask=valid)


def hc_coefficients(streams, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, splits: int = 0):
    """streams [T, S, d], fn [(2+S)*S, S*d] -> (pre [T, S], post [T, S], comb [T, S, S]) fp32.

    ``splits`` slices of the S*d inputs per token; 0 picks enough to fill the GPU (one under the interpreter)."""
    t, s, d = streams.shape
    k, mm = s * d, (2 + s) * s
    pre = empty((t, s), torch.float32, streams.device)
    post = empty((t, s), torch.float32, streams.device)
    comb = empty((t, s, s), torch.float32, streams.device)
    if t:
        mp = next_pow2(mm)
        if not splits:
            splits = 1 if INTERPRETED else split_count(t, triton.cdiv(k, 128), min_blocks_per_split=8)
        bk = min(next_pow2(triton.cdiv(k, splits)), 4096 if INTERPRETED else 128)
        k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
        splits = triton.cdiv(k, k_per_split)
        partials = torch.empty(t, splits, mp, dtype=torch.float32, device=streams.device)
        squares = torch.empty(t, splits, dtype=torch.float32, device=streams.device)
        run_kernel(_hc_mix_partial_kernel, (t, splits), streams.contiguous(), fn.float().contiguous(), partials,
                   squares, k, mm, k_per_split, MP=mp, BK=bk)
        run_kernel(_hc_mix_finish_kernel, (t,), partials, squares, base.float().contiguous(),
                   scale.float().contiguous(), pre, post, comb, s, k, iters, float(hc_eps), float(norm_eps),
                   SPLITS=splits, SPLITS_P=next_pow2(splits), MP=mp, SP=max(2, next_pow2(s)))
    return pre, post, comb


@cut_launch_jit
def _hc_collapse_kernel(x_ptr, pre_ptr, out_ptr, S, D, first_program, BD: tl.constexpr):
    t = (tl.program_id(0) + first_program).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    acc = tl.zeros([BD], tl.float32)
    for s in range(0, S):
        w = tl.load(pre_ptr + t * S + s).to(tl.float32)
        acc += w * tl.load(x_ptr + (t * S + s) * D + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_s pre[t, s] * streams[t, s] -> [T, d] in the streams' dtype."""
    t, s, d = streams.shape
    out = empty((t, d), streams.dtype, streams.device)
    if t:
        bd = min(next_pow2(d), 8192 if INTERPRETED else 1024)
        run_kernel(_hc_collapse_kernel, (t, triton.cdiv(d, bd)), streams.contiguous(), pre.float().contiguous(), out, s,
                   d, BD=bd)
    return out


@cut_launch_jit
def _hc_collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, S, D, eps, first_program, HAS_W: tl.constexpr,
                             BD: tl.constexpr):
    """One token: its collapsed row stays in registers between the collapse and the norm (no [T, d] round trip
    through memory, one launch instead of two)."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    d = tl.arange(0, BD)
    acc = tl.zeros([BD], tl.float32)
    for s in range(0, S):
        w = tl.load(pre_ptr + t * S + s).to(tl.float32)
        acc += w * tl.load(x_ptr + (t * S + s) * D + d, mask=d < D, other=0.0).to(tl.float32)
    collapsed = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # hc_collapse's rounding
    y = collapsed * (1.0 / tl.sqrt(tl.sum(collapsed * collapsed, axis=0) / D + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


COLLAPSE_NORM_MAX_WIDTH = 16384  # the row lives in registers: a wider one is declined (the reference runs it)


def hc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight, eps: float) -> torch.Tensor:
    t, s, d = streams.shape
    if d > COLLAPSE_NORM_MAX_WIDTH:
        return NotImplemented
    out = empty((t, d), streams.dtype, streams.device)
    if t:
        bd = next_pow2(d)
        launch = {} if INTERPRETED else dict(num_warps=max(4, min(16, bd // 512)))
        run_kernel(_hc_collapse_norm_kernel, (t,), streams.contiguous(), pre.float().contiguous(),
                   weight if weight is not None else streams, out, s, d, float(eps), HAS_W=weight is not None, BD=bd,
                   **launch)
    return out


@cut_launch_jit
def _hc_expand_kernel(x_ptr, f_ptr, post_ptr, comb_ptr, out_ptr, S, D, first_program, SP: tl.constexpr,
                      BD: tl.constexpr):
    t = (tl.program_id(0) + first_program).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, SP)
    x = tl.load(x_ptr + (t * S + s[:, None]) * D + d[None, :], mask=(s[:, None] < S) & (d[None, :] < D),
                other=0.0).to(tl.float32)  # [SP(in), BD]
    comb = tl.load(comb_ptr + t * S * S + s[:, None] * S + s[None, :], mask=(s[:, None] < S) & (s[None, :] < S),
                   other=0.0)  # [SP(in), SP(out)]
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [SP(out), BD]
    post = tl.load(post_ptr + t * S + s, mask=s < S, other=0.0)
    f = tl.load(f_ptr + t * D + d, mask=d < D, other=0.0).to(tl.float32)
    out = post[:, None] * f[None, :] + mixed
    tl.store(out_ptr + (t * S + s[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(s[:, None] < S) & (d[None, :] < D))


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[o] = post[o] * out + sum_i comb[i, o] * X[i] -> [T, S, d] in the streams' dtype."""
    t, s, d = streams.shape
    res = empty(streams.shape, streams.dtype, streams.device)
    if t:
        bd = min(next_pow2(d), 4096 if INTERPRETED else 256)
        run_kernel(_hc_expand_kernel, (t, triton.cdiv(d, bd)), streams.contiguous(), out.contiguous(),
                   post.float().contiguous(), comb.float().contiguous(), res, s, d, SP=max(2, next_pow2(s)), BD=bd)
    return res
