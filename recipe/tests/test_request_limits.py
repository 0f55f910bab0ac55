"""Range, name and shape limits refuse a Chat request with the official message; values at a
limit are accepted. The differential suite compares the same messages with the official
package."""
import pytest

import deepinfer_recipe as dr

M = "DeepSeek-V4-Pro"
U = {"role": "user", "content": "hi"}
P = {"type": "object", "properties": {}}


def tool(name):
    return {"type": "function", "function": {"name": name, "parameters": P}}


def req(**kw):
    return {"model": M, "messages": [U], **kw}


NAME_PATTERN = ("string does not match pattern. Expected a string that matches the pattern "
                "'^[a-zA-Z0-9_-]+$'.")
REFUSED = [
    (req(temperature=2.0001), "Invalid temperature value, the valid range of temperature is [0, 2]"),
    (req(temperature=-0.1), "Invalid temperature value, the valid range of temperature is [0, 2]"),
    (req(top_p=0.0), "Invalid top_p value, the valid range of top_p is (0, 1.0]"),
    (req(top_p=1e-46), "Invalid top_p value, the valid range of top_p is (0, 1.0]"),
    (req(top_p=1.0001), "Invalid top_p value, the valid range of top_p is (0, 1.0]"),
    (req(logprobs=True, top_logprobs=21),
     "Invalid top_logprobs value, the valid range of top_logprobs is [0, 20]."),
    (req(frequency_penalty=2.0001),
     "Invalid frequency_penalty value, the valid range of frequency_penalty is [-2, 2]"),
    (req(presence_penalty=-2.5),
     "Invalid presence_penalty value, the valid range of presence_penalty is [-2, 2]"),
    (req(seed=2 ** 63), "Invalid seed value, the valid range of seed is [0, 2^63)"),
    (req(stream_options={"include_usage": True}),
     "stream_options should be set along with stream = true"),
    (req(stream_options={}, stream=False), "stream_options should be set along with stream = true"),
    (req(tools=[tool("ok"), tool("a.b")]), f"Invalid 'tools[1].function.name': {NAME_PATTERN}"),
    (req(tools=[tool("a b")]), f"Invalid 'tools[0].function.name': {NAME_PATTERN}"),
    (req(tools=[tool("\ud800")]), f"Invalid 'tools[0].function.name': {NAME_PATTERN}"),
    (req(tools=[tool("é" * 65)]), "Invalid 'tools[0].function.name': string too long. Expected a "
     "string with maximum length 128, but got a string with length 130 instead."),
    (req(tools=[tool("")]), "Invalid 'tools[0].function.name': empty string. Expected a string "
     "with minimum length 1, but got an empty string instead."),
    (req(tools=[tool("f"), tool("f")]), "Tool names must be unique."),
    (req(messages=[U, {"role": "assistant"}, U]),
     "Invalid assistant message: content or tool_calls must be set"),
    (req(messages=[U, {"role": "assistant", "content": None, "reasoning_content": "r"}]),
     "Invalid assistant message: content or tool_calls must be set"),
    (req(messages=[U, {"role": "assistant", "content": "x", "tool_calls": []}, U]),
     "Invalid 'messages[1].tool_calls': empty array. Expected an array with minimum length 1, "
     "but got an empty array instead."),
    (req(stop=""), "Invalid 'stop': empty string. Expected a string with minimum length 1, but "
     "got an empty string instead."),
    (req(stop=["END", ""]), "Invalid 'stop[1]': empty string. Expected a string with minimum "
     "length 1, but got an empty string instead."),
]


@pytest.mark.parametrize("body,message", REFUSED)
def test_refused_from_dict(body, message):
    with pytest.raises(dr.ConversionError) as e:
        dr.render(body, "chat")
    assert (e.value.status, e.value.message) == (400, message)


@pytest.mark.parametrize("body", [
    req(temperature=0.0), req(temperature=2.0), req(temperature=2.0000001), req(top_p=1.0),
    req(top_p=1e-45), req(logprobs=True, top_logprobs=20), req(frequency_penalty=-2.0),
    req(presence_penalty=2.0), req(seed=0), req(seed=2 ** 63 - 1),
    req(stream=True, stream_options={"include_usage": True}), req(tools=[tool("x" * 128)]),
    req(tools=[tool("f"), tool("f")], tool_choice="none"), req(stop=[]),
    req(messages=[U, {"role": "assistant", "content": ""}, U]),
])
def test_limits_accepted(body):
    """Values at a limit are valid."""
    assert dr.render(body, "chat").prompt


def test_responses_refusal_part_refused():
    body = {"model": M, "input": [U, {"type": "message", "role": "assistant",
                                      "content": [{"type": "refusal", "refusal": "no"}]}]}
    with pytest.raises(dr.RequestValidationError):
        dr.render(body, "responses")
