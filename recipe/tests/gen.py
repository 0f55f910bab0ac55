"""Seeded random request generators for the differential suite (one per API).

Each generator takes a `random.Random` and returns a request dict. The cases deliberately
mix the features that interact in the templates: system placement, thinking / effort,
tools and tool_choice, multi-turn reasoning, tool results, images, JSON mode, prefix.
"""
from __future__ import annotations

import random

MODELS = ["DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"]
WORDS = ["alpha", "Beta", "json", "数据", "émoji 🔎", "<｜User｜>", "</think>", "a\nb", "  ", "x",
         "<｜ref｜>r<｜/ref｜>", "<｜image｜>", "\"quote\"", "tab\tend", "1e-5"]
EFFORTS = [None, None, "none", "minimal", "low", "medium", "high", "xhigh", "max"]


def text(r: random.Random, n: int = 4) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, n)))


def schema(r: random.Random) -> dict:
    props = {}
    for i in range(r.randint(0, 3)):
        props[f"p{i}"] = r.choice([{"type": "string", "description": text(r, 2)},
                                   {"type": "integer", "minimum": 0},
                                   {"type": "number", "exclusiveMinimum": 1e-5},
                                   {"type": "array", "items": {"type": "string"}},
                                   {"type": "object", "properties": {"k": {"type": "boolean"}}}])
    return {"type": "object", "properties": props}


def args(r: random.Random) -> dict:
    out = {}
    for i in range(r.randint(0, 3)):
        out[f"p{i}"] = r.choice([text(r, 2), 3, 2.5, 1e-7, True, None, [1, "two"], {"k": False},
                                 -0.0, 12345678901234567890])
    return out


def tool_names(r):
    return [f"tool_{i}" for i in range(r.randint(1, 3))]


