"""V4.1's caches in vLLM's paged memory, behind the core model's ``SequenceState`` interface.

vLLM allocates one paged tensor per cache owner and hands each step a block table per cache group. Two kinds
of owners (registered in ``static_forward_context`` so the runner finds them):
  * one window cache per layer (sliding-window spec: blocks that leave the window are reused), a row per
    token: [latent (head_dim), token id, position, padding]. The stored position lets every read check that the
    slot holds the token it should; the token ids give Engram its n-gram history;
  * one compressed cache per KV-source layer (``tokens_per_state = ratio``), a row per group of ``ratio``
    tokens: [NVFP4 latent (head_dim), MXFP4 index key (index_head_dim), compressor inputs (wkv, wgate) of the
    group's first ratio - 1 tokens]. Those inputs are written as each token is processed, so a request can
    resume at any position (prefix-cache hit, chunked prefill, recompute after preemption, or a speculative
    step whose last tokens were rejected) and rebuild its open group from vLLM's memory alone.
Rows are padded so every page is a whole multiple of the window page; vLLM can then put all caches in one
pool. Values are stored dequantised in float32 (the reference precision, and exact for token ids and
positions); the packed byte records of the GPU kernels are the kernel backends' business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from ..models.deepseek_v41.args import ModelArgs

WINDOW_EXTRA = 16  # token id, position, padding


def window_width(args: ModelArgs) -> int:
    return args.head_dim + WINDOW_EXTRA


def compressed_width(args: ModelArgs, ratio: int) -> int:
    """Row width of a compressed cache: an entry plus its group's inputs, padded so page = k * window page."""
    needed = args.head_dim + args.index_head_dim + 2 * (ratio - 1) * args.head_dim
    unit = ratio * window_width(args)
    return unit * math.ceil(needed / unit)


@dataclass
class PagedMetadata:
    block_table: torch.Tensor  # [requests, blocks]
    query_start_loc: list[int]
    seq_lens: list[int]
    num_actual_tokens: int


class DeepInferMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> PagedMetadata:
        cm = common_attn_metadata
        return PagedMetadata(
            block_table=cm.block_table_tensor.cpu(),
            query_start_loc=cm.query_start_loc_cpu.tolist(),
            seq_lens=cm.seq_lens.cpu().tolist(),
            num_actual_tokens=cm.num_actual_tokens,
        )


class DeepInferCacheBackend(AttentionBackend):
    """Metadata-only backend: the attention math runs in the core model, not in a vLLM AttentionImpl."""

    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "DEEPINFER_V41"

    @staticmethod
    def get_builder_cls():
        return DeepInferMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise RuntimeError("DEEPINFER_V41 layers compute attention in the core model; vLLM never needs an impl")


class CacheOwner(nn.Module, AttentionLayerBase):
    """Owns one paged cache; found by vLLM's runner through ``static_forward_context[name]``."""

    def __init__(self, name: str, spec, vllm_config):
        nn.Module.__init__(self)
        self.layer_name, self.spec, self.width = name, spec, spec.head_size
        self.kv_cache = torch.empty(0)
        context = vllm_config.compilation_config.static_forward_context
        if name in context:
            raise ValueError(f"duplicate cache layer name {name!r}")
        context[name] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return DeepInferCacheBackend

    def get_kv_cache_spec(self, vllm_config):
        return self.spec

    def bind_kv_cache(self, kv_cache) -> None:
        tensor = kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache
        self.kv_cache = tensor

    def rows(self) -> torch.Tensor:
        """The cache as [slots, width]; a view, so writes land in vLLM's memory."""
        return self.kv_cache.view(-1, self.width)

    @property
    def rows_per_block(self) -> int:
        """Rows (tokens, or compressed states) per block of the bound tensor. vLLM may scale a group's block
        size when it unifies page sizes, so this comes from the tensor, not from the cache config."""
        return self.kv_cache.shape[-2]


