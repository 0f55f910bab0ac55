"""Conversion options (the official option names) and the converted-request result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .conversation import Conversation, ModelVersion
from .errors import ConversionError, RequestValidationError
from .tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens

DEFAULT_MODELS = {"DeepSeek-V4-Pro": ModelVersion.V4, "DeepSeek-V4.1-Flash": ModelVersion.V41}
MAX_TOKENS_BOUND = 393216


def _version(v: Any, where: str) -> ModelVersion:
    if isinstance(v, ModelVersion):
        return v
    s = str(v)
    for mv in ModelVersion:
        if s in (mv.value, mv.name, {"V4": "DeepseekV4Pro", "V41": "DeepseekV41Flash"}[mv.name]):
            return mv
    raise RequestValidationError(f"{where}: unknown model version {s!r}; expected one of "
                                 "DeepSeek-V4-Pro, DeepSeek-V4.1-Flash")


@dataclass(slots=True)
class ConversionOptions:
    """Same names as the official `ConversionOptions`.

    `model_alias` may be `{"name": "version"}` (added to the defaults);
    `model_versions_by_name` replaces the whole table.
    """

    default_thinking_mode: bool = True
    reasoning_content_behavior: str = "fill_empty"  # fill_empty | reject
    responses_web_search: str = "drop"  # drop | reject
    messages_web_search: str = "reject"
    thinking_max_tokens_upper_bound: int = MAX_TOKENS_BOUND
    non_thinking_max_tokens_upper_bound: int = MAX_TOKENS_BOUND
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS
    model_versions_by_name: dict = field(default_factory=lambda: dict(DEFAULT_MODELS))

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "ConversionOptions":
        if d is None:
            return _DEFAULT_OPTIONS
        if isinstance(d, ConversionOptions):
            return d
        o = cls()
        for k, v in d.items():
            if k == "model_alias":
                items = v.items() if isinstance(v, dict) else [tuple(v)]
                for name, ver in items:
                    o.model_versions_by_name[name] = _version(ver, f"options.model_alias.{name}")
            elif k == "model_versions_by_name":
                o.model_versions_by_name = {n: _version(x, f"options.model_versions_by_name.{n}")
                                            for n, x in v.items()}
            elif k == "special_tokens":
                o.special_tokens = SpecialTokens.from_dict(v)
            elif k in ("reasoning_content_behavior", "responses_web_search", "messages_web_search"):
                s = _snake(str(v))
                ok = ("fill_empty", "reject") if k == "reasoning_content_behavior" else ("drop", "reject")
                if s not in ok:
                    raise RequestValidationError(f"options.{k}: expected one of {', '.join(ok)}, got {v!r}")
                setattr(o, k, s)
            elif k in ("default_thinking_mode",):
                o.default_thinking_mode = bool(v)
            elif k in ("thinking_max_tokens_upper_bound", "non_thinking_max_tokens_upper_bound"):
                setattr(o, k, int(v))
            else:
                raise RequestValidationError(f"options.{k}: unknown conversion option")
        return o


def _snake(s: str) -> str:
    out = []
    for i, ch in enumerate(s):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


_DEFAULT_OPTIONS = ConversionOptions()


@dataclass(slots=True)
class ParsingOptions:
    """How to parse the model output of one request."""

    parse_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    # None (thinking off) | reasoning_start | reasoning_continuation | content_continuation
    thinking_initial_stage: Optional[str] = None
    stop_sequences: list = field(default_factory=list)
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS
    continuation: bool = False  # prefix continuation: leading newlines are kept


@dataclass(slots=True)
class InferenceOptions:
    """Sampling adjustments the engine must apply (the official package reports the same)."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    seed: Optional[int] = None
    output_constraint: Optional[tuple] = None  # (kind, schema string)

    def to_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "logprobs": self.logprobs, "top_logprobs": self.top_logprobs,
                "seed": self.seed,
                "output_constraint": None if self.output_constraint is None else
                {"kind": self.output_constraint[0], "schema": self.output_constraint[1]}}


@dataclass(slots=True)
class ConvertedRequest:
    """A request after conversion: conversation + model version + inference/parsing options."""

    api: str
    model: str
    model_version: ModelVersion
    conversation: Conversation
    inference: InferenceOptions
    parsing: ParsingOptions
    stream: bool = False
    include_usage: bool = False
    namespace_tool_map: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # Responses: request settings reported back

    def resolve_max_tokens(self, prompt_tokens: int, context_limit: int) -> int:
        """max_tokens to send to the engine (defaults: 8192 / 65536 / 131072 with effort max)."""
        mt = self.inference.max_tokens
        left = context_limit - prompt_tokens
        if mt is not None:
            if prompt_tokens + mt > context_limit:
                raise ConversionError(f"This model's maximum context length is {context_limit} "
                                      f"tokens. However, you requested {prompt_tokens + mt} tokens "
                                      f"({prompt_tokens} in the messages, {mt} in the completion).")
            return max(1, mt)
        if left < 0:
            raise ConversionError(f"This model's maximum context length is {context_limit} tokens. "
                                  f"However, your messages resulted in {prompt_tokens} tokens.")
        c = self.conversation
        d = 8192 if not c.thinking_mode else (131072 if c.reasoning_effort == "max" else 65536)
        return max(1, min(d, left))


def resolve_model(model: Any, opts: ConversionOptions) -> ModelVersion:
    v = opts.model_versions_by_name.get(model)
    if v is None:
        names = ", ".join(opts.model_versions_by_name)
        raise ConversionError(f"The supported API model names are {names}, but you passed {model}.",
                              param="model")
    return v


EFFORT_MAP = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh",
              "ultra": "max", "max": "max"}


def resolve_thinking(thinking_type: Optional[str], effort: Optional[str], opts: ConversionOptions):
    """-> (thinking_mode, effort or None). Explicit thinking wins, then effort, then default."""
    if thinking_type is not None:
        on = thinking_type in ("enabled", "adaptive")
    elif effort is not None:
        on = effort != "none"
    else:
        on = opts.default_thinking_mode
    eff = EFFORT_MAP.get(effort) if (on and effort is not None) else None
    return on, eff


def sampling(version: ModelVersion, thinking: bool, has_tools: bool, temperature, top_p):
    """-> (temperature, top_p) after the model's rules."""
    import struct

    def f32(x):
        return struct.unpack("f", struct.pack("f", x))[0]

    if thinking:
        t = 1.0
        if version is ModelVersion.V41:
            p = max(top_p if top_p is not None else 1.0, f32(0.95))
        else:
            p = f32(0.95) if has_tools else 1.0
    else:
        t = f32(temperature) if temperature is not None else 1.0
        if version is ModelVersion.V41:
            p = 1.0
        else:
            p = f32(top_p) if top_p is not None else 1.0
    return t, p
