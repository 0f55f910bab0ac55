"""Bad input gets a 4xx with a message and the server keeps serving; concurrency and disconnects are safe.

Guarantees: every malformed request class below is answered 400/422 with an error message (never 5xx, never a
hang), and the next good request is answered; 16 concurrent streams with distinct prompts each receive
exactly the output they get when run alone (greedy); a client that disconnects mid-stream leaves the server
healthy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import MODEL

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

BAD_REQUESTS = {
    "unknown role": {**GOOD, "messages": [{"role": "wizard", "content": "Hi"}]},
    "invalid tool schema": {**GOOD, "tools": [{"type": "function", "function": {"parameters": "nope"}}]},
    "tool_choice names an unknown tool": {**GOOD, "tools": [TOOL],
                                          "tool_choice": {"type": "function", "function": {"name": "missing"}}},
    "max_tokens beyond the context": {**GOOD, "max_tokens": 10**6},
    "wrong type": {**GOOD, "temperature": "hot"},
    "messages missing": {"model": MODEL, "max_tokens": 4},
    "tool_choice required with thinking on": {**GOOD, "tools": [TOOL], "tool_choice": "required"},
    "image that cannot be decoded": {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
}


def test_malformed_json_is_a_400(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500
    assert httpx.post(f"{server}/v1/chat/completions", json=GOOD, timeout=60).status_code == 200


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_gets_4xx_and_the_server_keeps_serving(server, name):
    r = httpx.post(f"{server}/v1/chat/completions", json=BAD_REQUESTS[name], timeout=60)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:500])
    assert r.json().get("error", {}).get("message") or r.json().get("message") or r.json().get("detail")
    assert httpx.post(f"{server}/v1/chat/completions", json=GOOD, timeout=60).status_code == 200


def stream_text(client, prompt: str) -> str:
    parts = []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=12, temperature=0, stream=True,
                                                extra_body={"chat_template_kwargs": {"thinking": False}}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_sixteen_concurrent_streams_get_their_own_output(openai_client):
    prompts = [f"Request number {i}: say something about {i * 7 + 3}" for i in range(16)]
    alone = [stream_text(openai_client, p) for p in prompts]
    assert len(set(alone)) > 1, "distinct prompts should give distinct outputs"
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: stream_text(openai_client, p), prompts))
    assert together == alone


def test_client_disconnect_mid_stream_leaves_the_server_healthy(server):
    body = {**GOOD, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert httpx.post(f"{server}/v1/chat/completions", json=GOOD, timeout=60).status_code == 200
