"""Thin driver for the official `deepseek_recipe` package (the black-box oracle).

Only used by the differential tests and the benchmark; importing it without the package
raises ImportError, which the tests turn into a skip.
"""
from __future__ import annotations

import json

import deepseek_recipe as dr  # noqa: F401  (ImportError -> tests skip)

REQ = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest,
       "messages": dr.MessagesRequest}
RESP = {"chat": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse,
        "messages": dr.MessagesResponse}
FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
          "content_filter": dr.InferenceFinishReason.ContentFilter}


def options(opts: dict | None):
    o = dr.ConversionOptions(**{k: v for k, v in (opts or {}).items()
                                if k in ("default_thinking_mode",)})
    for k, v in (opts or {}).items():
        if k == "model_alias":
            for name, ver in v.items():
                mv = dr.ModelVersion.DeepseekV41Flash if "4.1" in ver else dr.ModelVersion.DeepseekV4Pro
                o = o.with_model_alias(name, mv)
        elif k == "reasoning_content_behavior":
            o = o.with_reasoning_content_behavior(
                dr.ReasoningContentBehavior.Reject if v == "reject" else dr.ReasoningContentBehavior.FillEmpty)
    return o


def convert(request: dict, api: str, opts: dict | None = None):
    return REQ[api](json.dumps(request)).convert(options(opts))


def encoding(conv, tokenizer=None):
    enc = dr.DeepseekV41Encoding() if conv.model_version == dr.ModelVersion.DeepseekV41Flash \
        else dr.DeepseekV4Encoding()
    if tokenizer is not None:
        enc = enc.with_tokenizer(tokenizer)
    return enc


def render(request: dict, api: str, opts: dict | None = None, tokenizer=None):
    """-> ("ok", prompt, token_ids|None, conv) or ("error", status|None, message, None)."""
    try:
        conv = convert(request, api, opts)
    except dr.ConversionError as e:
        return ("error", e.status_code, json.loads(e.body)["error"]["message"], None)
    except ValueError as e:
        return ("error", None, str(e), None)
    enc = encoding(conv, tokenizer)
    prompt = enc.render_conversation(conv.conversation).prompt
    ids = enc.encode(conv.conversation) if tokenizer is not None else None
    return ("ok", prompt, ids, conv)


def events(request: dict, api: str, pieces: list, finish: str = "stop", prompt_tokens: int = 10,
           cached: int = 0, rid: str = "resp1", tokenizer=None, token_ids: list | None = None):
    """Run the official stream processor; -> list of (sse_name, dict)."""
    conv = convert(request, api)
    gen = REQ[api].chunk_generator(conv, rid, request.get("model"))
    sp = dr.StreamProcessor(gen, conv.parsing_options, tokenizer)
    ev = list(sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
        prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached))))
    feed = [dr.InferenceChunk.tokens([t]) for t in token_ids] if token_ids is not None else \
        [dr.InferenceChunk.text(p, 1) for p in pieces]
    for ch in feed:
        if sp.finished:
            break
        ev += sp.push(ch)
    if not sp.finished:
        ev += sp.push(dr.InferenceChunk.finish(FINISH[finish]))
    if not sp.finished:
        ev += sp.finish()
    return ev


def parse(request: dict, api: str, pieces: list, stream: bool = False, finish: str = "stop",
          prompt_tokens: int = 10, cached: int = 0, rid: str = "resp1", created: int = 0):
    ev = events(request, api, pieces, finish, prompt_tokens, cached, rid)
    if stream:
        return [(RESP[api].sse_event_name(e), json.loads(e.to_json())) for e in ev]
    r = RESP[api](rid, request.get("model"), created, prompt_tokens, cached)
    for e in ev:
        r.accumulate(e)
    return json.loads(r.to_json())
