"""DeepSeek-V4.1-Flash in plain PyTorch: one module per concept, official checkpoint names."""

from .args import ConfigError, ModelArgs
from .kv_cache import SequenceCache, SequenceChunk
from .loader import CheckpointError
from .model import DeepseekV41ForCausalLM, DeepseekV41Model, ImageInputError

__all__ = ["CheckpointError", "ConfigError", "DeepseekV41ForCausalLM", "DeepseekV41Model", "ImageInputError",
           "ModelArgs", "SequenceCache", "SequenceChunk"]
