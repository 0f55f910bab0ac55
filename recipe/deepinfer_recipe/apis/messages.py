"""Anthropic Messages: request models (content blocks, tool_use / tool_result, thinking) and
conversion to a Conversation."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from ..conversation import Conversation, ImageSource, Message, ToolCall, join_parts
from ..errors import ConversionError
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, resolve_model,
                       resolve_thinking, sampling)
from .chat import make_parsing
from .common import (Model, _TAGS, check_stop, check_strict, check_temperature, check_tool_name,
                     check_top_p, check_unique, make_tool, output_constraint, validate)

_TAGS.update({"text", "image", "thinking", "tool_use", "tool_result", "base64", "url", "any",
              "auto", "none", "tool", "server_tool_use", "web_search_tool_result", "document",
              "tool_addition"})


class TextBlock(Model):
    type: Literal["text"]
    text: str


class ImageSrcBase64(Model):
    type: Literal["base64"]
    media_type: str
    data: str


class ImageSrcURL(Model):
    type: Literal["url"]
    url: str


class ImageBlock(Model):
    type: Literal["image"]
    source: Annotated[Union[ImageSrcBase64, ImageSrcURL], Field(discriminator="type")]


class ThinkingBlock(Model):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class ToolUseBlock(Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Any = None


class ToolResultBlock(Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]], None] = None
    is_error: Optional[bool] = None


class ServerToolUseBlock(Model):
    type: Literal["server_tool_use", "web_search_tool_result", "document", "tool_addition"]


Block = Annotated[Union[TextBlock, ImageBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock,
                        ServerToolUseBlock], Field(discriminator="type")]


class MessageParam(Model):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(Model):
    name: str
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None
    type: Optional[str] = None
    strict: Optional[bool] = None
    defer_loading: bool = False


class ToolChoice(Model):
    type: Literal["auto", "any", "none", "tool"]
    name: Optional[str] = None


class Thinking(Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class OutputConfig(Model):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]] = None


class MessagesRequest(Model):
    """POST /v1/messages body."""

    model: str
    messages: list[MessageParam]
    system: Optional[Union[str, list[TextBlock]]] = None
    max_tokens: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = None


def _image(b: ImageBlock, path: str) -> ImageSource:
    s = b.source
    if s.type == "base64":
        return ImageSource("data_url", f"data:{s.media_type};base64,{s.data}", "high", path)
    return ImageSource("url", s.url, "high", path)


def convert_messages(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    req: MessagesRequest = body if isinstance(body, MessagesRequest) else validate(MessagesRequest, body)
    version = resolve_model(req.model, opts)
    thinking, effort = resolve_thinking(req.thinking.type if req.thinking else None,
                                        req.output_config.effort if req.output_config else None, opts)
    bound = opts.thinking_max_tokens_upper_bound if thinking else opts.non_thinking_max_tokens_upper_bound
    max_tokens = req.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is "
                                  f"[1, {bound}]", param="max_tokens")
        max_tokens = min(max_tokens, bound)
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type is not None and t.type not in ("custom", "function"):
            if opts.messages_web_search == "reject" or not t.type.startswith("web_search"):
                raise ConversionError(f"tools[{i}]: server tools are not supported", param=f"tools[{i}]")
            continue
        check_tool_name(t.name, f"tools[{i}].name")
        tools.append(make_tool(t.name, t.description, t.input_schema, t.strict, t.defer_loading))
    check_strict(tools)
    tool_names = [t.name for t in tools]
    tool_choice = "auto"
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "none":
            tool_choice = "none"
        elif tc.type == "tool":
            tools = [t for t in tools if t.name == tc.name]
            if not tools:
                raise ConversionError(f"tool_choice: tool {tc.name!r} is not in tools", param="tool_choice")
            tool_choice = "required"

    msgs: list = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        if text:
            msgs.append(Message("system", [text]))
    for i, m in enumerate(req.messages):
        path = f"messages[{i}].content"
        if isinstance(m.content, str):
            msgs.append(Message(m.role, [m.content]))
            continue
        if m.role == "assistant":
            a = Message("assistant", [])
            texts = []
            for j, b in enumerate(m.content):
                if b.type == "thinking":
                    a.reasoning_content = (a.reasoning_content or "") + b.thinking
                elif b.type == "text":
                    texts.append([b.text])
                elif b.type == "tool_use":
                    args = b.input if b.input is not None else {}
                    a.tool_calls = (a.tool_calls or []) + [
                        ToolCall(b.id, b.name, json.dumps(args, ensure_ascii=False))]
                elif b.type == "image":
                    texts.append([_image(b, f"{path}[{j}]")])
            a.parts = join_parts(texts)
            msgs.append(a)
        else:
            chunks = []
            for j, b in enumerate(m.content):
                if b.type == "tool_result":
                    c = b.content
                    if c is None:
                        parts = []
                    elif isinstance(c, str):
                        parts = [c]
                    else:
                        parts = join_parts([[x.text] if x.type == "text" else
                                            [_image(x, f"{path}[{j}].content[{k}]")]
                                            for k, x in enumerate(c)])
                    if chunks:
                        msgs.append(Message("user", join_parts(chunks)))
                        chunks = []
                    msgs.append(Message("tool", parts, tool_call_id=b.tool_use_id))
                elif b.type == "text":
                    chunks.append([b.text])
                elif b.type == "image":
                    chunks.append([_image(b, f"{path}[{j}]")])
            if chunks or not m.content:
                msgs.append(Message("user", join_parts(chunks)))
    if not req.messages:
        raise ConversionError("Empty input messages", param="messages")
    if tool_choice != "none":
        check_unique(tool_names)
    conv = Conversation(msgs, thinking, tools, tool_choice, effort, "text", None)
    if tool_choice == "required" and thinking and tools:
        raise ConversionError("Thinking mode does not support this tool_choice", param="tool_choice")
    # the official package names the field `stop` in this message, as in the other APIs
    check_stop(req.stop_sequences, "stop")
    check_temperature(req.temperature)
    check_top_p(req.top_p)
    rendered_tools = bool(tools) and tool_choice != "none"
    temperature, top_p = sampling(version, thinking, rendered_tools, req.temperature, req.top_p)
    inf = InferenceOptions(max_tokens, temperature, top_p, False, None, None, output_constraint(conv))
    parsing = make_parsing(conv, rendered_tools, list(req.stop_sequences or []), opts)
    return ConvertedRequest("messages", req.model, version, conv, inf, parsing, bool(req.stream))
