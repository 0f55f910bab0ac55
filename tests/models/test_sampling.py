"""The sampled distribution (models/deepseek_v41/sampling.py): exact kept sets at the top-k and top-p boundaries,
ties included, for the one definition that plain decoding, the drafter and the verify callers share."""

import math

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41.sampling import processed_probs, sample

NEG_INF = float("-inf")


def kept(logits, **settings) -> list[int]:
    return processed_probs(torch.tensor([logits]), **settings)[0].nonzero().flatten().tolist()


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(processed_probs(logits, top_k=2), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(processed_probs(logits, top_p=0.8), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(processed_probs(logits, top_p=0.81), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
    assert processed_probs(logits, temperature=0.0).tolist() == [[1.0, 0, 0, 0]]
    with pytest.raises(ValueError):
        processed_probs(logits, top_p=0.0)


def test_top_k_keeps_exactly_k_with_a_tie_at_the_kth_value():
    """A threshold at the k-th value would keep every tied token (3 here); exactly k are kept, the lower id first."""
    assert kept([2.0, 1.0, 1.0, 0.0], top_k=2) == [0, 1]
    assert kept([1.0, 2.0, 0.0, 1.0], top_k=2) == [0, 1]  # the tie (ids 0 and 3) goes to id 0, not to sort order
    assert kept([1.0, 1.0, 1.0, 1.0], top_k=3) == [0, 1, 2]
    probs = processed_probs(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), top_k=2)[0]
    assert probs.tolist() == pytest.approx([math.e / (math.e + 1), 1 / (math.e + 1), 0, 0])


def test_top_p_keeps_the_token_that_reaches_p():
    """The first token's mass is exactly 0.5: it alone reaches top_p = 0.5, so the second (whose preceding mass
    equals p, not less) is not kept."""
    logits = [math.log(2.0), 0.0, 0.0]
    assert torch.tensor([logits]).softmax(-1)[0, 0].item() == 0.5  # the boundary is exact, not a rounding
    assert kept(logits, top_p=0.5) == [0]
    assert kept(logits, top_p=0.51) == [0, 1]  # the tie at 0.25 straddles 0.75: the lower id stays
    assert kept([0.0, 0.0, NEG_INF], top_p=0.5) == [0]
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5) == [0, 1]
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5, top_k=1) == [0]


def test_settings_apply_per_row_and_at_every_position():
    logits = torch.tensor([[[2.0, 1.0, 1.0, 0.0]] * 3, [[math.log(2.0), 0.0, 0.0, NEG_INF]] * 3])  # [2, 3, 4]
    probs = processed_probs(logits, temperature=torch.tensor([1.0, 0.7]), top_k=torch.tensor([2, 0]),
                            top_p=torch.tensor([1.0, 0.5]))
    for pos in range(3):
        assert probs[0, pos].nonzero().flatten().tolist() == [0, 1]
        assert probs[1, pos].nonzero().flatten().tolist() == [0]


def test_greedy_ties_go_to_the_lower_id():
    assert processed_probs(torch.tensor([[0.0, 3.0, 3.0]]), temperature=0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert sample(torch.tensor([0.0, 3.0, 3.0]), temperature=0.0) == 1


def test_sample_draws_only_from_the_kept_set():
    """``sample`` is what plain decoding (generate) draws with: it must never return a token the boundary rule
    dropped, and it must reach every kept one."""
    g = torch.Generator().manual_seed(0)
    top_k = {sample(torch.tensor([1.0, 2.0, 0.0, 1.0]), 1.0, 2, 1.0, g) for _ in range(400)}
    assert top_k == {0, 1}
    top_p = {sample(torch.tensor([0.0, 0.0, 0.0, 0.0]), 1.0, 0, 0.5, g) for _ in range(400)}
    assert top_p == {0, 1}
