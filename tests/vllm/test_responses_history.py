"""How a Responses history reaches the recipe (vllm/patches/patch_responses_history.py): a previous response's
output items are converted like input items, and a turn that is reasoning alone keeps an (empty) answer."""

from deepinfer_plugins.vllm.patches.patch_responses_history import output_items_as_input


def fake_vllm_conversion(*, request_instructions=None, request_input, prev_msg=None, prev_response_output=None):
    """vLLM's item conversion as far as these tests need it: a reasoning item becomes an assistant message with
    ``reasoning`` and no content; output messages of a previous response would be dropped (it keeps none here)."""
    assert prev_response_output is None, "the wrapper hands previous output items over as input items"
    messages = []
    for item in request_input:
        if item.get("type") == "reasoning":
            messages.append({"role": "assistant", "reasoning": item["content"][0]["text"]})
        elif item.get("type") == "function_call":
            messages.append({"role": "assistant", "tool_calls": [{"id": item["call_id"]}]})
        else:
            messages.append({"role": item["role"], "content": item["content"]})
    return messages


REASONING = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "thought"}]}


def test_a_reasoning_only_turn_gets_empty_content():
    construct = output_items_as_input(fake_vllm_conversion)
    messages = construct(request_input=[{"role": "user", "content": "Hello"}, REASONING,
                                        {"role": "user", "content": "And then?"}])
    assert messages[1] == {"role": "assistant", "reasoning": "thought", "content": ""}
    assert messages[0] == {"role": "user", "content": "Hello"}


def test_previous_output_items_come_before_the_new_input():
    construct = output_items_as_input(fake_vllm_conversion)
    call = {"type": "function_call", "call_id": "c1"}
    messages = construct(request_input="And then?", prev_response_output=[REASONING, call])
    assert messages == [{"role": "assistant", "reasoning": "thought", "content": ""},
                        {"role": "assistant", "tool_calls": [{"id": "c1"}]},
                        {"role": "user", "content": "And then?"}]
