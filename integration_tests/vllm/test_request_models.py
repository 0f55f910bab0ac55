"""vLLM's request models after patch_request_models (vllm/patches/patch_request_models.py), in-process: the values
the official API accepts validate, the values nobody lists are still refused, and a ``regex`` response format
becomes vLLM's regex constraint (Chat and Completions alike)."""

import pytest
from pydantic import ValidationError

from deepinfer_plugins.vllm.patches import patch_request_models


@pytest.fixture(scope="module", autouse=True)
def patched():
    assert patch_request_models.apply() and patch_request_models.apply()  # applying twice changes nothing more


def chat(response_format):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "response_format": response_format})


def messages(content, effort=None, thinking=None, max_tokens=4):
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    if effort is not None:
        body["output_config"] = {"effort": effort}
    if thinking is not None:
        body["thinking"] = thinking
    return AnthropicMessagesRequest.model_validate(body)


def test_a_regex_response_format_is_a_regex_constraint():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert chat({"type": "regex", "regex": "[0-9]+"}).extract_structured_outputs().regex == "[0-9]+"
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                                   "response_format": {"type": "regex", "regex": "a|b"}})
    assert completion.extract_structured_outputs().regex == "a|b"
    assert chat({"type": "json_object"}).extract_structured_outputs().json_object  # vLLM's own formats unchanged
    assert chat({"type": "text"}).extract_structured_outputs() is None
    with pytest.raises(ValidationError):
        chat({"type": "grammar", "grammar": "root ::= x"})


@pytest.mark.parametrize("effort", ["none", "minimal", "ultra", "max", "low"])
def test_messages_efforts_of_the_official_api(effort):
    assert messages("hi", effort).output_config.effort == effort


def test_document_blocks_and_unlisted_values():
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
    request = messages([document, {"type": "text", "text": "Summarise."}])
    assert [block.type for block in request.messages[0].content] == ["document", "text"]
    AnthropicCountTokensRequest.model_validate({"model": "m",
                                                "messages": [{"role": "user", "content": [document]}]})
    with pytest.raises(ValidationError):
        messages("hi", "extreme")
    with pytest.raises(ValidationError):
        messages([{"type": "video", "source": {}}])


