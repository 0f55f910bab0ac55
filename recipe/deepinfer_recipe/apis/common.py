"""Shared pieces of the request models: base config, error formatting, output constraints."""
from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..conversation import ToolDefinition
from ..errors import ConversionError, RequestValidationError
from ..jsonfmt import compact
from ..strict import all_plain, check_tool_schema, normalise


class Model(BaseModel):
    """Base of every request model: unknown fields are accepted and ignored (as the APIs do)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


# union and discriminator tags of the request models, which a field path leaves out
_TAGS: set = {"system", "user", "assistant", "tool", "latest_reminder", "text", "image_url", "file",
              "function", "json_object", "json_schema", "enabled", "disabled", "adaptive"}


def loc_str(loc: tuple) -> str:
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x in _TAGS or str(x).startswith(("function-", "typed-dict", "list[", "str", "json-")):
            continue  # union / discriminator tags are not field names
        else:
            out += ("." if out else "") + str(x)
    return out or "body"


def decoded_body(body: Any) -> dict:
    """A request body given as a dict, or as JSON text or bytes, as a dict."""
    if isinstance(body, (str, bytes, bytearray)):
        try:
            body = json.loads(body)
        except ValueError as e:
            raise RequestValidationError(f"body: invalid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestValidationError("body: expected a JSON object")
    return body


def validate(model_cls, body: Any):
    """Parse a request body (dict, str or bytes) into `model_cls`, raising
    RequestValidationError('<field>: <problem>')."""
    try:
        return model_cls.model_validate(decoded_body(body))
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        msg = err["msg"]
        if err.get("type") == "literal_error" or err.get("type") == "union_tag_invalid":
            msg = f"{msg}, got {err.get('input')!r}"
        raise RequestValidationError(f"{loc_str(err['loc'])}: {msg}",
                                     param=loc_str(err["loc"])) from None


def tools_constraint(tools: list, required: bool) -> tuple:
    arr = []
    for t in tools:
        # a tool without parameters takes none: the grammar needs an (empty) schema
        d = {"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": t.parameters if t.parameters is not None else {}, "strict": t.strict}}
        if t.defer_loading:
            d["defer_loading"] = True
        arr.append(d)
    return ("tool_call_required" if required else "tool_call", compact(arr))


def output_constraint(conv, regex: str | None = None) -> tuple | None:
    """What decoding must follow: the rendered tools, else a JSON format, else a regex."""
    if conv.tools and conv.tool_choice != "none":
        return tools_constraint(conv.tools, conv.tool_choice == "required")
    if conv.response_format == "json_object":
        return ("json", "")
    if conv.response_format == "json_schema":
        return ("json", compact(conv.constraint_schema if conv.constraint_schema is not None
                                else conv.response_schema))
    if regex is not None:
        return ("regex", regex)
    return None


def check_json_word(conv) -> None:
    if conv.response_format != "json_object":
        return
    for m in conv.messages:
        if "json" in m.content.lower():
            return
    raise ConversionError("Prompt must contain the word 'json' in some form to use "
                          "'response_format' of type 'json_object'.", param="response_format")


def check_strict(tools: list, where: str = "tools") -> list:
    """Strict function tools: every property must be required; strict and non-strict don't mix."""
    kinds = {bool(t.strict) for t in tools}
    if len(kinds) > 1:
        raise ConversionError("All tools must be either strict or non-strict", param=where)
    return tools


def make_tool(name, description, parameters, strict=None, defer_loading=False) -> ToolDefinition:
    return ToolDefinition(name=name, description=description, parameters=parameters,
                          strict=strict, defer_loading=bool(defer_loading))


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
TOOL_NAME_MAX = 128


_name_match = _TOOL_NAME.fullmatch


def tool_name_ok(name: str) -> bool:
    """The cheap yes/no form of `check_tool_name`, for callers that defer the error: a name
    the pattern accepts is ASCII, so its length in characters is its length in bytes."""
    return len(name) <= TOOL_NAME_MAX and _name_match(name) is not None


def check_tool_name(name: str, path: str) -> None:
    """Tool names become identifiers in the rendered tool schema and in parsed calls, so the
    official package refuses anything a client SDK could not round-trip. Its length limit
    counts UTF-8 bytes, and it reports length before pattern."""
    if tool_name_ok(name):
        return
    if not name:
        raise ConversionError(f"Invalid '{path}': empty string. Expected a string with minimum "
                              "length 1, but got an empty string instead.", param=path)
    n = len(name.encode("utf-8", "surrogatepass"))  # a lone surrogate fails the pattern below
    if n > TOOL_NAME_MAX:
        raise ConversionError(f"Invalid '{path}': string too long. Expected a string with maximum "
                              f"length {TOOL_NAME_MAX}, but got a string with length {n} instead.",
                              param=path)
    if _TOOL_NAME.fullmatch(name) is None:
        raise ConversionError(f"Invalid '{path}': string does not match pattern. Expected a string "
                              "that matches the pattern '^[a-zA-Z0-9_-]+$'.", param=path)


