"""The DSpark drafter as the V4.1 checkpoint stores it (``mtp.0..N-1``), on the tiny model.

Guarantees: the drafter's tensors have exactly the checkpoint's names and shapes and round-trip through
write_random_checkpoint -> from_pretrained (auto-detected, or refused by name when incomplete); the draft
stages are SWA-only with the main RoPE and the draft MoE sizes; a block is non-causal inside and sees only the
``sliding_window`` context positions before the anchor; the Markov head is sequential (slot k's token and
confidence come from the previous slot's token) and is reproduced from the module pieces; sampled drafts come
with the distribution they were drawn from; feeding the context in pieces, with rollbacks, or from a bounded-
replay prefill drafts the same block as feeding it at once; batching requests changes nothing.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from deepinfer_plugins.models.deepseek_v41 import CheckpointError, DeepseekV41ForCausalLM, SequenceChunk
from deepinfer_plugins.models.deepseek_v41.attention import rope_inv_freq
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.drafter import DraftAttention, DSparkDrafter

from ..conftest import prompt

pytestmark = pytest.mark.usefixtures("single_thread")


def features(model, ids, bounded_replay=False):
    """Run ids as a fresh sequence; -> (logits, captured streams, cache)."""
    cache = model.new_cache()
    chunk = SequenceChunk(0, ids.numel(), 0, cache)
    layers = tuple(model.args.dspark_target_layer_ids)
    logits = model.forward_chunks(ids, [chunk], bounded_replay, capture_layers=layers)
    cache.advance(ids)
    return logits, chunk.published["streams_in"], cache


def draft(model, state, anchor, **kw):
    return model.drafter.propose(model.embed, model.head.weight, torch.tensor([anchor]), [state], **kw)


def context_state(model, ids, max_rollback=0):
    _, streams, _ = features(model, ids)
    state = model.drafter.new_state(max_rollback)
    model.drafter.add_context(state, model.drafter.context(streams), 0)
    return state


def test_tensor_names_and_shapes_follow_the_spec(tiny256):
    a = tiny256.args
    d, r, v = a.hidden_size, a.dspark_markov_rank, a.vocab_size
    sd = {k: t for k, t in tiny256.state_dict().items() if k.startswith("mtp.")}
    last = a.num_nextn_predict_layers - 1
    main_proj = sd["mtp.0.main_proj.weight"]
    assert main_proj.shape == (d, 3 * d) and main_proj.dtype == torch.float8_e4m3fn
    assert "mtp.0.main_proj.scale" in sd
    assert sd["mtp.0.main_norm.weight"].shape == (d,)
    assert sd[f"mtp.{last}.norm.weight"].shape == (d,)
    assert sd[f"mtp.{last}.markov_head.embed.weight"].shape == (v, r)
    assert sd[f"mtp.{last}.markov_head.head.weight"].shape == (v, r)
    assert sd[f"mtp.{last}.confidence_head.proj.weight"].shape == (1, d + r)
    # The block tensors of every stage carry the backbone layer names; no compressor / indexer / engram.
    backbone = {k.split(".", 2)[2] for k in tiny256.state_dict() if k.startswith("layers.0.")}
    for s in range(a.num_nextn_predict_layers):
        stage = {k.split(".", 2)[2] for k in sd if k.startswith(f"mtp.{s}.")}
        assert backbone - {n for n in backbone if n.startswith("ffn.experts.")} <= stage
        assert not any(n.startswith(("attn.compressor", "attn.indexer", "engram")) for n in stage)
        experts = {n.split(".")[2] for n in stage if n.startswith("ffn.experts.")}
        assert len(experts) == a.dspark_n_routed_experts
    heads_and_combiner = {k for k in sd if any(x in k for x in ("main_", "markov", "confidence", ".norm.weight"))}
    assert heads_and_combiner == {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight",
                                  f"mtp.{last}.norm.weight", f"mtp.{last}.markov_head.embed.weight",
                                  f"mtp.{last}.markov_head.head.weight", f"mtp.{last}.confidence_head.proj.weight"}


def test_draft_stages_are_swa_blocks_with_the_draft_moe(tiny256):
    a = tiny256.args
    for s, stage in enumerate(tiny256.drafter):
        assert isinstance(stage.attn, DraftAttention)
        assert stage.layer_id == a.num_hidden_layers + s and stage.attn.ratio == 0
        assert not stage.attn.is_kv_source and not stage.attn.is_index_source
        torch.testing.assert_close(stage.attn.inv_freq, rope_inv_freq(a, 0))  # main RoPE, no YaRN
        assert stage.ffn.gate.top_k == a.dspark_num_experts_per_tok
        assert stage.ffn.experts.n_experts == a.dspark_n_routed_experts


def test_checkpoint_round_trip(tiny256_dir, tiny256):
    """Every mtp.* tensor written by write_random_checkpoint loads unchanged (auto-detected)."""
    assert tiny256.drafter is not None
    index = json.loads((tiny256_dir / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if n.startswith("mtp.")]
    assert set(names) == {k for k in tiny256.state_dict() if k.startswith("mtp.")}
    loaded = tiny256.state_dict()
    for name in names:
        with safe_open(str(tiny256_dir / index[name]), "pt") as f:
            stored = f.get_tensor(name)
        if stored.element_size() == 1:  # FP8 / FP4 codes and E8M0 scales: compare the bits
            stored, expected = stored.view(torch.uint8), loaded[name].view(torch.uint8)
        else:
            stored, expected = stored.float(), loaded[name].float()
        assert torch.equal(stored, expected), name
    without = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, with_drafter=False)
    assert without.drafter is None and not any(k.startswith("mtp.") for k in without.state_dict())


def test_incomplete_drafter_loads_the_backbone_or_fails_by_name(tiny256_dir, tmp_path):
    ckpt = tmp_path / "partial"
    shutil.copytree(tiny256_dir, ckpt)
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["mtp.1.markov_head.head.weight"]
    index_file.write_text(json.dumps(index))
    assert DeepseekV41ForCausalLM.from_pretrained(ckpt).drafter is None
    with pytest.raises(CheckpointError, match="mtp.1.markov_head.head.weight"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt, with_drafter=True)


def test_preset_without_draft_stages(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "nodraft", "tiny-vocab256", num_nextn_predict_layers=0)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.startswith("mtp.") for n in index)
    assert DeepseekV41ForCausalLM.from_pretrained(ckpt).drafter is None
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 0"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt, with_drafter=True)


def test_context_uses_only_the_window_before_the_anchor(tiny256_f64):
    """Features of positions older than sliding_window before the anchor do not matter; newer ones do."""
    m, w = tiny256_f64, tiny256_f64.args.sliding_window
    ids = prompt(30, 1)
    _, streams, _ = features(m, ids)
    ctx = m.drafter.context(streams)
    results = []
    for changed in (None, 30 - w - 1, 30 - w):
        c = ctx.clone()
        if changed is not None:
            c[changed] = -c[changed]
        state = m.drafter.new_state()
        m.drafter.add_context(state, c, 0)
        results.append(m.drafter.hidden(m.embed, torch.tensor([7]), [state]))
    torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)
    assert (results[2] - results[0]).abs().max() > 1e-3


def test_block_is_non_causal(tiny256_f64):
    """Slot 0 attends to the later (noise) slots: changing the noise token changes slot 0's hidden state."""
    m = tiny256_f64
    state = context_state(m, prompt(20, 2))
    h = m.drafter.hidden(m.embed, torch.tensor([9]), [state])
    noise = m.args.dspark_noise_token_id
    try:
        m.args.dspark_noise_token_id = noise - 1
        h_other = m.drafter.hidden(m.embed, torch.tensor([9]), [state])
    finally:
        m.args.dspark_noise_token_id = noise
    assert (h[:, 0] - h_other[:, 0]).abs().max() > 1e-3


