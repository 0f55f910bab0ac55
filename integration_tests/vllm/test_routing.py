"""Cache-aware routing across replicas with ``vllm-router --policy cache_aware``: two plain replicas with the
plugin, the router in front, two conversations.

Guarantees: a new conversation that arrives while one replica is busy goes to the idle one; once both are idle,
each conversation's next turn goes to the replica that served it before (not to the replica a tie would pick)
and is answered from that replica's prefix cache (``usage.prompt_tokens_details.cached_tokens``), with the core
model's greedy output. The router matches prefixes on token ids it gets from each replica's render endpoint
(``--enable-scale-out``), so what it matches is the prompt our renderer builds: the render endpoints give the ids
of the recipe's codec of the request's API, as the serving endpoints run them."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from deepinfer_plugins.cli import launch_server, stop_process_group, wait_ready
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL, free_port, installed_command, launch_side_by_side

LOGS = Path(os.environ.get("DEEPINFER_SERVER_LOG", "/tmp/deepinfer-integration-server.log")).parent
OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def replicas_and_router(checkpoint):
    router = installed_command("vllm-router")
    if router is None:
        pytest.skip("vllm-router is not installed (integration_tests/setup_vllm_venv.sh)")

    def start(index: int, cpus: set[int]):  # one OpenMP thread each
        return launch_server(
            checkpoint, free_port(),
            ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", MODEL, "--enforce-eager",
             "--enable-scale-out"],
            LOGS / f"deepinfer-replica-{index}.log",
            env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, cpus=cpus)

    started = launch_side_by_side([partial(start, index) for index in range(2)])
    processes = [process for process, _ in started]
    replicas = [base for _, base in started]
    try:
        port = free_port()
        log = LOGS / "deepinfer-cache-aware-router.log"
        processes.append(subprocess.Popen(
            [router, "--policy", "cache_aware", "--worker-urls", *replicas, "--host", "127.0.0.1",
             "--port", str(port)], start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT))
        wait_ready(f"http://127.0.0.1:{port}", processes[-1], 120, log)
        yield replicas, f"http://127.0.0.1:{port}"
    finally:
        for process in processes:
            stop_process_group(process)


def metric(base: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
               if line.startswith(name))


def chat(router: str, messages: list[dict], max_tokens: int = 4) -> dict:
    response = httpx.post(f"{router}/v1/chat/completions", timeout=300,
                          json={"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                "return_token_ids": True, "messages": messages, **OFF})
    assert response.status_code == 200, response.text
    return response.json()


def served_by(router: str, replicas: list[str], messages: list[dict]) -> tuple[int, dict]:
    """The replica that served a request sent while no other request runs, and its answer."""
    before = [metric(base, "vllm:request_success_total") for base in replicas]
    answer = chat(router, messages)
    served = [i for i, base in enumerate(replicas) if metric(base, "vllm:request_success_total") > before[i]]
    assert len(served) == 1, served
    return served[0], answer


def opening(topic: str) -> list[dict]:
    """A first turn longer than the prefix cache's hit granularity (vLLM logs it as the lcm of block sizes)."""
    notes = " ".join(f"Note {i} on the {topic} stays put." for i in range(80))
    return [{"role": "user", "content": f"About the {topic}: {notes}"}]


def next_turn(messages: list[dict], answer: dict, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": question}]


def test_next_turn_lands_on_the_replica_holding_its_prefix(replicas_and_router, core_model):
    replicas, router = replicas_and_router
    harbour = opening("harbour")
    first, harbour_answer = served_by(router, replicas, harbour)
    other = 1 - first
    harbour = next_turn(harbour, harbour_answer, "And tomorrow?")

    # While the first replica decodes a long answer, a new conversation (no prefix anywhere) goes to the idle one.
    with ThreadPoolExecutor(1) as pool:
        long_answer = pool.submit(chat, router, harbour, 200)
        deadline = time.monotonic() + 120
        while metric(replicas[first], "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline and not long_answer.done(), "the long answer never ran"
            time.sleep(0.2)
        orchard = opening("orchard")
        before = metric(replicas[other], "vllm:request_success_total")
        orchard_answer = chat(router, orchard)
        assert metric(replicas[other], "vllm:request_success_total") == before + 1, "a miss goes to the idle replica"
        harbour_answer = long_answer.result()

    # Both idle now: each conversation's next turn follows its prefix, and hits that replica's prefix cache.
    for messages, answer, replica in ((orchard, orchard_answer, other), (harbour, harbour_answer, first)):
        served, reply = served_by(router, replicas, next_turn(messages, answer, "What changes next week?"))
        assert served == replica, f"conversation served by replica {replica}, its next turn by {served}"
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, reply["usage"]
        assert reply["choices"][0]["token_ids"] == generate(core_model, reply["prompt_token_ids"],
                                                            SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("api, body", [
    ("chat", {"messages": [{"role": "user", "content": "Hello"}], "thinking": {"type": "disabled"}}),
    ("messages", {"max_tokens": 4, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
        {"role": "system", "content": "Answer in French from now on."}, {"role": "user", "content": "Again"}]}),
    ("responses", {"instructions": "Be brief.", "reasoning": {"effort": "none"}, "input": [
        {"role": "developer", "content": "Answer in French."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "One."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Again"}]}),
])
def test_render_endpoint_gives_the_prompt_the_server_runs(replicas_and_router, checkpoint, api, body):
    """The router's prefix tree is built from these ids: they are the recipe's codec of the request's API, as the
    serving endpoint renders it (DeepSeek's ``thinking`` field, a system message inside ``messages``, a developer
    message and two reasoning items of one turn, which vLLM's own conversion refuses or runs together)."""
    import deepinfer_recipe

    from deepinfer_plugins.vllm.patches.patch_api_codecs import chat_request, messages_request, responses_request
    from deepinfer_plugins.vllm.tokenizer import MODEL_NAME

    replica = replicas_and_router[0][0]
    body = {"model": MODEL, **body}
    path = {"chat": "chat/completions", "messages": "messages", "responses": "responses"}[api]
    rendered = httpx.post(f"{replica}/v1/{path}/render", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    codec = {"chat": lambda: chat_request(body, MODEL_NAME), "messages": lambda: messages_request(body, MODEL_NAME),
             "responses": lambda: responses_request(body, [], {}, MODEL_NAME)}[api]()
    want = deepinfer_recipe.render(codec, api, tokenizer=str(checkpoint)).token_ids
    assert rendered.json()["token_ids"] == want
