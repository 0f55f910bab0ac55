"""OpenAI Chat Completions: a request body read, checked and converted to a Conversation in one
pass over the decoded JSON.

Reading follows the official package: every field must have its JSON type (no string read as a
number, no integer as a boolean) and unknown fields are ignored. A body with a field of the wrong
shape is refused before any rule about its meaning is applied, so the reading pass raises shape
errors at once and keeps the first rule it sees broken for after the body has been read."""
from __future__ import annotations

import math
from typing import Any, Optional

from ..conversation import (Conversation, ImageSource, Message, ModelVersion, ToolCall,
                            ToolDefinition)
from ..errors import ConversionError, RequestValidationError
from ..strict import check_document, normalise
from ..options import (ConversionOptions, ConvertedRequest, InferenceOptions, ParsingOptions,
                       resolve_model, resolve_thinking, sampling)
from .common import (check_format_with_tools, check_json_word, check_penalty, decoded_body,
                     check_reasoning_passed, check_seed, check_stop, check_temperature,
                     check_tool_name, check_top_logprobs, check_top_p, check_unique,
                     no_such_tool, output_constraint, read_tool_schemas)

ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
_ROLE_SET = frozenset(ROLES)
PART_TYPES = ("text", "image_url", "file")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
TOOL_CHOICES = ("none", "auto", "required")
IMAGE_DETAILS = ("low", "high", "original", "auto")
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex")


# ---- shape errors ---------------------------------------------------------------------------

def _shape_error(path: str, problem: str) -> RequestValidationError:
    return RequestValidationError(f"{path}: {problem}", param=path)


def _missing(path: str) -> RequestValidationError:
    return _shape_error(path, "Field required")


def _not_a(path: str, kind: str) -> RequestValidationError:
    return _shape_error(path, f"Input should be a valid {kind}")


def _choices(allowed: tuple) -> str:
    quoted = [f"'{a}'" for a in allowed]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _not_one_of(path: str, allowed: tuple, value) -> RequestValidationError:
    return _shape_error(path, f"Input should be {_choices(allowed)}, got {value!r}")


def _unknown_tag(path: str, key: str, allowed: tuple, value: dict) -> RequestValidationError:
    """A message or content part names its kind in `key`; the whole entry is shown, since the
    kind alone may not tell the client which entry is meant."""
    if key not in value:
        return _shape_error(path, f"Unable to extract tag using discriminator '{key}'")
    return _shape_error(path, f"Input tag '{value[key]}' found using '{key}' does not match any "
                              f"of the expected tags: {', '.join(repr(a) for a in allowed)}, "
                              f"got {value!r}")


# ---- optional scalar fields: None when absent or null ---------------------------------------

def _opt_str(v, path: str) -> Optional[str]:
    if v is None or v.__class__ is str:
        return v
    raise _not_a(path, "string")


def _opt_bool(v, path: str) -> Optional[bool]:
    if v is None or v.__class__ is bool:
        return v
    raise _not_a(path, "boolean")


def _opt_int(v, path: str) -> Optional[int]:
    if v is None or v.__class__ is int:
        return v
    if v.__class__ is float and math.isfinite(v) and not v.is_integer():
        raise _shape_error(path, "Input should be a valid integer, got a number with a "
                                 "fractional part")
    raise _not_a(path, "integer")


def _opt_float(v, path: str) -> Optional[float]:
    if v is None or v.__class__ is float:
        return v
    if v.__class__ is int:
        try:
            return float(v)
        except OverflowError:
            raise _not_a(path, "number") from None
    raise _not_a(path, "number")


def _opt_choice(v, path: str, allowed: tuple) -> Optional[str]:
    if v is None or (v.__class__ is str and v in allowed):
        return v
    raise _not_one_of(path, allowed, v)


def _opt_dict(v, path: str) -> Optional[dict]:
    if v is None or v.__class__ is dict:
        return v
    raise _not_a(path, "dictionary")


def _bad_field(obj: dict, key: str, path: str, kind: str) -> RequestValidationError:
    """A required field `key` of `obj` (at `path`) that is missing or not a `kind`."""
    return _missing(f"{path}.{key}") if key not in obj else _not_a(f"{path}.{key}", kind)


def _required_str(obj: dict, key: str, path: str) -> str:
    v = obj.get(key)
    if v.__class__ is str:
        return v
    raise _bad_field(obj, key, path, "string")


def _required_dict(obj: dict, key: str, path: str) -> dict:
    v = obj.get(key)
    if v.__class__ is dict:
        return v
    raise _bad_field(obj, key, path, "dictionary")


def _required_choice(obj: dict, key: str, path: str, allowed: tuple) -> str:
    if key not in obj:
        raise _missing(f"{path}.{key}")
    v = obj[key]
    if v.__class__ is str and v in allowed:
        return v
    raise _not_one_of(f"{path}.{key}", allowed, v)


