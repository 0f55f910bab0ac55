"""The vision path on the tiny model (preset tiny-vocab256, image token 255): span layout, what image spans change
in the language model (bias_vl routing, dead Engram tokens with gate 0), cache-exact decoding with images in the
sequence, and the resize policy's budget. Agreement with the independent port is tests/oracle/test_nemo_vision.py.
"""

import dataclasses
import math
import random

import pytest
import torch
from PIL import Image

from deepinfer_plugins.models.deepseek_v41 import (ImageInputError, ModelArgs, VisionInputError, plan_image_grid,
                                                   preprocess_image)
from deepinfer_plugins.models.deepseek_v41.image_processing import resize_for_detail

from ..conftest import prompt
from .test_decode import assert_same_logits

IMAGE = 255


def patches(n_h, n_w, seed):
    return torch.randn(n_h * n_w, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def image_prompt(model, pieces, seed=0):
    """pieces: text lengths (int) and patch grids ((n_h, n_w)) in order -> (ids, span rows of every image)."""
    ids, spans = [], []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            ids.append(prompt(piece, seed + i))
        else:
            spans.append(model.embed_image(patches(*piece, seed + i), *piece))
            ids.append(torch.full((spans[-1].shape[0],), IMAGE))
    return torch.cat(ids), torch.cat(spans)


def rows_for(ids, spans, start, end):
    """The span rows of the image positions among ids[start:end]."""
    before = int((ids[:start] == IMAGE).sum())
    return spans[before: before + int((ids[start:end] == IMAGE).sum())]


def test_span_layout(tiny256):
    n_h, n_w = 7, 8  # 3 x 3 LM embeddings after zero-padding the grid to 9 x 9
    span = tiny256.embed_image(patches(n_h, n_w, 0), n_h, n_w)
    rows, cols = 3, 3
    assert span.shape == (rows * (cols + 1) + 2, tiny256.args.hidden_size)
    assert torch.equal(span[0], tiny256.image_start.float()) and torch.equal(span[-1], tiny256.image_end.float())
    newlines = [1 + r * (cols + 1) + cols for r in range(rows)]
    for row in range(1, span.shape[0] - 1):
        assert torch.equal(span[row], tiny256.image_newline.float()) == (row in newlines), row


def test_tower_attends_over_the_whole_image(tiny256):
    """Bidirectional: changing the last patch changes the first cell's embedding (causal attention would not)."""
    x = patches(6, 6, 1)
    changed = x.clone()
    changed[-1] += 1
    first = [tiny256.embed_image(p, 6, 6)[1] for p in (x, changed)]
    assert not torch.allclose(*first)


def test_image_inputs_are_checked(tiny256):
    with pytest.raises(VisionInputError, match=r"\[12, 3, 14, 14\]"):
        tiny256.embed_image(patches(3, 3, 0), 3, 4)
    ids, spans = image_prompt(tiny256, [4, (3, 3), 2])
    assert spans.shape[0] == 4  # one embedding: start, embedding, newline, end
    with pytest.raises(ImageInputError, match=r"image_embeds must be \[4, 64\]"):
        tiny256(ids, image_embeds=spans[:3])


def test_image_spans_route_with_bias_vl(tiny256):
    """bias_vl steers every span token, and only span tokens: text-only logits ignore it."""
    ids, spans = image_prompt(tiny256, [10, (7, 8), 6])
    text = prompt(30, 5)
    before_image, before_text = tiny256(ids, image_embeds=spans), tiny256(text)
    saved = [layer.ffn.gate.bias_vl.clone() for layer in tiny256.layers]
    try:
        for layer in tiny256.layers:
            layer.ffn.gate.bias_vl.copy_(torch.randn(layer.ffn.gate.bias_vl.shape) * 10)
        after_image, after_text = tiny256(ids, image_embeds=spans), tiny256(text)
    finally:
        for layer, bias in zip(tiny256.layers, saved):
            layer.ffn.gate.bias_vl.copy_(bias)
    assert torch.equal(before_text, after_text)
    # causal: the text before the image is untouched (up to the row-count dependence of CPU GEMMs, test_decode.py)
    torch.testing.assert_close(before_image[:10], after_image[:10], atol=1e-5, rtol=0)
    assert (before_image[10:] - after_image[10:]).abs().amax(-1).min() > 1e-4  # from the image_start on


def test_span_tokens_are_dead_for_engram_hashing(tiny256):
    """After an image the n-grams restart as at a sequence start, and span positions hash like the pad."""
    hasher, text = tiny256.hasher, prompt(6, 3)
    with_image = torch.cat((prompt(5, 4), torch.full((7,), IMAGE), text))
    rows = hasher(with_image, [[]], [with_image.numel()])
    assert torch.equal(rows[12:], hasher(text, [[]], [6]))
    pads = torch.full((1,), tiny256.args.engram_pad_token_id)
    pad_row = hasher.forward(pads, [[2, 2, 2]], [1])
    assert torch.equal(rows[5:12], pad_row.expand(7, -1, -1))


def test_engram_gate_is_zero_on_span_tokens(tiny256):
    layer = tiny256.args.engram_layer_ids[0]
    engram = tiny256.layers[layer].engram
    streams = torch.randn(6, tiny256.args.hc_mult, tiny256.args.hidden_size)
    row_ids = tiny256.hasher(prompt(6, 9), [[]], [6])[:, engram.table]
    image_rows = torch.tensor([False, True, True, False, True, False])
    out = engram(streams, row_ids, image_rows)
    assert torch.equal(out[image_rows], streams[image_rows])
    assert (out[~image_rows] - streams[~image_rows]).abs().amax() > 1e-3


@pytest.mark.parametrize("cuts", [(0, 15, 27, 32, 44), (0, 11, 12, 26, 31, 34, 44)])
def test_chunked_prefill_and_decode_with_images_equal_the_full_forward(tiny256, cuts):
    """Two images of different sizes between text; chunk boundaries fall inside both spans (image A occupies
    10..23, image B 30..34), then 12 single-token decode steps."""
    ids, spans = image_prompt(tiny256, [10, (7, 8), 6, (3, 5), 9, 12])
    assert ids.numel() == 56 and torch.equal(ids[10:24], torch.full((14,), IMAGE))
    full = tiny256(ids, image_embeds=spans)
    cache = tiny256.new_cache()
    pieces = [tiny256(ids[a:b], cache, image_embeds=rows_for(ids, spans, a, b) if (ids[a:b] == IMAGE).any()
                      else None) for a, b in zip(cuts, cuts[1:])]
    pieces += [tiny256(ids[i:i + 1], cache) for i in range(cuts[-1], ids.numel())]
    assert_same_logits(torch.cat(pieces), full)


def test_bounded_replay_with_an_image_equals_the_full_prefill(tiny256):
    ids, spans = image_prompt(tiny256, [20, (7, 8), 30])
    full = tiny256(ids, image_embeds=spans)
    last = tiny256(ids, tiny256.new_cache(), bounded_replay=True, image_embeds=spans)
    assert_same_logits(last, full[-1:])


TINY_VISION = ModelArgs.preset("tiny-vocab256").vision
FULL_VISION = ModelArgs.preset("full").vision


@pytest.mark.parametrize("vision", [TINY_VISION, FULL_VISION], ids=["tiny", "full"])
def test_resize_policy_fits_the_budget(vision):
    sizes = [(w, h) for w in (1, 13, 56, 300, 640, 1920, 5000, 20000) for h in (1, 9, 77, 480, 1080, 7000)]
    for w, h in sizes:
        grid = plan_image_grid(w, h, vision)
        assert grid.span_length <= vision.max_image_tokens, (w, h, grid)
        assert grid.height == grid.patch_rows * vision.patch_size and grid.width == grid.patch_cols * 14
        assert (grid.rows, grid.cols) == (math.ceil(grid.patch_rows / 3), math.ceil(grid.patch_cols / 3))
    small = plan_image_grid(100, 100, FULL_VISION)  # upscaled to min_pixels = 544^2, then up to whole patches
    assert (small.width, small.height) == (546, 546)
    large = plan_image_grid(4000, 3000, FULL_VISION)  # downscaled to the budget, aspect kept to a cell
    assert large.span_length <= 1024 and abs(large.width / large.height - 4 / 3) < 0.05
    with pytest.raises(VisionInputError, match="positive"):
        plan_image_grid(0, 10, FULL_VISION)


def test_preprocessing_letterboxes_and_normalises():
    image = Image.new("RGB", (120, 60), (255, 0, 127))
    out = preprocess_image(image, TINY_VISION, pixel_dtype=torch.float32)
    grid = out.grid
    assert out.patches.shape == (grid.patch_rows * grid.patch_cols, 3, 14, 14)
    pixels = out.patches.view(grid.patch_rows, grid.patch_cols, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(
        3, grid.height, grid.width)
    centre = pixels[:, grid.height // 2, grid.width // 2]
    torch.testing.assert_close(centre, torch.tensor([1.0, -1.0, 127 / 127.5 - 1]))
    if grid.height / grid.width > 60 / 120 + 0.05:  # letterboxed top and bottom in grey
        torch.testing.assert_close(pixels[:, 0, 0], torch.full((3,), 127 / 127.5 - 1))
    with pytest.raises(VisionInputError, match="cannot decode"):
        preprocess_image(b"not an image", TINY_VISION)


def test_a_grid_sized_image_plans_to_its_own_grid():
    """What ``resize_for_detail`` rests on: an image already at the size a detail planned for it plans to the
    same grid at the default detail (checked over sizes, squeezing budgets and small budgets)."""
    budgets = [FULL_VISION, TINY_VISION, dataclasses.replace(FULL_VISION, max_wh_ratio=4.0),
               dataclasses.replace(TINY_VISION, max_wh_ratio=2.0),
               dataclasses.replace(TINY_VISION, max_image_tokens=200, min_pixels=10000, max_wh_ratio=3.0)]
    r = random.Random(0)
    checked = 0
    for vision in budgets:
        for _ in range(3000):
            width, height = r.randint(1, 8192), r.randint(1, 8192)
            if r.random() < 0.3:
                width = height * r.randint(2, 12)
            try:
                grid = plan_image_grid(width, height, vision, "low")
            except VisionInputError:
                continue
            if grid != plan_image_grid(width, height, vision):
                checked += 1
                assert plan_image_grid(grid.width, grid.height, vision) == grid, (vision, width, height)
    assert checked > 5000


@pytest.mark.parametrize("size, squeeze", [((513, 1197), None), ((537, 248), None), ((558, 105), None),
                                           ((600, 1400), 2.0), ((1147, 570), 2.0)])
def test_an_image_resized_for_its_detail_preprocesses_as_that_detail(size, squeeze):
    """Each a size whose low-detail grid differs from the default's (the wide ones squeezed by max_wh_ratio)."""
    vision = dataclasses.replace(TINY_VISION, max_wh_ratio=squeeze)
    image = Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(size[0])).numpy())
    want = preprocess_image(image, vision, pixel_dtype=torch.float32, detail="low")
    assert want.grid != preprocess_image(image, vision, pixel_dtype=torch.float32).grid
    got = preprocess_image(resize_for_detail(image, vision, "low"), vision, pixel_dtype=torch.float32)
    assert got.grid == want.grid and torch.equal(got.patches, want.patches)
    assert resize_for_detail(image, vision, "high") is None and resize_for_detail(image, vision, "auto") is None
