"""Per-sequence decoding state of V4.1, and the batch layout the model runs on.

A sequence owns four kinds of state (spec §5, §7):
  * a window ring per layer: the last ``sliding_window`` FP8-quantised latents (K = V) with their positions;
  * per KV-source layer, the shared compressed KV (NVFP4 latents) and its indexer keys (MXFP4), which grow by
    one entry per ``ratio`` tokens, plus the compressor inputs of a not yet complete group;
  * the last ``engram_max_ngram_size - 1`` token ids for Engram's n-gram hashes.
Engines keep the same state in their own paged memory; they implement the ``SequenceState`` methods over it
(see deepinfer_plugins/vllm), so the model code is identical in both places.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .args import ModelArgs


class SequenceState(Protocol):
    """The cache interface the layers use. ``SequenceCache`` is the in-memory reference implementation."""

    num_tokens: int

    def window_context(self, layer: int, first: int, end: int) -> torch.Tensor:
        """This layer's cached window latents of positions [first, end) -> [end - first, head_dim]."""

    def write_window(self, layer: int, latents: torch.Tensor, start_pos: int) -> None:
        """Store the latents of positions start_pos.. (only the last ``sliding_window`` matter)."""

    def compressed(self, source_layer: int) -> "CompressedKV":
        """The shared compressed state published by KV-source layer ``source_layer``."""

    def ngram_history(self) -> list[int]:
        """Up to engram_max_ngram_size - 1 token ids preceding the next forward, oldest first."""

    def advance(self, token_ids: torch.Tensor) -> None:
        """Account for ``token_ids`` having been run (called once per forward, after every layer)."""


class GrowingBuffer:
    """Rows appended with amortised doubling, so an append costs O(new rows), not O(cache)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.data = torch.empty(0, width, dtype=dtype, device=device)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        needed = self.length + rows.shape[0]
        if needed > self.data.shape[0]:
            grown = torch.empty(max(needed, 2 * self.data.shape[0], 16), self.data.shape[1],
                                dtype=self.data.dtype, device=self.data.device)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length:needed] = rows
        self.length = needed

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def rows(self) -> torch.Tensor:
        return self.data[: self.length]


@dataclass
class CompressedKV:
    """Shared compressed state of one KV-source layer: entries j cover tokens [j*ratio, (j+1)*ratio)."""

    ratio: int
    latents: GrowingBuffer  # [N, head_dim] NVFP4-quantised, rotated at position j*ratio
    index_keys: GrowingBuffer  # [N, index_head_dim] MXFP4-quantised, rotated
    pending_values: torch.Tensor  # [tokens of the open group, head_dim] fp32 compressor inputs
    pending_gates: torch.Tensor

    @property
    def num_entries(self) -> int:
        return self.latents.length


class SequenceCache(SequenceState):
    """In-memory state of one sequence (the reference for every engine adapter)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.args = args
        self.window = args.sliding_window
        self.num_tokens = 0
        self.rings = {i: torch.zeros(self.window, args.head_dim, dtype=dtype, device=device)
                      for i in range(args.num_hidden_layers)}
        self.ring_positions = {i: torch.full((self.window,), -1, dtype=torch.long, device=device)
                               for i in range(args.num_hidden_layers)}
        self.sources = {
            s: CompressedKV(
                ratio=args.layer_ratios[s],
                latents=GrowingBuffer(args.head_dim, dtype, device),
                index_keys=GrowingBuffer(args.index_head_dim, dtype, device),
                pending_values=torch.zeros(0, args.head_dim, device=device),
                pending_gates=torch.zeros(0, args.head_dim, device=device),
            )
            for s in args.kv_source_layer_ids
        }
        self.history: list[int] = []

    def window_context(self, layer: int, first: int, end: int) -> torch.Tensor:
        positions = torch.arange(first, end, device=self.ring_positions[layer].device)
        slots = positions % self.window
        if bool((self.ring_positions[layer][slots] != positions).any()):
            raise RuntimeError(f"layer {layer}: window cache does not hold positions {first}..{end - 1}")
        return self.rings[layer][slots]

    def write_window(self, layer: int, latents: torch.Tensor, start_pos: int) -> None:
        keep = min(latents.shape[0], self.window)
        positions = torch.arange(start_pos + latents.shape[0] - keep, start_pos + latents.shape[0],
                                 device=latents.device)
        slots = positions % self.window
        self.rings[layer][slots] = latents[-keep:].to(self.rings[layer].dtype)
        self.ring_positions[layer][slots] = positions

    def compressed(self, source_layer: int) -> CompressedKV:
        return self.sources[source_layer]

    def ngram_history(self) -> list[int]:
        return self.history

    def advance(self, token_ids: torch.Tensor) -> None:
        keep = self.args.engram_max_ngram_size - 1
        self.history = (self.history + token_ids.tolist())[-keep:] if keep else []
        self.num_tokens += token_ids.numel()


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
