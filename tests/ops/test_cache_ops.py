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


@pytest.mark.parametrize("fmt,dim", [("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unused_slots_gather_positive_zeros_whatever_the_cache_holds(fmt, dim, dtype):
    """An engine's cache holds stale bytes and slot -1 reads through slot 0: records of bytes 0xFF decode to NaN
    in every format (NaN scales), and an unused slot must still give +0.0, neither NaN nor -0.0."""
    cache = torch.full((3, ops.record_bytes(fmt, dim)), 0xFF, dtype=torch.uint8)
    rows = ops.cache_gather(cache, torch.tensor([[-1, 1], [2, -1]]), fmt, dim, dtype)
    unused = torch.stack((rows[0, 0], rows[1, 1]))
    assert (unused == 0).all() and not unused.signbit().any()
    assert rows[0, 1].isnan().all()


def test_fp4_nibble_order_and_sign():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 6.0, -1e-9  # code 7 in the low nibble; tiny negative -> negative zero (code 8)
    rec = ops.pack_cache_records(x, "mxfp4")
    assert rec[0, 0].item() == 0x87


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,entries", [(1, 64), (5, 0), (16, 64), (17, 64), (40, 8)])
def test_sparse_attention_over_records_is_attention_over_the_decoded_pool(rows, entries, dtype):
    """Up to ``PER_REFERENCE_ROWS`` rows each row's keys are decoded in its own order, above it each distinct key
    once into a shared pool: either way the result is ``sparse_attention`` over the pool of decoded keys, bit for
    bit, with unused slots (a row with none at all too) and rows that share keys."""
    from deepinfer_plugins.ops.fused import PER_REFERENCE_ROWS, records_pool

    assert (rows <= PER_REFERENCE_ROWS) == (rows in (1, 5, 16))  # both paths are covered

    g = torch.Generator().manual_seed(rows * 100 + entries)
    window = ops.pack_cache_records(torch.randn(300, 128, generator=g), "fp8_window")
    compressed = ops.pack_cache_records(torch.randn(90, 128, generator=g), "nvfp4")
    window_slots = torch.randint(0, 60, (rows, 32), generator=g)  # few distinct keys: rows share them
    compressed_slots = torch.randint(0, 90, (rows, entries), generator=g)
    window_slots[0, -5:] = -1
    compressed_slots[:, -3:] = -1
    if rows > 1:
        window_slots[1], compressed_slots[1] = -1, -1
    q = torch.randn(rows, 8, 128, generator=g).to(dtype)
    sink = torch.randn(8, generator=g)
    pool, indices = records_pool(window, window_slots, compressed, compressed_slots, 128, dtype)
    want = ops.sparse_attention.reference(q, pool, indices, sink, 0.1)
    got = ops.sparse_attention_records.reference(q, window, window_slots, compressed, compressed_slots, sink, 0.1)
    assert got.dtype == dtype and torch.equal(got, want)
