"""vLLM's request models take the values the official API accepts and vLLM's models do not list: a Chat ``regex``
response format, Messages ``document`` blocks and the efforts ``none``, ``minimal`` and ``ultra``, and the
Messages server-tool blocks, which the official package refuses with its own message (see the ledger in
__init__.py). The prompt is the codec's (patch_api_codecs); these only let the body through, and only
to our renderer where another model's path would lose them. Responses entries the codec skips and OpenAI's types
cannot read (a hosted tool's call with only its ids) are dropped instead of refusing the body, and an assistant
message's file beside its text is let through to be stubbed. A tool choice of a body without tools (absent, null
or empty) is read as ``auto``, as the official package reads it, where vLLM's Chat and Responses request models
refused it; a named tool choice that names no declared tool is still refused by them (they run before any
codec), but with the official message."""

from __future__ import annotations

from functools import partial
from typing import Literal, Optional, get_args, get_origin

_PATCHED_FLAG = "_deepinfer_patched"
_REFUSED_FLAG = "_deepinfer_refused_elsewhere"  # its own flag: patch_api_codecs wraps the same handlers

REGEX_FORMAT = "regex"
# the Messages codec stubs a document in place and refuses server-tool blocks, each as the official package does
MESSAGES_BLOCKS = ("document", "server_tool_use", "web_search_tool_result")
MESSAGES_EFFORTS = ("none", "minimal", "ultra")
# vLLM's (Anthropic's) rules for an enabled thinking budget; the official API reads none of them
THINKING_BUDGET_FLOOR = 1024
THINKING_BUDGET_CHECK = "validate_thinking_budget"
INPUT_ONLY_PARTS = {"input_file", "input_image"}  # Responses content parts only an input message takes
UNDECLARED_TOOL = "Invalid value for 'tool_call': no function named '{}' was specified in the 'tools' parameter."


def widen_literal(model, field: str, added: tuple[str, ...]) -> bool:
    """Add ``added`` to the values of a pydantic model's ``Literal[...]`` (or ``Literal[...] | None``) field.
    -> whether the field changed; the caller rebuilds the models that contain ``model``."""
    info = model.model_fields[field]
    options = get_args(info.annotation)
    optional = type(None) in options
    literal = next((option for option in options if get_args(option)), info.annotation) if optional \
        else info.annotation
    values = get_args(literal)
    missing = tuple(value for value in added if value not in values)
    if not missing:
        return False
    widened = Literal[(*values, *missing)]
    info.annotation = widened | None if optional else widened
    return True


def optional_thinking_budget(enabled_config) -> bool:
    """Make ``budget_tokens`` of an enabled thinking config optional and any non-negative integer, as the official
    API reads it (vLLM required it, at least 1024). -> whether it changed; the caller rebuilds."""
    from annotated_types import Ge

    info = enabled_config.model_fields["budget_tokens"]
    if info.default is None:
        return False
    info.annotation, info.default, info.metadata = Optional[int], None, [Ge(0)]
    return True


def without_budget_check(request_model) -> bool:
    """Drop the request model's check that the thinking budget is below ``max_tokens``, which the official API
    does not make; ``refused_elsewhere`` makes it for another model's renderer. -> whether it changed."""
    return request_model.__pydantic_decorators__.model_validators.pop(THINKING_BUDGET_CHECK, None) is not None


