"""Image preprocessing: the one place that turns an image into the vision tower's patches and its span length.

``plan_image_grid`` is plain arithmetic on the image's size (no pixels, no torch), so token accounting can size a
prompt without decoding; ``preprocess_image`` decodes, resizes and normalises to the planned grid. Both follow the
resize policy of docs/model.md#image-preprocessing: upscale small images to ``min_pixels``, round up to whole
patches, and shrink to the ``max_image_tokens`` budget when the span would not fit.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .args import VisionArgs
from .vision import VisionInputError

PAD_GREY = (127, 127, 127)
"""Fill of the letterbox around an aspect-preserving fit (docs/model.md#image-preprocessing)."""


@dataclass(frozen=True)
class ImageGrid:
    """Where one image lands: its resized size in pixels, its patch grid and its grid of LM embeddings."""

    height: int
    width: int
    patch_rows: int
    patch_cols: int
    rows: int
    cols: int

    @property
    def span_length(self) -> int:
        """Token positions of the image's span: start, each row of embeddings plus a newline, end."""
        return self.rows * (self.cols + 1) + 2


def _grid(height: int, width: int, vision: VisionArgs) -> ImageGrid:
    p, r = vision.patch_size, vision.downsample_ratio
    patch_rows, patch_cols = height // p, width // p
    return ImageGrid(height, width, patch_rows, patch_cols, -(-patch_rows // r), -(-patch_cols // r))


def plan_image_grid(width: int, height: int, vision: VisionArgs) -> ImageGrid:
    """The grid an image of ``width`` x ``height`` pixels is resized to. Raises VisionInputError for an empty
    image or one that cannot fit the token budget."""
    if width <= 0 or height <= 0:
        raise VisionInputError(f"image size must be positive, got {width} x {height}")
    p, budget = vision.patch_size, vision.max_image_tokens
    w, h = width, height
    if vision.max_wh_ratio is not None and w > h * vision.max_wh_ratio:
        w = h * vision.max_wh_ratio  # very wide images are squeezed to the widest allowed aspect
    if w * h < vision.min_pixels:
        grow = math.sqrt(vision.min_pixels / (w * h))
        w, h = int(w * grow), int(h * grow)
    grid = _grid(math.ceil(h / p) * p, math.ceil(w / p) * p, vision)
    if grid.span_length > budget:
        grid = _fit_budget(w, h, vision)
    if min(grid.height, grid.width) <= 0 or grid.span_length > budget:
        raise VisionInputError(f"a {width} x {height} image cannot fit max_image_tokens={budget}")
    return grid


def _fit_budget(w: float, h: float, vision: VisionArgs) -> ImageGrid:
    """The largest grid of the image's aspect whose span fits the budget: with rows = aspect * cols, the span
    rows * (cols + 1) + 2 reaches the budget at cols = sqrt((budget - 2) / aspect + 1/4) - 1/2."""
    p, budget = vision.patch_size, vision.max_image_tokens
    cell = p * vision.downsample_ratio  # pixels per LM embedding along each side
    aspect = h / w
    max_cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    max_rows = max_cols * aspect
    if max_cols < 1:  # taller than the budget allows even one column wide: one column of as many rows as fit
        return _grid((budget - 2) // 2 * cell, cell, vision)
    if max_rows < 1:  # the wide counterpart: one row
        return _grid(cell, (budget - 3) * cell, vision)
    scale = min(math.floor(max_cols) * cell / w, math.floor(max_rows) * cell / h)
    return _grid(math.floor(h * scale / p) * p, math.floor(w * scale / p) * p, vision)


@dataclass(frozen=True)
class PreprocessedImage:
    """``patches`` [patch_rows * patch_cols, 3, p, p] row-major, normalised to [-1, 1]; what ``embed_image`` takes."""

    patches: torch.Tensor
    grid: ImageGrid


def load_rgb(image):
    """A PIL image, encoded bytes, or a file path -> an RGB PIL image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        source = io.BytesIO(image)
    elif isinstance(image, (str, Path)):
        source = image
    else:
        raise VisionInputError(f"an image must be a PIL image, encoded bytes or a path, got {type(image).__name__}")
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise VisionInputError(f"cannot decode the image: {exc}") from None


def preprocess_image(image, vision: VisionArgs, pixel_dtype: torch.dtype = torch.bfloat16) -> PreprocessedImage:
    """Decode, resize to ``plan_image_grid``'s size and cut into patches. An image squeezed by ``max_wh_ratio`` is
    stretched to the grid; any other is fitted inside it with its aspect kept, centred on ``PAD_GREY``. Values
    are (x / 255 - 0.5) / 0.5, rounded to ``pixel_dtype`` (bf16, the released input precision; float32 keeps
    them unrounded)."""
    rgb = load_rgb(image)
    grid = plan_image_grid(rgb.width, rgb.height, vision)
    size = (grid.width, grid.height)
    squeezed = vision.max_wh_ratio is not None and rgb.width >= vision.max_wh_ratio * rgb.height
    resized = rgb.resize(size) if squeezed else ImageOps.pad(rgb, size, color=PAD_GREY)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(pixel_dtype)  # [3, H, W]
    p = vision.patch_size
    patches = (pixels.unflatten(1, (grid.patch_rows, p)).unflatten(3, (grid.patch_cols, p))
               .permute(1, 3, 0, 2, 4).flatten(0, 1))  # [rows * cols, 3, p, p]
    return PreprocessedImage(patches.contiguous(), grid)
