"""Lossless verification of a drafted block: speculative sampling with variable lengths.

Dynamic-length scheduling only changes *how many* drafts each request verifies; this rule is
the unchanged standard one, so the output distribution is exactly the target's as long as the
lengths were chosen without looking at the drafts being verified (docs/dspark.md#scheduling).
"""

from __future__ import annotations

import torch

from .proposal import VerifyResult

_RESIDUAL_EPS = 1e-6  # below this residual mass a rejection is float noise: sample from p


def _check(draft_tokens, num_verify, target_probs, draft_probs, accept_u, sample_u):
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError("draft_tokens must be an int tensor [rows, k]")
    if draft_tokens.is_floating_point() or num_verify.is_floating_point():
        raise TypeError("draft_tokens and num_verify must be integer tensors")
    rows, k = draft_tokens.shape
    if not target_probs.is_floating_point() or target_probs.dim() != 3 or target_probs.shape[:2] != (rows, k + 1):
        raise ValueError(f"target_probs must be float [rows={rows}, k+1={k + 1}, vocab] (row j is the "
                         f"target distribution after x_j, j = 0..k), got {list(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if num_verify.shape != (rows,):
        raise ValueError(f"num_verify must have shape [{rows}], got {list(num_verify.shape)}")
    if rows and (num_verify.min() < 0 or num_verify.max() > k):
        raise ValueError(f"num_verify must lie in [0, {k}]")
    if draft_probs is not None and (not draft_probs.is_floating_point() or draft_probs.shape != (rows, k, vocab)):
        raise ValueError(f"draft_probs must be float [{rows}, {k}, {vocab}] or None (greedy drafts), "
                         f"got {list(draft_probs.shape)}")
    verified = torch.arange(k, device=draft_tokens.device)[None, :] < num_verify[:, None]
    if verified.any() and (draft_tokens[verified].min() < 0 or draft_tokens[verified].max() >= vocab):
        raise ValueError(f"verified draft tokens must be ids in [0, {vocab})")
    if torch.isnan(target_probs).any() or (target_probs < 0).any():
        raise ValueError("target_probs must be non-negative probabilities (no NaN)")
    if accept_u is not None and accept_u.shape != (rows, k):
        raise ValueError(f"accept_u must have shape [{rows}, {k}], got {list(accept_u.shape)}")
    if sample_u is not None and sample_u.shape != (rows,):
        raise ValueError(f"sample_u must have shape [{rows}], got {list(sample_u.shape)}")
    return rows, k, verified


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [rows, vocab] (need not be normalised) from u [rows] in [0, 1).

    Inverse-CDF sampling lets callers pass their own uniforms (common random numbers in the
    simulator, fixed draws in tests); zero-probability tokens are never returned.
    """
    cdf = probs.cumsum(dim=-1)  # [rows, V]
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]  # [rows, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


# Speculative sampling, one round per row (Leviathan et al. 2023; docs/dspark.md#verification).
#   Drafts x_k ~ q_k for k = 1..ℓ (ℓ = num_verify[r], 0 allowed); p_k = processed target
#   distribution at row k-1 of the verify forward; u_k ~ U[0, 1).
#   accept x_k  iff  u_k · q_k(x_k) < p_k(x_k)        i.e. with probability min(1, p_k(x_k) / q_k(x_k))
#   m = number of leading accepts (the scan stops at the first rejection)
#   m < ℓ (rejected at m+1):  y ~ norm(max(0, p_{m+1} - q_{m+1}))    correction
#                             (if that mass is ~0 the rejection was float noise: y ~ p_{m+1})
#   m = ℓ (all accepted):     y ~ p_{ℓ+1}                             bonus
# Per position, P(y = v) = min(p, q)(v) + (1 - Σ min(p, q)) · max(0, p - q)(v) / Σ max(0, p - q)
#   = p(v), so each committed token has the target's law; ℓ chosen without looking at x_{≥k}
#   keeps that true position by position.
# Greedy drafts: q_k = onehot(x_k), so accept w.p. p_k(x_k) and the residual is p_k without x_k.
# Greedy target (temperature 0): p = onehot(argmax) (see sampling.processed_probs), so the rule
#   becomes "accept iff x_k = argmax p_k, then emit argmax": the exact-match rule.
# EOS: if an accepted x_j is EOS, commit x_1..x_j and nothing after it.
# Commit x_1..x_m, y (m + 1 tokens); keep KV rows anchor..x_m (m + 1 = kv_keep), drop the rest.
def verify(draft_tokens: torch.Tensor, num_verify: torch.Tensor, target_probs: torch.Tensor,
           draft_probs: torch.Tensor | None = None, *, eos_token_id: int | None = None,
           accept_u: torch.Tensor | None = None, sample_u: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> VerifyResult:
    """Verify ℓ_r drafts per row; see the comment above for the rule.

    draft_tokens int [rows, k]; num_verify int [rows] (ℓ_r ≤ k); target_probs [rows, k+1, vocab];
    draft_probs [rows, k, vocab] or None for greedy drafts; accept_u [rows, k] and sample_u [rows]
    are the uniforms (drawn from ``generator`` when omitted).
    """
    rows, k, verified = _check(draft_tokens, num_verify, target_probs, draft_probs, accept_u, sample_u)
    dev, dt = target_probs.device, target_probs.dtype
    if accept_u is None:
        accept_u = torch.rand(rows, k, generator=generator, device=dev, dtype=dt)
    if sample_u is None:
        sample_u = torch.rand(rows, generator=generator, device=dev, dtype=dt)
    x = torch.where(verified, draft_tokens, 0).long()  # [rows, k]
    ar = torch.arange(rows, device=dev)

    p_x = target_probs[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [rows, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, x[..., None]).squeeze(-1)
    accepted = (accept_u.to(dt) * q_x < p_x) & verified  # [rows, k]
    m = accepted.long().cumprod(dim=-1).sum(dim=-1)  # leading accepts [rows]

    eos_truncated = torch.zeros(rows, dtype=torch.bool, device=dev)
    if eos_token_id is not None:
        pos = torch.arange(k, device=dev)[None, :]
        eos_hit = (x == eos_token_id) & (pos < m[:, None])  # [rows, k]
        eos_truncated = eos_hit.any(dim=-1)
        m = torch.where(eos_truncated, eos_hit.long().argmax(dim=-1) + 1, m)

    rejected = (m < num_verify) & ~eos_truncated
    p_next = target_probs[ar, m]  # [rows, V]: p_{m+1}
    j = m.clamp(max=max(k - 1, 0))  # the rejected position (only read where rejected)
    if k == 0:
        residual = p_next
    elif draft_probs is None:
        residual = p_next.scatter(-1, x[ar, j][:, None], 0.0)
    else:
        residual = (p_next - draft_probs[ar, j]).clamp(min=0)
    use_residual = rejected & (residual.sum(dim=-1) > _RESIDUAL_EPS)
    y = sample_inverse_cdf(torch.where(use_residual[:, None], residual, p_next), sample_u)

    committed = torch.full((rows, k + 1), -1, dtype=torch.long, device=dev)
    committed[:, :k] = torch.where(torch.arange(k, device=dev)[None, :] < m[:, None], x, -1)
    committed[ar, m] = torch.where(eos_truncated, -1, y)
    return VerifyResult(
        num_accepted=m,
        committed=committed,
        num_committed=m + (~eos_truncated).long(),
        is_bonus=(m == num_verify) & ~eos_truncated,
        eos_truncated=eos_truncated,
        kv_keep=m + 1,
    )