# ---- reading --------------------------------------------------------------------------------

def _content(content, i: int) -> list:
    """Content given as a list of parts -> message parts, the parts joined by a blank line."""
    path = f"messages[{i}].content"
    image_path = f".messages[{i}]"  # the official image path names only the message
    if content.__class__ is not list:
        raise _not_a(path, "string")
    parts: list = []
    for j, p in enumerate(content):
        if j:
            parts.append("\n\n")
        where = f"{path}[{j}]"
        if p.__class__ is not dict:
            raise _not_a(where, "dictionary")
        kind = p.get("type")
        if kind == "text":
            parts.append(_required_str(p, "text", where))
        elif kind == "image_url":
            image = _required_dict(p, "image_url", where)
            url = _required_str(image, "url", f"{where}.image_url")
            detail = image.get("detail", "high")
            if detail.__class__ is not str or detail not in IMAGE_DETAILS:
                raise _not_one_of(f"{where}.image_url.detail", IMAGE_DETAILS, detail)
            parts.append(ImageSource("data_url" if url.startswith("data:") else "url", url, detail,
                                     image_path))
        elif kind == "file":
            # a file the recipe cannot read: V4 shows the image stub for it, V4.1 refuses it
            parts.append(ImageSource("file", _opt_dict(p.get("file"), f"{where}.file"), "high",
                                     image_path))
        else:
            raise _unknown_tag(where, "type", PART_TYPES, p)
    return parts


def _tool_calls(calls, i: int) -> list:
    if calls.__class__ is not list:
        raise _not_a(f"messages[{i}].tool_calls", "list")
    out = []
    for j, c in enumerate(calls):
        if c.__class__ is not dict:
            raise _not_a(f"messages[{i}].tool_calls[{j}]", "dictionary")
        call_id = c.get("id")
        if call_id.__class__ is not str:
            raise _bad_field(c, "id", f"messages[{i}].tool_calls[{j}]", "string")
        kind = c.get("type", "function")
        if kind != "function":
            raise _not_one_of(f"messages[{i}].tool_calls[{j}].type", ("function",), kind)
        f = c.get("function")
        if f.__class__ is not dict:
            raise _bad_field(c, "function", f"messages[{i}].tool_calls[{j}]", "dictionary")
        name = f.get("name")
        if name.__class__ is not str:
            raise _bad_field(f, "name", f"messages[{i}].tool_calls[{j}].function", "string")
        arguments = f.get("arguments", "")
        if arguments.__class__ is not str:
            raise _not_a(f"messages[{i}].tool_calls[{j}].function.arguments", "string")
        out.append(ToolCall(call_id, name, arguments))
    return out


def _insufficient(i: int) -> ConversionError:
    return ConversionError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to "
        "each 'tool_call_id'. (insufficient tool messages following tool_calls message)",
        param=f"messages[{i}].tool_calls")


def _has_file(content, parts: list) -> bool:
    return content.__class__ is list and any(p.__class__ is ImageSource and p.kind == "file" for p in parts)


def _file_problem(i: int) -> ConversionError:
    """V4.1 reads no file part, whatever the part holds (the official message says otherwise)."""
    return ConversionError(f".messages[{i}]: file must have a file_id or file_data", param=f"messages[{i}]")


