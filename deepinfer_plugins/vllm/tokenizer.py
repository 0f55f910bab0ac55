"""Tokenizer mode and renderer ``deepinfer``: prompts are rendered by deepinfer_recipe, as token ids.

A served request is rendered by the recipe's codec of its own API (Chat Completions, Responses, Messages) from the
body the client sent (vllm/patches/patch_api_codecs.py, which hands the rendering over through ``PRERENDERED``);
the chat messages vLLM passes then serve only to fetch the images. Without a body at hand (offline ``LLM.chat``,
requests vLLM builds itself) those chat messages, with tools, tool_choice, response_format and the thinking
switches, are rendered as a Chat Completions request. Either way the recipe encodes the prompt so that template
markers become single special tokens while user text never does: the prompt reaches the engine as token ids, not
as text that vLLM would tokenize again (which would turn a user's ``<｜User｜>`` into a marker).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from PIL import Image
from vllm.renderers.chat_utils import parse_chat_messages, parse_chat_messages_async
from vllm.renderers.base import BaseRenderer
from vllm.tokenizers.hf import CachedHfTokenizer
from vllm.tokenizers.protocol import TokenizerLike

from .thinking import with_thinking_switch
from .vision import check_image_data_uri, serving_args

MODEL_NAME = "DeepSeek-V4.1-Flash"
RAW_IMAGE_PART_TYPES = ("image_pil", "image_embeds")  # Python-side vLLM inputs: no URL the recipe could render
# A prompt the recipe has already rendered from the request itself, for the render vLLM runs next in this task.
PRERENDERED: contextvars.ContextVar[Any] = contextvars.ContextVar("deepinfer_prerendered", default=None)


class DeepInferTokenizer(TokenizerLike):
    """The checkpoint's own fast tokenizer (tokenizer.json); prompt rendering lives in the renderer."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return CachedHfTokenizer.from_pretrained(*args, **kwargs)


@functools.lru_cache(maxsize=4)
def prompt_tokenizer(path: str):
    from deepinfer_recipe import PromptTokenizer

    return PromptTokenizer.load(path)


