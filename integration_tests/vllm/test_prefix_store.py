"""The retained prefix cache on shared storage (``DeepInferStoreConnector``): two ``vllm serve`` replicas with the
plugin on one store directory, set up with nothing but vLLM's own ``--kv-transfer-config`` flag, with vLLM's
NixlConnector beside the store under its MultiConnector (where nixl is installed).

Guarantees: a conversation stored by one server is served from storage by another server and by the same server
after a restart (vLLM's prefix cache is empty in both), with the core model's greedy output; the hit covers at
least the earlier turn's prompt, and what the caller is told (``cached_tokens``, ``prompt_cache_hit_tokens``,
``cache_read_input_tokens``) equals what the store's metrics count. A unit past its retention is not served; a
corrupted, truncated or foreign unit is a miss with a warning and the answer is still the core model's; two
servers storing the same conversation at once leave intact units. Beside the store, one replica hands a prompt
over to the other through NIXL, with the core model's output."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from deepinfer_plugins.cli import cpu_share, launch_server, stop_process_group
from deepinfer_plugins.kvstore import PrefixKey, PrefixStore
from deepinfer_plugins.kvstore.unit import encode, read_header
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL, free_port, launch_side_by_side

LOGS = Path(os.environ.get("DEEPINFER_SERVER_LOG", "/tmp/deepinfer-integration-server.log")).parent
OFF = {"chat_template_kwargs": {"thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
MAX_TOKENS = 4


NIXL = importlib.util.find_spec("nixl") is not None


def serve(checkpoint, store_dir: Path, name: str, cpus: set[int]):
    """A replica on the store; where NIXL is installed, with vLLM's NixlConnector beside the store under its
    MultiConnector (both ``kv_both``), as a replica that also hands prompts over to decode servers runs."""
    config = {"kv_connector": "DeepInferStoreConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"store_dir": str(store_dir), "sweep_interval_s": 2}}
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if NIXL:  # imported here: test_disaggregation skips its whole module without nixl
        from .test_disaggregation import TRANSFER

        nixl = json.loads(TRANSFER.format(role="kv_both"))
        config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"connectors": [config, nixl]}}
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    return launch_server(checkpoint, free_port(),
                         ["--dtype", "float32", "--max-model-len", "4096", "--served-model-name", MODEL,
                          "--enforce-eager", "--kv-transfer-config", json.dumps(config)],
                         LOGS / f"deepinfer-store-{name}.log", env=env, cpus=cpus)


class Servers:
    """Replica A and replica B on one store; A can be restarted."""

    def __init__(self, checkpoint, store_dir: Path):
        self.checkpoint, self.store_dir = checkpoint, store_dir
        (self.a_process, self.a), (self.b_process, self.b) = launch_side_by_side(
            [partial(serve, checkpoint, store_dir, name) for name in ("a", "b")])

    def restart_a(self) -> None:
        stop_process_group(self.a_process)
        self.a_process, self.a = serve(self.checkpoint, self.store_dir, "a-restarted", cpu_share(0, 2))

    def stop(self) -> None:
        for process in (self.a_process, self.b_process):
            stop_process_group(process)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    servers = Servers(checkpoint, tmp_path_factory.mktemp("kv-store"))
    yield servers
    servers.stop()


def store_metric(base: str, name: str) -> float:
    """A counter of the store (summed over engines), 0 before its first increment."""
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"vllm:deepinfer_kv_store_{name}_total"))


def counters(base: str) -> dict[str, float]:
    """The store's counters, and ``local``: the tokens vLLM's own prefix cache served (shared system prompt)."""
    names = ("hits", "hit_tokens", "misses", "invalid", "units_written")
    found = {name: store_metric(base, name) for name in names}
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    found["local"] = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                         if line.startswith("vllm:prefix_cache_hits_total"))
    found["external"] = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                            if line.startswith("vllm:external_prefix_cache_hits_total"))
    return found


def cached_tokens_split(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(tokens from storage, tokens from vLLM's own prefix cache) of the one request between two readings."""
    return after["hit_tokens"] - before["hit_tokens"], after["local"] - before["local"]


