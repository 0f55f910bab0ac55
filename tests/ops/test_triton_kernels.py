"""Every Triton kernel against its PyTorch reference: under the Triton interpreter (CPU tensors) by default,
compiled on a GPU with ``DEEPINFER_TEST_DEVICE=cuda`` (benchmarks/device_check.sh).

Guarantees: quantisers, cache records, dequantisers, RoPE, the Engram hash and top-k selections are bit-exact
(ids equal, ties to the lower id); attention, indexer, mHC, norms and gates match within the stated
tolerances. Inputs are fresh random per run (seed printed), every output buffer starts poisoned, and edge
cases are covered: all-zero and saturating blocks, narrow rows, -1 padding, empty selections, window
wrap-around, all-equal scores, k larger than the row.
"""

import math

import pytest
import torch

from .kernel_compare import (TEST_DEVICE, assert_bits_equal, assert_close, gen, on_test_device,  # noqa: F401
                             poison_outputs)

from deepinfer_plugins import ops  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels import attention, indexer, mhc, misc, quant  # noqa: E402

attention, indexer, mhc, misc, quant = map(on_test_device, (attention, indexer, mhc, misc, quant))


def spread(shape, g, dtype=torch.float32):
    """Values over many binades, with ties to round (exact quarter steps) and zero blocks mixed in."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float())
    x = torch.where(torch.rand(shape, generator=g) < 0.1, torch.round(x * 4) / 4, x)
    x.view(-1, shape[-1])[0, : min(32, shape[-1])] = 0.0
    return x.to(dtype)


# ---- quantisers and records (bit-exact) -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 512), (3, 4, 32), (5, 8)])
@pytest.mark.parametrize("name", ["fp8_fake_quant", "nvfp4_fake_quant", "mxfp4_fake_quant"])
def test_fake_quant_is_bit_exact(name, shape, dtype, gen):
    x = spread(shape, gen, dtype)
    x.view(-1, shape[-1])[-1, :2] = torch.tensor([1e6, -3e-30])  # saturating scale, negative underflow
    assert_bits_equal(getattr(quant, name)(x), getattr(ops, name).reference(x))


@pytest.mark.parametrize("name", ["fp8_fake_quant", "mxfp4_fake_quant"])
def test_power_of_two_scales_divide_exactly_at_the_range_ends(name, gen):
    """The power-of-two scales divide by multiplying with their reciprocal: a block of 24 (a masked tile), a block
    at the smallest scale (values near FLT_MIN, 2^-126 scale for MXFP4), one at the largest, one whose small
    values fall to subnormal fp32 or to zero once divided.
    bf16 skips the FLT_MIN row: the interpreter converts bf16 subnormals to fp32 inexactly (a GPU does not)."""
    x = spread((6, 24), gen)
    x[1] = torch.linspace(-1.0, 1.0, 24) * 1.2e-38
    x[2] = torch.linspace(-1.0, 1.0, 24) * 3.0e38
    x[3, :3] = torch.tensor([3.0e38, -2.0e-38, -1.0e-30])
    assert_bits_equal(getattr(quant, name)(x), getattr(ops, name).reference(x))
    normal = x[[0, 2, 3, 4, 5]].bfloat16()
    assert_bits_equal(getattr(quant, name)(normal), getattr(ops, name).reference(normal))


def test_fp8_block_quant_is_bit_exact(gen):
    x = spread((4, 256), gen)
    q, s = quant.fp8_block_quant(x)
    qr, sr = ops.fp8_block_quant.reference(x)
    assert_bits_equal(q, qr)
    assert_bits_equal(s, sr)


@pytest.mark.parametrize("fmt,dim", [("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 32)])
def test_records_pack_unpack_write_gather(fmt, dim, gen):
    x = spread((7, dim), gen, torch.bfloat16)
    records = quant.pack_cache_records(x, fmt)
    assert records.shape == (7, ops.record_bytes(fmt, dim))
    assert_bits_equal(records, ops.pack_cache_records.reference(x, fmt))
    assert_bits_equal(quant.unpack_cache_records(records, fmt, dim, torch.float32),
                      ops.unpack_cache_records.reference(records, fmt, dim, torch.float32))
    # paged write: slots out of order, one skipped (-1); untouched slots keep their bytes
    cache = torch.randint(0, 256, (12, records.shape[1]), generator=gen, dtype=torch.uint8)
    expected = ops.cache_write.reference(cache.clone(), torch.tensor([9, 0, -1, 3, 11, 4, 1]), x, fmt)
    got = quant.cache_write(cache.clone(), torch.tensor([9, 0, -1, 3, 11, 4, 1]), x, fmt)
    assert_bits_equal(got, expected)
    slots = torch.tensor([[3, -1, 9], [0, 0, -1]])
    assert_bits_equal(quant.cache_gather(expected, slots, fmt, dim, torch.bfloat16),
                      ops.cache_gather.reference(expected, slots, fmt, dim, torch.bfloat16))
    # an engine row wider than the record, the record inside it (vLLM's window row also holds the token id and
    # position; its packed compressed rows hold several sources' records): the write and the gather address rows
    # by stride and leave the bytes around each record alone
    table = torch.randint(0, 256, (12, 8 + records.shape[1] + 16), generator=gen, dtype=torch.uint8)
    columns = slice(8, 8 + records.shape[1])
    expected_table = table.clone()
    ops.cache_write.reference(expected_table[:, columns], torch.tensor([9, 0, -1, 3, 11, 4, 1]), x, fmt)
    quant.cache_write(table[:, columns], torch.tensor([9, 0, -1, 3, 11, 4, 1]), x, fmt)
    assert_bits_equal(table, expected_table)
    assert_bits_equal(quant.cache_gather(table[:, columns], slots, fmt, dim, torch.bfloat16),
                      ops.cache_gather.reference(expected, slots, fmt, dim, torch.bfloat16))


def test_window_ring_write_wraps_around(gen):
    window, dim = 8, 64
    cache = torch.zeros(window, ops.record_bytes("fp8_window", dim), dtype=torch.uint8)
    ref = cache.clone()
    for start in (0, 5, 11):  # chunks whose positions cross the ring boundary
        x = torch.randn(6, dim, generator=gen)
        slots = torch.arange(start, start + 6) % window
        quant.cache_write(cache, slots, x, "fp8_window")
        ops.cache_write.reference(ref, slots, x, "fp8_window")
        assert_bits_equal(cache, ref)


def test_weight_and_table_dequant(gen):
    w = torch.randn(70, 96, generator=gen)
    q8, s8 = ops.quantize_fp8_weight(w)
    assert_bits_equal(quant.dequant_fp8_weight(q8, s8, torch.bfloat16), ops.dequant_fp8_weight.reference(q8, s8, torch.bfloat16))
    q4, s4 = ops.quantize_fp4_weight(w)
    assert_bits_equal(quant.dequant_fp4_weight(q4, s4, torch.float32), ops.dequant_fp4_weight.reference(q4, s4, torch.float32))
    table, scale = ops.quantize_fp8_rows(torch.randn(50, 64, generator=gen))
    ids = torch.randint(0, 50, (5, 6), generator=gen)
    assert_bits_equal(quant.engram_gather(table, scale, ids, torch.float32),
                      ops.engram_gather.reference(table, scale, ids, torch.float32))
    narrow, nscale = ops.quantize_fp8_rows(torch.randn(20, 8, generator=gen))  # width 8 < block 32
    assert_bits_equal(quant.engram_gather(narrow, nscale, ids % 20, torch.float32),
                      ops.engram_gather.reference(narrow, nscale, ids % 20, torch.float32))


# ---- sparse attention (stated tolerance) -----------------------------------------------------------------------
ATTN_TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,k", [(2, 16, 64, 40), (3, 4, 32, 12), (6, 20, 48, 70)])
def test_sparse_attention(t, h, d, k, dtype, gen):
    pool = torch.randn(90, d, generator=gen).to(dtype)
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    sink = torch.randn(h, generator=gen)
    idx = torch.randint(0, 90, (t, k), generator=gen)
    idx = torch.where(torch.rand(t, k, generator=gen) < 0.2, -1, idx)  # -1 padding anywhere
    idx[0] = -1  # a query with an empty selection returns zeros
    scale = d ** -0.5
    got = attention.sparse_attention(q, pool, idx, sink, scale)
    want = ops.sparse_attention.reference(q, pool, idx, sink, scale)
    assert (got[0] == 0).all()
    atol, rtol = ATTN_TOL[dtype]
    assert_close(got, want, atol=atol, rtol=rtol, cos=1e-4)


@pytest.mark.parametrize("splits,head_block,key_block", [(3, 16, 16), (2, 32, 16), (5, 16, 16)])
def test_sparse_attention_key_splits(splits, head_block, key_block, gen):
    """Flash-decoding splits: partial softmax states combined with the sink, including splits whose keys are
    all -1 (row 1 keeps only its first keys) and a row with no key at all (zeros)."""
    t, h, d, k = 3, 20, 64, 75
    pool = torch.randn(50, d, generator=gen)
    q = torch.randn(t, h, d, generator=gen) * 2
    sink = torch.randn(h, generator=gen)
    idx = torch.randint(0, 50, (t, k), generator=gen)
    idx[1, 10:] = -1
    idx[2] = -1
    config = attention.AttentionConfig(head_block=head_block, key_block=key_block, splits=splits)
    got = attention.sparse_attention(q, pool, idx, sink, 0.2, config=config)
    assert (got[2] == 0).all()
    assert_close(got, ops.sparse_attention.reference(q, pool, idx, sink, 0.2), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,splits", [(64, 1), (64, 3), (512, 0)])
def test_sparse_attention_from_cache_records(d, splits, dtype, gen):
    """Keys decoded from fp8_window and nvfp4 records in the kernel: -1 slots anywhere, a row without keys
    (zeros), a row with window keys only, splits that cross from the window segment into the compressed one.
    The records sit in engine rows wider than a record (row-strided views, as vLLM's caches hand them over)."""
    t, h, w, c = 4, 20, 9, 14
    window_cache = in_wider_rows(ops.pack_cache_records(torch.randn(12, d, generator=gen), "fp8_window"), 0, 16, gen)
    compressed_cache = in_wider_rows(ops.pack_cache_records(torch.randn(30, d, generator=gen), "nvfp4"), 36, 68, gen)
    window_slots = torch.randint(0, 12, (t, w), generator=gen)
    compressed_slots = torch.randint(0, 30, (t, c), generator=gen)
    window_slots = torch.where(torch.rand(t, w, generator=gen) < 0.2, -1, window_slots)
    compressed_slots = torch.where(torch.rand(t, c, generator=gen) < 0.2, -1, compressed_slots)
    window_slots[0], compressed_slots[0] = -1, -1
    compressed_slots[1] = -1
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    sink = torch.randn(h, generator=gen)
    config = attention.AttentionConfig(head_block=16, key_block=16, splits=splits)
    got = attention.sparse_attention_records(q, window_cache, window_slots, compressed_cache, compressed_slots,
                                             sink, d ** -0.5, config=config)
    want = ops.sparse_attention_records.reference(q, window_cache, window_slots, compressed_cache, compressed_slots,
                                                  sink, d ** -0.5)
    assert (got[0] == 0).all()
    atol, rtol = ATTN_TOL[dtype]
    assert_close(got, want, atol=atol, rtol=rtol, cos=1e-4)


def in_wider_rows(records: torch.Tensor, before: int, after: int, gen) -> torch.Tensor:
    """records [S, R] as bytes before..before + R of random rows of before + R + after bytes (a row-strided view
    that starts inside the row, as the records of a later KV source in vLLM's packed compressed rows do)."""
    width = before + records.shape[1] + after
    table = torch.randint(0, 256, (records.shape[0], width), generator=gen, dtype=torch.uint8)
    table[:, before: before + records.shape[1]] = records
    return table[:, before: before + records.shape[1]]


def test_sparse_attention_records_without_compressed_keys(gen):
    """Layers without a compression ratio pass an empty compressed cache and no compressed slots."""
    d, h = 64, 16
    window_cache = ops.pack_cache_records(torch.randn(10, d, generator=gen), "fp8_window")
    window_slots = torch.randint(0, 10, (3, 6), generator=gen)
    window_slots[1, :2] = -1
    empty = torch.empty(0, ops.record_bytes("nvfp4", d), dtype=torch.uint8)
    q, sink = torch.randn(3, h, d, generator=gen), torch.randn(h, generator=gen)
    got = attention.sparse_attention_records(q, window_cache, window_slots, empty, window_slots[:, :0], sink, 0.125)
    want = ops.sparse_attention_records.reference(q, window_cache, window_slots, empty, window_slots[:, :0], sink,
                                                  0.125)
    assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_sparse_attention_multi_token_verify_over_a_wrapped_window(gen):
    """DSpark verify: 4 query rows, each with its own window (ring slots wrap) plus compressed entries."""
    window, d, h = 8, 32, 16
    pool = torch.randn(window + 10, d, generator=gen)  # ring rows 0..7, compressed rows 8..17
    positions = torch.arange(21, 25)
    ring = (positions[:, None] - window + 1 + torch.arange(window)[None, :]) % window  # [4, 8] wraps
    comp = torch.randint(window, window + 10, (4, 5), generator=gen)
    comp[:, -1] = -1
    idx = torch.cat((ring, comp), dim=1)
    q = torch.randn(4, h, d, generator=gen)
    sink = torch.randn(h, generator=gen)
    assert_close(attention.sparse_attention(q, pool, idx, sink, 0.3),
                 ops.sparse_attention.reference(q, pool, idx, sink, 0.3), atol=2e-5, rtol=1e-5)


# ---- indexer, top-k, pre-filter ----------------------------------------------------------------------------------
def test_indexer_scores(gen):
    q = ops.mxfp4_fake_quant(torch.randn(3, 32, 128, generator=gen))
    keys = ops.mxfp4_fake_quant(torch.randn(200, 128, generator=gen))
    w = torch.randn(3, 32, generator=gen)
    want = ops.indexer_scores.reference(q, w, keys)
    assert_close(indexer.indexer_scores(q, w, keys), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 5, 16, 300])
