"""vLLM compiles the model body (deepinfer_plugins/vllm/compiled.py); every paged-cache access is an opaque op.

Guarantees:
  * in-process, the body traced by dynamo with fullgraph=True (as vLLM traces it) over the adapter's paged caches,
    its ops reading the step through vLLM's forward context, has no graph break, and its steps (chunked prefill,
    then batched decodes) give the hidden states of the eager adapter step, and the residual streams the DSpark
    drafter's context is made from;
  * served, the default server compiles (its log reports DYNAMO_TRACE_ONCE and our compiled-body line), and its
    greedy output equals that of an ``--enforce-eager`` server and of the core model's generate(), token for
    token.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters
from vllm.config import CompilationMode
from vllm.forward_context import ForwardContext, override_forward_context

from deepinfer_plugins.cli import launch_server, stop_process_group
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate
from deepinfer_plugins.vllm.compiled import CompiledBody, attach_steps
from deepinfer_plugins.vllm.model import paged_forward
from integration_tests.vllm.conftest import LOG, MODEL, free_port
from integration_tests.vllm.paged_caches import PagedCaches
from integration_tests.vllm.test_paged_state import PROMPTS, schedule

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def eager_vllm_config():
    """What ``CompiledBody``'s decorator reads: mode NONE leaves the class as written, for the test to compile."""
    return SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.NONE, splitting_ops=[]),
                           speculative_config=None)


@torch.no_grad()
def test_body_traces_without_graph_breaks_and_gives_the_eager_steps(core_model):
    args = core_model.args
    eager = PagedCaches(args, len(PROMPTS), 64, torch.Generator().manual_seed(0))
    paged = PagedCaches(args, len(PROMPTS), 64, torch.Generator().manual_seed(0))  # the same stale bytes
    steps = attach_steps(core_model, paged.windows)
    capture = (1, args.num_hidden_layers - 2)
    body = CompiledBody(vllm_config=eager_vllm_config(), core=core_model,
                        layer_names=[owner.layer_name for owner in paged.windows], capture_layers=capture)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(body.forward, backend="eager", fullgraph=True, dynamic=True)
    generator = torch.Generator().manual_seed(1)
    tokens = {r: torch.randint(3, 250, (n + 8,), generator=generator) for r, n in PROMPTS.items()}
    for step in schedule(decode_steps=3):
        work = {r: (first, tokens[r][first: first + n]) for r, (first, n) in step.items()}
        input_ids, positions, metadata = paged.batch(work)
        eager_chunks = paged_forward(args, input_ids, positions, eager.batch(work)[2], eager.windows,
                                     eager.compressed, eager.inputs).chunks
        expected = core_model.hidden_states(input_ids, eager_chunks, capture_layers=capture)
        context = ForwardContext(no_compile_layers=paged.static_forward_context, attn_metadata=metadata,
                                 slot_mapping={})
        with override_forward_context(context):
            forward = steps.begin(lambda m: paged_forward(args, input_ids, positions, m, paged.windows,
                                                          paged.compressed, paged.inputs))
            actual, captured = compiled(input_ids, positions)
            forward.audit.verify()
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        assert captured.keys() == set(capture)
        for layer, streams in captured.items():
            torch.testing.assert_close(streams, torch.cat([c.published["streams_in"][layer] for c in eager_chunks]),
                                       atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def greedy(client, max_tokens: int = 24) -> tuple[list[int], list[int]]:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}, "return_token_ids": True}).model_dump()
    return out["prompt_token_ids"], out["choices"][0]["token_ids"]


def test_default_server_compiles_and_equals_the_eager_server_and_core(openai_client, checkpoint, core_model,
                                                                       tmp_path):
    from openai import OpenAI

    prompt_ids, compiled_ids = greedy(openai_client)
    log = LOG.read_text()
    assert "'mode': <CompilationMode.DYNAMO_TRACE_ONCE" in log and "vLLM compiles the model body" in log
    eager_log = tmp_path / "eager-server.log"
    process, base = launch_server(checkpoint, free_port(), ["--dtype", "float32", "--max-model-len", "2048",
                                                            "--served-model-name", MODEL, "--enforce-eager"],
                                  eager_log)
    try:
        eager_prompt_ids, eager_ids = greedy(OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                                    timeout=120))
    finally:
        stop_process_group(process)
    assert "'mode': <CompilationMode.NONE" in eager_log.read_text()
    assert "the model body runs eagerly" in eager_log.read_text()
    assert eager_prompt_ids == prompt_ids
    assert compiled_ids == eager_ids
    assert compiled_ids == generate(core_model, prompt_ids, SamplingParams(max_new_tokens=24, stop_token_ids=(1,)))