CACHE_DTYPE = torch.float32


def make_cache_owners(args: ModelArgs, vllm_config, prefix: str):
    block_size, dtype = vllm_config.cache_config.block_size, CACHE_DTYPE
    windows = nn.ModuleList(
        CacheOwner(f"{prefix}layers.{i}.window_cache",
                   SlidingWindowMLASpec(block_size=block_size, num_kv_heads=1, head_size=window_width(args),
                                        dtype=dtype, sliding_window=args.sliding_window), vllm_config)
        for i in range(args.num_hidden_layers))
    compressed = nn.ModuleDict({
        str(s): CacheOwner(f"{prefix}layers.{s}.compressed_cache",
                           MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                            head_size=compressed_width(args, args.layer_ratios[s]), dtype=dtype,
                                            tokens_per_state=args.layer_ratios[s]), vllm_config)
        for s in args.kv_source_layer_ids})
    return windows, compressed


class PagedRows:
    """The ``GrowingBuffer`` face of one column range of a compressed cache (entries 0..count-1)."""

    def __init__(self, compressed: "PagedCompressedKV", lo: int, hi: int):
        self.compressed, self.lo, self.hi, self.length = compressed, lo, hi, compressed.first_entries

    @property
    def rows(self) -> torch.Tensor:
        slots = self.compressed.slots(torch.arange(self.length))
        return self.compressed.table[slots, self.lo:self.hi]

    def append(self, rows: torch.Tensor) -> None:
        slots = self.compressed.slots(torch.arange(self.length, self.length + rows.shape[0]))
        self.compressed.table[slots, self.lo:self.hi] = rows.to(self.compressed.table.dtype)
        self.length += rows.shape[0]


