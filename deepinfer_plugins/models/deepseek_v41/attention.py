"""CSA2 attention: single-latent MQA over a sliding window plus selected entries of a shared compressed KV.

Every layer attends to the last ``sliding_window`` positions of its own FP8 latent (K = V). Layers with a
compression ratio also attend to ``index_topk`` entries of the compressed KV published by the latest KV-source
layer, chosen by the latest index-source layer (docs/model.md#layers-and-roles: full = KV + index source, reindex =
index source, reuse = neither). Output: inverse RoPE, then the grouped low-rank projection ``wo_a`` / ``wo_b``.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn

from ... import ops
from ...ops.cache import record_bytes, to_device
from ...ops.fused import distinct_slots
from .args import ModelArgs
from .indexer import Indexer
from .kv_cache import (COMPRESSED_FORMAT, BatchStore, SequenceChunk, key_positions, oldest_window_key,
                       window_positions)
from .linear import Linear
from .norm import RMSNorm


def one_table(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (uint8 record table [S, R], slots [q, k] into it, -1 = none) -> one table and the slots of
    every query row [sum q, max k] (right-padded with -1), so that one attention call serves the whole batch.

    Engines keep every sequence in one paged table, which is then passed as is. Sequences that own their tables
    (the in-memory cache) get the rows their slots use copied into a new table, each distinct row once; a table
    no longer than its slot rows (the drafter's keys) is copied whole, since finding the distinct rows makes a
    GPU wait for the device."""
    width = max(slots.shape[1] for _, slots in parts)
    padded = [torch.nn.functional.pad(slots, (0, width - slots.shape[1]), value=-1) for _, slots in parts]
    table = parts[0][0]
    if all(t.data_ptr() == table.data_ptr() and t.shape == table.shape and t.stride() == table.stride()
           for t, _ in parts):
        return table, torch.cat(padded)
    rows, remapped, offset = [], [], 0
    for (table, _), slots in zip(parts, padded):
        if table.shape[0] > slots.shape[1]:
            used, slots = distinct_slots(slots)
            table = table[used]
        rows.append(table)
        remapped.append(torch.where(slots >= 0, slots + offset, -1))
        offset += table.shape[0]
    return torch.cat(rows), torch.cat(remapped)


