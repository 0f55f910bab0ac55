"""SGLang's multimodal processor for V4.1 images: decoding, patches and the prompt's image spans.

SGLang's tokenizer manager hands the processor the request's token ids (``prefer_tokenized_input``) and its
images in order. Every image stands in the prompt as one ``image_token_id`` (the config's; what the recipe's
``<｜image｜>`` encodes to); here each image is decoded and cut into patches by the core's ``preprocess_image``,
and its placeholder becomes ``span_length`` copies of ``image_token_id``: start, each row of embeddings followed
by a newline, end (docs/model.md#vision). Every span position takes one row of the core's ``embed_image``, which
the model class returns from ``get_image_feature``; the scheduler then pads the span with the image's hash
(``pad_input_ids``), so the radix cache tells two images of the same size apart.

A checkpoint without vision tensors has no tower: SGLang still builds this processor for it (its config keeps
``vision_config``), and every image is refused with ``ImageInputError`` naming the missing tower.

Nothing here is SGLang's own preprocessing: resize policy, patch order and span length are the core's, so the
two engines lay out the same prompt for the same image.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalProcessorOutput
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
from sglang.srt.utils import ImageData, load_image

from ..models.deepseek_v41.image_processing import PreprocessedImage, load_rgb, preprocess_image
from ..models.deepseek_v41.model import ImageInputError
from ..models.deepseek_v41.vision import VisionInputError
from .model import model_args_from_sglang_config


class ImageDataError(VisionInputError):
    """An image of the request that cannot be used: not fetched, not decodable, or a size the token budget cannot
    hold."""


class ImagePlaceholderError(ValueError):
    """The prompt's image placeholders and the request's images do not pair up one to one."""


@dataclass(frozen=True)
class ImageSpans:
    """A prompt with every image placeholder expanded: ``input_ids`` and each image's ``(first, last)`` position
    (inclusive, SGLang's offset convention)."""

    input_ids: list[int]
    offsets: list[tuple[int, int]]


def check_placeholders(token_ids: list[int], num_images: int, image_token_id: int) -> None:
    placeholders = sum(1 for token in token_ids if token == image_token_id)
    if placeholders != num_images:
        raise ImagePlaceholderError(f"the prompt has {placeholders} image placeholders (token id {image_token_id}) "
                                    f"but the request carries {num_images} images; each image needs exactly one "
                                    "placeholder, in the order of the images")


def expand_image_spans(token_ids: list[int], span_lengths: list[int], image_token_id: int) -> ImageSpans:
    """Replace the i-th ``image_token_id`` of ``token_ids`` by ``span_lengths[i]`` copies of it."""
    check_placeholders(token_ids, len(span_lengths), image_token_id)
    out: list[int] = []
    offsets: list[tuple[int, int]] = []
    lengths = iter(span_lengths)
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        n = next(lengths)
        offsets.append((len(out), len(out) + n - 1))
        out.extend([image_token_id] * n)
    return ImageSpans(out, offsets)


def decode_and_preprocess(image, index: int, vision) -> PreprocessedImage:
    """One request image (URL, path, data URI, base64 text, bytes, PIL image or SGLang's ``ImageData``) -> its
    patches and grid, at the detail its ``ImageData`` carries (SGLang's chat parsing keeps the part's
    ``detail``; ``low`` shrinks a large image first, every other detail plans the image as it is). Any failure
    is an ``ImageDataError`` naming the image (1-based) and the problem."""
    name = f"image {index + 1} of the request"
    detail = (image.detail if isinstance(image, ImageData) else None) or "high"
    try:
        source = image.url if isinstance(image, ImageData) else image
        if isinstance(source, str):
            source, _ = load_image(source, gpu_image_decode=False)  # SGLang's fetch and decode (URLs, data URIs)
        rgb = load_rgb(source)  # decodes every pixel now, so a truncated file fails here
    except Exception as exc:  # noqa: BLE001 - a fetch or decoder failure of any kind is a bad image, not a crash
        raise ImageDataError(f"{name} ({describe(image)}) is not an image that can be decoded: "
                             f"{type(exc).__name__}: {exc}") from None
    try:
        return preprocess_image(rgb, vision, detail=detail)
    except VisionInputError as exc:  # e.g. a sliver that cannot fit the token budget
        raise ImageDataError(f"{name}: {exc}") from None


def describe(image) -> str:
    """What an error message shows of an image: its size or type, never a whole data URI."""
    if isinstance(image, (bytes, bytearray)):
        return f"{len(image)} bytes"
    if isinstance(image, str):
        return f"{image[:40]}..." if len(image) > 40 else image
    return type(image).__name__


class DeepInferImageProcessor(BaseMultimodalProcessor):
    """Registered for our architecture names by register.py (SGLang finds it by the config's architecture)."""

    prefer_tokenized_input = True  # the request's own token ids, never a re-tokenised decode of them
    preserve_processor_input_ids = True  # the ids returned here are the prompt, spans expanded
    gpu_image_decode = False  # the core's preprocessing reads PIL images

    def __init__(self, hf_config, server_args, _processor, *args, **kwargs):
        super().__init__(hf_config, server_args, _processor, *args, **kwargs)
        self.args = model_args_from_sglang_config(hf_config)
        self.image_token_id = self.args.image_token_id

    def prompt_ids(self, input_text) -> list[int]:
        if isinstance(input_text, list):
            return [int(token) for token in input_text]
        if self._tokenizer is None:
            raise ImagePlaceholderError("a text prompt with images needs a tokenizer; send input_ids instead")
        return self._tokenizer.encode(input_text)

    def preprocess_images(self, images: list) -> list[PreprocessedImage]:
        return [decode_and_preprocess(image, i, self.args.vision) for i, image in enumerate(images)]

    async def process_mm_data_async(self, image_data, input_text, request_obj, *args,
                                    **kwargs) -> MultimodalProcessorOutput | None:
        images = list(image_data or [])
        if kwargs.get("audio_data") or getattr(request_obj, "video_data", None):
            raise ImageInputError("DeepSeek-V4.1 takes images only (no audio or video)")
        if not images:
            return None
        if self.args.vision is None:
            raise ImageInputError(f"the request carries {len(images)} image(s), but this checkpoint has no vision "
                                  "tower (no vision.* tensors): it serves text only")
        token_ids = self.prompt_ids(input_text)
        check_placeholders(token_ids, len(images), self.image_token_id)  # before any image is fetched or decoded
        preprocessed = await asyncio.to_thread(self.preprocess_images, images)
        spans = expand_image_spans(token_ids, [p.grid.span_length for p in preprocessed], self.image_token_id)
        items = [MultimodalDataItem(modality=Modality.IMAGE, feature=p.patches, offsets=[offset],
                                    model_specific_data={"patch_rows": p.grid.patch_rows,
                                                         "patch_cols": p.grid.patch_cols})
                 for p, offset in zip(preprocessed, spans.offsets)]
        return MultimodalProcessorOutput(input_ids=spans.input_ids,
                                         mm_items=self._prepare_mm_items_for_transport(items),
                                         im_token_id=self.image_token_id)
