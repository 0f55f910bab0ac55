"""deepinfer_recipe: DeepSeek V4 / V4.1 prompt rendering and output parsing, pure Python."""
from .conversation import (Conversation, ImageSource, Message, ModelVersion, Role, ToolCall,
                           ToolDefinition)
from .convert import (RenderResult, convert, render, render_chat, render_messages,
                      render_responses)
from .errors import ConversionError, RecipeError, RequestValidationError, TokenizerError
from .images import (ImageBudget, ImageError, ImageGrid, ImageQuota, ResolvedImage, image_token_adjustment,
                     plan_image_grid, resolve_images)
from .output import parse
from .parse import (ContentDelta, ParseError, ParseResult, ReasoningDelta, StreamParser,
                    ToolCallArgsDelta, ToolCallEnd, ToolCallStart)
from .responses_out import ChatBuilder, MessagesBuilder, ResponsesBuilder
from .options import ConversionOptions, ConvertedRequest, InferenceOptions, ParsingOptions
from .render import RenderedPrompt, render_conversation
from .tokens import PromptTokenizer, SpecialTokens

__version__ = "0.1.0"

__all__ = [
    "Conversation", "ImageSource", "Message", "ModelVersion", "Role", "ToolCall", "ToolDefinition",
    "RenderResult", "convert", "render", "render_chat", "render_messages", "render_responses",
    "ConversionError", "RecipeError", "RequestValidationError", "TokenizerError",
    "ImageBudget", "ImageError", "ImageGrid", "ImageQuota", "ResolvedImage", "image_token_adjustment",
    "plan_image_grid", "resolve_images",
    "ConversionOptions", "ConvertedRequest", "InferenceOptions", "ParsingOptions",
    "parse", "StreamParser", "ParseResult", "ParseError", "ReasoningDelta", "ContentDelta",
    "ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd", "ChatBuilder", "MessagesBuilder",
    "ResponsesBuilder", "RenderedPrompt", "render_conversation", "PromptTokenizer", "SpecialTokens", "__version__",
]
