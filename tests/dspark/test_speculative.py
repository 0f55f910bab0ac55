"""The reference speculative loop (dspark/speculative.py) on the tiny model with its random drafter.

Guarantees: greedy speculative decoding is token-identical to ``generate()`` for several prompts, 60 new
tokens (crossing the 8-token window and many compression groups), with fixed verify lengths 3 (and 1) and with
Algorithm-A planned lengths; with drafts that are partly right (the true continuation planted in a varying
number of slots) it still is, while accepting several drafts and bonus tokens per round; an EOS inside an
accepted prefix ends the output at the EOS; sampled decoding is reproducible per seed, and the token after
the first speculative round follows the target's processed distribution (chi-square, planted drafts whose q
overlaps p partly, so acceptances, rejections and residual draws all occur). Runs in float64 (conftest.py).

The random drafter's own acceptance is reported (printed with -s); it is near zero because the weights are
random, so the planted-draft tests are what exercise multi-token acceptance.
"""

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from deepinfer_plugins.dspark.cost_model import CostTable
from deepinfer_plugins.dspark.speculative import SpeculativeDecoder, speculative_generate
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate
from deepinfer_plugins.models.deepseek_v41.sampling import processed_probs

from ..conftest import prompt

PROMPTS = [(24, 7), (27, 3), (48, 4)]  # (length, seed); their greedy continuations avoid the image token

pytestmark = pytest.mark.usefixtures("single_thread")


class PlantedDecoder(SpeculativeDecoder):
    """Replaces the first j drafts of round i with the true greedy continuation (j cycles 0..B), the rest with
    a wrong token: deterministic acceptance of 0..B drafts, bonus tokens included."""

    def __init__(self, model, truth: list[int], params=None, **kw):
        super().__init__(model, params, **kw)
        self.truth, self.round, self.planted = truth, 0, []

    def draft(self, request, generator):
        out = super().draft(request, generator)
        anchor_pos = request.start_pos + next(iter(request.streams_in.values())).shape[0]
        done = anchor_pos - self.prompt_len + 1  # output tokens so far (the anchor included)
        j = self.round % (self.block_size + 1)
        self.round += 1
        self.planted.append((done, j))
        tokens = out.proposal.draft_tokens.clone()
        for k in range(self.block_size):
            true = self.truth[done + k] if done + k < len(self.truth) else 3
            tokens[0, k] = true if k < j else (true + 1) % 250 + 3 * (true + 1 >= 250)
        return dataclasses.replace(out, proposal=dataclasses.replace(out.proposal, draft_tokens=tokens))

    def generate(self, prompt_ids):
        self.prompt_len = len(prompt_ids)
        return super().generate(prompt_ids)


@pytest.mark.parametrize("length,seed", PROMPTS)
def test_greedy_speculative_equals_generate(tiny256_f64, length, seed):
    ids = prompt(length, seed).tolist()
    params = SamplingParams(max_new_tokens=60)
    expected = generate(tiny256_f64, ids, params)
    out, stats = speculative_generate(tiny256_f64, ids, params)
    assert out == expected
    assert stats.committed == len(out) - 1  # every token after the first comes from a verify round
    print(f"\nrandom drafter, prompt {length}/{seed}: {stats.as_dict()}")
    if length == PROMPTS[0][0]:
        assert speculative_generate(tiny256_f64, ids, params, num_verify=1)[0] == expected
    cost = CostTable([1, 2, 3, 4], [10.0, 10.5, 11.0, 11.5])
    planned, stats = speculative_generate(tiny256_f64, ids, params, step_cost=cost)
    assert planned == expected
    assert stats.verified_drafts < 3 * stats.rounds  # the low confidences of a random head shorten verification


def test_planted_drafts_are_accepted_and_output_is_unchanged(tiny256_f64):
    ids = prompt(27, 3).tolist()
    params = SamplingParams(max_new_tokens=60)
    expected = generate(tiny256_f64, ids, params)
    decoder = PlantedDecoder(tiny256_f64, expected, params)
    assert decoder.generate(ids) == expected
    s = decoder.stats
    assert s.accepted_drafts > 20 and s.acceptance_length > 2
    assert s.accepted_at[-1] > 0  # whole blocks accepted: the bonus path
    assert s.verified_at[0] > s.accepted_at[0] > s.accepted_at[1] > 0


