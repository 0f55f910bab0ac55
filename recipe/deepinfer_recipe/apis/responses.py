"""OpenAI Responses: request models (input items, function / namespace / apply_patch tools)
and conversion to a Conversation."""
from __future__ import annotations

import json
import os
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, model_validator

from ..conversation import Conversation, ImageSource, Message, ModelVersion, ToolCall, join_parts
from ..errors import ConversionError, RequestValidationError
from ..jsonfmt import compact
from ..strict import check_document, normalise
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, resolve_model,
                       resolve_thinking, sampling)
from .chat import make_parsing
from .common import (Model, _TAGS, check_format_with_tools, check_reasoning_passed,
                     check_temperature, check_tool_name, check_top_logprobs, check_top_p,
                     check_unique, make_tool, no_such_tool, output_constraint, read_tool_schemas,
                     validate)

_TAGS.update({"message", "reasoning", "function_call", "function_call_output", "input_text",
              "output_text", "input_image", "reasoning_text", "summary_text", "namespace",
              "custom", "web_search", "web_search_preview", "custom_tool_call",
              "custom_tool_call_output", "developer", "item_reference", "web_search_call",
              "apply_patch", "input_file", "other", "hosted"})

with open(os.path.join(os.path.dirname(__file__), "..", "data", "apply_patch_tool.json"),
          encoding="utf-8") as _f:
    APPLY_PATCH = json.load(_f)


class InputText(Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(Model):
    type: Literal["input_image"]
    image_url: Optional[str] = None
    detail: Literal["low", "high", "original", "auto"] = "high"


class InputFile(Model):
    """A file is not read: the model is told one was there."""

    type: Literal["input_file"]
    text: ClassVar[str] = "[Unsupported Document]"


# no `refusal` part: the official package refuses it as input, having no way to render it
Part = Annotated[Union[InputText, InputImage, InputFile], Field(discriminator="type")]


class MessageItem(Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]


class ReasoningText(Model):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Model):
    type: Literal["reasoning"]
    content: Optional[list[ReasoningText]] = None
    summary: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[str] = None


class FunctionCallItem(Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""
    namespace: Optional[str] = None


class FunctionCallOutputItem(Model):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Part]]


class CustomToolCallItem(Model):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class CustomToolCallOutputItem(Model):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Union[str, list[Part]]


class WebSearchCallItem(Model):
    type: Literal["web_search_call"]


class ToolSearchCallItem(Model):
    """A client-run tool search: V4.1 shows it as a call of `tool_search` with the arguments."""

    type: Literal["tool_search_call"]
    call_id: str
    arguments: dict[str, Any]


class ToolSearchOutputItem(Model):
    """The tools a tool search found (the `Tool` union, defined below): its result, and from
    then on tools the model may call."""

    type: Literal["tool_search_output"]
    call_id: str
    tools: list["Tool"]


class OtherItem(Model):
    """Any other item (a stored item reference, a hosted tool's call or output, an MCP
    exchange...): state held by another server, nothing of it can be rendered, and the
    official package skips it."""

    type: str


def _by_type(members: dict, fallback: tuple[str, type], missing: str | None = None):
    """A union chosen by ``type``: a type in ``members`` selects its model, any other the fallback model (what
    the official package skips or drops); ``missing`` is the type of an entry that names none."""
    other, other_model = fallback

    def tag(v) -> str:
        t = v.get("type", missing) if isinstance(v, dict) else getattr(v, "type", None)
        return t if t in members else other

    arms = tuple(Annotated[model, Tag(t)] for t, model in members.items()) + (Annotated[other_model, Tag(other)],)
    return Annotated[Union[arms], Discriminator(tag)]


_ITEMS = {"message": MessageItem, "reasoning": ReasoningItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem, "custom_tool_call": CustomToolCallItem,
          "custom_tool_call_output": CustomToolCallOutputItem, "web_search_call": WebSearchCallItem,
          "tool_search_call": ToolSearchCallItem, "tool_search_output": ToolSearchOutputItem}
Item = _by_type(_ITEMS, ("other", OtherItem), missing="message")
RENDERED_ITEM_TYPES = frozenset(_ITEMS)  # input items of any other type are skipped, as the official package does


