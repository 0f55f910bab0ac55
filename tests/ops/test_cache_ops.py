"""Cache-record references: record sizes of docs/model.md#cache-records, and unpack(pack(x)) == the matching
fake-quant, bit for bit."""

import pytest
import torch

from deepinfer_plugins import ops


def test_record_sizes_match_the_spec():
    assert ops.record_bytes("fp8_window", 512) == 528
    assert ops.record_bytes("nvfp4", 512) == 288
    assert ops.record_bytes("mxfp4", 128) == 68


@pytest.mark.parametrize("fmt,fake", [("fp8_window", "fp8_fake_quant"), ("nvfp4", "nvfp4_fake_quant"),
                                      ("mxfp4", "mxfp4_fake_quant")])
def test_unpack_of_pack_is_the_fake_quant(fmt, fake):
    x = torch.randn(9, 512) * torch.logspace(-6, 3, 9)[:, None]
    x[0, :40] = 0
    got = ops.unpack_cache_records(ops.pack_cache_records(x, fmt), fmt, 512, torch.float32)
    assert torch.equal(got, getattr(ops, fake)(x))


def test_write_skips_negative_slots_and_gather_gives_zeros():
    x = torch.randn(3, 128)
    cache = torch.full((4, 68), 7, dtype=torch.uint8)
    ops.cache_write(cache, torch.tensor([2, -1, 0]), x, "mxfp4")
    assert (cache[1] == 7).all() and (cache[3] == 7).all()
    rows = ops.cache_gather(cache, torch.tensor([0, -1, 2]), "mxfp4", 128, torch.float32)
    assert torch.equal(rows[0], ops.mxfp4_fake_quant(x[2])) and (rows[1] == 0).all()
    assert torch.equal(rows[2], ops.mxfp4_fake_quant(x[0]))


def test_fp4_nibble_order_and_sign():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 6.0, -1e-9  # code 7 in the low nibble; tiny negative -> negative zero (code 8)
    rec = ops.pack_cache_records(x, "mxfp4")
    assert rec[0, 0].item() == 0x87
