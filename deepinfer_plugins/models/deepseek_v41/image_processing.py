"""Image preprocessing: the one place that turns an image into the vision tower's patches and its span length.

``plan_image_grid`` is plain arithmetic on the image's size (no pixels, no torch), kept in the recipe so that its
token accounting sizes a prompt as the engines lay it out; ``preprocess_image`` decodes, resizes and normalises to
the planned grid. Both follow the resize policy of docs/model.md#image-preprocessing: upscale small images to
``min_pixels``, round up to whole patches, and shrink to the ``max_image_tokens`` budget when the span would not
fit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from deepinfer_recipe import images
from deepinfer_recipe.images import ImageGrid, fit_to_grid
from PIL import Image, UnidentifiedImageError

from .args import VisionArgs
from .vision import VisionInputError


def plan_image_grid(width: int, height: int, vision: VisionArgs, detail: str = "high") -> ImageGrid:
    """The grid an image of ``width`` x ``height`` pixels is resized to: the recipe's ``plan_image_grid``, the
    one copy of the arithmetic (the recipe sizes prompts with it). Raises VisionInputError for an empty image or
    one that cannot fit the token budget."""
    try:
        return images.plan_image_grid(width, height, vision, detail)
    except images.ImageSizeError as exc:
        raise VisionInputError(str(exc)) from None


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


def preprocess_image(image, vision: VisionArgs, pixel_dtype: torch.dtype = torch.bfloat16,
                     detail: str = "high") -> PreprocessedImage:
    """Decode, resize to ``plan_image_grid``'s size for ``detail`` (the recipe's ``fit_to_grid``) and cut into
    patches. Values are (x / 255 - 0.5) / 0.5, rounded to ``pixel_dtype`` (bf16, the released input precision;
    float32 keeps them unrounded)."""
    rgb = load_rgb(image)
    grid = plan_image_grid(rgb.width, rgb.height, vision, detail)
    resized = fit_to_grid(rgb, grid, vision)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(pixel_dtype)  # [3, H, W]
    p = vision.patch_size
    patches = (pixels.unflatten(1, (grid.patch_rows, p)).unflatten(3, (grid.patch_cols, p))
               .permute(1, 3, 0, 2, 4).flatten(0, 1))  # [rows * cols, 3, p, p]
    return PreprocessedImage(patches.contiguous(), grid)


def resize_for_detail(image, vision: VisionArgs, detail: str):
    """For an engine whose processor plans every image at the default detail: the image fitted to the grid
    ``detail`` plans for it (a large image at ``low``, shrunk), or None where ``detail`` plans the default's
    grid. A grid-sized image plans to its own grid and fitting it again changes no pixel, so the processor's
    ``preprocess_image`` then gives exactly what ``preprocess_image(image, detail=detail)`` gives."""
    decoded = image if isinstance(image, Image.Image) else load_rgb(image)
    grid = plan_image_grid(decoded.width, decoded.height, vision, detail)
    if grid == plan_image_grid(decoded.width, decoded.height, vision):
        return None
    return fit_to_grid(load_rgb(decoded), grid, vision)
