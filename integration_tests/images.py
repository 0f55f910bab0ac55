"""Test images both engines' suites send: seeded noise, so two seeds are two different images of one size."""

from __future__ import annotations

import io

import torch
from PIL import Image


def png(seed: int, size=(40, 30)) -> bytes:
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()