def test_topk_ids_are_exact_with_ties_and_masks(k, gen):
    scores = torch.randint(-3, 4, (6, 130), generator=gen).float()  # many ties
    scores[1] = 2.0  # all equal
    scores[2] = float("-inf")  # nothing visible
    scores[3, 40:] = float("-inf")  # fewer visible than k
    scores[4] = torch.randn(130, generator=gen)
    scores[5, ::2] = float("-inf")
    assert_bits_equal(indexer.topk_indices(scores, k), ops.topk_indices.reference(scores, k))


def test_indexer_topk_selects_the_reference_ids(gen):
    """Fused selection: visibility per query, a candidate mask, integer-valued keys so that scores tie."""
    q = torch.randint(-2, 3, (4, 32, 128), generator=gen).float()
    keys = torch.randint(-2, 3, (150, 128), generator=gen).float()
    w = torch.rand(4, 32, generator=gen).round()
    visible = torch.tensor([150, 60, 0, 7])
    candidates = torch.rand(4, 150, generator=gen) < 0.7
    for cand in (None, candidates):
        assert_bits_equal(indexer.indexer_topk(q, w, keys, visible, 16, cand),
                          ops.indexer_topk.reference(q, w, keys, visible, 16, cand))


def records_of(keys: torch.Tensor, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [N, d] as mxfp4 records at shuffled rows of a larger row-strided table -> (records [S, R], slots [N])."""
    records = ops.pack_cache_records(keys, "mxfp4")
    slots = torch.randperm(keys.shape[0] + 9, generator=gen)[: keys.shape[0]]
    table = torch.randint(0, 256, (keys.shape[0] + 9, records.shape[1]), generator=gen, dtype=torch.uint8)
    table[slots] = records
    return in_wider_rows(table, 12, 20, gen), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 16])
def test_indexer_scores_from_records(d, dtype, gen):
    """Keys decoded from their records in the kernel give the float-key kernel's scores bit for bit (MXFP4 times a
    power of two is exact in either dtype), from out-of-order slots in a row-strided table, over several key tiles;
    d = 16 is the tiny presets' width (one scale per 16 channels)."""
    q = ops.mxfp4_fake_quant(torch.randn(3, 32, d, generator=gen)).to(dtype)
    keys = torch.randn(1100, d, generator=gen) * torch.exp2(torch.randint(-8, 8, (1100, 1), generator=gen).float())
    records, slots = records_of(keys, gen)
    w = torch.randn(3, 32, generator=gen)
    got = indexer.indexer_scores_records(q, w, records, slots)
    decoded = ops.cache_gather.reference(records, slots, "mxfp4", d, dtype)
    assert_bits_equal(got, indexer.indexer_scores(q, w, decoded))
    want = ops.indexer_scores_records.reference(q, w, records, slots)
    # summation order only: an fp32 rounding of the largest terms (keys span 2^-8..2^8), also where the sum is ~0
    assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