class PerSequenceStore:
    """The ``BatchStore`` of sequences that own their caches (``SequenceState.window_records`` and their own
    compressed records): each sequence is written and looked up on its own, and ``one_table`` merges the results.
    Positions come from the chunks on the host, so no step waits on the device."""

    def __init__(self, window: int):
        self.window = window

    def window_keys(self, layer: int, latents: torch.Tensor,
                    chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for chunk, chunk_latents in zip(chunks, latents.split([chunk.num_rows for chunk in chunks])):
            first = oldest_window_key(chunk, self.window)
            records, slots = chunk.state.window_records(layer, chunk_latents, chunk.start_pos, first)
            query_pos = torch.arange(chunk.first_query_pos, chunk.start_pos + chunk.num_rows, device=latents.device)
            wanted = window_positions(query_pos, [chunk], self.window)
            parts.append((records, torch.where(wanted >= first, slots[(wanted - first).clamp(min=0)], -1)))
        return one_table(parts)

    def index_key_slots(self, source_layer: int, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for chunk in chunks:
            keys = chunk.state.compressed(source_layer).index_keys
            parts.append((keys.records, keys.slots(torch.arange(keys.length, device=keys.records.device))[None, :]))
        return one_table(parts)

    def compressor_inputs(self, source_layer: int, values: torch.Tensor, gates: torch.Tensor,
                          chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        open_values, open_gates, rows = [], [], [chunk.num_rows for chunk in chunks]
        for chunk, chunk_values, chunk_gates in zip(chunks, values.split(rows), gates.split(rows)):
            state = chunk.state.compressed(source_layer)
            if state.num_tokens != chunk.start_pos:
                raise RuntimeError(f"layer {source_layer}: compressor state covers {state.num_tokens} tokens but the "
                                   f"chunk starts at position {chunk.start_pos}")
            state.remember_inputs(chunk_values, chunk_gates)
            open_values.append(state.pending_values)
            open_gates.append(state.pending_gates)
        return torch.cat(open_values), torch.cat(open_gates)

    def publish_entries(self, source_layer: int, latents: torch.Tensor, keys: torch.Tensor, counts: list[int],
                        open_groups: list[tuple[torch.Tensor, torch.Tensor]] | None,
                        chunks: list[SequenceChunk]) -> None:
        for chunk, chunk_latents, chunk_keys, open_group in zip(chunks, latents.split(counts), keys.split(counts),
                                                                open_groups or [None] * len(chunks)):
            state = chunk.state.compressed(source_layer)
            if chunk_latents.shape[0]:
                state.latents.append(chunk_latents)
                state.index_keys.append(chunk_keys)
            if open_group is not None:
                state.pending_values, state.pending_gates = open_group

    def ngram_histories(self, chunks: list[SequenceChunk]) -> list[list[int]]:
        return [chunk.state.ngram_history() for chunk in chunks]

    def compressed_slots(self, source_layer: int, entries: torch.Tensor,
                         chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for chunk, chunk_entries in zip(chunks, entries.split([chunk.num_query_rows for chunk in chunks])):
            records = chunk.state.compressed(source_layer).latents
            parts.append((records.records, records.slots(chunk_entries)))
        return one_table(parts)


def store_of(chunks: list[SequenceChunk], window: int) -> BatchStore:
    """The ``batch_store`` the chunks' states share (engines), or a ``PerSequenceStore`` over their own caches."""
    return getattr(chunks[0].state, "batch_store", None) or PerSequenceStore(window)


def rope_inv_freq(args: ModelArgs, ratio: int) -> torch.Tensor:
    """RoPE frequencies: base theta for SWA-only layers; compress theta with YaRN for ratio > 0 (docs/model.md#rope)."""
    rd = args.qk_rope_head_dim
    theta = args.compress_rope_theta if ratio else args.rope_theta
    freqs = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    rs = args.rope_scaling
    if ratio and rs and args.max_position_embeddings > rs["original_max_position_embeddings"]:
        low, high = args.yarn_range()
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / rs["factor"] * ramp + freqs * (1 - ramp)
    return freqs.float()


class Compressor(nn.Module):
    """CSA2 compressor of a KV-source layer: one entry per ``ratio`` tokens (docs/model.md#csa2-compressor).

    Ratio 1: entry = norm(wkv(x)). Ratio 2: per channel, a softmax over the two tokens of the group of wgate(x)
    weights wkv(x), in fp32, then norm. No overlap between groups and no position embedding.
    """

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim, dtype=torch.float32)
        if ratio > 1:
            self.wgate = Linear(args.hidden_size, args.head_dim, dtype=torch.float32)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def token_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio > 1: the per-token inputs (wkv(x), wgate(x)) in fp32, each [n, head_dim]. Caches keep those of
        the open group (and the in-memory cache a few more, so that a rollback can restore the open group
        exactly: kv_cache.CompressedKV.rollback)."""
        return self.wkv(x.float()), self.wgate(x.float())

    def token_entries(self, x: torch.Tensor) -> torch.Tensor:
        """Ratio 1: one entry per token [n, head_dim], unrotated."""
        return self.norm(self.wkv(x))

    def round_weight_once(self, dtype: torch.dtype) -> None:
        """Ratio 1 multiplies x by its fp32 wkv rounded to the activation dtype: keep that rounded copy (5 MB at
        V4.1) rather than rounding 10 MB per step. Ratio > 1 multiplies in fp32 and keeps nothing."""
        if self.ratio == 1:
            self.wkv.keep_dense(dtype)

    def forward(self, values: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Ratio > 1: the inputs of complete groups [groups * ratio, head_dim] (fp32) -> entries [groups,
        head_dim] in ``dtype``, unrotated."""
        return ops.csa2_compress(values, gates, self.ratio, self.norm.weight, self.norm.eps, dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.ratio = args.layer_ratios[layer_id] if layer_id < args.num_hidden_layers else 0
        self.n_heads, self.head_dim, self.rope_dim = args.num_attention_heads, args.head_dim, args.qk_rope_head_dim
        self.window = args.sliding_window
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_a = Linear(args.hidden_size, args.q_lora_rank, "fp8")
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, dtype)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, "fp8")
        self.wkv = Linear(args.hidden_size, self.head_dim, "fp8")
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype)
        self.o_groups = args.o_groups
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * args.o_lora_rank, "fp8")
        self.wo_b = Linear(self.o_groups * args.o_lora_rank, args.hidden_size, "fp8")
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.is_kv_source = layer_id in args.kv_source_layer_ids
        self.is_index_source = layer_id in args.index_source_layer_ids
        if self.is_kv_source:
            self.compressor = Compressor(args, self.ratio)
        if self.is_index_source:
            self.indexer = Indexer(args, layer_id, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(args, self.ratio), persistent=False)

    # ---- projections -------------------------------------------------------------------------------------
    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return ops.rope(x, positions, self.inv_freq, inverse)

    def window_latents(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window latents [n, head_dim] before the cache's FP8 block-32 quantisation: norm, RoPE."""
        return self.rotate(self.kv_norm(self.wkv(x)), positions)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [n, heads, head_dim] rotated, q latent [n, q_lora_rank] shared with the indexer)."""
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim))
        if self.args.q_head_norm:
            q = ops.rms_norm(q, None, self.args.rms_norm_eps)
        return self.rotate(q, positions), q_latent

    def publish_compressed(self, x: torch.Tensor, key_pos: torch.Tensor, chunks: list[SequenceChunk],
                           store: BatchStore) -> None:
        """Run the compressor over the new tokens of every chunk (x, key_pos: all key rows) and append each
        chunk's new entries and index keys to its shared state, for the whole batch at once."""
        entries_before = [chunk.state.compressed(self.layer_id).num_entries for chunk in chunks]
        open_counts = [chunk.start_pos - n * self.ratio for chunk, n in zip(chunks, entries_before)]
        if any(not 0 <= n < self.ratio for n in open_counts):
            raise RuntimeError(f"layer {self.layer_id}: compressor states hold {entries_before} entries of "
                               f"{self.ratio} tokens, but the chunks start at {[c.start_pos for c in chunks]}")
        if self.ratio == 1:
            latents, positions, open_groups = self.compressor.token_entries(x), key_pos, None
            counts = [chunk.num_rows for chunk in chunks]
        else:
            values, gates = self.compressor.token_inputs(x)
            open_values, open_gates = store.compressor_inputs(self.layer_id, values, gates, chunks)
            rows = [chunk.num_rows for chunk in chunks]
            # per chunk its open group then its new tokens; complete groups are pooled, the rest stays open
            values = torch.cat([t for pair in zip(open_values.split(open_counts), values.split(rows)) for t in pair])
            gates = torch.cat([t for pair in zip(open_gates.split(open_counts), gates.split(rows)) for t in pair])
            lengths = [o + n for o, n in zip(open_counts, rows)]
            counts = [n // self.ratio for n in lengths]
            starts = [0, *itertools.accumulate(lengths)][:-1]
            pooled = [slice(start, start + count * self.ratio) for start, count in zip(starts, counts)]
            latents = self.compressor(torch.cat([values[s] for s in pooled]), torch.cat([gates[s] for s in pooled]),
                                      x.dtype)
            open_groups = [(values[s.stop: start + n], gates[s.stop: start + n])
                           for s, start, n in zip(pooled, starts, lengths)]
            positions = to_device(torch.cat([(first + torch.arange(count)) * self.ratio
                                             for first, count in zip(entries_before, counts)]), x.device)
        keys = self.indexer.index_keys(latents, positions, self.rotate)
        store.publish_entries(self.layer_id, self.rotate(latents, positions), keys, counts, open_groups,
                              chunks)  # the store writes nvfp4 / mxfp4 records

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, chunks: list[SequenceChunk]) -> torch.Tensor:
        """x [rows, d] (normed attention input of every key row) -> [query rows, d].

        Projections, RoPE, the compressor's inputs, the indexer and the attention itself run once over the rows
        of every chunk. Window writes and slot lookups run once per layer where the states share a
        ``batch_store`` (engines), else once per sequence; the compressor's pooling stays per sequence."""
        all_key_pos = key_positions(chunks, x.device)
        key_pos = all_key_pos.split([chunk.num_rows for chunk in chunks])
        query_pos = [pos[chunk.num_rows - chunk.num_query_rows:] for pos, chunk in zip(key_pos, chunks)]
        key_rows = [x[chunk.row_start: chunk.row_start + chunk.num_rows] for chunk in chunks]
        x_query = torch.cat([rows[chunk.num_rows - chunk.num_query_rows:] for rows, chunk in zip(key_rows, chunks)])
        all_query_pos = torch.cat(query_pos)
        q, q_latent = self.queries(x_query, all_query_pos)
        key_x = torch.cat(key_rows)
        latents = self.window_latents(key_x, all_key_pos)
        o = self.attend_cached(key_x, all_key_pos, x_query, all_query_pos, q, q_latent, latents, chunks)
        return self.project_out(self.rotate(o, all_query_pos, inverse=True))

    def forward_all_rows(self, x: torch.Tensor, positions: torch.Tensor,
                         attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward`` where every row is a query row (engines that compile the model): the projections and RoPE
        around ``attend(q, q_latent, latents) -> o``, which runs ``attend_cached`` behind an opaque op."""
        q, q_latent = self.queries(x, positions)
        o = attend(q, q_latent, self.window_latents(x, positions))
        return self.project_out(self.rotate(o, positions, inverse=True))

    def attend_cached(self, key_x: torch.Tensor, key_pos: torch.Tensor, x_query: torch.Tensor,
                      query_pos: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor, latents: torch.Tensor,
                      chunks: list[SequenceChunk]) -> torch.Tensor:
        """What ``forward`` does between the projections, all the cache work: the window write, the compressor
        and index keys, the indexer's selection and the sparse attention -> o [query rows, heads, head_dim],
        still rotated. Its own method so that a compiling engine keeps the projections in its graph and makes
        only this opaque (vllm/compiled.py)."""
        store = store_of(chunks, self.window)
        if self.is_kv_source:
            self.publish_compressed(key_x, key_pos, chunks, store)
        window_cache, window_slots = store.window_keys(self.layer_id, latents, chunks)
        if self.ratio:
            source = self.args.kv_source_of[self.layer_id]
            compressed_cache, compressed_slots = store.compressed_slots(
                source, self.select_compressed(x_query, q_latent, query_pos, source, store, chunks), chunks)
        else:
            compressed_cache = torch.empty(0, record_bytes(COMPRESSED_FORMAT, self.head_dim), dtype=torch.uint8,
                                           device=key_x.device)
            compressed_slots = window_slots[:, :0]
        return ops.sparse_attention_records(q, window_cache, window_slots, compressed_cache, compressed_slots,
                                            self.attn_sink, self.softmax_scale)

    def select_compressed(self, x_query: torch.Tensor, q_latent: torch.Tensor, query_pos: torch.Tensor, source: int,
                          store, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Compressed entry ids [query rows, index_topk] of every query row: indexed here for the whole batch in
        one call, or reused from the last index source (each chunk keeps its rows' ids in ``published``)."""
        query_counts = [chunk.num_query_rows for chunk in chunks]
        if self.is_index_source:
            if self.indexer.selects_every_visible_entry(chunks):
                num_entries = max(chunk.state.compressed(source).num_entries for chunk in chunks)
                selected = self.indexer.every_visible_entry(query_pos, num_entries, chunks)
            else:
                q_index, weights = self.indexer.queries(x_query, q_latent, query_pos, self.rotate)
                key_records, key_slots = store.index_key_slots(source, chunks)
                selected = self.indexer(q_index, weights, query_pos, key_records, key_slots, chunks)
            for chunk, ids in zip(chunks, selected.split(query_counts)):
                chunk.published["topk"] = ids
            return selected
        return torch.cat([chunk.published["topk"][-chunk.num_query_rows:] for chunk in chunks])

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """o [n, heads, head_dim] -> grouped low-rank wo_a (one block per group of heads) -> wo_b -> [n, d]."""
        grouped = o.flatten(1).unflatten(-1, (self.o_groups, -1))  # [n, groups, heads/groups * head_dim]
        return self.wo_b(self.wo_a.grouped(grouped).flatten(1))  # wo_a: [n, groups, o_lora]
