"""The one exception family of deepinfer_recipe.

Every problem a caller causes raises a `RecipeError` that carries the HTTP status a server
should answer with and a message that names the offending field.
"""
from __future__ import annotations

import json


class RecipeError(Exception):
    """Base error: `.status` (HTTP status code) and `.message` (human readable)."""

    status: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.param = param

    def to_dict(self) -> dict:
        """The OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.error_type}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))


class RequestValidationError(RecipeError):
    """The request body does not have the shape the API defines (wrong type, unknown role...)."""


class ConversionError(RecipeError):
    """The request is well formed but cannot be served (unknown model, unsupported option...)."""


class TokenizerError(RecipeError):
    """No usable tokenizer, or a special token missing from its vocabulary."""

    status = 500
    error_type = "server_error"


__all__ = ["RecipeError", "RequestValidationError", "ConversionError", "TokenizerError"]
