"""Served prompts are the codec's of the request's own API (vllm/patches/patch_api_codecs.py).

Guarantees: for requests of the recipe's own generators (every message, input item, content-part and block kind,
reasoning and thinking history, namespace and custom tools, tool results, developer and inline system messages),
the Chat and Responses prompt token ids the server runs are the ids ``deepinfer_recipe.render(request, api)``
gives, and the Messages prompt has the length of the recipe's (vLLM's Messages endpoint reports no prompt ids),
which the recipe's differential suite holds equal to the official package's; a request the recipe refuses is
refused with its message; vLLM's ``chat_template_kwargs`` thinking switch renders as the API's own; images reach
the engine in placeholder order; a body vLLM's own request models refuse before any rendering is refused with the
codec's message where the codec refuses it too, and no generated request the recipe renders is refused.
"""

from __future__ import annotations

import copy
import random
import re
import sys
from pathlib import Path

import httpx
import pytest

import deepinfer_recipe
from deepinfer_plugins.vllm.patches.patch_api_codecs import codec_request
from deepinfer_plugins.vllm.vision import PLACEHOLDER

from ..images import png
from .conftest import MODEL
from .test_vision import data_uri

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipe" / "tests"))
import gen  # noqa: E402  (the recipe's request generators)

SEEDS = range(32)


def sent_body(api: str, body: dict) -> dict:
    body = {**copy.deepcopy(body), "model": MODEL, "stream": False}
    body.pop("stream_options", None)
    if api == "responses":
        body.update(max_output_tokens=1, enable_response_messages=True)
    elif api == "chat":
        body.update(max_tokens=1, return_token_ids=True)
        body.pop("max_completion_tokens", None)
    else:
        body["max_tokens"] = 1
    return body


def recipe(api: str, body: dict, checkpoint: Path):
    try:
        return deepinfer_recipe.render(codec_request(api, body), api, tokenizer=str(checkpoint))
    except deepinfer_recipe.RecipeError as exc:
        return exc


ENDPOINTS = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}


