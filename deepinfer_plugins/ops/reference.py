"""Plain-PyTorch references for the V4.1 ops other than quantisation (see quant.py).

These are both the specification that kernels are tested against and the CPU path of the model. Shapes use
T = query tokens, H = heads, D = head dim, P = KV pool rows, K = selected keys per query, N = compressed entries,
S = residual streams (hc_mult), E = routed experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import registry


@registry.reference("rope")
def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*len(inv_freq) channels of x [T, ..., C] as interleaved complex pairs.

    Pair (2k, 2k+1) is x_2k + i*x_2k+1, multiplied by exp(i*pos*f_k) (by its conjugate when ``inverse``, which
    undoes the rotation of attention outputs so that caches can stay rotated). Angles and products in fp32.
    """
    rd = 2 * inv_freq.numel()
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
    if inverse:
        angles = -angles
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
    cos, sin = angles.cos().reshape(shape), angles.sin().reshape(shape)
    rot = x[..., -rd:].float().unflatten(-1, (-1, 2))  # [T, ..., rd/2, 2]
    re, im = rot[..., 0], rot[..., 1]
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


@registry.reference("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in fp32 (V4.1 uses eps = 1e-20, so fp32 is required)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


@registry.reference("sinkhorn")
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, S_in, S_out] -> a (near) doubly stochastic mixing matrix, fp32.

    Softmax over the output streams, then column (input-sum) normalisation, then ``iters - 1`` rounds of row
    then column normalisation; ``eps`` is added to every denominator as in the reference.
    """
    m = logits.float().softmax(dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


@registry.reference("hc_coefficients")
def hc_coefficients(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    iters: int, hc_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC site coefficients from the residual streams [T, S, d].

    Returns pre [T, S] (collapse weights), post [T, S] (expand weights of the sublayer output) and
    comb [T, S_in, S_out] (Sinkhorn-normalised stream mixing), all fp32. The projection is taken before the
    RMS factor is applied, matching the reference's operation order.
    """
    n_streams = streams.shape[1]
    flat = streams.flatten(1).float()  # [T, S*d]
    mix = (flat @ fn.float().t()) * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + norm_eps)  # [T, (2+S)*S]
    scale = scale.float()
    gains = torch.cat((scale[0].expand(n_streams), scale[1].expand(n_streams), scale[2].expand(n_streams * n_streams)))
    logit = base.float() + mix * gains
    pre = torch.sigmoid(logit[:, :n_streams]) + hc_eps
    post = 2.0 * torch.sigmoid(logit[:, n_streams:2 * n_streams])
    comb = sinkhorn(logit[:, 2 * n_streams:].unflatten(-1, (n_streams, n_streams)), iters, hc_eps)
    return pre, post, comb


@registry.reference("hc_collapse")
def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_s pre[t, s] * streams[t, s] -> [T, d] in the streams' dtype."""
    return torch.einsum("ts,tsd->td", pre, streams.float()).to(streams.dtype)


@registry.reference("hc_expand")
def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[o] = post[o] * out + sum_i comb[i, o] * X[i]  -> [T, S, d] in the streams' dtype."""
    mixed = torch.einsum("tio,tid->tod", comb, streams.float())
    return (post[:, :, None] * out.float()[:, None, :] + mixed).to(streams.dtype)


