"""One call per engine step for DSpark drafting: target features of the newly committed positions + the anchor
-> a drafted block with confidences, per request. The vLLM proposer and the SGLang worker call this; neither
needs to know the drafter's layout.

Per request the engine:
  1. runs the target with ``capture_layers=drafter.feature_layers`` (prefill or verify forward) and slices, per
     layer, the streams of the positions it commits: all prompt rows after prefill (the last ``sliding_window``
     suffice), rows anchor..x_m after a verify;
  2. calls ``step`` with those streams, the position of their first row and the new anchor (the correction or
     bonus token, whose own features come with the next verify forward);
  3. plans verify lengths on ``proposal.confidences`` and verifies (length_policy.py, verify.py).
Features for a position that is already in the state replace it and everything after it, so an engine that
appended all verified rows can also call ``rollback`` instead of slicing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.deepseek_v41.drafter import DraftState
from .calibration import apply_sts
from .proposal import DSparkProposal


@dataclass(frozen=True)
class DraftRequest:
    """New target features of one request and its anchor.

    streams_in   {target layer: [n, S, d]} the residual streams entering each of ``feature_layers`` for the
                 positions start_pos..start_pos+n-1 (an empty dict drafts on the existing context)
    start_pos    position of the first row
    anchor_token the last committed token, at position start_pos + n
    """

    request_id: str
    streams_in: dict
    start_pos: int
    anchor_token: int


@dataclass(frozen=True)
class EngineDraft:
    """``proposal`` for the scheduler and verifier; ``confidence_logits`` [R, γ] raw, for logging and STS fits."""

    proposal: DSparkProposal
    confidence_logits: torch.Tensor


class DSparkEngineDrafter:
    """Draft state per request id over a model loaded with its drafter (``DeepseekV41ForCausalLM``, ``mtp``).

    max_rollback: positions ``rollback`` may forget (default: the block size). sts_temperatures: per-position
    STS temperatures (calibration.fit_sts) applied to the confidence logits; None = raw sigmoid.
    """

    def __init__(self, model, max_rollback: int | None = None, sts_temperatures=None):
        if getattr(model, "drafter", None) is None:
            raise ValueError("the model has no DSpark drafter: load it with "
                             "DeepseekV41ForCausalLM.from_pretrained(path, with_drafter=True)")
        self.model, self.drafter = model, model.drafter
        self.block_size = self.drafter.block_size
        self.max_rollback = self.block_size if max_rollback is None else max_rollback
        if sts_temperatures is not None and len(sts_temperatures) != self.block_size:
            raise ValueError(f"sts_temperatures needs one temperature per draft position ({self.block_size}), "
                             f"got {len(sts_temperatures)}")
        self.sts_temperatures = sts_temperatures
        self.states: dict[str, DraftState] = {}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Pass as ``capture_layers`` to the target's ``forward_chunks``."""
        return tuple(self.model.args.dspark_target_layer_ids)

    # ---- per-request state -------------------------------------------------------------------------------
    def add_request(self, request_id: str) -> None:
        if request_id in self.states:
            raise KeyError(f"request {request_id!r} already has a draft state")
        self.states[request_id] = self.drafter.new_state(self.max_rollback)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _state(self, request_id: str) -> DraftState:
        try:
            return self.states[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: call add_request first") from None

    def num_context_tokens(self, request_id: str) -> int:
        """Positions with target features; the next anchor sits at this position."""
        return self._state(request_id).num_tokens

    @torch.inference_mode()
    def update(self, request_id: str, streams_in: dict, start_pos: int) -> None:
        """Commit target features of positions start_pos.. (replacing any at or after start_pos)."""
        if not streams_in or next(iter(streams_in.values())).shape[0] == 0:
            return
        self.drafter.add_context(self._state(request_id), self.drafter.context(streams_in), start_pos)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Forget features of positions >= num_tokens."""
        self._state(request_id).rollback(num_tokens)

    # ---- the step call -----------------------------------------------------------------------------------
    def step(self, requests: list[DraftRequest], temperature=0.0, top_k=0, top_p=1.0,
             greedy_draft: bool | None = None, generator: torch.Generator | None = None) -> EngineDraft:
        """Commit each request's new features, then draft one block per request (sampling settings: scalars or
        per request; see DSparkDrafter.propose)."""
        for r in requests:
            self.update(r.request_id, r.streams_in, r.start_pos)
        states = [self._state(r.request_id) for r in requests]
        for r, state in zip(requests, states):
            n = next(iter(r.streams_in.values())).shape[0] if r.streams_in else 0
            if state.num_tokens != r.start_pos + n:
                raise ValueError(f"request {r.request_id!r}: the anchor must sit right after the features "
                                 f"(position {r.start_pos + n}), but the draft state holds {state.num_tokens} "
                                 "positions")
        device = self.model.embed.weight.device
        anchors = torch.tensor([r.anchor_token for r in requests], dtype=torch.long, device=device)
        block = self.drafter.propose(self.model.embed, self.model.head_weight, anchors, states, temperature,
                                     top_k, top_p, greedy_draft, generator)
        confidences = block.confidences
        if self.sts_temperatures is not None:
            confidences = torch.from_numpy(apply_sts(block.confidence_logits.double().cpu().numpy(),
                                                     np.asarray(self.sts_temperatures))).to(block.confidences)
        rows = len(requests)
        proposal = DSparkProposal(
            anchor_tokens=anchors, draft_tokens=block.tokens,
            num_drafted=torch.full((rows,), self.block_size, dtype=torch.long, device=device),
            confidences=confidences, draft_probs=block.draft_probs)
        return EngineDraft(proposal, block.confidence_logits)
