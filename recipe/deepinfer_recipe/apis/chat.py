"""OpenAI Chat Completions: request models and conversion to a Conversation."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from ..conversation import Conversation, ImageSource, Message, ToolCall, join_parts
from ..errors import ConversionError
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, ParsingOptions,
                       resolve_model, resolve_thinking, sampling)
from .common import Model, _TAGS, check_json_word, check_strict, make_tool, output_constraint, validate

_TAGS.update({"system", "user", "assistant", "tool", "latest_reminder", "text", "image_url",
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


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]
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
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None


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
        else:
            url = p.image_url.url
            chunks.append([ImageSource("data_url" if url.startswith("data:") else "url", url,
                                       p.image_url.detail, f"{path}[{i}]")])
    return join_parts(chunks)


def convert_chat(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    req: ChatCompletionRequest = body if isinstance(body, ChatCompletionRequest) else \
        validate(ChatCompletionRequest, body)
    version = resolve_model(req.model, opts)
    if not req.messages:
        raise ConversionError("Empty input messages", param="messages")
    if req.n is not None and req.n > 1:
        raise ConversionError("Invalid n value (currently only n = 1 is supported)", param="n")
    thinking, effort = resolve_thinking(req.thinking.type if req.thinking else None,
                                        req.reasoning_effort, opts)
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    bound = opts.thinking_max_tokens_upper_bound if thinking else opts.non_thinking_max_tokens_upper_bound
    if max_tokens is not None and not (1 <= max_tokens <= bound):
        raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is [1, {bound}]",
                              param="max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise ConversionError("Invalid top_logprobs and logprobs value, logprobs must be set to true "
                              "if top_logprobs is used.", param="top_logprobs")

    tools = [make_tool(t.function.name, t.function.description, t.function.parameters,
                       t.function.strict, t.defer_loading) for t in (req.tools or [])]
    check_strict(tools)
    tc = req.tool_choice
    tool_choice = "auto"
    if isinstance(tc, str):
        tool_choice = tc
    elif tc is not None:
        tools = [t for t in tools if t.name == tc.function.name]
        if not tools:
            raise ConversionError(f"tool_choice: function {tc.function.name!r} is not in tools",
                                  param="tool_choice")
        tool_choice = "required"

    msgs = []
    src = req.messages
    n = len(src)
    for i, m in enumerate(src):
        if m.role == "assistant" and m.prefix and i != n - 1:
            raise ConversionError("Invalid completion message: prefix set true with message which is "
                                  "not final message or message role is not assistant",
                                  param=f"messages[{i}].prefix")
    open_ids = None
    for i, m in enumerate(src):
        if m.role == "tool":
            if open_ids is None or m.tool_call_id not in open_ids:
                raise ConversionError("Messages with role 'tool' must be a response to a preceding "
                                      "message with 'tool_calls'", param=f"messages[{i}]")
        elif m.role == "assistant" and m.tool_calls:
            open_ids = {c.id for c in m.tool_calls}
        else:
            open_ids = None
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
            calls = None
            if m.tool_calls:
                calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
                ids = {c.id for c in calls}
                j = i + 1
                seen = set()
                while j < n and src[j].role == "tool":
                    seen.add(src[j].tool_call_id)
                    j += 1
                if not ids <= seen:
                    raise ConversionError(
                        "An assistant message with 'tool_calls' must be followed by tool messages "
                        "responding to each 'tool_call_id'. (insufficient tool messages following "
                        "tool_calls message)", param=f"messages[{i}].tool_calls")
            msgs.append(Message("assistant", _parts(m.content, path), m.reasoning_content, calls,
                                prefix=m.prefix and i == n - 1))
        elif role == "tool":
            msgs.append(Message("tool", _parts(m.content, path), tool_call_id=m.tool_call_id))
        else:
            msgs.append(Message("latest_reminder", _parts(m.content, path)))

    rf = req.response_format
    fmt, schema = "text", None
    if rf is not None and rf.type == "json_object":
        fmt = "json_object"
    elif rf is not None and rf.type == "json_schema":
        fmt = "json_schema"
        schema = rf.json_schema.schema_ if rf.json_schema else None
    conv = Conversation(msgs, thinking, tools, tool_choice, effort, fmt, schema)
    check_json_word(conv)
    if tool_choice == "required" and thinking and tools:
        raise ConversionError("Thinking mode does not support this tool_choice", param="tool_choice")
    if src[-1].role == "assistant" and src[-1].prefix:
        if fmt == "json_object":
            raise ConversionError("response_format json_object should not be used with prefix",
                                  param="response_format")
        if tools:
            raise ConversionError("Function call should not be used with prefix", param="tools")
    _check_reasoning(conv, opts)

    rendered_tools = bool(tools) and tool_choice != "none"
    temperature, top_p = sampling(version, thinking, rendered_tools, req.temperature, req.top_p)
    inf = InferenceOptions(max_tokens, temperature, top_p, bool(req.logprobs), req.top_logprobs,
                           req.seed, output_constraint(conv))
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    parsing = make_parsing(conv, rendered_tools, stop, opts)
    return ConvertedRequest("chat", req.model, version, conv, inf, parsing, bool(req.stream),
                            bool(req.stream_options and req.stream_options.include_usage))


def _check_reasoning(conv: Conversation, opts: ConversionOptions) -> None:
    if opts.reasoning_content_behavior != "reject" or not conv.thinking_mode:
        return
    if not (conv.tools and conv.tool_choice != "none"):
        return
    for i, m in enumerate(conv.messages):
        if m.role == "assistant" and m.reasoning_content is None and not m.prefix:
            raise ConversionError(f"messages[{i}]: Missing `reasoning_content` field in the assistant "
                                  "message at message index " + str(i), param=f"messages[{i}]")


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
