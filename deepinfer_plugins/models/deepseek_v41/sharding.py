"""Tensor-parallel shards of V4.1's blocks: which stored tensors split along which axis, read as shards.

Attention splits by query heads in whole output groups: rank r keeps the heads of groups
[r*G/tp, (r+1)*G/tp) (their ``wq_b`` rows, sinks, ``wo_a`` rows) and the matching input columns of ``wo_b``;
the single latent KV, the q latent, the compressor and the indexer are replicated (MQA has one KV head, so the
caches are the same on every rank). MoE splits every expert's intermediate dimension (``w1``/``w3`` rows,
``w2`` columns); the router is replicated. Each rank's sublayer output is a partial sum: an all-reduce (sum)
over ranks gives the unsharded output, which is what the mHC expand consumes. Embedding, head, norms, mHC
mixers, Engram and the DSpark drafter are replicated.

``shard_model`` turns a built, not yet loaded model (empty parameters, so no page of the full-size weights is
ever touched) into rank r's shape and returns the ``ShardPlan`` the one loader (loader.py) reads it with: for
each split tensor the shape the checkpoint must hold and the part this rank reads, so a rank reads and holds
1/tp of the split weights. The part read is widened to whole scale blocks (FP8: 32x32; FP4 experts: 32 input
columns, one scale per row), so FP8 codes and FP4 stacks stay as stored. When the split point falls inside a
block (``ShardPlan.trims``), ``finish_shards`` dequantises the widened part and keeps the exact slice, so any
split is exact; V4.1's 512-row heads, 1024-row output groups and 2304-wide experts split 2, 4 or 8 ways on
whole blocks. How loading uses the plan: docs/architecture.md#tensor-parallel-loading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .linear import WEIGHT_BLOCK, Linear
from .moe import RoutedExperts


@dataclass(frozen=True)
class TensorParallel:
    """A process's place in a tensor-parallel group, and the sum over the group of a partial sublayer output."""

    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Read:
    """One split tensor as a rank reads it: the shape the checkpoint must hold, and the part the rank takes."""

    full_shape: tuple[int, ...]
    index: tuple[slice, ...]


@dataclass(frozen=True)
class Trim:
    """The exact slice ``keep`` along ``axis`` of a projection's dense weight, within the widened part read."""

    axis: int
    keep: slice


@dataclass
class ShardPlan:
    """Rank ``rank`` of ``world``: official tensor name -> ``Read`` of every split tensor (the others are read
    whole), and module path -> ``Trim`` of every projection whose split falls inside a scale block."""

    rank: int
    world: int
    reads: dict[str, Read] = field(default_factory=dict)
    trims: dict[str, Trim] = field(default_factory=dict)


