"""Constrained output through vLLM's structured-output backend, and prefix caching of long prompts.

Guarantees: with thinking off, every json_schema / json_object / regex-constrained answer of the random-weight
model validates (jsonschema / json / re); the constraint is only enforced after the thinking block (a request
with thinking on returns unconstrained reasoning); tool_choice required / named yields schema-valid calls; a
repeated long prompt is served from the prefix cache (vLLM's /metrics counters) and decodes like the reference.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL

OFF = {"chat_template_kwargs": {"thinking": False}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def ask(client, max_tokens=60, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person in json"}],
                                          temperature=0, max_tokens=max_tokens, **kwargs)


def test_json_schema_is_enforced(openai_client):
    out = ask(openai_client, response_format={"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
              extra_body=OFF)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_json_object_is_enforced(openai_client):
    out = ask(openai_client, max_tokens=80, response_format={"type": "json_object"}, extra_body=OFF)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_is_enforced(openai_client):
    pattern = r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\."
    out = ask(openai_client, extra_body={**OFF, "structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, out.choices[0].message.content)


def test_constraint_leaves_thinking_free(openai_client):
    out = ask(openai_client, max_tokens=10, response_format={"type": "json_object"})
    message = out.choices[0].message
    assert getattr(message, "reasoning", None), "with thinking on, the first tokens are unconstrained reasoning"


def metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_repeated_long_prefix_is_served_from_the_prefix_cache(server, openai_client, core_model):
    """The second request resumes from cached blocks (window latents, compressed entries, open compressor
    group, Engram history all come from vLLM's pages) and still decodes exactly like the reference."""
    prompt = "Agent instructions. " + " ".join(f"Rule {i}: keep going and be precise." for i in range(60))
    before = metric(server, "vllm:prefix_cache_hits_total")
    outputs = []
    for _ in range(2):
        out = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=8, temperature=0,
                                                    extra_body={**OFF, "return_token_ids": True}).model_dump()
        outputs.append((out["prompt_token_ids"], out["choices"][0]["token_ids"]))
    hits = metric(server, "vllm:prefix_cache_hits_total") - before
    assert hits >= 256, f"expected the second request to reuse at least one 256-token block, got {hits} hits"
    (prompt_ids, cold), (_, cached) = outputs
    expected = generate(core_model, prompt_ids, SamplingParams(max_new_tokens=8, stop_token_ids=(1,)))
    assert cold == cached == expected



def chat_usage(client, prompt: str, stream: bool) -> dict:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0,
                  extra_body=OFF)
    if not stream:
        usage = client.chat.completions.create(**kwargs).usage.model_dump()
        return {"cached": usage["prompt_tokens_details"]["cached_tokens"], "prompt": usage["prompt_tokens"],
                "hit": usage["prompt_cache_hit_tokens"], "miss": usage["prompt_cache_miss_tokens"]}
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage.model_dump()
    return {"cached": usage["prompt_tokens_details"]["cached_tokens"], "prompt": usage["prompt_tokens"],
            "hit": usage["prompt_cache_hit_tokens"], "miss": usage["prompt_cache_miss_tokens"]}


def responses_usage(client, prompt: str, stream: bool) -> dict:
    kwargs = dict(model=MODEL, input=prompt, max_output_tokens=4, temperature=0)
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        usage = next(e for e in events if e.type == "response.completed").response.usage
    else:
        usage = client.responses.create(**kwargs).usage
    return {"cached": usage.input_tokens_details.cached_tokens, "prompt": usage.input_tokens}


def messages_usage(client, prompt: str, stream: bool) -> dict:
    kwargs = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": prompt}],
                  thinking={"type": "disabled"})
    if stream:
        with client.messages.stream(**kwargs) as events:
            usage = events.get_final_message().usage
    else:
        usage = client.messages.create(**kwargs).usage
    # Anthropic counts the prompt in three parts: read from the cache, written to it, and neither
    return {"cached": usage.cache_read_input_tokens,
            "prompt": usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_usage_reports_the_prefix_cache_hits_the_metrics_count(server, openai_client, anthropic_client, api, stream):
    """A cache-hit input token is priced apart from a miss, so every API reports the hits in its usage, equal to
    what vLLM's prefix-cache counter saw for that request; Chat also splits the prompt DeepSeek's way."""
    ask_usage, client = {"chat": (chat_usage, openai_client), "responses": (responses_usage, openai_client),
                         "messages": (messages_usage, anthropic_client)}[api]
    prompt = f"Usage check {api} {stream}. " + " ".join(f"Step {i}: count the cached tokens." for i in range(60))
    reported = []
    for _ in range(2):
        before = metric(server, "vllm:prefix_cache_hits_total")
        usage = ask_usage(client, prompt, stream)
        reported.append((usage, metric(server, "vllm:prefix_cache_hits_total") - before))
    (cold, cold_hits), (warm, warm_hits) = reported
    assert warm["cached"] == warm_hits >= 256, "the repeated prompt resumes from at least one 256-token block"
    assert cold["cached"] == cold_hits < warm["cached"] and warm["prompt"] == cold["prompt"]
    if api == "chat":
        for usage in (cold, warm):
            assert (usage["hit"], usage["miss"]) == (usage["cached"], usage["prompt"] - usage["cached"])


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"type": "string", "enum": ["C", "F"]}},
                  "required": ["city", "unit"]}  # strict: every property required, as the API demands
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "strict": True,
                                           "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                                          "required": ["zone"]}}}]


def test_required_tool_choice_is_enforced_with_the_tool_schemas(openai_client):
    out = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0, extra_body=OFF)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_calls_that_tool(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200, temperature=0,
        extra_body=OFF)
    names, arguments = [], {}
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function.name:
                names.append(call.function.name)
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert names and set(names) == {"get_time"}
    for text in arguments.values():
        jsonschema.validate(json.loads(text), TOOLS[1]["function"]["parameters"])