def _read_messages(src: list, v41: bool) -> tuple:
    """-> (messages, the first broken rule or None, whether the last message is an assistant
    prefix). The rules kept are those the official package checks in message order after
    reading: each tool message answers a call of the assistant turn just before it that is not
    answered yet, each call is answered before the next turn, an assistant turn has content or
    calls, only the last message may be a prefix, and V4.1 reads no file part (in any message)
    and no image in an assistant turn."""
    msgs = []
    last = len(src) - 1
    problem = prefix_problem = None
    need = None  # call ids of the current assistant turn not answered yet
    answered: set = set()  # and those answered
    caller = 0  # index of the assistant turn that made them
    last_prefix = False
    for i, m in enumerate(src):
        if m.__class__ is not dict:
            raise _not_a(f"messages[{i}]", "dictionary")
        role = m.get("role")
        if role.__class__ is not str or role not in _ROLE_SET:
            raise _unknown_tag(f"messages[{i}]", "role", ROLES, m)
        content = m.get("content")
        if content.__class__ is str:
            parts = [content]
        elif content is None and role == "assistant":
            parts = []  # an assistant turn may hold calls only
        elif "content" not in m:
            raise _missing(f"messages[{i}].content")
        else:
            parts = _content(content, i)

        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and call_id.__class__ is not str:
                raise _not_a(f"messages[{i}].tool_call_id", "string")
            if problem is None:
                if need and call_id in need:
                    need.discard(call_id)
                    answered.add(call_id)
                elif need and call_id in answered:
                    problem = ConversionError(f"Duplicate value for 'tool_call_id' of {call_id} in "
                                              f"message[{i}]", param=f"messages[{i}].tool_call_id")
                elif need:  # calls still unanswered: the stray answer is named as one of them
                    problem = ConversionError(
                        "An assistant message with 'tool_calls' must be followed by tool messages "
                        "responding to each 'tool_call_id', The following tool_call_ids did not have "
                        f"response messages: {call_id}", param=f"messages[{caller}].tool_calls")
                else:  # no call open, or every call answered already (a second answer too)
                    problem = ConversionError("Messages with role 'tool' must be a response to a "
                                              "preceding message with 'tool_calls'",
                                              param=f"messages[{i}]")
            if problem is None and v41 and _has_file(content, parts):
                problem = _file_problem(i)
            msgs.append(Message("tool", parts, None, None, call_id))
            continue

        if problem is None:
            if need:
                problem = _insufficient(caller)
            elif v41 and _has_file(content, parts):
                problem = _file_problem(i)
            need = None
        if role != "assistant":
            # a system message with nothing in it is left out
            if role != "system" or (parts and parts != [""]):
                msgs.append(Message(role, parts))
            continue

        reasoning = m.get("reasoning_content")
        if reasoning is not None and reasoning.__class__ is not str:
            raise _not_a(f"messages[{i}].reasoning_content", "string")
        calls = m.get("tool_calls")
        if calls is not None:
            calls = _tool_calls(calls, i)
        prefix = m.get("prefix", False)
        if prefix.__class__ is not bool:
            raise _not_a(f"messages[{i}].prefix", "boolean")
        if problem is None:
            if v41 and content.__class__ is list and \
                    any(p.__class__ is ImageSource for p in parts):
                problem = ConversionError("Image in assistant message is not supported",
                                          param=f"messages[{i}]")
            elif calls is not None and not calls:
                # an empty content string or list is still content, an empty call list is not
                problem = ConversionError(
                    f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array with "
                    "minimum length 1, but got an empty array instead.",
                    param=f"messages[{i}].tool_calls")
            elif content is None and not calls:
                problem = ConversionError("Invalid assistant message: content or tool_calls must "
                                          "be set", param=f"messages[{i}]")
            elif calls:
                need, answered = {c.id for c in calls}, set()
                caller = i
        if prefix:
            if i == last:
                last_prefix = True
            elif prefix_problem is None:
                prefix_problem = ConversionError(
                    "Invalid completion message: prefix set true with message which is not "
                    "final message or message role is not assistant", param=f"messages[{i}].prefix")
        msgs.append(Message("assistant", parts, reasoning, calls or None, None, prefix and i == last))
    if problem is None and need:
        problem = _insufficient(caller)
    return msgs, problem or prefix_problem, last_prefix


def _read_tools(raw) -> list:
    if raw is None:
        return []
    if raw.__class__ is not list:
        raise _not_a("tools", "list")
    tools = []
    for i, t in enumerate(raw):
        if t.__class__ is not dict:
            raise _not_a(f"tools[{i}]", "dictionary")
        kind = t.get("type", "function")
        if kind != "function":
            raise _not_one_of(f"tools[{i}].type", ("function",), kind)
        f = t.get("function")
        if f.__class__ is not dict:
            raise _bad_field(t, "function", f"tools[{i}]", "dictionary")
        name = f.get("name")
        if name.__class__ is not str:
            raise _bad_field(f, "name", f"tools[{i}].function", "string")
        description = f.get("description")
        if description is not None and description.__class__ is not str:
            raise _not_a(f"tools[{i}].function.description", "string")
        parameters = f.get("parameters")
        if parameters is not None and parameters.__class__ is not dict:
            raise _not_a(f"tools[{i}].function.parameters", "dictionary")
        strict = f.get("strict")
        if strict is not None and strict.__class__ is not bool:
            raise _not_a(f"tools[{i}].function.strict", "boolean")
        # the parameters are read (and a strict tool's normalised) into a copy of their own;
        # `defer_loading` is not read: the official package lists every Chat tool
        tools.append(ToolDefinition(name, description, None if parameters is None else
                                    dict(parameters), strict))
    return tools


def _read_tool_choice(raw) -> tuple:
    """-> (none | auto | required, the name a named choice gives or None)."""
    if raw is None:
        return "auto", None
    if raw.__class__ is dict:
        kind = raw.get("type", "function")
        if kind != "function":
            raise _not_one_of("tool_choice.type", ("function",), kind)
        f = _required_dict(raw, "function", "tool_choice")
        return "auto", _required_str(f, "name", "tool_choice.function")
    if raw.__class__ is str and raw in TOOL_CHOICES:
        return raw, None
    raise _not_one_of("tool_choice", TOOL_CHOICES, raw)


