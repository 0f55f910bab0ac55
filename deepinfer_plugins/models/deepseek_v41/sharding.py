"""Tensor-parallel sharding of V4.1's sublayers: which weights split along which axis, and what is summed.

Attention splits by query heads in whole output groups: rank r keeps the heads of groups
[r*G/tp, (r+1)*G/tp) (their ``wq_b`` rows, sinks, ``wo_a`` rows) and the matching input columns of ``wo_b``;
the single latent KV, the q latent, the compressor and the indexer are replicated (MQA has one KV head, so the
caches are the same on every rank). MoE splits every expert's intermediate dimension (``w1``/``w3`` rows,
``w2`` columns); the router is replicated. Each rank's sublayer output is a partial sum: an all-reduce (sum)
over ranks gives the unsharded output, which is what the mHC expand consumes.

Routed experts keep their FP4 stacks when every split point falls on a 32-column scale block (true for the
released 2304-wide experts split 2, 4 or 8 ways), so a shard reads 1/tp of the FP4 bytes; the other shards are
built from dequantised weights, so any split is exact (attention and the shared expert still are: a deployment
would keep their FP8 tensors, split on 32-column blocks, 1024-wide groups).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ... import ops
from .attention import Attention
from .linear import WEIGHT_BLOCK, Linear
from .moe import MoE, RoutedExperts


def _dense(linear: Linear, rows: slice = slice(None), cols: slice = slice(None)) -> Linear:
    weight = linear.dense_weight(torch.float32)[rows, cols]
    shard = Linear(weight.shape[1], weight.shape[0])
    shard.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return shard


def shard_attention(attn: Attention, rank: int, world: int) -> Attention:
    """Rank ``rank`` of ``world`` of an attention layer; its forward returns this rank's partial output."""
    if attn.o_groups % world:
        raise ValueError(f"o_groups={attn.o_groups} cannot be split over {world} ranks")
    groups = attn.o_groups // world
    heads = attn.n_heads // world
    head_rows = slice(rank * heads * attn.head_dim, (rank + 1) * heads * attn.head_dim)
    lora = attn.wo_a.out_features // attn.o_groups
    group_rows = slice(rank * groups * lora, (rank + 1) * groups * lora)
    shard = copy.copy(attn)
    shard._modules = dict(attn._modules)
    shard._parameters = dict(attn._parameters)
    shard.n_heads, shard.o_groups = heads, groups
    shard.wq_b = _dense(attn.wq_b, rows=head_rows)
    shard.wo_a = _dense(attn.wo_a, rows=group_rows)
    shard.wo_b = _dense(attn.wo_b, cols=group_rows)
    shard.attn_sink = nn.Parameter(attn.attn_sink[rank * heads:(rank + 1) * heads].clone(), requires_grad=False)
    return shard


def shard_moe(moe: MoE, rank: int, world: int) -> MoE:
    """Rank ``rank`` of ``world`` of an MoE layer (every expert's intermediate dimension split)."""
    shard = copy.copy(moe)
    shard._modules = dict(moe._modules)
    shard.experts = _shard_routed(moe.experts, rank, world)
    shard.shared_experts = _shard_expert(moe.shared_experts, rank, world)
    return shard


def _expert_part(inter: int, rank: int, world: int) -> slice:
    if inter % world:
        raise ValueError(f"expert width {inter} cannot be split over {world} ranks")
    return slice(rank * inter // world, (rank + 1) * inter // world)


def _shard_expert(expert, rank: int, world: int):
    part = _expert_part(expert.w1.out_features, rank, world)
    shard = copy.copy(expert)
    shard._modules = dict(expert._modules)
    shard.w1, shard.w3 = _dense(expert.w1, rows=part), _dense(expert.w3, rows=part)
    shard.w2 = _dense(expert.w2, cols=part)
    return shard


def _shard_routed(experts: RoutedExperts, rank: int, world: int) -> RoutedExperts:
    """Every routed expert's slice of the intermediate dimension. FP4 stacks stay FP4 when the slice starts and
    ends on a 32-column scale block (2304-wide experts over 2, 4 or 8 ranks); otherwise the slice is dequantised."""
    stored = experts.stored_weights()
    part = _expert_part(stored.w1.shape[1], rank, world)
    if stored.quantised and part.start % WEIGHT_BLOCK == 0 and part.stop % WEIGHT_BLOCK == 0:
        packed, blocks = slice(part.start // 2, part.stop // 2), slice(part.start // WEIGHT_BLOCK,
                                                                       part.stop // WEIGHT_BLOCK)
        shard = ops.ExpertWeights(stored.w1[:, part], stored.w1_scale[:, part], stored.w3[:, part],
                                  stored.w3_scale[:, part], stored.w2[:, :, packed], stored.w2_scale[:, :, blocks])
    else:
        dense = experts.dense_weights(torch.float32)
        shard = dense._replace(w1=dense.w1[:, part], w3=dense.w3[:, part], w2=dense.w2[:, :, part])
    return RoutedExperts.from_weights(shard, experts.swiglu_limit)


def shard_blocks(blocks, rank: int, world: int, all_reduce) -> None:
    """Turn every block into rank ``rank``'s shard, in place; ``all_reduce`` sums partial outputs over ranks."""
    for block in blocks:
        block.attn = shard_attention(block.attn, rank, world)
        block.ffn = shard_moe(block.ffn, rank, world)
        block.reduce_partial = all_reduce
