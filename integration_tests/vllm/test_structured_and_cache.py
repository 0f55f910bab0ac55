"""Constrained output through vLLM's structured-output backend, and prefix caching of long prompts.

Guarantees: with thinking off, every json_schema / json_object / regex-constrained answer of the random-weight
model validates (jsonschema / json / re); the constraint is only enforced after the thinking block (a request
with thinking on returns unconstrained reasoning); a repeated long prompt is served from the prefix cache, as
vLLM's own /metrics counters show.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema

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


def test_repeated_long_prefix_is_served_from_the_prefix_cache(server, openai_client):
    prompt = "Agent instructions. " + " ".join(f"Rule {i}: keep going and be precise." for i in range(60))
    before = metric(server, "vllm:prefix_cache_hits_total")
    for _ in range(2):
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=4, temperature=0, extra_body=OFF)
    hits = metric(server, "vllm:prefix_cache_hits_total") - before
    assert hits >= 256, f"expected the second request to reuse at least two 128-token blocks, got {hits} hits"
