"""Images of a request: how many positions each takes in the V4.1 prompt, and resolving image sources.

The prompt holds one ``<｜image｜>`` placeholder per image; the model sees each as a span of
``rows * (cols + 1) + 2`` positions (start, each row of embeddings and a newline, end), where the
grid follows from the image's size alone (``plan_image_grid``, docs/format.md#images). So a
caller sizes a prompt (``image_token_adjustment``) without the pixels, and the engines resize to
the same grid (``fit_to_grid``). ``resolve_images`` turns a request's image sources into images
fitted to their grids, WebP-encoded as the official resolver gives them, under the official
package's limits and errors: at most 600 images per request (counted across calls that share an
``ImageQuota``), PNG, JPEG, GIF or WebP content, at most 8192 pixels a side.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .conversation import ImageSource
from .errors import RecipeError

MAX_IMAGES_PER_REQUEST = 600
MAX_IMAGE_SIDE = 8192
LOW_DETAIL_MAX_SIDE = 512
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
SIGNATURES = ((b"\x89PNG", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"))
PAD_GREY = (127, 127, 127)  # fill of the letterbox around an aspect-preserving fit
WEBP_QUALITY = 90  # lossy, as the official resolver's WebP is; its quality is not published
UNSUPPORTED = ("You have uploaded an unsupported image. Please make sure your image is valid and has "
               "one of the following formats: webp, png, jpeg, and gif.")


@dataclass(frozen=True)
class ImageBudget:
    """What the grid of an image depends on: the V4.1 release's ``vision_config`` values. The
    engines pass their vision config, which has the same fields."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: Optional[float] = None


@dataclass(frozen=True)
class ImageGrid:
    """Where one image lands: its resized size in pixels, its patch grid and its grid of LM
    embeddings."""

    height: int
    width: int
    patch_rows: int
    patch_cols: int
    rows: int
    cols: int

    @property
    def span_length(self) -> int:
        """Positions of the image's span: start, each row of embeddings plus a newline, end."""
        return self.rows * (self.cols + 1) + 2


class ImageSizeError(ValueError):
    """A size no grid can hold: not positive, or past the token budget even at its smallest."""


