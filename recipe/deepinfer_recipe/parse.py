"""Incremental parser for the model's output grammar (see docs/format.md, "Output").

`StreamParser(options).feed(text)` returns typed deltas. The parser reproduces the official
deepseek-recipe 0.2.0 stream processor, including how it splits deltas:

* Every fed chunk is a unit. The surviving text of one chunk between two markers becomes
  ONE delta (so `feed("a</think>b</think>c")` in content yields the deltas "b" and "c").
* Text that may still be the start of a marker (a partial marker, or newlines that may
  precede `</think>` / a DSML block) is held back; a chunk whose tail is held is held whole
  and released as its own delta once resolved.
* Markers are found by the first *completed* match (stop sequences included), newline runs
  are only droppable when they started while nothing else was held (a `\\n` that breaks a
  partial marker is plain text - the official behaviour).

The final text does not depend on the chunking (except JSON mode, where each chunk of prose
outside the JSON becomes one space); the delta boundaries do, exactly like the official.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Optional

from .options import ParsingOptions

try:
    from _json import encode_basestring as _ESC  # type: ignore
except ImportError:  # pragma: no cover
    from json.encoder import py_encode_basestring as _ESC


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
_S_THINK, _S_DSML = "\ufdd0", "\ufdd1"  # noncharacters standing for special marker tokens

# states
(REASONING, CONTENT, TOOLS, TOOL_NAME, ARGS, ARG_NAME, ARG_ATTR, ARG_VALUE, DONE, FINISHED,
 J_PRE, J_FENCE, J_BARE, J_AFTER) = range(14)
_TEXT_STATES = frozenset((REASONING, CONTENT, ARG_VALUE, J_PRE, J_FENCE, J_BARE, J_AFTER))

# marker kinds
_M_THINK, _M_DSML, _M_STOP, _M_VEND, _M_FENCE_JSON, _M_FENCE, _M_BRACE, _M_FENCE_END = range(8)


def _kmp(p: str) -> list:
    f = [0] * len(p)
    k = 0
    for i in range(1, len(p)):
        while k and p[i] != p[k]:
            k = f[k - 1]
        if p[i] == p[k]:
            k += 1
        f[i] = k
    return f


class _Lits:
    """The markers of one text state: [(literal, newline_prefixed, kind)], trigger regex."""

    __slots__ = ("lits", "has_nl", "trig", "nl_lits", "maxlen", "m")

    def __init__(self, lits):
        self.lits = lits
        self.m = [(l, nl, kind, _kmp(l)) for l, nl, kind in lits]
        self.nl_lits = [l for l, nl, _ in lits if nl]
        self.has_nl = bool(self.nl_lits)
        chars = {l[0] for l, _, _ in lits}
        if self.has_nl:
            chars.add("\n")
        self.trig = re.compile("[" + "".join(re.escape(c) for c in sorted(chars)) + "]") \
            if chars else None
        self.maxlen = max((len(l) for l, _, _ in lits), default=0)


class _Matcher:
    """One marker's progress through the held text: how many characters of ``literal`` match so far
    (``matched``, a KMP state over ``failure``), where that match starts in the held text (``start``)
    and, for a newline-prefixed marker, where the run of newlines before it starts (``newline_start``);
    -1 where there is none."""

    __slots__ = ("literal", "newline_prefixed", "kind", "failure", "matched", "start", "newline_start")

    def __init__(self, literal: str, newline_prefixed: bool, kind: int, failure: list):
        self.literal, self.newline_prefixed, self.kind, self.failure = literal, newline_prefixed, kind, failure
        self.matched, self.start, self.newline_start = 0, -1, -1

    def reset(self) -> None:
        self.matched, self.start, self.newline_start = 0, -1, -1


class StreamParser:
    """Feed model output chunks; get `ReasoningDelta` / `ContentDelta` / `ToolCall*` deltas.

    strict=False (default) never raises: malformed output yields the official package's
    result. strict=True raises `ParseError` on grammar violations (unknown `string=`
    attribute value, text after the tool-call block, a truncated tool call at finish).
    `finished` is True once nothing more can be parsed (stop sequence or closed tool block);
    `stopped` only for a stop sequence (the official processor's "finished": the engine
    should stop generating).
    """

    def __init__(self, options: Optional[ParsingOptions] = None, strict: bool = False,
                 id_factory=None, token_mode: bool = False):
        o = options or ParsingOptions()
        self.o = o
        self.strict = strict
        st = o.special_tokens
        self.token_mode = token_mode
        if token_mode:
            # Token input: a marker's special-token part only matches the special token itself
            # (fed with `feed_token(text, special=True)`); the same spelling made of ordinary
            # tokens is text. Special marker tokens travel through the matcher as noncharacters.
            D = _S_DSML
            self.think_end = _S_THINK
            self._unmap = {ord(_S_THINK): st.thinking_end, ord(_S_DSML): st.dsml}
            self._tomap = {st.thinking_end: _S_THINK, st.dsml: _S_DSML}
        else:
            D = st.dsml
            self.think_end = st.thinking_end
            self._unmap = None
        self.dsml_open = "<" + D
        self.dsml_close = "</" + D
        self.block_closes = ("</" + D + " calls>", "</" + D + "tool_calls>")
        self.stops = [s for s in o.stop_sequences if s]
        self.parse_tools = o.parse_tool_calls
        self.json_mode = o.parse_json_output
        self._ids = id_factory or self._new_id
        stops = [(s, False, _M_STOP) for s in self.stops]
        te = (self.think_end, True, _M_THINK)
        do = (self.dsml_open, True, _M_DSML)
        tl = [(self.think_end, False, _M_THINK)] + ([do] if self.parse_tools else [])
        self._L = {
            REASONING: _Lits([te, do] if self.parse_tools else [te]),
            CONTENT: _Lits(stops + [(self.think_end, False, _M_THINK)] + ([do] if self.parse_tools else [])),
            ARG_VALUE: _Lits([(self.dsml_close, False, _M_VEND)]),
            J_PRE: _Lits([("```json\n", False, _M_FENCE_JSON), ("```\n", False, _M_FENCE),
                                  ("{", False, _M_BRACE), ("[", False, _M_BRACE)] + tl),
            J_FENCE: _Lits(stops + [("\n```", False, _M_FENCE_END)]),
            J_BARE: _Lits(stops + [("\n```", False, _M_FENCE_END)]),
            J_AFTER: _Lits(tl[1:]),
        }
        self.reasoning_parts: list = []
        self.content_parts: list = []
        self.calls: list = []
        self._cargs: list = []  # argument pieces of the current call
        self.stop_hit: Optional[str] = None
        self.stopped = False
        # held text (possible marker start): string, chunk id of every char, eligible newlines
        self._held = ""
        self._hsrc: list = []
        self._ms = None  # matcher states of the current text state
        self._buf = ""  # non-emitting tool states: unconsumed tail
        self._pend: list = []  # deltas not released yet: [kind, cid, delta]
        self._last = None  # (kind, cid) of the delta that text may still be appended to
        self._cid = 0
        self._strip = True
        self._attr = ""
        self._nparams = 0
        self._name = ""
        stage = o.thinking_initial_stage
        if o.starts_in_tool_calls and self.parse_tools:
            self.state = TOOLS
            self._strip = False
        elif stage in ("reasoning_start", "reasoning_continuation"):
            self.state = REASONING
            self._strip = stage == "reasoning_start"
        else:
            self.state = CONTENT
            self._strip = stage != "content_continuation"
        if self.state == CONTENT and self.json_mode:
            self.state = J_PRE

    def _new_id(self, index: int) -> str:
        return f"call_{index:02d}_" + "".join(random.choices(_ALNUM, k=24))

    # ------------------------------------------------------------------ public
    @property
    def finished(self) -> bool:
        return self.state >= DONE and self.state <= FINISHED

    def feed(self, text: str) -> list:
        """Process one chunk of output (one unit for delta splitting); returns the deltas
        that are resolved."""
        st = self.state
        if not text or st == FINISHED or st == DONE:
            return []
        self._cid += 1
        # fast path: plain text in a text state with nothing held
        if not self._held and st in (REASONING, CONTENT):
            L = self._L[st]
            if L.trig.search(text) is None:
                if self._strip:
                    text = text.lstrip("\n")
                    if not text:
                        return []
                    self._strip = False
                self._last = None
                if self._unmap is not None:
                    text = text.translate(self._unmap)
                if st == REASONING:
                    self.reasoning_parts.append(text)
                    d = ReasoningDelta(text)
                else:
                    self.content_parts.append(text)
                    d = ContentDelta(text)
                if self._pend:
                    out = [p[2] for p in self._pend]
                    self._pend = []
                    out.append(d)
                    return out
                return [d]
        pos, n = 0, len(text)
        while pos < n:
            st = self.state
            if st in _TEXT_STATES:
                pos = self._text(text, pos)
            elif st == FINISHED or st == DONE:
                break
            else:
                pos = self._tools(text, pos)
        return self._release()

    def feed_token(self, text: str, special: bool = False) -> list:
        """Token input (parser built with token_mode=True): `text` is the decoded token,
        `special` whether it is a special token. Only special `</think>` / `｜DSML｜` tokens
        act as markers."""
        if special and self._unmap is not None:
            text = self._tomap.get(text, text)
        elif self._unmap is not None and ("\ufdd0" in text or "\ufdd1" in text):
            text = text.replace("\ufdd0", "").replace("\ufdd1", "")
        return self.feed(text)

    def finish(self, finish_reason: str = "stop") -> tuple:
        """End of output: flush held-back text. -> (deltas, ParseResult)."""
        if self._held:
            t, src = self._held, self._hsrc
            self._held, self._hsrc, self._ms = "", [], None
            self._emit_src(t, src)
        if self.calls and not self.calls[-1].complete:
            self.calls[-1].arguments = "".join(self._cargs)
        out = [p[2] for p in self._pend]
        self._pend = []
        if self.strict and self.calls and not self.calls[-1].complete:
            raise ParseError("output ended inside a tool call")
        if self.stop_hit is not None:
            fr = "stop"
        elif finish_reason != "stop":
            fr = finish_reason
        elif self.calls:
            fr = "tool_calls"
        else:
            fr = "stop"
        res = ParseResult("".join(self.reasoning_parts) if self.o.thinking_initial_stage in
                          ("reasoning_start", "reasoning_continuation") else None,
                          "".join(self.content_parts), self.calls, fr, self.stop_hit)
        return out, res

    # ------------------------------------------------------------------ output
    def _release(self) -> list:
        p = self._pend
        if not p:
            return []
        if self._held:
            m = self._hsrc[0]
            k = 0
            while k < len(p) and p[k][1] < m:
                k += 1
            out = [x[2] for x in p[:k]]
            del p[:k]
            return out
        self._pend = []
        return [x[2] for x in p]

    def _emit(self, t: str, cid: int) -> None:
        """Text of the current text state from chunk `cid`."""
        st = self.state
        if self._unmap is not None:
            t = t.translate(self._unmap)
        if self._strip:
            t = t.lstrip("\n")
            if not t:
                return
            self._strip = False
        elif not t:
            return
        key = (st, cid)
        if st == REASONING:
            self.reasoning_parts.append(t)
            if self._last == key:
                self._pend[-1][2].text += t
            else:
                self._pend.append([st, cid, ReasoningDelta(t)])
                self._last = key
        elif st == CONTENT or st == J_FENCE or st == J_BARE:
            self.content_parts.append(t)
            if self._last == key:
                self._pend[-1][2].text += t
            else:
                self._pend.append([st, cid, ContentDelta(t)])
                self._last = key
        elif st == ARG_VALUE:
            if self._attr == "true":
                t = _ESC(t)[1:-1]
            elif self._attr != "false":
                return
            self._cargs.append(t)
            if self._last == key:
                self._pend[-1][2].text += t
            else:
                self._pend.append([st, cid, ToolCallArgsDelta(len(self.calls) - 1, t)])
                self._last = key
        else:  # J_PRE / J_AFTER: each chunk of prose becomes one space
            if self._last != key:
                self.content_parts.append(" ")
                self._pend.append([st, cid, ContentDelta(" ")])
                self._last = key

    def _emit_src(self, t: str, src: list) -> None:
        i, n = 0, len(t)
        while i < n:
            c = src[i]
            j = i + 1
            while j < n and src[j] == c:
                j += 1
            self._emit(t[i:j], c)
            i = j

    def _struct(self, d) -> None:
        self._pend.append([-1, self._cid, d])
        self._last = None

    def _arg(self, t: str) -> None:
        self._cargs.append(t)
        self._struct(ToolCallArgsDelta(len(self.calls) - 1, t))

    # ------------------------------------------------------------------ text states
    def _text(self, text: str, pos: int) -> int:
        """Run the marker matchers of the current text state over text[pos:].

        Every marker has its own matcher (KMP over the literal; newline-prefixed markers also
        count a run of newlines right before the literal). A newline that breaks a partial
        literal does not start a newline run for that marker (the official behaviour). The
        held text starts where the earliest live matcher started; the first marker to
        complete wins (ties: the one that started first)."""
        L = self._L[self.state]
        trig = L.trig
        ms = self._ms
        if ms is None:
            ms = self._ms = [_Matcher(*m) for m in L.m]
        cid = self._cid
        n = len(text)
        H, src = self._held, self._hsrc
        while pos < n:
            if not H:
                m = trig.search(text, pos) if trig is not None else None
                if m is None:
                    self._held, self._hsrc = "", []
                    self._emit(text[pos:], cid)
                    return n
                i = m.start()
                if i > pos:
                    self._emit(text[pos:i], cid)
                pos = i
                src = []
            c = text[pos]
            pos += 1
            p = len(H)
            H += c
            src.append(cid)
            best = -1
            bm = None
            live = p + 1
            for mt in ms:
                k, nls = mt.matched, mt.newline_start
                if k == 0 and c == "\n" and mt.newline_prefixed:
                    if nls < 0:
                        mt.newline_start = nls = p
                    if nls < live:
                        live = nls
                    continue
                lit = mt.literal
                k0 = k
                if k:
                    fail = mt.failure
                    while k and lit[k] != c:
                        k = fail[k - 1]
                if lit[k] == c:
                    k += 1
                if k == 0:
                    mt.reset()
                    continue
                if k0 == 0:
                    start = p
                elif k <= k0:
                    start = p - k + 1
                    nls = mt.newline_start = -1
                else:
                    start = mt.start
                mt.matched, mt.start = k, start
                st0 = nls if nls >= 0 else start
                if k == len(lit):
                    if bm is None or st0 < best:
                        best, bm = st0, mt
                elif st0 < live:
                    live = st0
            if bm is not None:
                for mt in ms:
                    mt.reset()
                self._held, self._hsrc = "", []
                if best:
                    self._emit_src(H[:best], src[:best])
                self._last = None
                self._ms = None
                self._marker(bm.kind, bm.literal)
                return pos
            if p == 0 and c == "\n" and self._strip:
                # leading newlines of a section are dropped before any marker can use them
                for mt in ms:
                    mt.reset()
                H, src = "", []
                continue
            if live:
                self._emit_src(H[:live], src[:live])
                H = H[live:]
                src = src[live:]
                for mt in ms:
                    if mt.start >= 0:
                        mt.start -= live
                    if mt.newline_start >= 0:
                        mt.newline_start -= live
        self._held, self._hsrc = H, src
        return n

    def _marker(self, kind: int, lit: str) -> None:
        st = self.state
        if kind == _M_STOP:
            self.stop_hit = lit
            self.stopped = True
            self.state = FINISHED
        elif kind == _M_THINK:
            if st == REASONING:
                self.state = CONTENT if not self.json_mode else J_PRE
                self._strip = True
            else:  # a stray end-of-thinking marker in content is dropped
                self._strip = False
        elif kind == _M_DSML:
            self.state = TOOLS
            self._buf = ""
        elif kind == _M_VEND:
            if self._attr == "true":
                self._arg('"')
            self.state = ARGS
            self._buf = ""
        elif kind == _M_FENCE_JSON or kind == _M_FENCE:
            self.state = J_FENCE
            self._strip = False
        elif kind == _M_BRACE:
            self.content_parts.append(lit)
            self._struct(ContentDelta(lit))
            self.state = J_BARE
            self._strip = False
        elif kind == _M_FENCE_END:
            self.state = J_AFTER
            self._strip = False

    # ------------------------------------------------------------------ tool-call states
    def _find(self, b: str, markers) -> tuple:
        """Earliest completed marker in b -> (end, marker) or (-1, None)."""
        best = (-1, None)
        for m in markers:
            p = b.find(m)
            if p >= 0:
                end = p + len(m)
                if best[0] < 0 or end < best[0]:
                    best = (end, m)
        return best

    def _tools(self, text: str, pos: int) -> int:
        """One step in a tool-call state; returns the new position in `text`."""
        st = self.state
        if st == ARG_NAME:  # raw copy up to the first space
            i = text.find(" ", pos)
            if i < 0:
                self._name_text(text[pos:])
                return len(text)
            self._name_text(text[pos:i])
            self._arg(": ")
            self.state = ARG_ATTR
            self._buf = ""
            return i + 1
        if st == TOOL_NAME:
            i = text.find('"', pos)
            if i < 0:
                self._name += text[pos:]
                return len(text)
            self._name += text[pos:i]
            if self._unmap is not None:
                self._name = self._name.translate(self._unmap)
            idx = len(self.calls)
            call = ParsedToolCall(self._ids(idx), self._name)
            self.calls.append(call)
            self._cargs = []
            self._struct(ToolCallStart(idx, call.id, call.name))
            self.state = ARGS
            self._nparams = 0
            self._buf = ""
            return i + 1
        base = self._buf
        b = base + text[pos:]
        if st == TOOLS:
            end, m = self._find(b, ('invoke name="',) + self.block_closes)
            if m is None:
                self._buf = b[-24:]
                return len(text)
            if m == 'invoke name="':
                self.state = TOOL_NAME
                self._name = ""
            else:
                if self.strict and b[end:].strip():
                    raise ParseError("text after the tool-call block")
                self.state = DONE
        elif st == ARGS:
            end, m = self._find(b, ("parameter name=", self.dsml_close))
            if m is None:
                self._buf = b[-24:]
                return len(text)
            if m == self.dsml_close:
                self._arg("}" if self._nparams else "{}")
                self.calls[-1].complete = True
                self._struct(ToolCallEnd(len(self.calls) - 1))
                self.calls[-1].arguments = "".join(self._cargs)
                self.state = TOOLS
            else:
                self._arg("{" if self._nparams == 0 else ", ")
                self._nparams += 1
                self.state = ARG_NAME
        else:  # ARG_ATTR
            end, m = self._find(b, ('string="true">', 'string="false">'))
            if self.strict and m is None:
                mm = re.search(r'string="([^"]*)"', b)
                if mm and mm.group(1) not in ("true", "false"):
                    raise ParseError(f'parameter string attribute must be "true" or "false", '
                                     f'got {mm.group(1)!r}')
            if m is None:
                self._buf = b[-24:]
                return len(text)
            self._attr = "true" if m == 'string="true">' else "false"
            if self._attr == "true":
                self._arg('"')
            self.state = ARG_VALUE
        self._buf = ""
        return pos + max(0, end - len(base))

    def _name_text(self, t: str) -> None:
        if not t:
            return
        if self._unmap is not None:
            t = t.translate(self._unmap)
        self._cargs.append(t)
        key = (ARG_NAME, self._cid)
        if self._last == key:
            self._pend[-1][2].text += t
        else:
            self._pend.append([ARG_NAME, self._cid, ToolCallArgsDelta(len(self.calls) - 1, t)])
            self._last = key

    def arguments(self, index: int) -> str:
        return self.calls[index].arguments


def parse_text(text: str, options: Optional[ParsingOptions] = None, finish_reason: str = "stop"
               ) -> ParseResult:
    p = StreamParser(options)
    p.feed(text)
    return p.finish(finish_reason)[1]
