"""vLLM's own thinking switch, ``chat_template_kwargs`` ``thinking`` (or ``enable_thinking``), read one way by the
renderer, the API codecs and the reasoning parser."""

from __future__ import annotations


def thinking_switch(template_kwargs: dict | None) -> bool | None:
    """vLLM's own thinking switch, ``chat_template_kwargs`` ``thinking`` (or ``enable_thinking``), if set."""
    thinking = (template_kwargs or {}).get("thinking", (template_kwargs or {}).get("enable_thinking"))
    return None if thinking is None else bool(thinking)


def with_thinking_switch(request: dict, template_kwargs: dict | None) -> dict:
    """``request`` with vLLM's thinking switch, where set, as the API's ``thinking`` field (Chat, Messages)."""
    thinking = thinking_switch(template_kwargs)
    if thinking is not None:
        request["thinking"] = {"type": "enabled" if thinking else "disabled"}
    return request