def _grid(height: int, width: int, budget) -> ImageGrid:
    p, r = budget.patch_size, budget.downsample_ratio
    patch_rows, patch_cols = height // p, width // p
    return ImageGrid(height, width, patch_rows, patch_cols, -(-patch_rows // r), -(-patch_cols // r))


def plan_image_grid(width: int, height: int, budget=ImageBudget(), detail: str = "high") -> ImageGrid:
    """The grid an image of ``width`` x ``height`` pixels is resized to: upscaled to
    ``min_pixels``, rounded up to whole patches, and shrunk to the ``max_image_tokens`` budget
    with its aspect kept when the span would not fit. ``detail="low"`` first scales an image
    down to ``LOW_DETAIL_MAX_SIDE`` pixels on its longer side (so a large image ends near
    ``min_pixels``); every other detail plans the image as it is."""
    if width <= 0 or height <= 0:
        raise ImageSizeError(f"image size must be positive, got {width} x {height}")
    p, tokens = budget.patch_size, budget.max_image_tokens
    w, h = width, height
    if budget.max_wh_ratio is not None and w > h * budget.max_wh_ratio:
        w = h * budget.max_wh_ratio  # very wide images are squeezed to the widest allowed aspect
    if detail == "low" and max(w, h) > LOW_DETAIL_MAX_SIDE:
        shrink = LOW_DETAIL_MAX_SIDE / max(w, h)
        w, h = max(math.floor(w * shrink + 0.5), 1), max(math.floor(h * shrink + 0.5), 1)  # halves up
    if w * h < budget.min_pixels:
        grow = math.sqrt(budget.min_pixels / (w * h))
        w, h = int(w * grow), int(h * grow)
    rows, cols = math.ceil(h / p), math.ceil(w / p)
    while rows * cols * p * p < budget.min_pixels:  # truncated by the upscale: one more patch on the long side
        rows, cols = (rows + 1, cols) if rows > cols else (rows, cols + 1)
    grid = _grid(rows * p, cols * p, budget)
    if grid.span_length > tokens:
        grid = _fit_budget(w, h, budget)
    if min(grid.height, grid.width) <= 0 or grid.span_length > tokens:
        raise ImageSizeError(f"a {width} x {height} image cannot fit max_image_tokens={tokens}")
    return grid


def _fit_budget(w: float, h: float, budget) -> ImageGrid:
    """The largest grid of the image's aspect whose span fits the budget: with rows = aspect *
    cols, the span rows * (cols + 1) + 2 reaches the budget at
    cols = sqrt((budget - 2) / aspect + 1/4) - 1/2."""
    p, tokens = budget.patch_size, budget.max_image_tokens
    cell = p * budget.downsample_ratio  # pixels per LM embedding along each side
    aspect = h / w
    max_cols = math.sqrt((tokens - 2) / aspect + 0.25) - 0.5
    max_rows = max_cols * aspect
    if max_cols < 1:  # taller than the budget allows even one column wide: one column of as many rows as fit
        return _grid((tokens - 2) // 2 * cell, cell, budget)
    if max_rows < 1:  # the wide counterpart: one row
        return _grid(cell, (tokens - 3) * cell, budget)
    scale = min(math.floor(max_cols) * cell / w, math.floor(max_rows) * cell / h)
    return _grid(math.floor(h * scale / p) * p, math.floor(w * scale / p) * p, budget)


def image_token_adjustment(images: Sequence["ResolvedImage"]) -> int:
    """Prompt positions the images take beyond their one placeholder each: what a prompt's
    token count must add to size the context (``resolve_max_tokens``)."""
    return sum(image.grid.span_length - 1 for image in images)


# ---- resolving ------------------------------------------------------------------------------

class ImageError(RecipeError):
    """An image the request cannot use. ``kind`` is the official package's name for the failure
    (``TooManyImages``, ``InvalidUrl``, ``InvalidDataUrl``, ``Decode``, ``Fetch``,
    ``UnsupportedMediaType``, ``ImageDimensionsTooLarge``); ``is_retryable`` is true only for a
    failed download."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message, param=param)
        self.kind = kind
        self.is_retryable = kind == "Fetch"


class ImageQuota:
    """The images and encoded bytes that the completed ``resolve_images`` calls of one request
    recorded: pass the same quota to every call so that the count limit holds across them. A
    failed call records nothing."""

    def __init__(self):
        self.image_count = 0
        self.byte_size = 0


def fit_to_grid(image, grid: ImageGrid, budget=ImageBudget()):
    """An RGB PIL image resized to its grid's pixels: stretched where ``max_wh_ratio`` squeezed it,
    else fitted inside with its aspect kept (bicubic) and centred on ``PAD_GREY``. An image already
    at its grid's size comes back unchanged, and plans to the same grid again."""
    from PIL import ImageOps

    size = (grid.width, grid.height)
    squeezed = budget.max_wh_ratio is not None and image.width >= budget.max_wh_ratio * image.height
    return image.resize(size) if squeezed else ImageOps.pad(image, size, color=PAD_GREY)


@dataclass(frozen=True)
class ResolvedImage:
    """An image ready for an engine, as the official resolver gives it: ``data`` is the image fitted
    to its grid (which ``detail`` chose; ``fit_to_grid``) and WebP-encoded, so an engine planning
    it at the default detail finds that grid again. ``format``, ``width``, ``height`` and
    ``source_bytes`` describe the image as given (the quota counts its bytes)."""

    data: bytes
    format: str
    width: int
    height: int
    grid: ImageGrid
    source_bytes: int


def fetch_url(url: str, timeout: float = 30.0, max_bytes: int = 64 << 20) -> bytes:
    """The default fetcher: an http(s) GET through urllib. It connects to any address; a server
    that takes image URLs from untrusted clients passes its own ``fetch`` that filters them."""
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) only, checked before
        data = response.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"more than {max_bytes} bytes")
    return data


def resolve_images(sources: Sequence[ImageSource], quota: ImageQuota | None = None,
                   fetch: Callable[[str], bytes] = fetch_url, budget=ImageBudget()) -> list[ResolvedImage]:
    """Image sources (``RenderResult.images``) -> their images, in order, or the ``ImageError``
    of the first that fails. Data URLs are decoded (base64 or percent-encoded), http(s) URLs
    fetched with ``fetch``, and each image is decoded to check its format and size."""
    quota = quota if quota is not None else ImageQuota()
    total = quota.image_count + len(sources)
    if total > MAX_IMAGES_PER_REQUEST:
        first_over = sources[max(MAX_IMAGES_PER_REQUEST - quota.image_count, 0)]
        raise ImageError("TooManyImages", f"{_prefix(first_over.path)}Too many images: max "
                         f"{MAX_IMAGES_PER_REQUEST} images per request, got {total}", first_over.path)
    images = [_resolve(source, fetch, budget) for source in sources]
    quota.image_count += len(images)
    quota.byte_size += sum(image.source_bytes for image in images)
    return images


def _prefix(path: str) -> str:
    return f"{path}: " if path else ""


def _image_error(kind: str, source: ImageSource, problem: str) -> ImageError:
    """An error about the one image a source holds, named `{path}.image[0]` as the official package does."""
    where = f"{source.path}.image[0]" if source.path else "image[0]"
    return ImageError(kind, f"{where}: {problem}", source.path or None)


def _unsupported(kind: str, source: ImageSource) -> ImageError:
    return _image_error(kind, source, UNSUPPORTED)


def _resolve(source: ImageSource, fetch: Callable[[str], bytes], budget) -> ResolvedImage:
    data = _source_bytes(source, fetch)
    if _sniff(data) is None:
        raise _unsupported("UnsupportedMediaType", source)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - the `images` extra installs it
        raise RecipeError("resolving images needs Pillow: pip install 'deepinfer-recipe[images]'",
                          status=500) from None
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            image_format, (width, height) = image.format, image.size
            if max(width, height) > MAX_IMAGE_SIDE:
                raise _unsupported("ImageDimensionsTooLarge", source)
            image.load()
            rgb = image if image.mode == "RGB" else image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise _unsupported("Decode", source) from None
    try:
        grid = plan_image_grid(width, height, budget, source.detail)
    except ImageSizeError:
        raise _unsupported("ImageDimensionsTooLarge", source) from None
    encoded = io.BytesIO()
    fit_to_grid(rgb, grid, budget).save(encoded, format="WEBP", quality=WEBP_QUALITY)
    return ResolvedImage(encoded.getvalue(), image_format, width, height, grid, len(data))


def _sniff(data: bytes) -> str | None:
    """The accepted format the leading bytes announce (content decides, not the declared media type);
    bytes that announce one and then do not decode are a decode failure, not an unsupported type."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for signature, name in SIGNATURES if data.startswith(signature)), None)


def _source_bytes(source: ImageSource, fetch: Callable[[str], bytes]) -> bytes:
    if source.kind == "bytes":
        return bytes(source.value)
    if source.kind == "data_url":
        header, comma, body = source.value.partition(",")
        if not header.startswith("data:") or not comma:
            raise _unsupported("InvalidDataUrl", source)
        if header.endswith(";base64"):
            try:
                return base64.b64decode(body, validate=True)
            except (binascii.Error, ValueError):
                raise _unsupported("InvalidDataUrl", source) from None
        return urllib.parse.unquote_to_bytes(body)
    if source.kind == "url":
        url = source.value
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ImageError("InvalidUrl", f'{_prefix(source.path)}invalid url: "{url}"', source.path or None)
        try:
            return fetch(url)
        except Exception:  # noqa: BLE001 - any failure of the download is the client's unfetchable URL
            raise _image_error("Fetch", source, f"Failed to download image from {url}") from None
    raise _unsupported("UnsupportedMediaType", source)  # a file reference: nothing to read here
