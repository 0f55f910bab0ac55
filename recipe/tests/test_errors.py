"""Bad input raises a typed RecipeError with an HTTP status and a message naming the field."""
import pytest

import deepinfer_recipe as dr

M = "DeepSeek-V4.1-Flash"
U = [{"role": "user", "content": "hi"}]
T = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("req,status,needle", [
    ({"model": M, "messages": U, "tools": T, "tool_choice": "required"}, 400, "Thinking mode does not support"),
    ({"model": "gpt-4", "messages": U}, 400, "you passed gpt-4"),
    ({"messages": U}, 400, "model"),
    ({"model": M, "messages": []}, 400, "Empty input messages"),
    ({"model": M, "messages": [{"role": "developer", "content": "x"}]}, 400, "messages[0]"),
    ({"model": M, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"model": M, "messages": U, "n": 2}, 400, "n = 1"),
    ({"model": M, "messages": U, "response_format": {"type": "json_object"}}, 400, "json"),
    ({"model": M, "messages": U, "temperature": "hot"}, 400, "temperature"),
    ({"model": M, "messages": U, "max_tokens": 10 ** 7}, 400, "max_tokens"),
    ({"model": M, "messages": U, "reasoning_effort": "bogus"}, 400, "reasoning_effort"),
])
def test_chat_errors(req, status, needle):
    with pytest.raises(dr.RecipeError) as e:
        dr.render(req, "chat")
    assert e.value.status == status
    assert needle in e.value.message


_DEVELOPER = {"role": "developer", "content": "x"}


@pytest.mark.parametrize("req,message", [
    ({"model": M, "messages": U, "stream": 1}, "stream: Input should be a valid boolean"),
    ({"model": M, "messages": U, "temperature": "0.5"}, "temperature: Input should be a valid number"),
    ({"model": M, "messages": U, "max_tokens": 10.0}, "max_tokens: Input should be a valid integer"),
    ({"model": M, "messages": U, "max_tokens": 10.5},
     "max_tokens: Input should be a valid integer, got a number with a fractional part"),
    ({"model": M, "messages": U, "tools": [{"function": {"name": "f", "strict": 0}}]},
     "tools[0].function.strict: Input should be a valid boolean"),
    ({"model": M, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u", "detail": "x"}}]}]},
     "messages[0].content[1].image_url.detail: Input should be 'low', 'high', 'original' or 'auto', "
     "got 'x'"),
    ({"model": M, "messages": [_DEVELOPER]},
     "messages[0]: Input tag 'developer' found using 'role' does not match any of the expected tags: "
     f"'system', 'user', 'assistant', 'tool', 'latest_reminder', got {_DEVELOPER!r}"),
    ({"model": M, "messages": U + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {}}]}]},
     "messages[1].tool_calls[0].function.name: Field required"),
    ({"model": M, "messages": U, "tool_choice": {"type": "function"}}, "tool_choice.function: Field required"),
    # the body's shape is read before any rule about its meaning: the unknown model comes later
    ({"model": "gpt-4", "messages": U, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage: Input should be a valid boolean"),
])
def test_chat_shape_errors_name_the_field(req, message):
    with pytest.raises(dr.RequestValidationError) as e:
        dr.render(req, "chat")
    assert (e.value.status, e.value.message, e.value.param) == (400, message, message.split(":")[0])


def test_responses_custom_tool():
    with pytest.raises(dr.ConversionError, match="Only 'apply_patch'"):
        dr.render({"model": M, "input": "x", "tools": [{"type": "custom", "name": "x"}]}, "responses")


def test_messages_server_tool():
    with pytest.raises(dr.ConversionError, match="server tools"):
        dr.render({"model": M, "max_tokens": 5, "messages": U,
                   "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "messages")


def test_bad_api_and_finish_reason():
    with pytest.raises(dr.RequestValidationError, match="api"):
        dr.render({"model": M, "messages": U}, "nope")
    with pytest.raises(dr.RequestValidationError, match="finish_reason"):
        dr.parse("x", {"model": M, "messages": U}, "chat", finish_reason="boom")
