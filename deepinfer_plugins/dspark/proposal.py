"""Engine-independent records passed between drafter, scheduler, verifier and engine.

A vLLM proposer (``custom_class``) or an SGLang spec worker fills a ``DSparkProposal`` after
the drafter runs, asks ``plan_verify_lengths`` for ℓ_r, runs the target
over anchor + ℓ_r rows per request, and hands the processed target probabilities to ``verify``,
which returns a ``VerifyResult``: the tokens to append and how many KV rows to keep. Neither
record knows about an engine's block tables or CUDA graphs; adapters translate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_rows(name: str, t: torch.Tensor, rows: int, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.shape[0] != rows:
        raise ValueError(f"{name} must have {dims} dims with {rows} rows, got shape {list(t.shape)}")


@dataclass(frozen=True)
class DSparkProposal:
    """One drafted block per decoding request.

    anchor_tokens int64 [rows]            last committed token x_0 (its target KV comes from
                                          the verify forward)
    draft_tokens  int64 [rows, γ]         x_1..x_γ; entries at or past num_drafted are ignored
    num_drafted   int64 [rows]            γ_r ≤ γ (0 = this request only decodes)
    confidences   float [rows, γ]         calibrated *conditional* c_k = P(x_k accepted | x_<k accepted)
    draft_probs   float [rows, γ, vocab]  the distributions x_k were sampled from, or None for
                                          greedy (one-hot) drafting
    """

    anchor_tokens: torch.Tensor
    draft_tokens: torch.Tensor
    num_drafted: torch.Tensor
    confidences: torch.Tensor
    draft_probs: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.anchor_tokens, torch.Tensor) or self.anchor_tokens.dim() != 1:
            raise TypeError("anchor_tokens must be a 1-D torch.Tensor [rows]")
        rows = self.anchor_tokens.shape[0]
        _check_rows("draft_tokens", self.draft_tokens, rows, 2)
        _check_rows("num_drafted", self.num_drafted, rows, 1)
        _check_rows("confidences", self.confidences, rows, 2)
        gamma = self.draft_tokens.shape[1]
        if self.confidences.shape[1] != gamma:
            raise ValueError(f"confidences has {self.confidences.shape[1]} positions, draft_tokens {gamma}")
        if rows and (self.num_drafted.min() < 0 or self.num_drafted.max() > gamma):
            raise ValueError(f"num_drafted must lie in [0, {gamma}]")
        if self.draft_probs is not None:
            _check_rows("draft_probs", self.draft_probs, rows, 3)
            if self.draft_probs.shape[1] != gamma:
                raise ValueError(f"draft_probs has {self.draft_probs.shape[1]} positions, draft_tokens {gamma}")

    @property
    def gamma(self) -> int:
        return self.draft_tokens.shape[1]

    def confidence_lists(self) -> list[list[float]]:
        """The input ``plan_verify_lengths`` takes: c_{r,1..γ_r} per request."""
        c = self.confidences.detach().double().cpu().tolist()
        return [row[:n] for row, n in zip(c, self.num_drafted.tolist())]

    def survival(self) -> torch.Tensor:
        """Prefix survival a_{r,k} = c_{r,1}···c_{r,k}, zero past num_drafted. [rows, γ]"""
        live = torch.arange(self.gamma, device=self.confidences.device)[None, :] < self.num_drafted[:, None]
        return torch.where(live, self.confidences, 0).cumprod(dim=-1)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification round per request (all int64/bool [rows] unless noted).

    num_accepted   m: accepted drafts (after EOS truncation)
    committed      [rows, k + 1] tokens to append, left-aligned, padded with -1:
                   x_1..x_m then the correction/bonus token (none after an accepted EOS)
    num_committed  m + 1, or m when an accepted EOS ended the sequence
    is_bonus       every verified draft was accepted and the extra token came from p_{ℓ+1}
    eos_truncated  an accepted draft was EOS: commit stops at it, no extra token
    kv_keep        target KV rows of this verify forward to keep: anchor + accepted = m + 1;
                   crop the cache to start + kv_keep, drop the rest (rejected rows)
    """

    num_accepted: torch.Tensor
    committed: torch.Tensor
    num_committed: torch.Tensor
    is_bonus: torch.Tensor
    eos_truncated: torch.Tensor
    kv_keep: torch.Tensor
