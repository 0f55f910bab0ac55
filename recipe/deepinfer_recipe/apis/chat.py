"""OpenAI Chat Completions: request models and conversion to a Conversation."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, model_validator

from ..conversation import (Conversation, ImageSource, Message, ModelVersion, ToolCall,
                            ToolDefinition, join_parts)
from ..errors import ConversionError, RequestValidationError
from ..strict import check_document, normalise
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, ParsingOptions,
                       resolve_model, resolve_thinking, sampling)
from .common import (Model, _TAGS, check_format_with_tools, check_json_word, check_penalty,
                     check_reasoning_passed, check_seed, check_stop, check_temperature,
                     check_tool_name, check_top_logprobs, check_top_p, check_unique, make_tool,
                     no_such_tool, output_constraint, read_tool_schemas, tool_name_ok, validate)

_TAGS.update({"system", "user", "assistant", "tool", "latest_reminder", "text", "image_url", "file",
              "function", "json_object", "json_schema", "enabled", "disabled", "adaptive"})


class TextPart(Model):
    type: Literal["text"]
    text: str


class ImageURL(Model):
    url: str
    detail: Literal["low", "high", "original", "auto"] = "high"


class ImagePart(Model):
    type: Literal["image_url"]
    image_url: ImageURL


class FilePart(Model):
    """A file the recipe cannot read: V4 shows the image stub for it, V4.1 refuses it."""

    type: Literal["file"]
    file: Optional[dict[str, Any]] = None


ContentPart = Annotated[Union[TextPart, ImagePart, FilePart], Field(discriminator="type")]
Content = Union[str, list[ContentPart]]


class FunctionCall(Model):
    name: str
    arguments: str = ""


class ToolCallModel(Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Model):
    role: Literal["system"]
    content: Content


class UserMessage(Model):
    role: Literal["user"]
    content: Content


class AssistantMessage(Model):
    role: Literal["assistant"]
    content: Optional[Content] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallModel]] = None
    prefix: bool = False


class ToolMessage(Model):
    role: Literal["tool"]
    content: Content
    tool_call_id: Optional[str] = None


class LatestReminderMessage(Model):
    role: Literal["latest_reminder"]
    content: Content


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage,
                              LatestReminderMessage], Field(discriminator="role")]


class FunctionDef(Model):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionTool(Model):
    type: Literal["function"] = "function"
    function: FunctionDef
    defer_loading: bool = False


class NamedFunction(Model):
    name: str


class NamedToolChoice(Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class Thinking(Model):
    type: Literal["enabled", "disabled", "adaptive"]


class JsonSchemaSpec(Model):
    name: Optional[str] = None
    schema_: Any = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Model):
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: Optional[JsonSchemaSpec] = None
    regex: Optional[str] = None

    @model_validator(mode="after")
    def _regex_given(self):
        if self.type == "regex" and self.regex is None:
            raise ValueError("missing field `regex`")
        return self


class StreamOptions(Model):
    include_usage: bool = False


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]


class ChatCompletionRequest(Model):
    """POST /v1/chat/completions body."""

    model: str
    messages: list[ChatMessage]
    thinking: Optional[Thinking] = None
    reasoning_effort: Optional[Effort] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    response_format: Optional[ResponseFormat] = None
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    seed: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None


def _parts(content, path: str) -> list:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    chunks = []
    for i, p in enumerate(content):
        if p.type == "text":
            chunks.append([p.text])
        elif p.type == "file":
            chunks.append([ImageSource("file", p.file, "high", f"{path}[{i}]")])
        else:
            url = p.image_url.url
            chunks.append([ImageSource("data_url" if url.startswith("data:") else "url", url,
                                       p.image_url.detail, f"{path}[{i}]")])
    return join_parts(chunks)


def convert_chat(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    if isinstance(body, (str, bytes, bytearray)):
        try:
            body = json.loads(body)
        except ValueError:
            pass  # `validate` reports it
    if body.__class__ is dict:
        out = _fast_convert(body, opts)
        if out is not None:
            return out
    req: ChatCompletionRequest = body if isinstance(body, ChatCompletionRequest) else \
        validate(ChatCompletionRequest, body)
    version = resolve_model(req.model, opts)
    for i, t in enumerate(req.tools or ()):
        check_tool_name(t.function.name, f"tools[{i}].function.name")
    if not req.messages:
        raise ConversionError("Empty input messages", param="messages")
    thinking, effort = resolve_thinking(req.thinking.type if req.thinking else None,
                                        req.reasoning_effort, opts)
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens

    tools = [make_tool(t.function.name, t.function.description, t.function.parameters,
                       t.function.strict, t.defer_loading) for t in (req.tools or [])]
    tool_names = [t.name for t in tools]
    all_tools = tools
    msgs = []
    src = req.messages
    n = len(src)
    v41 = version is ModelVersion.V41
    # one pass in message order, as the official package reports the first problem it meets
    open_ids = need = None
    caller = 0
    for i, m in enumerate(src):
        if m.role == "tool":
            if open_ids is None or m.tool_call_id not in open_ids:
                raise ConversionError("Messages with role 'tool' must be a response to a preceding "
                                      "message with 'tool_calls'", param=f"messages[{i}]")
            need.discard(m.tool_call_id)
            continue
        if need:
            raise _insufficient(caller)
        if v41 and isinstance(m.content, list) and any(p.type == "file" for p in m.content):
            # V4.1 accepts no file parts
            raise ConversionError(f".messages[{i}]: file must have a file_id or file_data",
                                  param=f"messages[{i}]")
        open_ids = need = None
        if m.role == "assistant":
            if version is ModelVersion.V41 and isinstance(m.content, list) and \
                    any(p.type == "image_url" for p in m.content):
                raise ConversionError("Image in assistant message is not supported",
                                      param=f"messages[{i}]")  # V4.1 reads none
            _check_assistant_shape(m.content, m.tool_calls, i)
            if m.tool_calls:
                open_ids = {c.id for c in m.tool_calls}
                need = set(open_ids)
                caller = i
    if need:
        raise _insufficient(caller)
    for i, m in enumerate(src):
        if m.role == "assistant" and m.prefix and i != n - 1:
            raise ConversionError("Invalid completion message: prefix set true with message which is "
                                  "not final message or message role is not assistant",
                                  param=f"messages[{i}].prefix")
    tc = req.tool_choice
    tool_choice = "auto"
    missing_choice = None
    if isinstance(tc, str):
        tool_choice = tc
    elif tc is not None and tools:  # with no tools a named choice has nothing to name
        tools = [t for t in tools if t.name == tc.function.name]
        if not tools:  # refused in _finish, where the official package checks it
            missing_choice = tc.function.name
        tool_choice = "required"
    for i, m in enumerate(src):
        role = m.role
        path = f"messages[{i}].content"
        if role == "system":
            parts = _parts(m.content, path)
            if not parts or parts == [""]:
                continue
            msgs.append(Message("system", parts))
        elif role == "user":
            msgs.append(Message("user", _parts(m.content, path)))
        elif role == "assistant":
            parts = _parts(m.content, path)
            if version is ModelVersion.V41 and any(p.__class__ is not str for p in parts):
                raise ConversionError("Image in assistant message is not supported",
                                      param=f"messages[{i}]")
            calls = None
            if m.tool_calls:
                calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            msgs.append(Message("assistant", parts, m.reasoning_content, calls,
                                prefix=m.prefix and i == n - 1))
        elif role == "tool":
            msgs.append(Message("tool", _parts(m.content, path), tool_call_id=m.tool_call_id))
        else:
            msgs.append(Message("latest_reminder", _parts(m.content, path)))

    check_reasoning_passed(src, thinking, opts, "reasoning_content", has_tools=bool(req.tools))
    rf = req.response_format
    fmt, schema, strict_format = "text", None, False
    if rf is not None and rf.type == "json_object":
        fmt = "json_object"
    elif rf is not None and rf.type == "json_schema":
        fmt = "json_schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestValidationError("response_format.json_schema.schema: Field required",
                                         param="response_format")
        schema = rf.json_schema.schema_
        strict_format = bool(rf.json_schema.strict)
    elif rf is not None and rf.type == "regex":
        fmt, schema = "regex", rf.regex
    last_prefix = src[-1].role == "assistant" and src[-1].prefix
    so = req.stream_options
    return _finish(req.model, version, msgs, thinking, tools, tool_names, tool_choice, effort, fmt,
                   (schema, strict_format, rf is not None, all_tools, missing_choice),
                   last_prefix, max_tokens, req.temperature, req.top_p, req.logprobs,
                   req.top_logprobs, req.seed, req.stop, req.stream, so is not None,
                   bool(so and so.include_usage), req.n, req.frequency_penalty,
                   req.presence_penalty, opts)


def _insufficient(i: int) -> ConversionError:
    return ConversionError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to "
        "each 'tool_call_id'. (insufficient tool messages following tool_calls message)",
        param=f"messages[{i}].tool_calls")


def _check_assistant_shape(content, tool_calls, i: int) -> None:
    """An assistant turn with nothing in it has no rendering the official package accepts; an
    empty content string or list is still content, an empty tool_calls list is not."""
    if tool_calls is not None and not tool_calls:
        raise ConversionError(f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array "
                              "with minimum length 1, but got an empty array instead.",
                              param=f"messages[{i}].tool_calls")
    if content is None and not tool_calls:
        raise ConversionError("Invalid assistant message: content or tool_calls must be set",
                              param=f"messages[{i}]")


def _finish(model, version, msgs, thinking, tools, tool_names, tool_choice, effort, fmt, schema,
            last_prefix, max_tokens, temperature, top_p, logprobs, top_logprobs, seed, stop,
            stream, has_stream_options, include_usage, n, frequency_penalty, presence_penalty,
            opts) -> ConvertedRequest:
    """The checks and results that follow building the messages. Both conversion paths end
    here, so every rule below holds for both; the order of the checks is the official
    package's, which decides the error a request with several problems gets."""
    regex = None
    # the model-based path passes the format details and every tool (before a named
    # tool_choice picked one: strict tools are all read) with the schema
    schema, strict_format, format_given, all_tools, missing_choice = \
        schema if schema.__class__ is tuple else (schema, False, False, tools, None)
    if fmt == "regex":
        # a regex constrains decoding only; the prompt is that of plain text
        regex, fmt, schema = schema, "text", None
    conv = Conversation(msgs, thinking, tools, tool_choice, effort, fmt, schema)
    check_json_word(conv)
    read_tool_schemas(all_tools, tool_choice)
    if tool_choice != "none":
        check_unique(tool_names)
    if missing_choice is not None:
        raise no_such_tool(missing_choice)
    if tool_choice == "required" and thinking and tools:
        raise ConversionError("Thinking mode does not support this tool_choice", param="tool_choice")
    if last_prefix:
        if fmt == "json_object":
            raise ConversionError("response_format json_object should not be used with prefix",
                                  param="response_format")
        # tools, or calls in the history: a continuation could not be told from a call
        if tools or any(m.tool_calls or m.role == "tool" for m in msgs):
            raise ConversionError("Function call should not be used with prefix", param="tools")
    check_format_with_tools(all_tools, tool_choice, format_given)
    if strict_format:
        conv.constraint_schema = normalise(schema, "json")
    elif fmt == "json_schema":
        check_document(schema)
    check_stop(stop)
    if has_stream_options and not stream:
        raise ConversionError("stream_options should be set along with stream = true",
                              param="stream_options")
    if n is not None and n > 1:
        raise ConversionError("Invalid n value (currently only n = 1 is supported)", param="n")
    check_penalty("presence_penalty", presence_penalty)
    check_penalty("frequency_penalty", frequency_penalty)
    check_temperature(temperature)
    check_top_p(top_p)
    if top_logprobs is not None and not logprobs:
        raise ConversionError("Invalid top_logprobs and logprobs value, logprobs must be set to true "
                              "if top_logprobs is used.", param="top_logprobs")
    check_top_logprobs(top_logprobs)
    bound = opts.thinking_max_tokens_upper_bound if thinking else opts.non_thinking_max_tokens_upper_bound
    if max_tokens is not None and not (1 <= max_tokens <= bound):
        raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is [1, {bound}]",
                              param="max_tokens")
    check_seed(seed)
    stop = [stop] if stop.__class__ is str else list(stop or ())

    rendered_tools = bool(tools) and tool_choice != "none"
    temperature, top_p = sampling(version, thinking, rendered_tools, temperature, top_p)
    inf = InferenceOptions(max_tokens, temperature, top_p, bool(logprobs), top_logprobs,
                           seed, output_constraint(conv, regex))
    parsing = make_parsing(conv, rendered_tools, stop, opts)
    return ConvertedRequest("chat", model, version, conv, inf, parsing, bool(stream),
                            include_usage)