class FunctionTool(Model):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None
    defer_loading: bool = False


class NamespaceTool(Model):
    type: Literal["namespace"]
    name: str
    description: Optional[str] = None
    tools: list[FunctionTool]


class CustomTool(Model):
    type: Literal["custom"]
    name: str


class WebSearchTool(Model):
    type: Literal["web_search", "web_search_preview"]


class HostedTool(Model):
    """Any other tool type (hosted apply_patch, file search, MCP, code interpreter, shell...):
    its calls would be answered by another server, so the official package drops it (the
    `custom` apply_patch tool is the one rendered)."""

    type: str


_TOOLS = {"function": FunctionTool, "namespace": NamespaceTool, "custom": CustomTool,
          "web_search": WebSearchTool, "web_search_preview": WebSearchTool}
Tool = _by_type(_TOOLS, ("hosted", HostedTool))
RENDERED_TOOL_TYPES = frozenset(_TOOLS)  # tools of any other type are dropped, as the official package does


ToolSearchOutputItem.model_rebuild()


class NamedTool(Model):
    type: Literal["function", "custom"]
    name: str


class Reasoning(Model):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]] = None
    summary: Optional[str] = None


class Thinking(Model):
    type: Literal["enabled", "disabled", "adaptive"]


class TextFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    schema_: Any = Field(default=None, alias="schema")
    name: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Model):
    format: Optional[TextFormat] = None


class ResponsesRequest(Model):
    """POST /v1/responses body."""

    model: str
    input: Union[str, list[Item]]
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedTool]] = None
    reasoning: Optional[Reasoning] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = None
    stream: Optional[bool] = None
    user: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _default_item_type(cls, data):
        # an input item with a role but no type is a message
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = data["input"]
            if any(isinstance(x, dict) and "type" not in x for x in items):
                data = dict(data)
                data["input"] = [dict(x, type="message") if isinstance(x, dict) and "type" not in x
                                 else x for x in items]
        return data


def _parts(content, item_path: str) -> list:
    """`item_path`: the input item (`input[i]`), all of an image's location that the official
    image sources record."""
    if isinstance(content, str):
        return [content]
    chunks = []
    for i, p in enumerate(content):
        if p.type == "input_image":
            url = p.image_url or ""
            chunks.append([ImageSource("data_url" if url.startswith("data:") else "url", url,
                                       p.detail, item_path)])
        else:
            chunks.append([p.text])
    return join_parts(chunks)


def qualified(ns: str, name: str, v41: bool) -> str:
    """A namespace function's name as the model sees it: `ns::name` (V4.1) or `ns__name`
    (V4, where an underscore already at the seam stands for the separator)."""
    if v41:
        return f"{ns}::{name}"
    sep = "" if ns.endswith("_") or name.startswith("_") else "__"
    return f"{ns}{sep}{name}"


def flatten_tools(req: ResponsesRequest, opts: ConversionOptions, v41: bool = True):
    """-> (tools, namespace_tool_map). Namespace tools become `ns::name` (V4.1, description
    `ns description\nfunction description`) or `ns__name` (V4, function description only;
    `ns_x` when the seam already has an underscore). A function's `defer_loading` is not read:
    the official package lists every function of the request."""
    tools, ns_map = [], {}
    # a namespace function whose name is taken (by a function tool, or by an earlier
    # namespace function) is numbered: name_1, name_2...
    taken = {t.name for t in req.tools or () if t.type == "function"}
    add_tools(req.tools or [], "tools", opts, v41, tools, ns_map, taken, deferred=False)
    return tools, ns_map