def post(server: str, api: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{ENDPOINTS[api]}", json=body, timeout=120)


def served_prompt(api: str, response: httpx.Response) -> list[int] | int:
    """Chat and Responses: the prompt's token ids; Messages: its length (Anthropic's ``input_tokens`` leaves out
    the tokens written to and read from the prompt cache, which vLLM counts in whole blocks)."""
    if api == "chat":
        return response.json()["prompt_token_ids"]
    if api == "responses":
        return response.json()["input_messages"][0]["tokens"]
    usage = response.json()["usage"]
    return usage["input_tokens"] + sum(usage.get(key) or 0 for key in ("cache_creation_input_tokens",
                                                                        "cache_read_input_tokens"))


def wanted_prompt(api: str, rendered) -> list[int] | int:
    return len(rendered.token_ids) if api == "messages" else rendered.token_ids


def error_message(response: httpx.Response) -> str:
    error = response.json().get("error", {})
    return error.get("message", "") if isinstance(error, dict) else str(error)


def generated(api: str) -> list[tuple[str, dict]]:
    cases = []
    for seed in SEEDS:
        cases.append(("plain", getattr(gen, api)(random.Random(seed))))
        cases.append(gen.shape(api, random.Random(10_000 + seed), count=False))
        cases.append(gen.boundary(api, random.Random(20_000 + seed), count=False))
    return cases


def generated_everywhere(api: str, seeds=range(150)) -> list[tuple[str, dict]]:
    """(class, request) from each of the recipe's generators of ``api`` (those of its differential suite, with
    the default conversion options)."""
    cases = []
    for seed in seeds:
        cases += [("plain", getattr(gen, api)(random.Random(seed))),
                  gen.shape(api, random.Random(10_000 + seed), count=False),
                  gen.boundary(api, random.Random(20_000 + seed), count=False),
                  gen.tool_schemas(api, random.Random(40_000 + seed)),
                  ("images", gen.images(api, random.Random(60_000 + seed))),
                  ("deferred tools", gen.deferred_tools(api, random.Random(70_000 + seed)))]
        if api != "messages":  # strict schemas are a Chat and Responses notion
            cases.append(gen.strict(api, random.Random(30_000 + seed)))
        kinds, body, options = gen.combined(api, random.Random(50_000 + seed))
        if options is None:
            cases.append(("+".join(kinds), body))
        if api == "responses":
            cases.append(("tool search", gen.tool_search(random.Random(80_000 + seed))))
    return cases


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_generated_requests_run_the_recipes_prompt(server, checkpoint, api):
    """Plain, reshaped and boundary requests: each the recipe renders runs its prompt, each it refuses is refused
    with its message, whether vLLM's request model or the codec refused it first (patch_validation_errors)."""
    matched, refused, mismatched = [], [], []
    for kind, body in generated(api):
        body = sent_body(api, body)
        want = recipe(api, body, checkpoint)
        if not isinstance(want, deepinfer_recipe.RecipeError) and want.images:
            continue  # the generators' images are not fetchable; images have their own test below
        got = post(server, api, body)
        if isinstance(want, deepinfer_recipe.RecipeError):
            assert got.status_code == 400, (kind, want.message, got.text)
            assert want.message in error_message(got), (kind, want.message, error_message(got))
            refused.append(kind)
        else:
            assert got.status_code == 200, (kind, got.text)
            (matched if served_prompt(api, got) == wanted_prompt(api, want) else mismatched).append(kind)
    assert not mismatched, f"served prompts that differ from the recipe's: {mismatched}"
    assert len(matched) >= 16 and refused, (matched, refused)


def test_responses_developer_message_and_reasoning_items(server, checkpoint):
    """Two classes the chat-message form lost: a developer message (a Chat role the codecs refuse) and two
    reasoning items of the turn in progress, which the Responses codec joins with a newline."""
    body = sent_body("responses", {"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {}}}], "input": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "first"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "second"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    want = recipe("responses", body, checkpoint)
    assert "<think>first\nsecond</think>" in want.prompt and "Answer in French." in want.prompt
    got = post(server, "responses", body)
    assert got.status_code == 200, got.text
    assert served_prompt("responses", got) == want.token_ids


def test_messages_inline_system_and_thinking_blocks(server, checkpoint):
    """A system message inside ``messages`` (vLLM merged it into the leading system prompt) and two thinking
    blocks of the turn in progress, which the Messages codec joins with a blank line."""
    body = sent_body("messages", {"system": "Be brief.", "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "system", "content": "Answer in French from now on."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "first", "signature": "s"},
                                          {"type": "thinking", "thinking": "second", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}]})
    want = recipe("messages", body, checkpoint)
    assert "first\n\nsecond" in want.prompt and "<｜User｜>Hello<｜System｜>Answer in French" in want.prompt
    got = post(server, "messages", body)
    assert got.status_code == 200, got.text
    assert served_prompt("messages", got) == len(want.token_ids)
    counted = httpx.post(f"{server}/v1/messages/count_tokens",
                         json={key: value for key, value in body.items() if key not in ("max_tokens", "stream")})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == len(want.token_ids)


@pytest.mark.parametrize("template_kwargs", [{"thinking": False}, {"enable_thinking": False}])
def test_thinking_switch_of_vllm_renders_as_the_apis_own(server, checkpoint, template_kwargs):
    body = sent_body("responses", {"input": "Hello", "chat_template_kwargs": template_kwargs})
    want = recipe("responses", body, checkpoint)
    assert want.prompt.endswith("</think>")
    got = post(server, "responses", body)
    assert got.status_code == 200 and served_prompt("responses", got) == want.token_ids


def test_responses_images_run_the_recipes_prompt(server, checkpoint, core_model):
    """vLLM replaces each image placeholder by the image's span (every span token at the image token id), in
    order."""
    first, second = data_uri(png(1)), data_uri(png(2, size=(20, 50)))
    body = sent_body("responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": first}, {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": second, "detail": "low"}]}]})
    want = recipe("responses", body, checkpoint)
    assert len(want.images) == 2
    got = post(server, "responses", body)
    assert got.status_code == 200, got.text
    placeholder = deepinfer_recipe.PromptTokenizer.load(str(checkpoint)).special_id(PLACEHOLDER)
    served = served_prompt("responses", got)
    assert spans_collapsed(served, core_model.args.image_token_id, placeholder) == want.token_ids
    assert len(served) > len(want.token_ids)


def spans_collapsed(ids: list[int], span_id: int, placeholder_id: int) -> list[int]:
    """Each run of image-span tokens as the one placeholder it replaced."""
    return [placeholder_id if token == span_id else token for i, token in enumerate(ids)
            if token != span_id or i == 0 or ids[i - 1] != span_id]


def test_chat_thinking_field_is_the_apis_own(server, checkpoint):
    """DeepSeek's ``thinking`` field, which vLLM's chat request model does not know: the prompt ends out of
    thinking, and the reasoning parser, which reads the prompt's end, gives the answer as content."""
    body = sent_body("chat", {"messages": [{"role": "user", "content": "Hello"}],
                              "thinking": {"type": "disabled"}})
    body["max_tokens"] = 4
    want = recipe("chat", body, checkpoint)
    assert want.prompt.endswith("</think>")
    got = post(server, "chat", body)
    assert got.status_code == 200 and served_prompt("chat", got) == want.token_ids
    message = got.json()["choices"][0]["message"]
    assert message["content"] and not message.get("reasoning_content") and not message.get("reasoning")


def test_responses_tool_search_items(server, checkpoint):
    """A client-run tool search in the history: vLLM's own conversion refused its items ("Unsupported input item
    type"); the Responses codec renders the call and, as the result, the tools it found."""
    body = sent_body("responses", {"tools": [{"type": "tool_search"}], "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "tool_search_call", "call_id": "s1", "arguments": {"query": "weather"}},
        {"type": "tool_search_output", "call_id": "s1", "tools": [
            {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]}]})
    want = recipe("responses", body, checkpoint)
    assert 'invoke name="tool_search"' in want.prompt and "### Updated Tool Schemas" in want.prompt
    got = post(server, "responses", body)
    assert got.status_code == 200, got.text
    assert served_prompt("responses", got) == want.token_ids


def test_chat_regex_response_format(server, checkpoint):
    """A ``regex`` response format, which vLLM's request model did not list (patch_request_models): the prompt is
    the recipe's (that of plain text), the answer follows the regex, and a format without its regex is the
    recipe's 400."""
    body = sent_body("chat", {"messages": [{"role": "user", "content": "Pick a number."}],
                              "thinking": {"type": "disabled"}, "response_format": {"type": "regex",
                                                                                    "regex": "[0-9]{3}"}})
    body["max_tokens"] = 8
    want = recipe("chat", body, checkpoint)
    got = post(server, "chat", body)
    assert got.status_code == 200, got.text
    assert served_prompt("chat", got) == want.token_ids
    assert re.fullmatch("[0-9]{3}", got.json()["choices"][0]["message"]["content"])
    missing = {**body, "response_format": {"type": "regex"}}
    refused = recipe("chat", missing, checkpoint)
    assert isinstance(refused, deepinfer_recipe.RecipeError)
    got = post(server, "chat", missing)
    assert got.status_code == 400 and refused.message in error_message(got), got.text


@pytest.mark.parametrize("effort", ["none", "minimal", "ultra"])
def test_messages_document_blocks_and_the_official_efforts(server, checkpoint, effort):
    """A ``document`` block (stubbed in place as unsupported) and efforts vLLM's request models did not list."""
    body = sent_body("messages", {"output_config": {"effort": effort}, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        {"type": "text", "text": "Summarise it."}]}]})
    want = recipe("messages", body, checkpoint)
    assert "[Unsupported document type: application/pdf]" in want.prompt
    got = post(server, "messages", body)
    assert got.status_code == 200, got.text
    assert served_prompt("messages", got) == len(want.token_ids)