def test_markov_head_is_sequential_and_confidence_uses_the_previous_token(tiny256_f64):
    """Greedy slot k = argmax(head(norm(h_k)) + markov(x_{k-1})), x_0 = anchor; confidence from [h_k, E[x_{k-1}]]."""
    m = tiny256_f64
    state = context_state(m, prompt(25, 3))
    block = draft(m, state, 11)
    h = m.drafter.hidden(m.embed, torch.tensor([11]), [state])[0]  # [B, d]
    last = m.drafter[-1]
    prev = 11
    for k in range(m.drafter.block_size):
        e = last.markov_head.embed.weight[prev].double()
        logits = m.head.weight.double() @ last.norm(h[k]).double() + last.markov_head.head.weight.double() @ e
        logits[m.args.image_token_id] = float("-inf")
        assert int(block.tokens[0, k]) == int(logits.argmax())
        conf = last.confidence_head.proj.weight.double()[0] @ torch.cat((h[k].double(), e))
        torch.testing.assert_close(block.confidence_logits[0, k].double(), conf, atol=1e-5, rtol=0)
        prev = int(block.tokens[0, k])
    torch.testing.assert_close(block.confidences, torch.sigmoid(block.confidence_logits))
    assert block.draft_probs is None


def test_sampled_drafts_come_with_their_distribution(tiny256_f64):
    m = tiny256_f64
    state = context_state(m, prompt(25, 4))
    a = draft(m, state, 11, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(3))
    b = draft(m, state, 11, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)
    q = a.draft_probs[0]  # [B, V]
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0], dtype=q.dtype))
    assert ((q > 0).sum(-1) <= 5).all()
    assert (q.gather(-1, a.tokens[0][:, None]) > 0).all()
    # Slot k's q depends on the token drawn at k-1 (the Markov bias), so other draws give other q's.
    draws = {tuple(draft(m, state, 11, temperature=1.5, generator=torch.Generator().manual_seed(s)).tokens[0].tolist())
             for s in range(8)}
    assert len(draws) > 1