def add_tools(given: list, where: str, opts: ConversionOptions, v41: bool, tools: list, ns_map: dict,
              taken: set, deferred: bool) -> list:
    """Append the tools of `given` (the request's, or those a tool search loaded, which are
    `deferred`: callable, but announced where they were loaded) to `tools`; -> the new ones."""
    first = len(tools)
    for i, t in enumerate(given):
        if t.type in ("function", "namespace"):
            check_tool_name(t.name, f"{where}[{i}].name")
        if t.type == "namespace":
            for j, f in enumerate(t.tools):
                check_tool_name(f.name, f"{where}[{i}].tools[{j}].name")
            check_unique((f.name for f in t.tools), "Tool names within a namespace must be unique.")
        if t.type == "function":
            tools.append(make_tool(t.name, t.description, t.parameters, t.strict, deferred))
        elif t.type == "namespace":
            for f in t.tools:
                full = base = qualified(t.name, f.name, v41)
                n = 0
                while full in taken:
                    n += 1
                    full = f"{base}_{n}"
                taken.add(full)
                if v41:
                    # the namespace's description heads each of its functions' descriptions
                    desc = f"{t.description}\n{f.description or ''}" if t.description \
                        else f.description
                else:
                    desc = f.description
                tools.append(make_tool(full, desc, f.parameters, f.strict, deferred))
                ns_map[full] = (t.name, f.name)
        elif t.type == "custom":
            if t.name != "apply_patch":
                raise ConversionError(f"Unsupported custom tool: '{t.name}'. Only 'apply_patch' "
                                      "is supported.", param=f"{where}[{i}]")
            ap = APPLY_PATCH["v41" if v41 else "v4"]
            tools.append(make_tool(ap["name"], ap["description"], ap["parameters"], None, deferred))
        elif t.type in ("web_search", "web_search_preview"):
            if opts.responses_web_search == "reject":
                raise ConversionError(f"{where}[{i}]: web_search is not supported", param=f"{where}[{i}]")
    return tools[first:]


def tool_search_result(found: list) -> str:
    """A tool search output as its tool result: the tools as found, compact JSON, each function
    of a namespace on its own with the namespace named beside it."""
    rows: list = []
    for t in found:
        if t.type == "function":
            rows.append(_found_function(t))
        elif t.type == "namespace":
            rows += [dict(_found_function(f), namespace={"name": t.name, "description": t.description or ""})
                     for f in t.tools]
        else:
            rows.append({"type": t.type, "name": t.name} if t.type == "custom" else {"type": t.type})
    return compact(rows)


def _found_function(f: FunctionTool) -> dict:
    return {"type": "function", "name": f.name, "description": f.description, "parameters": f.parameters,
            "strict": f.strict}


def after_tool_results(msgs: list) -> list:
    """The tools loaded by tool searches are announced in a system turn after the run of tool
    results they arrived in (several searches answered together: their results, then each
    announcement in order)."""
    out: list = []
    pending: list = []
    for m in msgs:
        if m.role == "system" and m.tools is not None and out and out[-1].role == "tool":
            pending.append(m)
            continue
        if m.role != "tool" and pending:
            out += pending
            pending = []
        out.append(m)
    return out + pending


