"""Reference ops against hand-computed values: quantiser rounding ties, saturation and scales; Sinkhorn; top-k."""

import pytest
import torch

from deepinfer_plugins import ops


def block(values, width=32, fill=0.0):
    row = torch.full((width,), fill)
    row[: len(values)] = torch.tensor(values)
    return row


def test_fp8_scale_is_the_power_of_two_ceiling_and_ties_round_to_even():
    # amax 1.0 -> 1/448 -> scale 2^-8. 76 * 2^-8 sits between e4m3 72 and 80: ties go to the even mantissa (80).
    x = block([1.0, 76 * 2**-8, 0.3, -0.3])
    out = ops.fp8_fake_quant(x)
    assert out[:4].tolist() == [1.0, 80 * 2**-8, 80 * 2**-8, -80 * 2**-8]
    q, scale = ops.fp8_block_quant(x)
    assert scale.tolist() == [2**-8]


def test_fp8_exact_power_of_two_amax_keeps_its_exponent():
    x = block([896.0, 3.0])  # 896 / 448 = 2 exactly -> scale 2, not 4
    assert ops.fp8_block_quant(x)[1].tolist() == [2.0]
    assert ops.fp8_fake_quant(x)[:2].tolist() == [896.0, 3.0]  # 896/2 = 448 (the max); 3/2 = 1.5 exact


def test_fp8_zero_block_uses_the_amax_floor():
    assert ops.fp8_fake_quant(torch.zeros(32)).abs().sum() == 0
    assert ops.fp8_block_quant(torch.zeros(32))[1].tolist() == [2.0 ** -22]  # 1e-4/448 = 2.2e-7 -> 2^-22


def test_nvfp4_rounds_to_nearest_even_on_the_e2m1_grid():
    x = block([6.0, 2.5, 0.25, 0.75, 5.0, 1.25, 1.75, 3.5, -2.5], width=16)
    out = ops.nvfp4_fake_quant(x)  # amax 6 -> scale e4m3(1.0) = 1
    assert out[:9].tolist() == [6.0, 2.0, 0.0, 1.0, 4.0, 1.0, 2.0, 4.0, -2.0]


def test_nvfp4_saturates_when_the_e4m3_scale_rounds_down():
    x = block([6.3, 3.0], width=16)  # 6.3/6 = 1.05 -> e4m3 1.0; 6.3 clamps to 6
    assert ops.nvfp4_fake_quant(x)[:2].tolist() == [6.0, 3.0]


def test_mxfp4_scale_is_a_power_of_two():
    x = block([7.0, 2.6, -1.1])  # 7/6 -> scale 2: 3.5, 1.3, -0.55 -> 4, 1.5, -0.5
    assert ops.mxfp4_fake_quant(x)[:3].tolist() == [8.0, 3.0, -1.0]


def test_narrow_rows_are_one_block():
    x = torch.tensor([[1.0] * 8 + [0.0] * 8])  # 16 channels, MXFP4 block 32 -> one block
    assert ops.mxfp4_fake_quant(x).shape == x.shape


def test_block_that_does_not_divide_raises():
    with pytest.raises(ValueError, match="multiple"):
        ops.fp8_fake_quant(torch.ones(48))


def test_fp8_weight_round_trip_and_scale_layout():
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(0))
    q, scale = ops.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 3)
    back = ops.dequant_fp8_weight(q, scale, torch.float32)
    assert torch.allclose(back, w, rtol=2**-3, atol=1e-6)
    q2, scale2 = ops.quantize_fp8_weight(back)
    assert torch.equal(ops.dequant_fp8_weight(q2, scale2, torch.float32), back)


def test_fp4_nibble_order_even_column_low():
    packed = torch.tensor([[0x2F]], dtype=torch.uint8).view(torch.int8)  # low nibble 0xF = -6, high 0x2 = 1
    scale = torch.tensor([[1.0]]).to(torch.float8_e8m0fnu)
    w = ops.dequant_fp4_weight(torch.cat([packed] * 16, dim=1), scale, torch.float32)
    assert w[0, :2].tolist() == [-6.0, 1.0]