def thinking_budget_refusals(request) -> list[str]:
    """What vLLM's Messages models refused of an enabled thinking budget and the official API accepts."""
    thinking = getattr(request, "thinking", None)
    if getattr(thinking, "type", None) != "enabled":
        return []
    budget = thinking.budget_tokens
    if budget is None:
        return ["thinking.budget_tokens missing"]
    if budget < THINKING_BUDGET_FLOOR:
        return [f"thinking.budget_tokens {budget} (below {THINKING_BUDGET_FLOOR})"]
    max_tokens = getattr(request, "max_tokens", None)
    remote_prefill = (getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode")
    if max_tokens is not None and budget >= max_tokens and not remote_prefill:
        return [f"thinking.budget_tokens {budget} (not below max_tokens {max_tokens})"]
    return []


def official_only_values(request) -> list[str]:
    """The values of a Messages request that only the widened models accept."""
    found = thinking_budget_refusals(request)
    effort = getattr(getattr(request, "output_config", None), "effort", None)
    if effort in MESSAGES_EFFORTS:
        found.append(f"output_config.effort {effort!r}")
    for message in getattr(request, "messages", None) or []:
        blocks = message.content if isinstance(message.content, list) else []
        found += [f"a {block.type!r} content block" for block in blocks if block.type in MESSAGES_BLOCKS]
    return found


def refused_elsewhere(handler):
    """Wrap a Messages handler: where a model other than ours serves the request, its conversion would drop a
    document block, pass on an effort its template does not know or a thinking budget vLLM's rules refuse, so
    those values are refused with a 400, as vLLM's models refused them."""

    async def handle(self, request, raw_request=None):
        from .patch_api_codecs import deepinfer_renders

        found = official_only_values(request)
        if found and not deepinfer_renders(self):
            return self.create_error_response(f"{', '.join(found)} is not supported for this model")
        return await handler(self, request, raw_request)

    setattr(handle, _REFUSED_FLAG, True)
    return handle


def regex_constraint(structured_outputs_from_response_format):
    """Wrap vLLM's ``structured_outputs_from_response_format``: a ``regex`` response format constrains the output
    to its ``regex`` (vLLM's own ``structured_outputs.regex``); every other format is vLLM's."""

    def convert(structured_outputs, response_format):
        if getattr(response_format, "type", None) != REGEX_FORMAT:
            return structured_outputs_from_response_format(structured_outputs, response_format)
        from dataclasses import replace

        from vllm.sampling_params import StructuredOutputsParams

        regex = getattr(response_format, REGEX_FORMAT, None)
        if structured_outputs is None:
            return StructuredOutputsParams(regex=regex)
        return replace(structured_outputs, regex=regex)

    setattr(convert, _PATCHED_FLAG, True)
    return convert


def chat_choice_name(choice: dict):
    """The name a Chat tool choice gives: only a ``function`` choice names a tool."""
    function = choice.get("function") if choice.get("type") == "function" else None
    return function.get("name") if isinstance(function, dict) else None


def responses_choice_name(choice: dict):
    """The name a Responses tool choice gives: a ``function`` or a ``custom`` choice names a tool."""
    return choice.get("name") if choice.get("type") in ("function", "custom") else None


def declared_tool_names(tools: list) -> set:
    """Every name a tool choice may give: Chat functions, Responses tools and the members of their namespaces."""
    names = set()
    for tool in (tool for tool in tools if isinstance(tool, dict)):
        function = tool.get("function")
        names.add(function.get("name") if isinstance(function, dict) else tool.get("name"))
        members = tool.get("tools") if tool.get("type") == "namespace" else None
        names.update(member.get("name") for member in members or () if isinstance(member, dict))
    return names


def toolless_choice(data, choice_name) -> bool:
    """Whether a request body declares no tools (absent, null or ``[]``) and gives an empty tool list or a tool
    choice of a kind the official package then reads as ``auto``: ``auto``, ``required`` or a named tool (any
    name; ``choice_name`` says which choices name one)."""
    if not isinstance(data, dict) or data.get("tools") not in (None, []):
        return False
    choice = data.get("tool_choice")
    if choice is None:
        return data.get("tools") == []
    if isinstance(choice, dict):
        return isinstance(choice_name(choice), str)
    return choice in ("auto", "required")


def without_unreadable_skipped_entries(data, element_types):
    """A Responses body without the input items and tools that vLLM's request model cannot read (a hosted tool's
    call with only its ids, a bare ``file_search`` tool: OpenAI's types require more fields) and that the codec
    skips as the official package does (deepinfer_recipe's ``RENDERED_ITEM_TYPES``, ``RENDERED_TOOL_TYPES``):
    neither could change the prompt, and vLLM refused the whole body for them. Messages mixing a file or an image
    with output text are made readable (``mixed_message_as_input``). ``element_types`` maps "input" and "tools" to
    a pydantic ``TypeAdapter`` of one element."""
    from deepinfer_recipe.apis.responses import RENDERED_ITEM_TYPES, RENDERED_TOOL_TYPES
    from pydantic import ValidationError

    def readable(entry, adapter) -> bool:
        try:
            adapter.validate_python(entry)
        except ValidationError:
            return False
        return True

    if not isinstance(data, dict):
        return data
    kept = dict(data)
    for field, rendered in (("input", RENDERED_ITEM_TYPES), ("tools", RENDERED_TOOL_TYPES)):
        entries = data.get(field)
        if isinstance(entries, list):
            kept[field] = [entry for entry in entries if not isinstance(entry, dict) or "type" not in entry
                           or entry["type"] in rendered or readable(entry, element_types[field])]
    if isinstance(kept.get("input"), list):
        kept["input"] = [mixed_message_as_input(item) for item in kept["input"]]
    return kept


def mixed_message_as_input(item):
    """A message holding an input-only part (``input_file``, ``input_image``) beside ``output_text`` parts fits
    none of OpenAI's message types (an output message takes neither, an input message no output text; vLLM's
    model refused the body, or, for an output message whose content it validates lazily, later lost the parts).
    The codec reads both text kinds alike, stubs a file in place and refuses an image in an assistant message
    with the official message; so the output text parts are given as input text, which vLLM's input message
    reads."""
    if not isinstance(item, dict) or item.get("type", "message") != "message" \
            or not isinstance(item.get("content"), list):
        return item
    content = item["content"]
    kinds = {part.get("type") for part in content if isinstance(part, dict)}
    if "output_text" not in kinds or not kinds & INPUT_ONLY_PARTS:
        return item
    as_input = [{"type": "input_text", "text": part.get("text")}
                if isinstance(part, dict) and part.get("type") == "output_text" else part for part in content]
    return {key: value for key, value in item.items() if key not in ("id", "status")} | {"content": as_input}


INT64 = 1 << 63
# Responses fields the official package reads nowhere, with what vLLM's Responses model takes of each
UNREAD_RESPONSES_FIELDS = {"frequency_penalty": lambda value: -2 <= value <= 2,
                           "presence_penalty": lambda value: -2 <= value <= 2,
                           "seed": lambda value: isinstance(value, int) and -INT64 <= value < INT64}


def readable_responses_values(data):
    """A Responses body without the values vLLM's request model refused and the official package accepts: a
    penalty or a seed it cannot hold (out of its range, or not a number), which the official package reads
    nowhere in a Responses request (dropped), and a namespace tool without the ``description`` OpenAI's type
    requires and the official package does not (given an empty one)."""
    if not isinstance(data, dict):
        return data
    kept = dict(data)
    for field, takes in UNREAD_RESPONSES_FIELDS.items():
        value = kept.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not takes(value)):
            del kept[field]
    if isinstance(kept.get("tools"), list):
        kept["tools"] = [{**tool, "description": ""} if isinstance(tool, dict) and tool.get("type") == "namespace"
                         and "description" not in tool else tool for tool in kept["tools"]]
    return kept


