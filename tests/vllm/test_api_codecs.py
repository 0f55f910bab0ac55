"""The requests the served path hands the recipe (vllm/patches/patch_api_codecs.py): the body as the client sent
it; for Responses, the history ``previous_response_id`` stands for ahead of its input and vLLM's thinking switch
as the API's own effort; for Chat and Messages, the switch as the API's own ``thinking`` (and, for Chat, vLLM's
``continue_final_message`` as the API's ``prefix``)."""

import pytest

import deepinfer_recipe
from deepinfer_plugins.vllm.patches.patch_api_codecs import (
    chat_request,
    responses_request,
    image_messages,
    input_items,
    messages_request,
    output_item,
)

MODEL = "DeepSeek-V4.1-Flash"
REASONING = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def test_the_body_is_rendered_as_sent_under_the_recipes_model_name():
    body = {"model": "served-name", "input": "Hello", "instructions": "be brief", "store": True,
            "previous_response_id": "resp_1", "chat_template_kwargs": {}}
    request = responses_request(body, [], {}, MODEL)
    assert request == {"model": MODEL, "input": "Hello", "instructions": "be brief", "store": True,
                       "chat_template_kwargs": {}}
    assert body["model"] == "served-name" and "previous_response_id" in body  # the sent body is left as it was


def test_the_history_goes_ahead_of_the_input():
    history = [{"role": "user", "content": "Hello"}, REASONING, CALL]
    follow_up = responses_request({"model": "m", "input": "And then?"}, history, {}, MODEL)
    assert follow_up["input"] == [*history, {"role": "user", "content": "And then?"}]
    listed = responses_request({"model": "m", "input": [{"type": "function_call_output", "call_id": "c1",
                                                      "output": "ok"}]}, history, {}, MODEL)
    assert listed["input"][:3] == history and listed["input"][3]["type"] == "function_call_output"
    assert input_items(follow_up) == follow_up["input"]
    assert input_items({"input": "Hello"}) == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("kwargs, reasoning, effort", [
    ({"thinking": False}, None, "none"),
    ({"enable_thinking": False}, {"summary": "auto"}, "none"),
    ({"thinking": False}, {"effort": "high"}, "none"),  # the switch wins, as ``thinking`` does in Chat
    ({"thinking": True}, {"effort": "none"}, None),
    ({"thinking": True}, {"effort": "low"}, "low"),
    ({}, {"effort": "none"}, "none"),
    ({}, None, None),
])
def test_vllms_thinking_switch_wins_over_the_effort(kwargs, reasoning, effort):
    body = {"model": "m", "input": "Hello", **({"reasoning": reasoning} if reasoning else {})}
    request = responses_request(body, [], kwargs, MODEL)
    assert (request.get("reasoning") or {}).get("effort") == effort
    if reasoning and "summary" in reasoning:
        assert request["reasoning"]["summary"] == "auto"


def test_thinking_off_renders_the_prompt_the_chat_switch_renders():
    chat = deepinfer_recipe.render({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                                    "thinking": {"type": "disabled"}}, "chat").prompt
    responses = deepinfer_recipe.render(responses_request({"model": "m", "input": "Hello"}, [], {"thinking": False},
                                                      MODEL), "responses").prompt
    assert responses == chat and responses.endswith("</think>")


def test_images_reach_vllm_in_placeholder_order_with_their_detail():
    url_a, url_b = "https://example.com/a.png", "data:image/png;base64,AAAA"
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url_a, "detail": "low"}, {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": url_b}]}]}
    rendered = deepinfer_recipe.render(responses_request(body, [], {}, MODEL), "responses")
    (message,) = image_messages(rendered.images)
    assert [part["image_url"]["url"] for part in message["content"]] == [url_a, url_b]
    assert message["content"][0]["image_url"]["detail"] == "low"
    assert image_messages([]) == [{"role": "user", "content": []}]


def test_output_items_are_kept_as_sent_back_items():
    class Item:
        def model_dump(self, **options):
            assert options == {"mode": "json", "exclude_none": True}
            return dict(REASONING)

    assert output_item(Item()) == REASONING
    assert output_item(CALL) == CALL and output_item(CALL) is not CALL


@pytest.mark.parametrize("kwargs, thinking, want", [
    ({"thinking": False}, {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}),
    ({"enable_thinking": True}, {"type": "disabled"}, {"type": "enabled"}),
    (None, {"type": "disabled"}, {"type": "disabled"}),
    (None, None, None),
])
def test_messages_request_takes_vllms_switch_as_its_thinking(kwargs, thinking, want):
    body = {"model": "served-name", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}],
            **({"thinking": thinking} if thinking else {}), **({"chat_template_kwargs": kwargs} if kwargs else {})}
    request = messages_request(body, MODEL)
    assert request["model"] == MODEL and request["messages"] == body["messages"]
    assert request.get("thinking") == want
    assert body["model"] == "served-name"


def test_chat_request_takes_vllms_switches_as_the_apis_own():
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bon"}]
    body = {"model": "served-name", "messages": messages, "thinking": {"type": "enabled"},
            "chat_template_kwargs": {"thinking": False}, "continue_final_message": True}
    request = chat_request(body, MODEL)
    assert request["model"] == MODEL and request["thinking"] == {"type": "disabled"}
    assert request["messages"] == [messages[0], {**messages[1], "prefix": True}]
    assert messages[1] == {"role": "assistant", "content": "Bon"} and body["model"] == "served-name"
    plain = chat_request({"model": "m", "messages": messages, "thinking": {"type": "disabled"}}, MODEL)
    assert plain["thinking"] == {"type": "disabled"} and plain["messages"] == messages
    rendered = deepinfer_recipe.render(request, "chat").prompt
    assert rendered.endswith("<｜Assistant｜></think>Bon")