def check_unique(names, message: str = "Tool names must be unique.") -> None:
    """A duplicate name makes a parsed call ambiguous about which definition it targets; with
    `tool_choice: none` no call can be parsed, and the official package lets it pass."""
    seen = set()
    for n in names:
        if n in seen:
            raise ConversionError(message, param="tools")
        seen.add(n)


def check_stop(stop, field: str = "stop") -> None:
    """An empty stop string would end every completion at its first character."""
    if stop.__class__ is str:
        if not stop:
            raise ConversionError(f"Invalid '{field}': empty string. Expected a string with "
                                  "minimum length 1, but got an empty string instead.", param=field)
        return
    for i, s in enumerate(stop or ()):
        if not s:
            raise ConversionError(f"Invalid '{field}[{i}]': empty string. Expected a string with "
                                  "minimum length 1, but got an empty string instead.",
                                  param=f"{field}[{i}]")


def f32(x: float) -> float:
    """The official package holds sampling values as f32, so range checks must compare the
    rounded value: 2.0000001 passes as 2.0 while 1e-46 becomes 0 and fails top_p."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _range_error(field: str, shown: str) -> ConversionError:
    return ConversionError(f"Invalid {field} value, the valid range of {field} is {shown}",
                           param=field)


def check_penalty(field: str, v) -> None:
    if v is not None and not (-2.0 <= f32(v) <= 2.0):
        raise _range_error(field, "[-2, 2]")


def check_temperature(v) -> None:
    if v is not None and not (0.0 <= f32(v) <= 2.0):
        raise _range_error("temperature", "[0, 2]")


def check_top_p(v) -> None:
    if v is not None and not (0.0 < f32(v) <= 1.0):
        raise _range_error("top_p", "(0, 1.0]")


def check_top_logprobs(v) -> None:
    if v is not None and not (0 <= v <= 20):
        raise _range_error("top_logprobs", "[0, 20].")


def check_seed(v) -> None:
    if v is not None and not (0 <= v < 1 << 63):
        raise _range_error("seed", "[0, 2^63)")


def check_reasoning_passed(msgs, thinking: bool, opts, field: str, empty_ok: bool = True,
                           has_tools: bool = False) -> None:
    """With `reasoning_content_behavior: reject`, an assistant turn since the last user
    message that called tools, or any such turn when the request has tools, must bring its
    reasoning back: the model resumes that reasoning in an agent loop, and a made-up empty
    one would mislead it. Earlier turns are not read by the model's reasoning and may lack
    it. `msgs` are request messages or Conversation messages (both have role, tool_calls and
    reasoning_content); `empty_ok` says whether empty reasoning counts."""
    if opts.reasoning_content_behavior != "reject" or not thinking:
        return
    start = 0
    for i, m in enumerate(msgs):
        if m.role == "user":
            start = i + 1
    for m in msgs[start:]:
        if m.role == "assistant" and (m.tool_calls or has_tools) and (
                m.reasoning_content is None or (not empty_ok and not m.reasoning_content)):
            raise ConversionError(f"The `{field}` in the thinking mode must be passed back to "
                                  "the API.", param="messages")


def no_such_tool(name: str) -> ConversionError:
    """A named tool_choice must name a tool of the request (the wording is the official one
    for all three APIs)."""
    return ConversionError(f"Invalid value for 'tool_call': no function named '{name}' was "
                           "specified in the 'tools' parameter.", param="tool_choice")


def read_tool_schemas(tools: list, tool_choice: str) -> None:
    """Tools that will be rendered are read: a strict tool's parameters are rendered (and
    constrained) in the official normal form, the others checked as JSON Schema documents.
    With tool_choice none nothing is read."""
    if tool_choice == "none":
        return
    # one look at all plain schemas together spares the per-tool walk in the common case
    plain = all_plain([t.parameters for t in tools if not t.strict])
    for t in tools:
        if t.strict:
            t.parameters = normalise(t.parameters, "tool")
        else:
            check_tool_schema(t.name, t.parameters, known_plain=plain)
    check_strict(tools)


def check_format_with_tools(tools: list, tool_choice: str, format_given: bool) -> None:
    """Strict tools constrain the whole output: they leave no room for a response format."""
    if tool_choice != "none" and format_given and any(t.strict for t in tools):
        raise ConversionError("response_format should not be used with tools",
                              param="response_format")