def test_indexer_topk_records_selects_the_reference_ids(gen):
    """The fused selection over records: integer-valued keys (exact in MXFP4) so that scores tie, visibility per
    query, a candidate mask."""
    q = torch.randint(-2, 3, (4, 32, 128), generator=gen).float()
    keys = torch.randint(-2, 3, (150, 128), generator=gen).float()
    records, slots = records_of(keys, gen)
    assert torch.equal(ops.cache_gather.reference(records, slots, "mxfp4", 128, torch.float32), keys)
    w = torch.rand(4, 32, generator=gen).round()
    visible = torch.tensor([150, 60, 0, 7])
    candidates = torch.rand(4, 150, generator=gen) < 0.7
    for cand in (None, candidates):
        got = indexer.indexer_topk_records(q, w, records, slots, visible, 16, cand)
        assert_bits_equal(got, ops.indexer_topk_records.reference(q, w, records, slots, visible, 16, cand))
        assert_bits_equal(got, indexer.indexer_topk(q, w, keys, visible, 16, cand))


def test_indexer_records_of_a_batch_of_sequences(gen):
    """Several sequences in one call: each sequence's rows score its own keys (key_slots [B, N], -1 past its
    entries), query tiles never spanning two sequences (a prefill of 5 rows among decodes), with the reference's
    scores and ids; an all-padding sequence scores 0 everywhere."""
    counts, entries = [1, 5, 1, 2, 1], [40, 70, 3, 70, 0]
    q = torch.randint(-2, 3, (sum(counts), 32, 128), generator=gen).float()
    w = torch.rand(sum(counts), 32, generator=gen).round()
    records, slots = records_of(torch.randint(-2, 3, (sum(entries), 128), generator=gen).float(), gen)
    key_slots = torch.full((len(counts), max(entries)), -1)
    for b, (start, n) in enumerate(zip([0, 40, 110, 113, 183], entries)):
        key_slots[b, :n] = slots[start: start + n]
    got = indexer.indexer_scores_records(q, w, records, key_slots, counts)
    assert_bits_equal(got, ops.indexer_scores_records.reference(q, w, records, key_slots, counts))
    assert_bits_equal(got[-1], torch.zeros(max(entries)))
    visible = torch.tensor([40, 60, 61, 62, 63, 70, 3, 69, 70, 0])
    for cand in (None, torch.rand(len(visible), max(entries), generator=gen) < 0.7):
        assert_bits_equal(indexer.indexer_topk_records(q, w, records, key_slots, visible, 16, cand, counts),
                          ops.indexer_topk_records.reference(q, w, records, key_slots, visible, 16, cand, counts))


