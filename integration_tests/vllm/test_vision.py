"""Images through the real server (the session checkpoint has a vision tower), with the official SDKs.

Guarantees: an image sent through Chat Completions (``image_url``), Responses (``input_image``) or Anthropic
Messages (an ``image`` block with a base64 source), streamed or not, gets exactly the answer of the core model
run greedily on the same prompt with the image's span embeddings at the positions vLLM laid out; two images in
one prompt land in their order; an image part's ``detail`` sizes the image as the recipe plans it; a repeated
image is served from the prefix cache, while a different image of the same size is not mistaken for it. Bad
images get a 400 whose message names the image and its problem, and the server keeps serving: corrupt base64, a
payload that is no image, a format vLLM refuses to decode, an image past the pixel limit
(``VLLM_MAX_IMAGE_PIXELS``), more images than ``--limit-mm-per-prompt`` allows (the session server allows 2). An
http image URL is fetched and answered like the same image sent inline; one the server cannot reach, one its
host answers with 404, and a local file URL (no ``--allowed-local-media-path``) get a 4xx. A checkpoint converted
without its vision tensors serves text and refuses images with a 400 that names the missing tower.
"""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib

import httpx
import pytest
import torch
from PIL import Image

from deepinfer_plugins.cli import launch_server, stop_process_group
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.image_processing import plan_image_grid, preprocess_image

from ..images import png
from .conftest import IMAGES_PER_PROMPT, LOG, MODEL, free_port
from .test_structured_and_cache import metric

OFF = {"chat_template_kwargs": {"thinking": False}, "return_token_ids": True}
QUESTION = "What is in this picture?"
MAX_TOKENS = 8


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels but holds almost no data: past a pixel limit, it must be
    refused from its header, before anything is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


def eps() -> bytes:
    """An image in a format PIL reads but vLLM refuses to decode (its loader would run Ghostscript)."""
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 30, 30)).save(buffer, format="EPS")
    return buffer.getvalue()


def data_uri(payload: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def image_content(urls: list[str], after: str = "") -> list[dict]:
    content = [{"type": "text", "text": QUESTION}, *({"type": "image_url", "image_url": {"url": url}} for url in urls)]
    return content + ([{"type": "text", "text": after}] if after else [])


def image_chat(client, urls: str | list[str], after: str = ""):
    urls = [urls] if isinstance(urls, str) else urls
    messages = [{"role": "user", "content": image_content(urls, after)}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                         extra_body=OFF)
    raw = out.model_dump()
    return raw["prompt_token_ids"], raw["choices"][0]["token_ids"], raw["choices"][0]["message"]["content"]


@torch.inference_mode()
def core_greedy(model, prompt_ids: list[int], images: bytes | list[bytes], max_tokens: int,
                detail: str = "high") -> list[int]:
    """The core model on the same prompt, each image's span embeddings at its positions in order; greedy, stop
    id 1."""
    spans = []
    for image in [images] if isinstance(images, bytes) else images:
        pre = preprocess_image(image, model.args.vision, detail=detail)
        spans.append(model.embed_image(pre.patches, pre.grid.patch_rows, pre.grid.patch_cols))
    cache = model.new_cache()
    logits = model(torch.tensor(prompt_ids), cache, bounded_replay=True, image_embeds=torch.cat(spans))
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token == 1:
            break
        logits = model(torch.tensor([token]), cache)
    return out


def core_checked_chat(client, core_model, image: bytes) -> tuple[list[int], str]:
    """Chat's prompt ids and answer for the image, the answer checked against the core model's."""
    prompt_ids, output_ids, text = image_chat(client, data_uri(image))
    assert output_ids == core_greedy(core_model, prompt_ids, image, MAX_TOKENS)
    return prompt_ids, text


def test_image_chat_equals_the_core_model(openai_client, core_model):
    image = png(1)
    prompt_ids, text = core_checked_chat(openai_client, core_model, image)
    span = preprocess_image(image, core_model.args.vision).grid.span_length
    assert prompt_ids.count(core_model.args.image_token_id) == span, "one span of image positions per image"
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": image_content([data_uri(image)])}], temperature=0,
        max_tokens=MAX_TOKENS, extra_body=OFF, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


def test_two_images_land_in_their_order(openai_client, core_model):
    """Spans of different sizes, so that a swap would also change the prompt."""
    images = [png(8), png(9, size=(90, 20))]
    prompt_ids, output_ids, _ = image_chat(openai_client, [data_uri(image) for image in images])
    spans = [preprocess_image(image, core_model.args.vision).grid.span_length for image in images]
    assert spans[0] != spans[1]
    assert prompt_ids.count(core_model.args.image_token_id) == sum(spans)
    assert output_ids == core_greedy(core_model, prompt_ids, images, MAX_TOKENS)


def test_a_low_detail_image_gets_the_span_and_the_pixels_of_its_detail(openai_client, core_model):
    """``detail: low`` shrinks a large image before its grid is planned (what the recipe counts); vLLM's processor
    plans every image at the default detail, so the renderer hands it the image fitted to the low-detail grid. At
    the session's vision budget a 513 x 1197 image takes 8 positions at low detail and 14 at high; both answers are
    the core model's on the pixels of their detail, in either order (no cache entry of one serves the other)."""
    image = png(12, size=(513, 1197))
    spans = {detail: plan_image_grid(513, 1197, core_model.args.vision, detail).span_length
             for detail in ("low", "high")}
    assert spans == {"low": 8, "high": 14}
    for detail in ("low", "high", "low"):
        content = [{"type": "text", "text": QUESTION},
                   {"type": "image_url", "image_url": {"url": data_uri(image), "detail": detail}}]
        raw = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    temperature=0, max_tokens=MAX_TOKENS, extra_body=OFF).model_dump()
        prompt_ids = raw["prompt_token_ids"]
        assert prompt_ids.count(core_model.args.image_token_id) == spans[detail], detail
        assert raw["choices"][0]["token_ids"] == core_greedy(core_model, prompt_ids, image, MAX_TOKENS, detail)