def _plain(value: Any) -> Any:
    """Pydantic request objects -> plain JSON-like values for the recipe, under their wire names (vLLM's
    ``json_schema.json_schema`` is the API's ``json_schema.schema``)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True, by_alias=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _chat_part(part: dict) -> dict:
    """A content part as the recipe's Chat Completions parser takes it. vLLM passes Responses parts on unchanged:
    ``input_text`` / ``output_text`` become the ``text`` part and ``input_image`` the ``image_url`` part they
    stand for, as vLLM's own chat parser reads them."""
    kind = part.get("type")
    if kind in RAW_IMAGE_PART_TYPES:
        raise ValueError(f"content part type {kind!r} is not supported; send images as image URLs or data URIs")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        url = part.get("image_url")
        image = {"url": url.get("url") if isinstance(url, dict) else url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    return part


def recipe_chat_request(messages: list, kwargs: dict, tool_choice: Any, response_format: Any) -> dict:
    """vLLM's chat messages and chat-template kwargs -> a Chat Completions request for deepinfer_recipe."""
    plain = _plain(list(messages))
    for message in plain:
        if "reasoning" in message and "reasoning_content" not in message:
            message["reasoning_content"] = message.pop("reasoning")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if not isinstance(function.get("arguments", ""), str):  # vLLM decodes them for Jinja templates
                function["arguments"] = json.dumps(function["arguments"], ensure_ascii=False)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [_chat_part(part) for part in content]
    if kwargs.get("continue_final_message") and plain and plain[-1].get("role") == "assistant":
        plain[-1]["prefix"] = True
    request: dict[str, Any] = {"model": MODEL_NAME, "messages": plain}
    if kwargs.get("tools"):
        request["tools"] = _plain(kwargs["tools"])
        if tool_choice is not None:
            request["tool_choice"] = _plain(tool_choice)
    if response_format is not None:
        request["response_format"] = _plain(response_format)
    with_thinking_switch(request, kwargs)
    if kwargs.get("reasoning_effort") is not None:
        request["reasoning_effort"] = kwargs["reasoning_effort"]
    return request


class DeepInferRenderer(BaseRenderer):
    def render_messages(self, messages, params):
        rendered = self._render(messages, params)
        with _image_errors():
            parsed = parse_chat_messages(messages, self.model_config, content_format="openai",
                                         media_io_kwargs=params.media_io_kwargs,
                                         mm_processor_kwargs=params.mm_processor_kwargs)
        return _engine_prompt(rendered, *parsed, self._vision())

    async def render_messages_async(self, messages, params):
        """As ``render_messages``, with image URLs fetched and decoded off the server's event loop."""
        rendered = self._render(messages, params)
        with _image_errors():
            parsed = await parse_chat_messages_async(messages, self.model_config, content_format="openai",
                                                     media_io_kwargs=params.media_io_kwargs,
                                                     mm_processor_kwargs=params.mm_processor_kwargs)
        return _engine_prompt(rendered, *parsed, self._vision())

    def _vision(self):
        return serving_args(str(self.model_config.model)).vision

    def _render(self, messages, params):
        prerendered = PRERENDERED.get()
        if prerendered is not None:
            return prerendered
        return self.render_request(recipe_chat_request(messages, params.get_apply_chat_template_kwargs(),
                                                       params.tool_choice, params.response_format), "chat")

    def render_request(self, request: dict, api: str):
        """The recipe's prompt for a request of ``api``; images refused here, before vLLM decodes them, get a
        message naming the image."""
        import deepinfer_recipe

        try:
            rendered = deepinfer_recipe.render(request, api, tokenizer=prompt_tokenizer(self._tokenizer_path()))
        except deepinfer_recipe.RecipeError as exc:
            raise ValueError(exc.message) from None
        if rendered.images and serving_args(str(self.model_config.model)).vision is None:
            raise ValueError("this checkpoint has no vision tower (no vision.* tensors): it serves text only, "
                             "so requests with images are refused")
        for number, image in enumerate(rendered.images, 1):
            if image.kind == "data_url":
                check_image_data_uri(image.value, f"image {number} of the request")
            elif urlsplit(image.value).scheme == "file" and not self.model_config.allowed_local_media_path:
                raise ValueError(f"image {number} of the request: file URLs are refused; the server reads local "
                                 "files only under its --allowed-local-media-path")
        return rendered

    def _tokenizer_path(self) -> str:
        return str(self.model_config.tokenizer)


def _engine_prompt(rendered, conversation, mm_data, mm_uuids, vision):
    """The recipe's token ids with the images vLLM decoded, in message order: the order of the placeholders."""
    prompt = {"prompt_token_ids": rendered.token_ids, "prompt": rendered.prompt}
    if mm_data and vision is not None:
        _size_for_detail(rendered.images, mm_data, mm_uuids, vision)
    if mm_data:
        prompt["multi_modal_data"] = mm_data
        if mm_uuids is not None:
            prompt["multi_modal_uuids"] = mm_uuids
    return conversation, prompt


def _size_for_detail(sources, mm_data: dict, mm_uuids: dict | None, vision) -> None:
    """vLLM's processor (vllm/vision.py) plans every image at the default detail; an image whose part asks for a
    detail that plans another grid (``low``: a large image shrunk, as the recipe counts its tokens) is handed to
    it already fitted to that grid (``resize_for_detail``). vLLM hashes the fitted pixels, so one image sent at
    two details is cached as two; a client's own image uuid gets the detail appended for the same reason."""
    from vllm.multimodal.media import MediaWithBytes

    from ..models.deepseek_v41.image_processing import resize_for_detail

    images, uuids = mm_data.get("image"), (mm_uuids or {}).get("image")
    if not isinstance(images, list) or len(images) != len(sources):
        return
    for at, (source, image) in enumerate(zip(sources, images)):
        if source.detail in (None, "high"):
            continue
        resized = resize_for_detail(image.media if isinstance(image, MediaWithBytes) else image, vision,
                                    source.detail)
        if resized is not None:
            images[at] = resized
            if isinstance(uuids, list) and uuids[at] is not None:
                uuids[at] = f"{uuids[at]}#detail={source.detail}"


@contextlib.contextmanager
def _image_errors():
    """Failures that come from the request's image URLs as the client's 400, not the 500 vLLM answers for an
    exception it does not treat as the client's: a host that cannot be reached or does not answer in time (vLLM
    keeps these as server errors for retry logic, but the server is healthy: the client's URL is what failed, as
    OpenAI's API answers it), and a fetched image past PIL's decompression-bomb threshold. Data URIs are checked
    before, by ``check_image_data_uri``; an HTTP 4xx from the image host stays vLLM's 422."""
    try:
        yield
    except Image.DecompressionBombError as exc:
        raise ValueError(f"an image of the request cannot be loaded: {exc}") from None
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise ValueError(f"an image URL of the request cannot be fetched: {exc or type(exc).__name__}") from None
