"""The engine-facing drafting call (dspark/engine_api.py) on the tiny model.

Guarantees: one ``step`` over several requests drafts what per-request steps draft; features fed in pieces,
or appended for all verified rows and then rolled back, give the drafts of feeding the accepted rows only;
STS temperatures change the confidences but not the drafts; misuse (unknown request, anchor not right after
the features, no drafter) raises with a message saying what to do.
"""

import pytest
import torch

from deepinfer_plugins.dspark.engine_api import DraftRequest, DSparkEngineDrafter
from deepinfer_plugins.dspark.proposal import DSparkProposal
from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM, SequenceChunk

from ..conftest import prompt

pytestmark = pytest.mark.usefixtures("single_thread")


def streams_of(model, ids):
    cache = model.new_cache()
    chunk = SequenceChunk(0, ids.numel(), 0, cache)
    model.forward_chunks(ids, [chunk], capture_layers=tuple(model.args.dspark_target_layer_ids))
    return chunk.published["streams_in"]


def rows(streams, a, b):
    return {layer: s[a:b] for layer, s in streams.items()}


def test_batched_step_equals_single_steps(tiny256_f64):
    m = tiny256_f64
    s1, s2 = streams_of(m, prompt(20, 1)), streams_of(m, prompt(33, 2))
    batched = DSparkEngineDrafter(m)
    for r in ("a", "b"):
        batched.add_request(r)
    both = batched.step([DraftRequest("a", s1, 0, 7), DraftRequest("b", s2, 0, 9)])
    assert isinstance(both.proposal, DSparkProposal) and both.proposal.draft_tokens.shape == (2, m.drafter.block_size)
    for r, (s, anchor) in enumerate(((s1, 7), (s2, 9))):
        single = DSparkEngineDrafter(m)
        single.add_request("x")
        one = single.step([DraftRequest("x", s, 0, anchor)])
        assert torch.equal(one.proposal.draft_tokens[0], both.proposal.draft_tokens[r])
        torch.testing.assert_close(one.confidence_logits[0], both.confidence_logits[r], atol=1e-4, rtol=0)


def test_pieces_and_rollback_equal_accepted_rows_only(tiny256_f64):
    m = tiny256_f64
    ids = prompt(30, 3)
    s = streams_of(m, ids)
    ref = DSparkEngineDrafter(m)
    ref.add_request("r")
    expected = ref.step([DraftRequest("r", rows(s, 0, 26), 0, 5)])
    api = DSparkEngineDrafter(m, max_rollback=6)
    api.add_request("r")
    api.update("r", rows(s, 0, 20), 0)
    api.update("r", rows(s, 20, 29), 20)  # all verified rows ...
    api.rollback("r", 26)  # ... of which 6 were accepted
    assert api.num_context_tokens("r") == 26
    got = api.step([DraftRequest("r", {}, 26, 5)])
    assert torch.equal(got.proposal.draft_tokens, expected.proposal.draft_tokens)
    # Features replacing positions already present roll back implicitly.
    api.update("r", rows(s, 24, 30), 24)
    api.rollback("r", 26)
    got = api.step([DraftRequest("r", {}, 26, 5)])
    assert torch.equal(got.proposal.draft_tokens, expected.proposal.draft_tokens)


def test_sts_changes_confidences_not_drafts(tiny256_f64):
    m = tiny256_f64
    s = streams_of(m, prompt(20, 4))
    raw, sts = DSparkEngineDrafter(m), DSparkEngineDrafter(m, sts_temperatures=[2.0] * m.drafter.block_size)
    outs = []
    for api in (raw, sts):
        api.add_request("r")
        outs.append(api.step([DraftRequest("r", s, 0, 3)]))
    assert torch.equal(outs[0].proposal.draft_tokens, outs[1].proposal.draft_tokens)
    torch.testing.assert_close(outs[1].proposal.confidences, torch.sigmoid(outs[0].confidence_logits / 2))


def test_misuse_is_named(tiny256_f64, tiny256_dir):
    m = tiny256_f64
    api = DSparkEngineDrafter(m)
    with pytest.raises(KeyError, match="add_request"):
        api.step([DraftRequest("nope", {}, 0, 3)])
    api.add_request("r")
    with pytest.raises(KeyError, match="already"):
        api.add_request("r")
    s = streams_of(m, prompt(10, 5))
    with pytest.raises(ValueError, match="anchor must sit right after"):
        api.step([DraftRequest("r", rows(s, 0, 10), 0, 3), DraftRequest("r", {}, 4, 3)])
    with pytest.raises(ValueError, match="with_drafter=True"):
        DSparkEngineDrafter(DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, with_drafter=False))