def test_responses_input_image_answers_like_the_core_model(openai_client, core_model):
    image = png(7)
    prompt_ids, text = core_checked_chat(openai_client, core_model, image)
    request = dict(model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0,
                   extra_body={"chat_template_kwargs": {"thinking": False}},
                   input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                                       {"type": "input_image", "image_url": data_uri(image)}]}])
    out = openai_client.responses.create(**request)
    assert out.usage.input_tokens == len(prompt_ids), "the same prompt as Chat's"
    assert out.output_text == text
    streamed = "".join(event.delta for event in openai_client.responses.create(**request, stream=True)
                       if event.type == "response.output_text.delta")
    assert streamed == text


def test_messages_image_block_answers_like_the_core_model(openai_client, anthropic_client, core_model):
    image = png(2)
    prompt_ids, text = core_checked_chat(openai_client, core_model, image)
    content = [{"type": "text", "text": QUESTION},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(image).decode()}}]
    request = dict(model=MODEL, max_tokens=MAX_TOKENS, thinking={"type": "disabled"}, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": content}])
    out = anthropic_client.messages.create(**request)
    cached = (out.usage.cache_read_input_tokens or 0) + (out.usage.cache_creation_input_tokens or 0)
    assert out.usage.input_tokens + cached == len(prompt_ids), "the same prompt as Chat's"
    assert "".join(block.text for block in out.content if block.type == "text") == text
    with anthropic_client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == text


def test_repeated_image_hits_the_prefix_cache_and_another_does_not(server, openai_client, core_model):
    """The prompt fills a 256-token block past the image, so the block holding the image can be cached; the
    other image has the same size, hence the same token ids, and only its content hash tells it apart."""
    first, other = png(3), png(4)
    after = " ".join(f"Rule {i}: look closely and be precise." for i in range(40))
    image_chat(openai_client, data_uri(first), after)
    before = metric(server, "vllm:prefix_cache_hits_total")
    image_chat(openai_client, data_uri(first), after)
    repeated = metric(server, "vllm:prefix_cache_hits_total")
    assert repeated - before >= 256, "the same image should be served from the prefix cache"
    prompt_ids, output_ids, _ = image_chat(openai_client, data_uri(other), after)
    assert metric(server, "vllm:prefix_cache_hits_total") == repeated, "a different image must not hit"
    assert output_ids == core_greedy(core_model, prompt_ids, other, MAX_TOKENS)


BAD_IMAGES = {  # name -> (the request's image URLs, what the 400's message must say)
    "corrupt base64": (["data:image/png;base64,@@@ not base64 @@@"], "image 1 of the request: the data URI's "
                                                                     "payload is not valid base64"),
    "not an image": ([data_uri(b"plain text, not an image")], "image 1 of the request: the payload (image/png, "
                                                              "24 bytes) is not an image that can be decoded"),
    "unsupported format": ([data_uri(png(10)), data_uri(eps(), "application/postscript")],
                           "image 2 of the request: EPS images are not supported"),
    "past the pixel limit": ([data_uri(png_header(20_000, 10_000))],
                             "image 1 of the request: the image is over the limit of 178956970 pixels"),
    "more images than allowed": ([data_uri(png(11 + i)) for i in range(IMAGES_PER_PROMPT + 1)],
                                 f"At most {IMAGES_PER_PROMPT} image(s) may be provided in one prompt"),
}


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_bad_image_is_a_400_naming_it_and_the_server_keeps_serving(server, openai_client, name):
    urls, message = BAD_IMAGES[name]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": image_content(urls)}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert message in r.json()["error"]["message"]
    assert image_chat(openai_client, data_uri(png(5)))[1]


def test_bad_image_block_is_a_400_in_messages_too(server, anthropic_client):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@@ not base64 @@@"}}]}]}
    r = httpx.post(f"{server}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "image 1 of the request: the data URI's payload is not valid base64" in r.json()["error"]["message"]
    text = anthropic_client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert text.content


def test_pixel_limit_is_vllm_max_image_pixels(monkeypatch):
    """An operator lowers the limit with vLLM's own variable; the message gives the image's size."""
    from deepinfer_plugins.vllm.vision import check_image_data_uri

    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", "1000")
    check_image_data_uri(data_uri(png(1, size=(40, 25))), "image 1")
    with pytest.raises(ValueError, match=r"image 1: the image is 40 x 26 = 1040 pixels, over the limit of 1000"):
        check_image_data_uri(data_uri(png(1, size=(40, 26))), "image 1")


class ImageHost(http.server.BaseHTTPRequestHandler):
    """Serves ``png(21)`` at /noise.png and 404 elsewhere: an image URL the server fetches over http."""

    def do_GET(self):  # noqa: N802 - the handler name http.server calls
        if self.path != "/noise.png":
            self.send_error(404)
            return
        body = png(21)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


def test_image_url_is_fetched_and_answered_like_the_same_data_uri(openai_client, core_model, image_host):
    fetched = image_chat(openai_client, f"{image_host}/noise.png")
    assert fetched[:2] == image_chat(openai_client, data_uri(png(21)))[:2]
    assert fetched[1] == core_greedy(core_model, fetched[0], png(21), MAX_TOKENS)


def unfetchable_urls(image_host: str) -> dict[str, tuple[str, int, str]]:
    """name -> (an image URL the server cannot or may not fetch, the status, what the message must say). A 4xx
    from the image host is vLLM's 422; the rest are the client's 400."""
    return {"not found": (f"{image_host}/missing.png", 422, "Failed to fetch media from URL: HTTP 404 error"),
            "connection refused": (f"http://127.0.0.1:{free_port()}/noise.png", 400,
                                   "an image URL of the request cannot be fetched: Cannot connect to host"),
            "local file": ("file:///etc/hostname", 400, "image 1 of the request: file URLs are refused")}


@pytest.mark.parametrize("name", ["not found", "connection refused", "local file"])
def test_image_url_the_server_cannot_fetch_is_a_4xx(server, openai_client, image_host, name):
    url, status, message = unfetchable_urls(image_host)[name]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": image_content([url])}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert message in r.json()["error"]["message"], r.text[:500]
    assert image_chat(openai_client, data_uri(png(5)))[1]


@pytest.fixture(scope="module")
def text_only_server(tmp_path_factory):
    """A checkpoint converted without its vision tensors (its config still has ``vision_config``)."""
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("tiny-text"), "tiny", seed=0, text_only=True)
    process, base = launch_server(checkpoint, free_port(), ["--dtype", "float32", "--max-model-len", "1024",
                                                            "--served-model-name", MODEL],
                                  LOG.with_name(LOG.stem + "-text-only.log"))
    yield base
    stop_process_group(process)


def test_text_only_checkpoint_serves_text_and_refuses_images(text_only_server):
    text = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]}
    assert httpx.post(f"{text_only_server}/v1/chat/completions", json=text, timeout=60).status_code == 200
    image = {**text, "messages": [{"role": "user", "content": image_content([data_uri(png(6))])}]}
    r = httpx.post(f"{text_only_server}/v1/chat/completions", json=image, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "vision tower" in r.json()["error"]["message"]
    assert httpx.post(f"{text_only_server}/v1/chat/completions", json=text, timeout=60).status_code == 200
