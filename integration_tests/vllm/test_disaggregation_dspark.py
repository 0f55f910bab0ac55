"""Prefill/decode disaggregation with DSpark speculation on both servers, through vllm-router: the prefill server
also writes the drafter's context keys at every prompt position (a cache group of their own), NIXL carries them
with the target's caches, and the decode server drafts from them at its first step.

Guarantees: the decode server's greedy output equals the core ``generate()`` for a prompt far longer than the
window; every prompt token reaches the decode server by transfer; the decode server drafted (vLLM's
``spec_decode`` counters). Each draft-context read checks the position stored beside the keys (vllm/cache.py),
so context that did not arrive fails the request instead of drafting from stale bytes. Its own module: the plain
pair of test_disaggregation.py is stopped before this pair starts, so each server keeps a core of its own."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import httpx
import pytest

from deepinfer_plugins.cli import stop_process_group
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import launch_side_by_side
from .test_disaggregation import (LOGS, ROLES, chat_body, connect, new_tokens, router_command, start, start_router,
                                  tokens_by_source)
from .test_dspark import metric

pytest.importorskip("nixl", reason="NixlConnector needs the nixl package (integration_tests/setup_vllm_venv.sh)")

SPECULATION = {"method": "custom_class", "model": "deepinfer_plugins.vllm.spec_decode.DeepInferDSparkProposer",
               "num_speculative_tokens": 2}


def start_speculating(checkpoint: Path, role: str, cpus: set[int]):
    process, base = start(checkpoint, role, cpus, ("--speculative-config", json.dumps(SPECULATION)),
                          f"dspark-{role}")
    log = LOGS / f"deepinfer-dspark-{role}.log"
    assert "DSpark speculation" in log.read_text(), f"the {role} server does not speculate; see {log}"
    return process, base


@pytest.fixture(scope="module")
def router_over_pair(checkpoint):
    """(router URL, prefill URL, decode URL) of a DSpark prefill/decode pair behind vllm-router."""
    router = router_command()
    running = launch_side_by_side([partial(start_speculating, checkpoint, role) for role in ROLES])
    (_, prefill), (_, decode) = running
    try:
        connect(prefill, decode)
        running.append(start_router(router, prefill, decode, LOGS / "deepinfer-dspark-pd-router.log"))
        yield running[-1][1], prefill, decode
    finally:
        for process, _ in running:
            stop_process_group(process)


def drafts_made(base: str) -> float:
    return metric(httpx.get(f"{base}/metrics", timeout=10).text, "vllm:spec_decode_num_drafts_total")


def test_decode_drafts_from_the_transferred_draft_context(router_over_pair, core_model):
    router, prefill, decode = router_over_pair
    before, drafts_before = tokens_by_source(decode), drafts_made(decode)
    response = httpx.post(f"{router}/v1/chat/completions", timeout=300,
                          json={**chat_body(60), "max_tokens": 12, "return_token_ids": True})
    assert response.status_code == 200, response.text
    out = response.json()
    prompt_ids = out["prompt_token_ids"]
    assert len(prompt_ids) > 8 * core_model.args.sliding_window, "far past the tiny model's window"
    at_decode = new_tokens(before, tokens_by_source(decode))
    assert at_decode.get("local_compute", 0) <= 1, at_decode
    assert at_decode.get("external_kv_transfer", 0) == len(prompt_ids) - at_decode.get("local_compute", 0)
    assert drafts_made(decode) > drafts_before, "the decode server did not draft"
    assert out["choices"][0]["token_ids"] == generate(core_model, prompt_ids,
                                                      SamplingParams(max_new_tokens=12, stop_token_ids=(1,)))