@pytest.mark.parametrize("heads,d", [(2, 16), (64, 128)])
def test_indexer_records_score_one_decode_row(heads, d, gen):
    """A decode step scores one query row: a one-row query tile (TB = 1), alone and as the tile of a one-row
    sequence, at the tiny presets' indexer (2 heads of 16) and V4.1's (64 of 128). On the H200 the tiny model's
    logits left the CPU reference at exactly these calls (benchmarks/results/h200/diagnose.txt) while the tests of
    several rows passed; integer-valued inputs make every score exact, so the reference is met bit for bit."""
    q = torch.randint(-2, 3, (1, heads, d), generator=gen).float()
    w = torch.randint(1, 3, (1, heads), generator=gen).float()
    records, slots = records_of(torch.randint(-2, 3, (37, d), generator=gen).float(), gen)
    want = ops.indexer_scores_records.reference(q, w, records, slots)
    assert want.abs().max() > 0
    assert_bits_equal(indexer.indexer_scores_records(q, w, records, slots), want)
    assert_bits_equal(indexer.indexer_scores_records(q, w, records, slots[None], [1]), want)
    visible = torch.tensor([30])
    assert_bits_equal(indexer.indexer_topk_records(q, w, records, slots[None], visible, 8, None, [1]),
                      ops.indexer_topk_records.reference(q, w, records, slots[None], visible, 8, None, [1]))


