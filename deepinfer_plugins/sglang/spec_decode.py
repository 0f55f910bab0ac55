"""SGLang's TARGET_VERIFY logits onto DeepInfer's DSpark verification (``deepinfer_plugins.dspark.verify``).

DeepInfer registers no speculative algorithm on SGLang (register.py): the scheduler-side worker SGLang 0.5.23
drives (its V2 schema: ``forward_batch_generation`` returning accepted lengths, draft KV bookkeeping, CUDA
graphs, overlap) is not written. What such a worker would call on the target's output is here and tested on
CPU with the real TARGET_VERIFY forward of model.py: the translation of that forward's rows onto ``verify``.
"""

from __future__ import annotations

import torch


def verify_from_target_logits(verify_logits: torch.Tensor, draft_tokens: torch.Tensor, num_verify: torch.Tensor,
                              draft_probs: torch.Tensor | None = None, temperature=0.0, top_k=0, top_p=1.0,
                              eos_token_id: int | None = None, generator: torch.Generator | None = None):
    """SGLang's TARGET_VERIFY output -> ``dspark.verify`` -> VerifyResult.

    verify_logits [R * (k + 1), vocab]: ``next_token_logits`` of a TARGET_VERIFY forward whose rows per request
    are anchor, x_1..x_k (SGLang's layout: requests one after another); draft_tokens int [R, k];
    num_verify int [R] (ℓ_r ≤ k). Rows past anchor + ℓ_r are computed by SGLang's fixed-width window and ignored.
    """
    from ..dspark import processed_probs, verify

    rows, k = draft_tokens.shape
    if verify_logits.shape[0] != rows * (k + 1):
        raise ValueError(f"verify_logits has {verify_logits.shape[0]} rows; {rows} requests x (anchor + {k} drafts) "
                         f"= {rows * (k + 1)} expected")
    target_probs = processed_probs(verify_logits.float().view(rows, k + 1, -1), temperature, top_k, top_p)
    return verify(draft_tokens, num_verify, target_probs, draft_probs, eos_token_id=eos_token_id,
                  generator=generator)
