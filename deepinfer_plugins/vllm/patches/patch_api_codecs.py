"""Served Chat Completions, Responses and Anthropic Messages requests are rendered by deepinfer_recipe's codec of
their own API, from the body the client sent, as the official package renders them; a Responses follow-up through
``previous_response_id`` sees the previous input and output items as if the client had sent them back (see the
ledger in __init__.py)."""

from __future__ import annotations

import contextvars
import functools
import json
from typing import Any

from ... import envs
from ..thinking import thinking_switch, with_thinking_switch

_PATCHED_FLAG = "_deepinfer_patched"
# A Responses or Messages request vLLM parsed and the JSON body it parsed it from, while it is being served.
SENT_BODY: contextvars.ContextVar[tuple[Any, dict] | None] = contextvars.ContextVar("deepinfer_sent_body",
                                                                                  default=None)
# The request object vLLM renders, the API whose codec renders it instead, and the request that codec renders.
CODEC: contextvars.ContextVar[tuple[Any, str, dict] | None] = contextvars.ContextVar("deepinfer_codec",
                                                                                   default=None)


def responses_request(body: dict, history: list[dict], template_kwargs: dict, model_name: str) -> dict:
    """The Responses request the recipe renders: the body as sent, with the items ``previous_response_id`` stands
    for ahead of its input, under the model name the recipe knows. vLLM's thinking switch, where set, wins over
    ``reasoning.effort`` as ``thinking`` does in a Chat request (and as the reasoning parser reads it): off is the
    effort ``"none"``, on drops an effort of ``"none"``."""
    request = {key: value for key, value in body.items() if key != "previous_response_id"}
    request["model"] = model_name
    if history:
        request["input"] = [*history, *input_items(body)]
    thinking = thinking_switch(template_kwargs)
    reasoning = request.get("reasoning") if isinstance(request.get("reasoning"), dict) else {}
    if thinking is False:
        request["reasoning"] = {**reasoning, "effort": "none"}
    elif thinking and reasoning.get("effort") == "none":
        request["reasoning"] = {key: value for key, value in reasoning.items() if key != "effort"}
    return request


def messages_request(body: dict, model_name: str) -> dict:
    """The Messages request the recipe renders: the body as sent, under the model name the recipe knows; vLLM's
    thinking switch, where set, is the request's ``thinking``, as it is for a Chat request."""
    return with_thinking_switch(dict(body, model=model_name), body.get("chat_template_kwargs"))


