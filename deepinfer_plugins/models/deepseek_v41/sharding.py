"""Tensor-parallel sharding of V4.1's sublayers: which weights split along which axis, and what is summed.

Attention splits by query heads in whole output groups: rank r keeps the heads of groups
[r*G/tp, (r+1)*G/tp) (their ``wq_b`` rows, sinks, ``wo_a`` rows) and the matching input columns of ``wo_b``;
the single latent KV, the q latent, the compressor and the indexer are replicated (MQA has one KV head, so the
caches are the same on every rank). MoE splits every expert's intermediate dimension (``w1``/``w3`` rows,
``w2`` columns); the router is replicated. Each rank's sublayer output is a partial sum: an all-reduce (sum)
over ranks gives the unsharded output, which is what the mHC expand consumes.

Shards keep the stored formats when every split point falls on a scale block, so a rank reads 1/tp of the
quantised bytes: the FP8 projections (32x32 blocks: V4.1's 512-row heads, 1024-row output groups and 2304-wide
shared expert split 2, 4 or 8 ways) and the routed experts' FP4 stacks (32-column blocks). Other splits are built
from dequantised weights, so any split is exact.
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


def _on_blocks(part: range, size: int) -> bool:
    return part.step == 1 and part.start % WEIGHT_BLOCK == 0 and (part.stop % WEIGHT_BLOCK == 0 or part.stop == size)


def shard_linear(linear: Linear, rows: slice = slice(None), cols: slice = slice(None)) -> Linear:
    """The rows / columns of a projection: FP8 codes with their scales as stored when the slice lies on whole
    scale blocks, else ``_dense``. A kept dense copy (``keep_dense``) is kept for the shard too."""
    out_rows, in_cols = range(linear.out_features)[rows], range(linear.in_features)[cols]
    if linear.fmt != "fp8" or not (_on_blocks(out_rows, linear.out_features) and
                                   _on_blocks(in_cols, linear.in_features)):
        return _dense(linear, rows, cols)
    shard = Linear(len(in_cols), len(out_rows), "fp8")
    shard.weight = nn.Parameter(linear.weight[rows, cols].contiguous(), requires_grad=False)
    scale_rows = slice(out_rows.start // WEIGHT_BLOCK, -(-out_rows.stop // WEIGHT_BLOCK))
    scale_cols = slice(in_cols.start // WEIGHT_BLOCK, -(-in_cols.stop // WEIGHT_BLOCK))
    shard.scale = nn.Parameter(linear.scale[scale_rows, scale_cols].contiguous(), requires_grad=False)
    dense = getattr(linear, "dense", None)
    if dense is not None:
        shard.keep_dense(dense.dtype)
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
    shard.wq_b = shard_linear(attn.wq_b, rows=head_rows)
    shard.wo_a = shard_linear(attn.wo_a, rows=group_rows)
    shard.wo_b = shard_linear(attn.wo_b, cols=group_rows)
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
    shard.w1, shard.w3 = shard_linear(expert.w1, rows=part), shard_linear(expert.w3, rows=part)
    shard.w2 = shard_linear(expert.w2, cols=part)
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
