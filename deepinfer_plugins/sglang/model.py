"""SGLang model class for DeepSeek-V4.1-Flash: translates SGLang's batch and KV slots onto the core model.

No model math here (docs/architecture.md#one-copy-of-the-model-math): the network is
``deepinfer_plugins.models.deepseek_v41``; this file maps
  * SGLang's ``ForwardBatch`` (forward mode, per-request row counts, ``positions``, ``req_pool_indices``,
    ``out_cache_loc``) onto ``SequenceChunk``s of the core's ``forward_chunks``;
  * SGLang's KV slots (``req_to_token[req_pool_idx, pos]``, the same indices its allocator, radix cache and
    speculative rollback manage) onto the core's ``SequenceState`` protocol, via ``SlotStore`` below;
  * the checkpoint iterator of SGLang's loader (``load_weights``) onto the core's module tree, whose parameter
    names are the official checkpoint names;
  * SGLang's multimodal inputs (``forward_batch.mm_inputs``, image spans padded with each image's hash) onto the
    core's token ids and span rows: ``get_image_feature`` runs the core's ``embed_image``, SGLang's
    ``prepare_mm_inputs`` caches and slices the spans per chunk, and the core gets the ids with every image
    position back at ``image_token_id`` (vision.py holds the processor that lays the spans out).

Where V4.1's cache lives. V4.1 keeps per layer a window of FP8 latents, per KV-source layer a compressed KV
(one entry per ``ratio`` tokens) with indexer keys and an open compressor group, and the last few token ids
for Engram (kv_cache.py). SGLang 0.5.23's generic MHA/MLA token pools have no such layout, and upstream's
own V4 pool belongs to upstream's model. ``SlotStore`` therefore keeps every per-token item in buffers
indexed by SGLang's slot id, the caches as the byte records of ops/cache.py: the window record of position p
at slot(p), compressed entry j and its indexer key at the slot of the last token of its group (so the entry
exists exactly while SGLang keeps that slot), every token's compressor inputs (fp32) at its slot (read back
for the open group, so a rollback into a group pooled during verification finds its tokens' inputs), the token
id at slot(p). A sequence's state is thus a pure
function of its slot list, which is what SGLang's radix-cache prefix sharing, chunked prefill and
speculative rollback (freeing rejected slots) assume. Cost: SGLang still allocates its own (unused)
token pool for the config's head sizes; a DeepInfer KV-pool class would remove that and is not written.

Verified on CPU (integration_tests/sglang/test_sglang_registration.py): construction from the config SGLang
itself loads for a tiny checkpoint, ``load_weights`` from a safetensors iterator, and logits of a real
``ForwardBatch`` (EXTEND of two requests, chunked EXTEND with a cached prefix, DECODE, TARGET_VERIFY, and
EXTEND with one or two images, chunked inside a span: test_sglang_vision.py) equal the core model's, with
SGLang's real ``ReqToTokenPool``. The attention backend is a stand-in on CPU (only its
``req_to_token_pool`` is read, through SGLang's ``get_req_to_token_pool()``), because SGLang cannot run its
model runner without a GPU / a CPU sgl-kernel here. Not verified: a live SGLang server (scheduler, CUDA
graphs: the per-sequence loops here are not graph-capturable), input-token logprobs (only next-token logits
are returned), tensor / pipeline parallelism (the core model is single-device), quantised kernels.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..models.deepseek_v41 import ConfigError, ModelArgs, SequenceChunk
from ..models.deepseek_v41 import DeepseekV41ForCausalLM as CoreModel
from ..models.deepseek_v41.kv_cache import (COMPRESSED_FORMAT, INDEX_KEY_FORMAT, WINDOW_FORMAT, EntryCount,
                                             ranges_rows, window_positions)
from ..models.deepseek_v41.loader import attach_engram_token_map, load_weights, new_model, without_missing_vision
from ..ops import cache_write
from ..ops.cache import record_bytes, to_device


# ---- config ------------------------------------------------------------------------------------------------
def model_args_from_sglang_config(config) -> ModelArgs:
    """ModelArgs from the config object SGLang hands the model class.

    SGLang 0.5.23 flattens V4.1's nested config (sglang/srt/configs/deepseek_v41.py), so the nested
    ``config.json`` is read again from ``config._name_or_path`` (SGLang sets it to the checkpoint directory);
    a config that still carries ``text_config`` (a plain dict or HF config) is used as is. A checkpoint that
    holds no vision tensors gets no vision tower, even when its config keeps ``vision_config`` (text-only
    conversions of the release do): the model would otherwise wait for tensors that never come.
    """
    path = getattr(config, "_name_or_path", None)
    if path and (Path(path) / "config.json").exists():
        return without_missing_vision(Path(path), ModelArgs.from_file(path))
    values = config if isinstance(config, dict) else config.to_dict()
    if "text_config" in values:
        return ModelArgs.from_hf_config(values)
    raise ConfigError(f"cannot rebuild the V4.1 config: {path!r} has no config.json and the config SGLang passed "
                      "was flattened (no text_config); pass the checkpoint directory as --model-path")


class UnsupportedInputError(ValueError):
    """SGLang asked for something this adapter does not serve (a forward mode, embeddings, pipeline stages)."""


# ---- KV state over SGLang's slots ------------------------------------------------------------------------

class SlotStore:
    """V4.1's per-token state in buffers indexed by SGLang KV slot id (see the module docstring).

    window[layer]      [slots, 528] uint8       fp8_window record of the token's window latent (head_dim 512)
    entries[src]       [slots, 288] uint8       nvfp4 record of the compressed entry whose group ends there
    index_keys[src]    [slots, 68] uint8        mxfp4 record of its indexer key
    input_values/gates[src] [slots, head_dim] fp32  the token's compressor inputs (read back for an open group)
    tokens             [slots] int64            token id (Engram n-gram history)
    """

    def __init__(self, args: ModelArgs, device: torch.device):
        self.args, self.device = args, device
        self.capacity = 0
        self.window: dict[int, torch.Tensor] = {}
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.input_values: dict[int, torch.Tensor] = {}
        self.input_gates: dict[int, torch.Tensor] = {}
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)

    def ensure(self, num_slots: int) -> None:
        """Grow every buffer to hold slot ids < num_slots (amortised doubling; contents kept)."""
        if num_slots <= self.capacity:
            return
        new = max(num_slots, 2 * self.capacity, 64)
        a = self.args

        def grown(old: torch.Tensor | None, width: int, dtype: torch.dtype) -> torch.Tensor:
            buf = torch.zeros(new, width, dtype=dtype, device=self.device)
            if old is not None:
                buf[: old.shape[0]] = old
            return buf

        window_bytes = record_bytes(WINDOW_FORMAT, a.head_dim)
        for layer in range(a.num_hidden_layers):
            self.window[layer] = grown(self.window.get(layer), window_bytes, torch.uint8)
        entry_bytes, key_bytes = record_bytes(COMPRESSED_FORMAT, a.head_dim), record_bytes(INDEX_KEY_FORMAT,
                                                                                           a.index_head_dim)
        for src in a.kv_source_layer_ids:
            self.entries[src] = grown(self.entries.get(src), entry_bytes, torch.uint8)
            self.index_keys[src] = grown(self.index_keys.get(src), key_bytes, torch.uint8)
            self.input_values[src] = grown(self.input_values.get(src), a.head_dim, torch.float32)
            self.input_gates[src] = grown(self.input_gates.get(src), a.head_dim, torch.float32)
        tokens = torch.zeros(new, dtype=torch.long, device=self.device)
        tokens[: self.tokens.shape[0]] = self.tokens
        self.tokens = tokens
        self.capacity = new


class SlotStep:
    """``BatchStore`` of one SGLang forward. Every per-token buffer is indexed by the same SGLang slot ids, so the
    slots of a forward (its new rows, each query row's window, each request's slot list) are the same for every
    layer: they are built once, and a layer costs one record write and one gather per lookup."""

    def __init__(self, store: SlotStore):
        self.store, self.window = store, store.args.sliding_window
        self.plans: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def plan(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (slots of the new rows [key rows], each query row's window slots [query rows, W], every request's
        slot list padded with -1 [chunks, longest], the chunk of every query row [query rows])."""
        key = tuple((c.start_pos, c.num_rows, c.num_query_rows) for c in chunks)
        if key not in self.plans:
            device = self.store.device
            slot_lists = torch.nn.utils.rnn.pad_sequence([c.state.slots for c in chunks], batch_first=True,
                                                         padding_value=-1)
            new = torch.cat([c.state.slots[c.start_pos: c.start_pos + c.num_rows] for c in chunks])
            query_chunk, query_pos = to_device(ranges_rows([(b, c.first_query_pos, c.start_pos + c.num_rows)
                                                            for b, c in enumerate(chunks)]), device)
            wanted = window_positions(query_pos, chunks, self.window)
            window = torch.where(wanted >= 0, slot_lists[query_chunk[:, None], wanted.clamp(min=0)], -1)
            self.plans[key] = new, window, slot_lists, query_chunk
        return self.plans[key]

    def window_keys(self, layer: int, latents: torch.Tensor,
                    chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        new, window, _, _ = self.plan(chunks)
        cache_write(self.store.window[layer], new, latents, WINDOW_FORMAT)
        return self.store.window[layer], window

    def compressor_inputs(self, source_layer: int, values: torch.Tensor, gates: torch.Tensor,
                          chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        new, _, slot_lists, _ = self.plan(chunks)
        ratio = self.store.args.layer_ratios[source_layer]
        chunk, position = to_device(ranges_rows([(b, c.start_pos - c.start_pos % ratio, c.start_pos)
                                                 for b, c in enumerate(chunks)]), self.store.device)
        open_slots = slot_lists[chunk, position]
        stored_values, stored_gates = self.store.input_values[source_layer], self.store.input_gates[source_layer]
        open_values, open_gates = stored_values[open_slots], stored_gates[open_slots]  # read before the writes
        stored_values[new], stored_gates[new] = values.float(), gates.float()
        return open_values, open_gates

    def publish_entries(self, source_layer: int, latents: torch.Tensor, keys: torch.Tensor, counts: list[int],
                        open_groups, chunks: list[SequenceChunk]) -> None:
        """The open groups' inputs are stored already (``compressor_inputs``)."""
        _, _, slot_lists, _ = self.plan(chunks)
        ratio = self.store.args.layer_ratios[source_layer]
        states = [c.state.compressed(source_layer) for c in chunks]
        chunk, entry = to_device(ranges_rows([(b, s.num_entries, s.num_entries + n)
                                              for b, (s, n) in enumerate(zip(states, counts))]), self.store.device)
        if entry.numel():
            slots = slot_lists[chunk, entry * ratio + ratio - 1]  # entry j lives at the slot of its group's last token
            cache_write(self.store.entries[source_layer], slots, latents, COMPRESSED_FORMAT)
            cache_write(self.store.index_keys[source_layer], slots, keys, INDEX_KEY_FORMAT)
        for state, count in zip(states, counts):
            state.num_entries += count

    def index_key_slots(self, source_layer: int, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, slot_lists, _ = self.plan(chunks)
        ratio = self.store.args.layer_ratios[source_layer]
        counts = [c.state.compressed(source_layer).num_entries for c in chunks]
        entries = torch.arange(max(counts), device=slot_lists.device)
        slots = slot_lists[:, (entries * ratio + ratio - 1).clamp(max=max(slot_lists.shape[1] - 1, 0))]
        known = to_device(torch.tensor(counts), slot_lists.device)
        return self.store.index_keys[source_layer], torch.where(entries[None, :] < known[:, None], slots, -1)

    def ngram_histories(self, chunks: list[SequenceChunk]) -> list[torch.Tensor]:
        _, _, slot_lists, _ = self.plan(chunks)
        keep = self.store.args.engram_max_ngram_size - 1
        chunk, position = to_device(ranges_rows([(b, max(0, c.start_pos - keep), c.start_pos)
                                                 for b, c in enumerate(chunks)]), self.store.device)
        return list(self.store.tokens[slot_lists[chunk, position]].split([min(keep, c.start_pos) for c in chunks]))

    def compressed_slots(self, source_layer: int, entries: torch.Tensor,
                         chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, slot_lists, query_chunk = self.plan(chunks)
        ratio = self.store.args.layer_ratios[source_layer]
        group_end = (entries * ratio + ratio - 1).clamp(min=0)  # entry j lives at the slot of its group's last token
        slots = slot_lists[query_chunk[:, None].expand_as(entries), group_end]
        return self.store.entries[source_layer], torch.where(entries >= 0, slots, -1)


class SlotSequenceState:
    """``SequenceState`` of one request for one forward, over ``SlotStore``; the forward's ``SlotStep`` reads and
    writes the caches.

    slots [start_pos + new tokens]: SGLang slot of every position up to the end of this forward's rows.
    """

    def __init__(self, store: SlotStore, slots: torch.Tensor, start_pos: int, batch_store: SlotStep):
        self.store, self.slots, self.num_tokens, self.batch_store = store, slots, start_pos, batch_store
        self.sources = {s: EntryCount(start_pos // store.args.layer_ratios[s]) for s in store.args.kv_source_layer_ids}

    def compressed(self, source_layer: int) -> EntryCount:
        return self.sources[source_layer]

    def advance(self, token_ids: torch.Tensor) -> None:
        self.store.tokens[self.slots[self.num_tokens: self.num_tokens + token_ids.numel()]] = token_ids.long()
        self.num_tokens += token_ids.numel()


# ---- the SGLang model class --------------------------------------------------------------------------------
def rows_per_request(forward_batch, num_rows: int) -> list[int]:
    """How many rows of the flattened batch belong to each request, by SGLang forward mode."""
    mode, bs = forward_batch.forward_mode, forward_batch.batch_size
    if mode.is_decode():
        return [1] * bs
    if mode.is_target_verify():
        if num_rows % bs:
            raise ValueError(f"TARGET_VERIFY batch of {num_rows} rows does not split evenly over {bs} requests")
        return [num_rows // bs] * bs
    if mode.is_extend():
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None:
            lens = forward_batch.extend_seq_lens.tolist()
        return [int(n) for n in lens]
    raise UnsupportedInputError(f"DeepInfer's V4.1 SGLang model does not handle forward mode {mode.name}")


class TokenEmbedding:
    """The core's token embedding in the activation dtype, as SGLang's multimodal routine calls it: image rows
    are written into its output, so they keep the precision ``embed_image`` gave them (the embedding table itself
    is stored in bf16)."""

    def __init__(self, core: CoreModel):
        self.core = core
        self.num_embeddings = core.embed.num_embeddings

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.core.embed(token_ids).to(self.core.dtype)  # [rows, d]


class DeepInferDeepseekV41ForCausalLM(nn.Module):
    """SGLang model class (constructor, ``forward``, ``load_weights`` as SGLang's model loader calls them).

    ``self.model`` is the core ``DeepseekV41ForCausalLM``; parameters live there under the official names.
    ``quant_config`` is ignored: the core keeps FP8 / FP4 weights as stored and picks the GEMM from the
    weight (linear.py), so SGLang's quantisation layers are not involved.
    """

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.args = model_args_from_sglang_config(config)
        dtype = torch.get_default_dtype()  # SGLang sets it to the served dtype around model construction
        self.model = new_model(CoreModel, self.args, dtype)
        self.store: SlotStore | None = None
        self.checkpoint_dir = getattr(config, "_name_or_path", None)

    # ---- weights ------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Official-name tensors -> the core's parameters, through the core's ``load_weights``."""
        loaded = load_weights(self.model, weights, "the checkpoint SGLang loaded")
        self.model.finish_loading()
        attach_engram_token_map(self.model, Path(self.checkpoint_dir or "."))
        return loaded

    # ---- images -------------------------------------------------------------------------------------------
    def pad_input_ids(self, input_ids, mm_inputs):
        """The scheduler's prompt ids with each image span's positions set to the image's pad values (derived
        from its pixels' hash), so the radix cache never matches one image's span against another's: every
        span holds the same ``image_token_id`` otherwise. ``forward`` maps them back."""
        from sglang.srt.managers.mm_utils import pad_mm_tokens

        return pad_mm_tokens(input_ids, mm_inputs)

    def get_input_embeddings(self) -> "TokenEmbedding":
        return TokenEmbedding(self.model)

    def get_image_feature(self, items) -> list[torch.Tensor]:
        """Each image's whole span [span_length, d] (the core's vision tower, aligner and delimiters), in item
        order: SGLang caches it by the image's hash and slices out the rows a chunk covers."""
        return [self.model.embed_image(item.feature, int(item.patch_rows), int(item.patch_cols)) for item in items]

    def image_inputs(self, input_ids: torch.Tensor, forward_batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (token ids with every image position back at ``image_token_id``, the span rows of those positions
        in order, or None when the batch holds no image). SGLang's ``prepare_mm_inputs`` runs ``get_image_feature``
        through its embedding cache and places each chunk's rows at the pad-value positions; the core takes the
        ids beside the rows, because image positions route with ``bias_vl`` and are dead to Engram."""
        mode = forward_batch.forward_mode
        if not (mode.is_extend() and not mode.is_target_verify() and forward_batch.contains_mm_inputs()):
            return input_ids, None
        from sglang.srt.managers.mm_utils import prepare_mm_inputs

        pad_values = sorted({value for mm in forward_batch.mm_inputs if mm is not None for item in mm.mm_items
                             for value in item.padding_values()})
        image = torch.isin(input_ids, to_device(torch.tensor(pad_values, dtype=input_ids.dtype), input_ids.device))
        token_ids = input_ids.masked_fill(image, self.args.image_token_id)
        # prepare_mm_inputs clamps the ids it is given in place; the caller's stay as they are
        embeds = prepare_mm_inputs(input_ids.clone(), forward_batch, self, {}, multimodal_model=self)  # [rows, d]
        return token_ids, embeds[image]

    # ---- forward ------------------------------------------------------------------------------------------
    def slot_store(self, num_slots: int) -> SlotStore:
        if self.store is None:
            self.store = SlotStore(self.args, self.model.embed.weight.device)
        self.store.ensure(num_slots)
        return self.store

    def sequence_chunks(self, positions: torch.Tensor, forward_batch) -> tuple[list[SequenceChunk], list[int]]:
        """One SequenceChunk per request, its state over SGLang's slots. -> (chunks, rows per request)."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        req_to_token = get_req_to_token_pool().req_to_token
        counts = rows_per_request(forward_batch, positions.numel())
        device = self.model.embed.weight.device
        first_rows = [0, *itertools.accumulate(counts)][: len(counts)]
        # three reads on the host per forward, whatever the batch size (each one waits for a GPU): the requests'
        # pool rows, their first positions and the largest slot id
        pool_rows = forward_batch.req_pool_indices.tolist()
        nonempty = [i for i, n in enumerate(counts) if n]
        firsts = positions[to_device(torch.tensor([first_rows[i] for i in nonempty], dtype=torch.long),
                                     positions.device)].tolist() if nonempty else []
        starts = [0] * len(counts)
        for i, first in zip(nonempty, firsts):
            starts[i] = first
        out_loc = forward_batch.out_cache_loc.long().to(device)
        slot_lists = [torch.cat((req_to_token[pool_row, :start].long().to(device), out_loc[row: row + n]))
                      for pool_row, start, row, n in zip(pool_rows, starts, first_rows, counts)]  # [start + n] each
        every_slot = torch.cat(slot_lists) if slot_lists else out_loc
        store = self.slot_store(int(every_slot.max()) + 1 if every_slot.numel() else 0)
        batch_store = SlotStep(store)
        chunks = [SequenceChunk(row, n, start, SlotSequenceState(store, slots, start, batch_store))
                  for row, n, start, slots in zip(first_rows, counts, starts, slot_lists)]
        return chunks, counts

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, input_embeds=None,
                get_embedding: bool = False, pp_proxy_tensors=None):
        """input_ids, positions [rows] -> LogitsProcessorOutput (next-token logits: last row per request for
        EXTEND, every row for DECODE and TARGET_VERIFY). Image positions of an EXTEND hold pad values
        (``pad_input_ids``); ``image_inputs`` turns them into the ids and span rows the core takes."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        if input_embeds is not None or get_embedding or pp_proxy_tensors is not None:
            raise UnsupportedInputError("DeepInfer's V4.1 SGLang model takes token ids only (no input_embeds, "
                                      "embedding mode or pipeline parallelism)")
        token_ids, image_embeds = self.image_inputs(input_ids, forward_batch)
        chunks, counts = self.sequence_chunks(positions, forward_batch)
        states = [c.state for c in chunks]
        starts = [c.row_start for c in chunks]
        # bounded_replay stays off: a later request may resume from any cached prefix (radix cache), which needs
        # every layer's window latent at every position.
        hidden = self.model.hidden_states(token_ids, chunks, image_embeds=image_embeds)  # [rows, d]
        for state, start, n in zip(states, starts, counts):
            state.advance(token_ids[start: start + n])
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_target_verify():  # is_extend() includes TARGET_VERIFY
            # the head runs on the rows that are sampled only: a prefill chunk's logits of every row would be
            # [rows, 129280] fp32 (4.2 GB at 8192 rows)
            hidden = hidden[to_device(torch.tensor([s + n - 1 for s, n in zip(starts, counts)]), hidden.device)]
        return LogitsProcessorOutput(next_token_logits=self.model.compute_logits(hidden))


class DeepseekV41ForCausalLM(DeepInferDeepseekV41ForCausalLM):
    """The same class under the architecture name official V4.1 checkpoints carry (register.py decides)."""