def test_another_models_messages_path_still_refuses_them():
    """Served by a renderer other than ours, vLLM's conversion would drop a document block (or mistake a
    server-tool block): those values are refused with a 400 as before; the handler runs for everything else and
    for our renderer."""
    import asyncio

    from deepinfer_plugins.vllm.tokenizer import DeepInferRenderer

    calls = []

    class Serving:
        renderer = object()

        def create_error_response(self, message):
            return ("400", message)

    async def handler(self, request, raw_request=None):
        calls.append(request)
        return "served"

    handle = patch_request_models.refused_elsewhere(handler)
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
    with_document, plain = messages([document]), messages("hi", "high")
    assert asyncio.run(handle(Serving(), with_document)) == \
        ("400", "a 'document' content block is not supported for this model")
    assert asyncio.run(handle(Serving(), messages("hi", "ultra")))[0] == "400"
    server_tool = messages([{"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}}])
    assert asyncio.run(handle(Serving(), server_tool)) == \
        ("400", "a 'server_tool_use' content block is not supported for this model")
    assert asyncio.run(handle(Serving(), plain)) == "served" and calls == [plain]
    for thinking, refused in (({"type": "enabled"}, "thinking.budget_tokens missing"),
                              ({"type": "enabled", "budget_tokens": 5}, "thinking.budget_tokens 5 (below 1024)"),
                              ({"type": "enabled", "budget_tokens": 4096},
                               "thinking.budget_tokens 4096 (not below max_tokens 4)")):
        assert asyncio.run(handle(Serving(), messages("hi", thinking=thinking))) == \
            ("400", f"{refused} is not supported for this model")
    budgeted = messages("hi", thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)
    assert asyncio.run(handle(Serving(), budgeted)) == "served"
    ours = Serving()
    ours.renderer = DeepInferRenderer.__new__(DeepInferRenderer)
    assert asyncio.run(handle(ours, with_document)) == "served"
    assert asyncio.run(handle(ours, messages("hi", thinking={"type": "enabled"}))) == "served"


@pytest.mark.parametrize("thinking", [{"type": "enabled"}, {"type": "enabled", "budget_tokens": None},
                                      {"type": "enabled", "budget_tokens": 0},
                                      {"type": "enabled", "budget_tokens": 100_000}])
def test_an_enabled_thinking_config_takes_any_budget_the_official_api_takes(thinking):
    """The official API accepts an enabled thinking config with no budget or any non-negative one (it reads none),
    where vLLM's model required a budget of at least 1024 below ``max_tokens``."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

    assert messages("hi", thinking=thinking).thinking.budget_tokens == thinking.get("budget_tokens")
    AnthropicCountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "thinking": thinking})


@pytest.mark.parametrize("budget", [-1, "many", 1.5])
def test_a_thinking_budget_the_official_api_refuses_is_still_refused(budget):
    with pytest.raises(ValidationError, match="budget_tokens"):
        messages("hi", thinking={"type": "enabled", "budget_tokens": budget})


def chat_with_tools(tool_choice, tools=({"type": "function", "function": {"name": "lookup"}},)):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": list(tools), "tool_choice": tool_choice})


def responses_with_tools(tool_choice, tools=({"type": "function", "name": "lookup"},)):
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": list(tools),
                                            "tool_choice": tool_choice})


@pytest.mark.parametrize("name", ["nope", ""])
def test_a_tool_choice_naming_no_declared_tool_is_refused_with_the_official_message(name):
    from vllm.exceptions import VLLMValidationError

    for refuse in (lambda: chat_with_tools({"type": "function", "function": {"name": name}}),
                   lambda: responses_with_tools({"type": "function", "name": name})):
        with pytest.raises(VLLMValidationError) as refused:
            refuse()
        assert refused.value.args[0] == patch_request_models.UNDECLARED_TOOL.format(name)
        assert refused.value.parameter == "tool_choice"
    assert chat_with_tools({"type": "function", "function": {"name": "lookup"}}).tool_choice.function.name == \
        "lookup"
    assert responses_with_tools({"type": "function", "name": "lookup"}).tool_choice.name == "lookup"


def test_vllms_other_tool_choice_refusals_keep_their_messages():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    for invalid in ("bogus", {"type": "function"}):  # no tools, and a choice the official package refuses too
        with pytest.raises(VLLMValidationError, match="`tools` must be set"):
            ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "tool_choice": invalid})
    with pytest.raises(VLLMValidationError, match="Expected field `name`"):
        chat_with_tools({"type": "function", "function": {}})
    namespaces = [{"type": "namespace", "name": space, "description": "d",
                   "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}
                  for space in ("mail", "files")]
    with pytest.raises(VLLMValidationError, match="ambiguous"):  # declared twice, not undeclared
        responses_with_tools({"type": "function", "name": "lookup"}, namespaces)


@pytest.mark.parametrize("tools", [None, [], "absent"])
@pytest.mark.parametrize("choice", ["auto", "required", "named", "empty name"])
def test_a_tool_choice_without_tools_is_auto(tools, choice):
    """The official package reads a tool choice of a body without tools as ``auto`` (and renders the prompt of no
    tools); vLLM's validators refused it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    name = "" if choice == "empty name" else "lookup"
    chat_choice = {"type": "function", "function": {"name": name}} if choice in ("named", "empty name") else choice
    declared = {} if tools == "absent" else {"tools": tools}
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tool_choice": chat_choice, **declared})
    assert request.tool_choice == "auto" and not request.tools
    for kind in ("function", "custom"):
        responses_choice = {"type": kind, "name": name} if choice in ("named", "empty name") else choice
        request = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": responses_choice,
                                                   **declared})
        assert request.tool_choice == "auto" and not request.tools


def test_an_empty_tool_list_is_no_tools():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": []})
    assert not request.tools and request.tool_choice == "none"  # vLLM's default without tools


def test_responses_entries_the_codec_skips_and_vllm_cannot_read_are_dropped():
    """Hosted tools' items and tools without the fields OpenAI's types require: the official package skips them
    (they cannot change the prompt) and vLLM's model refused the whole body. Readable ones are kept, and an entry
    of a kind the codec renders is still refused when malformed."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    items = [{"role": "user", "content": "hi"}, {"type": "computer_call", "id": "c1", "call_id": "cc1"},
             {"type": "file_search_call", "id": "fs1", "queries": ["q"], "status": "completed"},
             {"role": "user", "content": "again"}]
    tools = [{"type": "file_search"}, {"type": "code_interpreter"}, {"type": "web_search"},
             {"type": "file_search", "vector_store_ids": ["v"]}]
    request = ResponsesRequest.model_validate({"model": "m", "input": items, "tools": tools})
    assert [getattr(item, "type", None) or item.get("type") for item in request.input] == \
        [None, "file_search_call", None]  # the two messages keep their (typeless) form
    assert [tool.type for tool in request.tools] == ["web_search", "file_search"]
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": [{"type": "function_call", "id": "c1"}]})
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [{"type": "function"}]})


@pytest.mark.parametrize("part", [{"type": "input_file", "file_id": "f1"},
                                  {"type": "input_image", "image_url": "https://x/y.png"}])
def test_an_assistant_message_with_a_file_or_image_and_output_text_is_read_as_input(part):
    """Readable by vLLM, so that the codec stubs the file, or refuses the image with the official message."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    message = {"type": "message", "id": "m1", "status": "completed", "role": "assistant", "content": [
        part, {"type": "output_text", "text": "ok", "annotations": []}]}
    request = ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": "hi"}, message]})
    given, text = request.input[1]["content"]
    assert dict(given)["type"] == part["type"] and dict(text) == {"type": "input_text", "text": "ok"}
    plain = {**message, "content": message["content"][1:]}  # readable as given: left as it is
    request = ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": "hi"}, plain]})
    assert request.input[1].id == "m1" and request.input[1].content[0].type == "output_text"


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.0000002), ("presence_penalty", -3.5),
                                          ("frequency_penalty", "high"), ("seed", 1 << 63), ("seed", -(1 << 64)),
                                          ("seed", 1.5)])
