"""`parse`: raw model output -> the API response (dict) or its stream events."""
from __future__ import annotations

from typing import Any, Optional, Union

from .convert import convert
from .errors import RequestValidationError
from .parse import StreamParser
from .responses_out import ChatBuilder, MessagesBuilder, ResponsesBuilder


def _builder(conv, rid: str, created: Optional[int]):
    thinking = conv.parsing.thinking_initial_stage is not None
    if conv.api == "chat":
        return ChatBuilder(rid, conv.model, thinking, created)
    if conv.api == "messages":
        return MessagesBuilder(rid, conv.model, thinking)
    tools = []
    for t in (conv.echo.get("tools") or []):
        tools.append(t.model_dump(by_alias=True, exclude_unset=False) if hasattr(t, "model_dump") else t)
    return ResponsesBuilder(rid, conv.model, thinking, conv.echo, _responses_tools(conv),
                            conv.namespace_tool_map, created)


def _responses_tools(conv) -> list:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": t.strict} for t in conv.conversation.tools]


def parse(raw: Union[str, list], request: dict, api: str, stream: bool = False,
          finish_reason: str = "stop", *, options: Optional[dict] = None, prompt_tokens: int = 0,
          cached_tokens: int = 0, response_id: str = "resp1", created: Optional[int] = None,
          tokenizer=None) -> Any:
    """Parse raw output (one string, or a list of pieces = one token each) for `request`.

    Returns the final response dict, or with `stream=True` the list of (event_name, data)
    (event_name is None for Chat Completions chunks). Token ids (list[int]) need `tokenizer`.
    """
    if finish_reason not in ("stop", "length", "content_filter"):
        raise RequestValidationError(f"finish_reason: expected stop, length or content_filter, "
                                     f"got {finish_reason!r}")
    conv = convert(request, api, options)
    pieces = [raw] if isinstance(raw, str) else list(raw)
    if pieces and isinstance(pieces[0], int):
        from .convert import _tokenizer
        from .tokens import PromptTokenizer

        tok = _tokenizer(tokenizer if tokenizer is not None else True)
        pieces = decode_stream(tok, pieces)
    parser = StreamParser(conv.parsing)
    b = _builder(conv, response_id, created)
    completion = 0
    ev: list = []
    if api == "chat":
        ev += b.start()
    elif api == "messages":
        ev += b.start(prompt_tokens, cached_tokens)
    else:
        ev += b.start()
    for p in pieces:
        completion += 1
        if not parser.finished:
            ev += b.deltas(parser.feed(p))
    ds, res = parser.finish(finish_reason)
    ev += b.deltas(ds)
    if api == "chat":
        usage = ChatBuilder.usage(prompt_tokens, completion, cached_tokens)
        if not stream:
            return b.final(res, usage)
        ev += b.end(res, usage)
        return ev
    if api == "messages":
        if not stream:
            return b.final(res, prompt_tokens, completion, cached_tokens)
        ev += b.end(res, prompt_tokens, completion, cached_tokens)
        return ev
    ev += b.end(res, prompt_tokens, completion, cached_tokens)
    if not stream:
        return ev[-1][1]["response"]
    return ev


def decode_stream(tok, ids: list) -> list:
    """Token ids -> text pieces (one per id; '' while a multi-byte character is incomplete)."""
    from tokenizers.decoders import DecodeStream

    ds = DecodeStream(skip_special_tokens=False)
    out = []
    for i in ids:
        s = ds.step(tok.full, i)
        out.append(s or "")
    return out