def test_indexer_records_without_entries(gen):
    """A source with no compressed entry yet (N = 0): no scores, every selected slot -1."""
    q, w = torch.randn(3, 32, 128, generator=gen), torch.randn(3, 32, generator=gen)
    records, slots = ops.pack_cache_records(torch.randn(4, 128, generator=gen), "mxfp4"), torch.zeros(0).long()
    assert indexer.indexer_scores_records(q, w, records, slots).shape == (3, 0)
    assert_bits_equal(indexer.indexer_topk_records(q, w, records, slots, torch.tensor([0, 1, 2]), 5),
                      torch.full((3, 5), -1))


def test_indexer_records_layout_is_checked(gen):
    """A table of the wrong width raises; a width the kernel cannot tile by its scale block (48 = 32 + 16) is
    declined, and the registry runs the reference."""
    q, w = torch.randn(2, 4, 128, generator=gen), torch.randn(2, 4, generator=gen)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="uint8 \\[slots, 68\\]"):
        indexer.indexer_scores_records(q, w, torch.zeros(3, 72, dtype=torch.uint8), slots)
    q48, records48 = q[..., :48], torch.zeros(3, ops.record_bytes("mxfp4", 48), dtype=torch.uint8)
    assert indexer.indexer_scores_records(q48, w, records48, slots) is NotImplemented
    assert indexer.indexer_topk_records(q48, w, records48, slots, torch.tensor([3, 3]), 2) is NotImplemented