def test_fp4_weight_round_trip_is_exact_on_grid_values():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed, scale = ops.quantize_fp4_weight(w)
    once = ops.dequant_fp4_weight(packed, scale, torch.float32)
    assert torch.equal(ops.dequant_fp4_weight(*ops.quantize_fp4_weight(once), torch.float32), once)


def test_sinkhorn_output_is_doubly_stochastic():
    logits = torch.randn(16, 4, 4, generator=torch.Generator().manual_seed(2))
    m = ops.sinkhorn(logits, iters=20, eps=1e-6)
    assert torch.allclose(m.sum(-1), torch.ones(16, 4), atol=1e-3)
    assert torch.allclose(m.sum(-2), torch.ones(16, 4), atol=1e-5)
    assert bool((m >= 0).all())


def test_topk_indices_sorted_padded_and_ties_to_lower_id():
    scores = torch.tensor([[0.0, 3.0, 0.0, 0.0, float("-inf")], [float("-inf")] * 5])
    assert ops.topk_indices(scores, 3).tolist() == [[0, 1, 2], [-1, -1, -1]]
    assert ops.topk_indices(scores[:, :2], 3).tolist() == [[0, 1, -1], [-1, -1, -1]]


def sorted_topk_definition(scores: torch.Tensor, k: int) -> torch.Tensor:
    """top-k ids by their definition: the first k of a stable descending sort, -inf dropped, ascending, -1 padded."""
    ids = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    rows = [sorted(i for i in row.tolist() if scores[r, i] != float("-inf")) for r, row in enumerate(ids)]
    return torch.tensor([row + [-1] * (k - len(row)) for row in rows], dtype=torch.int64).view(len(rows), k)


