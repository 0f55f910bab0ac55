"""Lightning indexer: picks, for each query, the ``index_topk`` compressed entries it attends to
(docs/model.md#indexer).

Index-source layers score every visible entry with MXFP4 queries against MXFP4 keys. From the candidate-source
layer on, selection is two-level: the candidate source keeps the best ``candidate_topk_blocks`` blocks of
``candidate_block_size`` entries (always including the newest), and later index sources rank only inside them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ... import ops
from .args import ModelArgs
from .kv_cache import SequenceChunk
from .linear import Linear
from .norm import RMSNorm


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.ratio = args.layer_ratios[layer_id]
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, "fp8")
        self.weights_proj = Linear(args.hidden_size, self.n_heads, dtype=dtype)
        if layer_id in args.kv_source_layer_ids:
            self.wk = Linear(args.head_dim, self.head_dim, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype)
        self.is_candidate_source = layer_id == args.candidate_source_layer_id
        self.uses_candidates = args.uses_candidates(layer_id)

    def index_keys(self, latents: torch.Tensor, positions: torch.Tensor, rotate: Callable) -> torch.Tensor:
        """Keys of new compressed entries: k_norm(wk(latent)), rotated at the entry position (the cache stores
        them as MXFP4 records, docs/model.md#cache-records)."""
        return rotate(self.k_norm(self.wk(latents)), positions)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
                rotate: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """x [q, d], q_latent [q, q_lora_rank] of any number of sequences -> (MXFP4 queries [q, heads, head_dim],
        head weights [q, heads] fp32); per row, so a batch computes them once."""
        q = ops.mxfp4_fake_quant(rotate(self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), positions))
        return q, self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

    def selects_every_visible_entry(self, chunks: list[SequenceChunk]) -> bool:
        """Whether the selection keeps every entry each query row sees, known from the batch's geometry on the
        host: no row sees more than ``index_topk`` entries and, where the two-level pre-filter applies, every
        block holding a visible entry survives it (and the candidate source shares this layer's ratio). Scoring
        then cannot change the result (finite activations give finite scores), so a short context skips it."""
        most = max(((c.start_pos + c.num_rows) // self.ratio for c in chunks), default=0)
        if most > self.args.index_topk:
            return False
        if not (self.is_candidate_source or self.uses_candidates):
            return True
        if self.args.layer_ratios[self.args.candidate_source_layer_id] != self.ratio:
            return False
        return most <= self.args.candidate_topk_blocks * self.args.candidate_block_size

    def every_visible_entry(self, positions: torch.Tensor, num_entries: int,
                            chunks: list[SequenceChunk]) -> torch.Tensor:
        """``forward``'s result where ``selects_every_visible_entry``: entries 0.. of what each row sees, -1
        padded. The candidate source still publishes its pre-filter, over the ``num_entries`` columns of the
        batch's widest sequence: any finite scores of the visible entries give the same one, so zeros stand in."""
        visible = self.visible_entries(positions)
        if self.is_candidate_source:
            self.publish_candidates(torch.zeros(positions.shape[0], num_entries, device=positions.device), visible,
                                    chunks)
        ids = torch.arange(self.args.index_topk, device=positions.device)
        return torch.where(ids[None, :] < visible[:, None], ids[None, :], -1)

    def visible_entries(self, positions: torch.Tensor) -> torch.Tensor:
        """How many compressed entries a query row at each position sees [T]."""
        return torch.div(positions + 1, self.ratio, rounding_mode="floor")

    def publish_candidates(self, scores: torch.Tensor, visible: torch.Tensor,
                           chunks: list[SequenceChunk]) -> torch.Tensor:
        """The candidate source's block pre-filter of scores [T, N], kept per chunk for the later index sources.
        -> the scores with every entry a row does not see at -inf."""
        entry = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(entry[None, :] >= visible[:, None], float("-inf"))
        candidates = ops.candidate_mask(scores, visible, self.args.candidate_block_size,
                                        self.args.candidate_topk_blocks)
        for chunk, rows in zip(chunks, candidates.split([c.num_query_rows for c in chunks])):
            chunk.published["candidates"] = rows
        return scores

    def forward(self, q: torch.Tensor, head_weights: torch.Tensor, positions: torch.Tensor, key_records: torch.Tensor,
                key_slots: torch.Tensor, chunks: list[SequenceChunk]) -> torch.Tensor:
        """``queries`` [T, ...] of the query rows of every chunk -> selected entry ids [T, index_topk] ascending,
        -1 padded; one call for the whole batch. key_slots [chunks, N]: the rows of ``key_records`` (mxfp4
        records, scored as stored: the kernels decode each 68 B record in registers) holding each chunk's index
        keys, -1 past its entries."""
        query_counts = [chunk.num_query_rows for chunk in chunks]
        visible = self.visible_entries(positions)
        if not self.is_candidate_source:  # selection only: one fused op (Ascend: npu_lightning_indexer)
            candidates = torch.cat([chunk.published["candidates"][-chunk.num_query_rows:] for chunk in chunks]) \
                if self.uses_candidates else None
            return ops.indexer_topk_records(q, head_weights, key_records, key_slots, visible, self.args.index_topk,
                                            candidates, query_counts)
        # the candidate source also publishes its block pre-filter, which needs the scores themselves
        scores = ops.indexer_scores_records(q, head_weights, key_records, key_slots, query_counts)  # [T, N]
        return ops.topk_indices(self.publish_candidates(scores, visible, chunks), self.args.index_topk)