def _read_format(raw) -> tuple:
    """-> (format type or None when not given, json_schema dict or None, the regex of a regex
    format or None)."""
    if raw is None:
        return None, None, None
    if raw.__class__ is not dict:
        raise _not_a("response_format", "dictionary")
    kind = _required_choice(raw, "type", "response_format", FORMAT_TYPES)
    spec = _opt_dict(raw.get("json_schema"), "response_format.json_schema")
    if spec is not None:
        _opt_str(spec.get("name"), "response_format.json_schema.name")
        _opt_bool(spec.get("strict"), "response_format.json_schema.strict")
    regex = _opt_str(raw.get("regex"), "response_format.regex")
    if kind == "regex" and regex is None:
        raise _missing("response_format.regex")
    return kind, spec, regex if kind == "regex" else None


def _read_stop(raw):
    if raw is None or raw.__class__ is str:
        return raw
    if raw.__class__ is not list:
        raise _not_a("stop", "string")
    for i, s in enumerate(raw):
        if s.__class__ is not str:
            raise _not_a(f"stop[{i}]", "string")
    return raw


# ---- conversion -----------------------------------------------------------------------------

def convert_chat(body: Any, opts: ConversionOptions) -> ConvertedRequest:
    body = decoded_body(body)
    g = body.get
    # the fields are read in the official order, which decides the error a body with several
    # shape problems gets
    model = g("model")
    if model.__class__ is not str:
        raise _missing("model") if "model" not in body else _not_a("model", "string")
    src = g("messages")
    if src.__class__ is not list:
        raise _missing("messages") if "messages" not in body else _not_a("messages", "list")
    msgs, problem, last_prefix = _read_messages(
        src, opts.model_versions_by_name.get(model) is ModelVersion.V41)
    thinking = _opt_dict(g("thinking"), "thinking")
    if thinking is not None:
        thinking = _required_choice(thinking, "type", "thinking", THINKING_TYPES)
    effort = _opt_choice(g("reasoning_effort"), "reasoning_effort", EFFORTS)
    tools = _read_tools(g("tools"))
    tool_choice, named_choice = _read_tool_choice(g("tool_choice"))
    fmt, format_spec, regex = _read_format(g("response_format"))
    stop = _read_stop(g("stop"))
    n = _opt_int(g("n"), "n")
    max_tokens = _opt_int(g("max_tokens"), "max_tokens")
    max_completion_tokens = _opt_int(g("max_completion_tokens"), "max_completion_tokens")
    temperature = _opt_float(g("temperature"), "temperature")
    top_p = _opt_float(g("top_p"), "top_p")
    frequency_penalty = _opt_float(g("frequency_penalty"), "frequency_penalty")
    presence_penalty = _opt_float(g("presence_penalty"), "presence_penalty")
    logprobs = _opt_bool(g("logprobs"), "logprobs")
    top_logprobs = _opt_int(g("top_logprobs"), "top_logprobs")
    seed = _opt_int(g("seed"), "seed")
    stream = _opt_bool(g("stream"), "stream")
    stream_options = _opt_dict(g("stream_options"), "stream_options")
    include_usage = False
    if stream_options is not None:
        include_usage = stream_options.get("include_usage", False)
        if include_usage.__class__ is not bool:
            raise _not_a("stream_options.include_usage", "boolean")

    # the rules about meaning, in the official package's order
    version = resolve_model(model, opts)
    for i, t in enumerate(tools):
        check_tool_name(t.name, f"tools[{i}].function.name")
    if not src:
        raise ConversionError("Empty input messages", param="messages")
    thinking, effort = resolve_thinking(thinking, effort, opts)
    if problem is not None:
        raise problem
    tool_names = [t.name for t in tools]
    all_tools = tools
    missing_choice = None
    if named_choice is not None and tools:  # with no tools a named choice has nothing to name
        tools = [t for t in tools if t.name == named_choice]
        if not tools:
            missing_choice = named_choice
        tool_choice = "required"
    check_reasoning_passed(msgs, thinking, opts, "reasoning_content", has_tools=bool(all_tools))
    format_given = fmt is not None
    schema = None
    strict_format = False
    if fmt == "json_schema":
        if format_spec is None or format_spec.get("schema") is None:
            raise RequestValidationError("response_format.json_schema.schema: Field required",
                                         param="response_format")
        schema = format_spec["schema"]
        strict_format = bool(format_spec.get("strict"))
    elif fmt != "json_object":
        fmt = "text"  # a regex constrains decoding only; the prompt is that of plain text

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
    if stream_options is not None and not stream:
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
    if max_tokens is None:
        max_tokens = max_completion_tokens
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