def settled_counters(base: str, before: dict[str, float], **expected_increase: float) -> dict[str, float]:
    """vLLM publishes connector stats with the step after the one that counted them: poll briefly."""
    deadline = time.monotonic() + 20
    while True:
        now = counters(base)
        if all(now[name] - before[name] >= amount for name, amount in expected_increase.items()):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def wait_until(condition, failure: str) -> None:
    """Units are written and swept by the servers' own steps and threads: poll up to 20 s."""
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.5)


def conversation(topic: str) -> list[dict]:
    """An agent conversation (tools defined) of about 1.2K prompt tokens: four store anchors (256 tokens) and nine
    compression groups of the coarsest ratio (128)."""
    notes = " ".join(f"Finding {i} about the {topic}: module {i % 17} calls helper {i % 5} twice."
                     for i in range(56))
    return [{"role": "system", "content": f"The {topic} is under review. You review code and may read files."},
            {"role": "user", "content": f"Review the {topic}. {notes}"}]


def chat(base: str, messages: list[dict], **extra) -> dict:
    response = httpx.post(f"{base}/v1/chat/completions", timeout=600,
                          json={"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                "return_token_ids": True, "messages": messages, "tools": TOOLS, **OFF, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def next_turn(messages: list[dict], answer: dict) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Which finding matters most?"}]


def assert_core_answer(core_model, reply: dict) -> None:
    assert reply["choices"][0]["token_ids"] == generate(core_model, reply["prompt_token_ids"],
                                                        SamplingParams(max_new_tokens=MAX_TOKENS))


def the_store(servers) -> PrefixStore:
    (tag,) = [p.name for p in servers.store_dir.iterdir()]
    return PrefixStore(servers.store_dir, tag)


def unit_of(servers, token_ids: list[int], num_tokens: int) -> Path:
    store = the_store(servers)
    return store.unit_path(PrefixKey(store.model, token_ids).digest(num_tokens))


@pytest.mark.skipif(not NIXL, reason="NixlConnector needs the nixl package (integration_tests/setup_vllm_venv.sh)")
def test_beside_the_store_a_replica_hands_a_prompt_over_through_nixl(servers, core_model):
    """Under MultiConnector the store and NIXL share the replicas: A prefills, B decodes from the transferred
    caches with the core model's output, and A still stores the prompt it computed."""
    from .test_disaggregation import chat_body, connect, handoff, new_tokens, tokens_by_source

    connect(servers.a, servers.b)
    written, before = store_metric(servers.a, "units_written"), tokens_by_source(servers.b)
    response = handoff(servers.a, servers.b, chat_body(60), 8)
    assert response.status_code == 200, response.text
    out = response.json()
    prompt_ids = out["prompt_token_ids"]
    at_b = new_tokens(before, tokens_by_source(servers.b))
    assert at_b.get("local_compute", 0) <= 1 and at_b.get("external_kv_transfer", 0) >= len(prompt_ids) - 1, at_b
    assert out["choices"][0]["token_ids"] == generate(core_model, prompt_ids,
                                                      SamplingParams(max_new_tokens=8, stop_token_ids=(1,)))
    wait_until(lambda: store_metric(servers.a, "units_written") > written, "A stored nothing of the handed prompt")