def test_eos_inside_an_accepted_prefix_stops(tiny256_f64):
    """Stop token = the first of a round's B planted (accepted) drafts: the output ends right there, although
    the verify accepted the drafts after it too."""
    ids = prompt(27, 3).tolist()
    expected = generate(tiny256_f64, ids, SamplingParams(max_new_tokens=60))
    decoder = PlantedDecoder(tiny256_f64, expected, SamplingParams(max_new_tokens=60))
    decoder.generate(ids)
    b = decoder.block_size
    i = next(done for done, j in decoder.planted if j == b and expected[done] not in expected[:done])
    params = SamplingParams(max_new_tokens=60, stop_token_ids=(expected[i],))
    stopped = PlantedDecoder(tiny256_f64, expected, params)
    out = stopped.generate(ids)
    assert out == expected[: i + 1] == generate(tiny256_f64, ids, params)
    assert stopped.planted[-1] == (i, b) and stopped.stats.accepted_at[b - 1] > 0


def test_sampled_speculative_is_reproducible(tiny256_f64):
    ids = prompt(24, 7).tolist()
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_k=20, seed=5)
    a, stats = speculative_generate(tiny256_f64, ids, params)
    b, _ = speculative_generate(tiny256_f64, ids, params)
    assert a == b and len(a) == 30 and stats.rounds > 0
    c, _ = speculative_generate(tiny256_f64, ids, dataclasses.replace(params, seed=6))
    assert c != a


class MixtureDecoder(SpeculativeDecoder):
    """Drafts x_1 from q = 0.5 p_true + 0.5 onehot(w), p_true the target's processed distribution after the
    anchor and w a token outside its top-k: the ratio test then accepts some drafts and rejects others."""

    def __init__(self, model, p_next: dict, params, wrong: int):
        super().__init__(model, params, num_verify=1)
        self.p_next, self.wrong = p_next, wrong

    def draft(self, request, generator):
        out = super().draft(request, generator)
        if request.anchor_token not in self.p_next:  # a later round (t2 was a correction): the real drafter
            return out
        q = 0.5 * self.p_next[request.anchor_token]
        q[self.wrong] += 0.5
        x = torch.multinomial(q, 1, generator=generator)
        probs = out.proposal.draft_probs.clone()
        probs[0, 0] = q
        tokens = out.proposal.draft_tokens.clone()
        tokens[0, 0] = x
        return dataclasses.replace(out, proposal=dataclasses.replace(out.proposal, draft_tokens=tokens,
                                                                     draft_probs=probs))


def test_sampled_speculative_follows_the_target_distribution(tiny256_f64):
    """(t1, t2) over 300 seeds: t1 from the prefill, t2 from one verify round of one draft; the joint law must
    be p(t1) p(t2 | t1) of the processed target (temperature 1, top-k 3)."""
    m = tiny256_f64
    ids = prompt(6, 8).tolist()
    params = SamplingParams(max_new_tokens=2 + 1, temperature=1.0, top_k=3)
    process = lambda logits: processed_probs(logits[-1:], 1.0, 3, 1.0)[0]  # noqa: E731
    p1 = process(m(torch.tensor(ids)))
    firsts = p1.nonzero().flatten().tolist()
    p_next = {t: process(m(torch.tensor(ids + [t]))) for t in firsts}
    wrong = int(torch.stack(list(p_next.values())).sum(0).argmin())
    cells = [(a, b) for a in firsts for b in p_next[a].nonzero().flatten().tolist()]
    counts = dict.fromkeys(cells, 0)
    accepted = 0
    for seed in range(300):
        decoder = MixtureDecoder(m, p_next, dataclasses.replace(params, seed=seed), wrong)
        out = decoder.generate(ids)
        counts[(out[0], out[1])] += 1
        accepted += decoder.stats.accepted_drafts
    expected = np.array([float(p1[a] * p_next[a][b]) for a, b in cells]) * 300
    observed = np.array([counts[c] for c in cells])
    p_value = chi2.sf(((observed - expected) ** 2 / expected).sum(), len(cells) - 1)
    assert p_value > 0.001, (observed, expected.round(1))
    assert 50 < accepted < 250  # both the acceptance and the residual path were taken
