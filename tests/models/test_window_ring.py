"""WindowRing: the in-memory window cache reads back what it was given, and refuses positions it no longer holds."""

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41.kv_cache import WindowRing

DIM = 64


def _ring(size):
    return WindowRing(torch.zeros(size, ops.record_bytes("fp8_window", DIM), dtype=torch.uint8), "test", "fp8_window")


def _latents(n, seed):
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


def test_reads_the_last_positions_written_across_the_wrap():
    ring = _ring(4)
    ring.write(_latents(3, 0), 0)
    latest = _latents(4, 1)
    ring.write(latest, 3)  # positions 3..6: slots 3, 0, 1, 2
    expected = ops.pack_cache_records(latest[1:], "fp8_window")
    assert torch.equal(ring.read(4, 7), expected)
    assert ring.slots(4, 7).tolist() == [0, 1, 2]


def test_a_long_write_keeps_only_the_last_size_positions():
    ring = _ring(4)
    latents = _latents(10, 2)
    ring.write(latents, 5)  # positions 5..14
    assert torch.equal(ring.read(11, 15), ops.pack_cache_records(latents[6:], "fp8_window"))
    with pytest.raises(RuntimeError, match="does not hold positions 10..14"):
        ring.read(10, 15)


def test_rollback_forgets_later_positions():
    """The positions kept read back unchanged, the forgotten ones are refused, and a rewrite of a forgotten
    position reads back its new record."""
    ring = _ring(6)
    latents, rewritten = _latents(5, 3), _latents(1, 4)
    ring.write(latents, 0)
    ring.rollback(3)
    assert torch.equal(ring.read(0, 3), ops.pack_cache_records(latents[:3], "fp8_window"))
    with pytest.raises(RuntimeError, match="does not hold positions 2..3"):
        ring.read(2, 4)
    ring.write(rewritten, 3)
    assert torch.equal(ring.read(0, 4), ops.pack_cache_records(torch.cat((latents[:3], rewritten)), "fp8_window"))