def test_a_conversation_stored_by_one_replica_is_served_from_storage_by_the_other(servers, core_model):
    messages = conversation("parser")
    before_a = counters(servers.a)
    first = chat(servers.a, messages)
    settled_counters(servers.a, before_a, units_written=2)
    assert unit_of(servers, first["prompt_token_ids"], len(first["prompt_token_ids"])).exists()

    before = counters(servers.b)
    reply = chat(servers.b, next_turn(messages, first))
    after = settled_counters(servers.b, before, hits=1)
    usage = reply["usage"]
    stored, local = cached_tokens_split(before, after)
    assert after["hits"] - before["hits"] == 1 and after["external"] - before["external"] == stored
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_cache_hit_tokens"] == stored + local
    assert stored + local >= len(first["prompt_token_ids"])
    assert reply["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    assert_core_answer(core_model, reply)


def test_a_restarted_replica_serves_the_next_turn_from_storage(servers, core_model):
    messages = conversation("scheduler")
    first = chat(servers.a, messages)
    servers.restart_a()
    before = counters(servers.a)
    reply = chat(servers.a, next_turn(messages, first))
    after = settled_counters(servers.a, before, hits=1)
    assert after["hits"] - before["hits"] == 1
    stored, local = cached_tokens_split(before, after)
    assert local == 0  # nothing of this conversation was computed since the restart
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == stored >= len(first["prompt_token_ids"])
    assert_core_answer(core_model, reply)


def test_messages_streamed_report_the_storage_hit_as_cache_read_tokens(servers):
    from anthropic import Anthropic

    body = dict(model=MODEL, max_tokens=MAX_TOKENS, system="You review code.",
                tools=[{"name": "read_file", "description": "Read a file.",
                        "input_schema": TOOLS[0]["function"]["parameters"]}], thinking={"type": "disabled"})
    messages = [conversation("router")[1]]
    client_a = Anthropic(base_url=servers.a, api_key="unused", max_retries=0)
    client_b = Anthropic(base_url=servers.b, api_key="unused", max_retries=0)
    first = client_a.messages.create(**body, messages=messages)
    before = counters(servers.b)
    turn = [*messages, {"role": "assistant", "content": first.content},
            {"role": "user", "content": "Which finding matters most?"}]
    with client_b.messages.stream(**body, messages=turn) as events:
        usage = events.get_final_message().usage
    after = settled_counters(servers.b, before, hits=1)
    assert after["hits"] - before["hits"] == 1
    stored, local = cached_tokens_split(before, after)
    assert usage.cache_read_input_tokens == stored + local
    assert stored + local >= first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


def test_a_unit_past_its_retention_is_not_served(servers, core_model):
    messages = conversation("allocator")
    # long enough to outlive the rest of the request on a loaded box (the unit is written when the prompt is done)
    first = chat(servers.a, messages, kv_transfer_params={"retention_s": 3})
    unit = unit_of(servers, first["prompt_token_ids"], len(first["prompt_token_ids"]))
    assert unit.exists()
    time.sleep(4)
    before = counters(servers.b)
    reply = chat(servers.b, next_turn(messages, first))
    after = settled_counters(servers.b, before, misses=1)
    assert after["hits"] == before["hits"] and after["misses"] - before["misses"] == 1
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_tokens_split(before, after)[1]
    assert_core_answer(core_model, reply)
    wait_until(lambda: not unit.exists(), "the expired unit was never swept")  # sweepers run every 2 s here


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def another_models_unit(path: Path) -> None:
    """Intact, with a valid checksum, but of another model (a shared directory misused, a file copied over)."""
    data = path.read_bytes()
    header, offset = read_header(data)
    payloads = []
    for array in header.arrays:
        payloads.append(data[offset: offset + array.nbytes])
        offset += array.nbytes
    path.write_bytes(encode(type(header)("another-model", header.prefix, header.anchor, header.num_tokens,
                                         header.retention_s, header.arrays), payloads))


@pytest.mark.parametrize("damage", [flip_a_byte, cut_short, another_models_unit])
def test_a_damaged_unit_is_a_miss_and_the_answer_is_the_core_models(servers, core_model, damage):
    messages = conversation({flip_a_byte: "lexer", cut_short: "linker", another_models_unit: "loader"}[damage])
    first = chat(servers.a, messages)
    prompt = first["prompt_token_ids"]
    tokens = prompt + first["choices"][0]["token_ids"]
    units = [unit_of(servers, tokens, n) for n in (len(prompt), len(prompt) + MAX_TOKENS - 1)]
    wait_until(lambda: all(unit.exists() for unit in units), "units never written")
    for unit in units:
        damage(unit)
    before = counters(servers.b)
    reply = chat(servers.b, next_turn(messages, first))
    after = settled_counters(servers.b, before, misses=1)
    assert after["hits"] == before["hits"] and after["invalid"] > before["invalid"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_tokens_split(before, after)[1]
    assert_core_answer(core_model, reply)
    assert "is not served" in (LOGS / "deepinfer-store-b.log").read_text()


def test_two_replicas_storing_one_conversation_at_once_leave_intact_units(servers, core_model):
    messages = conversation("tokenizer")
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda base: chat(base, messages), [servers.a, servers.b]))
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]
    prompt = answers[0]["prompt_token_ids"]
    store = the_store(servers)
    key = PrefixKey(store.model, prompt + answers[0]["choices"][0]["token_ids"])
    for num_tokens in (len(prompt), len(prompt) + MAX_TOKENS - 1):
        wait_until(store.unit_path(key.digest(num_tokens)).exists, f"no unit of {num_tokens} tokens")
        header, _ = store.read(key.digest(num_tokens))
        assert header.num_tokens == num_tokens
    leftovers = [p for p in store.unit_path(key.digest(len(prompt))).parent.iterdir() if p.name.startswith(".")]
    assert not leftovers


