"""Per-sequence decoding state of V4.1, and the batch layout the model runs on.

A sequence owns four kinds of state (docs/model.md#attention, #engram):
  * a window ring per layer: the last ``sliding_window`` latents (K = V) as ``fp8_window`` records (528 B at
    head_dim 512) with their positions;
  * per KV-source layer, the shared compressed KV (``nvfp4`` records, 288 B) and its indexer keys (``mxfp4``
    records, 68 B), which grow by one entry per ``ratio`` tokens, plus the compressor inputs of a not yet
    complete group;
  * the last ``engram_max_ngram_size - 1`` token ids for Engram's n-gram hashes.
Caches hold the byte records of ops/cache.py, written by ``ops.cache_write`` and read by the attention kernel as
stored (``ops.sparse_attention_records``): the caches are the model's cache precision (docs/model.md#cache-records)
at its storage size, not float copies of it. Engines keep the same records in their own paged memory; they implement
the ``SequenceState`` methods over it (see deepinfer_plugins/vllm), so the model code is identical in both places.

Speculative decoding runs the target over drafted tokens and then drops the rejected ones, so a cache built
with ``max_rollback = R`` can forget its last R tokens exactly (``SequenceCache.rollback``): rings hold
``sliding_window + R`` rows (the rejected rows must not overwrite the window the next token needs, as ATOM's
128 + 5 rows), compressed states keep the per-token compressor inputs of their last R + ratio - 1 tokens (to
rebuild the open group of a truncated state), and the Engram history keeps R more token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ... import ops
from ...ops.cache import record_bytes, to_device
from .args import ModelArgs

WINDOW_FORMAT, COMPRESSED_FORMAT, INDEX_KEY_FORMAT = "fp8_window", "nvfp4", "mxfp4"  # docs/model.md#cache-records


class BatchStore(Protocol):
    """A batch's cache reads and writes for one layer at a time, where its sequences share tables (engines): a
    layer's window writes and slot lookups then cost a few batched ops, not some per sequence, and the indexer
    scores every sequence in one call."""

    def window_keys(self, layer: int, latents: torch.Tensor,
                    chunks: list["SequenceChunk"]) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's window latents [key rows of every chunk, head_dim] (unquantised: written as
        fp8_window records) -> (records [S, R] uint8, possibly a row-strided view; each query row's window slots
        [query rows, W], -1 = none): the records of the positions within ``sliding_window`` up to the row's own."""

    def index_key_slots(self, source_layer: int, chunks: list["SequenceChunk"]) -> tuple[torch.Tensor, torch.Tensor]:
        """The index keys of KV source ``source_layer`` -> (their mxfp4 records [S, R] uint8, possibly a
        row-strided view; slots [chunks, N]: row n of chunk b holds its entry n's key, -1 past its entries)."""

    def compressor_inputs(self, source_layer: int, values: torch.Tensor, gates: torch.Tensor,
                          chunks: list["SequenceChunk"]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the per-token compressor inputs (wkv(x), wgate(x), fp32 [key rows of every chunk, head_dim]) of KV
        source ``source_layer`` (ratio > 1) -> the inputs of each chunk's open group before them (values, gates
        [open tokens of every chunk, head_dim], chunk order)."""

    def publish_entries(self, source_layer: int, latents: torch.Tensor, keys: torch.Tensor, counts: list[int],
                        open_groups: list[tuple[torch.Tensor, torch.Tensor]] | None,
                        chunks: list["SequenceChunk"]) -> None:
        """Append counts[b] new entries to chunk b's compressed state (rotated latents [sum counts, head_dim] and
        index keys [sum counts, index_head_dim], unquantised: written as nvfp4 / mxfp4 records); ``open_groups``
        (ratio > 1): each chunk's inputs of its new open group, for stores that do not keep them already."""

    def ngram_histories(self, chunks: list["SequenceChunk"]) -> list[torch.Tensor]:
        """Each chunk's up to engram_max_ngram_size - 1 token ids before its rows, oldest first (int64, on the
        model's device)."""

    def compressed_slots(self, source_layer: int, entries: torch.Tensor,
                         chunks: list["SequenceChunk"]) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed entry ids [query rows of every chunk, k] (-1 = none) of KV source ``source_layer`` ->
        (its nvfp4 records [S, R] uint8, possibly a row-strided view; their slots [query rows, k], -1 kept)."""


class SequenceState(Protocol):
    """The cache interface the layers use. ``SequenceCache`` is the in-memory reference implementation.

    Engines whose sequences share tables give every state of a batch the same ``batch_store`` attribute (a
    ``BatchStore``), which then replaces ``window_records`` and ``ngram_history``, and their ``compressed``
    states need only ``num_entries`` (``EntryCount``); the model reads and writes per sequence otherwise."""

    num_tokens: int

    def window_records(self, layer: int, latents: torch.Tensor, start_pos: int,
                       first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's window latents [n, head_dim] of positions start_pos.. (unquantised: the store
        writes them as fp8_window records) and return (records [S, R] uint8, possibly a row-strided view; slots
        [start_pos + n - first]) with records[slots[i]] the record of position first + i."""

    def compressed(self, source_layer: int) -> "CompressedKV | EntryCount":
        """The shared compressed state published by KV-source layer ``source_layer``."""

    def ngram_history(self) -> list[int]:
        """Up to engram_max_ngram_size - 1 token ids preceding the next forward, oldest first."""

    def advance(self, token_ids: torch.Tensor) -> None:
        """Account for ``token_ids`` having been run (called once per forward, after every layer)."""


