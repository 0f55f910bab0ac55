"""A Responses history renders as the official codec renders it: a follow-up sees its previous response's output
items as if the client had sent them back, and a turn that is reasoning alone is a turn (see the ledger in
__init__.py)."""

from __future__ import annotations

_PATCHED_FLAG = "_deepinfer_patched"


def reasoning_only_turns_have_content(messages: list) -> list:
    """vLLM turns a reasoning item that no message or call follows into an assistant message without content,
    which the recipe's Chat conversion refuses as a client's empty assistant message would be; in a Responses
    history it is a turn whose answer is empty, as the official Responses codec renders it."""
    for message in messages:
        if (isinstance(message, dict) and message.get("role") == "assistant" and message.get("content") is None
                and not message.get("tool_calls") and "reasoning" in message):
            message["content"] = ""
    return messages


def output_items_as_input(construct_input_messages):
    """Wrap vLLM's ``construct_input_messages`` so that ``prev_response_output`` goes through the same conversion as
    input items (reasoning, function calls, messages) instead of its own, which keeps output messages only."""

    def construct(*, request_instructions=None, request_input, prev_msg=None, prev_response_output=None):
        if prev_response_output:
            new_input = ([{"role": "user", "content": request_input}] if isinstance(request_input, str)
                         else list(request_input))
            request_input = [*prev_response_output, *new_input]
        return reasoning_only_turns_have_content(construct_input_messages(
            request_instructions=request_instructions, request_input=request_input, prev_msg=prev_msg,
            prev_response_output=None))

    setattr(construct, _PATCHED_FLAG, True)
    return construct


def apply() -> bool:
    from vllm.renderers import online_renderer

    if not getattr(online_renderer.construct_input_messages, _PATCHED_FLAG, False):
        online_renderer.construct_input_messages = output_items_as_input(online_renderer.construct_input_messages)
    return True