def test_agent_traffic_is_kept_three_days_and_chat_seven(servers):
    """Tools in the request make it agent traffic; a request's ``kv_transfer_params.retention_s`` overrides."""
    kept = {}
    cases = (("agent", {}), ("chat", {"tools": None}), ("own", {"kv_transfer_params": {"retention_s": 60}}))
    for name, extra in cases:
        messages = [{"role": "user", "content": f"A short {name} question about retention classes?"}]
        body = {"model": MODEL, "temperature": 0, "max_tokens": 2, "return_token_ids": True, "messages": messages,
                "tools": TOOLS, **OFF, **extra}
        if body["tools"] is None:
            del body["tools"]
        response = httpx.post(f"{servers.a}/v1/chat/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        prompt = response.json()["prompt_token_ids"]
        store = the_store(servers)
        unit = store.unit_path(PrefixKey(store.model, prompt).digest(len(prompt)))
        wait_until(unit.exists, f"no unit for the {name} request")
        kept[name] = store.read(PrefixKey(store.model, prompt).digest(len(prompt)))[0].retention_s
    assert kept == {"agent": 3 * 86400, "chat": 7 * 86400, "own": 60}


@pytest.mark.parametrize("extra, message", [
    ({}, "needs kv_connector_extra_config.store_dir"),
    ({"store_dir": "/x", "retention": 3}, "unknown kv_connector_extra_config keys"),
    ({"store_dir": "/x", "chat_retention_s": -1}, "chat_retention_s must be"),
    ({"store_dir": "/x", "agent_retention_s": "3d"}, "agent_retention_s must be"),
    ({"store_dir": "/x", "capacity_bytes": 0}, "capacity_bytes must be"),
    ({"store_dir": "/x", "sweep_interval_s": 0}, "sweep_interval_s must be"),
])
def test_store_settings_are_checked_at_start_up(extra, message):
    from deepinfer_plugins.vllm.kv_store import StoreConfig

    with pytest.raises(ValueError, match=message):
        StoreConfig.from_extra(extra)


def test_a_unit_is_served_only_for_the_same_image(servers):
    """Two images of one size have equal placeholder tokens: only the image's content identifier tells their
    units apart, and the wrong one would be a silently wrong answer."""
    import base64

    from integration_tests.images import png

    def turn(seed: int) -> list[dict]:
        uri = f"data:image/png;base64,{base64.b64encode(png(seed)).decode()}"
        notes = " ".join(f"Region {i} of the screenshot shows widget {i % 7}." for i in range(150))
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": f"Describe it. {notes}"}]}]

    first = chat(servers.a, turn(1))
    follow_up = [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the colours?"}]
    time.sleep(1)  # the finished request's unit is written in the step after it ends
    before = counters(servers.b)
    other = chat(servers.b, [*turn(2), *follow_up])
    after = settled_counters(servers.b, before, misses=1)
    assert after["hits"] == before["hits"], "another image's unit was served"
    assert other["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"], \
        "the two prompts differ only in the image's pixels"
    before = after
    same = chat(servers.b, [*turn(1), *follow_up])
    after = settled_counters(servers.b, before, hits=1)
    assert after["hits"] - before["hits"] == 1
    stored, local = cached_tokens_split(before, after)
    assert stored > 0 and stored + local >= len(first["prompt_token_ids"])
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == stored + local