class EntryRecords(Protocol):
    """Records of compressed entries 0..length-1 in one cache format (``RecordBuffer``)."""

    length: int

    def append(self, x: torch.Tensor) -> None:
        """Quantise x [n, dim] and store it as entries length..length + n - 1."""

    @property
    def records(self) -> torch.Tensor:
        """The uint8 table [S, R] the entries live in (possibly a row-strided view)."""

    def slots(self, entries: torch.Tensor) -> torch.Tensor:
        """Rows of ``records`` holding entry ids ``entries`` (any shape; -1 stays -1)."""


class RecordBuffer:
    """``EntryRecords`` in memory: rows appended with amortised doubling, so an append costs O(new rows)."""

    def __init__(self, fmt: str, dim: int, device: torch.device | str = "cpu"):
        self.fmt, self.dim = fmt, dim
        self.data = torch.empty(0, record_bytes(fmt, dim), dtype=torch.uint8, device=device)
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        needed = self.length + x.shape[0]
        if needed > self.data.shape[0]:
            grown = self.data.new_empty(max(needed, 2 * self.data.shape[0], 16), self.data.shape[1])
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        ops.cache_write(self.data, torch.arange(self.length, needed, device=x.device), x, self.fmt)
        self.length = needed

    @property
    def records(self) -> torch.Tensor:
        return self.data

    def slots(self, entries: torch.Tensor) -> torch.Tensor:
        return entries

    def truncate(self, length: int) -> None:
        """Forget entries >= length (``CompressedKV.rollback``)."""
        self.length = min(self.length, length)


class RollbackError(ValueError):
    """A cache was asked to forget more tokens than it keeps the state for."""


class WindowRing:
    """The latents of the last ``size`` positions of one layer: slot = position % size.

    ``rows`` uint8 [size, record bytes] hold the byte records of cache format ``fmt``, written by
    ``ops.cache_write``. Which position each slot holds (-1: none) is kept on the host, where every position
    comes from, so that checking a read never waits for the device."""

    def __init__(self, rows: torch.Tensor, name: str, fmt: str):
        self.rows, self.size, self.name, self.fmt = rows, rows.shape[0], name, fmt
        self.positions = torch.full((self.size,), -1, dtype=torch.long)

    def slots(self, first: int, end: int) -> torch.Tensor:
        """Slots of positions [first, end) on the rows' device, checked to hold them."""
        positions = torch.arange(first, end)
        if bool((self.positions[positions % self.size] != positions).any()):
            raise RuntimeError(f"{self.name}: window cache does not hold positions {first}..{end - 1}")
        return torch.arange(first, end, device=self.rows.device) % self.size

    def read(self, first: int, end: int) -> torch.Tensor:
        """Records of positions [first, end) -> [end - first, record bytes]."""
        return self.rows[self.slots(first, end)]

    def write(self, latents: torch.Tensor, start_pos: int) -> None:
        """Store latents [n, dim] of positions start_pos.. as records; only the last ``size`` are kept."""
        keep = min(latents.shape[0], self.size)
        first, end = start_pos + latents.shape[0] - keep, start_pos + latents.shape[0]
        ops.cache_write(self.rows, torch.arange(first, end, device=self.rows.device) % self.size, latents[-keep:],
                        self.fmt)
        positions = torch.arange(first, end)
        self.positions[positions % self.size] = positions

    def rollback(self, num_tokens: int) -> None:
        """Forget positions >= num_tokens."""
        self.positions.masked_fill_(self.positions >= num_tokens, -1)