def chat(r: random.Random) -> dict:
    import json
    names = tool_names(r)
    use_tools = r.random() < 0.55
    req: dict = {"model": r.choice(MODELS), "messages": []}
    msgs = req["messages"]
    if r.random() < 0.5:
        msgs.append({"role": "system", "content": text(r)})
    call_no = 0
    for turn in range(r.randint(1, 4)):
        kind = r.random()
        if kind < 0.1 and turn:
            msgs.append({"role": "system", "content": r.choice(["", text(r)])})
        if kind > 0.92:
            msgs.append({"role": "latest_reminder", "content": text(r)})
        if r.random() < 0.2:
            msgs.append({"role": "user", "content": [
                {"type": "text", "text": text(r)},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                {"type": "text", "text": text(r)}]})
        else:
            msgs.append({"role": "user", "content": text(r)})
        if r.random() < 0.15:
            msgs.append({"role": "user", "content": text(r)})
        a: dict = {"role": "assistant", "content": r.choice(["", text(r)])}
        if r.random() < 0.6:
            a["reasoning_content"] = text(r)
        if use_tools and r.random() < 0.6:
            calls = []
            for _ in range(r.randint(1, 3)):
                call_no += 1
                cid = r.choice(["call_", "c", "z"]) + str(r.randint(0, 99))
                argtxt = json.dumps(args(r)) if r.random() < 0.9 else r.choice(["not json", "[1,2]"])
                calls.append({"id": cid + f"_{call_no}", "type": "function",
                              "function": {"name": r.choice(names), "arguments": argtxt}})
            a["tool_calls"] = calls
            msgs.append(a)
            order = list(calls)
            r.shuffle(order)
            for c in order:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": text(r)})
        else:
            msgs.append(a)
    msgs.append({"role": "user", "content": text(r)})
    if r.random() < 0.1:
        msgs.append({"role": "assistant", "content": r.choice(["", "Once"]),
                     "reasoning_content": text(r), "prefix": True})
    if use_tools:
        req["tools"] = [{"type": "function", "function": {
            "name": n, **({"description": text(r)} if r.random() < 0.7 else {}),
            "parameters": schema(r)}} for n in names]
        tc = r.random()
        if tc < 0.1:
            req["tool_choice"] = "none"
        elif tc < 0.2:
            req["tool_choice"] = "required"
        elif tc < 0.25:
            req["tool_choice"] = {"type": "function", "function": {"name": names[0]}}
        elif tc < 0.4:
            req["tool_choice"] = "auto"
    th = r.random()
    if th < 0.2:
        req["thinking"] = {"type": "disabled"}
    elif th < 0.3:
        req["thinking"] = {"type": r.choice(["enabled", "adaptive"])}
    e = r.choice(EFFORTS)
    if e:
        req["reasoning_effort"] = e
    rf = r.random()
    if rf < 0.08:
        req["response_format"] = {"type": "json_object"}
    elif rf < 0.13:
        req["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(r)}}
    if r.random() < 0.15:
        req["stop"] = r.choice(["END", ["END", "\n\n"]])
    if r.random() < 0.2:
        req["temperature"] = r.choice([0.0, 0.3, 1.5])
    if r.random() < 0.2:
        req["top_p"] = r.choice([0.5, 0.97, 1.0])
    return req


def _chat_base(r: random.Random) -> dict:
    req = chat(r)
    # the Responses / Messages shapes have no prefix continuation or latest_reminder
    req["messages"] = [m for m in req["messages"] if not m.get("prefix")
                       and m["role"] != "latest_reminder"]
    return req


def responses(r: random.Random) -> dict:
    c = _chat_base(r)
    out: dict = {"model": c["model"], "input": []}
    items = out["input"]
    for m in c["messages"]:
        role = m["role"]
        if role == "system":
            if not items and r.random() < 0.5 and "instructions" not in out:
                out["instructions"] = m["content"]
            else:
                items.append({"type": "message", "role": r.choice(["system", "developer"]),
                              "content": m["content"]})
        elif role == "user":
            if isinstance(m["content"], list):
                parts = [{"type": "input_text", "text": p["text"]} if p["type"] == "text" else
                         {"type": "input_image", "image_url": p["image_url"]["url"]}
                         for p in m["content"]]
                items.append({"type": "message", "role": "user", "content": parts})
            else:
                items.append({"role": "user", "content": m["content"]})
        elif role == "assistant":
            if m.get("reasoning_content") is not None:
                items.append({"type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
            if m.get("content"):
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": m["content"]}]})
            for tc in m.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": tc["id"],
                              "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
    if r.random() < 0.15 and len(items) == 1 and items[0].get("role") == "user" \
            and isinstance(items[0]["content"], str):
        out["input"] = items[0]["content"]
    if "tools" in c:
        out["tools"] = [{"type": "function", "name": t["function"]["name"],
                         **({"description": t["function"]["description"]}
                            if "description" in t["function"] else {}),
                         "parameters": t["function"]["parameters"]} for t in c["tools"]]
        if r.random() < 0.2:
            out["tools"].append({"type": "namespace", "name": "ns", "description": text(r, 2),
                                 "tools": [{"type": "function", "name": "inner",
                                            "description": text(r, 2), "parameters": schema(r)}]})
        if r.random() < 0.1:
            out["tools"].append({"type": "custom", "name": "apply_patch"})
        if r.random() < 0.1:
            out["tools"].append({"type": "web_search"})
        tc = c.get("tool_choice")
        if isinstance(tc, dict):
            out["tool_choice"] = {"type": "function", "name": tc["function"]["name"]}
        elif tc:
            out["tool_choice"] = tc
    if "thinking" in c:
        out["thinking"] = c["thinking"]
    if c.get("reasoning_effort"):
        out["reasoning"] = {"effort": c["reasoning_effort"]}
    rf = c.get("response_format")
    if rf and rf["type"] == "json_object":
        out["text"] = {"format": {"type": "json_object"}}
    elif rf:
        out["text"] = {"format": {"type": "json_schema", "name": "s", "schema": rf["json_schema"]["schema"]}}
    for k in ("temperature", "top_p"):
        if k in c:
            out[k] = c[k]
    return out


def messages(r: random.Random) -> dict:
    c = _chat_base(r)
    out: dict = {"model": c["model"], "max_tokens": r.choice([64, 1024, 500000]), "messages": []}
    ms = out["messages"]
    systems = [m["content"] for m in c["messages"] if m["role"] == "system"]
    if systems and c["messages"][0]["role"] == "system":
        s = systems[0]
        out["system"] = s if r.random() < 0.5 else [{"type": "text", "text": s}]
    pending: list = []

    def flush_user(blocks):
        if ms and ms[-1]["role"] == "user" and isinstance(ms[-1]["content"], list):
            ms[-1]["content"].extend(blocks)
        else:
            ms.append({"role": "user", "content": blocks})

    for m in c["messages"]:
        role = m["role"]
        if role == "system":
            continue
        if role == "user":
            if isinstance(m["content"], list):
                blocks = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                          {"type": "image", "source": {"type": "url", "url": p["image_url"]["url"]}}
                          for p in m["content"]]
            else:
                blocks = [{"type": "text", "text": m["content"]}]
            if r.random() < 0.3 and not (ms and ms[-1]["role"] == "user"):
                ms.append({"role": "user", "content": m["content"] if isinstance(m["content"], str) else blocks})
            else:
                flush_user(blocks)
        elif role == "assistant":
            blocks = []
            if m.get("reasoning_content") is not None:
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": "sig"})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            import json as _j
            for tc in m.get("tool_calls") or []:
                try:
                    inp = _j.loads(tc["function"]["arguments"])
                except ValueError:
                    inp = {"raw": tc["function"]["arguments"]}
                if not isinstance(inp, dict):
                    inp = {"raw": inp}
                blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": inp})
            if not blocks:
                blocks = [{"type": "text", "text": "ok"}]
            ms.append({"role": "assistant", "content": blocks})
        elif role == "tool":
            content = m["content"] if r.random() < 0.6 else [{"type": "text", "text": m["content"]}]
            flush_user([{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": content}])
    if "tools" in c:
        out["tools"] = [{"name": t["function"]["name"],
                         **({"description": t["function"]["description"]}
                            if "description" in t["function"] else {}),
                         "input_schema": t["function"]["parameters"]} for t in c["tools"]]
        tc = c.get("tool_choice")
        if isinstance(tc, dict):
            out["tool_choice"] = {"type": "tool", "name": tc["function"]["name"]}
        elif tc == "required":
            out["tool_choice"] = {"type": "any"}
        elif tc:
            out["tool_choice"] = {"type": tc}
    if "thinking" in c:
        out["thinking"] = c["thinking"]
    if c.get("reasoning_effort"):
        out["output_config"] = {"effort": c["reasoning_effort"]}
    if "stop" in c:
        out["stop_sequences"] = [c["stop"]] if isinstance(c["stop"], str) else c["stop"]
    for k in ("temperature", "top_p"):
        if k in c:
            out[k] = c[k]
    return out


GENERATORS = {"chat": chat, "responses": responses, "messages": messages}


# ---- boundary and invalid values -------------------------------------------------------
# Each `boundary` request is an ordinary generated request with one field set at, or just
# beyond, a limit the official package enforces; the class it exercises is counted in STATS
# so the suite can show every class was generated.

from collections import Counter  # noqa: E402

STATS: Counter = Counter()

TEMPERATURES = [0, 0.0, -0.0, 2, 2.0, 2.0000001, 2.0000002, 2.0001, -0.1, -1e-46, 3, 1e39]
TOP_PS = [1, 1.0, 0, 0.0, 1e-9, 1e-45, 1e-46, 1.0000001, 1.0001, -0.5]
TOP_LOGPROBS = [0, 1, 20, 21, 255, -1]
PENALTIES = [-2, 2, -2.0, 2.0, 2.0000001, 2.0000002, 2.0001, -2.0001, -3.5, 0.5]
SEEDS = [0, 1, -1, 2 ** 63 - 1, 2 ** 63]
BAD_NAMES = ["a.b", "a b", "a/b", "é", "ns::f", "", "tab\t", "x" * 129, "é" * 64, "ünï"]
OK_NAMES = ["x" * 64, "x" * 65, "x" * 128, "A-z_0-9", "-", "_"]


def _name(r: random.Random) -> str:
    return r.choice(BAD_NAMES) if r.random() < 0.7 else r.choice(OK_NAMES)


def _chat_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def _sampling(r: random.Random, req: dict, api: str) -> str:
    """Set one sampling field; the fields an API lacks are sent anyway (it must ignore them)."""
    k = r.choice(["temperature", "temperature", "top_p", "top_p", "top_logprobs",
                  "frequency_penalty", "presence_penalty", "seed", "stream_options"])
    if k == "temperature":
        req[k] = r.choice(TEMPERATURES)
    elif k == "top_p":
        req[k] = r.choice(TOP_PS)
    elif k == "top_logprobs":
        req[k] = r.choice(TOP_LOGPROBS)
        if api == "chat" and r.random() < 0.85:
            req["logprobs"] = True
    elif k in ("frequency_penalty", "presence_penalty"):
        req[k] = r.choice(PENALTIES)
    elif k == "seed":
        req[k] = r.choice(SEEDS)
    else:
        req[k] = r.choice([{"include_usage": True}, {"include_usage": False}, {}])
        s = r.choice([None, False, True])
        if s is not None:
            req["stream"] = s
    return k


def _chat_boundary(r: random.Random, req: dict) -> str:
    kind = r.choice(["sampling", "sampling", "tool_name", "duplicate_tool", "assistant_empty",
                     "stop_empty"])
    if kind == "sampling":
        return _sampling(r, req, "chat")
    if kind == "tool_name":
        tools = req.setdefault("tools", [_chat_tool("tool_0")])
        f = tools[r.randrange(len(tools))]["function"]
        tc = req.get("tool_choice")
        new = _name(r)
        if isinstance(tc, dict) and tc["function"]["name"] == f["name"]:
            tc["function"]["name"] = new
        f["name"] = new
    elif kind == "duplicate_tool":
        tools = req.setdefault("tools", [_chat_tool("tool_0")])
        tools.insert(r.randint(0, len(tools)), dict(r.choice(tools)))
    elif kind == "assistant_empty":
        m = r.choice([{"role": "assistant"}, {"role": "assistant", "content": None},
                      {"role": "assistant", "content": None, "reasoning_content": "r"},
                      {"role": "assistant", "content": None, "tool_calls": []},
                      {"role": "assistant", "content": "", "tool_calls": []},
                      {"role": "assistant", "content": ""}, {"role": "assistant", "content": []}])
        msgs = req["messages"]
        if msgs[-1]["role"] == "assistant" and r.random() < 0.5:
            msgs[-1].pop("content")  # a prefix continuation with nothing to continue
        else:
            msgs.insert(r.randint(0, len(msgs) - 1), m)
    else:
        req["stop"] = r.choice(["", [""], ["", "END"], ["END", ""], "END", []])
    return kind


def _responses_boundary(r: random.Random, req: dict) -> str:
    kind = r.choice(["sampling", "sampling", "tool_name", "duplicate_tool", "refusal_part"])
    if kind == "sampling":
        return _sampling(r, req, "responses")
    tools = req.setdefault("tools", [{"type": "function", "name": "tool_0"}])
    fns = [t for t in tools if t["type"] == "function"] or tools
    if kind == "tool_name":
        where = r.random()
        if where < 0.6:
            _rename(req, r.choice(fns), _name(r))
        else:
            ns = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}
            if where < 0.8:
                ns["name"] = _name(r)
            else:
                ns["tools"][0]["name"] = _name(r)
            tools.insert(r.randint(0, len(tools)), ns)
    elif kind == "duplicate_tool":
        where = r.random()
        if where < 0.5:
            tools.insert(r.randint(0, len(tools)), dict(r.choice(fns)))
        elif where < 0.7:
            tools += [{"type": "function", "name": "apply_patch"}, {"type": "custom", "name": "apply_patch"}]
        elif where < 0.85:
            tools.append({"type": "namespace", "name": "ns",
                          "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]})
        else:  # not duplicates: a namespace is its own name space
            tools += [{"type": "function", "name": "ns"},
                      {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "ns"}]}]
    else:
        if isinstance(req["input"], str):
            req["input"] = [{"role": "user", "content": req["input"]}]
        items = req["input"]
        part = {"type": "refusal", "refusal": "I can't help with that."}
        where = r.random()
        if where < 0.5:
            items.insert(r.randint(0, len(items)), {"type": "message", "role": "assistant",
                                                    "content": [part]})
        elif where < 0.75:
            items.insert(r.randint(0, len(items)), {"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "a"}, part]})
        else:
            items += [{"type": "function_call", "call_id": "rf", "name": "tool_0", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "rf", "output": [part]},
                      {"role": "user", "content": "go on"}]
    return kind


def _rename(req: dict, tool: dict, new: str) -> None:
    """Rename a tool and a tool_choice that names it, so only the name itself is in question."""
    tc = req.get("tool_choice")
    if isinstance(tc, dict) and tc.get("name") == tool["name"]:
        tc["name"] = new
    tool["name"] = new


def _messages_boundary(r: random.Random, req: dict) -> str:
    kind = r.choice(["sampling", "sampling", "tool_name", "duplicate_tool", "stop_empty"])
    if kind == "sampling":
        k = r.choice(["temperature", "top_p"])
        req[k] = r.choice(TEMPERATURES if k == "temperature" else TOP_PS)
        return k
    tools = req.setdefault("tools", [{"name": "tool_0", "input_schema": {"type": "object"}}])
    if kind == "tool_name":
        _rename(req, r.choice(tools), _name(r))
    elif kind == "duplicate_tool":
        tools.insert(r.randint(0, len(tools)), dict(r.choice(tools)))
    else:
        req["stop_sequences"] = r.choice([[""], ["", "END"], ["END", ""], ["END"], []])
    return kind


_BOUNDARY = {"chat": _chat_boundary, "responses": _responses_boundary,
             "messages": _messages_boundary}


def boundary(api: str, r: random.Random, count: bool = True) -> tuple:
    """-> (class name, request): a generated request with one boundary value set. Counted in
    STATS unless `count` is false, so a recount does not double the summary."""
    req = GENERATORS[api](r)
    kind = _BOUNDARY[api](r, req)
    if count:
        STATS[(api, kind)] += 1
    return kind, req


# ---- prompt shapes ----------------------------------------------------------------------
# Each `shape` request is an ordinary generated request reshaped in one way that changes
# how the official package assembles the prompt (how pieces of a turn are joined, what an
# unsupported part becomes, which inputs it drops or refuses). SHAPE_STATS counts the classes.

SHAPE_STATS: Counter = Counter()
_IMG = "https://x/y.png"


def _items(req: dict) -> list:
    if isinstance(req["input"], str):
        req["input"] = [{"role": "user", "content": req["input"]}]
    return req["input"]


def _split(r: random.Random, t: str) -> list:
    """A text cut into 1-3 pieces, sometimes with an empty piece in between or in front."""
    cuts = sorted(r.randint(0, len(t)) for _ in range(r.randint(0, 2)))
    out = [t[a:b] for a, b in zip([0] + cuts, cuts + [len(t)])]
    if r.random() < 0.3:
        out.insert(r.randint(0, len(out)), "")
    return out


def _user_at(r: random.Random, seq: list, user) -> None:
    """Insert a user message right after a tool result or user message, or at the end before
    the last user turn, so it lands inside a run of user/tool messages."""
    spots = [i + 1 for i, m in enumerate(seq)
             if m.get("role") in ("user", "tool") or m.get("type") == "function_call_output"]
    seq.insert(r.choice(spots) if spots else len(seq), user)


def _unknown_choice(r: random.Random, req: dict, api: str) -> str:
    """A named tool_choice that names no tool of the request."""
    if api == "chat":
        req["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
    elif api == "responses":
        req["tool_choice"] = {"type": r.choice(["function", "custom"]), "name": "nope"}
    else:
        req["tool_choice"] = {"type": "tool", "name": "nope"}
    return "tool_choice_unknown"


def _responses_shape(r: random.Random, req: dict) -> str:
    kind = r.choice(["reasoning_parts", "reasoning_parts", "empty_user", "assistant_image",
                     "tool_choice_unknown", "empty_input", "dropped_items", "dropped_items",
                     "output_pairing", "namespace_call", "input_file"])
    if kind == "tool_choice_unknown":
        return _unknown_choice(r, req, "responses")
    if kind == "empty_input":
        req["input"] = []
        return kind
    items = _items(req)
    if kind == "dropped_items":
        for _ in range(r.randint(1, 3)):
            items.insert(r.randint(0, len(items)), r.choice([
                {"type": "item_reference", "id": "msg_1"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed",
                 "action": {"type": "search", "query": "q"}},
                {"type": r.choice(["computer_call", "file_search_call", "mcp_call",
                                   "local_shell_call_output", "image_generation_call",
                                   "code_interpreter_call", "mcp_approval_request"]),
                 "id": "h_1", "call_id": "hc_1"}]))
        if r.random() < 0.4:
            tools = req.setdefault("tools", [])
            tools.insert(r.randint(0, len(tools)), {"type": r.choice([
                "apply_patch", "apply_patch", "file_search", "mcp", "code_interpreter",
                "local_shell", "shell", "computer_use_preview", "image_generation"])})
        return kind
    if kind == "namespace_call":
        ns, inner = r.choice([("ns", "inner"), ("n_", "f"), ("ns", "_f"), ("other", "g")])
        tools = req.setdefault("tools", [])
        if not any(t.get("name") == ns for t in tools):
            tools.append({"type": "namespace", "name": ns, "description": text(r, 2),
                          "tools": [{"type": "function", "name": inner}]})
        at = r.randint(0, len(items) - 1)
        items[at:at] = [{"type": "function_call", "call_id": "nsc", "namespace": ns, "name": inner,
                         "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "nsc", "output": text(r)}]
        return kind
    if kind == "input_file":
        part = r.choice([{"type": "input_file", "file_id": "file_1"},
                         {"type": "input_file", "filename": "a.pdf",
                          "file_data": "data:application/pdf;base64,AAAA"}])
        for it in items:
            if it.get("type", "message") == "message" and r.random() < 0.5:
                c = it["content"]
                if isinstance(c, str):
                    c = [{"type": "input_text" if it["role"] != "assistant" else "output_text",
                          "text": c}]
                c.insert(r.randint(0, len(c)), part)
                it["content"] = c
            elif it.get("type") == "function_call_output" and r.random() < 0.3:
                it["output"] = [part]
        return kind
    if kind == "output_pairing":
        calls = [it["call_id"] for it in items if it.get("type") == "function_call"]
        out = {"type": "function_call_output", "output": text(r),
               "call_id": r.choice(calls) if calls and r.random() < 0.5 else "nope"}
        items.insert(r.randint(0, len(items)), out)
        return kind
    if kind == "reasoning_parts":
        out = []
        for it in items:
            if it.get("type") == "reasoning" and it["content"]:
                pieces = _split(r, it["content"][0]["text"])
                if r.random() < 0.5:
                    it = dict(it, content=[{"type": "reasoning_text", "text": p} for p in pieces])
                    out.append(it)
                else:
                    out += [{"type": "reasoning", "summary": [],
                             "content": [{"type": "reasoning_text", "text": p}] if p or
                             r.random() < 0.5 else []} for p in pieces]
                continue
            out.append(it)
            if it.get("role") == "assistant" and r.random() < 0.4:
                # reasoning after an answer opens a new assistant turn
                out += [{"type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": text(r)}]},
                        {"type": "message", "role": "assistant",
                         "content": [{"type": "output_text", "text": text(r)}]}]
        req["input"] = out
    elif kind == "empty_user":
        for _ in range(r.randint(1, 2)):
            _user_at(r, items, {"role": "user", "content": r.choice(["", "", text(r)])})
    else:
        items.insert(r.randint(0, len(items)), {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": r.choice(["", text(r)])},
            {"type": "input_image", "image_url": _IMG}][::r.choice([1, -1])]})
    return kind


def _chat_shape(r: random.Random, req: dict) -> str:
    kind = r.choice(["empty_user", "empty_user", "assistant_image", "tool_choice_unknown",
                     "regex", "file_part"])
    if kind == "tool_choice_unknown":
        return _unknown_choice(r, req, "chat")
    if kind == "file_part":
        users = [m for m in req["messages"] if m["role"] in ("user", "system")]
        m = r.choice(users)
        if isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        m["content"].insert(r.randint(0, len(m["content"])), {"type": "file", "file": r.choice(
            [{"file_id": "file_1"},
             {"filename": "a.pdf", "file_data": "data:application/pdf;base64,AA"}])})
        return kind
    if kind == "regex":
        req["response_format"] = {"type": "regex", "regex": r.choice(["[a-z]+", "(yes|no)"])}
        return kind
    msgs = req["messages"]
    if kind == "empty_user":
        for _ in range(r.randint(1, 2)):
            _user_at(r, msgs, {"role": "user", "content": r.choice(["", "", text(r)])})
    else:
        msgs.insert(r.randint(0, len(msgs) - 1), {"role": "assistant", "content": [
            {"type": "text", "text": r.choice(["", text(r)])},
            {"type": "image_url", "image_url": {"url": _IMG}}][::r.choice([1, -1])]})
    return kind


def _break_pairing(r: random.Random, msgs: list) -> None:
    """One change to how tool_use and tool_result blocks pair up (or none, when the
    conversation has no calls): a result dropped, repeated, moved behind text or into the
    wrong message, an orphan result, a repeated tool_use id, text after a tool_use."""
    users = [m for m in msgs if m["role"] == "user" and isinstance(m["content"], list)
             and any(b["type"] == "tool_result" for b in m["content"])]
    callers = [m for m in msgs if m["role"] == "assistant"
               and any(b["type"] == "tool_use" for b in m["content"])]
    how = r.choice(["drop", "repeat", "text_first", "orphan", "same_id", "text_after", "split"])
    if how == "orphan" or not users:
        at = r.randrange(len(msgs))
        if msgs[at]["role"] == "user" and isinstance(msgs[at]["content"], list):
            msgs[at]["content"].insert(0, {"type": "tool_result", "tool_use_id": "zz",
                                           "content": "r"})
        else:
            msgs.insert(at, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "zz", "content": "r"}]})
        return
    m = r.choice(users)
    results = [b for b in m["content"] if b["type"] == "tool_result"]
    if how == "drop":
        m["content"].remove(r.choice(results))
        if not m["content"]:
            m["content"].append({"type": "text", "text": "go on"})
    elif how == "repeat":
        m["content"].insert(r.randint(0, len(m["content"])), dict(r.choice(results)))
    elif how == "text_first":
        m["content"].insert(0, {"type": "text", "text": text(r)})
    elif how == "split":
        at = msgs.index(m)
        b = results[-1]
        m["content"].remove(b)
        if not m["content"]:
            m["content"].append({"type": "text", "text": "go on"})
        msgs.insert(at + 1, {"role": "user", "content": [b]})
    elif callers:
        a = r.choice(callers)
        uses = [b for b in a["content"] if b["type"] == "tool_use"]
        if how == "same_id":
            a["content"].append(dict(uses[0]))
        else:
            a["content"].insert(a["content"].index(uses[0]) + 1, {"type": "text", "text": "and"})


def _messages_shape(r: random.Random, req: dict) -> str:
    kind = r.choice(["thinking_blocks", "text_blocks", "text_blocks", "assistant_image",
                     "tool_choice_unknown", "system_message", "system_message", "document",
                     "tool_pairing", "tool_pairing", "server_blocks", "image_file"])
    if kind == "tool_choice_unknown":
        return _unknown_choice(r, req, "messages")
    msgs = req["messages"]
    if kind == "tool_pairing":
        _break_pairing(r, msgs)
        return kind
    if kind == "server_blocks":
        m = r.choice(msgs)
        if isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        m["content"].insert(r.randint(0, len(m["content"])), r.choice([
            {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {}},
            {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []},
            {"type": "tool_use", "id": "tu_x", "name": "tool_0", "input": {}}]))
        return kind
    if kind == "image_file":
        m = r.choice(msgs)
        if isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        img = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
        results = [b for b in m["content"] if b["type"] == "tool_result"]
        if results and r.random() < 0.5:
            results[0]["content"] = [img]
        else:
            m["content"].insert(r.randint(len(results), len(m["content"])), img)
        return kind
    if kind == "document":
        for m in msgs:
            if r.random() < 0.5:
                continue
            doc = {"type": "document", "source": r.choice([
                {"type": "text", "media_type": "text/plain", "data": "doc"},
                {"type": "base64", "media_type": "application/pdf", "data": "AAAA"},
                {"type": "url", "url": "https://x/a.pdf"}])}
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            blocks = m["content"]
            if m["role"] == "user":
                results = [b for b in blocks if b["type"] == "tool_result"]
                if results and r.random() < 0.5:
                    results[0]["content"] = [doc]
                    continue
                blocks.insert(r.randint(len(results), len(blocks)), doc)
            else:
                blocks.insert(r.randint(0, len(blocks)), doc)
        return kind
    if kind == "system_message":
        for _ in range(r.randint(1, 2)):
            content = r.choice(["", text(r),
                                [{"type": "text", "text": t} for t in _split(r, text(r))]])
            if r.random() < 0.1:
                content = []
            msgs.insert(r.randint(0, len(msgs)), {"role": "system", "content": content})
        return kind
    if kind == "thinking_blocks":
        for m in msgs:
            if m["role"] == "assistant":
                blocks = []
                for b in m["content"]:
                    if b["type"] == "thinking":
                        blocks += [dict(b, thinking=p) for p in _split(r, b["thinking"])]
                    else:
                        blocks.append(b)
                m["content"] = blocks
    elif kind == "text_blocks":
        for m in msgs:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            blocks = []
            for b in m["content"]:
                if b["type"] == "text":
                    blocks += [dict(b, text=p) for p in _split(r, b["text"])]
                else:
                    blocks.append(b)
                if r.random() < 0.2 and (m["role"] == "user" or b["type"] != "tool_use"):
                    blocks.append({"type": "text", "text": ""})
            m["content"] = blocks
    else:
        msgs.insert(r.randint(0, len(msgs) - 1), {"role": "assistant", "content": [
            {"type": "text", "text": r.choice(["", text(r)])},
            {"type": "image", "source": {"type": "url", "url": _IMG}}][::r.choice([1, -1])]})
    return kind


_SHAPE = {"chat": _chat_shape, "responses": _responses_shape, "messages": _messages_shape}


def shape(api: str, r: random.Random, count: bool = True) -> tuple:
    """-> (class name, request): a generated request reshaped in one way."""
    req = GENERATORS[api](r)
    kind = _SHAPE[api](r, req)
    if count:
        SHAPE_STATS[(api, kind)] += 1
    return kind, req


# ---- strict schemas ---------------------------------------------------------------------
# A strict tool or response format is read as the official package reads it: normalised
# (keywords dropped, fixed order) or refused. `strict_schema` builds schemas that mix kept and
# dropped keywords, and each of the refusals it knows.

STRICT_OK = [
    {"type": "string", "description": "d", "title": "T", "minLength": 1, "pattern": "^a",
     "format": "email", "enum": ["a", "b"], "default": "a"},
    {"description": "n", "maximum": 5, "type": "number", "minimum": 0.5, "multipleOf": 2},
    {"type": "integer", "enum": [1], "exclusiveMinimum": 0, "format": "uuid"},
    {"type": "array", "minItems": 1, "items": {"type": "string", "format": "ipv4"},
     "description": "a"},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "u", "title": "U"},
    {"type": ["string", "null"], "description": "t", "enum": ["x", None]},
    {"$ref": "#/$defs/X", "description": "dropped"},
    {"type": "boolean", "default": True},
    {"type": "null"},
]
STRICT_BAD = [
    {"type": "string", "format": "date"},
    {"type": "string", "enum": ["a", 1]},
    {"type": "array"},
    {"oneOf": [{"type": "string"}]},
    {"type": "str"},
    {"type": "object", "properties": {}},
]


def strict_schema(r: random.Random, top_ok: bool = True) -> dict:
    props = {}
    for i in range(r.randint(1, 4)):
        p = dict(r.choice(STRICT_OK))
        if r.random() < 0.15:
            p = {"type": "object", "properties": {"k": dict(r.choice(STRICT_OK))},
                 "additionalProperties": False, "description": "o", "title": "O"}
        props[f"p{i}"] = p
    if r.random() < 0.15:
        props[f"bad{len(props)}"] = dict(r.choice(STRICT_BAD))
    s = {"title": "S", "type": "object", "properties": props}
    k = r.random()
    if k < 0.5:
        s["required"] = list(props)[::r.choice([1, -1])]
    elif k < 0.6:
        s["required"] = list(props)[1:] or ["missing"]
    elif k < 0.65:
        s["required"] = list(props) + [list(props)[0]]
    elif k < 0.7:
        s["required"] = list(props) + ["missing"]
    a = r.random()
    if a < 0.6:
        s["additionalProperties"] = False
    elif a < 0.68:
        s["additionalProperties"] = True
    elif a < 0.76:
        s["additionalProperties"] = {"type": "string"}
    if r.random() < 0.4:
        s["$defs"] = {"X": {"type": "string"}}
    if r.random() < 0.2:
        s["description"] = "top"
    if r.random() < 0.05:
        s = r.choice([{"type": "string"}, {"anyOf": [s]}, {"type": "object"}])
    return s


def strict(api: str, r: random.Random) -> tuple:
    """-> (class name, request) with a strict tool or strict response format."""
    req = GENERATORS[api](r)
    if api == "responses" and r.random() < 0.5:
        req.pop("tools", None)
        req.pop("tool_choice", None)
        req["text"] = {"format": {"type": "json_schema", "name": "s", "strict": True,
                                  "schema": strict_schema(r)}}
        return "strict_format", req
    if api == "chat" and r.random() < 0.5:
        req.pop("tools", None)
        req.pop("tool_choice", None)
        req["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "s", "strict": r.choice([True, True, None]), "schema": strict_schema(r)}}
        return "strict_format", req
    tools = req.setdefault("tools", [])
    if api == "chat":
        tools[:] = [{"type": "function", "function": {"name": f"tool_{i}", "strict": True,
                                                      "parameters": strict_schema(r)}}
                    for i in range(max(1, len(tools)))]
        if r.random() < 0.1:
            tools[0]["function"].pop("parameters")
    else:
        tools[:] = [dict(t, strict=True, parameters=strict_schema(r)) if t["type"] == "function"
                    else t for t in tools] or [{"type": "function", "name": "tool_0",
                                                "strict": True, "parameters": strict_schema(r)}]
        for t in tools:
            if t["type"] == "namespace":
                t["tools"] = [dict(f, strict=True, parameters=strict_schema(r)) for f in t["tools"]]
            elif t["type"] != "function":
                tools.remove(t)
    return "strict_tool", req


# ---- tool schemas and tool types ----------------------------------------------------------
# Non-strict tool parameters are JSON Schema documents whose top level must be an object;
# Messages tools with a `type` are server tools.

SCHEMA_VARIANTS = [
    {"type": "object", "required": ["a", "a"], "properties": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}},
     "$defs": {"X": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
    {"type": "string"}, {}, {"properties": {}}, {"type": ["object", "null"]},
    {"type": "object"},
]


def tool_schemas(api: str, r: random.Random) -> tuple:
    """-> (class name, request) with one tool's schema (or a Messages tool's type) varied."""
    req = GENERATORS[api](r)
    if api == "messages" and r.random() < 0.3:
        tools = req.setdefault("tools", [{"name": "tool_0", "input_schema": {"type": "object"}}])
        t = r.choice(tools)
        t["type"] = r.choice(["custom", "function", "bash_20250124", "web_search_20250305",
                              "text_editor_20250124"])
        return "tool_type", req
    v = r.choice(SCHEMA_VARIANTS + [None])
    if api == "chat":
        tools = req.setdefault("tools", [{"type": "function", "function": {"name": "tool_0"}}])
        f = r.choice(tools)["function"]
        f.pop("parameters", None)
        if v is not None:
            f["parameters"] = v
    elif api == "responses":
        tools = req.setdefault("tools", [{"type": "function", "name": "tool_0"}])
        f = r.choice([t for t in tools if t["type"] == "function"] or tools)
        if f["type"] == "function":
            f.pop("parameters", None)
            if v is not None:
                f["parameters"] = v
    else:
        tools = req.setdefault("tools", [{"name": "tool_0"}])
        f = r.choice(tools)
        f.pop("input_schema", None)
        if v is not None:
            f["input_schema"] = v
    if r.random() < 0.3:
        fmt = dict(r.choice(SCHEMA_VARIANTS))
        if api == "chat":
            req["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "s", "schema": fmt}}
        elif api == "responses":
            req["text"] = {"format": {"type": "json_schema", "name": "s", "schema": fmt}}
    return "tool_schema", req


def combined(api: str, r: random.Random) -> tuple:
    """-> (classes, request, options): two or three reshapings of one request, sometimes a
    boundary value and the reject-missing-reasoning option too. Several problems in one
    request decide which refusal is reported first, so this compares the order of checks."""
    req = GENERATORS[api](r)
    kinds = []
    for _ in range(r.randint(2, 3)):
        try:
            kinds.append(_SHAPE[api](r, req))
        except (ValueError, IndexError):
            pass  # a reshaping that found nothing to work on (e.g. an emptied input)
    if r.random() < 0.3:
        try:
            kinds.append(_BOUNDARY[api](r, req))
        except (ValueError, IndexError, KeyError, TypeError, AttributeError):
            pass  # a boundary change that assumes a request shape no longer there
    opts = {"reasoning_content_behavior": "reject"} if r.random() < 0.3 else None
    return kinds, req, opts


# ---- images: every place an image may stand, with its detail and source kind -------------

DETAILS = ["low", "high", "original", "auto"]


def _image_ref(r: random.Random) -> str:
    return r.choice([f"https://img.example/{r.randint(0, 99)}.png",
                     "data:image/png;base64,iVBORw0KGgo=", "data:image/jpeg;base64,/9j/4AAQ"])


def _image_part(api: str, r: random.Random) -> dict:
    url = _image_ref(r)
    if api == "chat":
        image = {"url": url}
        if r.random() < 0.7:
            image["detail"] = r.choice(DETAILS)
        return {"type": "image_url", "image_url": image}
    if api == "responses":
        part = {"type": "input_image", "image_url": url}
        if r.random() < 0.7:
            part["detail"] = r.choice(DETAILS)
        return part
    if url.startswith("data:"):
        media, _, data = url[len("data:"):].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _text_part(api: str, r: random.Random) -> dict:
    return {"type": "input_text" if api == "responses" else "text", "text": text(r)}


def _mixed(api: str, r: random.Random, least: int = 1) -> list:
    parts = [_image_part(api, r) for _ in range(r.randint(least, 3))]
    parts += [_text_part(api, r) for _ in range(r.randint(0, 2))]
    r.shuffle(parts)
    return parts


def images(api: str, r: random.Random) -> dict:
    """A conversation with images in user turns, in tool results and (where the API has them in
    messages) in system turns, several per turn, each URL or data URL with a random detail."""
    model = r.choice(MODELS)
    if api == "chat":
        tools = [_chat_tool("lookup")]
        msgs: list = []
        if r.random() < 0.3:
            msgs.append({"role": "system", "content": _mixed(api, r, least=0) or text(r)})
        msgs.append({"role": "user", "content": _mixed(api, r)})
        if r.random() < 0.6:
            calls = [{"id": f"c{k}", "type": "function",
                      "function": {"name": "lookup", "arguments": "{}"}} for k in range(r.randint(1, 2))]
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": _mixed(api, r, least=0)
                      or text(r)} for c in calls]
        msgs.append({"role": "user", "content": r.choice([text(r), _mixed(api, r)])})
        return {"model": model, "messages": msgs, "tools": tools}
    if api == "responses":
        items: list = []
        if r.random() < 0.3:
            items.append({"type": "message", "role": r.choice(["system", "developer"]),
                          "content": _mixed(api, r)})
        items.append({"type": "message", "role": "user", "content": _mixed(api, r)})
        if r.random() < 0.6:
            items.append({"type": "function_call", "call_id": "c1", "name": "lookup",
                          "arguments": "{}"})
            items.append({"type": "function_call_output", "call_id": "c1",
                          "output": _mixed(api, r, least=0) or text(r)})
        items.append({"role": "user", "content": r.choice([text(r), _mixed(api, r)])})
        return {"model": model, "input": items,
                "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}
    msgs = []
    if model == "DeepSeek-V4.1-Flash" and r.random() < 0.3:
        msgs.append({"role": "system", "content": _mixed(api, r)})
    msgs.append({"role": "user", "content": _mixed(api, r)})
    if r.random() < 0.6:
        ids = [f"t{k}" for k in range(r.randint(1, 2))]
        msgs.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": i, "name": "lookup", "input": {}} for i in ids]})
        results = [{"type": "tool_result", "tool_use_id": i,
                    "content": _mixed(api, r, least=0) or text(r)} for i in ids]
        msgs.append({"role": "user", "content": results + _mixed(api, r, least=0)})
    msgs.append({"role": "user", "content": r.choice([text(r), _mixed(api, r)])})
    return {"model": model, "max_tokens": 64, "messages": msgs,
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}


# ---- Chat tool answers: stray, repeated and missing answers, file parts in tool results ---

def tool_answers(r: random.Random) -> dict:
    """Assistant turns with one to three calls, each followed by answers drawn from its own ids,
    ids of other turns and unknown ids, in any order, repeated or left out, some carrying a
    file part (which V4.1 refuses in any message)."""
    msgs: list = [{"role": "user", "content": text(r)}]
    seen: list = []
    for turn in range(r.randint(1, 3)):
        ids = [f"c{turn}_{k}" for k in range(r.randint(1, 3))]
        seen += ids
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]})
        answers = list(ids) if r.random() < 0.6 else r.sample(ids, r.randint(0, len(ids)))
        if r.random() < 0.4:
            answers.insert(r.randint(0, len(answers)), r.choice(seen + ["zz"]))
        r.shuffle(answers)
        for i in answers:
            content = text(r)
            if r.random() < 0.15:
                content = [{"type": "text", "text": text(r)},
                           {"type": "file", "file": r.choice([{"file_id": "f1"}, {}])}]
            msgs.append({"role": "tool", "tool_call_id": i, "content": content})
        if r.random() < 0.7:
            msgs.append({"role": "user", "content": text(r)})
    return {"model": r.choice(MODELS), "messages": msgs, "tools": [_chat_tool("f")]}


