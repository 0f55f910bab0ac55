"""The fused indexer selection is the model's step-by-step selection: scores, the visibility and candidate masks,
then top-k with ties to the lower id, ascending ids and -1 padding; the records ops are the same ops over the keys
their mxfp4 cache records decode to. Compared bit for bit."""

import pytest
import torch

from deepinfer_plugins import ops


def step_by_step(q, head_weights, keys, visible, k, candidates=None):
    """The selection as Indexer.forward wrote it before the fused op existed."""
    scores = ops.indexer_scores.reference(q, head_weights, keys)
    entry = torch.arange(scores.shape[1])
    scores = scores.masked_fill(entry[None, :] >= visible[:, None], float("-inf"))
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    return ops.topk_indices.reference(scores, k)


def case(t=5, heads=4, dim=32, n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = ops.mxfp4_fake_quant.reference(torch.randn(t, heads, dim, generator=g))
    keys = ops.mxfp4_fake_quant.reference(torch.randn(n, dim, generator=g))
    keys[[3, 17, 44]] = keys[30].clone()  # exact ties inside the visible range
    keys[50:] = keys[2].clone()
    return q, torch.randn(t, heads, generator=g), keys, g


@pytest.mark.parametrize("k", [1, 8, 64, 100])
def test_equals_the_step_by_step_selection(k):
    q, weights, keys, _ = case()
    visible = torch.tensor([0, 1, 31, 70, 90])  # nothing, one entry, a prefix, all, past the end
    got = ops.indexer_topk.reference(q, weights, keys, visible, k)
    assert got.shape == (5, k)
    assert torch.equal(got, step_by_step(q, weights, keys, visible, k))


def test_equals_the_step_by_step_selection_with_candidates():
    q, weights, keys, g = case()
    visible = torch.tensor([0, 12, 40, 70, 70])
    candidates = torch.rand(5, 70, generator=g) > 0.6
    candidates[4] = False  # every entry filtered out
    got = ops.indexer_topk.reference(q, weights, keys, visible, 16, candidates)
    assert torch.equal(got, step_by_step(q, weights, keys, visible, 16, candidates))
    assert (got[4] == -1).all()
    assert (got[0] == -1).all()
    chosen = got[2][got[2] >= 0]
    assert candidates[2, chosen].all() and (chosen < 40).all()


def test_semantics_on_a_hand_made_case():
    """One head, weight 1: score = relu(q . key). Ties go to the lower id; ids ascend; -inf slots become -1."""
    q = torch.tensor([[[1.0, 0.0]]])
    keys = torch.tensor([[2.0, 0.0], [5.0, 1.0], [-3.0, 0.0], [5.0, 9.0], [2.0, 0.0], [7.0, 0.0]])
    weights = torch.ones(1, 1)
    # scores 2, 5, 0, 5, 2, 7; entry 5 is invisible
    assert ops.indexer_topk.reference(q, weights, keys, torch.tensor([5]), 3).tolist() == [[0, 1, 3]]
    assert ops.indexer_topk.reference(q, weights, keys, torch.tensor([5]), 7).tolist() == [[0, 1, 2, 3, 4, -1, -1]]
    assert ops.indexer_topk.reference(q, weights, keys, torch.tensor([6]), 2).tolist() == [[1, 5]]
    only_late = torch.tensor([[False, False, True, False, True, True]])
    assert ops.indexer_topk.reference(q, weights, keys, torch.tensor([5]), 3, only_late).tolist() == [[2, 4, -1]]


def test_dispatches_to_the_reference_on_cpu():
    q, weights, keys, _ = case()
    visible = torch.tensor([0, 1, 31, 70, 90])
    assert ops.registry.select("indexer_topk", "cpu") is ops.indexer_topk.reference
    assert torch.equal(ops.indexer_topk(q, weights, keys, visible, 8),
                       ops.indexer_topk.reference(q, weights, keys, visible, 8))


def in_records(keys, g, before=20, after=12, spare_rows=5):
    """keys [N, d] as mxfp4 records at shuffled rows of a larger table, each record inside a wider random row (a
    row-strided view, as vLLM hands its packed compressed cache over) -> (records [S, R] view, slots [N])."""
    records = ops.pack_cache_records.reference(keys, "mxfp4")
    n, width = records.shape
    table = torch.randint(0, 256, (n + spare_rows, before + width + after), generator=g, dtype=torch.uint8)
    slots = torch.randperm(n + spare_rows, generator=g)[:n]
    table[slots, before: before + width] = records
    return table[:, before: before + width], slots


@pytest.mark.parametrize("with_candidates", [False, True])
def test_records_ops_are_the_float_ops_on_the_decoded_keys(with_candidates):
    """The keys of ``case`` are MXFP4 values, so their records decode to them exactly: the records ops must give
    the float ops' scores and ids bit for bit, whatever rows the records sit at."""
    q, weights, keys, g = case()
    records, slots = in_records(keys, g)
    assert records.stride(0) > records.shape[1] and not torch.equal(slots, slots.sort().values)
    assert torch.equal(ops.cache_gather.reference(records, slots, "mxfp4", 32, q.dtype), keys)
    assert torch.equal(ops.indexer_scores_records.reference(q, weights, records, slots),
                       ops.indexer_scores.reference(q, weights, keys))
    visible = torch.tensor([0, 12, 40, 70, 90])
    candidates = torch.rand(5, 70, generator=g) > 0.5 if with_candidates else None
    got = ops.indexer_topk_records.reference(q, weights, records, slots, visible, 16, candidates)
    assert torch.equal(got, ops.indexer_topk.reference(q, weights, keys, visible, 16, candidates))


def test_records_ops_without_entries():
    """A source with no compressed entry yet: no scores, and every selected slot -1."""
    q, weights, keys, _ = case()
    records = ops.pack_cache_records.reference(keys, "mxfp4")  # rows exist, none is an entry
    slots = torch.zeros(0, dtype=torch.int64)
    assert ops.indexer_scores_records.reference(q, weights, records, slots).shape == (5, 0)
    ids = ops.indexer_topk_records.reference(q, weights, records, slots, torch.tensor([0, 1, 2, 3, 4]), 4)
    assert ids.tolist() == [[-1] * 4] * 5


def test_records_ops_dispatch_to_the_reference_on_cpu():
    q, weights, keys, g = case()
    records, slots = in_records(keys, g)
    visible = torch.tensor([0, 1, 31, 70, 90])
    assert ops.registry.select("indexer_scores_records", "cpu") is ops.indexer_scores_records.reference
    assert ops.registry.select("indexer_topk_records", "cpu") is ops.indexer_topk_records.reference
    assert torch.equal(ops.indexer_topk_records(q, weights, records, slots, visible, 8),
                       ops.indexer_topk_records.reference(q, weights, records, slots, visible, 8))


@pytest.mark.parametrize("sequences,rows,dim", [(1, 1, 32), (16, 1, 128), (4, 3, 128), (3, 6, 64)])
def test_a_batch_of_equal_sequences_scores_as_each_sequence_alone(sequences, rows, dim):
    """Decode and verification batches (every sequence the same query rows) are scored in one product: each
    sequence's scores must be what it gets scored alone, bit for bit, with -1 slots past its entries."""
    g = torch.Generator().manual_seed(sequences * 10 + rows)
    keys = ops.mxfp4_fake_quant.reference(torch.randn(300, dim, generator=g))
    records = ops.pack_cache_records.reference(keys, "mxfp4")
    slots = torch.randint(0, 300, (sequences, 90), generator=g)
    for b in range(sequences):
        slots[b, 90 - 7 * b:] = -1
    q = ops.mxfp4_fake_quant.reference(torch.randn(sequences * rows, 4, dim, generator=g))
    weights = torch.randn(sequences * rows, 4, generator=g)
    got = ops.indexer_scores_records.reference(q, weights, records, slots, [rows] * sequences)
    alone = [ops.indexer_scores_records.reference(q[b * rows: (b + 1) * rows], weights[b * rows: (b + 1) * rows],
                                                  records, slots[b]) for b in range(sequences)]
    assert torch.equal(got, torch.cat(alone))