_OPT_INT = ("n", "max_tokens", "max_completion_tokens", "top_logprobs", "seed")
_OPT_BOOL = ("logprobs", "stream")
_OPT_FLOAT = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
_THINKING_TYPES = frozenset(("enabled", "disabled", "adaptive"))
_EFFORTS = frozenset(("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"))
_TOOL_CHOICES = frozenset(("none", "auto", "required"))
_MSG_ROLES = frozenset(("system", "user", "assistant", "tool", "latest_reminder"))


def _fast_text(content):
    """Message content -> parts for the plain shapes (a string, or a list of text parts);
    None for anything else (images, wrong types...)."""
    if content.__class__ is str:
        return [content]
    if content.__class__ is not list:
        return None
    out: list = []
    for p in content:
        if p.__class__ is not dict or p.get("type") != "text":
            return None
        t = p.get("text")
        if t.__class__ is not str:
            return None
        if out:
            out.append("\n\n")
        out.append(t)
    return out


def _fast_convert(body: dict, opts: ConversionOptions) -> Optional[ConvertedRequest]:
    """The common, valid request shape converted straight from the dict, without building
    the request models. Returns None whenever anything is unusual (an image, a named tool
    choice, a response format, a value of another type than the plain JSON one, any error):
    the model-based path then handles the request, so results and error messages are the same."""
    g = body.get
    model = g("model")
    src = g("messages")
    if model.__class__ is not str or src.__class__ is not list or not src:
        return None
    for k in _OPT_INT:
        v = g(k)
        if v is not None and v.__class__ is not int:
            return None
    for k in _OPT_BOOL:
        v = g(k)
        if v is not None and v.__class__ is not bool:
            return None
    for k in _OPT_FLOAT:
        v = g(k)
        if v is not None and v.__class__ is not float:
            return None
    if g("response_format") is not None or opts.reasoning_content_behavior == "reject":
        return None
    stop = g("stop")
    if stop.__class__ is list:
        for x in stop:
            if x.__class__ is not str:
                return None
    elif stop is not None and stop.__class__ is not str:
        return None
    include_usage = False
    so = g("stream_options")
    if so is not None:
        if so.__class__ is not dict:
            return None
        include_usage = so.get("include_usage", False)
        if include_usage.__class__ is not bool:
            return None
    th = g("thinking")
    if th is not None:
        if th.__class__ is not dict:
            return None
        th = th.get("type")
        if th.__class__ is not str or th not in _THINKING_TYPES:
            return None
    effort = g("reasoning_effort")
    if effort is not None and (effort.__class__ is not str or effort not in _EFFORTS):
        return None
    tool_choice = g("tool_choice")
    if tool_choice is None:
        tool_choice = "auto"
    elif tool_choice.__class__ is not str or tool_choice not in _TOOL_CHOICES:
        return None

    tools = []
    raw_tools = g("tools")
    if raw_tools is not None:
        if raw_tools.__class__ is not list:
            return None
        strict_kinds = set()
        for t in raw_tools:
            if t.__class__ is not dict or t.get("type", "function") != "function":
                return None
            f = t.get("function")
            defer = t.get("defer_loading", False)
            if f.__class__ is not dict or defer.__class__ is not bool:
                return None
            name = f.get("name")
            desc = f.get("description")
            params = f.get("parameters")
            strict = f.get("strict")
            if name.__class__ is not str or (desc is not None and desc.__class__ is not str) \
                    or (strict is not None and strict.__class__ is not bool) \
                    or not tool_name_ok(name):
                return None
            if params is not None:
                if params.__class__ is not dict:
                    return None
                for k in params:
                    if k.__class__ is not str:
                        return None
                params = dict(params)
            if strict:
                return None  # normalised on the model-based path
            strict_kinds.add(bool(strict))
            tools.append(ToolDefinition(name, desc, params, strict, defer))
        if len(strict_kinds) > 1:
            return None

    # resolve and range checks (any failure: the model-based path raises the error)
    version = opts.model_versions_by_name.get(model)
    if version is None:
        return None
    thinking, effort = resolve_thinking(th, effort, opts)
    max_tokens = g("max_tokens")
    if max_tokens is None:
        max_tokens = g("max_completion_tokens")

    msgs = []
    last = len(src) - 1
    open_ids = None  # ids of the calls the current run of tool messages answers
    need = None  # ids of those not answered yet
    last_prefix = False
    for i, m in enumerate(src):
        if m.__class__ is not dict:
            return None
        role = m.get("role")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid.__class__ is not str or open_ids is None or tcid not in open_ids:
                return None
            parts = _fast_text(m.get("content"))
            if parts is None:
                return None
            need.discard(tcid)
            msgs.append(Message("tool", parts, None, None, tcid))
            continue
        if need:
            return None  # insufficient tool messages after an assistant's tool_calls
        if role == "assistant":
            content = m.get("content")
            if content is None:
                parts = []
            else:
                parts = _fast_text(content)
                if parts is None:
                    return None
            rc = m.get("reasoning_content")
            prefix = m.get("prefix", False)
            if (rc is not None and rc.__class__ is not str) or prefix.__class__ is not bool:
                return None
            if prefix:
                if i != last:
                    return None
                last_prefix = True
            raw_calls = m.get("tool_calls")
            calls = None
            open_ids = need = None
            if not raw_calls and (raw_calls is not None or content is None):
                return None  # no calls and no content, or an empty call list
            if raw_calls is not None:
                if raw_calls.__class__ is not list:
                    return None
                if raw_calls:
                    calls = []
                    for c in raw_calls:
                        if c.__class__ is not dict or c.get("type", "function") != "function":
                            return None
                        cid = c.get("id")
                        f = c.get("function")
                        if cid.__class__ is not str or f.__class__ is not dict:
                            return None
                        name = f.get("name")
                        args = f.get("arguments", "")
                        if name.__class__ is not str or args.__class__ is not str:
                            return None
                        calls.append(ToolCall(cid, name, args))
                    open_ids = {c.id for c in calls}
                    need = set(open_ids)
            msgs.append(Message("assistant", parts, rc, calls, None, prefix))
            continue
        open_ids = None
        if role.__class__ is not str or role not in _MSG_ROLES:
            return None
        parts = _fast_text(m.get("content"))
        if parts is None:
            return None
        if role == "system":
            if not parts or parts == [""]:
                continue
        msgs.append(Message(role, parts))
    if need:
        return None
    return _finish(model, version, msgs, thinking, tools, [t.name for t in tools], tool_choice,
                   effort, "text", None, last_prefix, max_tokens, g("temperature"), g("top_p"),
                   g("logprobs"), g("top_logprobs"), g("seed"), stop, g("stream"), so is not None,
                   include_usage, g("n"), g("frequency_penalty"), g("presence_penalty"), opts)


def make_parsing(conv: Conversation, rendered_tools: bool, stop: list,
                 opts: ConversionOptions) -> ParsingOptions:
    stage = None
    last = conv.messages[-1] if conv.messages else None
    prefix = last is not None and last.role == "assistant" and last.prefix
    if conv.thinking_mode:
        if prefix:
            stage = "content_continuation" if (last.content or last.tool_calls) else \
                "reasoning_continuation"
        else:
            stage = "reasoning_start"
    p = ParsingOptions(parse_tool_calls=rendered_tools,
                       starts_in_tool_calls=rendered_tools and conv.tool_choice == "required",
                       parse_json_output=conv.response_format == "json_object",
                       thinking_initial_stage=stage, stop_sequences=stop,
                       special_tokens=opts.special_tokens)
    p.continuation = prefix
    return p
