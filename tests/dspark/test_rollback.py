"""Exact cache rollback on the tiny model (SequenceCache.rollback, DraftState.rollback).

Guarantees: running extra tokens and rolling them back leaves a cache that decodes exactly like one that never
saw them: same logits (1e-4 on fp32, identical argmax), across the 8-token window, ratio-2 groups cut in the
middle (the open group is rebuilt from the kept compressor inputs), ratio-1 entries, and Engram's n-gram
history. A rollback deeper than ``max_rollback`` is refused with RollbackError, never silently inexact.
Runs in float64 (see conftest.py). Tolerance 1e-4 with identical argmax, as in tests/models/test_decode.py:
the fake FP8 / FP4 quantisation of cached latents can still round a value to the neighbouring code when the
batch shape changes its last bits, which moves logits by ~1e-6.
"""

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41.kv_cache import RollbackError, SequenceCache

from ..conftest import prompt

pytestmark = pytest.mark.usefixtures("single_thread")


def assert_same_logits(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def new_cache(model, max_rollback):
    return SequenceCache(model.args, max_rollback=max_rollback)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_with_rollbacks_equals_decode_without(tiny256_f64, seed):
    """Verify-like steps: run the true next token plus up to 4 junk tokens in one forward, keep the true one
    (and, sometimes, a true prefix of several), roll the junk back; the kept rows' logits and everything after
    equal a plain run of the true sequence."""
    ids = prompt(76, seed)
    full = tiny256_f64(ids)
    cache = new_cache(tiny256_f64, max_rollback=4)
    outputs = [tiny256_f64(ids[:17], cache)]
    gen = torch.Generator().manual_seed(seed)
    pos = 17
    while pos < ids.numel():
        keep = min(int(torch.randint(1, 4, (1,), generator=gen)), ids.numel() - pos)
        junk = torch.randint(3, 250, (int(torch.randint(0, 4 - keep + 2, (1,), generator=gen)),), generator=gen)
        run = torch.cat((ids[pos: pos + keep], junk))
        logits = tiny256_f64(run, cache)
        cache.rollback(pos + keep)
        outputs.append(logits[:keep])
        pos += keep
    assert cache.num_tokens == ids.numel()
    assert_same_logits(torch.cat(outputs), full)


def test_rollback_state_equals_a_fresh_cache(tiny256_f64):
    """After a rollback that cuts a ratio-2 group, every piece of state matches a cache built without the
    dropped tokens (window rows by position, compressed entries, pending compressor inputs, n-gram history)."""
    ids = prompt(40, 3)
    rolled, fresh = new_cache(tiny256_f64, 5), new_cache(tiny256_f64, 5)
    tiny256_f64(ids[:30], rolled)
    tiny256_f64(ids[30:35], rolled)  # one verify-like forward of 5 rows
    rolled.rollback(31)  # the ratio-2 group [30, 32) is open again with one token
    tiny256_f64(ids[:31], fresh)
    for layer in range(tiny256_f64.args.num_hidden_layers):
        assert torch.equal(rolled.rings[layer].read(31 - 8, 31), fresh.rings[layer].read(23, 31))  # fp8 records
    for source, state in rolled.sources.items():
        other = fresh.sources[source]
        assert state.num_entries == other.num_entries
        entries = torch.arange(state.num_entries)
        dim = tiny256_f64.args.head_dim
        torch.testing.assert_close(ops.cache_gather(state.latents.records, entries, "nvfp4", dim, torch.float64),
                                   ops.cache_gather(other.latents.records, entries, "nvfp4", dim, torch.float64),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(state.pending_values, other.pending_values, atol=1e-5, rtol=0)
        torch.testing.assert_close(state.pending_gates, other.pending_gates, atol=1e-5, rtol=0)
    assert rolled.ngram_history() == fresh.ngram_history() == ids[28:31].tolist()
    nxt = ids[31:33]
    assert_same_logits(tiny256_f64(nxt, rolled), tiny256_f64(nxt, fresh))


def test_rollback_limits(tiny256_f64):
    ids = prompt(20, 4)
    cache = new_cache(tiny256_f64, 2)
    tiny256_f64(ids, cache)
    with pytest.raises(RollbackError, match="max_rollback=2"):
        cache.rollback(17)
    with pytest.raises(RollbackError, match="holds 20"):
        cache.rollback(21)
    cache.rollback(20)  # no-op
    cache.rollback(18)
    assert cache.num_tokens == 18
    plain = tiny256_f64.new_cache()
    tiny256_f64(ids, plain)
    with pytest.raises(RollbackError):
        plain.rollback(19)


def test_rings_keep_the_window_through_a_rollback(tiny256_f64):
    """A verify forward writes up to max_rollback rows past the anchor; with a ring of window + max_rollback
    rows those never overwrite positions the next token still needs: after the rollback every layer's ring
    still holds the records of positions 13..19 exactly as the prefill wrote them, the kept verify row 20 as a
    cache that never saw the rejected tokens holds it (up to the quantisation flips of a different batch shape,
    see the module docstring), and nothing of the rejected positions 21..23."""
    ids = prompt(30, 5)
    cache, fresh = new_cache(tiny256_f64, 3), new_cache(tiny256_f64, 3)
    tiny256_f64(ids[:20], cache)
    layers = range(tiny256_f64.args.num_hidden_layers)
    prefilled = [cache.rings[layer].read(21 - 8, 20).clone() for layer in layers]
    tiny256_f64(torch.tensor([7, 8, 9, 10]), cache)  # positions 20..23
    cache.rollback(21)
    tiny256_f64(torch.cat((ids[:20], torch.tensor([7]))), fresh)
    for layer in layers:
        ring, other = cache.rings[layer], fresh.rings[layer]
        assert torch.equal(ring.read(21 - 8, 20), prefilled[layer]), layer
        assert sorted(p for p in ring.positions.tolist() if p >= 0) == list(range(21 - 8, 21)), layer
        dim = tiny256_f64.args.head_dim
        kept, want = (ops.cache_gather(r.rows, r.slots(20, 21), r.fmt, dim, torch.float64) for r in (ring, other))
        torch.testing.assert_close(kept, want, atol=0.07 * want.abs().max().item(), rtol=0)
