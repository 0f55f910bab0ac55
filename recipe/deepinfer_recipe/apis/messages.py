"""Anthropic Messages: request models (content blocks, tool_use / tool_result, thinking) and
conversion to a Conversation."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from ..conversation import Conversation, ImageSource, Message, ModelVersion, ToolCall, join_parts
from ..errors import ConversionError
from ..strict import check_tool_schema
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, resolve_model,
                       resolve_thinking, sampling)
from .chat import make_parsing
from .common import (Model, _TAGS, check_reasoning_passed, check_stop,
                     check_temperature, check_tool_name, check_top_p, check_unique, make_tool,
                     no_such_tool, output_constraint, validate)

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


class ImageSrcFile(Model):
    type: Literal["file"]
    file_id: Optional[str] = None


class ImageBlock(Model):
    type: Literal["image"]
    source: Annotated[Union[ImageSrcBase64, ImageSrcURL, ImageSrcFile],
                      Field(discriminator="type")]


class ThinkingBlock(Model):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class ToolUseBlock(Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Any = None


class DocumentBlock(Model):
    type: Literal["document"]
    source: dict[str, Any]

    @property
    def stub(self) -> str:
        """Documents are not read: the model is told one was there and of which type."""
        mt = self.source.get("media_type")
        return f"[Unsupported document type: {mt if isinstance(mt, str) else 'unknown'}]"


class ToolResultBlock(Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock, DocumentBlock],
                                       Field(discriminator="type")]], None] = None
    is_error: Optional[bool] = None


class ServerToolUseBlock(Model):
    type: Literal["server_tool_use", "web_search_tool_result", "tool_addition"]


Block = Annotated[Union[TextBlock, ImageBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock,
                        DocumentBlock, ServerToolUseBlock], Field(discriminator="type")]


class MessageParam(Model):
    role: Literal["user", "assistant", "system"]
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


def _file_id_error(where: str, path: str) -> ConversionError:
    return ConversionError(f"{where}: file_id is not supported. Pass the image as a base64 "
                           "data url instead.", param=path)


def _image(b: ImageBlock, path: str, v41: bool = False, where: str = "",
           source_path: str = "") -> ImageSource:
    """`where`: the block as the official messages name it, for the file_id refusal;
    `source_path`: the image's location as the official image sources record it."""
    s = b.source
    if s.type == "file":
        # an uploaded file cannot be fetched here; V4 only shows a stub for any image
        if v41:
            raise _file_id_error(where, path)
        return ImageSource("file", s.file_id, "high", source_path)
    if s.type == "base64":
        return ImageSource("data_url", f"data:{s.media_type};base64,{s.data}", "high", source_path)
    return ImageSource("url", s.url, "high", source_path)


_MISSING = ("`tool_use` ids were found without `tool_result` blocks immediately after: {}. Each "
            "`tool_use` block must have a corresponding `tool_result` block in the next message.")


def _unexpected(k: int, j: int, tid: str) -> ConversionError:
    return ConversionError(f"unexpected `messages.{k}.content.{j}: tool_use_id` found in "
                           f"`tool_result` blocks: {tid}. Each `tool_result` block must have a "
                           "corresponding `tool_use` block in the previous message.",
                           param=f"messages[{k}].content[{j}]")


def _calls_outside_assistant(k: int, blocks) -> None:
    for b in blocks:
        t = b.type
        if t in ("tool_use", "server_tool_use", "web_search_tool_result"):
            name = "web_search_tool_result" if t == "web_search_tool_result" else "tool_use"
            raise ConversionError(f"messages.{k}: `{name}` blocks can only be in `assistant` "
                                  "messages", param=f"messages[{k}]")