def _rank_part(size: int, rank: int, world: int, what: str) -> range:
    if size % world:
        raise ValueError(f"{what}={size} cannot be split over {world} ranks")
    return range(rank * size // world, (rank + 1) * size // world)


def _widened(part: range, size: int, block: int) -> range:
    """``part`` grown to whole ``block``s (the last block of ``size`` may be partial)."""
    return range(part.start // block * block, min(-(-part.stop // block) * block, size))


def _along(axis: int, part: range, ndim: int) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    index[axis] = slice(part.start, part.stop)
    return tuple(index)


def _narrowed(parameter: torch.Tensor, index: tuple[slice, ...]) -> nn.Parameter:
    """An empty parameter of ``parameter[index]``'s shape and dtype, on its device."""
    shape = [len(range(dim)[i]) for dim, i in zip(parameter.shape, index)]
    return nn.Parameter(torch.empty(shape, dtype=parameter.dtype, device=parameter.device), requires_grad=False)


def _split_linear(plan: ShardPlan, path: str, linear: Linear, axis: int) -> None:
    """``linear``'s output rows (axis 0) or input columns (axis 1) of this rank, widened to whole FP8 blocks."""
    size = linear.weight.shape[axis]
    part = _rank_part(size, plan.rank, plan.world, f"{path} size")
    read = _widened(part, size, WEIGHT_BLOCK) if linear.fmt == "fp8" else part
    index = _along(axis, read, 2)
    plan.reads[f"{path}.weight"] = Read(tuple(linear.weight.shape), index)
    linear.weight = _narrowed(linear.weight, index)
    if linear.fmt == "fp8":
        blocks = range(read.start // WEIGHT_BLOCK, -(-read.stop // WEIGHT_BLOCK))
        scale_index = _along(axis, blocks, 2)
        plan.reads[f"{path}.scale"] = Read(tuple(linear.scale.shape), scale_index)
        linear.scale = _narrowed(linear.scale, scale_index)
    linear.out_features, linear.in_features = linear.weight.shape
    if read != part:
        plan.trims[path] = Trim(axis, slice(part.start - read.start, part.stop - read.start))


def _split_experts(plan: ShardPlan, path: str, experts: RoutedExperts) -> None:
    """Every routed expert's share of the intermediate width: ``w1``/``w3`` rows (one FP4 scale per row: any row
    split is on blocks) and ``w2`` input columns, widened to whole 32-column scale blocks."""
    inter = experts.w1.shape[1]
    part = _rank_part(inter, plan.rank, plan.world, "expert width")
    read = _widened(part, inter, WEIGHT_BLOCK)
    packed = range(read.start // 2, read.stop // 2)
    blocks = range(read.start // WEIGHT_BLOCK, read.stop // WEIGHT_BLOCK)
    indices = {"w1": _along(0, part, 2), "w1_scale": _along(0, part, 2), "w3": _along(0, part, 2),
               "w3_scale": _along(0, part, 2), "w2": _along(1, packed, 2), "w2_scale": _along(1, blocks, 2)}
    for stack, index in indices.items():
        full = getattr(experts, stack)
        kind, suffix = (stack[:2], "scale") if stack.endswith("_scale") else (stack, "weight")
        for expert in range(experts.n_experts):
            plan.reads[f"{path}.{expert}.{kind}.{suffix}"] = Read(tuple(full.shape[1:]), index)
        setattr(experts, stack, _narrowed(full, (slice(None),) + index))
    if read != part:
        plan.trims[path] = Trim(1, slice(part.start - read.start, part.stop - read.start))


def shard_model(model: nn.Module, tensor_parallel: TensorParallel) -> ShardPlan:
    """Reshape every block of ``model`` (built by ``new_model``, not loaded) into the rank's shard, in place
    -> the plan ``load_weights`` reads it with."""
    rank, world = tensor_parallel.rank, tensor_parallel.world
    plan = ShardPlan(rank, world)
    for layer_id, block in enumerate(model.layers):
        prefix = f"layers.{layer_id}"
        attn = block.attn
        groups = _rank_part(attn.o_groups, rank, world, "o_groups")
        heads = range(groups.start * attn.n_heads // attn.o_groups, groups.stop * attn.n_heads // attn.o_groups)
        attn.n_heads, attn.o_groups = len(heads), len(groups)
        _split_linear(plan, f"{prefix}.attn.wq_b", attn.wq_b, axis=0)
        _split_linear(plan, f"{prefix}.attn.wo_a", attn.wo_a, axis=0)
        _split_linear(plan, f"{prefix}.attn.wo_b", attn.wo_b, axis=1)
        sink_index = (slice(heads.start, heads.stop),)
        plan.reads[f"{prefix}.attn.attn_sink"] = Read(tuple(attn.attn_sink.shape), sink_index)
        attn.attn_sink = _narrowed(attn.attn_sink, sink_index)
        for name in ("w1", "w3"):
            _split_linear(plan, f"{prefix}.ffn.shared_experts.{name}", getattr(block.ffn.shared_experts, name), 0)
        _split_linear(plan, f"{prefix}.ffn.shared_experts.w2", block.ffn.shared_experts.w2, axis=1)
        _split_experts(plan, f"{prefix}.ffn.experts", block.ffn.experts)
        block.reduce_partial = tensor_parallel.all_reduce
    return plan


def _dense_linear(linear: Linear, trim: Trim) -> Linear:
    weight = linear.dense_weight(torch.float32).narrow(trim.axis, trim.keep.start, trim.keep.stop - trim.keep.start)
    dense = Linear(weight.shape[1], weight.shape[0])
    dense.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return dense


def _dense_experts(experts: RoutedExperts, trim: Trim) -> RoutedExperts:
    dense = experts.dense_weights(torch.float32)
    return RoutedExperts.from_weights(dense._replace(w2=dense.w2[:, :, trim.keep]), experts.swiglu_limit)


def finish_shards(model: nn.Module, plan: ShardPlan) -> None:
    """Once the plan's tensors are loaded: every projection split inside a scale block becomes the dense fp32
    slice of its widened part (FP8 / FP4 cannot hold a part of a block's scale)."""
    for path, trim in plan.trims.items():
        owner, _, leaf = path.rpartition(".")
        module = model.get_submodule(path)
        dense = _dense_experts(module, trim) if isinstance(module, RoutedExperts) else _dense_linear(module, trim)
        setattr(model.get_submodule(owner), leaf, dense)