@registry.reference("sparse_attention")
def sparse_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, softmax_scale: float,
) -> torch.Tensor:
    """Single-latent MQA over selected keys, K = V, with a per-head sink logit.

    q [T, H, D]; kv_pool [P, D]; indices [T, K] rows of the pool, -1 = unused slot; sink [H] fp32.
    Returns o [T, H, D] (fp32 softmax, result in q's dtype). The sink joins the softmax with a zero value
    vector, so a query with no valid key returns zeros. Serves single-token decode and multi-token
    verification alike: each query row carries its own key set.

    Rows run in tiles whose gathered keys fit in about ``KEY_TILE_BYTES``: a prefill chunk's [T, K, D] keys
    (200 MB for 2048 rows at K = 192, D = 128) would otherwise be written to memory and read back twice. Every
    row is computed on its own, so the tiling does not change a bit of the result.
    """
    rows_per_tile = max(1, KEY_TILE_BYTES // max(1, indices.shape[-1] * kv_pool.shape[-1] * 4))
    if q.shape[0] > rows_per_tile:
        return torch.cat([sparse_attention_rows(q[start: start + rows_per_tile], kv_pool,
                                                indices[start: start + rows_per_tile], sink, softmax_scale)
                          for start in range(0, q.shape[0], rows_per_tile)])
    return sparse_attention_rows(q, kv_pool, indices, sink, softmax_scale)


KEY_TILE_BYTES = 2 << 20


def sparse_attention_rows(q: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                          softmax_scale: float) -> torch.Tensor:
    return attend_gathered(q, kv_pool[indices.clamp(min=0)], indices >= 0, sink, softmax_scale)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
    """``sparse_attention`` over each row's keys already gathered: keys [T, K, D], valid [T, K] (False = unused
    slot), so a caller that decodes them per row does not copy them again through a pool."""
    keys = keys.float()
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * softmax_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(logits.shape[0], -1, 1)
    probs = torch.cat((logits, sink_logit), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


@registry.reference("indexer_scores")
def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores: score[t, n] = sum_h relu(q[t, h] . keys[n]) * head_weights[t, h].

    q [T, h, d] and keys [N, d] are already MXFP4-quantised; head_weights [T, h]. Returns fp32 [T, N].
    """
    dots = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu()
    return torch.einsum("thn,th->tn", dots, head_weights.float())


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties broken towards the lower index, so the selection never depends on
    how many (masked) columns follow. -> (values [.., k'], ids [.., k']) with k' = min(k, columns)."""
    values, ids = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


@registry.reference("topk_indices")
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids per row of scores [T, N] sorted ascending; slots whose score is -inf become -1. -> [T, k].

    Ties go to the lower entry id: the set is the first k of a stable descending sort. It is found with two
    top-k passes instead of sorting whole rows (at long context a row holds thousands of entries): the entries
    above the row's k-th largest score are all in the plain top-k, and the places left go to the entries equal to
    that score, lowest id first. A NaN score takes no place (its places stay -1)."""
    t, n = scores.shape
    kept_per_row = min(k, n)
    if kept_per_row:
        values, top_ids = scores.topk(kept_per_row, dim=-1)
        threshold = values[:, -1:]
        above = values > threshold
        entry = torch.arange(n, dtype=torch.float32, device=scores.device)
        tie_key = torch.where(scores == threshold, -entry, float("-inf"))  # larger for a lower id
        tie_values, tie_ids = tie_key.topk(kept_per_row, dim=-1)
        places_left = kept_per_row - above.sum(dim=-1, keepdim=True)
        tie_in = (torch.arange(kept_per_row, device=scores.device) < places_left) & (tie_values > float("-inf"))
        chosen = torch.cat((torch.where(above, top_ids, n), torch.where(tie_in, tie_ids, n)), dim=-1)
        finite = torch.isfinite(scores.gather(1, chosen.clamp(max=n - 1)))
        ids = torch.where(finite & (chosen < n), chosen, n).sort(dim=-1).values[:, :kept_per_row]
        ids = torch.where(ids == n, torch.full_like(ids, -1), ids)
    else:
        ids = torch.empty(t, 0, dtype=torch.int64, device=scores.device)
    if ids.shape[-1] < k:
        ids = torch.cat((ids, ids.new_full((ids.shape[0], k - ids.shape[-1]), -1)), dim=-1)
    return ids


@registry.reference("candidate_mask")
def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int) -> torch.Tensor:
    """Two-level pre-filter published by the candidate-source layer.

    scores [T, N] (-inf where invisible), visible [T] = number of visible entries per query. Each block of
    ``block_size`` entries scores the max of its entries; the block holding the newest visible entry is always
    kept; the ``top_blocks`` best blocks with a finite score survive. Returns a bool mask [T, N].
    """
    t, n = scores.shape
    n_blocks = -(-n // block_size)
    padded = F.pad(scores, (0, n_blocks * block_size - n), value=float("-inf"))
    block_scores = padded.view(t, n_blocks, block_size).amax(dim=-1)  # [T, n_blocks]
    newest = ((visible - 1).clamp(min=0) // block_size).long()
    has_visible = visible > 0
    forced = torch.full_like(block_scores, float("inf"))
    block_scores = torch.where(
        has_visible[:, None] & (torch.arange(n_blocks, device=scores.device)[None, :] == newest[:, None]),
        forced, block_scores,
    )
    values, ids = stable_topk(block_scores, top_blocks)
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(1, ids, ~torch.isneginf(values))
    return keep.repeat_interleave(block_size, dim=1)[:, :n]


@registry.reference("sqrtsoftplus_route")
def sqrtsoftplus_route(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing with sqrt(softplus) scores.

    logits [T, E] fp32 router logits; correction_bias [T, E] or [E] affects selection only.
    Returns (weights [T, k] fp32, expert ids [T, k]): selected scores renormalised and scaled.
    """
    scores = F.softplus(logits.float()).sqrt()
    ids = (scores + correction_bias.float()).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scale, ids


@registry.reference("engram_hash")
def engram_hash(
    ngram_tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """Engram table row ids for each position.

    ngram_tokens [T, G] int64: compressed ids of the tokens at t, t-1, ..., t-G+1 (already replaced by the pad
    id from the first unavailable slot on); multipliers [G]; primes and offsets [G-1, heads] (order 2..G).
    r = tok_0*m_0, then r ^= tok_n*m_n for n = 1..G-1 with int64 wrap-around; order n+1 head h reads row
    offsets[n-1, h] + (r mod primes[n-1, h]). Returns [T, (G-1)*heads] int64, columns order-major.
    """
    r = ngram_tokens[:, 0] * multipliers[0]
    columns = []
    for n in range(1, ngram_tokens.shape[1]):
        r = r ^ (ngram_tokens[:, n] * multipliers[n])
        columns.append(offsets[n - 1][None, :] + torch.remainder(r[:, None], primes[n - 1][None, :]))
    return torch.cat(columns, dim=1)


@registry.reference("swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(clamp(gate, max=L)) * clamp(up, -L, L) in fp32 (no clamp when limit is None), input dtype out."""
    g, u = gate.float(), up.float()
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return (F.silu(g) * u).to(gate.dtype)


@registry.reference("dense_linear")
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + b for a float W [out, in] (stored bf16, the vision tower's) in x's dtype -> [..., out].
    The vision tower's GEMMs: its weights are not quantised, so they need none of the block-scaled ops."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


@registry.reference("bidirectional_attention")
def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (unmasked) attention of every row over every row, the ViT's over one image's patches.

    q, k, v [P, H, D] -> [P, H, D] in q's dtype, softmax scale 1/sqrt(D), in fp32. Through SDPA so that the
    [H, P, P] scores of a large image (P ~ 9000 patches) are never held at once."""
    heads_first = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, P, D]
    return F.scaled_dot_product_attention(*heads_first).transpose(0, 1).to(q.dtype)
