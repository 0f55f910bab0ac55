"""Response builders: parser deltas -> Chat Completions / Responses / Messages responses,
streamed (event lists) or not (one dict)."""
from __future__ import annotations

import json
import time
from typing import Optional

from .parse import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

CHAT_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter",
               "tool_calls": "tool_calls"}
MSG_STOP = {"stop": "end_turn", "length": "max_tokens", "content_filter": "refusal",
            "tool_calls": "tool_use"}


class ChatBuilder:
    """Chat Completions chunks (`stream`) and the final `chat.completion` object."""

    def __init__(self, rid: str, model: str, thinking: bool, created: Optional[int] = None,
                 stage: Optional[str] = None):
        self.rid, self.model, self.thinking = rid, model, thinking
        self.stage = stage
        self.created = int(time.time()) if created is None else created

    def _chunk(self, delta: dict, finish=None, usage=None) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                "usage": usage}

    def start(self) -> list:
        if not self.thinking:
            d = {"role": "assistant", "content": ""}
        elif self.stage == "content_continuation":
            d = {"role": "assistant", "content": "", "reasoning_content": None}
        else:
            d = {"role": "assistant", "content": None, "reasoning_content": ""}
        return [(None, self._chunk(d))]

    def deltas(self, ds: list) -> list:
        ev = []
        th = self.thinking
        rid, created, model = self.rid, self.created, self.model
        for d in ds:
            c = d.__class__
            if c is ContentDelta:
                delta = {"content": d.text, "reasoning_content": None} if th else {"content": d.text}
            elif c is ReasoningDelta:
                delta = {"content": None, "reasoning_content": d.text}
            elif c is ToolCallArgsDelta:
                delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
            elif c is ToolCallStart:
                delta = {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                         "function": {"name": d.name, "arguments": ""}}]}
            else:
                continue
            ev.append((None, {"id": rid, "object": "chat.completion.chunk", "created": created,
                              "model": model, "system_fingerprint": None,
                              "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": None}], "usage": None}))
        return ev

    def fast(self, reasoning: bool, text: str, ev: list) -> bool:
        """Append the event of one reasoning/content delta; False if it needs the full path."""
        if reasoning:
            delta = {"content": None, "reasoning_content": text}
        elif self.thinking:
            delta = {"content": text, "reasoning_content": None}
        else:
            delta = {"content": text}
        ev.append((None, {"id": self.rid, "object": "chat.completion.chunk",
                          "created": self.created, "model": self.model,
                          "system_fingerprint": None,
                          "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": None}], "usage": None}))
        return True

    def end(self, res, usage: dict) -> list:
        d = {"content": "", "reasoning_content": None} if self.thinking else {"content": ""}
        return [(None, self._chunk(d, CHAT_FINISH[res.finish_reason], usage))]

    @staticmethod
    def usage(prompt: int, completion: int, cached: int, reasoning: Optional[int] = None) -> dict:
        """`reasoning`: reasoning token count (token input only; None omits the field)."""
        u = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
        if reasoning is not None:
            u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        u["prompt_cache_hit_tokens"] = cached
        u["prompt_cache_miss_tokens"] = prompt - cached
        return u

    def final(self, res, usage: dict) -> dict:
        msg = {"role": "assistant", "content": res.content}
        if res.reasoning is not None:
            msg["reasoning_content"] = res.reasoning
        if res.tool_calls:
            msg["tool_calls"] = [{"index": i, "id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in enumerate(res.tool_calls)]
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [{"index": 0, "message": msg, "logprobs": None,
                                                  "finish_reason": CHAT_FINISH[res.finish_reason]}],
                "usage": usage, "system_fingerprint": None}


class MessagesBuilder:
    """Anthropic Messages SSE events and the final `message` object."""

    def __init__(self, rid: str, model: str, thinking: bool, signature: Optional[str] = None):
        self.rid, self.model, self.thinking = rid, model, thinking
        self.signature = rid if signature is None else signature
        self.block = None  # kind of the open block
        self.index = -1
        self.ping = False

    def _usage(self, inp, out, cached) -> dict:
        return {"input_tokens": inp, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": out, "service_tier": "standard"}

    def start(self, prompt: int, cached: int) -> list:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": self._usage(prompt, 0, cached)}})]

    def _close(self, ev: list) -> None:
        if self.block is None:
            return
        if self.block == "thinking":
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "signature_delta",
                                                         "signature": self.signature}}))
        ev.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = None

    def _open(self, kind: str, block: dict, ev: list) -> None:
        if self.thinking and self.index < 0 and kind != "thinking":
            # thinking mode always reports a thinking block first (possibly empty)
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, ev)
        self._close(ev)
        self.index += 1
        self.block = kind
        ev.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                           "content_block": block}))
        if not self.ping:
            self.ping = True
            ev.append(("ping", {"type": "ping"}))

    def fast(self, reasoning: bool, text: str, ev: list) -> bool:
        if reasoning:
            if self.block != "thinking":
                return False
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            if self.block != "text":
                return False
            delta = {"type": "text_delta", "text": text}
        ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                           "delta": delta}))
        return True

    def deltas(self, ds: list) -> list:
        ev: list = []
        for d in ds:
            c = d.__class__
            if c is ReasoningDelta:
                if self.block != "thinking":
                    self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, ev)
                ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "thinking_delta", "thinking": d.text}}))
            elif c is ContentDelta:
                if self.block != "text":
                    self._open("text", {"type": "text", "text": ""}, ev)
                ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": d.text}}))
            elif c is ToolCallStart:
                self._open("tool_use", {"type": "tool_use", "id": d.id, "name": d.name, "input": {}}, ev)
            elif c is ToolCallArgsDelta:
                ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": d.text}}))
            elif c is ToolCallEnd:
                self._close(ev)
        return ev

    def end(self, res, prompt: int, completion: int, cached: int) -> list:
        ev: list = []
        if self.thinking and self.index < 0:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, ev)
        self._close(ev)
        stop = "stop_sequence" if res.stop_sequence is not None and res.finish_reason == "stop" \
            else MSG_STOP[res.finish_reason]
        ev.append(("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop, "stop_sequence": res.stop_sequence},
            "usage": self._usage(prompt, completion, cached)}))
        ev.append(("message_stop", {"type": "message_stop"}))
        return ev

    def final(self, res, prompt: int, completion: int, cached: int) -> dict:
        content = []
        if res.reasoning is not None:
            content.append({"type": "thinking", "thinking": res.reasoning, "signature": self.signature})
        if res.content:
            content.append({"type": "text", "text": res.content})
        for c in res.tool_calls:
            try:
                inp = json.loads(c.arguments) if c.arguments else {}
            except ValueError:
                inp = {}
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": inp})
        stop = "stop_sequence" if res.stop_sequence is not None and res.finish_reason == "stop" \
            else MSG_STOP[res.finish_reason]
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop, "stop_sequence": res.stop_sequence,
                "usage": self._usage(prompt, completion, cached)}