def check_pairing(messages: list, v41: bool = False) -> None:
    """No message may have an empty block list. Every tool_use must be answered by a
    tool_result at the start of the very next user message, once, and every tool_result
    must answer a tool_use of the message before: a call without its result (or the
    reverse) has no faithful rendering. Server tool blocks are refused, and call blocks
    outside assistant messages. V4.1 also refuses images given as file ids and assistant
    images. The messages and their order are the official package's, which decide the
    error a request gets."""
    pending: dict = {}  # the tool_use ids of the previous message, when it is an assistant's
    caller = 0
    for k, m in enumerate(messages):
        content = m.content
        if content.__class__ is list and not content and m.role != "system":
            raise ConversionError(f"messages.{k}: all messages must have non-empty content",
                                  param=f"messages[{k}]")
        if m.role == "user" and content.__class__ is not str:
            answered: set = set()
            leading = bool(pending)
            for j, b in enumerate(content):
                t = b.type
                if t == "tool_result":
                    tid = b.tool_use_id
                    if tid not in pending:
                        raise _unexpected(k, j, tid)
                    if tid in answered:
                        raise ConversionError(
                            f"messages.{k}.content.{j}: each tool_use must have a single result. "
                            f"Found multiple `tool_result` blocks with id: {tid}",
                            param=f"messages[{k}].content[{j}]")
                    answered.add(tid)
                    if v41 and isinstance(b.content, list):
                        for x, c in enumerate(b.content):
                            if c.type == "image" and c.source.type == "file":
                                raise _file_id_error(f"messages.{k}.content.{j}.tool_result"
                                                     f".content[{x}]", f"messages[{k}]")
                    continue
                _calls_outside_assistant(k, (b,))
                if leading:
                    leading = False
                    missing = [x for x in pending if x not in answered]
                    if missing:
                        raise ConversionError(f"messages.{k}: " + _MISSING.format(
                            ", ".join(sorted(missing))), param=f"messages[{k}]")
                if v41 and t == "image" and b.source.type == "file":
                    raise _file_id_error(f"messages.{k}.content[{j}]",
                                         f"messages[{k}].content[{j}]")
            if leading:
                missing = [x for x in pending if x not in answered]
                if missing:
                    raise ConversionError(f"messages.{caller}:" + _MISSING.format(
                        ", ".join(sorted(missing))), param=f"messages[{caller}]")
        elif pending:
            raise ConversionError(f"messages.{k}: " + _MISSING.format(
                ", ".join(sorted(pending))), param=f"messages[{k}]")
        pending = {}
        if m.role == "system" and content.__class__ is not str:
            for j, b in enumerate(content):
                if v41 and b.type == "image" and b.source.type == "file":
                    raise _file_id_error(f"messages.{k}.content[{j}]",
                                         f"messages[{k}].content[{j}]")
            _calls_outside_assistant(k, content)
        if m.role == "assistant" and content.__class__ is not str:
            for j, b in enumerate(content):
                t = b.type
                if t == "tool_use":
                    if b.id in pending:
                        raise ConversionError(f"messages.{k}.content.{j}: `tool_use` ids must be "
                                              "unique", param=f"messages[{k}].content[{j}]")
                    pending[b.id] = True
                elif t in ("server_tool_use", "web_search_tool_result"):
                    raise ConversionError("Unsupported content block: server tools are not "
                                          "supported", param=f"messages[{k}]")
                elif pending and t != "thinking":
                    # calls end the assistant turn: what follows them would come after results
                    raise ConversionError(f"messages.{k}.{j}: " + _MISSING.format(
                        ", ".join(sorted(pending))), param=f"messages[{k}].content[{j}]")
                elif v41 and t == "image":  # V4.1 reads no assistant images
                    if b.source.type == "file":
                        raise _file_id_error(f"messages.{k}.content[{j}]",
                                             f"messages[{k}].content[{j}]")
                    raise ConversionError("Image in assistant message is unsupported",
                                          param=f"messages[{k}].content[{j}]")
            caller = k
    if pending:
        raise ConversionError(f"messages.{caller}:" + _MISSING.format(", ".join(sorted(pending))),
                              param=f"messages[{caller}]")


class _View:
    """A request message seen as a turn: a user message of tool results only is not a user
    turn, a V4 system message is; an assistant's reasoning is present when it has a thinking
    block."""

    __slots__ = ("role", "tool_calls", "reasoning_content")

    def __init__(self, m: MessageParam, v41: bool):
        blocks = [] if isinstance(m.content, str) else m.content
        # V4 has no system turns: a system message reaches it as a user turn
        self.role = "user" if m.role == "system" and not v41 else m.role
        if m.role == "user" and blocks and all(b.type == "tool_result" for b in blocks):
            self.role = "tool"
        self.tool_calls = [b for b in blocks if b.type == "tool_use"]
        thoughts = [b.thinking for b in blocks if b.type == "thinking"]
        self.reasoning_content = "\n\n".join(thoughts) if thoughts else None