def chat_request(body: dict, model_name: str) -> dict:
    """The Chat Completions request the recipe renders: the body as sent, under the model name the recipe knows;
    vLLM's thinking switch, where set, is the request's ``thinking``, and its ``continue_final_message`` is the
    API's ``prefix`` on the final assistant message."""
    request = with_thinking_switch(dict(body, model=model_name), body.get("chat_template_kwargs"))
    messages = body.get("messages")
    if (body.get("continue_final_message") and isinstance(messages, list) and messages
            and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"):
        request["messages"] = [*messages[:-1], {**messages[-1], "prefix": True}]
    return request


def codec_request(api: str, body: dict) -> dict:
    """The request the codec of ``api`` renders for a sent body that continues no stored response."""
    from ..tokenizer import MODEL_NAME

    if api == "responses":
        return responses_request(body, [], body.get("chat_template_kwargs") or {}, MODEL_NAME)
    return chat_request(body, MODEL_NAME) if api == "chat" else messages_request(body, MODEL_NAME)


def input_items(request: dict) -> list:
    """The request's input as items: what a follow-up through ``previous_response_id`` continues."""
    sent = request.get("input", [])
    return [{"role": "user", "content": sent}] if isinstance(sent, str) else list(sent)


def image_messages(images: list) -> list[dict]:
    """The rendered prompt's images, in placeholder order, as one chat message: what vLLM's multimodal parsing
    reads to fetch and decode them."""
    parts = []
    for image in images:
        url = {"url": image.value}
        if image.detail:
            url["detail"] = image.detail
        parts.append({"type": "image_url", "image_url": url})
    return [{"role": "user", "content": parts}]


def output_item(item: Any) -> dict:
    return item.model_dump(mode="json", exclude_none=True) if hasattr(item, "model_dump") else dict(item)


def deepinfer_renders(serving) -> bool:
    """Whether a serving object (an endpoint's handler, or the online renderer itself) renders with ours."""
    from ..tokenizer import DeepInferRenderer

    renderer = getattr(serving, "renderer", None) or getattr(getattr(serving, "online_renderer", None), "renderer",
                                                              None)
    return isinstance(renderer, DeepInferRenderer)


def claimed(request) -> bool:
    claim = CODEC.get()
    return claim is not None and claim[0] is request


def body_handler(var: contextvars.ContextVar, value, skip=lambda request: False):
    """Wrap an endpoint handler ``(self, request, raw_request)`` so that, with DeepInfer's renderer, ``var`` holds
    ``value(request, body)`` while the request is served, ``body`` being the JSON the client sent (FastAPI keeps
    the bytes it parsed); ``skip(request)`` leaves a request to the handler as it is."""

    def wrap(handler):
        async def handle(self, request, raw_request=None):
            if raw_request is None or not deepinfer_renders(self) or skip(request):
                return await handler(self, request, raw_request)
            token = var.set(value(request, json.loads(await raw_request.body())))
            try:
                return await handler(self, request, raw_request)
            finally:
                var.reset(token)

        setattr(handle, _PATCHED_FLAG, True)
        return handle

    return wrap


# Responses and Messages handlers (``create_responses``, ``create_messages``, ``count_tokens``, the render
# endpoint's ``render_messages_request``): the sent body is at hand while the request is converted and rendered.
remember_sent_body = body_handler(SENT_BODY, lambda request, body: (request, body))


def chat_claim(request, body: dict) -> tuple[Any, str, dict]:
    from ..tokenizer import MODEL_NAME

    return request, "chat", chat_request(body, MODEL_NAME)


# ``OpenAIServingChat.create_chat_completion`` and the render endpoint's ``render_chat_request`` (whose token ids a
# cache-aware router matches prefixes on): a Chat Completions request is rendered from the body the client sent,
# unless it was converted from a Messages request, which its own codec renders.
chat_codec = body_handler(CODEC, chat_claim, skip=claimed)


def responses_rendering(render_responses):
    """Wrap ``OnlineRenderer.render_responses``: with DeepInfer's renderer and the sent body at hand, the Responses
    codec renders the request, with the stored history ahead of its input, instead of vLLM's conversion of the
    items into chat messages. The items returned as the render's messages are what vLLM's store keeps for a
    follow-up."""

    async def render(self, request, *, previous_messages=None, previous_response_outputs=None, tool_server=None,
                     skip_mm_cache=False):
        from ..tokenizer import MODEL_NAME

        sent = SENT_BODY.get()
        if sent is None or sent[0] is not request or not deepinfer_renders(self):
            return await render_responses(self, request, previous_messages=previous_messages,
                                          previous_response_outputs=previous_response_outputs,
                                          tool_server=tool_server, skip_mm_cache=skip_mm_cache)
        template_kwargs = self.effective_chat_template_kwargs(request)
        history = [*(previous_messages or []), *map(output_item, previous_response_outputs or [])]
        codec = responses_request(sent[1], history, template_kwargs, MODEL_NAME)
        token = CODEC.set((request, "responses", codec))
        try:
            _, engine_inputs = await self.preprocess_chat(
                request, [], default_template=None,
                default_template_content_format=self.chat_template_content_format,
                default_template_kwargs=template_kwargs, parser=self.parser, skip_mm_cache=skip_mm_cache)
        finally:
            CODEC.reset(token)
        return self._responses_render_result(input_items(codec), engine_inputs)

    setattr(render, _PATCHED_FLAG, True)
    return render


def messages_conversion(to_chat_completion_request):
    """Wrap ``AnthropicServingMessages.to_chat_completion_request``: the chat request converted from the Messages
    request being served is claimed for the Messages codec, with the request it renders. Its thinking budget is
    dropped: the official API reads ``thinking.budget_tokens`` nowhere, and vLLM would stop the reasoning there
    (or, with no reasoning config, refuse the request)."""

    def convert(cls, anthropic_request, **options):
        from ..tokenizer import MODEL_NAME

        chat_request = to_chat_completion_request(cls, anthropic_request, **options)
        sent = SENT_BODY.get()
        if sent is not None and sent[0] is anthropic_request:
            chat_request.thinking_token_budget = None
            CODEC.set((chat_request, "messages", messages_request(sent[1], MODEL_NAME)))
        return chat_request

    setattr(convert, _PATCHED_FLAG, True)
    return convert


def official_sampling(request, inference) -> None:
    """Sample as the official API does: vLLM builds the sampling parameters from the request after this render,
    so the recipe's adjusted temperature and top_p replace the request's own (in thinking mode the official API
    ignores both)."""
    request.temperature, request.top_p = inference.temperature, inference.top_p


def codec_rendering(preprocess_chat):
    """Wrap ``OnlineRenderer.preprocess_chat``: for a claimed request the prompt is its API codec's rendering,
    handed to the renderer vLLM calls next, and vLLM is handed the prompt's images only, to fetch and decode."""

    async def preprocess(self, request, messages, *args, **kwargs):
        from ..tokenizer import PRERENDERED

        claim = CODEC.get()
        if claim is None or claim[0] is not request or not deepinfer_renders(self):
            return await preprocess_chat(self, request, messages, *args, **kwargs)
        rendered = self.renderer.render_request(claim[2], claim[1])
        if not envs.request_sampling():
            official_sampling(request, rendered.inference)
        token = PRERENDERED.set(rendered)
        try:
            return await preprocess_chat(self, request, image_messages(rendered.images), *args, **kwargs)
        finally:
            PRERENDERED.reset(token)

    setattr(preprocess, _PATCHED_FLAG, True)
    return preprocess


def responses_render_route(router) -> None:
    """Replace the ``/v1/responses/render`` route of vLLM's render router with its endpoint wrapped so that the
    body the client sent is at hand (``SENT_BODY``) while the request renders: its handler, unlike the other
    render endpoints', is not given the HTTP request. The app copies the router's routes when it is built, after
    the plugin has loaded."""
    from fastapi.routing import APIRoute

    (at, route), = [(i, r) for i, r in enumerate(router.routes)
                    if isinstance(r, APIRoute) and r.path == "/v1/responses/render"]
    endpoint = route.endpoint
    if getattr(endpoint, _PATCHED_FLAG, False):
        return

    @functools.wraps(endpoint)  # FastAPI reads the parameters (the request model, the HTTP request) from it
    async def render_responses(request, raw_request):
        handler = getattr(raw_request.app.state, "serving_render", None)
        if handler is None or not deepinfer_renders(handler):
            return await endpoint(request, raw_request)
        token = SENT_BODY.set((request, json.loads(await raw_request.body())))
        try:
            return await endpoint(request, raw_request)
        finally:
            SENT_BODY.reset(token)

    setattr(render_responses, _PATCHED_FLAG, True)
    router.add_api_route(route.path, render_responses, methods=list(route.methods), dependencies=route.dependencies,
                         response_model=route.response_model, responses=route.responses)
    router.routes[at] = router.routes.pop()


def apply() -> bool:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.scale_out.render.serving import ServingRender
    from vllm.renderers.online_renderer import OnlineRenderer

    for owner, name, wrap in ((OpenAIServingChat, "create_chat_completion", chat_codec),
                              (ServingRender, "render_chat_request", chat_codec),
                              (ServingRender, "render_messages_request", remember_sent_body),
                              (OpenAIServingResponses, "create_responses", remember_sent_body),
                              (AnthropicServingMessages, "create_messages", remember_sent_body),
                              (AnthropicServingMessages, "count_tokens", remember_sent_body),
                              (OnlineRenderer, "render_responses", responses_rendering),
                              (OnlineRenderer, "preprocess_chat", codec_rendering)):
        if not getattr(getattr(owner, name), _PATCHED_FLAG, False):
            setattr(owner, name, wrap(getattr(owner, name)))
    convert = AnthropicServingMessages.to_chat_completion_request
    if not getattr(convert, _PATCHED_FLAG, False):
        AnthropicServingMessages.to_chat_completion_request = classmethod(messages_conversion(convert.__func__))
    from vllm.entrypoints.scale_out.render import api_router  # after patch_request_models: see apply_all

    responses_render_route(api_router.router)
    return True