CUSTOM_INPUT_PREFIX = '{"input": "'


class CustomToolInput:
    """A custom tool call's ``input``, made from the JSON arguments the parser streams for it, as the official
    package makes it: arguments that open with a string ``input`` member give that string, streamed decoded as
    it arrives (what follows its closing quote is dropped); any other arguments give their JSON text, streamed
    from the delta where they part from that opening; arguments cut short before either is known give the text
    they have when the call ends."""

    def __init__(self):
        self.raw = ""  # the argument deltas so far
        self.mode = "open"  # open (undecided), string (inside the input string), json (passing the JSON on), done
        self.escaped = ""  # string content held back: an escape sequence split between deltas
        self.text = ""  # the input so far

    def feed(self, delta: str) -> str:
        """One argument delta -> the input delta it makes ("" for none)."""
        self.raw += delta
        if self.mode == "open":
            if self.raw.startswith(CUSTOM_INPUT_PREFIX):
                self.mode = "string"
                return self._string(self.raw[len(CUSTOM_INPUT_PREFIX):])
            if CUSTOM_INPUT_PREFIX.startswith(self.raw):
                return ""
            self.mode, delta = "json", self.raw
        elif self.mode == "string":
            return self._string(delta)
        elif self.mode != "json":
            return ""
        self.text += delta
        return delta

    def finish(self) -> str:
        """The call ended: an undecided opening is the input as it is -> the delta that makes it."""
        if self.mode != "open":
            return ""
        self.mode, self.text = "json", self.raw
        return self.raw

    def _string(self, piece: str) -> str:
        content, at = self.escaped + piece, 0
        decoded = []
        while at < len(content):
            char = content[at]
            if char == '"':
                self.mode = "done"
                break
            if char != "\\":
                decoded.append(char)
                at += 1
                continue
            width = 6 if content[at + 1: at + 2] == "u" else 2
            if content[at + 1: at + 2] == "u" and 0xD800 <= int(content[at + 2: at + 6] or "0", 16) < 0xDC00:
                width = 12  # a surrogate pair's first half waits for its second
            if at + width > len(content):
                break
            decoded.append(json.loads(f'"{content[at: at + width]}"'))
            at += width
        self.escaped = content[at:] if self.mode == "string" else ""
        text = "".join(decoded)
        self.text += text
        return text


