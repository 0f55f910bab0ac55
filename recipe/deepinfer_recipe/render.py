"""Prompt rendering for DeepSeek V4 and V4.1 (see docs/format.md).

A renderer turns a `Conversation` into a `RenderedPrompt`: the prompt text plus the list of
segments with a flag saying which ones are template special tokens (needed for encoding).
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Optional

from .conversation import Conversation, ModelVersion
from .jsonfmt import dumps_named_lines, dumps_v4, dumps_v41
from .tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens

EFFORT_V4 = {
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
             "You MUST be very thorough in your thinking and comprehensively decompose the problem "
             "to resolve the root cause, rigorously stress-testing your logic against all potential "
             "paths, edge cases, and adversarial scenarios.\n"
             "Explicitly write out your entire deliberation process, documenting every intermediate "
             "step, considered alternative, and rejected hypothesis to ensure absolutely no "
             "assumption is left unchecked.\n\n"),
    "max": ("Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
            "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
            "exhaustively decompose the problem into its most fundamental components, trace every "
            "causal chain to its root, and resolve the underlying cause rather than any surface "
            "symptom.\n"
            "Do not stop reasoning until you have independently verified the solution from "
            "multiple angles and are certain that no assumption remains unchecked and no error "
            "remains undiscovered.\n\n"),
}
EFFORT_V4["xhigh"] = EFFORT_V4["high"]
EFFORT_V4[None] = EFFORT_V4["high"]
EFFORT_V4["low"] = ""

_V41_EFFORT_VALUE = {"low": 50, "high": 75, "xhigh": 75, None: 75, "max": 100}
EFFORT_V41 = {k: f"Reasoning Effort: {v} (range 1-100, the higher the value, the more thorough "
                 "the reasoning)\n\n" for k, v in _V41_EFFORT_VALUE.items()}

JSON_OBJECT_V4 = ("You are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
                  "Reply with JSON object ONLY.")
SCHEMA_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

# The tool prompt. `{D}` is the DSML special token, `{T}`/`{/T}` the thinking markers; `{calls}`,
# `{invoke}`, `{param}` the version's tag names.
_TOOL_PROMPT = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    "invoke tools by writing a \"<{D}{calls}>\" block like the following:\n\n"
    "<{D}{calls}>\n<{D}{invoke} name=\"$TOOL_NAME\">\n"
    "<{D}{param} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{D}{param}>\n"
    "...\n</{D}{invoke}>\n<{D}{invoke} name=\"$TOOL_NAME2\">\n...\n</{D}{invoke}>\n</{D}{calls}>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by {T}), you MUST output your complete reasoning "
    "inside {T}...{/T} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {/T} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)


@dataclass(slots=True)
class RenderedPrompt:
    """`prompt` text; `segments`/`special` the pieces it is made of and which are special
    tokens; `images` the image parts in placeholder order."""

    segments: list
    special: list
    images: list = field(default_factory=list)
    _prompt: Optional[str] = None

    @property
    def prompt(self) -> str:
        if self._prompt is None:
            self._prompt = "".join(self.segments)
        return self._prompt

    @property
    def special_ranges(self) -> list:
        """Half-open code-point ranges of the special-token spans (like the official API)."""
        out, pos = [], 0
        for t, s in zip(self.segments, self.special):
            if s:
                out.append((pos, pos + len(t)))
            pos += len(t)
        return out


class _Writer:
    __slots__ = ("segs", "spec", "images", "st", "no_images")

    def __init__(self, st: SpecialTokens):
        self.segs: list = []
        self.spec: list = []
        self.images: list = []
        self.st = st
        self.no_images = False

    def text(self, t: str) -> None:
        if t:
            self.segs.append(t)
            self.spec.append(False)

    def special(self, t: str) -> None:
        self.segs.append(t)
        self.spec.append(True)

    def parts(self, parts: list) -> None:
        for p in parts:
            if p.__class__ is str:
                if p:
                    self.segs.append(p)
                    self.spec.append(False)
            elif self.no_images:  # V4 has no vision input
                self.segs.append("[Unsupported Image]")
                self.spec.append(False)
            else:
                self.images.append(p)
                self.segs.append(self.st.image)
                self.spec.append(True)

    def grounded(self, t: str) -> None:
        """Assistant text: grounding tokens typed in it are promoted to special tokens."""
        gs = _info(self.st).grounding
        if "<｜" not in t and not any(g in t for g in gs):
            self.text(t)
            return
        i = 0
        n = len(t)
        start = 0
        while i < n:
            for g in gs:
                if t.startswith(g, i):
                    self.text(t[start:i])
                    self.special(g)
                    i += len(g)
                    start = i
                    break
            else:
                i += 1
        self.text(t[start:])


class _Style:
    """What differs between V4 and V4.1 in tool markup and JSON spelling."""

    def __init__(self, v41: bool):
        self.v41 = v41
        self.calls = " calls" if v41 else "tool_calls"
        self.invoke = " invoke" if v41 else "invoke"
        self.param = " parameter" if v41 else "parameter"
        self.dumps = dumps_v41 if v41 else dumps_v4
        # DSML block pieces
        self.next_sep = "\n<" if v41 else "<"  # before a second call / parameter
        self.par_open = self.param + ' name="'
        self.par_close = self.param + ">" if v41 else self.param + ">\n"
        self.end_tag = "\n</" if v41 else "</"
        self.inv_close = self.invoke + ">" if v41 else self.invoke + ">\n"
        self.calls_open = self.calls + ">\n"
        self.calls_close = self.calls + ">"


_STYLE_V4 = _Style(False)
_STYLE_V41 = _Style(True)


class _StInfo:
    """What the renderer derives from one SpecialTokens value (computed once, cached)."""

    __slots__ = ("st", "grounding", "plain_ok", "tool_prompt")

    def __init__(self, st: SpecialTokens):
        self.st = st
        self.grounding = st.grounding
        # True when text without "<｜" cannot hold a grounding token (the default spellings)
        self.plain_ok = all("<｜" in g for g in self.grounding)
        self.tool_prompt: dict = {}


_INFO: dict = {}


def _info(st: SpecialTokens) -> _StInfo:
    i = _INFO.get(id(st))
    if i is None or i.st is not st:
        if len(_INFO) > 64:
            _INFO.clear()
        i = _INFO[id(st)] = _StInfo(st)
    return i


def _tool_prompt(w: _Writer, tools: list, style: _Style) -> None:
    st = w.st
    schemas = dumps_named_lines(
        [{"name": t.name, "description": t.description or "",
          "parameters": t.parameters if t.parameters is not None else {}}
         for t in tools if not t.defer_loading], not style.v41)
    cache = _info(st).tool_prompt
    pieces = cache.get(style.v41)
    if pieces is None:
        tmpl = _TOOL_PROMPT.replace("{calls}", style.calls).replace("{invoke}", style.invoke) \
            .replace("{param}", style.param)
        pieces = []
        # split on the three markers
        for tok in re.split(r"(\{D\}|\{T\}|\{/T\}|\{schemas\})", tmpl):
            if tok == "{D}":
                pieces.append((st.dsml, True))
            elif tok == "{T}":
                pieces.append((st.thinking_start, True))
            elif tok == "{/T}":
                pieces.append((st.thinking_end, True))
            elif tok == "{schemas}":
                pieces.append((None, False))
            elif tok:
                pieces.append((tok, False))
        cache[style.v41] = pieces
    for t, s in pieces:
        if t is None:
            w.text(schemas)
        elif s:
            w.special(t)
        else:
            w.text(t)


def _updated_tools(w: _Writer, tools: list, style: _Style) -> None:
    """V4.1: a system message carrying tools appends their schemas (deferred tools included,
    missing parameters written as null)."""
    w.text("\n\n### Updated Tool Schemas\n\n" + dumps_named_lines(
        [{"name": t.name, "description": t.description or "", "parameters": t.parameters}
         for t in tools], not style.v41))


def _dsml_block(w: _Writer, calls: list, style: _Style) -> None:
    """`\\n\\n<DSML calls>...</DSML calls>` for the tool calls of one assistant message.

    Plain text and the DSML token alternate strictly, so the plain pieces between two DSML
    tokens are written as one segment."""
    D = w.st.dsml
    dumps = style.dumps
    nxt = style.next_sep
    par_open, par_close, end_tag = style.par_open, style.par_close, style.end_tag
    out: list = ["\n\n<", D]
    cur = style.calls_open
    sep = "<"
    for c in calls:
        out += (cur + sep, D)
        sep = nxt
        cur = f'{style.invoke} name="{c.name}">\n'
        text = c.arguments
        try:
            obj = _loads(text)
        except (ValueError, TypeError):
            obj = None
        psep = "<"
        for k, v in (obj.items() if obj.__class__ is dict else (("arguments", text),)):
            out += (cur + psep, D)
            psep = nxt
            if v.__class__ is str:
                out += (par_open + k + '" string="true">' + v + "</", D)
            else:
                out += (par_open + k + '" string="false">' + dumps(v) + "</", D)
            cur = par_close
        out += (cur + end_tag, D)
        cur = style.inv_close
    out += (cur + end_tag, D, style.calls_close)
    w.segs += out
    w.spec += _FT * (len(out) >> 1)
    w.spec.append(False)


_FT = [False, True]
_loads = json.loads


def _tool_result_parts(m) -> list:
    return ["<tool_result>", *m.parts, "</tool_result>"]


def _order_v4(msgs: list) -> list:
    """V4: each assistant's calls sorted by id; the following N messages (N = #calls) sorted
    with results (by tool_call_id) before other messages."""
    out = list(msgs)
    i = 0
    n = len(out)
    while i < n:
        m = out[i]
        if m.role == "assistant" and m.tool_calls:
            calls = m.tool_calls
            if len(calls) > 1:
                m = copy.copy(m)
                m.tool_calls = sorted(calls, key=lambda c: c.id)
                out[i] = m
            k = len(calls)
            window = out[i + 1:i + 1 + k]
            if len(window) > 1:
                window.sort(key=lambda x: (0, x.tool_call_id or "") if x.role == "tool" else (1, ""))
                out[i + 1:i + 1 + k] = window
            i += 1 + len(window)
        else:
            i += 1
    return out


def _order_v41(msgs: list) -> list:
    """V4.1: in each run of user/tool messages after an assistant with calls, results are
    reordered to the order of that assistant's calls (unknown ids first)."""
    out = list(msgs)
    i = 0
    n = len(out)
    while i < n:
        m = out[i]
        if m.role == "assistant" and m.tool_calls:
            j = i + 1
            while j < n and out[j].role in ("user", "tool"):
                j += 1
            if j - i > 2:
                run = out[i + 1:j]
                order = {c.id: k for k, c in enumerate(m.tool_calls)}
                big = len(order) + 1
                run.sort(key=lambda x: order.get(x.tool_call_id, -1) if x.role == "tool" else big)
                out[i + 1:j] = run
            i = j
        else:
            i += 1
    return out


