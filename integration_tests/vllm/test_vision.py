"""Images through the real server (the session checkpoint has a vision tower), with the official SDKs.

Guarantees: a Chat Completions request with a PNG data URI decodes greedily exactly like the core model run on
the same pixels (its span embeddings at the image positions vLLM laid out); the Anthropic Messages ``image``
block is served from the same prompt and gives the same answer, streamed or not; a repeated image is served
from the prefix cache, while a different image of the same size is not mistaken for it; a corrupt data URI or a
payload that is no image gets a 4xx with a message and the server keeps serving. A checkpoint converted without
its vision tensors serves text and refuses images with a 400 that names the missing tower.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from PIL import Image

from deepinfer_plugins.cli import launch_server, stop_process_group
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.image_processing import preprocess_image

from .conftest import LOG, MODEL, free_port
from .test_structured_and_cache import metric

OFF = {"chat_template_kwargs": {"thinking": False}, "return_token_ids": True}
QUESTION = "What is in this picture?"
MAX_TOKENS = 8


def png(seed: int, size=(40, 30)) -> bytes:
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(payload: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def image_chat(client, url: str, after: str = "", **kwargs):
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    if after:
        content.append({"type": "text", "text": after})
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                         temperature=0, max_tokens=MAX_TOKENS, extra_body=OFF, **kwargs)
    raw = out.model_dump()
    return raw["prompt_token_ids"], raw["choices"][0]["token_ids"], raw["choices"][0]["message"]["content"]


@torch.inference_mode()
def core_greedy(model, prompt_ids: list[int], image: bytes, max_tokens: int) -> list[int]:
    """The core model on the same prompt, the image's span embeddings at its positions; greedy, stop id 1."""
    pre = preprocess_image(image, model.args.vision)
    span = model.embed_image(pre.patches, pre.grid.patch_rows, pre.grid.patch_cols)
    cache = model.new_cache()
    logits = model(torch.tensor(prompt_ids), cache, bounded_replay=True, image_embeds=span)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token == 1:
            break
        logits = model(torch.tensor([token]), cache)
    return out


def test_image_chat_equals_the_core_model(openai_client, core_model):
    image = png(1)
    prompt_ids, output_ids, _ = image_chat(openai_client, data_uri(image))
    span = preprocess_image(image, core_model.args.vision).grid.span_length
    assert prompt_ids.count(core_model.args.image_token_id) == span, "one span of image positions per image"
    assert output_ids == core_greedy(core_model, prompt_ids, image, MAX_TOKENS)


def test_messages_image_block_answers_like_chat(openai_client, anthropic_client):
    image = png(2)
    _, _, chat_text = image_chat(openai_client, data_uri(image))
    content = [{"type": "text", "text": QUESTION},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(image).decode()}}]
    request = dict(model=MODEL, max_tokens=MAX_TOKENS, thinking={"type": "disabled"}, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": content}])
    out = anthropic_client.messages.create(**request)
    assert "".join(block.text for block in out.content if block.type == "text") == chat_text
    with anthropic_client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == chat_text


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


@pytest.mark.parametrize("url", [
    pytest.param("data:image/png;base64,@@@ not base64 @@@", id="corrupt base64"),
    pytest.param(data_uri(b"plain text, not an image"), id="not an image"),
])
def test_bad_image_gets_4xx_and_the_server_keeps_serving(server, openai_client, url):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.json()["error"]["message"]
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
    image = {**text, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_uri(png(6))}}]}]}
    r = httpx.post(f"{text_only_server}/v1/chat/completions", json=image, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "vision tower" in r.json()["error"]["message"]
    assert httpx.post(f"{text_only_server}/v1/chat/completions", json=text, timeout=60).status_code == 200
