"""V4.1's caches in vLLM's paged memory, behind the core model's ``SequenceState`` interface.

vLLM allocates one paged tensor per cache owner and hands each step a block table per cache group. Three kinds
of owners (registered in ``static_forward_context`` so the runner finds them), all byte tables (uint8 rows):
  * one window cache per layer (sliding-window spec: blocks that leave the window are reused), a row per
    token: [fp8_window record (528 B at head_dim 512), int32 token id, int32 position]. The stored position
    lets every read check that the slot holds the token it should; the token ids give Engram its n-gram history;
  * one compressed cache per compression ratio (``tokens_per_state = ratio``), a row per group of ``ratio``
    tokens holding every KV source of that ratio: [nvfp4 entry record (288 B) of each source, then the mxfp4
    index-key record (68 B) of each source]. Sources of one ratio close their groups at the same positions, so
    they share rows; packing them fills the padding the page rule below would leave in a row per source;
  * one compressor-input cache per KV-source layer with ratio > 1 (sliding window of ``ratio`` tokens), a row
    per token: [fp32 wkv(x), fp32 wgate(x), int32 position]. A group is pooled once its last token arrives, so
    only the inputs of the open group are ever read; they are written as each token is processed, so a request
    can resume at any position (prefix-cache hit, chunked prefill, recompute after preemption, or a speculative
    step whose last tokens were rejected) and rebuild its open group from vLLM's memory alone, and the window
    keeps that state bounded per request instead of growing with the sequence.
The records are the byte images of ops/cache.py, written by ``ops.cache_write`` and read by the attention kernel as
stored (``ops.sparse_attention_records`` takes the row-strided record columns of these tables), so a token costs
what docs/model.md#cache-records budgets instead of float copies. Every owner's page is the window page (row widths
are power-of-two multiples of the window row, blocks hold proportionally fewer or more tokens), so vLLM puts all
caches in one pool without growing any group's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from .. import ops
from ..models.deepseek_v41.args import ModelArgs
from ..models.deepseek_v41.kv_cache import (COMPRESSED_FORMAT, INDEX_KEY_FORMAT, WINDOW_FORMAT, EntryCount,
                                            SequenceChunk, oldest_window_key, ranges_rows, window_positions)
from ..ops.cache import record_bytes, to_device

CACHE_DTYPE = torch.uint8
ROW_ALIGN = 16  # bytes: rows start 16-byte aligned (vectorised and cp.async loads of records)
INT32 = 4


def window_meta_at(args: ModelArgs) -> int:
    """Byte offset of a window row's int32 [token id, position]: after the record, 4-byte aligned."""
    return INT32 * math.ceil(record_bytes(WINDOW_FORMAT, args.head_dim) / INT32)


def window_width(args: ModelArgs) -> int:
    """Bytes of a window row: the fp8_window record, then the token id and the position (int32 each)."""
    return ROW_ALIGN * math.ceil((window_meta_at(args) + 2 * INT32) / ROW_ALIGN)


def paged_layout(args: ModelArgs, needed: int, tokens_per_row: int, block_size: int) -> tuple[int, int]:
    """(row bytes, block size in tokens) of an owner whose rows cover ``tokens_per_row`` tokens and need
    ``needed`` bytes: the row is window_width * tokens_per_row * 2^j for the least j that fits, and the block
    holds 2^-j as many tokens, so the page equals the window page. Where the block cannot be divided that far
    (a block must hold whole rows) it keeps ``block_size`` and vLLM grows the other groups' blocks to match."""
    unit = window_width(args) * tokens_per_row  # a multiple of ROW_ALIGN, so scale 1 always keeps rows aligned
    scale = 2.0 ** math.ceil(math.log2(needed / unit))
    while (unit * scale) % ROW_ALIGN:  # a scale below 1 that leaves rows unaligned
        scale *= 2
    width = int(unit * scale)
    block = block_size / scale
    if block != int(block) or int(block) % tokens_per_row:
        return width, block_size
    return width, int(block)