def convert_messages(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    req: MessagesRequest = body if isinstance(body, MessagesRequest) else validate(MessagesRequest, body)
    version = resolve_model(req.model, opts)
    thinking, effort = resolve_thinking(req.thinking.type if req.thinking else None,
                                        req.output_config.effort if req.output_config else None, opts)
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type is not None:
            if opts.messages_web_search == "reject" or not t.type.startswith("web_search"):
                raise ConversionError(f"tools[{i}]: server tools are not supported", param=f"tools[{i}]")
            continue
        check_tool_name(t.name, f"tools[{i}].name")
        # V4.1 announces a deferred tool only when it is loaded; V4 lists every tool
        tools.append(make_tool(t.name, t.description, t.input_schema, t.strict,
                               t.defer_loading and version is ModelVersion.V41))
    if tools and all(t.defer_loading for t in tools):
        raise ConversionError("tools: at least one tool must have defer_loading=false. All tools cannot be "
                              "deferred.", param="tools")
    if not req.messages:
        raise ConversionError("messages: at least one message is required", param="messages")
    check_pairing(req.messages, version is ModelVersion.V41)
    if opts.reasoning_content_behavior == "reject":
        v41 = version is ModelVersion.V41
        check_reasoning_passed([_View(m, v41) for m in req.messages], thinking, opts,
                               "content[].thinking", has_tools=bool(tools))
    bound = opts.thinking_max_tokens_upper_bound if thinking else opts.non_thinking_max_tokens_upper_bound
    max_tokens = req.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is "
                                  f"[1, {bound}]", param="max_tokens")
        max_tokens = min(max_tokens, bound)
    tool_names = [t.name for t in tools]
    all_tools = tools
    tool_choice = "auto"
    missing_choice = None
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "none":
            tool_choice = "none"
        elif tc.type == "tool" and tools:  # with no tools there is nothing to name
            tools = [t for t in tools if t.name == tc.name]
            if not tools:  # refused after the tool checks, where the official package does
                missing_choice = tc.name
            tool_choice = "required"

    msgs: list = []
    v41 = version is ModelVersion.V41
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        if text:
            msgs.append(Message("system", [text]))
    for i, m in enumerate(req.messages):
        path = f"messages[{i}].content"
        if m.role == "system":
            # V4.1 has system turns; V4 has none, so the text reaches the model as a reminder
            # in the user turn it precedes (nothing at all when empty)
            if isinstance(m.content, str):
                parts = [m.content]
            else:
                parts = join_parts([[b.text] if b.type == "text" else [b.stub]
                                    if b.type == "document" else
                                    [_image(b, f"{path}[{j}]", source_path=f"messages.{i}")]
                                    for j, b in enumerate(m.content)
                                    if b.type in ("text", "document", "image")])
            if v41:
                msgs.append(Message("system", parts))
            else:
                text = "".join(p if p.__class__ is str else "[Unsupported Image]" for p in parts)
                if text:
                    msgs.append(Message("user", [f"<system-reminder>\n{text}\n"
                                                 "</system-reminder>"]))
            continue
        if isinstance(m.content, str):
            msgs.append(Message(m.role, [m.content]))
            continue
        if m.role == "assistant":
            a = Message("assistant", [])
            thoughts = []
            # the answer text grows block by block, a blank line before each block once
            # there is some text: an empty first block adds nothing
            parts: list = []
            for j, b in enumerate(m.content):
                if b.type == "thinking":
                    thoughts.append(b.thinking)
                elif b.type == "text" or b.type == "document":
                    if any(parts):
                        parts.append("\n\n")
                    parts.append(b.text if b.type == "text" else b.stub)
                elif b.type == "tool_use":
                    args = b.input if b.input is not None else {}
                    a.tool_calls = (a.tool_calls or []) + [
                        ToolCall(b.id, b.name, json.dumps(args, ensure_ascii=False))]
                elif b.type == "image":
                    if v41:
                        raise ConversionError("Image in assistant message is unsupported",
                                              param=f"{path}[{j}]")
                    if any(parts):
                        parts.append("\n\n")
                    parts.append(_image(b, f"{path}[{j}]", v41, source_path=f"messages.{i}"))
            if thoughts:
                a.reasoning_content = "\n\n".join(thoughts)
            a.parts = parts
            msgs.append(a)
        else:
            # each text or image block is a user message of its own: the renderer joins
            # them as it joins consecutive user messages (V4 skips the empty ones)
            chunks = []
            for j, b in enumerate(m.content):
                if b.type == "tool_result":
                    c = b.content
                    if c is None:
                        parts = []
                    elif isinstance(c, str):
                        parts = [c]
                    else:
                        parts = join_parts([[x.text] if x.type == "text" else [x.stub]
                                            if x.type == "document" else
                                            [_image(x, f"{path}[{j}].content[{k}]", v41,
                                                   f"messages.{i}.content.{j}.tool_result"
                                                   f".content[{k}]",
                                                   f"messages.{i}.content.{j}.tool_result")]
                                            for k, x in enumerate(c)])
                    msgs += chunks
                    chunks = []
                    msgs.append(Message("tool", parts, tool_call_id=b.tool_use_id))
                elif b.type == "text":
                    chunks.append(Message("user", [b.text]))
                elif b.type == "document":
                    chunks.append(Message("user", [b.stub]))
                elif b.type == "image":
                    block = f"messages.{i}.content[{j}]"
                    chunks.append(Message("user", [_image(b, f"{path}[{j}]", v41, block, block)]))
            msgs += chunks
    if tool_choice != "none":
        # `strict` is not read here: every schema is a JSON Schema document
        for t in all_tools:
            check_tool_schema(t.name, t.parameters, missing_ok=False)
        check_unique(tool_names)
    if missing_choice is not None:
        raise no_such_tool(missing_choice)
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