def test_candidate_mask(gen):
    scores = torch.randn(4, 70, generator=gen)
    visible = torch.tensor([70, 33, 0, 1])
    scores = torch.where(torch.arange(70)[None, :] < visible[:, None], scores, float("-inf"))
    scores[0, :16] = 5.0  # tied block maxima
    assert_bits_equal(indexer.candidate_mask(scores, visible, 8, 3), ops.candidate_mask.reference(scores, visible, 8, 3))


# ---- mHC ---------------------------------------------------------------------------------------------------------
def test_sinkhorn_and_coefficients(gen):
    logits = torch.randn(5, 4, 4, generator=gen) * 3
    assert_close(mhc.sinkhorn(logits, 20, 1e-6), ops.sinkhorn.reference(logits, 20, 1e-6), atol=1e-6, rtol=1e-5)
    for n_streams in (4, 3):  # 3: padded [4, 4] Sinkhorn tiles and mixing rows
        mix_rows = (2 + n_streams) * n_streams
        streams = torch.randn(3, n_streams, 64, generator=gen).bfloat16()
        fn = torch.randn(mix_rows, n_streams * 64, generator=gen) * 0.05
        base, scale = torch.randn(mix_rows, generator=gen), torch.rand(3, generator=gen)
        want = ops.hc_coefficients.reference(streams, fn, base, scale, 20, 1e-6, 1e-20)
        for splits in (0, 3):  # the default and partial sums over input slices (what a GPU launch uses)
            got = mhc.hc_coefficients(streams, fn, base, scale, 20, 1e-6, 1e-20, splits)
            for g, w in zip(got, want, strict=True):
                assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_expand(dtype, gen):
    streams = torch.randn(5, 4, 96, generator=gen).to(dtype)
    pre = torch.rand(5, 4, generator=gen)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close(mhc.hc_collapse(streams, pre), ops.hc_collapse.reference(streams, pre), atol=tol, rtol=tol)
    out, post, comb = torch.randn(5, 96, generator=gen).to(dtype), torch.rand(5, 4, generator=gen), torch.rand(5, 4, 4, generator=gen)
    assert_close(mhc.hc_expand(streams, out, post, comb), ops.hc_expand.reference(streams, out, post, comb),
                 atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, weighted", [(96, True), (80, False), (5120, True)])
def test_collapse_norm_is_the_collapse_then_the_norm(d, weighted, dtype, gen):
    """One kernel for the two ops, the collapse rounded to the streams' dtype before the norm as between them.
    bf16: the collapse's fp32 sum may round to the neighbouring bf16 value (another summation order), and the
    output rounds once more: two bf16 steps (2^-7 relative) apart at most."""
    streams = (torch.randn(5, 4, d, generator=gen) * 3).to(dtype)
    pre = torch.rand(5, 4, generator=gen)
    weight = torch.randn(d, generator=gen).to(dtype) if weighted else None
    got = mhc.hc_collapse_norm(streams, pre, weight, 1e-20)
    assert got.dtype == dtype and got.shape == (5, d)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6
    assert_close(got, ops.hc_collapse_norm.reference(streams, pre, weight, 1e-20), atol=tol, rtol=tol)
    assert_close(got, misc.rms_norm(mhc.hc_collapse(streams, pre), weight, 1e-20), atol=tol, rtol=tol)
    assert mhc.hc_collapse_norm(streams[:0], pre[:0], weight, 1e-20).shape == (0, d)


def test_collapse_norm_declines_rows_too_wide_for_registers(gen):
    streams = torch.zeros(1, 2, mhc.COLLAPSE_NORM_MAX_WIDTH + 32)
    assert mhc.hc_collapse_norm(streams, torch.ones(1, 2), None, 1e-6) is NotImplemented


# ---- small ops -------------------------------------------------------------------------------------------------------
def test_rms_norm_rope_swiglu(gen):
    x = torch.randn(4, 3, 80, generator=gen)
    w = torch.randn(80, generator=gen)
    assert_close(misc.rms_norm(x, w, 1e-20), ops.rms_norm.reference(x, w, 1e-20), atol=1e-5, rtol=1e-5)
    assert_close(misc.rms_norm(x.bfloat16(), None, 1e-6), ops.rms_norm.reference(x.bfloat16(), None, 1e-6),
                 atol=1e-2, rtol=1e-2)
    pos, inv = torch.randint(0, 5000, (4,), generator=gen), torch.rand(8, generator=gen)
    for inverse in (False, True):  # bit-exact against the same libm; a GPU's sin/cos differ in the last bit
        got, want = misc.rope(x, pos, inv, inverse), ops.rope.reference(x, pos, inv, inverse)
        if TEST_DEVICE == "cpu":
            assert_bits_equal(got, want)
        else:
            assert_close(got, want, atol=1e-6, rtol=1e-6)
    g, u = torch.randn(6, 40, generator=gen) * 6, torch.randn(6, 40, generator=gen) * 6
    for limit in (10.0, None):
        assert_close(misc.swiglu(g, u, limit), ops.swiglu.reference(g, u, limit), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [6, 2])
def test_router_selects_the_same_experts(top_k, gen):
    logits = torch.randn(9, 384, generator=gen) * 2
    bias = torch.randn(9, 384, generator=gen) * 0.1  # per-token bias (image spans use bias_vl)
    w, ids = misc.sqrtsoftplus_route(logits, bias, top_k, 1.5)
    wr, idr = ops.sqrtsoftplus_route.reference(logits, bias, top_k, 1.5)
    assert torch.equal(ids, idr)
    assert_close(w, wr, atol=1e-6, rtol=1e-6)


def test_engram_hash_is_exact_with_int64_wraparound(gen):
    toks = torch.randint(0, 99092, (11, 4), generator=gen)
    toks[0] = 2  # pad ids
    mult = torch.tensor([76632096046245, 4839876093313, 35959672319349, 73987337458391])  # docs/model.md#hash, layer 1
    primes = torch.tensor([16000057, 16000079, 16000081, 16000097, 16000103, 16000109, 16000121, 16000139]).repeat(3, 1)
    offsets = (primes.flatten().cumsum(0) - primes.flatten()).view(3, 8)
    assert_bits_equal(misc.engram_hash(toks, mult, primes, offsets), ops.engram_hash.reference(toks, mult, primes, offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(3, 64), (2, 100), (1, 5120)])
def test_engram_gate(tokens, width, dtype, gen):
    """Key and value as the model passes them (strided slices of one wkv row, [T, S * d + d]); 5120 (V4.1) spans
    several chunks of the kernel's two passes, 100 ends in a masked tail. fp32 differs only in summation order;
    in bf16 that order can move an output across a rounding boundary, hence one bf16 step of tolerance."""
    s = 4
    streams = torch.randn(tokens, s, width, generator=gen).to(dtype)
    kv = torch.randn(tokens, (s + 1) * width, generator=gen).to(dtype)
    key, value = kv[:, : s * width].unflatten(-1, (s, width)), kv[:, s * width:]
    w = torch.randn(s, width, generator=gen)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -7)
    assert_close(misc.engram_gate(streams, key, value, w, 1e-20),
                 ops.engram_gate.reference(streams, key, value, w, 1e-20), **tol)