class ResponsesBuilder:
    """OpenAI Responses SSE events and the final `response` object. As the official package makes
    them, a call of a custom tool is a `custom_tool_call` item (its `input` from the call's
    arguments: `CustomToolInput`), a call of `tool_search` where the request's tool search runs on
    the client a `tool_search_call` item (its arguments as an object; `{}` in a response cut short,
    or for arguments that are no object), and every other call a `function_call`."""

    def __init__(self, rid: str, model: str, thinking: bool, echo: Optional[dict] = None,
                 tools_echo: Optional[list] = None, namespace_tool_map: Optional[dict] = None,
                 created: Optional[int] = None):
        self.rid, self.model, self.thinking = rid, model, thinking
        self.echo = echo or {}
        self.tools_echo = tools_echo or []
        self.ns = namespace_tool_map or {}
        tools = self.echo.get("tools") or []
        self.custom_tools = {_get(t, "name") for t in tools if _get(t, "type") == "custom"}
        self.client_tool_search = any(_get(t, "type") == "tool_search" and _get(t, "execution") == "client"
                                      for t in tools)
        self.created = int(time.time()) if created is None else created
        self.seq = 0
        self.items: list = []
        self.cur: Optional[dict] = None
        self.call: Optional[CustomToolInput] = None  # the open custom call's input
        self.search_arguments = ""  # the open tool search call's arguments, as streamed

    def _ev(self, name: str, data: dict) -> tuple:
        data["sequence_number"] = self.seq
        self.seq += 1
        return (name, data)

    def response(self, status: str, output: list, usage=None, incomplete=None) -> dict:
        e = self.echo
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "background": False,
                "completed_at": self.created if status in ("completed", "incomplete") else None,
                "content_filters": None, "error": None, "frequency_penalty": 0.0,
                "incomplete_details": incomplete, "instructions": e.get("instructions"),
                "max_output_tokens": e.get("max_output_tokens"), "max_tool_calls": None,
                "model": self.model, "moderation": None, "output": output,
                "parallel_tool_calls": True, "presence_penalty": 0.0, "previous_response_id": None,
                "prompt_cache_key": None, "prompt_cache_retention": None,
                "reasoning": _echo_reasoning(e.get("reasoning")), "safety_identifier": None,
                "service_tier": "default", "store": False, "temperature": e.get("temperature", 1.0),
                "text": _echo_text(e.get("text")), "tool_choice": _echo_tool_choice(e.get("tool_choice")),
                "tools": _echo_tools(e.get("tools")), "top_logprobs": e.get("top_logprobs", 0),
                "top_p": e.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "user": e.get("user"), "metadata": {}}

    def start(self) -> list:
        r = self.response("in_progress", [])
        return [self._ev("response.created", {"type": "response.created", "response": r}),
                self._ev("response.in_progress", {"type": "response.in_progress", "response": r})]

    def _close(self, ev: list, final_phase: Optional[str] = None, status: str = "completed") -> None:
        it = self.cur
        if it is None:
            return
        i = len(self.items) - 1
        kind = it["type"]
        if kind == "reasoning":
            text = it["content"][0]["text"]
            ev.append(self._ev("response.reasoning_text.done", {"type": "response.reasoning_text.done",
                      "content_index": 0, "item_id": it["id"], "output_index": i, "text": text}))
            ev.append(self._ev("response.content_part.done", {"type": "response.content_part.done",
                      "content_index": 0, "item_id": it["id"], "output_index": i,
                      "part": {"type": "reasoning_text", "text": text}}))
        elif kind == "message":
            text = it["content"][0]["text"]
            if final_phase:
                it["phase"] = final_phase
            ev.append(self._ev("response.output_text.done", {"type": "response.output_text.done",
                      "content_index": 0, "item_id": it["id"], "logprobs": [], "output_index": i,
                      "text": text}))
            ev.append(self._ev("response.content_part.done", {"type": "response.content_part.done",
                      "content_index": 0, "item_id": it["id"], "output_index": i,
                      "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": text}}))
        elif kind == "custom_tool_call":
            self._custom_input(self.call.finish(), ev)
            ev.append(self._ev("response.custom_tool_call_input.done", {
                "type": "response.custom_tool_call_input.done", "input": it["input"], "item_id": it["id"],
                "output_index": i}))
            self.call = None
        elif kind == "tool_search_call":
            try:
                arguments = json.loads(self.search_arguments) if status == "completed" else {}
            except ValueError:
                arguments = {}
            it["arguments"] = arguments if isinstance(arguments, dict) else {}
        else:
            ev.append(self._ev("response.function_call_arguments.done", {
                "type": "response.function_call_arguments.done", "arguments": it["arguments"],
                "item_id": it["id"], "output_index": i}))
        it["status"] = status
        ev.append(self._ev("response.output_item.done", {"type": "response.output_item.done",
                  "item": _copy(it), "output_index": i}))
        self.cur = None

    def _open(self, item: dict, ev: list, part: Optional[dict]) -> None:
        self.items.append(item)
        self.cur = item
        i = len(self.items) - 1
        ev.append(self._ev("response.output_item.added", {"type": "response.output_item.added",
                  "item": _copy(item), "output_index": i}))
        if part is not None:
            item["content"] = []
            ev.append(self._ev("response.content_part.added", {"type": "response.content_part.added",
                      "content_index": 0, "item_id": item["id"], "output_index": i, "part": dict(part)}))
            item["content"].append(part)

    def deltas(self, ds: list) -> list:
        ev: list = []
        for d in ds:
            c = d.__class__
            n = len(self.items)
            if c is ReasoningDelta:
                if self.cur is None or self.cur["type"] != "reasoning":
                    self._close(ev)
                    n = len(self.items)
                    self._open({"type": "reasoning", "id": f"rs_{self.rid}_{n}", "status": "in_progress",
                                "content": [], "summary": [], "encrypted_content": f"{self.rid}-{n}"},
                               ev, {"type": "reasoning_text", "text": ""})
                self.cur["content"][0]["text"] += d.text
                ev.append(self._ev("response.reasoning_text.delta", {"type": "response.reasoning_text.delta",
                          "content_index": 0, "delta": d.text, "item_id": self.cur["id"],
                          "output_index": len(self.items) - 1}))
            elif c is ContentDelta:
                if self.cur is None or self.cur["type"] != "message":
                    self._close(ev)
                    n = len(self.items)
                    self._open({"type": "message", "id": f"msg_{self.rid}_{n}", "status": "in_progress",
                                "role": "assistant", "phase": "final_answer", "content": []}, ev,
                               {"type": "output_text", "annotations": [], "logprobs": [], "text": ""})
                self.cur["content"][0]["text"] += d.text
                ev.append(self._ev("response.output_text.delta", {"type": "response.output_text.delta",
                          "content_index": 0, "delta": d.text, "item_id": self.cur["id"], "logprobs": [],
                          "output_index": len(self.items) - 1}))
            elif c is ToolCallStart:
                self._close(ev, "commentary")
                n = len(self.items)
                name = d.name
                if name in self.custom_tools:
                    item = {"type": "custom_tool_call", "id": f"ctc_{self.rid}_{n}", "status": "in_progress",
                            "call_id": d.id, "name": name, "input": ""}
                    self.call = CustomToolInput()
                elif name == "tool_search" and self.client_tool_search:
                    item = {"type": "tool_search_call", "id": f"tsc_{self.rid}_{n}", "status": "in_progress",
                            "call_id": d.id, "execution": "client", "arguments": {}}
                    self.search_arguments = ""
                else:
                    item = {"type": "function_call", "id": f"fc_{self.rid}_{n}", "status": "in_progress",
                            "call_id": d.id, "name": name, "arguments": ""}
                    if name in self.ns:
                        item["namespace"], item["name"] = self.ns[name]
                self._open(item, ev, None)
            elif c is ToolCallArgsDelta:
                kind = self.cur["type"]
                if kind == "custom_tool_call":
                    self._custom_input(self.call.feed(d.text), ev)
                elif kind == "tool_search_call":
                    self.search_arguments += d.text
                else:
                    self.cur["arguments"] += d.text
                    ev.append(self._ev("response.function_call_arguments.delta", {
                        "type": "response.function_call_arguments.delta", "delta": d.text,
                        "item_id": self.cur["id"], "output_index": len(self.items) - 1}))
            # ToolCallEnd: the item stays open until the next item or the end of the response
        return ev

    def _custom_input(self, delta: str, ev: list) -> None:
        if delta:
            self.cur["input"] = self.call.text
            ev.append(self._ev("response.custom_tool_call_input.delta", {
                "type": "response.custom_tool_call_input.delta", "delta": delta, "item_id": self.cur["id"],
                "output_index": len(self.items) - 1}))

    def fast(self, reasoning: bool, text: str, ev: list) -> bool:
        cur = self.cur
        if cur is None:
            return False
        if reasoning:
            if cur["type"] != "reasoning":
                return False
            cur["content"][0]["text"] += text
            ev.append(("response.reasoning_text.delta", {
                "type": "response.reasoning_text.delta", "content_index": 0, "delta": text,
                "item_id": cur["id"], "output_index": len(self.items) - 1,
                "sequence_number": self.seq}))
        else:
            if cur["type"] != "message":
                return False
            cur["content"][0]["text"] += text
            ev.append(("response.output_text.delta", {
                "type": "response.output_text.delta", "content_index": 0, "delta": text,
                "item_id": cur["id"], "logprobs": [], "output_index": len(self.items) - 1,
                "sequence_number": self.seq}))
        self.seq += 1
        return True

    def _usage(self, prompt, completion, cached, reasoning=0) -> dict:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + completion}

    def end(self, res, prompt: int, completion: int, cached: int, reasoning: int = 0) -> list:
        ev: list = []
        status, inc = _status(res.finish_reason)
        self._close(ev, status=status)
        r = self.response(status, [_copy(i) for i in self.items],
                          self._usage(prompt, completion, cached, reasoning), inc)
        name = "response.completed" if status == "completed" else "response.incomplete"
        ev.append(self._ev(name, {"type": name, "response": r}))
        return ev


