"""Reasoning and tool-call parsers ``deepinfer``: vLLM's parser interfaces over deepinfer_recipe's StreamParser.

vLLM runs the reasoning parser first (thinking vs answer) and hands the answer text to the tool parser
(DSML tool calls vs content). Both feed the recipe's incremental parser, whose result does not depend on how
the output is chunked, so streamed and non-streamed responses agree. Whether the output starts inside the
thinking block is read from the prompt: it ends with ``<think>`` when thinking is on and ``</think>`` when off.
vLLM shows the prompt to the reasoning parser for Chat Completions and streamed Responses only; a non-streamed
Responses answer is parsed knowing just the chat-template kwargs, so the parser starts from their thinking
switch, which is what the recipe renders the prompt's end from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from deepinfer_recipe import ParsingOptions, StreamParser
from deepinfer_recipe.parse import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.reasoning import ReasoningParser
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from .thinking import thinking_switch

THINK_START, THINK_END = "<think>", "</think>"


def last_marker(ids: Sequence[int], start_id: int, end_id: int) -> int | None:
    for token in reversed(ids):
        if token in (start_id, end_id):
            return token
    return None


class DeepInferReasoningParser(ReasoningParser):
    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.start_id, self.end_id = self.vocab[THINK_START], self.vocab[THINK_END]
        # the recipe thinks unless told not to
        self.starts_in_reasoning = thinking_switch(kwargs.get("chat_template_kwargs")) is not False
        self.stream: StreamParser | None = None

    @property
    def reasoning_start_str(self) -> str:
        return THINK_START

    @property
    def reasoning_end_str(self) -> str:
        return THINK_END

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True once the last thinking marker is ``</think>`` (earlier turns hold complete think blocks)."""
        ended = last_marker(input_ids, self.start_id, self.end_id) != self.start_id
        self.starts_in_reasoning = not ended
        return ended

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        return self.end_id in delta_ids

    def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        self.is_reasoning_end(prompt_token_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.end_id in input_ids:
            return input_ids[len(input_ids) - input_ids[::-1].index(self.end_id):]
        return [] if self.starts_in_reasoning else input_ids

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        if not self.starts_in_reasoning:
            return 0
        return list(token_ids).index(self.end_id) if self.end_id in token_ids else len(token_ids)

    def _parser(self) -> StreamParser:
        stage = "reasoning_start" if self.starts_in_reasoning else None
        return StreamParser(ParsingOptions(parse_tool_calls=False, thinking_initial_stage=stage))

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        parser = self._parser()
        deltas = parser.feed(model_output)
        deltas += parser.finish("stop")[0]
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        return (reasoning if self.starts_in_reasoning else None), (content or None)

    def extract_reasoning_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                    current_token_ids, delta_token_ids) -> DeltaMessage | None:
        if self.stream is None:
            self.stream = self._parser()
        deltas = self.stream.feed(delta_text)
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)