@dataclass
class CompressedKV:
    """Shared compressed state of one KV-source layer: entries j cover tokens [j*ratio, (j+1)*ratio)."""

    ratio: int
    latents: EntryRecords  # nvfp4 records of the entries, rotated at position j*ratio
    index_keys: EntryRecords  # mxfp4 records of their indexer keys, rotated
    pending_values: torch.Tensor  # [tokens of the open group, head_dim] fp32 compressor inputs
    pending_gates: torch.Tensor
    keep_inputs: int = 0  # per-token compressor inputs kept for rollback (ratio > 1 only)
    recent_values: torch.Tensor | None = None  # [<= keep_inputs, head_dim] inputs of the last covered tokens
    recent_gates: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return self.latents.length

    @property
    def num_tokens(self) -> int:
        """Tokens this state covers: complete groups plus the open group."""
        return self.num_entries * self.ratio + self.pending_values.shape[0]

    def remember_inputs(self, values: torch.Tensor, gates: torch.Tensor) -> None:
        """Keep the per-token compressor inputs of the last ``keep_inputs`` tokens (called before they are pooled)."""
        if not self.keep_inputs:
            return
        if self.recent_values is None:
            self.recent_values, self.recent_gates = values[:0], gates[:0]
        self.recent_values = torch.cat((self.recent_values, values))[-self.keep_inputs:]
        self.recent_gates = torch.cat((self.recent_gates, gates))[-self.keep_inputs:]

    def rollback(self, num_tokens: int) -> None:
        """Cover only tokens [0, num_tokens): drop later entries, rebuild the open group from the kept inputs."""
        covered = self.num_tokens
        if num_tokens == covered:
            return
        entries = num_tokens // self.ratio
        open_start = entries * self.ratio
        kept = 0 if self.recent_values is None else self.recent_values.shape[0]
        tail_start = covered - kept  # first token whose inputs are kept
        if num_tokens > open_start and open_start < tail_start:
            raise RollbackError(f"compressed state (ratio {self.ratio}) covers {covered} tokens but keeps the "
                                f"inputs of the last {kept} only; cannot roll back to {num_tokens}")
        self.latents.truncate(entries)
        self.index_keys.truncate(entries)
        if self.recent_values is None:
            self.pending_values, self.pending_gates = self.pending_values[:0], self.pending_gates[:0]
            return
        self.pending_values = self.recent_values[max(open_start - tail_start, 0): num_tokens - tail_start]
        self.pending_gates = self.recent_gates[max(open_start - tail_start, 0): num_tokens - tail_start]
        self.recent_values = self.recent_values[: max(num_tokens - tail_start, 0)]
        self.recent_gates = self.recent_gates[: max(num_tokens - tail_start, 0)]