def _status(fr: str):
    if fr == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if fr == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _copy(d: dict) -> dict:
    return json.loads(json.dumps(d))


def _get(o, k, default=None):
    if isinstance(o, dict):
        return o.get(k, default)
    extra = getattr(o, "model_extra", None) or {}
    return getattr(o, k, extra.get(k, default))


def _echo_reasoning(r) -> dict:
    if r is None:
        return {"effort": None, "summary": None}
    return {"effort": _get(r, "effort"), "summary": _get(r, "summary")}


def _echo_text(t) -> dict:
    fmt = _get(t, "format") if t is not None else None
    verbosity = _get(t, "verbosity") if t is not None else None
    if fmt is None:
        f = {"type": "text"}
    else:
        kind = _get(fmt, "type")
        f = {"type": kind}
        if kind == "json_schema":
            schema = fmt.get("schema") if isinstance(fmt, dict) else getattr(fmt, "schema_", None)
            f.update({"name": _get(fmt, "name"), "schema": schema,
                      "description": _get(fmt, "description"), "strict": _get(fmt, "strict")})
    return {"format": f, "verbosity": verbosity}


def _echo_tool_choice(tc):
    if tc is None:
        return "auto"
    if isinstance(tc, str):
        return tc
    return {"type": _get(tc, "type"), "name": _get(tc, "name")}


