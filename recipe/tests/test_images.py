"""Image resolving against the official deepseek-recipe 0.2.0's ImageResolver (skipped when not installed).

Guarantees: for every detail level, the size an image is resized to, the image handed on (WebP, at that size) and
the token adjustment it adds to a prompt are the official resolver's, on images of every aspect up to 50:1 and every side up to the 8192-pixel limit, in
each accepted format; the request limits (600 images per request, counted across calls that share a quota; 8192
pixels a side; PNG, JPEG, GIF or WebP content) and the failures of a source (bad data URL, undecodable bytes,
unreachable or non-http URL) raise ``ImageError`` with the official kind and message; the quota records the same
count and bytes, and a failed call records nothing.
"""
from __future__ import annotations

import base64
import io
import random
import socket

import pytest

official = pytest.importorskip("deepseek_recipe", reason="deepseek_recipe (official package) not installed")
Image = pytest.importorskip("PIL.Image")

from deepinfer_recipe import ImageError, ImageQuota, image_token_adjustment, resolve_images  # noqa: E402
from deepinfer_recipe.conversation import ImageSource  # noqa: E402

RESOLVER = official.ImageResolver(official.ReqwestImageFetcher(), official.OpenCvImagePreprocessor())
DETAILS = ("low", "high", "original", "auto")
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


def encoded(width: int, height: int, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    fast = {"compress_level": 1} if fmt == "PNG" else {}  # the same pixels; zlib's default level is slower
    Image.new("RGB", (width, height), (200, 30, 40)).save(buffer, fmt, **fast)
    return buffer.getvalue()


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def official_source(kind: str, value, detail: str, path: str):
    make = {"data_url": official.DataUrlImageSource, "url": official.UrlImageSource,
            "bytes": official.BytesImageSource}[kind]
    return make(value, detail, path=path)


def delivered(data: bytes) -> tuple[str, tuple[int, int]]:
    """The format and size of the image bytes a resolver hands an engine."""
    with Image.open(io.BytesIO(data)) as image:
        return image.format, image.size


def both(sources: list[tuple[str, object, str, str]], official_quota=None, our_quota=None):
    """-> (official outcome, ours): ("ok", [(width, height, (format, size) of the bytes)], adjustment) or
    ("error", kind, message)."""
    try:
        data = RESOLVER.resolve([official_source(*s) for s in sources], official_quota or official.ImageQuota())
        want = ("ok", [(i.width, i.height, delivered(i.data)) for i in data.images], data.image_token_adjustment())
    except official.ImageError as exc:
        want = ("error", exc.kind, str(exc))
    try:
        images = resolve_images([ImageSource(*s) for s in sources], our_quota)
        got = ("ok", [(i.grid.width, i.grid.height, delivered(i.data)) for i in images],
               image_token_adjustment(images))
    except ImageError as exc:
        got = ("error", exc.kind, exc.message)
    return want, got


def sizes(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = [(1, 1), (14, 14), (512, 512), (513, 40), (544, 544), (1024, 768), (8192, 8192), (8192, 164)]
    while len(out) < count:
        short = rng.randint(1, 2500)
        long = min(8192, max(1, int(short * rng.uniform(1, 50))))
        out.append((long, short) if rng.random() < 0.5 else (short, long))
    return out


@pytest.mark.parametrize("detail", DETAILS)
def test_resized_sizes_and_token_adjustment_are_the_official(detail):
    """40 sizes for each of the two details that plan differently, 12 for the two that plan as ``high`` does."""
    cases = sizes(40 if detail in ("low", "high") else 12, seed=DETAILS.index(detail))
    mismatches = []
    for w, h in cases:
        want, got = both([("data_url", data_url(encoded(w, h)), detail, "messages.0.content[1]")])
        if want != got:
            mismatches.append(((w, h), want, got))
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, e.g. {mismatches[:3]}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_accepted_format_and_source_kind(fmt):
    payload = encoded(300, 120, fmt)
    for kind, value in (("data_url", data_url(payload, FORMATS[fmt])), ("bytes", payload)):
        want, got = both([(kind, value, "low", "p"), (kind, value, "high", "q")])
        assert want == got and want[0] == "ok"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BMP = io.BytesIO()
Image.new("RGB", (30, 30)).save(BMP, "BMP")
FAILURES = {  # name -> the sources of one call
    "side past 8192": [("data_url", data_url(encoded(8193, 100)), "high", "messages.0.content[1]")],
    "bad base64": [("data_url", "data:image/png;base64,@@@", "high", "input[0]")],
    "not an image": [("data_url", data_url(b"plain text"), "high", ".messages[0]")],
    "BMP": [("data_url", data_url(BMP.getvalue(), "image/bmp"), "high", "p")],
    "percent-encoded garbage": [("data_url", "data:image/png,%89PNG", "high", "p")],
    "unreachable URL": [("url", f"http://127.0.0.1:{closed_port()}/a.png", "high", "messages.2.content.0.tool_result")],
    "non-http URL": [("url", "ftp://example.com/a.png", "high", "input[3]")],
    "no path": [("data_url", "data:image/png;base64,@@@", "high", "")],
    "second source bad": [("bytes", encoded(20, 20), "high", "a"), ("bytes", b"junk", "high", "b")],
    "601 images": [("bytes", encoded(10, 10), "high", f"m{i}") for i in range(601)],
}


@pytest.mark.parametrize("name", FAILURES)
def test_failures_are_the_official_errors(name):
    want, got = both(FAILURES[name])
    assert want[0] == "error" and got == want


def test_quota_counts_across_calls_and_a_failed_call_records_nothing():
    official_quota, our_quota = official.ImageQuota(), ImageQuota()
    first = [("bytes", encoded(10 + i, 10), "high", "x") for i in range(300)]
    assert both(first, official_quota, our_quota)[0][0] == "ok"
    assert (our_quota.image_count, our_quota.byte_size) == (official_quota.image_count(), official_quota.byte_size())
    failed = both([("bytes", b"junk", "high", "z")], official_quota, our_quota)
    assert failed[0] == failed[1] and failed[0][0] == "error"
    assert (our_quota.image_count, our_quota.byte_size) == (official_quota.image_count(), official_quota.byte_size())
    over = both([("bytes", encoded(10, 10), "high", "y")] * 301, official_quota, our_quota)
    assert over[0] == over[1] and over[0][1] == "TooManyImages"
    assert our_quota.image_count == official_quota.image_count() == 300


@pytest.mark.parametrize("detail", ["low", "high"])
def test_the_image_handed_on_is_the_source_fitted_to_its_grid(detail):
    """The pixels are the source's fitted to the grid (letterboxed in grey where the aspects differ), within the
    loss of the WebP encoding, and their size plans to the same grid again."""
    from deepinfer_recipe import plan_image_grid

    source = Image.new("RGB", (1300, 400), (200, 30, 40))
    buffer = io.BytesIO()
    source.save(buffer, "PNG")
    image, = resolve_images([ImageSource("bytes", buffer.getvalue(), detail, "p")])
    with Image.open(io.BytesIO(image.data)) as handed:
        pixels = handed.convert("RGB")
    assert pixels.size == (image.grid.width, image.grid.height)
    assert plan_image_grid(*pixels.size) == image.grid
    centre = pixels.getpixel((pixels.width // 2, pixels.height // 2))
    assert max(abs(a - b) for a, b in zip(centre, (200, 30, 40))) <= 8
    if pixels.height / pixels.width > 400 / 1300 + 0.05:  # letterboxed above and below
        assert max(abs(a - 127) for a in pixels.getpixel((pixels.width // 2, 0))) <= 8
