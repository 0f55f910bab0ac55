"""Incremental parser for the model's output grammar (see docs/format.md, "Output").

`StreamParser(options).feed(text)` returns typed deltas; the result does not depend on how the
output is chunked (except JSON mode, where the official format turns each source chunk of
surrounding prose into one space). Partial markers are held back until they resolve.
"""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Optional

from .options import ParsingOptions

_ESC = json.encoder.py_encode_basestring
try:
    from _json import encode_basestring as _ESC  # type: ignore[no-redef]
except ImportError:  # pragma: no cover
    pass


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    index: int
    text: str


@dataclass(slots=True)
class ToolCallEnd:
    index: int


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class ParseResult:
    reasoning: Optional[str]
    content: str
    tool_calls: list
    finish_reason: str  # stop | length | content_filter | tool_calls
    stop_sequence: Optional[str] = None


class ParseError(ValueError):
    """Raised only in strict mode, for output that breaks the grammar."""


_ALNUM = string.ascii_letters + string.digits

# states
REASONING, CONTENT, TOOLS, TOOL_NAME, ARGS, ARG_NAME, ARG_ATTR, ARG_VALUE, FINISHED = range(9)


def _partial_suffix(buf: str, markers) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        k = min(len(m) - 1, len(buf))
        while k > best:
            if m.startswith(buf[-k:]):
                best = k
                break
            k -= 1
    return best