def _echo_function(t) -> dict:
    return {"type": "function", "name": _get(t, "name"), "description": _get(t, "description"),
            "parameters": _get(t, "parameters"), "strict": _get(t, "strict")}


WEB_SEARCH_TOOLS = ("web_search", "web_search_2025_08_26")
USER_LOCATION_FIELDS = ("city", "country", "region", "timezone")


def _echo_tools(tools) -> list:
    """The request's tools as the response echoes them: the fields each kind keeps, in the official order;
    tool kinds the model never sees (file search, MCP, hosted shells, web_search_preview, ...) are left out."""
    out = []
    for t in tools or []:
        kind = _get(t, "type")
        if kind == "function":
            out.append(_echo_function(t))
        elif kind == "namespace":
            out.append({"type": "namespace", "name": _get(t, "name"),
                        "description": _get(t, "description"),
                        "tools": [_echo_function(x) for x in _get(t, "tools") or []]})
        elif kind == "custom":
            out.append({"type": "custom", "name": _get(t, "name")})
        elif kind == "tool_search":
            out.append({"type": "tool_search", "execution": _get(t, "execution"),
                        "description": _get(t, "description"), "parameters": _get(t, "parameters")})
        elif kind in WEB_SEARCH_TOOLS:
            location = _get(t, "user_location")
            out.append({"type": kind, "search_context_size": _get(t, "search_context_size"),
                        "user_location": None if location is None else
                        {field: _get(location, field) for field in USER_LOCATION_FIELDS}})
    return out
