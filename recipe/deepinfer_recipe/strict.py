"""Strict JSON schemas, as the official package reads them.

A strict schema (a `strict: true` function tool, a strict `json_schema` response format) is
turned into the constrained-decoding grammar, so only the subset the grammar supports is
accepted, and the official package re-serialises what it read: keywords it does not keep are
dropped (top-level `$defs` included) and the kept ones come in a fixed order. The same
normalised schema is rendered in the tool prompt and carried by the output constraint, so
both must be reproduced byte for byte, errors included.
"""
from __future__ import annotations

import re

from .errors import ConversionError
from .jsonfmt import _compact_c, compact

FORMATS = ("email", "hostname", "ipv4", "ipv6", "uuid")
TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")
# kept keywords of each type, in the order they are written back
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _Bad(Exception):
    """A schema the official reader cannot parse (its message follows the reader's prefix)."""


def _kind(v) -> str:
    """How the official reader names a JSON value it did not expect."""
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v!r}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return "null"


def _variant(v, allowed) -> str:
    if not isinstance(v, str):
        raise _Bad(f"invalid type: {_kind(v)}, expected a string")
    if v not in allowed:
        raise _Bad(f"unknown variant `{v}`, expected one of "
                   + ", ".join(f"`{a}`" for a in allowed))
    return v


def _string(v):
    if not isinstance(v, str):
        raise _Bad(f"invalid type: {_kind(v)}, expected a string")
    return v


def _read(s) -> dict:
    """Parse one schema node into its normalised form (pass 1: the reader's errors)."""
    if not isinstance(s, dict):
        raise _Bad(f"invalid type: {_kind(s)}, expected a map")
    if "type" in s:
        t = s["type"]
        if isinstance(t, list):
            out = {"type": [_variant(x, TYPES) for x in t]}
            if "description" in s:
                out["description"] = _string(s["description"])
            return out
        t = _variant(t, TYPES)
        return _READERS[t](s)
    if "anyOf" in s:
        alts = s["anyOf"]
        if not isinstance(alts, list):
            raise _Bad(f"invalid type: {_kind(alts)}, expected a sequence")
        try:
            out = {"anyOf": [_read(x) for x in alts]}
        except _Bad as e:  # the reader names the field it was in for alternatives only
            raise _Bad(f"field `anyOf`: {e}") from None
        if "description" in s:
            out["description"] = _string(s["description"])
        return out
    if "$ref" in s:
        return {"$ref": _string(s["$ref"])}
    raise _Bad("one of `type`, `anyOf`, `$ref` field is required")


def _object(s) -> dict:
    props = None
    desc = None
    required = None
    extra = None
    for k, v in s.items():
        if k == "properties":
            if not isinstance(v, dict):
                raise _Bad(f"invalid type: {_kind(v)}, expected a map")
            props = {name: _read(p) for name, p in v.items()}
        elif k == "required":
            if not isinstance(v, list):
                raise _Bad(f"invalid type: {_kind(v)}, expected a sequence")
            required = [_string(x) for x in v]
        elif k == "additionalProperties":
            if not isinstance(v, bool):
                raise _Bad(f"invalid type: {_kind(v)}, expected a boolean")
            extra = v
        elif k == "description":
            desc = _string(v)
    out = {"type": "object", "properties": props or {}, "additionalProperties": extra,
           "required": required}
    if desc is not None:
        out["description"] = desc
    return out


def _simple(t, keys):
    def read(s) -> dict:
        out = {"type": t}
        for k in keys:
            if k in s:
                v = s[k]
                if k in ("description", "pattern"):
                    v = _string(v)
                elif k == "format":
                    v = _variant(v, FORMATS)
                elif k == "enum":
                    if not isinstance(v, list):
                        raise _Bad(f"invalid type: {_kind(v)}, expected a sequence")
                    v = [_string(x) for x in v]
                out[k] = v
        return out
    return read


def _array(s) -> dict:
    if "items" not in s:
        raise _Bad("missing field `items`")
    out = {"type": "array", "items": _read(s["items"])}
    if "description" in s:
        out["description"] = _string(s["description"])
    return out


_READERS = {
    "object": _object,
    "string": _simple("string", ("description", "pattern", "format", "enum")),
    "number": _simple("number", ("description",) + _NUMERIC),
    "integer": _simple("integer", ("description",) + _NUMERIC),
    "boolean": _simple("boolean", ("description",)),
    "null": _simple("null", ("description",)),
    "array": _array,
}


