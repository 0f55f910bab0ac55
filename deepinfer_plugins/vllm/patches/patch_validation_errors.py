"""A body vLLM's request models refuse on a Chat Completions, Responses or Messages route of a server that renders
with DeepInfer's codecs gets the refusal the codec of its API gives it, the official package's message, where the
codec refuses it too; vLLM's own message otherwise (see the ledger in __init__.py)."""

from __future__ import annotations

import logging

_PATCHED_FLAG = "_deepinfer_patched"
ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages",
          "/v1/messages/count_tokens": "messages"}
SERVING = {"chat": "openai_serving_chat", "responses": "openai_serving_responses",
           "messages": "anthropic_serving_messages"}

logger = logging.getLogger(__name__)


def codec_refusal(api: str, body) -> str | None:
    """The message the codec of ``api`` refuses a sent body with; None where it renders the body, or cannot
    tell: a Responses follow-up, whose earlier items only the server's store holds, and a body the codec fails
    on in another way (vLLM's refusal stands, and the failure is logged)."""
    import deepinfer_recipe

    from .patch_api_codecs import codec_request

    if not isinstance(body, dict) or (api == "responses" and body.get("previous_response_id")):
        return None
    try:
        deepinfer_recipe.render(codec_request(api, body), api)
    except deepinfer_recipe.RecipeError as exc:
        return exc.message
    except Exception:  # noqa: BLE001 - an error path: vLLM's refusal is still the answer
        logger.exception("the %s codec failed on a body vLLM's request model refused", api)
    return None


def codec_refusals(validation_exception_handler):
    """Wrap vLLM's handler of ``RequestValidationError`` (the refusals of its request models): on one of the API
    routes of a server whose handler of that API renders with DeepInfer's, a body the codec refuses is answered
    as the codec's refusals are on that route once a body reaches it (a 400 with the codec's message; the
    Messages routes in Anthropic's error shape)."""

    async def handle(request, exc):
        from http import HTTPStatus

        from starlette.responses import JSONResponse
        from vllm.entrypoints.anthropic.api_router import translate_error_response
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        from .patch_api_codecs import deepinfer_renders

        api = ROUTES.get(request.url.path)
        if api is not None and deepinfer_renders(getattr(request.app.state, SERVING[api], None)):
            message = codec_refusal(api, exc.body)
            if message is not None:
                refusal = create_error_response(message, status_code=HTTPStatus.BAD_REQUEST)
                if api == "messages":
                    return translate_error_response(refusal)
                return JSONResponse(refusal.model_dump(), status_code=refusal.error.code)
        return await validation_exception_handler(request, exc)

    setattr(handle, _PATCHED_FLAG, True)
    return handle


def apply() -> bool:
    from vllm.entrypoints.serve.exception_handling import register

    if not getattr(register.validation_exception_handler, _PATCHED_FLAG, False):
        register.validation_exception_handler = codec_refusals(register.validation_exception_handler)
    return True
