"""The indexer's short-context path (``Indexer.selects_every_visible_entry``) on the tiny model: where every query
row sees at most ``index_topk`` entries (and every candidate block survives the pre-filter), the selection is
taken from the geometry without scoring. Guarantee: the same logits bit for bit, and the same published
candidate pre-filter, as scoring and selecting, on both sides of the bound (tiny: index_topk 4, ratio 1 and 2
index sources, candidate blocks of 2), from a one-token prefill (nothing compressed yet) on."""

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41.indexer import Indexer

from ..conftest import prompt


def run(model, ids, decode_from, monkeypatch, shortcut: bool):
    """Logits of a prefill of ids[:decode_from] then single-token decodes, the candidates each index layer
    published (in call order), and how often the short path ran."""
    published, taken = [], []
    every, forward = Indexer.every_visible_entry, Indexer.forward

    def every_spy(self, positions, num_entries, chunks):
        taken.append(self.layer_id)
        ids = every(self, positions, num_entries, chunks)
        published.extend(c.published["candidates"] for c in chunks if self.is_candidate_source)
        return ids

    def forward_spy(self, *args):
        ids = forward(self, *args)
        published.extend(c.published["candidates"] for c in args[-1] if self.is_candidate_source)
        return ids

    monkeypatch.setattr(Indexer, "every_visible_entry", every_spy)
    monkeypatch.setattr(Indexer, "forward", forward_spy)
    if not shortcut:
        monkeypatch.setattr(Indexer, "selects_every_visible_entry", lambda self, chunks: False)
    cache = model.new_cache()
    steps = [model(ids[:decode_from], cache)] + [model(ids[i:i + 1], cache) for i in range(decode_from, len(ids))]
    monkeypatch.undo()
    return torch.cat(steps), published, taken


@pytest.mark.parametrize("decode_from, short_layers", [(1, {2, 4, 6}), (5, {2}), (9, {2})])
def test_short_context_selection_equals_scoring(tiny256, monkeypatch, decode_from, short_layers):
    ids = prompt(14, decode_from)
    scored, scored_candidates, untaken = run(tiny256, ids, decode_from, monkeypatch, shortcut=False)
    short, short_candidates, taken = run(tiny256, ids, decode_from, monkeypatch, shortcut=True)
    assert not untaken
    assert set(taken) == short_layers  # layer 2: ratio 2; layer 4: the candidate source; layer 6 uses candidates
    assert torch.equal(short, scored)
    assert len(short_candidates) == len(scored_candidates) > 0
    for ours, theirs in zip(short_candidates, scored_candidates):
        assert torch.equal(ours, theirs)


def test_the_short_path_stops_at_the_bound(tiny256):
    args = tiny256.args
    for layer in args.index_source_layer_ids:
        indexer = tiny256.layers[layer].attn.indexer
        ratio = args.layer_ratios[layer]

        class Chunk:
            start_pos, num_rows = 0, args.index_topk * ratio

        assert indexer.selects_every_visible_entry([Chunk])
        Chunk.num_rows += ratio
        assert not indexer.selects_every_visible_entry([Chunk])