def _check(node: dict, empty_ok: bool = False) -> None:
    """Pass 2: the rules the grammar needs (every property required, no extra keys).
    `empty_ok`: an object without properties is allowed here (a tool's parameters)."""
    if node.get("type") == "object":
        props = node["properties"]
        for p in props.values():  # the innermost problem is reported first
            _check(p)
        if not props and not empty_ok:
            raise ConversionError("An object with no properties is not allowed.")
        req = node["required"]
        if req is not None:
            seen = set()
            for r in req:
                if r in seen:
                    raise ConversionError(f"Duplicate required property '{r}'")
                if r not in props:
                    raise ConversionError(f"Required property '{r}' not found in object")
                seen.add(r)
            if len(seen) != len(props):
                raise ConversionError("Required properties must match all properties in the "
                                      "object")
        node["required"] = list(props)
        if node["additionalProperties"] is True:
            raise ConversionError("additionalProperties should not be true")
        node["additionalProperties"] = False
    elif node.get("type") == "array":
        _check(node["items"])
    elif "anyOf" in node:
        for a in node["anyOf"]:
            _check(a)


_TYPE_NAMES = TYPES
_NON_NEGATIVE = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                 "minProperties")  # in the meta-schema's order


def check_document(schema, prefix: str = "Invalid json schema: ") -> None:
    """A non-strict response-format schema is compiled as a JSON Schema document: checked
    against the meta-schema (the checks below are the ones reproduced: unique `required`,
    known type names, non-negative counts) and then every local `$ref` must resolve."""
    def meta(s):
        # subschemas are validated before the keywords of the schema holding them
        if isinstance(s, dict):
            for v in s.values():
                meta(v)
            t = s.get("type")
            for name in (t if isinstance(t, list) else [t] if isinstance(t, str) else ()):
                if isinstance(name, str) and name not in _TYPE_NAMES:
                    raise ConversionError(f"{prefix}{compact(name)} is not valid "
                                          "under any of the schemas listed in the 'anyOf' "
                                          "keyword")
            for k in _NON_NEGATIVE:
                v = s.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                    raise ConversionError(f"{prefix}{compact(v)} is less than the "
                                          "minimum of 0")
            req = s.get("required")
            if isinstance(req, list) and len(req) != len({compact(x) for x in req}):
                raise ConversionError(prefix + compact(req)
                                      + " has non-unique elements")
        elif isinstance(s, list):
            for v in s:
                meta(v)

    def refs(s):
        if isinstance(s, dict):
            r = s.get("$ref")
            if isinstance(r, str) and r.startswith("#/"):
                node = schema
                for part in r[2:].split("/"):
                    part = part.replace("~1", "/").replace("~0", "~")
                    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                        node = node[int(part)]
                    elif isinstance(node, dict) and part in node:
                        node = node[part]
                    else:
                        raise ConversionError(f"{prefix}Pointer '{r[1:]}' does not "
                                              "exist")
            for v in s.values():
                refs(v)
        elif isinstance(s, list):
            for v in s:
                refs(v)

    if _plain(schema):
        return
    meta(schema)
    refs(schema)


_TYPE_VALUE = re.compile(r'"type":"([^"\\]*)"')
_TRIGGERS = ('"required"', '"$ref"', '"type":[') + tuple(f'"{k}"' for k in _NON_NEGATIVE)


def _plain(schema) -> bool:
    """True when the compact text of `schema` shows nothing check_document could refuse (no
    `required`, `$ref`, count keyword or type list, only known type names), which is the
    common case and spares the walk. A false "not plain" only costs the walk."""
    try:
        text = _compact_c(schema)
    except (ValueError, TypeError):
        return False
    for t in _TRIGGERS:
        if t in text:
            return False
    for name in _TYPE_VALUE.findall(text):
        if name not in _TYPE_NAMES:
            return False
    return True


def normalise(schema, what: str) -> dict:
    """The official normalised form of a strict schema; `what` is "tool" (function
    parameters) or "json" (a response format). Raises ConversionError as it does."""
    if schema is None and what == "tool":
        schema = {"type": "object"}  # a strict tool without parameters takes none
    try:
        node = _read(schema)
    except _Bad as e:
        prefix = "Invalid tool parameters schema : " if what == "tool" else "Invalid json schema: "
        raise ConversionError(prefix + str(e)) from None
    _check(node, what == "tool")
    if node.get("type") != "object":
        raise ConversionError("The top level of the function parameters schema must be an object."
                              if what == "tool" else
                              "The top level of the json schema must be an object.")
    return node


def all_plain(schemas: list) -> bool:
    """check_document would pass each of `schemas` (looked at together, see _plain)."""
    return _plain(schemas)


def check_tool_schema(name: str, params, missing_ok: bool = True,
                      known_plain: bool = False) -> None:
    """A non-strict tool's parameters: a JSON Schema document (see check_document) whose top
    level is an object, as the tool prompt and the parser assume. `known_plain`: the caller
    has seen that check_document has nothing to refuse."""
    prefix = f"Invalid schema for function '{name}': "
    if params is None:
        if missing_ok:
            return
        raise ConversionError(prefix + 'null is not of types "boolean", "object"')
    if isinstance(params, dict) and not known_plain:
        check_document(params, prefix)
    t = params.get("type") if isinstance(params, dict) else None
    if t != "object":
        raise ConversionError(prefix + "schema must be a JSON Schema of 'type: \"object\"', got "
                              f"'type: {compact(t)}'.")