@pytest.mark.parametrize("seed", range(6))
def test_topk_indices_is_the_stable_sort_definition_under_heavy_ties(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(150):
        t, n, k = (int(torch.randint(0, hi, (1,), generator=g)) for hi in (5, 40, 45))
        scores = torch.randint(-3, 4, (t, n), generator=g).float()  # seven values: ties at every threshold
        scores[torch.rand(t, n, generator=g) < 0.3] = float("-inf")
        assert torch.equal(ops.topk_indices.reference(scores, k), sorted_topk_definition(scores, k)), (scores, k)


def test_topk_indices_gives_nan_scores_no_place():
    scores = torch.tensor([[1.0, float("nan"), 2.0, 0.5], [float("nan")] * 4])
    assert ops.topk_indices.reference(scores, 3).tolist() == [[0, 2, -1], [-1, -1, -1]]


def test_candidate_mask_keeps_the_newest_block_and_the_best_blocks():
    inf = float("-inf")
    scores = torch.tensor([[5.0, 0.0, 1.0, 1.0, 0.0, 0.0, -9.0, inf]])  # blocks of 2: 5, 1, 0, -9(newest)
    mask = ops.candidate_mask(scores, torch.tensor([7]), block_size=2, top_blocks=2)
    assert mask.tolist() == [[True, True, False, False, False, False, True, True]]


def test_sparse_attention_with_sink_only_returns_zero():
    q = torch.randn(2, 3, 8)
    out = ops.sparse_attention(q, torch.randn(4, 8), torch.full((2, 5), -1), torch.zeros(3), 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_sparse_attention_matches_dense_softmax_with_sink():
    g = torch.Generator().manual_seed(3)
    q, pool, sink = torch.randn(1, 2, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(2, generator=g)
    out = ops.sparse_attention(q, pool, torch.tensor([[2, 0, -1]]), sink, 0.5)
    keys = pool[[2, 0]]
    logits = torch.cat(((q[0] @ keys.t()) * 0.5, sink[:, None]), dim=1)
    expected = logits.softmax(-1)[:, :2] @ keys
    assert torch.allclose(out[0], expected, atol=1e-6)


def test_sparse_attention_rows_do_not_depend_on_their_tile():
    """Long batches run in row tiles; each row's output is bit for bit what it gets alone."""
    from deepinfer_plugins.ops.reference import KEY_TILE_BYTES

    g = torch.Generator().manual_seed(4)
    keys, dim = 96, 64
    rows = 3 * KEY_TILE_BYTES // (keys * dim * 4) + 5  # four tiles, the last one short
    q, pool = torch.randn(rows, 4, dim, generator=g), torch.randn(300, dim, generator=g)
    indices, sink = torch.randint(-1, 300, (rows, keys), generator=g), torch.randn(4, generator=g)
    out = ops.sparse_attention.reference(q, pool, indices, sink, 0.3)
    for row in (0, rows // 2, rows - 1):
        assert torch.equal(out[row], ops.sparse_attention.reference(q[row: row + 1], pool, indices[row: row + 1],
                                                                    sink, 0.3)[0])


def test_router_renormalises_selected_scores_and_bias_only_steers():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    weights, ids = ops.sqrtsoftplus_route(logits, bias, top_k=2, routed_scale=1.5)
    s = torch.nn.functional.softplus(logits).sqrt()[0]
    assert sorted(ids[0].tolist()) == [0, 3]
    expected = torch.stack((s[ids[0, 0]], s[ids[0, 1]])) / (s[0] + s[3]) * 1.5
    assert torch.allclose(weights[0], expected)


def test_engram_hash_wraps_int64_and_xors_orders():
    grams = torch.tensor([[5, 7, 2]])
    m = torch.tensor([2**62 + 1, 3, 5])
    primes, offsets = torch.tensor([[11], [13]]), torch.tensor([[0], [11]])
    r1 = (5 * (2**62 + 1)) & (2**64 - 1)
    r1 = r1 - 2**64 if r1 >= 2**63 else r1
    r2 = r1 ^ 21
    r3 = r2 ^ 10
    assert ops.engram_hash(grams, m, primes, offsets).tolist() == [[r2 % 11, 11 + r3 % 13]]


def test_rope_inverse_undoes_rotation_and_leaves_nope_dims():
    x = torch.randn(5, 2, 16)
    pos = torch.arange(5)
    freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    y = ops.rope(x, pos, freq)
    assert torch.equal(y[..., :8], x[..., :8])
    assert torch.allclose(ops.rope(y, pos, freq, inverse=True), x, atol=1e-6)
    # interleaved pairs: channel 8 and 9 rotate together by pos * freq[0]
    angle = 3 * freq[0]
    assert torch.allclose(y[3, 0, 8], x[3, 0, 8] * angle.cos() - x[3, 0, 9] * angle.sin(), atol=1e-6)


def test_bidirectional_attention_with_two_patches_by_hand():
    """Two rows, one head: each row's output is the softmax(q.k / sqrt(D))-weighted mix of both values, so the
    first row sees the second (no causal mask)."""
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])  # [P=2, H=1, D=2]
    k = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = ops.bidirectional_attention(q, k, v)
    for row, logits in enumerate(([2.0, 0.0], [0.0, 2.0])):
        weights = torch.tensor(logits).div(2 ** 0.5).softmax(0)
        torch.testing.assert_close(out[row, 0], weights)
    assert ops.bidirectional_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).dtype == torch.bfloat16


def test_dense_linear_runs_a_bf16_weight_in_the_activation_dtype():
    x = torch.tensor([[1.0, 2.0]])
    weight = torch.tensor([[1.0, -1.0], [0.5, 0.25]], dtype=torch.bfloat16)
    bias = torch.tensor([0.5, 0.0], dtype=torch.bfloat16)
    out = ops.dense_linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.tolist() == [[-0.5, 1.0]]