def test_responses_values_the_official_package_reads_nowhere_are_dropped_where_vllm_cannot_hold_them(field, value):
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    assert getattr(ResponsesRequest.model_validate({"model": "m", "input": "hi", field: value}), field) is None
    assert getattr(ResponsesRequest.model_validate({"model": "m", "input": "hi", field: 1}), field) == 1


def test_a_namespace_tool_without_a_description_is_read():
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    tool = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}
    request = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [tool]})
    assert request.tools[0].description == "" and request.tools[0].tools[0].name == "f"
    described = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [{**tool, "description": "d"}]})
    assert described.tools[0].description == "d"


MODELS = {"chat": "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
          "responses": "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
          "messages": "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest"}


@pytest.mark.parametrize("api", sorted(MODELS))
def test_every_generated_request_the_recipe_renders_validates(api):
    """vLLM's request models run before any codec: each request of the recipe's generators (every part and item
    kind, boundary values, strict schemas, tool schemas, combinations, images, deferred tools, tool search) that
    the recipe renders must validate, or the server would refuse a request the official package accepts."""
    import importlib

    import deepinfer_recipe

    from .test_api_codecs import codec_request, generated_everywhere, sent_body

    module, name = MODELS[api].split(":")
    model = getattr(importlib.import_module(module), name)
    rendered, refused, classes = 0, [], set()
    for kind, body in generated_everywhere(api):
        body = sent_body(api, body)
        try:
            deepinfer_recipe.render(codec_request(api, body), api)
        except deepinfer_recipe.RecipeError:
            continue
        rendered += 1
        classes.add(kind)
        try:
            model.model_validate(body)
        except (ValidationError, ValueError) as exc:
            refused.append((kind, str(exc).splitlines()[:3]))
    print(f"{api}: {rendered} rendered requests of {len(classes)} classes validate")
    assert not refused, refused
    assert rendered >= 500 and len(classes) >= 20, (rendered, sorted(classes))
