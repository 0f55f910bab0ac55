"""DeepSeek-V4.1-Flash in plain PyTorch: one module per concept, official checkpoint names."""

from .args import ConfigError, ModelArgs, VisionArgs
from .image_processing import ImageGrid, PreprocessedImage, plan_image_grid, preprocess_image
from .kv_cache import SequenceCache, SequenceChunk
from .loader import CheckpointError
from .model import DeepseekV41ForCausalLM, DeepseekV41Model, ImageInputError
from .vision import VisionInputError

__all__ = ["CheckpointError", "ConfigError", "DeepseekV41ForCausalLM", "DeepseekV41Model", "ImageGrid",
           "ImageInputError", "ModelArgs", "PreprocessedImage", "SequenceCache", "SequenceChunk", "VisionArgs",
           "VisionInputError", "plan_image_grid", "preprocess_image"]
