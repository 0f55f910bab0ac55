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


def hide_scores(scores: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
    """scores [T, N] with -inf wherever query t may not select entry n (n >= visible[t], or outside
    ``candidates``): the input of the top-k step, exposed so that tests can swap the selection rule alone."""
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
    return topk_indices.reference(hide_scores(indexer_scores.reference(q, head_weights, keys), visible, candidates), k)


def record_keys(q: torch.Tensor, key_records: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """The keys the ``*_records`` ops score: mxfp4 records key_records[key_slots] decoded -> [..., d] in q's
    dtype; slot -1 gives a zero key."""
    return cache_gather.reference(key_records, key_slots, "mxfp4", q.shape[-1], q.dtype)


@registry.reference("indexer_scores_records")
def indexer_scores_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                           key_slots: torch.Tensor, query_counts: list[int] | None = None) -> torch.Tensor:
    """``indexer_scores`` with key n read from the indexer-key cache as stored: the mxfp4 record
    key_records[key_slots[n]]. -> fp32 [T, N].

    key_records uint8 [S, record_bytes("mxfp4", d)] (68 B at d = 128), possibly a row-strided view (an engine's
    cache row holds more than the record); key_slots [N] int64 rows in any order, -1 for no key (score 0).
    A batch of sequences in one call: key_slots [B, N] and ``query_counts`` (the query rows of each sequence, in
    order, summing to T); the rows of sequence b score the keys key_slots[b], each sequence's own entries 0..
    padded with -1 to the longest.
    """
    if query_counts is None:
        return indexer_scores.reference(q, head_weights, record_keys(q, key_records, key_slots))
    if len(query_counts) > 1 and min(query_counts) == max(query_counts) > 0:
        # decode and verification steps: every sequence has the same rows, so the batch scores in one batched call
        # (equal to the per-sequence calls bit for bit: the same GEMM per sequence); one sequence skips vmap's
        # own cost, which exceeds its scoring at short contexts
        rows = (-1, query_counts[0])
        scores = torch.vmap(indexer_scores.reference)(q.unflatten(0, rows), head_weights.unflatten(0, rows),
                                                      record_keys(q, key_records, key_slots))
        return scores.flatten(0, 1)
    scores = [indexer_scores.reference(q_b, w_b, record_keys(q, key_records, slots_b)) for q_b, w_b, slots_b in
              zip(q.split(query_counts), head_weights.split(query_counts), key_slots)]
    return torch.cat(scores) if scores else q.new_zeros(0, key_slots.shape[-1], dtype=torch.float32)


@registry.reference("indexer_topk_records")
def indexer_topk_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                         key_slots: torch.Tensor, visible: torch.Tensor, k: int,
                         candidates: torch.Tensor | None = None, query_counts: list[int] | None = None) -> torch.Tensor:
    """``indexer_topk`` with the keys read from the cache records as ``indexer_scores_records`` reads them
    (one sequence, or a batch with ``query_counts``): entry n (the id returned) is the record
    key_records[key_slots[n]] (key_slots[b, n] for a row of sequence b). -> ids [T, k]."""
    scores = indexer_scores_records.reference(q, head_weights, key_records, key_slots, query_counts)
    return topk_indices.reference(hide_scores(scores, visible, candidates), k)
