"""References for ops that fuse several steps of the V4.1 model: Engram gather + gate, CSA2 pooling, sparse
attention straight from the quantised cache records, the mHC collapse followed by a sublayer's RMSNorm.

The model (engram.py, attention.py ``Compressor``, norm.py) calls these ops instead of doing the steps itself, so
each step's math is written once, here or in the ops it composes, and a kernel that fuses them has one truth to
match.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .cache import cache_gather
from .quant import dequant_fp8_rows
from .reference import attend_gathered, hc_collapse, rms_norm, sparse_attention
from .registry import registry


@registry.reference("engram_gather")
def engram_gather(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Engram table lookup: weight [R, W] E4M3, scale [R, ceil(W/32)] E8M0, ids [T, C] -> [T, C, W] in dtype."""
    return dequant_fp8_rows(weight[ids], scale[ids], dtype)  # a plain function, not a registry op


@registry.reference("engram_gate")
def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Gated Engram injection (docs/model.md#gate).

    streams [T, S, d]; key [T, S, d] and value [T, d] (from ``wkv`` of the gathered rows); w [S, d] =
    q_weight * k_weight. gate[t, s] = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) with
    dot = sum(h * w * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(d), all fp32.
    Returns h + gate * value in the streams' dtype.
    """
    d = streams.shape[-1]
    h, key, value = streams.float(), key.float(), value.float()
    dot = (h * w.float() * key).sum(-1)  # [T, S]
    dot = dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps)
    dot = dot / math.sqrt(d)
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())  # [T, S]
    return (h + gate[..., None] * value[:, None, :]).to(streams.dtype)


@registry.reference("csa2_compress")
def csa2_compress(values: torch.Tensor, gates: torch.Tensor, ratio: int, norm_weight: torch.Tensor | None,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """CSA2 pooling of complete groups (docs/model.md#csa2-compressor), ratio >= 2.

    values, gates [G * ratio, c] fp32 (wkv(x), wgate(x)) -> latents [G, c] in ``dtype``: per channel a softmax
    over the group's tokens of the gates weights the values; the fp32 sum is cast to ``dtype`` and RMS-normed.
    Unrotated and unquantised (RoPE and the NVFP4 cache write follow).
    """
    grouped_v = values.float().unflatten(0, (-1, ratio))  # [G, r, c]
    weights = gates.float().unflatten(0, (-1, ratio)).softmax(dim=1)  # [G, r, c]
    return rms_norm.reference((weights * grouped_v).sum(dim=1).to(dtype), norm_weight, eps)


@registry.reference("hc_collapse_norm")
def hc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A sublayer's input: ``rms_norm(hc_collapse(streams, pre), weight, eps)``, the collapse rounded to the
    streams' dtype before the norm as in the two ops. streams [T, S, d], pre [T, S] -> [T, d]."""
    return rms_norm.reference(hc_collapse.reference(streams, pre), weight, eps)


def distinct_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [...] (-1 = none) -> (the distinct slots ascending, each slot's index into them with -1 kept)."""
    valid = slots >= 0
    distinct, rows = torch.unique(slots[valid], return_inverse=True)
    indices = torch.full_like(slots, -1)
    indices[valid] = rows
    return distinct, indices


def key_references(window_cache: torch.Tensor, window_slots: torch.Tensor,
                   compressed_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The keys a batch of rows reads from the two record caches, as one id space (window slots, then compressed
    slots offset by the window table's rows) -> (distinct key ids ascending, each reference's index into them
    [T, W + C] with -1 where the slot is -1, the number of valid references)."""
    slots = torch.cat((window_slots, compressed_slots + window_cache.shape[0] * (compressed_slots >= 0)), dim=1)
    distinct, indices = distinct_slots(slots)
    return distinct, indices, int((indices >= 0).sum())


def records_pool(window_cache: torch.Tensor, window_slots: torch.Tensor, compressed_cache: torch.Tensor,
                 compressed_slots: torch.Tensor, dim: int, dtype: torch.dtype,
                 gather: Callable = cache_gather.reference, references=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a batch of rows reads from the two record caches, decoded once each into a float pool.

    -> (pool [distinct keys, dim] in ``dtype``, indices [T, W + C] into it, -1 where the slot is -1), so that
    ``sparse_attention(q, pool, indices)`` is ``sparse_attention_records``. ``gather`` is ``cache_gather`` (the
    reference here; a backend passes the registry op to decode on its device); ``references`` is
    ``key_references`` of the same inputs when the caller has it already."""
    distinct, indices, _ = references or key_references(window_cache, window_slots, compressed_slots)
    in_window = distinct < window_cache.shape[0]
    pool = torch.empty(distinct.numel(), dim, dtype=dtype, device=indices.device)
    pool[in_window] = gather(window_cache, distinct[in_window], "fp8_window", dim, dtype)
    pool[~in_window] = gather(compressed_cache, distinct[~in_window] - window_cache.shape[0], "nvfp4", dim, dtype)
    return pool, indices


def records_pool_per_reference(window_cache: torch.Tensor, window_slots: torch.Tensor, compressed_cache: torch.Tensor,
                               compressed_slots: torch.Tensor, dim: int, dtype: torch.dtype,
                               gather: Callable = cache_gather.reference) -> tuple[torch.Tensor, torch.Tensor]:
    """``records_pool`` with a pool row per reference ([T * (W + C), dim], row t's keys in its own order) instead
    of one per distinct key: the pool's size follows from the shapes, so nothing is read on the host (counting the
    distinct keys is one device sync), at the cost of decoding a key once per row that reads it, which a batch of
    decodes (rows of different sequences) does anyway."""
    pool = torch.cat((gather(window_cache, window_slots, "fp8_window", dim, dtype),
                      gather(compressed_cache, compressed_slots, "nvfp4", dim, dtype)), dim=1)  # [T, W + C, dim]
    slots = torch.cat((window_slots, compressed_slots), dim=1)
    rows = torch.arange(slots.numel(), device=slots.device).view(slots.shape)
    return pool.reshape(-1, dim), torch.where(slots >= 0, rows, -1)


@registry.reference("sparse_attention_records")
def sparse_attention_records(q: torch.Tensor, window_cache: torch.Tensor, window_slots: torch.Tensor,
                             compressed_cache: torch.Tensor, compressed_slots: torch.Tensor, sink: torch.Tensor,
                             softmax_scale: float) -> torch.Tensor:
    """``sparse_attention`` over keys read from the quantised caches as stored (docs/model.md#cache-records): per
    query row t its window keys are ``fp8_window`` records window_cache[window_slots[t]] (528 B at D = 512) and its
    selected compressed entries ``nvfp4`` records compressed_cache[compressed_slots[t]] (288 B); slot -1 = unused.

    q [T, H, D]; window_slots [T, W], compressed_slots [T, C]; sink [H] -> [T, H, D] in q's dtype. The caches
    may be row-strided views (an engine's cache row holds more than the record). A decode kernel that reads the
    records moves 528 / 288 bytes per key instead of 1024 for a bf16 pool.
    """
    dim, dtype = q.shape[-1], q.dtype
    if q.shape[0] <= PER_REFERENCE_ROWS:
        keys = torch.cat((cache_gather.reference(window_cache, window_slots, "fp8_window", dim, dtype),
                          cache_gather.reference(compressed_cache, compressed_slots, "nvfp4", dim, dtype)), dim=1)
        valid = torch.cat((window_slots, compressed_slots), dim=1) >= 0
        return attend_gathered(q, keys, valid, sink, softmax_scale)  # keys [T, W + C, D]
    pool, indices = records_pool(window_cache, window_slots, compressed_cache, compressed_slots, dim, dtype)
    return sparse_attention.reference(q, pool, indices, sink, softmax_scale)


# Up to this many query rows (a decode batch: rows of different sequences, which share no key) each row's keys are
# decoded in its own order and attended as they are; above it (prefill rows of one sequence share most keys) each
# distinct key is decoded once into a pool the rows index. The keys have the same values either way, so the
# result is the same bit for bit; only the cost differs (about a third less at one row).
PER_REFERENCE_ROWS = 16