# ---- Responses tool search, and deferred tools in every API -------------------------------

def _found_tool(r: random.Random, k: int) -> dict:
    fn = {"type": "function", "name": f"found_{k}", "parameters": schema(r)}
    if r.random() < 0.5:
        fn["description"] = text(r)
    kind = r.random()
    if kind < 0.2:
        return {"type": "namespace", "name": f"ns{k}", "tools": [fn],
                **({"description": text(r)} if r.random() < 0.5 else {})}
    if kind < 0.25:
        return {"type": "custom", "name": "apply_patch"}
    return fn


def tool_search(r: random.Random) -> dict:
    """Client-run tool searches in a Responses history: calls with their arguments, outputs
    (answered in any order, alone or beside function calls of the same turn) listing the
    functions, namespaces and custom tools found; sometimes with request tools."""
    items: list = [{"role": "user", "content": text(r)}]
    k = 0
    for turn in range(r.randint(1, 2)):
        if r.random() < 0.3:
            items.append({"type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": text(r)}]})
        calls = [{"type": "tool_search_call", "call_id": f"s{turn}_{j}",
                  "arguments": r.choice([{"query": text(r)}, {"query": text(r), "limit": 3}, {}])}
                 for j in range(r.randint(1, 2))]
        outputs = []
        for c in calls:
            found = [_found_tool(r, k + j) for j in range(r.randint(0, 2))]
            k += len(found)
            outputs.append({"type": "tool_search_output", "call_id": c["call_id"], "tools": found})
        if r.random() < 0.3:
            calls.append({"type": "function_call", "call_id": f"f{turn}", "name": "lookup",
                          "arguments": "{}"})
            outputs.append({"type": "function_call_output", "call_id": f"f{turn}", "output": text(r)})
        r.shuffle(outputs)
        if r.random() < 0.1:
            outputs.pop()  # a call left unanswered
        items += calls + outputs
        if r.random() < 0.6:
            items.append({"role": "user", "content": text(r)})
    req = {"model": r.choice(MODELS), "input": items}
    tools = [{"type": "function", "name": "lookup", "parameters": schema(r)}]
    if r.random() < 0.5:
        tools.insert(0, {"type": "tool_search"})
    if r.random() < 0.3:
        tools.append({"type": "function", "name": "later", "parameters": schema(r), "defer_loading": True})
    if r.random() < 0.8:
        req["tools"] = tools
    return req


def deferred_tools(api: str, r: random.Random) -> dict:
    """Function tools with `defer_loading` in the places each API's clients put it."""
    tools = []
    for k in range(r.randint(1, 3)):
        defer = r.random() < 0.5
        if api == "chat":
            fn = {"name": f"t{k}", "parameters": schema(r)}
            tool = {"type": "function", "function": fn}
            if defer:
                (fn if r.random() < 0.5 else tool)["defer_loading"] = True
        elif api == "responses":
            tool = {"type": "function", "name": f"t{k}", "parameters": schema(r),
                    **({"defer_loading": True} if defer else {})}
        else:
            tool = {"name": f"t{k}", "input_schema": schema(r), **({"defer_loading": True} if defer else {})}
        tools.append(tool)
    model = r.choice(MODELS)
    if api == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text(r)}], "tools": tools}
    if api == "responses":
        return {"model": model, "input": text(r), "tools": tools}
    return {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": text(r)}], "tools": tools}