def compressed_layout(args: ModelArgs, ratio: int, num_sources: int, block_size: int) -> tuple[int, int]:
    needed = num_sources * (record_bytes(COMPRESSED_FORMAT, args.head_dim)
                            + record_bytes(INDEX_KEY_FORMAT, args.index_head_dim))
    return paged_layout(args, needed, ratio, block_size)


def inputs_layout(args: ModelArgs, block_size: int) -> tuple[int, int]:
    return paged_layout(args, 2 * args.head_dim * 4 + INT32, 1, block_size)


@dataclass
class PagedMetadata:
    block_table: torch.Tensor  # [requests, blocks] on the caches' device: slots are computed there
    query_start_loc: list[int]
    seq_lens: list[int]
    num_actual_tokens: int
    forward: object = None  # compiled.PagedForward of this step, set by the model before its body runs


class StoredPositions:
    """The positions a step's paged reads should find, compared once when the step ends.

    Every cache row keeps the position it was written for, and every read checks it: a wrong block table or a
    block freed too early would otherwise be a silently wrong answer. Comparing on the host after each read would
    make a GPU wait once per request and layer, so the reads of a step are gathered here (on the device) and
    ``verify`` compares them all with one copy to the host, before the step's output is used."""

    def __init__(self):
        self.found: list[torch.Tensor] = []
        self.expected: list[torch.Tensor] = []
        self.what: list[str] = []

    def expect(self, found: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        """``found`` [n] (stored positions on the device, any integer dtype) should equal ``expected`` [n]
        (on the host)."""
        if found.numel():
            self.found.append(found.reshape(-1).long())
            self.expected.append(expected.reshape(-1).long())
            self.what.append(what)

    def verify(self) -> None:
        """Raise RuntimeError naming the first read that found another position; then start a new step."""
        if not self.found:
            return
        found, expected = torch.cat(self.found), torch.cat(self.expected)
        sizes, what = [e.numel() for e in self.expected], self.what
        self.found, self.expected, self.what = [], [], []
        wrong = found != expected.to(found.device)
        any_wrong, at = torch.stack((wrong.any().long(), wrong.long().argmax())).tolist()
        if not any_wrong:
            return
        start = 0
        for read, size in zip(what, sizes):
            if at < start + size:
                raise RuntimeError(f"{read} does not hold position {int(expected[at])} (found {int(found[at])})")
            start += size


class DeepInferMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> PagedMetadata:
        cm = common_attn_metadata
        return PagedMetadata(
            block_table=cm.block_table_tensor,
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

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Our pages hold one head and no K/V pair, so every layout is the same bytes (``rows()`` views them flat);
        vLLM lets KV connectors (NIXL, LMCache) move caches whose rows stand for several tokens only under a
        block-outermost layout, so that is what we declare (docs/multi_replica.md)."""
        return (KVCacheLayout.BLHNC, KVCacheLayout.BLNHC)

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
        """The cache as uint8 [slots, width]; a view, so writes land in vLLM's memory."""
        return self.kv_cache.view(-1, self.width)

    @property
    def rows_per_block(self) -> int:
        """Rows (tokens, or compressed states) per block of the bound tensor. vLLM may scale a group's block
        size when it unifies page sizes, so this comes from the tensor, not from the cache config."""
        return self.kv_cache.shape[-2]

    def slots(self, block_row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Slots of a request's rows (token positions, or compressed states) through its block table row."""
        per_block = self.rows_per_block
        return block_row[rows // per_block].long() * per_block + rows % per_block

    def batch_slots(self, block_table: torch.Tensor, requests: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Slots of rows of several requests at once: row rows[i] of request requests[i] (same shapes). Tables
        stacked along leading dims ([..., requests, blocks]) give the slots through each of them."""
        per_block = self.rows_per_block
        return block_table[..., requests, rows // per_block].long() * per_block + rows % per_block


class CompressedOwner(CacheOwner):
    """The compressed cache of every KV source of one ratio: a source's records are columns of the shared rows."""

    def __init__(self, name: str, spec, vllm_config, args: ModelArgs, sources: list[int]):
        super().__init__(name, spec, vllm_config)
        self.sources = sources
        self.entry_bytes = record_bytes(COMPRESSED_FORMAT, args.head_dim)
        self.key_bytes = record_bytes(INDEX_KEY_FORMAT, args.index_head_dim)

    def entry_columns(self, source: int) -> torch.Tensor:
        """uint8 [rows, 288 at head_dim 512]: the nvfp4 entry records of ``source``."""
        at = self.sources.index(source) * self.entry_bytes
        return self.rows()[:, at: at + self.entry_bytes]

    def key_columns(self, source: int) -> torch.Tensor:
        """uint8 [rows, 68 at index_head_dim 128]: the mxfp4 index-key records of ``source``."""
        at = len(self.sources) * self.entry_bytes + self.sources.index(source) * self.key_bytes
        return self.rows()[:, at: at + self.key_bytes]


def make_cache_owners(args: ModelArgs, vllm_config, prefix: str):
    """-> (window owner per layer, compressed owner per ratio, compressor-input owner per ratio > 1 source)."""
    block_size = vllm_config.cache_config.block_size
    windows = nn.ModuleList(
        CacheOwner(f"{prefix}layers.{i}.window_cache",
                   SlidingWindowMLASpec(block_size=block_size, num_kv_heads=1, head_size=window_width(args),
                                        dtype=CACHE_DTYPE, sliding_window=args.sliding_window), vllm_config)
        for i in range(args.num_hidden_layers))
    compressed, inputs = nn.ModuleDict(), nn.ModuleDict()
    for ratio in sorted({args.layer_ratios[s] for s in args.kv_source_layer_ids}):
        sources = [s for s in args.kv_source_layer_ids if args.layer_ratios[s] == ratio]
        width, block = compressed_layout(args, ratio, len(sources), block_size)
        compressed[str(ratio)] = CompressedOwner(
            f"{prefix}layers.{sources[0]}.compressed_cache",  # vLLM wants one layer index in a cache's name
            MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=width, dtype=CACHE_DTYPE,
                             tokens_per_state=ratio), vllm_config, args, sources)
    for s in args.kv_source_layer_ids:
        ratio = args.layer_ratios[s]
        if ratio > 1:
            width, block = inputs_layout(args, block_size)
            inputs[str(s)] = CacheOwner(
                f"{prefix}layers.{s}.compressor_inputs",
                SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=width, dtype=CACHE_DTYPE,
                                     sliding_window=ratio), vllm_config)
    return windows, compressed, inputs


@dataclass
class WindowPlan:
    """Where one step's window keys are written, checked and read, through one block table (so for every
    layer of its cache group)."""

    new: torch.Tensor  # [key rows] slot of every new key row
    new_meta: torch.Tensor  # int32 [key rows, 2]: its token id and position
    context: torch.Tensor  # [c] slots of the earlier positions the queries read
    context_positions: torch.Tensor  # [c] (host) the positions those slots must hold
    query: torch.Tensor  # [query rows, W] each query row's window slots, -1 = none


@dataclass
class WindowRows:
    """A step's window rows as (request, position) pairs on the device, the same for every block table: vLLM
    may give each window layer its own cache group, and only the slots differ between them."""

    new: torch.Tensor  # [2, key rows] (request, position) of every new key row
    new_meta: torch.Tensor  # int32 [key rows, 2]: its token id and position
    context: torch.Tensor  # [2, c] the earlier positions the queries read
    context_positions: torch.Tensor  # [c] (host) the same positions
    query_requests: torch.Tensor  # [query rows]
    wanted: torch.Tensor  # [query rows, W] each query row's window positions, negative before its sequence

    def plans(self, owner: CacheOwner, tables: list[torch.Tensor]) -> list[WindowPlan]:
        """One ``WindowPlan`` per block table (tables of equal shape, read by owners with ``owner``'s rows per
        block), from one pass over the tables stacked: a step computes its window slots once, not once per cache
        group."""
        stacked = torch.stack(tables)  # [tables, requests, blocks]
        requests = self.query_requests[:, None].expand_as(self.wanted)
        query = torch.where(self.wanted >= 0, owner.batch_slots(stacked, requests, self.wanted.clamp(min=0)), -1)
        new, context = owner.batch_slots(stacked, *self.new), owner.batch_slots(stacked, *self.context)
        return [WindowPlan(new=new[i], new_meta=self.new_meta, context=context[i],
                           context_positions=self.context_positions, query=query[i]) for i in range(len(tables))]


class PagedStep:
    """``BatchStore`` of one vLLM step: every request's window keys and compressed entries, a layer at a time.

    The window owners of one cache group share a block table, and vLLM often gives every window layer a group of
    its own, so a step's window slots (the new rows, the context rows to check, each query's window) are computed
    for every table in one pass over the tables stacked, from one copy of host-built positions: a layer then costs
    one position gather, one record write and one metadata write, whatever the number of requests. Compressed
    entries are looked up for all query rows and the index keys of every request at once, through the table of
    their ratio's owner. Every owner is read through its own block table: vLLM may put the window caches of
    different layers in different cache groups that share physical tensors."""

    def __init__(self, args: ModelArgs, windows: nn.ModuleList, compressed: nn.ModuleDict, inputs: nn.ModuleDict,
                 metadata: dict, audit: StoredPositions):
        self.window, self.windows, self.metadata, self.audit = args.sliding_window, windows, metadata, audit
        self.head_dim, self.ratios, self.inputs = args.head_dim, args.layer_ratios, inputs
        self.ngram_context = args.engram_max_ngram_size - 1
        self.compressed_owner = {s: owner for owner in compressed.values() for s in owner.sources}
        self.record_bytes, self.meta_at = record_bytes(WINDOW_FORMAT, args.head_dim), window_meta_at(args)
        self.plans: dict[tuple, WindowPlan] = {}
        self.window_rows: dict[tuple, WindowRows] = {}

    def columns(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8_window record columns, int32 [token id, position] columns) of a layer's window cache."""
        table = self.windows[layer].rows()
        return table[:, : self.record_bytes], table[:, self.meta_at: self.meta_at + 2 * INT32].view(torch.int32)

    def window_keys(self, layer: int, latents: torch.Tensor,
                    chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        records, meta = self.columns(layer)
        plan = self.plan(self.windows[layer], chunks)
        self.audit.expect(meta[plan.context, 1], plan.context_positions, f"layer {layer}: paged window cache")
        ops.cache_write(records, plan.new, latents, WINDOW_FORMAT)
        meta[plan.new] = plan.new_meta
        return records, plan.query

    def compressed_slots(self, source_layer: int, entries: torch.Tensor,
                         chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.compressed_owner[source_layer]
        table = self.metadata[owner.layer_name].block_table
        requests = self.rows(chunks, table.device).query_requests[:, None].expand_as(entries)
        slots = owner.batch_slots(table, requests, entries.clamp(min=0))
        return owner.entry_columns(source_layer), torch.where(entries >= 0, slots, -1)

    def compressor_inputs(self, source_layer: int, values: torch.Tensor, gates: torch.Tensor,
                          chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.inputs[str(source_layer)]
        table = self.metadata[owner.layer_name].block_table
        ratio = self.ratios[source_layer]
        host_new = ranges_rows([(c.state.request, c.start_pos, c.start_pos + c.num_rows) for c in chunks])
        host_open = ranges_rows([(c.state.request, c.start_pos - c.start_pos % ratio, c.start_pos) for c in chunks])
        (new_req, new_pos), (open_req, open_pos) = to_device(torch.cat((host_new, host_open), dim=1),
                                                             table.device).split([host_new.shape[1],
                                                                                  host_open.shape[1]], dim=1)
        columns = owner.rows()[:, : 2 * self.head_dim * 4 + INT32]
        stored = columns[:, : 2 * self.head_dim * 4].view(torch.float32)  # [slots, 2 * head_dim]: wkv, wgate
        stored_positions = columns[:, 2 * self.head_dim * 4:].view(torch.int32)  # [slots, 1]
        open_slots = owner.batch_slots(table, open_req, open_pos)
        open_inputs = stored[open_slots]  # read before this step's rows are written
        self.audit.expect(stored_positions[open_slots, 0], host_open[1],
                          f"layer {source_layer}: compressor-input cache")
        new_slots = owner.batch_slots(table, new_req, new_pos)
        stored[new_slots] = torch.cat((values, gates), dim=1).float()
        stored_positions[new_slots, 0] = new_pos.to(torch.int32)
        return open_inputs[:, : self.head_dim], open_inputs[:, self.head_dim:]

    def publish_entries(self, source_layer: int, latents: torch.Tensor, keys: torch.Tensor, counts: list[int],
                        open_groups, chunks: list[SequenceChunk]) -> None:
        """The open groups' inputs are in the compressor-input cache already (``compressor_inputs``)."""
        owner = self.compressed_owner[source_layer]
        table = self.metadata[owner.layer_name].block_table
        states = [c.state.compressed(source_layer) for c in chunks]
        requests, entries = to_device(ranges_rows([(c.state.request, s.num_entries, s.num_entries + n)
                                                   for c, s, n in zip(chunks, states, counts)]), table.device)
        if entries.numel():
            slots = owner.batch_slots(table, requests, entries)
            ops.cache_write(owner.entry_columns(source_layer), slots, latents, COMPRESSED_FORMAT)
            ops.cache_write(owner.key_columns(source_layer), slots, keys, INDEX_KEY_FORMAT)
        for state, count in zip(states, counts):
            state.num_entries += count

    def index_key_slots(self, source_layer: int, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.compressed_owner[source_layer]
        table = self.metadata[owner.layer_name].block_table
        counts = [c.state.compressed(source_layer).num_entries for c in chunks]
        requests, known = to_device(torch.tensor([[c.state.request for c in chunks], counts]), table.device)
        entries = torch.arange(max(counts), device=table.device)
        slots = owner.batch_slots(table, requests[:, None], entries[None, :])
        return owner.key_columns(source_layer), torch.where(entries[None, :] < known[:, None], slots, -1)

    def ngram_histories(self, chunks: list[SequenceChunk]) -> list[torch.Tensor]:
        owner = self.windows[0]
        table = self.metadata[owner.layer_name].block_table
        host = ranges_rows([(c.state.request, max(0, c.start_pos - self.ngram_context), c.start_pos) for c in chunks])
        requests, positions = to_device(host, table.device)
        slots = owner.batch_slots(table, requests, positions)
        _, meta = self.columns(0)
        self.audit.expect(meta[slots, 1], host[1], "layer 0: paged window cache (Engram history)")
        return list(meta[slots, 0].long().split([min(self.ngram_context, c.start_pos) for c in chunks]))

    def plan(self, owner: CacheOwner, chunks: list[SequenceChunk]) -> WindowPlan:
        """The window plan of ``owner``'s block table; the first call of a step plans every window table at once."""
        rows_key = self.rows_key(chunks)
        key = (self.metadata[owner.layer_name].block_table.data_ptr(), owner.rows_per_block, rows_key)
        if key not in self.plans:
            groups: dict[tuple, tuple[CacheOwner, dict[int, torch.Tensor]]] = {}
            for window in self.windows:
                table = self.metadata[window.layer_name].block_table
                groups.setdefault((window.rows_per_block, table.shape), (window, {}))[1][table.data_ptr()] = table
            rows = self.rows(chunks, self.metadata[owner.layer_name].block_table.device)
            for first, tables in groups.values():
                for pointer, plan in zip(tables, rows.plans(first, list(tables.values()))):
                    self.plans[(pointer, first.rows_per_block, rows_key)] = plan
        return self.plans[key]

    @staticmethod
    def rows_key(chunks: list[SequenceChunk]) -> tuple:
        return tuple((c.state.request, c.start_pos, c.num_rows, c.num_query_rows) for c in chunks)

    def rows(self, chunks: list[SequenceChunk], device: torch.device) -> WindowRows:
        """The step's window rows, built on the host and copied to the device once per step."""
        key = self.rows_key(chunks)
        if key not in self.window_rows:
            self.window_rows[key] = self.new_window_rows(chunks, device)
        return self.window_rows[key]

    def new_window_rows(self, chunks: list[SequenceChunk], device: torch.device) -> WindowRows:
        ends = [c.start_pos + c.num_rows for c in chunks]
        host = {"new": ranges_rows([(c.state.request, c.start_pos, end) for c, end in zip(chunks, ends)]),
                "context": ranges_rows([(c.state.request, oldest_window_key(c, self.window), c.start_pos)
                                        for c in chunks]),
                "query": ranges_rows([(c.state.request, c.first_query_pos, end) for c, end in zip(chunks, ends)])}
        new, context, query = to_device(torch.cat(list(host.values()), dim=1), device).split(
            [host[part].shape[1] for part in ("new", "context", "query")], dim=1)
        tokens = torch.cat([chunk.state.token_ids[chunk.start_pos - chunk.state.num_tokens:] for chunk in chunks])
        return WindowRows(new, torch.stack((tokens, new[1]), dim=1).to(torch.int32), context, host["context"][1],
                          query[0], window_positions(query[1], chunks, self.window))


class PagedSequenceState:
    """``SequenceState`` of one request in one vLLM step: which request it is, where its rows start, its tokens
    (on the device) and its compressed entry counts. The step's ``batch_store`` (``PagedStep``) reads and writes
    vLLM's paged caches for all requests at once, computing slots on the caches' device and checking stored
    positions once per step, so a step never waits on the device per request or layer."""

    def __init__(self, args: ModelArgs, request: int, start_pos: int, token_ids: torch.Tensor,
                 batch_store: PagedStep):
        self.args, self.request, self.num_tokens, self.token_ids = args, request, start_pos, token_ids
        self.batch_store = batch_store
        self.sources = {s: EntryCount(start_pos // args.layer_ratios[s]) for s in args.kv_source_layer_ids}

    def compressed(self, source_layer: int) -> EntryCount:
        return self.sources[source_layer]

    def advance(self, token_ids: torch.Tensor) -> None:
        """Nothing to do: every piece of state was written into vLLM's pages during the forward."""


# ---- DSpark draft context (deepinfer_plugins/vllm/spec_decode.py) ---------------------------------------------------
def _draft_record_layout(args: ModelArgs) -> tuple[int, int]:
    """(record bytes per stage, byte offset of the int32 position) of a DSpark context row."""
    record = record_bytes(WINDOW_FORMAT, args.head_dim)
    return record, INT32 * math.ceil(args.num_nextn_predict_layers * record / INT32)


def dspark_feature_layout(args: ModelArgs, block_size: int) -> tuple[int, int]:
    """(row bytes, block size) of the DSpark context cache: one row per token holding every draft stage's context
    key of that position as an fp8_window record (see ``PagedDraftContexts``), then the position (int32)."""
    _, position_at = _draft_record_layout(args)
    return paged_layout(args, position_at + INT32, 1, block_size)


def make_dspark_feature_owner(args: ModelArgs, vllm_config, prefix: str, num_speculative_tokens: int) -> CacheOwner:
    """The cache owner of the DSpark draft context. A sliding window of ``sliding_window + k + 1`` positions: a
    draft at anchor position p reads positions [p - sliding_window, p), and p is at most k + 1 past the position
    vLLM last freed blocks for. Named after the first draft layer id (names need exactly one integer)."""
    width, block = dspark_feature_layout(args, vllm_config.cache_config.block_size)
    spec = SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=width, dtype=CACHE_DTYPE,
                                sliding_window=args.sliding_window + num_speculative_tokens + 1)
    return CacheOwner(f"{prefix}layers.{args.num_hidden_layers}.dspark_context", spec, vllm_config)


def _draft_columns(args: ModelArgs, owner: CacheOwner) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per stage the fp8_window record columns [slots, record bytes], int32 positions [slots, 1]) of the DSpark
    context cache."""
    record, position_at = _draft_record_layout(args)
    table = owner.rows()
    stages = [table[:, s * record: (s + 1) * record] for s in range(args.num_nextn_predict_layers)]
    return stages, table[:, position_at: position_at + INT32].view(torch.int32)


class PagedDraftContexts:
    """The draft context of every drafting row of a step, read from the paged DSpark context cache at once: row r
    drafts at anchor position ``anchors[r]`` and reads the keys of the ``sliding_window`` positions before it,
    through its block table row; nothing is kept between steps. ``rows`` are the per-row ``DraftState`` faces
    the drafter's block takes (``num_tokens``, and this object as ``batch_context``)."""

    def __init__(self, args: ModelArgs, owner: CacheOwner, block_table: torch.Tensor, anchors: list[int],
                 audit: StoredPositions):
        window, device = args.sliding_window, block_table.device
        positions = torch.tensor(anchors)[:, None] - window + torch.arange(window)  # [R, W] on the host
        # positions before a sequence's start read position 0's slot (always stored) and are masked out
        self.valid = to_device(positions >= 0, device)
        requests = torch.arange(len(anchors), device=device)[:, None].expand(-1, window)
        self.slots = owner.batch_slots(block_table, requests, to_device(positions.clamp(min=0), device))
        self.stages, stored_positions = _draft_columns(args, owner)
        audit.expect(stored_positions[self.slots, 0], positions.clamp(min=0), "DSpark context cache")
        self.rows = [PagedDraftRow(anchor, self) for anchor in anchors]

    def draft_keys(self, stage: int, blocks: torch.Tensor,
                   chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's [context window keys ; its block's B keys] as one record table [R * (W + B), record bytes]
        and the indices [R * B, W + B] of each query slot's keys (-1 before the sequence's start)."""
        rows, window = self.slots.shape
        block = chunks[0].num_rows
        ours = len(chunks) == rows and all(c.num_rows == block and c.state.batch_context is self for c in chunks)
        if not ours:
            raise ValueError("draft_keys: the chunks must be this step's rows, one block of equal size each")
        table = torch.cat((self.stages[stage][self.slots], blocks.unflatten(0, (rows, block))), dim=1)
        width = window + block
        own = torch.arange(rows * width, device=blocks.device).view(rows, width)
        seen = torch.cat((self.valid, self.valid.new_ones(rows, block)), dim=1)
        return table.flatten(0, 1), torch.where(seen, own, -1).repeat_interleave(block, dim=0)


@dataclass
class PagedDraftRow:
    """One drafting row's ``DraftState`` face: its anchor position, and the step's batched context reads."""

    num_tokens: int
    batch_context: PagedDraftContexts


def write_dspark_context(args: ModelArgs, owner: CacheOwner, block_table: torch.Tensor, requests: torch.Tensor,
                         positions: torch.Tensor, keys: torch.Tensor) -> None:
    """Store every stage's context keys [n, num_stages, head_dim] (unquantised: written as fp8_window records) of
    the given (request, position) rows of a step, all requests at once, and the positions."""
    slots = owner.batch_slots(block_table, requests, positions)
    stages, stored_positions = _draft_columns(args, owner)
    for stage, columns in enumerate(stages):
        ops.cache_write(columns, slots, keys[:, stage], WINDOW_FORMAT)
    stored_positions[slots, 0] = positions.to(torch.int32)
