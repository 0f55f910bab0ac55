"""vLLM's multimodal processing for V4.1 images: sizing, pixels and the prompt's image spans.

The recipe renders each image part as one placeholder token (``SpecialTokens.image``) and vLLM's chat parser
hands the decoded images over in the same order. Here each image is preprocessed by the core
(``preprocess_image``: patches and grid) and its placeholder is replaced by ``span_length`` copies of
``image_token_id``: every span position, delimiters and newlines included, takes one row of the core's
``embed_image``, which the model class returns from ``embed_multimodal``. vLLM keys prefix caching and its
encoder cache on the image's content hash, so the span's token ids need not differ between images.

A checkpoint without vision tensors supports no image at all (limit 0): vLLM then runs it as a text model.

``check_image_data_uri`` runs before vLLM decodes a data URI, so that a bad image is a 400 naming the image and
its problem: vLLM's own messages do not say which part failed ("Non-base64 digit found"), and an image past
PIL's decompression-bomb threshold escapes its error handling as a 500.
"""

from __future__ import annotations

import binascii
import functools
import io
import math
from collections.abc import Mapping
from pathlib import Path

import pybase64
import torch
from PIL import Image
from transformers import BatchFeature
from vllm import envs
from vllm.multimodal.image import ALLOWED_IMAGE_FORMATS
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo
from vllm.multimodal.processing.processor import PromptReplacement

from ..models.deepseek_v41.args import ModelArgs, VisionArgs
from ..models.deepseek_v41.image_processing import plan_image_grid, preprocess_image
from ..models.deepseek_v41.loader import without_missing_vision

PLACEHOLDER = "<｜image｜>"  # deepinfer_recipe.SpecialTokens.image: what the recipe renders for an image part


def max_image_pixels() -> int | None:
    """The most pixels a decoded image may have: ``VLLM_MAX_IMAGE_PIXELS`` (0 for none), capped by twice PIL's
    ``MAX_IMAGE_PIXELS``, past which PIL refuses to open an image at all (the two defaults are equal)."""
    limits = [envs.VLLM_MAX_IMAGE_PIXELS] if envs.VLLM_MAX_IMAGE_PIXELS > 0 else []
    if Image.MAX_IMAGE_PIXELS:
        limits.append(2 * Image.MAX_IMAGE_PIXELS)
    return min(limits, default=None)


def check_image_data_uri(url: str, name: str) -> None:
    """Raise ValueError, its message starting with ``name``, for a data URI vLLM could not turn into an image.

    Only the header is read: a payload that opens but fails to decode later is still refused by vLLM (400)."""
    spec, comma, data = url[len("data:"):].partition(",")
    if not comma or spec.rpartition(";")[2] != "base64":
        raise ValueError(f"{name}: only base64 data URIs are supported (data:<media type>;base64,<data>)")
    media_type = spec.partition(";")[0] or "no media type"
    try:
        payload = pybase64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{name}: the data URI's payload is not valid base64 ({exc})") from None
    limit = max_image_pixels()
    try:
        with Image.open(io.BytesIO(payload), formats=ALLOWED_IMAGE_FORMATS) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        raise ValueError(f"{name}: the image is over the limit of {limit} pixels (VLLM_MAX_IMAGE_PIXELS)") from None
    except (Image.UnidentifiedImageError, OSError):
        denied = denied_format(payload)
        if denied:
            raise ValueError(f"{name}: {denied} images are not supported; send PNG, JPEG, WebP, GIF or another "
                             f"raster format (vllm.multimodal.image.ALLOWED_IMAGE_FORMATS)") from None
        raise ValueError(f"{name}: the payload ({media_type}, {len(payload)} bytes) is not an image that can be "
                         f"decoded") from None
    if limit is not None and width * height > limit:
        raise ValueError(f"{name}: the image is {width} x {height} = {width * height} pixels, over the limit of "
                         f"{limit} (VLLM_MAX_IMAGE_PIXELS)")


def denied_format(payload: bytes) -> str | None:
    """The format PIL reads ``payload`` as, among those vLLM refuses to decode (EPS runs Ghostscript, ...).
    Identifying runs only the format's header parser, never its decoder."""
    Image.init()  # registers every format plugin; Image.OPEN holds only the common ones until then
    denied = [name for name in Image.OPEN if name not in ALLOWED_IMAGE_FORMATS]
    try:
        with Image.open(io.BytesIO(payload), formats=denied) as image:
            return image.format
    except Exception:  # noqa: BLE001 - any failure of a header parser means: not one of these formats
        return None


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
