"""An image's span length (``plan_image_grid``) against the official deepseek-recipe 0.2.0's V4.1 image token
count (``MultiModalData.image_token_adjustment`` plus the one placeholder), the number a client is billed and a
prompt is sized by.

They agree on every size sampled, up to an aspect ratio of 400:1 (docs/model.md#image-preprocessing)."""

from __future__ import annotations

import random

import pytest

from deepinfer_plugins.models.deepseek_v41.args import VisionArgs
from deepinfer_plugins.models.deepseek_v41.image_processing import plan_image_grid

official = pytest.importorskip("deepseek_recipe._native", reason="deepseek_recipe (official package) not installed")


def official_span(width: int, height: int) -> int:
    return official.MultiModalData([official.ImageInfo(b"", width, height)]).image_token_adjustment() + 1


def sampled_sizes(count: int, max_aspect: float, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = [(1, 1), (14, 14), (42, 42), (543, 544), (1024, 768), (4000, 4000), (8000, 160)]
    while len(sizes) < count:
        short = rng.randint(1, 4000)
        long = max(1, int(short * rng.uniform(1, max_aspect)))
        sizes.append((long, short) if rng.random() < 0.5 else (short, long))
    return sizes


def test_span_lengths_equal_the_official_image_token_counts():
    vision = VisionArgs()
    sizes = sampled_sizes(3000, max_aspect=50)
    pairs = [(w, h, official_span(w, h), plan_image_grid(w, h, vision).span_length) for w, h in sizes]
    mismatches = [pair for pair in pairs if pair[2] != pair[3]]
    assert not mismatches, f"{len(mismatches)} of {len(sizes)} sizes differ, e.g. (w, h, official, ours) {mismatches[:5]}"


def test_span_lengths_equal_the_official_counts_at_extreme_aspect_ratios():
    """Past about 59:1 the upscale's truncation leaves the area under ``min_pixels``, which the official resize
    makes up with one more patch on the long side."""
    vision = VisionArgs()
    sizes = [(w, h) for w, h in sampled_sizes(3000, max_aspect=400, seed=1) if max(w, h) <= 20_000]
    pairs = [(w, h, official_span(w, h), plan_image_grid(w, h, vision).span_length) for w, h in sizes]
    mismatches = [pair for pair in pairs if pair[2] != pair[3]]
    assert not mismatches, f"{len(mismatches)} of {len(sizes)} sizes differ, e.g. (w, h, official, ours) {mismatches[:5]}"