UNDECLARED_CHOICES = {
    "chat": {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
             "tool_choice": {"type": "function", "function": {"name": "search"}}},
    "responses": {"tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
                  "tool_choice": {"type": "function", "name": "search"}},
    "messages": {"tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
                 "tool_choice": {"type": "tool", "name": "search"}},
}


@pytest.mark.parametrize("api", UNDECLARED_CHOICES)
def test_a_tool_choice_naming_no_declared_tool_is_the_official_400(server, checkpoint, api):
    """vLLM's Chat and Responses request models refuse it before any codec runs, with the official package's
    message (patch_request_models); a Messages body reaches the codec, which refuses it the same way."""
    conversation = {"input": "Hi."} if api == "responses" else {"messages": [{"role": "user", "content": "Hi."}]}
    body = sent_body(api, {**conversation, **UNDECLARED_CHOICES[api]})
    refused = recipe(api, body, checkpoint)
    assert isinstance(refused, deepinfer_recipe.RecipeError) and "no function named 'search'" in refused.message
    got = post(server, api, body)
    assert got.status_code == 400 and refused.message in error_message(got), got.text


TOOLLESS_CHOICES = {
    "chat": [{"tool_choice": "required"}, {"tools": None, "tool_choice": "auto"}, {"tools": []},
             {"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}],
    "responses": [{"tool_choice": {"type": "function", "name": "f"}}, {"tools": [], "tool_choice": "required"}],
    "messages": [{"tool_choice": {"type": "tool", "name": "f"}}, {"tools": [], "tool_choice": {"type": "any"}}],
}


@pytest.mark.parametrize("api", TOOLLESS_CHOICES)
def test_a_tool_choice_without_tools_renders_as_the_official_package_does(server, checkpoint, api):
    """The official package reads it as ``auto`` and renders the prompt of no tools; vLLM's Chat and Responses
    request models refused it (patch_request_models)."""
    conversation = {"input": "Hi."} if api == "responses" else {"messages": [{"role": "user", "content": "Hi."}]}
    for choice in TOOLLESS_CHOICES[api]:
        body = sent_body(api, {**conversation, **choice})
        want = recipe(api, body, checkpoint)
        assert not isinstance(want, deepinfer_recipe.RecipeError), (choice, want)
        got = post(server, api, body)
        assert got.status_code == 200, (choice, got.text)
        assert served_prompt(api, got) == wanted_prompt(api, want), choice


SERVER_TOOL_TURNS = [
    {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "news"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
            {"type": "web_search_result", "url": "https://example.com", "title": "A", "encrypted_content": "e"}]},
        {"type": "text", "text": "Here is the news."}]},
    {"role": "user", "content": [{"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}]},
]


@pytest.mark.parametrize("turn", SERVER_TOOL_TURNS, ids=["assistant", "user"])
def test_messages_server_tool_blocks_are_the_official_400(server, checkpoint, turn):
    """vLLM's Messages model did not list these blocks (a validation error); the official package refuses them with
    its own message, and so does the codec once the body reaches it (patch_request_models)."""
    body = sent_body("messages", {"messages": [{"role": "user", "content": "Any news?"}, turn,
                                               {"role": "user", "content": "Thanks."}]})
    refused = recipe("messages", body, checkpoint)
    assert isinstance(refused, deepinfer_recipe.RecipeError), refused
    got = post(server, "messages", body)
    assert got.status_code == 400 and refused.message in error_message(got), got.text


def test_responses_hosted_entries_vllm_cannot_read_render_as_the_official_package_does(server, checkpoint):
    """A hosted tool's call with only its ids and hosted tools without their required fields (skipped), and an
    assistant message holding a file beside its text (the file stubbed in place): vLLM's model refused such
    bodies; the served prompt is the official package's (patch_request_models)."""
    body = sent_body("responses", {"tools": [{"type": "file_search"}, {"type": "code_interpreter"}], "input": [
        {"role": "user", "content": "Find the report."}, {"type": "computer_call", "id": "c1", "call_id": "cc1"},
        {"role": "assistant", "content": [{"type": "input_file", "file_id": "f1"},
                                          {"type": "output_text", "text": "Here it is.", "annotations": []}]},
        {"role": "user", "content": "Again."}]})
    assert "[Unsupported Document]" in recipe("responses", body, checkpoint).prompt
    want = recipe("responses", body, checkpoint)
    assert not isinstance(want, deepinfer_recipe.RecipeError), want
    got = post(server, "responses", body)
    assert got.status_code == 200, got.text
    assert served_prompt("responses", got) == want.token_ids


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048}, {"type": "enabled"},
                                      {"type": "enabled", "budget_tokens": 10}])