class SequenceCache(SequenceState):
    """In-memory state of one sequence (the reference for every engine adapter).

    ``max_rollback``: how many of its last tokens ``rollback`` may forget (0 for plain decoding; the speculative
    loop uses the block size, since a verify forward runs at most that many tokens past the anchor).
    """

    def __init__(self, args: ModelArgs, device: torch.device | str = "cpu", max_rollback: int = 0):
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self.args = args
        self.window = args.sliding_window
        self.max_rollback = max_rollback
        self.num_tokens = 0
        ring_shape = (self.window + max_rollback, record_bytes(WINDOW_FORMAT, args.head_dim))
        self.rings = {i: WindowRing(torch.zeros(ring_shape, dtype=torch.uint8, device=device), f"layer {i}",
                                    WINDOW_FORMAT)
                      for i in range(args.num_hidden_layers)}
        self.sources = {
            s: CompressedKV(
                ratio=args.layer_ratios[s],
                latents=RecordBuffer(COMPRESSED_FORMAT, args.head_dim, device),
                index_keys=RecordBuffer(INDEX_KEY_FORMAT, args.index_head_dim, device),
                pending_values=torch.zeros(0, args.head_dim, device=device),
                pending_gates=torch.zeros(0, args.head_dim, device=device),
                keep_inputs=max_rollback + args.layer_ratios[s] - 1 if max_rollback and args.layer_ratios[s] > 1 else 0,
            )
            for s in args.kv_source_layer_ids
        }
        self.ngram_context = args.engram_max_ngram_size - 1
        self.history: list[int] = []  # the last ngram_context + max_rollback token ids

    def window_records(self, layer: int, latents: torch.Tensor, start_pos: int,
                       first: int) -> tuple[torch.Tensor, torch.Tensor]:
        ring, end = self.rings[layer], start_pos + latents.shape[0]
        context = ring.slots(first, start_pos)
        if end - first <= ring.size:  # every position keeps its own slot: attend straight from the ring
            ring.write(latents, start_pos)
            return ring.rows, torch.cat((context, torch.arange(start_pos, end, device=context.device) % ring.size))
        records = torch.cat((ring.rows[context], ops.pack_cache_records(latents, WINDOW_FORMAT)))
        ring.write(latents, start_pos)  # a chunk longer than the ring overwrites rows its own queries still need
        return records, torch.arange(end - first, device=records.device)

    def compressed(self, source_layer: int) -> CompressedKV:
        return self.sources[source_layer]

    def ngram_history(self) -> list[int]:
        return self.history[-self.ngram_context:] if self.ngram_context else []

    def advance(self, token_ids: torch.Tensor) -> None:
        keep = self.ngram_context + self.max_rollback
        self.history = (self.history + token_ids.tolist())[-keep:] if keep else []
        self.num_tokens += token_ids.numel()

    def rollback(self, num_tokens: int) -> None:
        """Forget every token at position >= num_tokens, as if only tokens [0, num_tokens) had been run.

        Exact: decoding after a rollback gives the same logits as never having run the dropped tokens. At most
        ``max_rollback`` tokens can be dropped (RollbackError otherwise).
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise RollbackError(f"rollback to {num_tokens} tokens: the cache holds {self.num_tokens}")
        dropped = self.num_tokens - num_tokens
        if dropped > self.max_rollback:
            raise RollbackError(f"rollback of {dropped} tokens ({self.num_tokens} -> {num_tokens}) exceeds this "
                                f"cache's max_rollback={self.max_rollback}; build it with a larger max_rollback")
        if not dropped:
            return
        for ring in self.rings.values():
            ring.rollback(num_tokens)
        for state in self.sources.values():
            state.rollback(num_tokens)
        self.history = self.history[: len(self.history) - dropped]
        self.num_tokens = num_tokens


@dataclass
class EntryCount:
    """A sequence's compressed state where an engine's ``BatchStore`` reads and writes the records: all the model
    needs of it is how many entries it holds (``BatchStore.publish_entries`` counts the new ones)."""

    num_entries: int


@dataclass
class SequenceChunk:
    """One sequence's rows in a flattened batch.

    Rows [row_start, row_start + num_rows) of the batch hold positions start_pos.. of this sequence. During
    bounded replay a layer needs outputs only for the last ``num_query_rows`` rows; the earlier ones still
    provide keys (see model.py).
    """

    row_start: int
    num_rows: int
    start_pos: int
    state: SequenceState
    num_query_rows: int = -1
    published: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_query_rows < 0:
            self.num_query_rows = self.num_rows

    @property
    def first_query_pos(self) -> int:
        return self.start_pos + self.num_rows - self.num_query_rows


def key_positions(chunks: list[SequenceChunk], device: torch.device | str) -> torch.Tensor:
    """Positions of every key row of ``chunks`` [sum num_rows], in one copy to the device."""
    return to_device(torch.cat([torch.arange(c.start_pos, c.start_pos + c.num_rows) for c in chunks]), device)


def oldest_window_key(chunk: SequenceChunk, window: int) -> int:
    """The oldest position whose window key some query row of ``chunk`` reads."""
    return min(chunk.start_pos, max(0, chunk.first_query_pos - window + 1))


def window_positions(query_pos: torch.Tensor, chunks: list[SequenceChunk], window: int) -> torch.Tensor:
    """Each query row's window positions [query rows, span], its own last, negative before its sequence starts;
    span is the most window keys any query row of ``chunks`` reads."""
    span = max(min(window, c.start_pos + c.num_rows - oldest_window_key(c, window)) for c in chunks)
    return query_pos[:, None] - span + 1 + torch.arange(span, device=query_pos.device)


def ranges_rows(ranges: list[tuple[int, int, int]]) -> torch.Tensor:
    """int64 [2, n] on the host: (owner, position) of every position of the ranges (owner, low, high), in order;
    engines copy it to the device once and compute all the slots of a batch from it."""
    pieces = [torch.stack((torch.full((high - low,), owner), torch.arange(low, high))) for owner, low, high in ranges]
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(2, 0, dtype=torch.long)
