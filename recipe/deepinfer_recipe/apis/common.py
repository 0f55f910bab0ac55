"""Shared pieces of the request models: base config, error formatting, output constraints."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..conversation import ToolDefinition
from ..errors import ConversionError, RequestValidationError
from ..jsonfmt import compact


class Model(BaseModel):
    """Base of every request model: unknown fields are accepted and ignored (as the APIs do)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


_TAGS: set = set()


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


def validate(model_cls, body: Any):
    """Parse a request body (dict, str or bytes) into `model_cls`, raising
    RequestValidationError('<field>: <problem>')."""
    try:
        if isinstance(body, (str, bytes, bytearray)):
            try:
                body = json.loads(body)
            except ValueError as e:
                raise RequestValidationError(f"body: invalid JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestValidationError("body: expected a JSON object")
        return model_cls.model_validate(body)
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
        d = {"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters, "strict": t.strict}}
        if t.defer_loading:
            d["defer_loading"] = True
        arr.append(d)
    return ("tool_call_required" if required else "tool_call", compact(arr))


def output_constraint(conv) -> tuple | None:
    if conv.response_format == "json_object":
        return ("json", "")
    if conv.response_format == "json_schema":
        return ("json", compact(conv.response_schema))
    if conv.tools and conv.tool_choice != "none":
        return tools_constraint(conv.tools, conv.tool_choice == "required")
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
