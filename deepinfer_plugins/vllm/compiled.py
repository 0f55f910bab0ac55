"""What vLLM compiles of V4.1: the model body, with every paged-cache access behind opaque custom ops.

vLLM traces a model with torch.compile only through modules decorated with ``support_torch_compile``, and it may
trace once, during a warm-up run without attention metadata, then reuse the graph for every step (CPU's
DYNAMO_TRACE_ONCE). So the traced body must hold no branch on the metadata, no per-request Python and no host read.
``CompiledBody`` runs the core model's ``opaque_cache_hidden_states`` (embedding, mHC, norms, MoE, final norm: the
one copy of the math) with each layer's attention as ``Attention.forward_all_rows``: the query and window-latent
projections, RoPE and the output projection stay in the traced graph, and all the cache work between them (window
writes and reads, compressor inputs and entries, indexer selection, sparse attention over the cache records:
``Attention.attend_cached``) is one op, ``deepinfer::v41_attention``. The Engram row ids (which read the token
history from the window cache) are ``deepinfer::v41_engram_ids``. Like vLLM's own attention op they take only
tensors and the layer name, find the step through vLLM's forward context and run eagerly over the step's chunks;
their fake implementations give the traced graph its shapes. Both are added to vLLM's splitting ops, so a piecewise
(GPU) compile splits the graph there as it does around its own attention.

The step's chunks are built once per step before the body runs (``PagedSteps.begin``, host metadata from
``DeepInferMetadataBuilder``) and kept on the metadata object vLLM hands every op of that step. With DSpark
speculation the body also returns the residual streams entering the drafter's target layers, graph outputs like
the hidden states, so the target's forward is compiled with speculation on too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.forward_context import get_forward_context

from ..models.deepseek_v41.args import ModelArgs
from ..models.deepseek_v41.kv_cache import SequenceChunk
from .cache import StoredPositions

ATTENTION_OP = "deepinfer::v41_attention"
ENGRAM_OP = "deepinfer::v41_engram_ids"
DRAFT_ATTENTION_OP = "deepinfer::v41_draft_attention"


@dataclass
class PagedForward:
    """One step's work, built before the body runs: one chunk per request with rows in this step."""

    chunks: list[SequenceChunk]
    rows: list[tuple[int, int, int]]  # (request, start position, rows) of each chunk
    num_tokens: int  # rows of the batch that are real tokens (the rest is padding)
    audit: StoredPositions


def step_metadata() -> dict | None:
    """This step's attention metadata by layer name; None in vLLM's warm-up and profiling runs."""
    metadata = get_forward_context().attn_metadata
    return metadata[0] if isinstance(metadata, list) else metadata


class PagedSteps:
    """Where the ops find the current step: on the metadata of the first window cache, which vLLM builds anew
    every step (so nothing from an earlier step can be reused by mistake)."""

    def __init__(self, core, first_window: str):
        self.core, self.first_window = core, first_window

    def begin(self, build) -> PagedForward | None:
        """Build this step's ``PagedForward`` with ``build(metadata)`` and keep it for the ops; None without
        metadata."""
        metadata = step_metadata()
        if not metadata:
            return None
        first = metadata[self.first_window]
        first.forward = build(metadata)
        return first.forward

    def current(self) -> PagedForward | None:
        metadata = step_metadata()
        return metadata[self.first_window].forward if metadata else None


class Drafting:
    """Where ``deepinfer::v41_draft_attention`` finds the rows being drafted: set on the draft-context cache's
    owner (found by its layer name), ``chunks`` one per drafting row for the duration of one drafting call."""

    def __init__(self, drafter):
        self.drafter, self.chunks = drafter, None

    @contextmanager
    def rows(self, chunks: list[SequenceChunk]):
        self.chunks = chunks
        try:
            yield
        finally:
            self.chunks = None


def attach_steps(core, windows) -> PagedSteps:
    """The ``PagedSteps`` of a model, set on each of its window caches with the layer's id: what the ops find
    through the forward context by the layer name they are given."""
    steps = PagedSteps(core, windows[0].layer_name)
    for layer_id, owner in enumerate(windows):
        owner.steps, owner.layer_id = steps, layer_id
    return steps


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def _attention(x: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor,
               latents: torch.Tensor, layer_name: str) -> torch.Tensor:
    owner = get_forward_context().no_compile_layers[layer_name]
    step = owner.steps.current()
    out = torch.zeros_like(q)
    if step is not None and step.chunks:
        n = step.num_tokens
        out[:n] = owner.steps.core.layers[owner.layer_id].attn.attend_cached(
            x[:n], positions[:n], x[:n], positions[:n], q[:n], q_latent[:n], latents[:n], step.chunks)
    return out


@_attention.register_fake
def _attention_fake(x, positions, q, q_latent, latents, layer_name):
    return torch.empty_like(q)


