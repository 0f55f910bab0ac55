"""A Responses follow-up sees its previous response's output items as if the client had sent them back (see the
ledger in __init__.py)."""

from __future__ import annotations

from .patch_responses_store import store_enabled

_PATCHED_FLAG = "_deepinfer_patched"


def output_items_as_input(construct_input_messages):
    """Wrap vLLM's ``construct_input_messages`` so that ``prev_response_output`` goes through the same conversion as
    input items (reasoning, function calls, messages) instead of its own, which keeps output messages only."""

    def construct(*, request_instructions=None, request_input, prev_msg=None, prev_response_output=None):
        if prev_response_output:
            new_input = ([{"role": "user", "content": request_input}] if isinstance(request_input, str)
                         else list(request_input))
            request_input = [*prev_response_output, *new_input]
        return construct_input_messages(request_instructions=request_instructions, request_input=request_input,
                                        prev_msg=prev_msg, prev_response_output=None)

    setattr(construct, _PATCHED_FLAG, True)
    return construct


def apply() -> bool:
    if not store_enabled():
        return False
    from vllm.renderers import online_renderer

    if not getattr(online_renderer.construct_input_messages, _PATCHED_FLAG, False):
        online_renderer.construct_input_messages = output_items_as_input(online_renderer.construct_input_messages)
    return True
