"""Prefill/decode disaggregation through vLLM's NixlConnector (UCX over the CPU), with vllm-router in front: a
prefill server computes the prompt, a decode server receives every cache the model keeps (window records,
compressed records and index keys, the compressor's open group, Engram inputs) and continues from them.

Guarantees: the decode server's greedy continuation equals the core ``generate()`` on the same prompt, for
prompts far longer than the window and crossing compression groups; every prompt token but the ones the decode
server recomputes arrives by transfer (vLLM's ``prompt_tokens_by_source`` counters); the same holds through
``vllm-router --vllm-pd-disaggregation``; a decode server restarted mid-run takes handoffs again. Both servers
run eagerly: compiled serving is checked against eager serving in test_compile.py, and two compilations would
double this file's time.

Two servers on a two-core box need docs/multi_replica.md#on-a-cpu: each server runs one OpenMP thread and is
confined to its own core, since both spin-wait (NIXL's progress thread, vLLM's worker queue) and on shared cores
starve each other."""

from __future__ import annotations

import os
import subprocess
from functools import partial
from pathlib import Path

import httpx
import pytest

from deepinfer_plugins.cli import cpu_share, launch_server, stop_process_group, wait_ready
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL, free_port, installed_command, launch_side_by_side

pytest.importorskip("nixl", reason="NixlConnector needs the nixl package (integration_tests/setup_vllm_venv.sh)")

OFF = {"chat_template_kwargs": {"thinking": False}}
LOGS = Path(os.environ.get("DEEPINFER_SERVER_LOG", "/tmp/deepinfer-integration-server.log")).parent
TRANSFER = ('{{"kv_connector": "NixlConnector", "kv_role": "{role}", "kv_buffer_device": "cpu", '
            '"kv_connector_extra_config": {{"kv_lease_duration": 120}}}}')
ROLES = ("kv_producer", "kv_consumer")


def start(checkpoint: Path, role: str, cpus: set[int], extra: tuple[str, ...] = (), log_name: str = ""):
    """A prefill or decode server (``extra``: more flags, logged to deepinfer-<log_name or role>.log)."""
    return launch_server(
        checkpoint, free_port(),
        ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", MODEL, "--enforce-eager",
         "--kv-transfer-config", TRANSFER.format(role=role), *extra],
        LOGS / f"deepinfer-{log_name or role}.log",
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
             "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        cpus=cpus)