def readable_responses_body(data, element_types):
    """What vLLM's Responses model validates of a body: ``without_unreadable_skipped_entries``, then
    ``readable_responses_values``."""
    return readable_responses_values(without_unreadable_skipped_entries(data, element_types))


def official_tool_usage(check_tool_usage, choice_name, prepare=lambda data: data):
    """Wrap a request model's ``check_tool_usage`` (a before-validator, the function behind the classmethod),
    after ``prepare`` of the body. A body without tools (``toolless_choice``) loses its empty tool list and its
    tool choice becomes ``auto``, the official reading, where vLLM refused both. Where vLLM refuses a named tool
    choice whose name (possibly empty) no tool of the body declares, the refusal carries the official package's
    message. These validators run before any codec; their other refusals (an ambiguous namespace member among
    them) are vLLM's."""

    def check(cls, data):
        from vllm.exceptions import VLLMValidationError

        data = prepare(data)
        if toolless_choice(data, choice_name):
            chosen = data.get("tool_choice") is not None
            data = check_tool_usage(cls, {key: value for key, value in data.items()
                                          if key not in ("tools", "tool_choice")})
            return {**data, "tool_choice": "auto"} if chosen else data
        try:
            return check_tool_usage(cls, data)
        except VLLMValidationError as exc:
            tools = data.get("tools") if isinstance(data, dict) else None
            choice = data.get("tool_choice") if isinstance(tools, list) and tools else None
            name = choice_name(choice) if isinstance(choice, dict) else None
            if (not isinstance(name, str) or name in declared_tool_names(tools)
                    or not (exc.parameter or "").startswith("tool_choice")):
                raise
            raise VLLMValidationError(UNDECLARED_TOOL.format(name), parameter="tool_choice") from None

    setattr(check, _PATCHED_FLAG, True)
    return check


