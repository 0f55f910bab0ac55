"""JSON text as the prompt templates write it.

Both model versions use `", "` / `": "` separators, keep key order and leave non-ASCII
unescaped. They differ only in how floats are spelled:

* V4.1 writes Python `repr(float)`: `1e-05`, `1e+20`, `100.0`.
* V4 writes the same digits but keeps plain decimals down to 1e-5 (`0.00001`) and drops the
  zero padding of the exponent (`1e-7`).
"""
from __future__ import annotations

import json
import math

_STR = json.encoder.py_encode_basestring  # escapes only what JSON requires (no ASCII escaping)
try:  # the C version is much faster
    from _json import encode_basestring as _STR  # type: ignore[no-redef]
except ImportError:  # pragma: no cover
    pass


def float_v41(x: float) -> str:
    if x != x or math.isinf(x):
        return "null"
    return repr(x)


def float_v4(x: float) -> str:
    if x != x or math.isinf(x):
        return "null"
    r = repr(x)
    if "e" not in r:
        return r
    mant, exp = r.split("e")
    e = int(exp)
    if -5 <= e < 0:
        neg = mant.startswith("-")
        digits = mant.lstrip("-").replace(".", "")
        s = "0." + "0" * (-e - 1) + digits
        return ("-" if neg else "") + s
    return f"{mant}e{'-' if e < 0 else '+'}{abs(e)}"


def make_dumps(float_repr, item_sep: str = ", ", key_sep: str = ": "):
    def dumps(o) -> str:
        t = type(o)
        if t is str:
            return _STR(o)
        if t is dict:
            if not o:
                return "{}"
            return "{" + item_sep.join(_STR(str(k)) + key_sep + dumps(v)
                                       for k, v in o.items()) + "}"
        if t is list or t is tuple:
            if not o:
                return "[]"
            return "[" + item_sep.join(dumps(v) for v in o) + "]"
        if o is None:
            return "null"
        if o is True:
            return "true"
        if o is False:
            return "false"
        if t is int:
            return str(o)
        if t is float:
            return float_repr(o)
        if isinstance(o, str):
            return _STR(o)
        if isinstance(o, int):
            return str(int(o))
        if isinstance(o, float):
            return float_repr(float(o))
        if isinstance(o, dict):
            return dumps(dict(o))
        if isinstance(o, (list, tuple)):
            return dumps(list(o))
        raise TypeError(f"cannot serialise {t.__name__} as JSON")

    return dumps


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
try:  # the C encoder, called directly: skips JSONEncoder.encode's per-call Python setup
    from _json import make_encoder as _c_make_encoder  # type: ignore

    def _C_ENCODE(o, _d=_ENCODER.default, _s=_STR, _mk=_c_make_encoder, _j="".join) -> str:
        return _j(_mk({}, _d, _s, None, ": ", ", ", False, False, False)(o, 0))
except ImportError:  # pragma: no cover
    _C_ENCODE = _ENCODER.encode


def _accelerated(py_dumps, v4: bool):
    """The C encoder writes exactly this format (", " / ": ", key order, non-ASCII kept,
    floats as repr) except for NaN/inf (it raises) and, for V4, floats with an exponent:
    then the pure-Python writer is used."""

    def dumps(o) -> str:
        t = type(o)
        if t is str:
            return _STR(o)
        if t is dict or t is list:
            try:
                s = _C_ENCODE(o)
            except (ValueError, TypeError):
                return py_dumps(o)
            if v4 and ("e-" in s or "e+" in s):
                return py_dumps(o)
            return s
        if t is int:
            return int.__repr__(o)
        return py_dumps(o)

    return dumps


dumps_v4 = _accelerated(make_dumps(float_v4), True)
dumps_v41 = _accelerated(make_dumps(float_v41), False)

_NAMED_SEP = '}, {"name": '


def dumps_named_lines(objs: list, v4: bool) -> str:
    """`"\\n".join(dumps(o) for o in objs)` for dicts whose first key is "name" (tool schemas),
    with one encoder call: the list is encoded whole and its element boundaries
    (`}, {"name": `, a spelling only structure can produce since quotes inside strings are
    escaped) are turned into newlines when exactly the len-1 boundaries are found."""
    dumps = dumps_v4 if v4 else dumps_v41
    if len(objs) > 1:
        try:
            s = _C_ENCODE(objs)
        except (ValueError, TypeError):
            s = None
        if s is not None and not (v4 and ("e-" in s or "e+" in s)) \
                and s.count(_NAMED_SEP) == len(objs) - 1:
            return s[1:-1].replace(_NAMED_SEP, '}\n{"name": ')
    return "\n".join([dumps(o) for o in objs])


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
try:
    def _compact_c(o, _d=_COMPACT.default, _s=_STR, _mk=_c_make_encoder, _j="".join) -> str:
        return _j(_mk({}, _d, _s, None, ":", ",", False, False, True)(o, 0))
except NameError:  # pragma: no cover
    _compact_c = _COMPACT.encode


_compact_py = make_dumps(float_v4, ",", ":")


def compact(o) -> str:
    """Compact JSON (`,` / `:`), non-ASCII unescaped: the form used in output constraints.
    Floats are spelled as in V4 prompts (`0.00001`, `1e-7`, `1e+20`), as the official
    constraint writer does."""
    t = type(o)
    if t is dict or t is list:
        try:
            s = _compact_c(o)
        except (ValueError, TypeError):
            return _compact_py(o)
        if "e-" in s or "e+" in s:
            return _compact_py(o)
        return s
    return _compact_py(o)
