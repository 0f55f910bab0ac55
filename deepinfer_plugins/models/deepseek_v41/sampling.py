"""The one definition of the sampled next-token distribution: temperature, top-k and top-p.

Plain decoding (``generate``), the speculative loop, the drafter's q and the engine adapters' verify calls all
take it from here. Speculative sampling is lossless with respect to whatever distribution ``verify`` is given, so
"speculative output has the target's distribution" only means something if every caller processes logits the
same way, boundary ties included.
"""

from __future__ import annotations

import torch


def _per_row(value, rows: int, name: str, dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(rows)
    if t.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or have shape [{rows}], got {list(t.shape)}")
    return t


def processed_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Top-k keeps exactly k tokens and top-p the shortest prefix whose mass reaches p, ties going to the lower
    token id (a stable sort), so the kept set is a function of the logits alone and matches vLLM's Triton
    top-k/top-p kernel, which its rejection sampler uses.

    logits: [rows, vocab] or [rows, positions, vocab]; temperature / top_k / top_p: scalars or [rows] (one setting
    per request, applied at all its positions). temperature 0 -> one-hot on the argmax (the first maximal id, the
    same tie rule); top_k 0 -> off; top_p 1 -> off. Top-p is applied to what top-k left, renormalised, and always
    keeps the first token; the token whose mass crosses p is kept.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [rows, vocab] or [rows, positions, vocab], got {list(logits.shape)}")
    squeeze = logits.dim() == 2
    x = logits.unsqueeze(1) if squeeze else logits  # [rows, P, V]
    rows, _, vocab = x.shape
    temp = _per_row(temperature, rows, "temperature", torch.float32, x.device)
    k = _per_row(top_k, rows, "top_k", torch.int64, x.device)
    p = _per_row(top_p, rows, "top_p", torch.float32, x.device)
    if (temp < 0).any() or torch.isnan(temp).any():
        raise ValueError("temperature must be >= 0")
    if (k < 0).any():
        raise ValueError("top_k must be >= 0 (0 disables it)")
    if (p <= 0).any() or (p > 1).any():
        raise ValueError("top_p must lie in (0, 1]")

    greedy = temp == 0
    scaled = x.float() / torch.where(greedy, 1.0, temp)[:, None, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [rows, P, V]
    rank = torch.arange(vocab, device=x.device)
    k_eff = torch.where(k == 0, vocab, k.clamp(max=vocab))
    drop = (rank[None, None, :] >= k_eff[:, None, None]).expand_as(sorted_logits)
    probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    cumulative = probs_sorted.cumsum(dim=-1)
    mass_before = torch.cat((torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]), dim=-1)
    drop = drop | (mass_before >= p[:, None, None])
    keep = torch.zeros_like(drop).scatter(-1, order, ~drop)
    out = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    onehot = torch.zeros_like(out).scatter(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    out = torch.where(greedy[:, None, None], onehot, out)
    return out.squeeze(1) if squeeze else out


def sample(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, generator: torch.Generator | None = None) -> int:
    """One token id from logits [vocab]; greedy skips the generator so greedy runs never consume random numbers."""
    if temperature == 0:
        return int(logits.argmax())
    probs = processed_probs(logits[None], temperature, top_k, top_p)[0]
    return int(torch.multinomial(probs, 1, generator=generator))