class StreamParser:
    """Feed model output text; get `ReasoningDelta` / `ContentDelta` / `ToolCall*` deltas.

    strict=False (default) never raises: malformed output yields the best valid result.
    strict=True raises `ParseError` on grammar violations (unknown `string=` attribute value,
    text after the tool-call block, a truncated tool call at finish).
    """

    def __init__(self, options: Optional[ParsingOptions] = None, strict: bool = False,
                 id_factory=None):
        o = options or ParsingOptions()
        self.o = o
        self.strict = strict
        st = o.special_tokens
        self.think_end = st.thinking_end
        D = st.dsml
        self.dsml_open = "<" + D
        self.dsml_close = "</" + D
        self.block_closes = ("</" + D + " calls>", "</" + D + "tool_calls>")
        self.stops = [s for s in o.stop_sequences if s]
        self.parse_tools = o.parse_tool_calls
        self.buf = ""
        self.reasoning_parts: list = []
        self.content_parts: list = []
        self.calls: list = []
        self.stop_hit: Optional[str] = None
        self._ids = id_factory or self._new_id
        self.json_mode = o.parse_json_output
        self.json_state = 0  # 0 before JSON, 1 inside fenced, 2 inside bare, 3 after
        stage = o.thinking_initial_stage
        if o.starts_in_tool_calls and self.parse_tools:
            self.state = TOOLS
            self.strip_nl = False
        elif stage in ("reasoning_start", "reasoning_continuation"):
            self.state = REASONING
            self.strip_nl = stage == "reasoning_start"
        else:
            self.state = CONTENT
            self.strip_nl = not (o.continuation or stage == "content_continuation")
        self._cur_name = ""
        self._is_string = True
        self._nparams = 0
        self._attr = ""

    def _new_id(self, index: int) -> str:
        return f"call_{index:02d}_" + "".join(random.choices(_ALNUM, k=24))

    # ------------------------------------------------------------------ public
    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    def feed(self, text: str) -> list:
        """Process one chunk of output text; returns the deltas it completes."""
        if self.state == FINISHED or not text:
            return []
        out: list = []
        if self.json_mode and self.state == CONTENT:
            self._json_chunk(text, out)
            return out
        self.buf += text
        self._run(out, False)
        if self.json_mode and self.state == CONTENT and self.buf:
            rest, self.buf = self.buf, ""
            if self.strip_nl:
                rest = rest.lstrip("\n")
                if rest:
                    self.strip_nl = False
            if rest:
                self._json_chunk(rest, out)
        return out

    def finish(self, finish_reason: str = "stop") -> tuple:
        """End of output: flush held-back text. -> (deltas, ParseResult)."""
        out: list = []
        if self.state != FINISHED:
            if self.json_mode and self.state == CONTENT:
                self._json_flush(out)
            else:
                self._run(out, True)
        if self.strict and self.calls and not self.calls[-1].complete:
            raise ParseError("output ended inside a tool call")
        calls = self.calls
        if any(c.complete for c in calls):
            fr = "tool_calls"
        elif self.stop_hit is not None:
            fr = "stop"
        else:
            fr = finish_reason
        res = ParseResult("".join(self.reasoning_parts) if self.o.thinking_initial_stage else None,
                          "".join(self.content_parts), calls, fr, self.stop_hit)
        return out, res

    # ------------------------------------------------------------------ engine
    def _emit_reasoning(self, t: str, out: list) -> None:
        if t:
            self.reasoning_parts.append(t)
            out.append(ReasoningDelta(t))

    def _emit_content(self, t: str, out: list) -> None:
        if t:
            self.content_parts.append(t)
            out.append(ContentDelta(t))

    def _args(self, t: str, out: list) -> None:
        if t:
            c = self.calls[-1]
            c.arguments += t
            out.append(ToolCallArgsDelta(len(self.calls) - 1, t))

    def _run(self, out: list, final: bool) -> None:
        while True:
            st = self.state
            if st == REASONING:
                if not self._step_reasoning(out, final):
                    return
            elif st == CONTENT:
                if not self._step_content(out, final):
                    return
            elif st == FINISHED:
                self.buf = ""
                return
            else:
                if not self._step_tools(out, final):
                    return

    def _strip_leading(self) -> bool:
        """Drop leading newlines at the start of a section; False if more input is needed."""
        if self.strip_nl:
            b = self.buf.lstrip("\n")
            self.buf = b
            if not b:
                return False
            self.strip_nl = False
        return True

    def _step_reasoning(self, out: list, final: bool) -> bool:
        if not self._strip_leading():
            return False
        b = self.buf
        i = b.find(self.think_end)
        j = b.find(self.dsml_open) if self.parse_tools else -1
        if i >= 0 and (j < 0 or i < j):
            # one newline right before the end-of-thinking marker belongs to the marker
            self._emit_reasoning(b[:i - 1] if i and b[i - 1] == "\n" else b[:i], out)
            self.buf = b[i + len(self.think_end):]
            self.state = CONTENT
            self.strip_nl = True
            return True
        if j >= 0:  # a tool-call block opened inside reasoning: reasoning ends, no content
            self._emit_reasoning(b[:j].rstrip("\n"), out)
            self.buf = b[j:]
            self.state = TOOLS
            return True
        if final:
            self._emit_reasoning(b, out)
            self.buf = ""
            return False
        markers = (self.think_end, self.dsml_open) if self.parse_tools else (self.think_end,)
        k = _partial_suffix(b, markers)
        keep = len(b) - k
        body = b[:keep]
        # trailing newlines are held back: they may precede "</think>" or a tool block
        body = body.rstrip("\n")
        keep = len(body)
        self._emit_reasoning(body, out)
        self.buf = b[keep:]
        return False

    def _step_content(self, out: list, final: bool) -> bool:
        if self.json_mode:
            return False  # handled chunk by chunk in feed()
        if not self._strip_leading():
            return False
        b = self.buf
        # earliest of: stop sequence, tool block opener, stray </think>
        best, kind, mlen = -1, None, 0
        for s in self.stops:
            p = b.find(s)
            if p >= 0 and (best < 0 or p < best):
                best, kind, mlen = p, s, len(s)
        if self.parse_tools:
            p = b.find(self.dsml_open)
            if p >= 0 and (best < 0 or p < best):
                best, kind, mlen = p, "dsml", 0
        p = b.find(self.think_end)
        if p >= 0 and (best < 0 or p < best):
            best, kind, mlen = p, "think", len(self.think_end)
        if kind is not None:
            if kind == "dsml":
                self._emit_content(b[:best].rstrip("\n"), out)
                self.buf = b[best:]
                self.state = TOOLS
            elif kind == "think":  # stray end-of-thinking marker: skipped
                self._emit_content(b[:best], out)
                self.buf = b[best + mlen:]
            else:
                self._emit_content(b[:best], out)
                self.stop_hit = kind
                self.state = FINISHED
                self.buf = ""
            return True
        if final:
            self._emit_content(b, out)
            self.buf = ""
            return False
        markers = [self.think_end, *self.stops]
        if self.parse_tools:
            markers.append(self.dsml_open)
        k = _partial_suffix(b, markers)
        body = b[:len(b) - k]
        if self.parse_tools:
            stripped = body.rstrip("\n")  # newlines right before a tool block are swallowed
        else:
            stripped = body
        self._emit_content(stripped, out)
        self.buf = b[len(stripped):]
        return False

    def _step_tools(self, out: list, final: bool) -> bool:
        b = self.buf
        st = self.state
        if st == TOOLS:
            i = b.find('invoke name="')
            closes = [(b.find(c), c) for c in self.block_closes]
            closes = [x for x in closes if x[0] >= 0]
            c = min(closes) if closes else None
            if i >= 0 and (c is None or i < c[0]):
                self.buf = b[i + 13:]
                self.state = TOOL_NAME
                self._cur_name = ""
                return True
            if c is not None:
                if self.strict and b[c[0] + len(c[1]):].strip():
                    raise ParseError("text after the tool-call block")
                self.state = FINISHED
                self.buf = ""
                return True
            if not final:
                k = _partial_suffix(b, ('invoke name="', *self.block_closes))
                self.buf = b[len(b) - k:]
            return False
        if st == TOOL_NAME:
            i = b.find('"')
            if i < 0:
                return False
            idx = len(self.calls)
            call = ParsedToolCall(self._ids(idx), b[:i])
            self.calls.append(call)
            out.append(ToolCallStart(idx, call.id, call.name))
            self.buf = b[i + 1:]
            self.state = ARGS
            self._nparams = 0
            return True
        if st == ARGS:
            i = b.find('parameter name="')
            j = b.find(self.dsml_close)
            if i >= 0 and (j < 0 or i < j):
                self.buf = b[i + 16:]
                self.state = ARG_NAME
                return True
            if j >= 0:
                self._args("}" if self._nparams else "{}", out)
                self.calls[-1].complete = True
                out.append(ToolCallEnd(len(self.calls) - 1))
                self.buf = b[j + len(self.dsml_close):]
                self.state = TOOLS
                return True
            if not final:
                k = _partial_suffix(b, ('parameter name="', self.dsml_close))
                self.buf = b[len(b) - k:]
            return False
        if st == ARG_NAME:
            i = b.find('"')
            if i < 0:
                return False
            self._args(("{" if self._nparams == 0 else ", ") + _ESC(b[:i]) + ": ", out)
            self._nparams += 1
            self.buf = b[i + 1:]
            self.state = ARG_ATTR
            return True
        if st == ARG_ATTR:
            i = b.find('string="')
            if i < 0:
                return False
            j = b.find('"', i + 8)
            if j < 0 or j + 1 >= len(b):
                return False
            val = b[i + 8:j]
            rest = b[j + 1:]
            if rest[:1] == ">":
                rest = rest[1:]
            self._attr = val
            if val == "true":
                self._args('"', out)
            elif val != "false" and self.strict:
                raise ParseError(f'parameter string attribute must be "true" or "false", got {val!r}')
            self.buf = rest
            self.state = ARG_VALUE
            return True
        if st == ARG_VALUE:
            j = b.find(self.dsml_close)
            if j >= 0:
                self._value(b[:j], out)
                if self._attr == "true":
                    self._args('"', out)
                self.buf = b[j + len(self.dsml_close):]
                self.state = ARGS
                return True
            k = 0 if final else _partial_suffix(b, (self.dsml_close,))
            self._value(b[:len(b) - k], out)
            self.buf = b[len(b) - k:]
            return False
        return False

    def _value(self, t: str, out: list) -> None:
        if not t:
            return
        if self._attr == "true":
            self._args(_ESC(t)[1:-1], out)
        elif self._attr == "false":
            self._args(t, out)
        # any other attribute value: the value is dropped (arguments stay as written so far)

    # ------------------------------------------------------------------ JSON mode
    def _json_chunk(self, text: str, out: list) -> None:
        """json_object mode. Prose before the JSON opener and after the closing fence becomes
        one space per source chunk (this is what makes JSON mode chunking-dependent)."""
        js = self.json_state
        if js == 0:
            b = self.buf + text
            for opener in ("```json\n", "```\n"):
                p = b.find(opener)
                if p >= 0:
                    self.json_state = 1
                    self.buf = ""
                    self._emit_content(" ", out) if p > 0 else None
                    self._json_body(b[p + len(opener):], out)
                    return
            ps = [p for p in (b.find("{"), b.find("[")) if p >= 0]
            if ps:
                p = min(ps)
                self.json_state = 2
                self.buf = ""
                if p > 0:
                    self._emit_content(" ", out)
                self._json_body(b[p:], out)
                return
            k = _partial_suffix(b, ("```json\n", "```\n"))
            self.buf = b[len(b) - k:]
            if len(b) - k > 0:
                self._emit_content(" ", out)
            return
        if js == 3:
            self._emit_content(" ", out)
            return
        self._json_body(self.buf + text, out)

    def _json_body(self, b: str, out: list) -> None:
        self.buf = ""
        # stop sequences apply inside the JSON
        for s in self.stops:
            p = b.find(s)
            if p >= 0:
                self._emit_content(b[:p], out)
                self.stop_hit = s
                self.state = FINISHED
                return
        if self.json_state == 1:
            p = b.find("\n```")
            if p >= 0:
                self._emit_content(b[:p], out)
                self.json_state = 3
                if b[p + 4:]:
                    self._emit_content(" ", out)
                return
            k = _partial_suffix(b, ("\n```", *self.stops))
        else:
            k = _partial_suffix(b, tuple(self.stops)) if self.stops else 0
        self._emit_content(b[:len(b) - k], out)
        self.buf = b[len(b) - k:]

    def _json_flush(self, out: list) -> None:
        if self.buf:
            if self.json_state in (1, 2):
                self._emit_content(self.buf, out)
            self.buf = ""


def parse_text(text: str, options: Optional[ParsingOptions] = None, finish_reason: str = "stop"
               ) -> ParseResult:
    p = StreamParser(options)
    p.feed(text)
    return p.finish(finish_reason)[1]