def patch_tool_usage_check(request_model, choice_name, prepare=lambda data: data) -> bool:
    """Swap ``official_tool_usage`` of the model's ``check_tool_usage`` into its pydantic decorators (a
    before-validator, so ``prepare`` sees the body before its fields are validated); -> whether it changed
    (rebuild then)."""
    from dataclasses import replace

    validators = request_model.__pydantic_decorators__.model_validators
    decorator = validators["check_tool_usage"]
    if getattr(decorator.func.__func__, _PATCHED_FLAG, False):
        return False
    wrapped = official_tool_usage(decorator.func.__func__, choice_name, prepare)
    validators["check_tool_usage"] = replace(decorator, func=classmethod(wrapped).__get__(None, request_model))
    return True


def responses_element_types(request_model) -> dict:
    """A ``TypeAdapter`` of one element of the request model's ``input`` list and of its ``tools`` list."""
    from pydantic import TypeAdapter

    def element(annotation):
        options = get_args(annotation) if get_origin(annotation) is not list else (annotation,)
        listed = next(option for option in options if get_origin(option) is list)
        return TypeAdapter(get_args(listed)[0])

    return {field: element(request_model.model_fields[field].annotation) for field in ("input", "tools")}


def apply() -> bool:
    from vllm.entrypoints.anthropic import protocol as anthropic
    from vllm.entrypoints.generate.base import protocol as base
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.completion import protocol as completion
    from vllm.entrypoints.openai.responses import protocol as responses

    for name in ("create_messages", "count_tokens"):
        if not getattr(getattr(AnthropicServingMessages, name), _REFUSED_FLAG, False):
            setattr(AnthropicServingMessages, name, refused_elsewhere(getattr(AnthropicServingMessages, name)))
    for module in (chat, completion):
        convert = module.structured_outputs_from_response_format
        if not getattr(convert, _PATCHED_FLAG, False):
            module.structured_outputs_from_response_format = regex_constraint(convert)
    changed = widen_literal(base.ResponseFormat, "type", (REGEX_FORMAT,))
    changed |= widen_literal(anthropic.AnthropicContentBlock, "type", MESSAGES_BLOCKS)
    changed |= widen_literal(anthropic.AnthropicOutputConfig, "effort", MESSAGES_EFFORTS)
    changed |= optional_thinking_budget(anthropic.AnthropicThinkingConfigEnabled)
    changed |= without_budget_check(anthropic.AnthropicMessagesRequest)
    changed |= patch_tool_usage_check(chat.ChatCompletionRequest, chat_choice_name)
    changed |= patch_tool_usage_check(responses.ResponsesRequest, responses_choice_name,
                                         partial(readable_responses_body,
                                                 element_types=responses_element_types(responses.ResponsesRequest)))
    if changed:  # inner models first: each rebuild copies the schemas of the models it contains
        for model in (base.ResponseFormat, chat.ChatCompletionRequest, completion.CompletionRequest,
                      anthropic.AnthropicContentBlock, anthropic.AnthropicMessage, anthropic.AnthropicOutputConfig,
                      anthropic.AnthropicThinkingConfigEnabled,
                      anthropic.AnthropicMessagesRequest, anthropic.AnthropicCountTokensRequest,
                      responses.ResponsesRequest):
            model.model_rebuild(force=True)
    return True
