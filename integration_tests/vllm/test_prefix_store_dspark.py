"""The retained prefix cache with DSpark speculation on: a stored unit also holds the draft context, and a
restarted server drafts from it. Its own module, so that the two replicas of test_prefix_store.py (idle, but
spin-waiting) are stopped before these servers start."""

from __future__ import annotations

import json

import httpx

from deepinfer_plugins.cli import launch_server, stop_process_group
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL, free_port
from .test_prefix_store import LOGS, counters, settled_counters, store_metric, wait_until


def test_dspark_speculation_resumes_from_a_stored_prefix(checkpoint, core_model, tmp_path):
    """With DSpark on, a unit also holds the draft context (the drafter's keys at every stored position). After a
    restart, the next request recomputes fewer tokens than the window, so its first drafts read context keys that
    came from storage (every read checks the stored position); the answer is the core model's and drafts were made.
    Both servers run eagerly, as the store tests' replicas do: test_dspark.py checks the compiled forward with
    speculation on."""
    spec = {"method": "custom_class", "model": "deepinfer_plugins.vllm.spec_decode.DeepInferDSparkProposer",
            "num_speculative_tokens": 2}
    config = {"kv_connector": "DeepInferStoreConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"store_dir": str(tmp_path / "store")}}

    def start(name: str):
        log = LOGS / f"deepinfer-store-dspark-{name}.log"
        process, base = launch_server(checkpoint, free_port(),
                                      ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name",
                                       MODEL, "--enforce-eager", "--speculative-config", json.dumps(spec),
                                       "--kv-transfer-config", json.dumps(config)], log)
        assert "DSpark speculation" in log.read_text()
        return process, base

    def complete(base: str, prompt: list[int], max_tokens: int) -> list[int]:
        response = httpx.post(f"{base}/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["token_ids"]
        assert answer == generate(core_model, prompt, SamplingParams(max_new_tokens=max_tokens))
        return answer

    window = core_model.args.sliding_window
    prompt = [0] + [300 + (13 * j) % 4000 for j in range(90)]
    process, base = start("first")
    try:
        answer = complete(base, prompt, 6)
        wait_until(lambda: store_metric(base, "units_written") >= 2, "the finished request's unit was not written")
    finally:
        stop_process_group(process)
    process, base = start("restarted")
    try:
        follow_up = prompt + answer + [7, 8]
        before = counters(base)
        complete(base, follow_up, 6)
        after = settled_counters(base, before, hits=1)
        stored = after["hit_tokens"] - before["hit_tokens"]
        assert stored >= len(prompt) + len(answer) - 1 and len(follow_up) - stored < window
        lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
        assert sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("vllm:spec_decode_num_drafts_total")) > 0
    finally:
        stop_process_group(process)