def test_engram_gate_zero_dot_gives_gate_one_half(gen):
    """A stream orthogonal to its key: sign(0) = 0, so the gate is sigmoid(0) = 1/2 on both sides."""
    streams = torch.zeros(1, 4, 64)
    streams[0, :, 0] = 1.0
    key = torch.zeros(1, 4, 64)
    key[0, :, 1] = 1.0
    value = torch.randn(1, 64, generator=gen)
    w = torch.ones(4, 64)
    got = misc.engram_gate(streams, key, value, w, 1e-6)
    assert_close(got, ops.engram_gate.reference(streams, key, value, w, 1e-6), atol=1e-6, rtol=1e-6)
    assert_close(got[0, :, 2:], (0.5 * value[:, 2:]).expand(4, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [2, 4])
def test_csa2_compress(ratio, dtype, gen):
    """bf16 rounds twice, as the reference does: the pooled sum before the norm, then the output. A summation-order
    difference that moves the first rounding moves the output by up to two bf16 steps."""
    values, gates = torch.randn(8, 48, generator=gen), torch.randn(8, 48, generator=gen) * 4
    nw = torch.rand(48, generator=gen)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -6, cos=1e-4)
    for weight in (nw, None):
        assert_close(misc.csa2_compress(values, gates, ratio, weight, 1e-20, dtype),
                     ops.csa2_compress.reference(values, gates, ratio, weight, 1e-20, dtype), **tol)


def test_odd_widths_raise_like_the_reference():
    with pytest.raises(ValueError, match="multiple"):
        quant.fp8_fake_quant(torch.ones(48))
    assert math.isclose(1.0, 1.0)
