"""The API-neutral conversation every request is converted into before rendering.

These are plain slotted classes rather than pydantic models: the request models
(`apis/`) validate the input once, and the conversation is then built on the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union


class Role(str, Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    LATEST_REMINDER = "latest_reminder"


class ModelVersion(str, Enum):
    """Which prompt encoding a request targets."""

    V4 = "DeepSeek-V4-Pro"
    V41 = "DeepSeek-V4.1-Flash"


@dataclass(slots=True)
class ImageSource:
    """An image part; rendered as one image placeholder token. `kind`: url | data_url | bytes."""

    kind: str
    value: Any
    detail: str = "high"
    path: str = ""


# Message content: a list of text strings and ImageSource parts, in order.
Part = Union[str, ImageSource]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text as the client sent it


@dataclass(slots=True)
class ToolDefinition:
    name: str
    description: Optional[str] = None
    parameters: Any = None
    strict: Optional[bool] = None
    defer_loading: bool = False


@dataclass(slots=True)
class Message:
    role: str
    parts: list = field(default_factory=list)  # list[Part]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list] = None  # list[ToolCall]
    tool_call_id: Optional[str] = None
    prefix: bool = False
    # V4.1 system messages only: tools announced mid-conversation ("### Updated Tool Schemas")
    tools: Optional[list] = None  # list[ToolDefinition]

    @property
    def content(self) -> str:
        """Content text with each image shown as the default placeholder spelling."""
        return "".join(p if isinstance(p, str) else "<｜image｜>" for p in self.parts)

    @property
    def images(self) -> list:
        return [p for p in self.parts if not isinstance(p, str)]


@dataclass(slots=True)
class Conversation:
    """Messages plus the prompt-level settings the renderer needs."""

    messages: list = field(default_factory=list)
    thinking_mode: bool = True
    tools: list = field(default_factory=list)  # list[ToolDefinition]
    tool_choice: str = "auto"  # auto | none | required
    reasoning_effort: Optional[str] = None  # low | high | xhigh | max
    response_format: str = "text"  # text | json_object | json_schema
    response_schema: Any = None
    # a strict response format constrains decoding with its normalised form, while the prompt
    # shows the schema as sent
    constraint_schema: Any = None


def join_parts(chunks: list) -> list:
    """Join several part lists with a blank line between them (text and images alike)."""
    out: list = []
    for i, c in enumerate(chunks):
        if i:
            out.append("\n\n")
        out.extend(c)
    return out
