"""Widening a request model's Literal field (vllm/patches/patch_request_models.py), on plain pydantic models."""

from typing import Literal

import pytest
from pydantic import BaseModel, ValidationError

from deepinfer_plugins.vllm.patches.patch_request_models import widen_literal


class Block(BaseModel):
    type: Literal["text", "image"]
    effort: Literal["low", "high"] | None = None


class Message(BaseModel):
    content: list[Block]


def test_widened_values_validate_in_the_model_and_in_models_that_contain_it():
    with pytest.raises(ValidationError):
        Message.model_validate({"content": [{"type": "document"}]})
    assert widen_literal(Block, "type", ("document", "text"))
    assert widen_literal(Block, "effort", ("ultra",))
    assert not widen_literal(Block, "effort", ("ultra", "low"))  # nothing left to add
    for model in (Block, Message):
        model.model_rebuild(force=True)
    message = Message.model_validate({"content": [{"type": "document", "effort": "ultra"}, {"type": "text"}]})
    assert [block.type for block in message.content] == ["document", "text"]
    assert Block(type="image").effort is None  # still optional
    for unlisted in ({"type": "video"}, {"type": "text", "effort": "medium"}):
        with pytest.raises(ValidationError):
            Message.model_validate({"content": [unlisted]})