def render_conversation(conv: Conversation, version: ModelVersion,
                        special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> RenderedPrompt:
    if version is ModelVersion.V41 or version == "DeepSeek-V4.1-Flash":
        return _render_v41(conv, special_tokens)
    return _render_v4(conv, special_tokens)


def _as_role(m, role: str):
    m = copy.copy(m)
    m.role = role
    return m


def _rendered_tools(conv: Conversation) -> list:
    if conv.tool_choice == "none" or not conv.tools:
        return []
    return conv.tools


UNSUPPORTED_IMAGE = "[Unsupported Image]"


def _text_v4(parts: list) -> str:
    """V4 has no vision input: an image is spelled as a visible stub, so the model is told
    something was there rather than seeing a placeholder it was never trained to resolve."""
    return "".join(p if p.__class__ is str else UNSUPPORTED_IMAGE for p in parts)


def _render_v4(conv: Conversation, st: SpecialTokens) -> RenderedPrompt:
    style = _STYLE_V4
    w = _Writer(st)
    w.no_images = True
    w.special(st.bos)
    thinking = conv.thinking_mode
    tools = _rendered_tools(conv)
    if thinking:
        w.text(EFFORT_V4[conv.reasoning_effort])
    msgs = conv.messages
    sys_texts = [_text_v4(m.parts) for m in msgs if m.role == "system" and m.parts and m.content]
    sys_text = "\n\n".join(sys_texts)
    extra = sys_text or tools or conv.response_format != "text"
    if extra:
        w.text(sys_text)
        if tools:
            w.text("\n\n")
            _tool_prompt(w, tools, style)
        if conv.response_format == "json_object":
            w.text("\n\n" + JSON_OBJECT_V4)
        elif conv.response_format == "json_schema":
            w.text("\n\n" + SCHEMA_HEADER + style.dumps(conv.response_schema))
    # V4 has no developer role: a developer message is user text
    body = [m if m.role != "developer" else _as_role(m, "user") for m in msgs if m.role != "system"]
    body = _order_v4(body)
    _render_turns(w, body, thinking, bool(tools), style, v41=False,
                  required=bool(tools) and conv.tool_choice == "required")
    return RenderedPrompt(w.segs, w.spec, w.images)


def _render_v41(conv: Conversation, st: SpecialTokens) -> RenderedPrompt:
    style = _STYLE_V41
    w = _Writer(st)
    w.special(st.bos)
    thinking = conv.thinking_mode
    tools = _rendered_tools(conv)
    msgs = [m if m.role != "developer" else _as_role(m, "system") for m in conv.messages]
    first_sys = bool(msgs) and msgs[0].role == "system"
    # the effort line alone does not open a system block for a conversation with no messages
    need_sys = first_sys or (thinking and bool(msgs)) or bool(tools) or \
        conv.response_format != "text"
    start = 0
    if need_sys:
        w.special(st.system)
        if thinking:
            w.text(EFFORT_V41[conv.reasoning_effort])
        if first_sys:
            w.parts(msgs[0].parts)
            start = 1
        if tools:
            w.text("\n\n")
            _tool_prompt(w, tools, style)
        if first_sys and msgs[0].tools:
            _updated_tools(w, msgs[0].tools, style)
        if conv.response_format == "json_object":
            w.text("\n\n" + SCHEMA_HEADER + '{"type": "json_object"}')
        elif conv.response_format == "json_schema":
            w.text("\n\n" + SCHEMA_HEADER + style.dumps(conv.response_schema))
    body = msgs[start:]
    body = _order_v41(body)
    _render_turns(w, body, thinking, bool(tools), style, v41=True,
                  required=bool(tools) and conv.tool_choice == "required")
    return RenderedPrompt(w.segs, w.spec, w.images)


def _render_turns(w: _Writer, body: list, thinking: bool, keep_reasoning: bool, style: _Style,
                  v41: bool, required: bool = False) -> None:
    st = w.st
    info = _info(st)
    plain_ok = info.plain_ok
    segs, spec = w.segs, w.spec
    sa, pa = segs.append, spec.append
    USER, ASSISTANT, EOS = st.user, st.assistant, st.eos
    T_START, T_END = st.thinking_start, st.thinking_end
    prev = None
    user_text = False  # V4: the current run of user messages has written some text
    last = len(body) - 1
    for idx, m in enumerate(body):
        role = m.role
        if role == "tool" or role == "user":
            parts = m.parts
            # Consecutive user/tool messages make one turn, pieces joined by a blank line.
            # V4.1 joins every message, empty ones too; V4 first merges each run of user
            # messages, skipping the empty ones, so an empty message adds a separator only
            # where it is the whole user piece after a tool result.
            if prev == "user" or prev == "tool":
                if v41 or role == "tool" or prev == "tool":
                    sa("\n\n")
                    pa(False)
                    user_text = role == "user" and any(parts)
                elif not any(parts):
                    continue
                else:
                    if user_text:
                        sa("\n\n")
                        pa(False)
                    user_text = True
            else:
                sa(USER)
                pa(True)
                user_text = role == "user" and any(parts)
            if role == "tool":
                if len(parts) == 1 and parts[0].__class__ is str:
                    sa("<tool_result>" + parts[0] + "</tool_result>")
                    pa(False)
                else:
                    w.parts(_tool_result_parts(m))
            elif len(parts) == 1 and parts[0].__class__ is str:
                if parts[0]:
                    sa(parts[0])
                    pa(False)
            else:
                w.parts(parts)
        elif role == "assistant":
            is_prefix = m.prefix and idx == last
            if is_prefix:
                think_part = thinking
            else:
                think_part = thinking and keep_reasoning
            sa(ASSISTANT)
            pa(True)
            if think_part:
                sa(T_START)
                pa(True)
                rc = m.reasoning_content
                if rc:
                    if plain_ok and "<｜" not in rc:
                        sa(rc)
                        pa(False)
                    else:
                        w.grounded(rc)
                if is_prefix and not m.content and not m.tool_calls:
                    return
            sa(T_END)
            pa(True)
            for p in m.parts:
                if p.__class__ is str:
                    if p:
                        if plain_ok and "<｜" not in p:
                            sa(p)
                            pa(False)
                        else:
                            w.grounded(p)
                else:  # V4.1 refuses assistant images at conversion
                    w.text(UNSUPPORTED_IMAGE)
            if m.tool_calls:
                _dsml_block(w, m.tool_calls, style)
            if is_prefix:
                return
            sa(EOS)
            pa(True)
        elif role == "latest_reminder":
            if v41 and prev == "latest_reminder":
                continue
            w.special(st.latest_reminder)
            w.parts(m.parts)
        elif role == "system":  # V4.1 mid-conversation system message
            w.special(st.system)
            w.parts(m.parts)
            if m.tools:
                _updated_tools(w, m.tools, style)
        prev = role
    w.special(st.assistant)
    w.special(st.thinking_start if thinking else st.thinking_end)
    if required:
        w.text("\n\n<")
        w.special(st.dsml)
        w.text(style.calls + ">\n")
