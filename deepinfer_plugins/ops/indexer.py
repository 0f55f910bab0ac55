"""Reference for the fused indexer selection: scores, visibility mask, candidate mask, top-k in one op.

It is the composition of the model's own steps (indexer.py ``Indexer.forward``) written once, so a kernel that
scores and selects in one pass (Ascend ``npu_lightning_indexer``, a fused Triton kernel) has one truth to match.
The ``*_records`` ops take the keys as the cache stores them (mxfp4 records), so a kernel can decode each key
in registers: 68 B read per key at d = 128, where decoding the cache first writes and rereads 256 B of bf16.
"""

from __future__ import annotations

import torch

from .cache import cache_gather
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


def record_keys(q: torch.Tensor, key_records: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """The keys the ``*_records`` ops score: mxfp4 records key_records[key_slots] decoded -> [N, d] in q's dtype."""
    return cache_gather.reference(key_records, key_slots, "mxfp4", q.shape[-1], q.dtype)


@registry.reference("indexer_scores_records")
def indexer_scores_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                           key_slots: torch.Tensor) -> torch.Tensor:
    """``indexer_scores`` with key n read from the indexer-key cache as stored: the mxfp4 record
    key_records[key_slots[n]]. -> fp32 [T, N].

    key_records uint8 [S, record_bytes("mxfp4", d)] (68 B at d = 128), possibly a row-strided view (an engine's
    cache row holds more than the record); key_slots [N] int64 rows, every one a written record (no -1), in any
    order.
    """
    return indexer_scores.reference(q, head_weights, record_keys(q, key_records, key_slots))


@registry.reference("indexer_topk_records")
def indexer_topk_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                         key_slots: torch.Tensor, visible: torch.Tensor, k: int,
                         candidates: torch.Tensor | None = None) -> torch.Tensor:
    """``indexer_topk`` with the keys read from the cache records as ``indexer_scores_records`` reads them:
    entry n (the id returned) is the record key_records[key_slots[n]]. -> ids [T, k]."""
    return indexer_topk.reference(q, head_weights, record_keys(q, key_records, key_slots), visible, k, candidates)
