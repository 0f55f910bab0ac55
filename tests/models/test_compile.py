"""The core model compiles into one graph once its cache work is opaque.

``DeepseekV41Model.opaque_cache_hidden_states`` is the body engines hand to torch.compile: each layer's
attention as ``Attention.forward_all_rows``, its projections traced and its cache work (every cache read and
write, ``attend_cached``) behind an opaque op the engine supplies, the routed experts behind
``deepinfer::moe_experts`` (ops/opaque.py). Guarantees: dynamo traces it with fullgraph=True and no graph
break, and the compiled body gives ``hidden_states``' result for a prefill and for the decode steps after it,
including the residual streams it captures for the DSpark drafter (graph outputs of the compiled body).
The attention op here is a test-local custom op over the core's in-memory caches; vLLM's is in
deepinfer_plugins/vllm/compiled.py.
"""

import torch
from torch._dynamo.utils import counters

from deepinfer_plugins.models.deepseek_v41.attention import store_of
from deepinfer_plugins.models.deepseek_v41.kv_cache import SequenceChunk

from ..conftest import prompt

_step: dict = {}  # what the test op reads: the model and this step's chunks


@torch.library.custom_op("deepinfer_test::attend", mutates_args=())
def _attend(x: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor, latents: torch.Tensor,
            layer_id: int) -> torch.Tensor:
    return _step["model"].layers[layer_id].attn.attend_cached(x, positions, x, positions, q, q_latent, latents,
                                                              _step["chunks"])


@_attend.register_fake
def _(x, positions, q, q_latent, latents, layer_id):
    return torch.empty_like(q)


def attention(model, positions):
    """A layer's attention as engines compile it: projections traced, the cache work behind the test op."""
    def attend(layer_id, x):
        return model.layers[layer_id].attn.forward_all_rows(
            x, positions, lambda q, q_latent, latents: torch.ops.deepinfer_test.attend(x, positions, q, q_latent,
                                                                                     latents, layer_id))
    return attend


def test_moe_experts_op_matches_the_registry_op(tiny256):
    from deepinfer_plugins import ops

    moe = tiny256.layers[0].ffn
    x = torch.randn(6, tiny256.args.hidden_size)
    weights, ids = moe.gate(x)
    experts = moe.experts.weights(x.dtype)
    assert torch.equal(ops.routed_experts(x, weights, ids, experts, moe.experts.swiglu_limit),
                       ops.moe_experts(x, weights, ids, experts, moe.experts.swiglu_limit))


def test_body_compiles_without_graph_breaks_and_matches_eager(tiny256):
    """Dynamo's eager backend: tracing (with the ops' fake implementations) is what can break a graph."""
    model = tiny256
    ids = prompt(24, 5)
    capture = (0, 2, model.args.num_hidden_layers - 1)
    torch._dynamo.reset()
    counters.clear()

    class Body(torch.nn.Module):
        """Layer ids held as a module attribute, as engines hold them: dynamo keeps those constant."""

        capture_layers = capture

        def forward(self, token_ids, engram_ids, positions):
            return model.opaque_cache_hidden_states(token_ids, engram_ids, attention(model, positions),
                                                    capture_layers=self.capture_layers)

    compiled = torch.compile(Body(), backend="eager", fullgraph=True, dynamic=True)
    eager_cache, compiled_cache = model.new_cache(), model.new_cache()
    for start, stop in [(0, 16), (16, 17), (17, 18), (18, 24)]:
        rows = ids[start:stop]
        eager_chunk = SequenceChunk(0, stop - start, start, eager_cache)
        expected = model.hidden_states(rows, [eager_chunk], capture_layers=capture)
        eager_cache.advance(rows)
        chunks = [SequenceChunk(0, stop - start, start, compiled_cache)]
        engram_ids = model.hasher(rows, store_of(chunks, model.args.sliding_window).ngram_histories(chunks),
                                  [stop - start])
        _step.update(model=model, chunks=chunks)
        with torch.no_grad():
            actual, captured = compiled(rows, engram_ids, torch.arange(start, stop))
        compiled_cache.advance(rows)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        assert captured.keys() == eager_chunk.published["streams_in"].keys() == set(capture)
        for layer, streams in captured.items():
            torch.testing.assert_close(streams, eager_chunk.published["streams_in"][layer], atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_body_with_image_embeddings_compiles_and_matches_eager(tiny256):
    """Engines embed a step's images before the graph (``input_embeddings``) and pass the embeddings in: span
    positions then route with bias_vl and skip Engram inside the compiled body, as in ``hidden_states``; one step
    ends inside the span."""
    model = tiny256
    span = model.embed_image(torch.randn(7 * 8, 3, 14, 14, generator=torch.Generator().manual_seed(0)), 7, 8)
    ids = torch.cat((prompt(8, 6), torch.full((span.shape[0],), model.args.image_token_id), prompt(6, 7)))
    torch._dynamo.reset()
    counters.clear()

    def body(token_ids, engram_ids, positions, inputs_embeds):
        return model.opaque_cache_hidden_states(token_ids, engram_ids, attention(model, positions), inputs_embeds)

    compiled = torch.compile(body, backend="eager", fullgraph=True, dynamic=True)
    eager_cache, compiled_cache = model.new_cache(), model.new_cache()
    for start, stop in [(0, 14), (14, 26), (26, 27), (27, ids.numel())]:
        rows = ids[start:stop]
        before = int((ids[:start] == model.args.image_token_id).sum())
        image_rows = span[before: before + int((rows == model.args.image_token_id).sum())]
        expected = model.hidden_states(rows, [SequenceChunk(0, stop - start, start, eager_cache)],
                                       image_embeds=image_rows)
        eager_cache.advance(rows)
        chunks = [SequenceChunk(0, stop - start, start, compiled_cache)]
        engram_ids = model.hasher(rows, store_of(chunks, model.args.sliding_window).ngram_histories(chunks),
                                  [stop - start])
        _step.update(model=model, chunks=chunks)
        with torch.no_grad():
            actual, _ = compiled(rows, engram_ids, torch.arange(start, stop), model.input_embeddings(rows, image_rows))
        compiled_cache.advance(rows)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
