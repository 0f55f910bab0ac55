"""The DSpark draft context in vLLM's paged memory (vllm/cache.py), in-process without an engine.

Guarantees: the proposer's one batched read of every drafting row's context (``PagedDraftContexts``), through
block tables drawn at random over stale bytes, gives the drafts and confidences of the core drafter on its own
``DraftState``s, for rows whose anchor sits before, at and past the window; so does the drafter as vLLM compiles
it (traced without a graph break, its context reads one opaque op); and a block table that points a row at another
row's blocks is caught by the stored-position audit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41.kv_cache import SequenceChunk
from deepinfer_plugins.vllm.cache import (PagedDraftContexts, StoredPositions, make_dspark_feature_owner,
                                          write_dspark_context)

BLOCK_SIZE = 16
LENGTHS = (3, 8, 21)  # anchor positions: inside the first window, at its end, past it


def context_of(model, prompt: torch.Tensor) -> torch.Tensor:
    """The drafter's context C [n, d] of a fresh sequence, from the target's captured streams."""
    chunk = SequenceChunk(0, prompt.numel(), 0, model.new_cache())
    model.hidden_states(prompt, [chunk], capture_layers=tuple(model.args.dspark_target_layer_ids))
    return model.drafter.context(chunk.published["streams_in"]).to(model.drafter.dtype)


@pytest.fixture(scope="module")
def paged(core_model):
    """The draft-context owner over stale bytes, each request's blocks at random, every prompt position written
    the way the model's forward writes it."""
    model, args = core_model, core_model.args
    generator = torch.Generator().manual_seed(0)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
                             compilation_config=SimpleNamespace(static_forward_context={}))
    owner = make_dspark_feature_owner(args, config, "model.", num_speculative_tokens=2)
    blocks = -(-max(LENGTHS) // owner.spec.block_size)
    total = len(LENGTHS) * blocks + 2
    owner.bind_kv_cache(torch.randint(0, 256, (total, owner.spec.block_size, owner.spec.head_size),
                                      dtype=torch.uint8, generator=generator))
    table = torch.randperm(total, generator=generator)[: len(LENGTHS) * blocks].view(len(LENGTHS), blocks).int()
    prompts = [torch.randint(3, 250, (n,), generator=generator) for n in LENGTHS]
    states = []
    for request, prompt in enumerate(prompts):
        context = context_of(model, prompt)
        positions = torch.arange(prompt.numel())
        keys = torch.stack([stage.attn.window_latents(context, positions) for stage in model.drafter], dim=1)
        write_dspark_context(args, owner, table, torch.full_like(positions, request), positions, keys)
        state = model.drafter.new_state()
        model.drafter.add_context(state, context, 0)
        states.append(state)
    return owner, table, states


@torch.no_grad()
def test_batched_paged_context_drafts_as_the_core_drafter(core_model, paged):
    model = core_model
    owner, table, states = paged
    anchors = torch.tensor([5, 6, 7])
    want = model.drafter.propose(model.embed, model.head_weight, anchors, states, greedy_draft=True)
    audit = StoredPositions()
    context = PagedDraftContexts(model.args, owner, table, list(LENGTHS), audit)
    got = model.drafter.propose(model.embed, model.head_weight, anchors, context.rows, greedy_draft=True)
    audit.verify()
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidence_logits, want.confidence_logits, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_row_reading_another_rows_blocks_is_caught(core_model, paged):
    owner, table, _ = paged
    audit = StoredPositions()
    PagedDraftContexts(core_model.args, owner, table[[2, 1, 0]], list(LENGTHS), audit)
    with pytest.raises(RuntimeError, match="DSpark context cache does not hold position"):
        audit.verify()


@torch.no_grad()
def test_compiled_drafter_traces_without_graph_breaks_and_drafts_as_the_core(core_model, paged):
    """The drafter's block as vLLM compiles it (``CompiledDrafter``, traced by dynamo with fullgraph=True and
    dynamic shapes), its context reads the opaque op over the paged cache: no graph break, and the drafts and
    confidences of the core drafter on its own ``DraftState``s."""
    from torch._dynamo.utils import counters
    from vllm.forward_context import ForwardContext, override_forward_context

    from deepinfer_plugins.models.deepseek_v41.kv_cache import key_positions
    from deepinfer_plugins.vllm.compiled import CompiledDrafter, Drafting

    from .test_compile import eager_vllm_config

    model = core_model
    owner, table, states = paged
    owner.drafting = Drafting(model.drafter)
    drafter = CompiledDrafter(vllm_config=eager_vllm_config(), core=model, context_layer=owner.layer_name)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(drafter.forward, backend="eager", fullgraph=True, dynamic=True)
    for rows in ([0, 1, 2], [2, 0]):
        anchors = torch.tensor([5, 6, 7])[rows]
        want = model.drafter.propose(model.embed, model.head_weight, anchors, [states[r] for r in rows],
                                     greedy_draft=True)
        audit = StoredPositions()
        context = PagedDraftContexts(model.args, owner, table[rows], [LENGTHS[r] for r in rows], audit)
        chunks = model.drafter.block_chunks(context.rows)
        with override_forward_context(ForwardContext(no_compile_layers={owner.layer_name: owner}, attn_metadata={},
                                                     slot_mapping={})), owner.drafting.rows(chunks):
            hidden = compiled(anchors, key_positions(chunks, anchors.device))
        audit.verify()
        tokens, confidence_logits = model.drafter.greedy_drafts(hidden, model.head_weight, anchors)
        assert torch.equal(tokens, want.tokens)
        torch.testing.assert_close(confidence_logits, want.confidence_logits, atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