@torch.library.custom_op(ENGRAM_OP, mutates_args=())
def _engram_ids(token_ids: torch.Tensor, layer_name: str, tables: int, columns: int) -> torch.Tensor:
    steps = get_forward_context().no_compile_layers[layer_name].steps
    step = steps.current()
    ids = torch.zeros(token_ids.shape[0], tables, columns, dtype=torch.int64, device=token_ids.device)
    if step is not None and step.chunks:
        n, chunks = step.num_tokens, step.chunks
        histories = chunks[0].state.batch_store.ngram_histories(chunks)
        ids[:n] = steps.core.hasher(token_ids[:n], histories, [c.num_rows for c in chunks])
    return ids


@_engram_ids.register_fake
def _engram_ids_fake(token_ids, layer_name, tables, columns):
    return token_ids.new_empty(token_ids.shape[0], tables, columns, dtype=torch.int64)


@torch.library.custom_op(DRAFT_ATTENTION_OP, mutates_args=())
def _draft_attention(q: torch.Tensor, latents: torch.Tensor, stage: int, layer_name: str) -> torch.Tensor:
    drafting = get_forward_context().no_compile_layers[layer_name].drafting
    if drafting.chunks is None:  # a warm-up call: no rows to draft for
        return torch.zeros_like(q)
    return drafting.drafter[stage].attn.attend_context(q, latents, drafting.chunks)


@_draft_attention.register_fake
def _draft_attention_fake(q, latents, stage, layer_name):
    return torch.empty_like(q)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class CompiledBody(nn.Module):
    """The traced part of the forward: token ids -> (final hidden states [rows, d], the residual streams entering
    each of ``capture_layers``), cache work opaque. With image inputs vLLM hands every step its input embeddings
    (images merged), and the token ids beside them."""

    def __init__(self, *, vllm_config, prefix: str = "", core: nn.Module, layer_names: list[str],
                 capture_layers: tuple[int, ...] = ()):
        super().__init__()
        self.core, self.layer_names, self.capture_layers = core, layer_names, capture_layers
        args: ModelArgs = core.args
        self.engram_shape = (len(args.engram_layer_ids), (args.engram_max_ngram_size - 1) * args.engram_n_heads)
        splitting_ops = vllm_config.compilation_config.splitting_ops
        if splitting_ops:  # piecewise compile: split at our ops as at vLLM's attention
            splitting_ops.extend(op for op in (ATTENTION_OP, ENGRAM_OP) if op not in splitting_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        engram_ids = None
        if self.engram_shape[0]:
            engram_ids = torch.ops.deepinfer.v41_engram_ids(input_ids, self.layer_names[0], *self.engram_shape)

        def attention(layer_id: int, x: torch.Tensor) -> torch.Tensor:
            def attend(q, q_latent, latents):
                return torch.ops.deepinfer.v41_attention(x, positions, q, q_latent, latents,
                                                         self.layer_names[layer_id])

            return self.core.layers[layer_id].attn.forward_all_rows(x, positions, attend)

        return self.core.opaque_cache_hidden_states(input_ids, engram_ids, attention, inputs_embeds,
                                                    self.capture_layers)


@support_torch_compile(dynamic_arg_dims={"anchors": 0, "positions": 0})
class CompiledDrafter(nn.Module):
    """The DSpark drafter's block backbone, traced like the body: anchors [R] and the slots' positions [R * B] ->
    the collapsed hidden states [R, B, d] (the core's ``block_hidden``: embedding, each stage's projections,
    mHC, norms and MoE). Each stage's reads of the draft context are one opaque op,
    ``deepinfer::v41_draft_attention``, which finds the rows being drafted on the context cache's owner (its
    ``Drafting``, set by the proposer around the call). The Markov stage after it (the target's head, then one
    slot at a time) runs outside the graph: traced, the head is the compiler's GEMM against the head weight as
    stored, which on a CPU was slower than the whole eager drafter; eager, it is the engine's prepacked GEMM
    (ops/backends/vllm_cpu_backend.py), as for the target's logits."""

    def __init__(self, *, vllm_config, prefix: str = "", core: nn.Module, context_layer: str):
        super().__init__()
        self.core, self.context_layer = core, context_layer
        splitting_ops = vllm_config.compilation_config.splitting_ops
        if splitting_ops and DRAFT_ATTENTION_OP not in splitting_ops:
            splitting_ops.append(DRAFT_ATTENTION_OP)

    def forward(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        drafter = self.core.drafter

        def attention(stage: int, x: torch.Tensor) -> torch.Tensor:
            def attend(q, q_latent, latents):
                return torch.ops.deepinfer.v41_draft_attention(q, latents, stage, self.context_layer)

            return drafter[stage].attn.forward_all_rows(x, positions, attend)

        return drafter.block_hidden(self.core.embed, anchors, attention)