def handoff(prefill: str, decode: str, body: dict, max_tokens: int) -> httpx.Response:
    handed = httpx.post(f"{prefill}/v1/chat/completions", timeout=300,
                        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    handed.raise_for_status()
    return httpx.post(f"{decode}/v1/chat/completions", timeout=300,
                      json={**body, "max_tokens": max_tokens, "return_token_ids": True,
                            "kv_transfer_params": handed.json()["kv_transfer_params"]})


def chat_body(rules: int) -> dict:
    text = " ".join(f"Rule {i}: hand the cache over." for i in range(rules))
    return {"model": MODEL, "temperature": 0, **OFF, "messages": [{"role": "user", "content": text}]}


def connect(prefill: str, decode: str) -> None:
    """Hand a short prompt over until it works: the first handoff also runs NIXL's handshake, whose reply vLLM
    waits for 5 s at most; a loaded box can miss that, and the next handoff handshakes again."""
    for _ in range(3):
        if handoff(prefill, decode, chat_body(2), 1).status_code == 200:
            return
    pytest.fail(f"no handoff succeeded; see {LOGS}/deepinfer-kv_consumer.log")


@pytest.fixture(scope="module")
def servers(checkpoint):
    """[prefill, decode] as (process, base URL); a test may replace the decode server."""
    running = launch_side_by_side([partial(start, checkpoint, role) for role in ROLES])
    try:
        connect(running[0][1], running[1][1])
        yield running
    finally:
        for process, _ in running:
            stop_process_group(process)


@pytest.fixture
def prefill_and_decode(servers):
    return servers[0][1], servers[1][1]


def tokens_by_source(base: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            counts[source] = counts.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def new_tokens(before: dict, after: dict) -> dict[str, float]:
    """Prompt tokens per source (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``) since ``before``."""
    return {source: count - before.get(source, 0) for source, count in after.items()}


@pytest.mark.parametrize("rules", [6, 60], ids=["short", "long"])
def test_decode_continues_from_the_transferred_caches(prefill_and_decode, core_model, rules):
    prefill, decode = prefill_and_decode
    before = tokens_by_source(decode)
    response = handoff(prefill, decode, chat_body(rules), 12)
    assert response.status_code == 200, response.text
    out = response.json()
    sources = new_tokens(before, tokens_by_source(decode))
    prompt_ids, output_ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
    assert len(prompt_ids) > 8 * 4, "longer than the tiny model's window, across compression groups"
    assert sum(sources.values()) == len(prompt_ids)
    assert sources.get("local_compute", 0) <= 1, "decode recomputes at most the last prompt token"
    assert sources.get("external_kv_transfer", 0) >= len(prompt_ids) // 2, sources
    assert output_ids == generate(core_model, prompt_ids, SamplingParams(max_new_tokens=12, stop_token_ids=(1,)))


def routed_body() -> dict:
    """A prompt that shares no cached block with the other tests', so every token's source is known."""
    text = " ".join(f"Clause {i}: route the prompt first." for i in range(40))
    return {"model": MODEL, "temperature": 0, **OFF, "messages": [{"role": "user", "content": text}]}


def router_command() -> str:
    router = installed_command("vllm-router")
    if router is None:
        pytest.skip("vllm-router is not installed (integration_tests/setup_vllm_venv.sh)")
    return router


def start_router(router: str, prefill: str, decode: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm-router --vllm-pd-disaggregation`` in front of the pair -> (process, base URL), once it answers."""
    port = free_port()
    process = subprocess.Popen([router, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                                "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port)],
                               start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", process, 120, log)
    except BaseException:
        stop_process_group(process)
        raise
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pd_router(servers):
    process, base = start_router(router_command(), servers[0][1], servers[1][1], LOGS / "deepinfer-pd-router.log")
    try:
        yield base
    finally:
        stop_process_group(process)


def test_router_splits_prefill_and_decode(pd_router, prefill_and_decode, core_model):
    prefill, decode = prefill_and_decode
    prefill_before, decode_before = tokens_by_source(prefill), tokens_by_source(decode)
    response = httpx.post(f"{pd_router}/v1/chat/completions", timeout=300,
                          json={**routed_body(), "max_tokens": 10, "return_token_ids": True})
    assert response.status_code == 200, response.text
    out = response.json()
    prompt_ids = out["prompt_token_ids"]
    at_prefill = new_tokens(prefill_before, tokens_by_source(prefill))
    at_decode = new_tokens(decode_before, tokens_by_source(decode))
    assert at_prefill.get("local_compute", 0) == len(prompt_ids), "the router sent the prompt to prefill"
    assert at_decode.get("local_compute", 0) <= 1, at_decode
    assert at_decode.get("external_kv_transfer", 0) == len(prompt_ids) - at_decode.get("local_compute", 0)
    assert out["choices"][0]["token_ids"] == generate(core_model, prompt_ids,
                                                      SamplingParams(max_new_tokens=10, stop_token_ids=(1,)))


def test_a_restarted_decode_server_takes_handoffs_again(servers, checkpoint, core_model):
    stop_process_group(servers[1][0])
    servers[1] = start(checkpoint, "kv_consumer", cpu_share(ROLES.index("kv_consumer"), len(ROLES)))
    prefill, decode = servers[0][1], servers[1][1]
    connect(prefill, decode)
    response = handoff(prefill, decode, chat_body(30), 8)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["choices"][0]["token_ids"] == generate(core_model, out["prompt_token_ids"],
                                                      SamplingParams(max_new_tokens=8, stop_token_ids=(1,)))