def test_messages_thinking_with_any_budget_renders_as_the_official_package_does(server, checkpoint, thinking):
    """Anthropic's clients send an enabled thinking config with a budget, which the official API accepts at any
    value (or none) and reads nowhere; vLLM's model required one of at least 1024 below ``max_tokens``, and vLLM
    made it a thinking-token budget, which a server without a reasoning config refused."""
    body = sent_body("messages", {"thinking": thinking,
                                  "messages": [{"role": "user", "content": "Think, then say hi."}]})
    body["max_tokens"] = 3
    want = recipe("messages", body, checkpoint)
    assert not isinstance(want, deepinfer_recipe.RecipeError), want
    got = post(server, "messages", body)
    assert got.status_code == 200, got.text
    assert served_prompt("messages", got) == len(want.token_ids)
    assert got.json()["usage"]["output_tokens"] == 3


REFUSED_BY_BOTH = [
    ("chat", {"messages": "Hi."}),
    ("chat", {"messages": [{"role": "user", "content": "Hi."}], "temperature": "hot"}),
    ("responses", {"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}),
    ("responses", {"input": 5}),
    ("messages", {"messages": [{"role": "user", "content": "Hi."}], "tools": [{"name": "lookup"}]}),
    ("messages", {"messages": [{"role": "wizard", "content": "Hi."}]}),
]


@pytest.mark.parametrize("api, body", REFUSED_BY_BOTH)
def test_a_body_vllms_model_and_the_codec_refuse_gets_the_codecs_message(server, checkpoint, api, body):
    """vLLM's request models refuse these before any codec runs; the answer is the codec's refusal, the official
    package's message naming the field (patch_validation_errors), in the API's own error shape."""
    body = sent_body(api, body)
    refused = recipe(api, body, checkpoint)
    assert isinstance(refused, deepinfer_recipe.RecipeError), refused
    got = post(server, api, body)
    assert got.status_code == 400 and error_message(got) == refused.message, got.text
    shape = (got.json()["type"], got.json()["error"]["type"]) if api == "messages" else got.json()["error"]["code"]
    assert shape == (("error", "BadRequestError") if api == "messages" else 400), got.json()