def test_context_in_pieces_with_rollback_and_bounded_replay(tiny256_f64):
    m = tiny256_f64
    ids = prompt(40, 5)
    whole = context_state(m, ids)
    _, streams, _ = features(m, ids)
    ctx = m.drafter.context(streams)
    pieces = m.drafter.new_state(max_rollback=3)
    m.drafter.add_context(pieces, ctx[:25], 0)
    m.drafter.add_context(pieces, torch.randn(3, ctx.shape[1], dtype=ctx.dtype), 25)  # rejected rows
    pieces.rollback(25)
    m.drafter.add_context(pieces, ctx[25:37], 25)
    m.drafter.add_context(pieces, -ctx[37:], 37)
    m.drafter.add_context(pieces, ctx[37:], 37)  # replaces the rows from 37 on
    _, replay_streams, _ = features(m, ids, bounded_replay=True)
    replay = m.drafter.new_state()
    rows = min(s.shape[0] for s in replay_streams.values())
    assert rows < ids.numel()
    m.drafter.add_context(replay, m.drafter.context(replay_streams), ids.numel() - rows)
    expected = draft(m, whole, 13)
    for state in (pieces, replay):
        got = draft(m, state, 13)
        assert torch.equal(got.tokens, expected.tokens)
        torch.testing.assert_close(got.confidence_logits, expected.confidence_logits, atol=1e-6, rtol=0)


def test_batched_drafting_equals_one_by_one(tiny256_f64):
    m = tiny256_f64
    states = [context_state(m, prompt(n, n)) for n in (12, 31)]
    both = m.drafter.propose(m.embed, m.head.weight, torch.tensor([5, 6]), states)
    for r, state in enumerate(states):
        one = draft(m, state, 5 + r)
        assert torch.equal(both.tokens[r], one.tokens[0])
        torch.testing.assert_close(both.confidence_logits[r], one.confidence_logits[0], atol=1e-4, rtol=0)


def test_drafts_read_the_head_the_logits_use(tiny256_dir):
    """A CPU server keeps an fp32 copy of the bf16 LM head (``keep_dense_weights``); the logits and the engines'
    drafters (vllm/spec_decode.py, dspark/engine_api.py) read it through ``head_weight``, so no draft widens the
    whole head again. The drafts are the ones the stored head gives."""
    m = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir)  # its own: keep_dense_weights changes the model
    state = context_state(m, prompt(20, 3))
    stored = m.drafter.propose(m.embed, m.head.weight, torch.tensor([5]), [state])
    assert m.head_weight is m.head.weight
    m.keep_dense_weights()
    assert m.head.weight.dtype == torch.bfloat16
    assert m.head_weight is m.head.dense and m.head_weight.dtype == torch.float32
    kept = m.drafter.propose(m.embed, m.head_weight, torch.tensor([5]), [state])
    assert torch.equal(kept.tokens, stored.tokens)
    torch.testing.assert_close(kept.confidence_logits, stored.confidence_logits, atol=1e-5, rtol=0)


def test_feature_reduction_switch(tiny256_f64):
    m = tiny256_f64
    _, streams, _ = features(m, prompt(10, 6))
    try:
        outs = {}
        for how in ("mean", "sum", "stream0"):
            m.args.dspark_feature_reduction = how
            outs[how] = m.drafter.context(streams)
    finally:
        m.args.dspark_feature_reduction = "mean"
    # main_norm makes the context scale-free, so sum == mean; stream 0 alone is a different feature.
    torch.testing.assert_close(outs["sum"], outs["mean"], atol=1e-6, rtol=0)
    assert (outs["stream0"] - outs["mean"]).abs().max() > 1e-2
    with pytest.raises(KeyError, match="capture_layers"):
        m.drafter.context({5: streams[5]})


def test_drafter_needs_draft_stages(tiny256):
    args = tiny256.args
    saved = args.num_nextn_predict_layers
    try:
        args.num_nextn_predict_layers = 0
        with pytest.raises(ValueError, match="no DSpark draft stages"):
            DSparkDrafter(args)
    finally:
        args.num_nextn_predict_layers = saved
