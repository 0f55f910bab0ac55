"""vLLM's multimodal processing for V4.1 images: sizing, pixels and the prompt's image spans.

The recipe renders each image part as one placeholder token (``SpecialTokens.image``) and vLLM's chat parser
hands the decoded images over in the same order. Here each image is preprocessed by the core
(``preprocess_image``: patches and grid) and its placeholder is replaced by ``span_length`` copies of
``image_token_id``: every span position, delimiters and newlines included, takes one row of the core's
``embed_image``, which the model class returns from ``embed_multimodal``. vLLM keys prefix caching and its
encoder cache on the image's content hash, so the span's token ids need not differ between images.

A checkpoint without vision tensors supports no image at all (limit 0): vLLM then runs it as a text model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo
from vllm.multimodal.processing.processor import PromptReplacement

from ..models.deepseek_v41.args import ModelArgs, VisionArgs
from ..models.deepseek_v41.image_processing import plan_image_grid, preprocess_image
from ..models.deepseek_v41.loader import without_missing_vision

PLACEHOLDER = "<｜image｜>"  # deepinfer_recipe.SpecialTokens.image: what the recipe renders for an image part


@functools.lru_cache(maxsize=4)
def serving_args(checkpoint: str) -> ModelArgs:
    """The model's args as served: no vision tower when the checkpoint holds none of its tensors."""
    path = Path(checkpoint)
    return without_missing_vision(path, ModelArgs.from_file(path))


def largest_image_side(vision: VisionArgs) -> int:
    """A square side past the token budget, so ``plan_image_grid`` shrinks it to the largest span there is."""
    return (math.isqrt(vision.max_image_tokens) + 1) * vision.patch_size * vision.downsample_ratio


class DeepInferProcessingInfo(BaseProcessingInfo):
    @property
    def args(self) -> ModelArgs:
        return serving_args(str(self.ctx.model_config.model))

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None if self.args.vision is not None else 0}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        vision = self.args.vision
        if vision is None:
            return {"image": 0}
        side = largest_image_side(vision)
        return {"image": plan_image_grid(side, side, vision).span_length}

    def placeholder_id(self) -> int:
        return self.get_tokenizer().convert_tokens_to_ids(PLACEHOLDER)


class DeepInferDummyInputsBuilder(BaseDummyInputsBuilder[DeepInferProcessingInfo]):
    """Memory profiling's worst case: every image at the largest span the budget allows."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len, mm_counts, mm_options=None):
        side = largest_image_side(self.info.args.vision)
        return {"image": self._get_dummy_images(width=side, height=side, num_images=mm_counts.get("image", 0),
                                                overrides=(mm_options or {}).get("image"))}


class DeepInferMultiModalProcessor(BaseMultiModalProcessor[DeepInferProcessingInfo]):
    """No HF processor: the core's ``preprocess_image`` makes each image's patches; vLLM's prompt is already token
    ids (our renderer), so the only prompt work is the placeholder -> span replacement."""

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        vision = self.info.args.vision
        images = [preprocess_image(image, vision) for image in hf_data.get("images", [])]
        return BatchFeature({"patches": [image.patches for image in images],
                             "patch_grid": torch.tensor([[image.grid.patch_rows, image.grid.patch_cols]
                                                         for image in images], dtype=torch.int64).view(-1, 2)})

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs) -> Mapping[str, MultiModalFieldConfig]:
        return {"patches": MultiModalFieldConfig.batched("image"),
                "patch_grid": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        vision, image_token_id = self.info.args.vision, self.info.args.image_token_id

        def span(item_idx: int) -> list[int]:  # called only for images missing from vLLM's processor cache
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
            return [image_token_id] * plan_image_grid(size.width, size.height, vision).span_length

        return [PromptReplacement(modality="image", target=[self.info.placeholder_id()], replacement=span)]
