"""Small memory-bound ops: RMSNorm, RoPE, SwiGLU, the sqrt-softplus router, Engram hash and gate, CSA2 pooling."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, cut_launch_jit, empty, next_pow2, run_kernel


@cut_launch_jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, first_program, HAS_W: tl.constexpr, BN: tl.constexpr):
    r = (tl.program_id(0) + first_program).to(tl.int64)
    sq = tl.zeros([BN], tl.float32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        x = tl.load(x_ptr + r * N + n, mask=n < N, other=0.0).to(tl.float32)
        sq += x * x
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        y = tl.load(x_ptr + r * N + n, mask=n < N, other=0.0).to(tl.float32) * inv
        if HAS_W:
            y = y * tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * N + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    out = empty(x.shape, x.dtype, x.device)
    rows = x.numel() // max(n, 1)
    if rows:
        run_kernel(_rms_norm_kernel, (rows,), x.contiguous(), weight if weight is not None else x, out, n, float(eps),
                   HAS_W=weight is not None, BN=min(next_pow2(n), 8192 if INTERPRETED else 2048))
    return out


@cut_launch_jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, C, HALF, first_program, BC: tl.constexpr, BH: tl.constexpr):
    """Rows r of x [T*M, C] (token r // M): copy the first C - 2*HALF channels, rotate the interleaved pairs.
    The pairs are read and written as one dense [BH, 2] tile (not as two stride-2 vectors, whose masked
    accesses triton-ascend's adapter cannot lower)."""
    c = tl.arange(0, BC)
    nope = C - 2 * HALF
    k = tl.arange(0, BH)
    km = k < HALF
    pair = nope + 2 * k[:, None] + tl.arange(0, 2)[None, :]  # [BH, 2]
    r = (tl.program_id(0) + first_program).to(tl.int64)
    t = r // M
    x = tl.load(x_ptr + r * C + c, mask=c < nope, other=0.0)
    tl.store(out_ptr + r * C + c, x, mask=c < nope)
    re, im = tl.split(tl.load(x_ptr + r * C + pair, mask=km[:, None], other=0.0).to(tl.float32))
    cs = tl.load(cos_ptr + t * HALF + k, mask=km, other=0.0)
    sn = tl.load(sin_ptr + t * HALF + k, mask=km, other=0.0)
    a = re * cs
    b = im * sn
    e = re * sn
    f = im * cs
    tl.store(out_ptr + r * C + pair, tl.join(a - b, e + f).to(out_ptr.dtype.element_ty), mask=km[:, None])


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE on the last 2*len(inv_freq) channels. The [T, rd/2] angle table is computed with
    torch exactly as the reference does (tiny), so the kernel's products see the reference's cos and sin."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
    if inverse:
        angles = -angles
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    half = inv_freq.numel()
    c = x.shape[-1]
    out = empty(x.shape, x.dtype, x.device)
    rows = x.numel() // max(c, 1)
    if rows:
        run_kernel(_rope_kernel, (rows,), x.contiguous(), cos, sin, out, rows // x.shape[0], c, half, BC=next_pow2(c),
                   BH=next_pow2(half))
    return out


@triton.jit
def swiglu_values(g, u, limit, HAS_LIMIT: tl.constexpr):
    """silu(min(g, limit)) * clamp(u, -limit, limit) for fp32 g, u (no clamp without HAS_LIMIT)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@cut_launch_jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, limit, first_program, HAS_LIMIT: tl.constexpr, BN: tl.constexpr):
    n = (tl.program_id(0) + first_program).to(tl.int64) * BN + tl.arange(0, BN)
    g = tl.load(g_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, swiglu_values(g, u, limit, HAS_LIMIT).to(out_ptr.dtype.element_ty), mask=n < N)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit) -> torch.Tensor:
    out = empty(gate.shape, gate.dtype, gate.device)
    n = gate.numel()
    if n:
        bn = min(next_pow2(n), 65536 if INTERPRETED else 1024)
        run_kernel(_swiglu_kernel, (triton.cdiv(n, bn),), gate.contiguous(), up.contiguous(), out, n,
                   float(limit) if limit is not None else 0.0, HAS_LIMIT=limit is not None, BN=bn)
    return out


@cut_launch_jit
def _route_kernel(x_ptr, bias_ptr, w_ptr, id_ptr, E, bias_stride, routed_scale, first_program, K: tl.constexpr,
                  KP: tl.constexpr, EP: tl.constexpr):
    t = (tl.program_id(0) + first_program).to(tl.int64)
    e = tl.arange(0, EP)
    x = tl.load(x_ptr + t * E + e, mask=e < E, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    score = tl.sqrt(softplus)
    sel = score + tl.load(bias_ptr + t * bias_stride + e, mask=e < E, other=0.0).to(tl.float32)
    sel = tl.where(e < E, sel, float("-inf"))
    total = tl.zeros([], tl.float32)
    for j in range(K):  # K argmax rounds: descending order like torch.topk, ties to the lower id
        best = tl.argmax(sel, axis=0)
        w = tl.sum(tl.where(e == best, score, 0.0), axis=0)
        tl.store(id_ptr + t * K + j, best.to(tl.int64))
        tl.store(w_ptr + t * K + j, w)
        total += w
        sel = tl.where(e == best, float("-inf"), sel)
    kk = tl.arange(0, KP)
    w = tl.load(w_ptr + t * K + kk, mask=kk < K, other=0.0)
    tl.store(w_ptr + t * K + kk, w / (total + 1e-20) * routed_scale, mask=kk < K)


def sqrtsoftplus_route(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, routed_scale: float):
    t, e = logits.shape
    weights = empty((t, top_k), torch.float32, logits.device)
    ids = empty((t, top_k), torch.int64, logits.device)
    if t:
        bias = correction_bias.float().contiguous()
        run_kernel(_route_kernel, (t,), logits.float().contiguous(), bias, weights, ids, e, e if bias.dim() == 2 else 0,
                   float(routed_scale), K=top_k, KP=next_pow2(top_k), EP=next_pow2(e))
    return weights, ids


@cut_launch_jit
def _engram_hash_kernel(tok_ptr, mul_ptr, prime_ptr, off_ptr, out_ptr, T, G, HEADS,
                        first_program, BT: tl.constexpr, HP: tl.constexpr):
    t = (tl.program_id(0) + first_program) * BT + tl.arange(0, BT)
    h = tl.arange(0, HP)
    tm = t < T
    r = tl.load(tok_ptr + t.to(tl.int64) * G, mask=tm, other=0) * tl.load(mul_ptr)
    cols = (G - 1) * HEADS
    for n in range(1, G):
        r = r ^ (tl.load(tok_ptr + t.to(tl.int64) * G + n, mask=tm, other=0) * tl.load(mul_ptr + n))
        p = tl.load(prime_ptr + (n - 1) * HEADS + h, mask=h < HEADS, other=1)
        off = tl.load(off_ptr + (n - 1) * HEADS + h, mask=h < HEADS, other=0)
        rem = r[:, None] % p[None, :]
        rem = tl.where(rem < 0, rem + p[None, :], rem)  # floor-mod whatever the backend's % convention
        tl.store(out_ptr + t[:, None].to(tl.int64) * cols + (n - 1) * HEADS + h[None, :], off[None, :] + rem,
                 mask=tm[:, None] & (h[None, :] < HEADS))


def engram_hash(ngram_tokens, multipliers, primes, offsets) -> torch.Tensor:
    t, g = ngram_tokens.shape
    heads = primes.shape[1]
    out = empty((t, (g - 1) * heads), torch.int64, ngram_tokens.device)
    if t:
        bt = min(next_pow2(t), 1024 if INTERPRETED else 128)
        run_kernel(_engram_hash_kernel, (triton.cdiv(t, bt),), ngram_tokens.long().contiguous(),
                   multipliers.long().contiguous(), primes.long().contiguous(), offsets.long().contiguous(), out, t, g,
                   heads, BT=bt, HP=next_pow2(heads))
    return out


@cut_launch_jit
def _engram_gate_kernel(x_ptr, k_ptr, v_ptr, w_ptr, out_ptr, S, D, k_token_stride, v_token_stride, eps, inv_sqrt_d,
                        first_program, BD: tl.constexpr):
    """Stream s of token t, as program t * S + s: a stream's gate needs only its own row, so the streams of a
    decode token run on S multiprocessors instead of one. A pass over d sums the fp32 dot and both squares, a
    second writes h + gate * value. ``key`` and ``value`` rows may be strided slices of one wkv output row."""
    row = (tl.program_id(0) + first_program).to(tl.int64)
    t = row // S
    s = row % S
    x_row = x_ptr + row * D
    k_row = k_ptr + t * k_token_stride + s * D
    w_row = w_ptr + s * D
    dot = tl.zeros([BD], tl.float32)
    h_sq = tl.zeros([BD], tl.float32)
    k_sq = tl.zeros([BD], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        mask = d < D
        h = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
        key = tl.load(k_row + d, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_row + d, mask=mask, other=0.0).to(tl.float32)
        dot += h * w * key
        h_sq += h * h
        k_sq += key * key
    total = tl.sum(dot, axis=0) * (1.0 / tl.sqrt(tl.sum(h_sq, axis=0) / D + eps))
    total = total * (1.0 / tl.sqrt(tl.sum(k_sq, axis=0) / D + eps)) * inv_sqrt_d
    mag = tl.sqrt(tl.maximum(tl.abs(total), 1e-6))
    signed = tl.where(total > 0, mag, tl.where(total < 0, -mag, 0.0))
    gate = 1.0 / (1.0 + tl.exp(-signed))
    v_row = v_ptr + t * v_token_stride
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        mask = d < D
        h = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
        value = tl.load(v_row + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + d, (h + gate * value).to(out_ptr.dtype.element_ty), mask=mask)


def engram_gate(streams, key, value, w, eps: float) -> torch.Tensor:
    t, s, d = streams.shape
    out = empty(streams.shape, streams.dtype, streams.device)
    if key.stride(-1) != 1 or key.stride(1) != d:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if t:
        run_kernel(_engram_gate_kernel, (t * s,), streams.contiguous(), key, value, w.contiguous(), out, s, d,
                   key.stride(0), value.stride(0), float(eps), 1.0 / math.sqrt(d),
                   BD=min(next_pow2(d), 8192 if INTERPRETED else 1024))
    return out


@cut_launch_jit
def _csa2_kernel(v_ptr, g_ptr, w_ptr, out_ptr, R, C, eps, first_program, HAS_W: tl.constexpr, RP: tl.constexpr,
                 CP: tl.constexpr):
    grp = (tl.program_id(0) + first_program).to(tl.int64)
    r = tl.arange(0, RP)[:, None]
    c = tl.arange(0, CP)[None, :]
    mask = (r < R) & (c < C)
    v = tl.load(v_ptr + (grp * R + r) * C + c, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (grp * R + r) * C + c, mask=mask, other=float("-inf")).to(tl.float32)
    g = tl.where(c < C, g, 0.0)  # padded channels: finite, masked below
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    e = tl.where(mask, e, 0.0)
    denom = tl.where(c < C, tl.sum(e, axis=0)[None, :], 1.0)
    pooled = tl.sum(e / denom * v, axis=0)  # [CP]
    pooled = pooled.to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference casts before the norm
    cc = tl.arange(0, CP)
    y = pooled * (1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / C + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cc, mask=cc < C, other=0.0).to(tl.float32)
    tl.store(out_ptr + grp * C + cc, y.to(out_ptr.dtype.element_ty), mask=cc < C)


def csa2_compress(values, gates, ratio: int, norm_weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    n, c = values.shape
    groups = n // ratio
    out = empty((groups, c), dtype, values.device)
    if groups:
        run_kernel(_csa2_kernel, (groups,), values.float().contiguous(), gates.float().contiguous(),
                   norm_weight if norm_weight is not None else values, out, ratio, c, float(eps),
                   HAS_W=norm_weight is not None, RP=max(2, next_pow2(ratio)), CP=next_pow2(c))
    return out
