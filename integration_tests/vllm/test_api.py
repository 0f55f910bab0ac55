"""The three APIs through the real server, with the official SDKs.

Guarantees: chat (non-streamed and streamed, thinking on and off) returns reasoning / content in the right
fields and streamed deltas add up to the non-streamed answer; greedy decoding through vLLM (paged caches,
chunked prefill) equals the core model's ``generate()`` token for token; a DSML tool call (forced with a regex
constraint, since the weights are random) comes back as an OpenAI tool call and the round trip with its result
is served; Responses and Anthropic Messages answer through the same renderer and parsers (a Responses answer
with thinking off is its output text, streamed or not, as Chat's content); a Responses
follow-up through ``previous_response_id`` sees its history, and the store forgets past its bound.
"""

from __future__ import annotations

import json

import pytest

from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import MODEL, RESPONSES_STORE_SIZE

OFF = {"chat_template_kwargs": {"thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TOOL_CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def chat(client, content, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kwargs)


def test_thinking_on_returns_reasoning(openai_client):
    out = chat(openai_client, "Hello", max_tokens=12)
    message = out.choices[0].message
    assert getattr(message, "reasoning", None), "thinking is on by default: the answer starts in reasoning"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12


def test_thinking_off_returns_content(openai_client):
    out = chat(openai_client, "Hello", max_tokens=12, extra_body=OFF)
    message = out.choices[0].message
    assert message.content and not getattr(message, "reasoning", None)


def test_thinking_samples_as_the_official_api_whatever_temperature_is_sent(openai_client):
    """The official API ignores temperature and top_p in thinking mode (it samples at 1.0, top_p >= 0.95 on V4.1):
    a request for greedy thinking still samples, seeded like any sampled request; with thinking off the request's
    temperature stands."""
    def answer(seed: int, **body) -> list[int]:
        out = chat(openai_client, "Hello", max_tokens=8, seed=seed, top_p=0.01,
                   extra_body={"return_token_ids": True, **body})
        return out.choices[0].token_ids

    assert answer(1) == answer(1), "a seeded sampled request is reproducible"
    assert answer(1) != answer(2), "thinking on: sampled at temperature 1.0, not greedy"
    assert answer(1, **OFF) == answer(2, **OFF), "thinking off: temperature 0 is greedy"


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_chat_adds_up_to_the_non_streamed_answer(openai_client, thinking):
    body = {"chat_template_kwargs": {"thinking": thinking}}
    full = chat(openai_client, "Tell me a story", max_tokens=16, seed=7, extra_body=body).choices[0].message
    reasoning, content = [], []
    for chunk in chat(openai_client, "Tell me a story", max_tokens=16, seed=7, stream=True, extra_body=body):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append(getattr(delta, "reasoning", None) or "")
            content.append(delta.content or "")
    assert "".join(reasoning) == (getattr(full, "reasoning", None) or "")
    assert "".join(content) == (full.content or "")


def test_greedy_output_equals_core_generate(openai_client, core_model):
    out = chat(openai_client, "The quick brown fox jumps over the lazy dog. " * 6, max_tokens=24,
               extra_body={**OFF, "return_token_ids": True})
    raw = out.model_dump()
    prompt_ids, output_ids = raw["prompt_token_ids"], raw["choices"][0]["token_ids"]
    assert len(prompt_ids) > 48
    expected = generate(core_model, prompt_ids, SamplingParams(max_new_tokens=24, stop_token_ids=(1,)))
    assert output_ids == expected


def test_tool_call_round_trip(openai_client):
    out = chat(openai_client, "Weather in Paris?", max_tokens=200, tools=[WEATHER],
               extra_body={**OFF, "structured_outputs": {"regex": TOOL_CALL.replace("|", "\\|")}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    follow = openai_client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tools=[WEATHER], extra_body=OFF,
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].message.content


def test_streamed_tool_call(openai_client):
    stream = chat(openai_client, "Weather in Paris?", max_tokens=200, tools=[WEATHER], stream=True,
                  extra_body={**OFF, "structured_outputs": {"regex": TOOL_CALL.replace("|", "\\|")}})
    names, arguments, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                arguments.append(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and json.loads("".join(arguments)) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_responses_api(openai_client):
    out = openai_client.responses.create(model=MODEL, input="Hello", max_output_tokens=12, temperature=0)
    assert out.status in ("completed", "incomplete")
    assert out.usage.output_tokens == 12
    assert out.output, "a Responses answer has at least one output item"


def test_responses_with_thinking_off_answers_in_output_text(openai_client):
    """Not streamed, vLLM parses a Responses answer without showing the parser the prompt's end."""
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=12, temperature=0, extra_body=OFF)
    request = dict(model=MODEL, input="Hello", max_output_tokens=12, temperature=0, extra_body=OFF)
    out = openai_client.responses.create(**request)
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    streamed = "".join(event.delta for event in openai_client.responses.create(**request, stream=True)
                       if event.type == "response.output_text.delta")
    assert streamed == out.output_text


def test_messages_api(anthropic_client):
    out = anthropic_client.messages.create(model=MODEL, max_tokens=12,
                                           messages=[{"role": "user", "content": "Hello"}],
                                           thinking={"type": "disabled"})
    assert out.stop_reason == "max_tokens"
    assert any(block.type == "text" and block.text for block in out.content)


def test_messages_api_streamed(anthropic_client):
    events = []
    with anthropic_client.messages.stream(model=MODEL, max_tokens=10,
                                          messages=[{"role": "user", "content": "Hello"}],
                                          thinking={"type": "disabled"}) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.usage.output_tokens == 10


def test_responses_follow_up_through_previous_response_id(openai_client):
    """``store`` + ``previous_response_id`` (the store that ``deepinfer serve`` turns on): the follow-up sees the
    first turn exactly as if the client had sent it back itself."""
    first = openai_client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0,
                                           store=True)
    assert [item.type for item in first.output] == ["reasoning"], "thinking is on: the turn is its reasoning"
    follow_up = openai_client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                               max_output_tokens=6, temperature=0)
    history = [{"role": "user", "content": "Hello"}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "And then?"}]
    explicit = openai_client.responses.create(model=MODEL, input=history, max_output_tokens=6, temperature=0)
    assert follow_up.previous_response_id == first.id
    assert follow_up.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert follow_up.output_text == explicit.output_text
    assert [item.type for item in follow_up.output] == [item.type for item in explicit.output]


def test_responses_store_forgets_past_its_bound(openai_client):
    import openai

    oldest = openai_client.responses.create(model=MODEL, input="Hello", max_output_tokens=1, store=True)
    for _ in range(RESPONSES_STORE_SIZE):
        openai_client.responses.create(model=MODEL, input="Hello", max_output_tokens=1, store=True)
    with pytest.raises(openai.NotFoundError, match=oldest.id):
        openai_client.responses.create(model=MODEL, input="Hi", previous_response_id=oldest.id, max_output_tokens=1)
    openai_client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)  # and the server still serves
