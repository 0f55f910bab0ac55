"""Reference for the fused indexer selection: scores, visibility mask, candidate mask, top-k in one op.

It is the composition of the model's own steps (indexer.py ``Indexer.forward``) written once, so a kernel that
scores and selects in one pass (Ascend ``npu_lightning_indexer``, a fused Triton kernel) has one truth to match.
"""

from __future__ import annotations

import torch

from .reference import indexer_scores, topk_indices
from .registry import registry


def masked_indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                          candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores [T, N] with -inf wherever query t may not select entry n (n >= visible[t], or outside
    ``candidates``): the input of the top-k step, exposed so that tests can swap the selection rule alone."""
    scores = indexer_scores.reference(q, head_weights, keys)
    entry = torch.arange(scores.shape[1], device=scores.device)
    scores = scores.masked_fill(entry[None, :] >= visible[:, None], float("-inf"))
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    return scores


@registry.reference("indexer_topk")
def indexer_topk(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Selected entry ids [T, k] per query: ascending, ties to the lower id, -1 padded.

    q [T, h, d] and keys [N, d] MXFP4-quantised, head_weights [T, h]; visible [T] = number of entries query t
    may see (entries >= visible never count); candidates [T, N] bool, where given, further limits the choice
    (the two-level pre-filter of the layers after the candidate source).
    """
    return topk_indices.reference(masked_indexer_scores(q, head_weights, keys, visible, candidates), k)