class PagedCompressedKV:
    """``CompressedKV`` over a paged compressed cache for one request and one forward chunk."""

    def __init__(self, owner: CacheOwner, block_row: torch.Tensor, ratio: int, args: ModelArgs, start_pos: int,
                 end_pos: int):
        self.table, self.block_row, self.ratio = owner.rows(), block_row, ratio
        self.states_per_block = owner.rows_per_block
        self.head_dim = args.head_dim
        self.start_pos, self.end_pos = start_pos, end_pos
        self.first_entries, self.open_tokens = divmod(start_pos, ratio)
        self.latents = PagedRows(self, 0, args.head_dim)
        self.index_keys = PagedRows(self, args.head_dim, args.head_dim + args.index_head_dim)
        self.values_at = args.head_dim + args.index_head_dim
        self.gates_at = self.values_at + (ratio - 1) * args.head_dim

    def slots(self, groups: torch.Tensor) -> torch.Tensor:
        blocks = self.block_row[groups // self.states_per_block].long()
        return blocks * self.states_per_block + groups % self.states_per_block

    @property
    def num_entries(self) -> int:
        return self.latents.length

    def remember_inputs(self, values: torch.Tensor, gates: torch.Tensor) -> None:
        """Store the compressor inputs of every token that opens or continues a group (all but each group's
        last token) in its group's row, at ``(position % ratio) * head_dim``."""
        positions = torch.arange(self.start_pos, self.end_pos)
        keep = positions % self.ratio < self.ratio - 1
        slots = self.slots(positions[keep] // self.ratio)
        offsets = (positions[keep] % self.ratio) * self.head_dim
        for offset in offsets.unique().tolist():
            rows = keep.nonzero().flatten()[offsets == offset]
            at = slots[offsets == offset]
            self.table[at, self.values_at + offset: self.values_at + offset + self.head_dim] = values[rows].to(
                self.table.dtype)
            self.table[at, self.gates_at + offset: self.gates_at + offset + self.head_dim] = gates[rows].to(
                self.table.dtype)

    def _open_group(self, at: int) -> torch.Tensor:
        if self.open_tokens == 0:
            return torch.zeros(0, self.head_dim)
        row = self.table[self.slots(torch.tensor([self.first_entries]))[0]]
        return row[at: at + self.open_tokens * self.head_dim].float().view(self.open_tokens, self.head_dim)

    def _check_open(self, inputs: torch.Tensor) -> None:
        """The compressor hands back the open group's inputs; ``remember_inputs`` already stored them."""
        if inputs.shape[0] != self.end_pos % self.ratio:
            raise RuntimeError(f"compressor left {inputs.shape[0]} open tokens, expected {self.end_pos % self.ratio}")

    @property
    def pending_values(self) -> torch.Tensor:
        return self._open_group(self.values_at)

    @pending_values.setter
    def pending_values(self, values: torch.Tensor) -> None:
        self._check_open(values)

    @property
    def pending_gates(self) -> torch.Tensor:
        return self._open_group(self.gates_at)

    @pending_gates.setter
    def pending_gates(self, gates: torch.Tensor) -> None:
        self._check_open(gates)


class PagedSequenceState:
    """``SequenceState`` of one request in one vLLM step, reading and writing vLLM's paged caches.

    Every cache owner has its own block table: vLLM may put the window caches of different layers in different
    cache groups that share physical tensors, so a layer's rows are only found through its own table."""

    def __init__(self, args: ModelArgs, request: int, start_pos: int, token_ids: torch.Tensor,
                 windows: nn.ModuleList, compressed: nn.ModuleDict, metadata: dict):
        self.args, self.num_tokens, self.token_ids = args, start_pos, token_ids
        self.windows = windows
        self.window_rows = [metadata[owner.layer_name].block_table[request] for owner in windows]
        end_pos = start_pos + token_ids.numel()
        self.sources = {
            int(s): PagedCompressedKV(owner, metadata[owner.layer_name].block_table[request],
                                      args.layer_ratios[int(s)], args, start_pos, end_pos)
            for s, owner in compressed.items()
        }

    def _window_slots(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        row, per_block = self.window_rows[layer], self.windows[layer].rows_per_block
        return row[positions // per_block].long() * per_block + positions % per_block

    def window_context(self, layer: int, first: int, end: int) -> torch.Tensor:
        positions = torch.arange(first, end)
        rows = self.windows[layer].rows()[self._window_slots(layer, positions)]
        stored = rows[:, self.args.head_dim + 1].long()
        if not torch.equal(stored, positions):
            raise RuntimeError(f"layer {layer}: paged window cache does not hold positions {first}..{end - 1}")
        return rows[:, : self.args.head_dim]

    def write_window(self, layer: int, latents: torch.Tensor, start_pos: int) -> None:
        n, d = latents.shape[0], self.args.head_dim
        positions = torch.arange(start_pos, start_pos + n)
        table = self.windows[layer].rows()
        slots = self._window_slots(layer, positions)
        table[slots, :d] = latents.to(table.dtype)
        table[slots, d] = self.token_ids[-n:].to(table.dtype)
        table[slots, d + 1] = positions.to(table.dtype)

    def compressed(self, source_layer: int) -> PagedCompressedKV:
        return self.sources[source_layer]

    def ngram_history(self) -> list[int]:
        keep = self.args.engram_max_ngram_size - 1
        first = max(0, self.num_tokens - keep)
        if first == self.num_tokens:
            return []
        rows = self.windows[0].rows()[self._window_slots(0, torch.arange(first, self.num_tokens))]
        return rows[:, self.args.head_dim].long().tolist()

    def advance(self, token_ids: torch.Tensor) -> None:
        """Nothing to do: every piece of state was written into vLLM's pages during the forward."""


# ---- DSpark draft context (deepinfer_plugins/vllm/spec_decode.py) ---------------------------------------------------
DSPARK_POSITION_COLUMNS = 1  # the stored position, checked on every read


def dspark_feature_layout(args: ModelArgs, block_size: int) -> tuple[int, int]:
    """(row width, block size) of the DSpark context cache: one row per token holding every draft stage's context
    key of that position ([num_stages * head_dim], see ``PagedDraftContext``) and the position.

    The page must stay a whole multiple of, or a divisor of, every other cache's page so vLLM can put all caches in
    one pool. Pages of the other caches are ``block_size * f * window_width`` for f = 1 (window) and
    f = compressed_width / (ratio * window_width) (compressed). The row is padded to a power-of-two number of window
    widths; when that exceeds the largest f, the block holds proportionally fewer tokens so the page equals the
    largest page and no other group has to grow its blocks (prefix-cache granularity stays as it was)."""
    unit = window_width(args)
    needed = args.num_nextn_predict_layers * args.head_dim + DSPARK_POSITION_COLUMNS
    factor = 1 << max(0, math.ceil(needed / unit) - 1).bit_length()
    largest = max([1] + [compressed_width(args, r) // (r * unit) for r in set(args.layer_ratios) if r > 1])
    if factor <= largest:
        return largest * unit, block_size
    if (block_size * largest) % factor == 0:
        return factor * unit, block_size * largest // factor
    return factor * unit, block_size


def make_dspark_feature_owner(args: ModelArgs, vllm_config, prefix: str, num_speculative_tokens: int) -> CacheOwner:
    """The cache owner of the DSpark draft context. A sliding window of ``sliding_window + k + 1`` positions: a
    draft at anchor position p reads positions [p - sliding_window, p), and p is at most k + 1 past the position
    vLLM last freed blocks for. Named after the first draft layer id (names need exactly one integer)."""
    width, block = dspark_feature_layout(args, vllm_config.cache_config.block_size)
    spec = SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=width, dtype=CACHE_DTYPE,
                                sliding_window=args.sliding_window + num_speculative_tokens + 1)
    return CacheOwner(f"{prefix}layers.{args.num_hidden_layers}.dspark_context", spec, vllm_config)


class PagedDraftContext:
    """The ``DraftState`` face the drafter's attention reads (``num_tokens``, ``context_keys``) over the paged DSpark
    context cache of one request: keys of positions < anchor position, read from vLLM's memory, nothing kept."""

    def __init__(self, args: ModelArgs, owner: CacheOwner, block_row: torch.Tensor, anchor_pos: int):
        self.args, self.owner, self.block_row = args, owner, block_row
        self.num_tokens, self.window = anchor_pos, args.sliding_window
        first = max(0, anchor_pos - self.window)
        positions = torch.arange(first, anchor_pos)
        per_block = owner.rows_per_block
        slots = self.block_row[positions // per_block].long() * per_block + positions % per_block
        rows = owner.rows()[slots]
        stages, d = args.num_nextn_predict_layers, args.head_dim
        stored = rows[:, stages * d].long()
        if not torch.equal(stored, positions):
            raise RuntimeError(f"DSpark context cache does not hold positions {first}..{anchor_pos - 1} "
                               f"(found {stored.tolist()})")
        self.keys = rows[:, : stages * d].view(-1, stages, d)

    def context_keys(self, stage: int, end: int) -> torch.Tensor:
        if end != self.num_tokens:
            raise ValueError(f"draft context read up to {end}, built for anchor position {self.num_tokens}")
        return self.keys[:, stage]


def write_dspark_context(args: ModelArgs, owner: CacheOwner, block_row: torch.Tensor, keys: torch.Tensor,
                         start_pos: int) -> None:
    """Store keys [n, num_stages, head_dim] of positions start_pos.. of one request (and the positions)."""
    n, stages, d = keys.shape
    positions = torch.arange(start_pos, start_pos + n)
    per_block = owner.rows_per_block
    slots = block_row[positions // per_block].long() * per_block + positions % per_block
    table = owner.rows()
    table[slots, : stages * d] = keys.reshape(n, stages * d).to(table.dtype)
    table[slots, stages * d] = positions.to(table.dtype)