class DeepInferToolParser(ToolParser):
    """DSML tool calls (V4 and V4.1 spellings) -> OpenAI tool calls; arguments arrive as JSON text.

    ``tool_choice`` "required" or a named function makes the prompt end inside the tool-call block (the
    recipe renders the opener), so parsing starts there, and the call is constrained through vLLM's
    structured-output backend to well-formed DSML whose parameters follow each tool's JSON schema
    (``dsml_calls_regex``). With ``tool_choice`` "auto" the model may answer in prose, so nothing is forced.
    """

    supports_required_and_named = False

    def __init__(self, tokenizer, tools=None):
        super().__init__(tokenizer, tools)
        self.stream: StreamParser | None = None

    def adjust_request(self, request):
        tools = forced_tools(request)
        if tools is not None:
            parallel = getattr(request, "parallel_tool_calls", True) is not False
            request.structured_outputs = StructuredOutputsParams(regex=dsml_calls_regex(tools, parallel))
            if hasattr(request, "response_format"):
                request.response_format = None
        return request

    @staticmethod
    def _parser(request) -> StreamParser:
        return StreamParser(ParsingOptions(parse_tool_calls=True, thinking_initial_stage=None,
                                           starts_in_tool_calls=forced_tools(request) is not None))

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        parser = self._parser(request)
        parser.feed(model_output)
        _, result = parser.finish("stop")
        calls = [ToolCall(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in result.tool_calls]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls,
                                            content=result.content or None)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request) -> DeltaMessage | None:
        if self.stream is None:
            self.stream = self._parser(request)
        content, calls = [], []
        for delta in self.stream.feed(delta_text):
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
            elif isinstance(delta, ToolCallStart):
                calls.append(DeltaToolCall(index=delta.index, id=delta.id, type="function",
                                           function=DeltaFunctionCall(name=delta.name, arguments="")))
            elif isinstance(delta, ToolCallArgsDelta):
                calls.append(DeltaToolCall(index=delta.index, function=DeltaFunctionCall(arguments=delta.text)))
        if not content and not calls:
            return None
        return DeltaMessage(content="".join(content) or None, tool_calls=calls)


def _function(tool) -> dict:
    tool = tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)
    return tool.get("function", tool)


def forced_tools(request) -> list[dict] | None:
    """The tools a call must be made to (tool_choice "required" or a named function), else None."""
    tools = [_function(t) for t in (getattr(request, "tools", None) or [])]
    choice = getattr(request, "tool_choice", None)
    if hasattr(choice, "model_dump"):
        choice = choice.model_dump()
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools
    name = (choice.get("function") or choice).get("name") if isinstance(choice, dict) else None
    named = [t for t in tools if t.get("name") == name]
    return named or None


_JSON_SCALAR = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "boolean": r"(true|false)",
    "null": r"null",
}
_TEXT = r"([^<]|<[^/])*"  # a parameter value may hold '<' but not a closing tag


def _parameter_regex(name: str, schema: dict) -> str:
    kind = schema.get("type")
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        value, is_string = "(" + "|".join(re.escape(v) for v in schema["enum"]) + ")", True
    elif kind == "string" and "maxLength" in schema:
        value, is_string = f"[^<]{{{schema.get('minLength', 0)},{schema['maxLength']}}}", True
    elif kind == "string":
        value, is_string = _TEXT, True
    else:
        value, is_string = _JSON_SCALAR.get(kind, _TEXT), False
    flag = "true" if is_string else "false"
    return (re.escape(f'<｜DSML｜ parameter name="{name}" string="{flag}">') + value
            + re.escape("</｜DSML｜ parameter>"))


def _invoke_regex(function: dict) -> str:
    """V4.1 layout: ``invoke…>`` then each parameter on its own line, then ``\\n</…invoke>``; a call without
    arguments is ``invoke…>\\n\\n</…invoke>``."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    lines = []
    for name, prop in properties.items():
        line = r"\n" + _parameter_regex(name, prop if isinstance(prop, dict) else {})
        lines.append(f"({line})" if name in required else f"({line})?")
    body = "".join(lines)
    if not required:
        body = f"({body}|" + r"\n)" if body else r"\n"
    head = re.escape(f'<｜DSML｜ invoke name="{function["name"]}">')
    return head + body + r"\n" + re.escape("</｜DSML｜ invoke>")


def dsml_calls_regex(tools: list[dict], parallel: bool = True) -> str:
    """What may follow the recipe's ``<｜DSML｜ calls>\\n`` opener: one or more V4.1 invokes of the given tools,
    parameters in schema order (optional ones may be left out), scalar values typed by the schema, then the
    closing tag (exactly one invoke unless ``parallel``). Object and array values are only kept free of closing
    tags (not schema-checked)."""
    invoke = "(" + "|".join(_invoke_regex(t) for t in tools) + ")"
    more = r"(\n" + invoke + r")*" if parallel else ""
    return invoke + more + r"\n" + re.escape("</｜DSML｜ calls>")