def convert_responses(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    req: ResponsesRequest = body if isinstance(body, ResponsesRequest) else \
        validate(ResponsesRequest, body)
    version = resolve_model(req.model, opts)
    # the Responses API has no `thinking` field: reasoning.effort decides
    thinking, effort = resolve_thinking(None, req.reasoning.effort if req.reasoning else None, opts)
    tools, ns_map = flatten_tools(req, opts, version is ModelVersion.V41)
    if isinstance(req.input, list) and not req.input:
        raise ConversionError("Input items array must not be empty", param="input")
    msgs: list = []
    if req.instructions:
        msgs.append(Message("system", [req.instructions]))
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    cur = None  # the assistant message being assembled from consecutive items
    reasoning: list = []  # the reasoning_text parts of `cur`, in order

    pos: dict = {}  # id(message) -> index of the item that created it
    at = [0]  # index of the item being read

    def assistant(new_if_called=True):
        nonlocal cur, reasoning
        if cur is None or (new_if_called and cur.tool_calls):
            cur = Message("assistant", [])
            reasoning = []
            msgs.append(cur)
            pos[id(cur)] = at[0]
        return cur

    v41 = version is ModelVersion.V41
    kept: set = set()  # ids of the assistant turns with a message item (kept even if empty)
    called: set = set()  # call ids seen so far, and those already answered
    answered: set = set()

    loaded: list = []  # the function and custom tools tool searches found

    def answer(call_id: str, path: str) -> None:
        """An output answers exactly one call made before it."""
        nonlocal cur
        if call_id not in called:
            raise ConversionError(f"No tool call found for tool output with call_id "
                                  f"{call_id}.", param=path)
        if call_id in answered:
            raise ConversionError(f"Duplicate tool output for call_id: {call_id}.", param=path)
        answered.add(call_id)
        # while calls of the current turn are unanswered, a further call still belongs to
        # that turn (its outputs are listed after it)
        if cur is None or not cur.tool_calls or all(c.id in answered for c in cur.tool_calls):
            cur = None

    def read_item(i: int, it) -> None:
        nonlocal cur, reasoning
        at[0] = i
        t = it.type
        path = f"input[{i}]"
        if t == "reasoning":
            # reasoning that follows an answer or a call opens the next assistant turn; the
            # parts of an item, then the items of a turn, are lines of one reasoning text
            # (an item with no text adds nothing: like a web search call it only ends a
            # batch of calls)
            line = "\n".join([c.text for c in it.content or ()])
            if not line:
                assistant()
                return
            if cur is not None and cur.parts:
                cur = None
            a = assistant()
            reasoning.append(line)
            a.reasoning_content = "\n".join(reasoning)
        elif t in ("function_call", "custom_tool_call"):
            if it.call_id in called:
                raise ConversionError(f"Duplicate 'call_id': {it.call_id}.", param=path)
            a = assistant(False)
            args = it.arguments if t == "function_call" else json.dumps(
                {"input": it.input}, ensure_ascii=False)
            name = it.name
            if t == "function_call" and it.namespace is not None:
                # the call is shown as the model would have written it
                name = qualified(it.namespace, name, v41)
            a.tool_calls = (a.tool_calls or []) + [ToolCall(it.call_id, name, args)]
            called.add(it.call_id)
        elif t == "tool_search_call":
            if not v41:
                return  # V4 has no tool search: dropped like another server's call
            if it.call_id in called:
                raise ConversionError(f"Duplicate 'call_id': {it.call_id}.", param=path)
            a = assistant(False)
            a.tool_calls = (a.tool_calls or []) + [
                ToolCall(it.call_id, "tool_search", json.dumps(it.arguments, ensure_ascii=False))]
            called.add(it.call_id)
        elif t == "tool_search_output":
            if not v41:
                return
            answer(it.call_id, path)
            found = add_tools(it.tools, f"{path}.tools", opts, v41, tools, ns_map, {x.name for x in tools},
                              deferred=True)
            loaded.extend(x for x in it.tools if x.type in ("function", "custom"))
            msgs.append(Message("tool", [tool_search_result(it.tools)], tool_call_id=it.call_id))
            if found:
                msgs.append(Message("system", [], tools=found))
        elif t == "web_search_call":
            # a hosted call with nothing to render: it belongs to the assistant turn like a
            # message does, so after function calls it opens the next turn
            assistant()
        elif t not in _ITEMS:
            return
        elif t in ("function_call_output", "custom_tool_call_output"):
            answer(it.call_id, path)
            msgs.append(Message("tool", _parts(it.output, path),
                                tool_call_id=it.call_id))
        else:
            role = it.role
            parts = _parts(it.content, path)
            if role == "assistant":
                if v41 and any(p.__class__ is not str for p in parts):
                    raise ConversionError(f"{path}: Image in assistant message is unsupported",
                                          param=path)
                a = assistant()
                kept.add(id(a))
                a.parts = join_parts([a.parts, parts]) if a.parts else parts
            else:
                cur = None
                msgs.append(Message(role, parts))
                pos[id(msgs[-1])] = i

    # The official package reads the items in order and reports the first problem it meets;
    # calls left unanswered are noticed when the item that ends their batch is read. So the
    # first problem found while reading is kept (with whether its item ends a batch) and
    # compared with the unanswered calls found in the batches it ended or followed.
    stop = None
    for i, it in enumerate(items):
        try:
            read_item(i, it)
        except ConversionError as e:
            # calls and outputs continue a batch; any other item ends it
            stop = (e, it.type not in ("function_call", "custom_tool_call", "tool_search_call",
                                       "function_call_output", "custom_tool_call_output",
                                       "tool_search_output"))
            break
    for k, m in enumerate(msgs):
        if m.role == "assistant" and m.tool_calls:
            outs = set()
            j = k + 1
            while j < len(msgs) and (msgs[j].role == "tool" or msgs[j].tools is not None):
                outs.add(msgs[j].tool_call_id)  # (a loaded tools' announcement answers nothing)
                j += 1
            if j == len(msgs) and stop is not None and not stop[1]:
                break  # the batch was still open when reading stopped
            for c in m.tool_calls:
                if c.id not in outs:
                    raise ConversionError(f"No tool output found for tool call {c.id}.",
                                          param="input")
            m.tool_calls.sort(key=lambda c: c.id)
    if stop is not None:
        raise stop[0]
    # an assistant turn built from items that carry nothing (a web search call, reasoning
    # without text) is not rendered
    msgs = after_tool_results([m for m in msgs if m.role != "assistant" or m.parts or m.tool_calls
                               or m.reasoning_content is not None or id(m) in kept])
    check_reasoning_passed(msgs, thinking, opts, "reasoning_text", empty_ok=False,
                           has_tools=bool(tools))
    max_tokens = req.max_output_tokens
    bound = opts.thinking_max_tokens_upper_bound if thinking else opts.non_thinking_max_tokens_upper_bound
    if max_tokens is not None and not (1 <= max_tokens <= bound):
        raise ConversionError(f"Invalid max_output_tokens value, the valid range of "
                              f"max_output_tokens is [1, {bound}]", param="max_output_tokens")
    all_tools = tools
    tc = req.tool_choice
    if tc != "none":
        # the request's tools, then those tool searches loaded (the only deferred ones here)
        read_tool_schemas([t for t in tools if not t.defer_loading], tc)
        found = [t for t in tools if t.defer_loading]
        if found:
            read_tool_schemas(found, tc)
            if len({bool(t.strict) for t in tools}) > 1:
                raise ConversionError("Cannot use strict tool with non-strict tool in the same request",
                                      param="input")
    tool_choice = "auto"
    if isinstance(tc, str):
        tool_choice = tc
    elif tc is not None and tools:  # with no tools a named choice has nothing to name
        tools = [t for t in tools if t.name == tc.name]
        tool_choice = "required"
    if tool_choice != "none":
        # a namespace is its own name space: its functions are rendered qualified
        check_unique(t.name for t in [*(req.tools or ()), *loaded] if t.type in ("function", "custom"))
    if tool_choice == "required" and not tools and isinstance(tc, NamedTool):
        raise no_such_tool(tc.name)

    fmt, schema = "text", None
    f = req.text.format if req.text else None
    if f is not None and f.type == "json_object":
        fmt = "json_object"
    elif f is not None and f.type == "json_schema":
        if f.schema_ is None:
            raise RequestValidationError("text.format.schema: Field required", param="text.format")
        fmt, schema = "json_schema", f.schema_
    conv = Conversation(msgs, thinking, tools, tool_choice, effort, fmt, schema)
    if tool_choice == "required" and thinking and tools:
        raise ConversionError("Thinking mode does not support this tool_choice", param="tool_choice")
    if fmt == "json_object" and not any("json" in m.content.lower() for m in msgs):
        raise ConversionError("Response input messages must contain the word 'json' in some form "
                              "to use 'text.format' of type 'json_object'.", param="text.format")
    check_format_with_tools(all_tools, tool_choice, f is not None)
    if fmt == "json_schema" and f.strict:
        conv.constraint_schema = normalise(schema, "json")
    elif fmt == "json_schema":
        check_document(schema)
    check_temperature(req.temperature)
    check_top_p(req.top_p)
    check_top_logprobs(req.top_logprobs)
    rendered_tools = bool(tools) and tool_choice != "none"
    temperature, top_p = sampling(version, thinking, rendered_tools, req.temperature, req.top_p)
    inf = InferenceOptions(max_tokens, temperature, top_p, False, req.top_logprobs, None,
                           output_constraint(conv))
    parsing = make_parsing(conv, rendered_tools, [], opts)
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "top_logprobs": req.top_logprobs or 0, "user": req.user,
            "tool_choice": req.tool_choice, "tools": req.tools, "reasoning": req.reasoning,
            "text": req.text}
    return ConvertedRequest("responses", req.model, version, conv, inf, parsing, bool(req.stream),
                            True, ns_map, echo)
