"""Reference DSpark speculative decoding on the core model, no engine: the ground truth for the adapters.

    prefill (chunked, bounded replay) capturing the target features -> draft context; first token = anchor
    repeat:
        draft a block of B tokens + confidences from the anchor          (DSparkEngineDrafter.step)
        ℓ = plan_verify_lengths(c, step_cost) or a fixed k               (length_policy.py)
        ONE target forward over [anchor, x_1..x_ℓ], capturing features   (multi-token verification)
        verify: m accepted drafts + a correction / bonus token           (verify.py, greedy or sampled)
        roll the target cache back to anchor + m accepted rows; commit the features of those m + 1 rows to the
        draft context; the correction / bonus token is the next anchor
Greedy output equals ``generate()`` token for token; sampled output has the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.deepseek_v41.generate import SamplingParams
from ..models.deepseek_v41.kv_cache import SequenceCache, SequenceChunk
from ..models.deepseek_v41.sampling import processed_probs
from .engine_api import DraftRequest, DSparkEngineDrafter, EngineDraft
from .length_policy import plan_verify_lengths
from .verify import verify

REQUEST = "0"


@dataclass
class SpeculativeStats:
    """Acceptance statistics over verification rounds (spec dspark §3.5)."""

    block_size: int
    rounds: int = 0
    verified_drafts: int = 0
    accepted_drafts: int = 0
    committed: int = 0
    verified_at: list[int] = field(default_factory=list)  # [B] rounds that verified position k
    accepted_at: list[int] = field(default_factory=list)  # [B] rounds that accepted position k

    def __post_init__(self) -> None:
        self.verified_at = self.verified_at or [0] * self.block_size
        self.accepted_at = self.accepted_at or [0] * self.block_size

    def record(self, num_verified: int, num_accepted: int, num_committed: int) -> None:
        self.rounds += 1
        self.verified_drafts += num_verified
        self.accepted_drafts += num_accepted
        self.committed += num_committed
        for k in range(num_verified):
            self.verified_at[k] += 1
            self.accepted_at[k] += k < num_accepted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per round (accepted drafts + correction / bonus), τ̄."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_drafts / self.verified_drafts if self.verified_drafts else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "verified_drafts": self.verified_drafts,
                "accepted_drafts": self.accepted_drafts, "acceptance_length": round(self.acceptance_length, 4),
                "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
                "acceptance_at_position": [round(a / v, 4) if v else None
                                           for a, v in zip(self.accepted_at, self.verified_at)]}


class SpeculativeDecoder:
    """Speculative generation of one sequence with the model's own DSpark drafter.

    Verify lengths: ``step_cost`` (B -> ms, e.g. a cost_model.CostTable) plans them with Algorithm A on the
    drafter's confidences; otherwise a fixed ``num_verify`` (default: the whole block). ``greedy_draft``:
    draft with argmax (one-hot q) even when sampling; default: draft at the target's sampling settings.
    """

    def __init__(self, model, params: SamplingParams | None = None, *, num_verify: int | None = None,
                 step_cost=None, greedy_draft: bool | None = None, sts_temperatures=None, prefill_chunk: int = 2048):
        self.model, self.params = model, params or SamplingParams()
        self.drafts = DSparkEngineDrafter(model, sts_temperatures=sts_temperatures)
        self.block_size = self.drafts.block_size
        if num_verify is not None and step_cost is not None:
            raise ValueError("give either num_verify (fixed length) or step_cost (planned lengths), not both")
        if num_verify is not None and not 0 <= num_verify <= self.block_size:
            raise ValueError(f"num_verify must lie in [0, {self.block_size}], got {num_verify}")
        self.num_verify = self.block_size if num_verify is None else num_verify
        self.step_cost, self.greedy_draft, self.prefill_chunk = step_cost, greedy_draft, prefill_chunk
        self.stats = SpeculativeStats(self.block_size)

    # ---- the pieces a test may override ------------------------------------------------------------------
    def draft(self, request: DraftRequest, generator: torch.Generator | None) -> EngineDraft:
        p = self.params
        return self.drafts.step([request], p.temperature, p.top_k, p.top_p, self.greedy_draft, generator)

    def verify_length(self, draft: EngineDraft) -> int:
        if self.step_cost is None:
            return self.num_verify
        return plan_verify_lengths(draft.proposal.confidence_lists(), self.step_cost)[0]

    # ---- the loop ----------------------------------------------------------------------------------------
    def target_forward(self, tokens: torch.Tensor, cache: SequenceCache, bounded_replay: bool):
        chunk = SequenceChunk(0, tokens.numel(), cache.num_tokens, cache)
        logits = self.model.forward_chunks(tokens, [chunk], bounded_replay, capture_layers=self.drafts.feature_layers)
        cache.advance(tokens)
        return logits, chunk.published["streams_in"]

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        return processed_probs(logits, p.temperature, p.top_k, p.top_p)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int]) -> list[int]:
        """Prompt token ids -> generated ids (stop token included when hit); statistics in ``self.stats``."""
        params, model = self.params, self.model
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        device = model.embed.weight.device
        cache = SequenceCache(model.args, device, max_rollback=self.block_size)
        self.drafts.remove_request(REQUEST)
        self.drafts.add_request(REQUEST)
        self.stats = SpeculativeStats(self.block_size)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        for first in range(0, prompt.numel(), self.prefill_chunk):
            logits, streams = self.target_forward(prompt[first: first + self.prefill_chunk], cache, True)
            # Bounded replay captures at least the last min(rows, window) positions of every layer: enough context.
            rows = min(s.shape[0] for s in streams.values())
            streams, start = {layer: s[-rows:] for layer, s in streams.items()}, cache.num_tokens - rows
            if first + self.prefill_chunk < prompt.numel():  # the last chunk's features go with the first draft
                self.drafts.update(REQUEST, streams, start)
        if params.max_new_tokens == 0:
            return []
        out = [int(torch.multinomial(self.target_probs(logits[-1:])[0], 1, generator=generator))]
        while out[-1] not in params.stop_token_ids and len(out) < params.max_new_tokens:
            anchor = out[-1]
            draft = self.draft(DraftRequest(REQUEST, streams, start, anchor), generator)
            proposal = draft.proposal
            ell = min(self.verify_length(draft), params.max_new_tokens - len(out) - 1)
            start = cache.num_tokens  # the anchor's position
            drafted = proposal.draft_tokens[:, :ell]  # [1, ℓ]
            logits, streams = self.target_forward(torch.cat((proposal.anchor_tokens, drafted[0])), cache, False)
            q = None if proposal.draft_probs is None else proposal.draft_probs[:, :ell]
            result = verify(drafted, torch.tensor([ell]), self.target_probs(logits[None]), q, generator=generator)
            m = int(result.num_accepted[0])
            committed = result.committed[0, : int(result.num_committed[0])].tolist()
            cache.rollback(start + m + 1)  # keep the anchor and the accepted drafts
            streams = {layer: s[: m + 1] for layer, s in streams.items()}
            self.stats.record(ell, m, len(committed))
            for token in committed:
                out.append(token)
                if token in params.stop_token_ids:
                    break
        return out


def speculative_generate(model, prompt_ids: list[int], params: SamplingParams | None = None,
                         **options) -> tuple[list[int], SpeculativeStats]:
    """``SpeculativeDecoder(model, params, **options).generate(prompt_ids)`` -> (tokens, stats)."""
    decoder = SpeculativeDecoder(model, params, **options)
    return decoder.generate(prompt_ids), decoder.stats
