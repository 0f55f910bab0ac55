"""Lightning-indexer scores, exact top-k (radix select, ties to the lower id) and the two-level pre-filter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache import record_bytes, to_device
from .common import INTERPRETED, cut_launch_jit, e2m1_decode, empty, next_pow2, run_kernel, ue8m0_decode


@cut_launch_jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, tile_ptr, out_ptr, T, H, D, N, key_stride, first_program,
                           TB: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                           BF16_DOT: tl.constexpr, RECORDS: tl.constexpr, SB: tl.constexpr, TILES: tl.constexpr):
    """score[t, n] = sum_h relu(q[t, h] . k[n]) * w[t, h] for TB query rows and BN keys.

    The TB * HP (row, head) pairs form one matrix against the key tile, so every key tile read from memory
    serves TB queries. q and the keys are MXFP4 values (E2M1 times a power of two), exact in bf16: on a GPU the
    dot runs on bf16 tensor cores with fp32 accumulation and gives the fp32 products exactly; only the summation
    order differs from the reference. The interpreter has no bf16 dot, so it runs the same sum in fp32 (the GPU
    tests check the bf16 path). The dot runs over BD channels at a time to bound registers.

    Keys are float rows key_stride elements apart, or with RECORDS mxfp4 records (D / 2 bytes of E2M1 pairs, even
    channel low, then D / SB UE8M0 scales, SB = min(32, D) a power of two dividing BD) at rows slot[n], key_stride
    bytes apart, decoded in registers to the value ``cache_gather`` gives in q's dtype: the same key tile as the
    float path, so the same scores bit for bit, from 68 B per key at D = 128 instead of a decoded copy written and
    read again. Each byte is loaded once and split into its two channels (tl.join), and each scale once per
    block: loading per channel kept two 64-bit address tiles live and spilled at BN = 64 (255 registers).

    With TILES, a batch of sequences: program i takes the query tile (sequence b, first row, rows) of row i of
    the int32 tile table, whose rows score the key slots of row b of slot [B, N]; a tile never spans two
    sequences, so its key tile is shared as above. Slot -1 is no key (score 0)."""
    if TILES:
        tile = tile_ptr + 3 * (tl.program_id(0) + first_program)
        rows = tl.load(tile + 1) + tl.arange(0, TB)  # [TB] query rows
        row_ok = tl.arange(0, TB) < tl.load(tile + 2)
        slot_ptr += tl.load(tile).to(tl.int64) * N
    else:
        rows = (tl.program_id(0) + first_program) * TB + tl.arange(0, TB)
        row_ok = rows < T
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    h = tl.arange(0, HP)
    nmask = n < N
    if RECORDS:
        slot = tl.load(slot_ptr + n, mask=nmask, other=-1)
        nmask = slot >= 0
        key_row = k_ptr + tl.maximum(slot, 0).to(tl.int64) * key_stride  # [BN] records
    else:
        key_row = k_ptr + n.to(tl.int64) * key_stride
    pair_row = (rows[:, None] * H + h[None, :]).to(tl.int64)  # [TB, HP] rows of q viewed as [T * H, D]
    pair_mask = row_ok[:, None] & (h[None, :] < H)
    pair_row = tl.reshape(pair_row, [TB * HP])
    pair_mask = tl.reshape(pair_mask, [TB * HP])
    w = tl.load(w_ptr + pair_row, mask=pair_mask, other=0.0).to(tl.float32)  # [TB * HP]
    dots = tl.zeros([TB * HP, BN], tl.float32)
    for d0 in tl.static_range(0, DP, BD):
        d = d0 + tl.arange(0, BD)
        q = tl.load(q_ptr + pair_row[:, None] * D + d[None, :], mask=pair_mask[:, None] & (d[None, :] < D),
                    other=0.0)
        if RECORDS:
            pair = d0 // 2 + tl.arange(0, BD // 2)  # byte of channels 2i, 2i + 1
            group = d0 // SB + tl.arange(0, BD // SB)  # scale block
            pairs = tl.load(key_row[:, None] + pair[None, :], mask=nmask[:, None] & (pair[None, :] < D // 2),
                            other=0).to(tl.int32)  # [BN, BD / 2]
            scales = ue8m0_decode(tl.load(key_row[:, None] + D // 2 + group[None, :],
                                          mask=nmask[:, None] & (group[None, :] < D // SB), other=127).to(tl.int32))
            values = tl.join(e2m1_decode(pairs & 15), e2m1_decode(pairs >> 4))  # [BN, BD / 2, 2]: even channel low
            keys = (values.reshape(BN, BD // SB, SB) * scales[:, :, None]).reshape(BN, BD).to(q_ptr.dtype.element_ty)
        else:
            keys = tl.load(key_row[:, None] + d[None, :], mask=nmask[:, None] & (d[None, :] < D), other=0.0)
        if BF16_DOT:
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)), dots)
        else:
            dots = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), dots, input_precision="ieee")
    weighted = tl.reshape(tl.maximum(dots, 0.0) * w[:, None], [TB, HP, BN])
    score = tl.sum(weighted, axis=1)  # [TB, BN]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :], score,
             mask=row_ok[:, None] & (n[None, :] < N))


def query_tiles(query_counts: list[int], tb: int) -> torch.Tensor:
    """int32 [tiles, 3] (sequence, first row, rows): each sequence's query rows cut into tiles of at most tb."""
    tiles, first = [], 0
    for sequence, count in enumerate(query_counts):
        tiles += [(sequence, first + start, min(tb, count - start)) for start in range(0, count, tb)]
        first += count
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3)


def _scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, n: int, key_stride: int,
            slots: torch.Tensor | None, query_counts: list[int] | None = None) -> torch.Tensor:
    """Launches the scoring kernel over n keys: float rows of ``keys``, or mxfp4 records keys[slots] ([n], or
    [B, n] for a batch of sequences with ``query_counts`` rows each)."""
    t, h, d = q.shape
    out = empty((t, n), torch.float32, q.device)
    if t == 0 or n == 0:
        return out
    hp = max(16, next_pow2(h))
    rows = max(query_counts) if query_counts is not None else t  # the most rows that share keys
    tb = max(1, min(next_pow2(rows), 128 // hp)) if not INTERPRETED else next_pow2(rows)
    bn = max(16, min(next_pow2(n), 1024 if INTERPRETED else 64))
    dp = max(16, next_pow2(d))
    tiles = to_device(query_tiles(query_counts, tb), q.device) if query_counts is not None else None
    run_kernel(_indexer_scores_kernel, (triton.cdiv(t, tb) if tiles is None else tiles.shape[0], triton.cdiv(n, bn)),
               q.contiguous(), head_weights.contiguous(), keys, slots if slots is not None else keys,
               tiles if tiles is not None else keys, out, t, h, d, n, key_stride, TB=tb, HP=hp, DP=dp,
               BD=dp if INTERPRETED else min(dp, 64), BN=bn, BF16_DOT=not INTERPRETED, RECORDS=slots is not None,
               SB=min(32, d), TILES=tiles is not None)
    return out


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, h, d] and keys [N, d] (MXFP4-rounded, as the op's contract says), head_weights [T, h] -> fp32 [T, N]."""
    keys = keys.contiguous()
    return _scores(q, head_weights, keys, keys.shape[0], q.shape[-1], None)


def indexer_scores_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                           key_slots: torch.Tensor, query_counts: list[int] | None = None) -> torch.Tensor:
    """``indexer_scores`` with key n the mxfp4 record key_records[key_slots[n]] (uint8 [S, record_bytes], rows may
    be strided; only the bytes within a row must be dense), decoded in the kernel; a batch of sequences with
    key_slots [B, N] and ``query_counts`` (see the reference). Declined (the reference runs it) where the scale
    block min(32, d) is no power of two that divides d: the kernel tiles by it."""
    d = q.shape[-1]
    block = min(32, d)
    if d % block or block < 2 or block & (block - 1):
        return NotImplemented
    width = record_bytes("mxfp4", d)
    if (key_records.dtype != torch.uint8 or key_records.dim() != 2 or key_records.shape[1] != width
            or key_records.stride(1) != 1):
        raise ValueError(f"key records must be a uint8 [slots, {width}] table dense within a row for index head dim "
                         f"{d}; got {key_records.dtype} {tuple(key_records.shape)} strides {key_records.stride()}")
    return _scores(q, head_weights, key_records, key_slots.shape[-1], key_records.stride(0), key_slots.contiguous(),
                   query_counts)


@triton.jit
def _ordered_key(s):
    """fp32 -> int64 in [0, 2^32) with the same order (-inf lowest, +inf highest)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@cut_launch_jit
def _topk_kernel(s_ptr, out_ptr, N, K, first_program, BN: tl.constexpr):
    """Exact top-k of one row: radix-select the k-th largest key (32 counting passes), then emit, in id order,
    every id above it and the lowest-id ties; ids with score -inf are dropped and the tail is -1."""
    row = (tl.program_id(0) + first_program).to(tl.int64)
    base = s_ptr + row * N
    prefix = tl.zeros([], tl.int64)
    for bit in range(31, -1, -1):
        cand = prefix | (tl.full([], 1, tl.int64) << bit)
        count = tl.zeros([], tl.int32)
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            key = _ordered_key(tl.load(base + n, mask=n < N, other=float("-inf")))
            count += tl.sum(((key >= cand) & (n < N)).to(tl.int32), axis=0)
        prefix = tl.where(count >= K, cand, prefix)
    greater = tl.zeros([], tl.int32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        key = _ordered_key(tl.load(base + n, mask=n < N, other=float("-inf")))
        greater += tl.sum(((key > prefix) & (n < N)).to(tl.int32), axis=0)
    ties_left = K - greater  # ties at the threshold taken lowest id first
    written = tl.zeros([], tl.int32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        s = tl.load(base + n, mask=n < N, other=float("-inf"))
        key = _ordered_key(s)
        inrow = n < N
        tie = (key == prefix) & inrow
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
        take = inrow & ((key > prefix) | (tie & (tie_rank < ties_left))) & (s != float("-inf"))
        pos = written + tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32)
        tl.store(out_ptr + row * K + pos, n.to(tl.int64), mask=take)
        ties_left -= tl.sum(tie.to(tl.int32), axis=0)
        written += tl.sum(take.to(tl.int32), axis=0)
    for k0 in range(0, K, BN):
        kk = k0 + tl.arange(0, BN)
        tl.store(out_ptr + row * K + kk, tl.full([BN], -1, tl.int64), mask=(kk >= written) & (kk < K))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, N] -> ids [T, k] ascending, -1 for slots with score -inf or beyond N; ties to the lower id."""
    t, n = scores.shape
    out = empty((t, k), torch.int64, scores.device)
    if t == 0 or k == 0:
        return out
    bn = max(16, min(next_pow2(max(n, k)), 4096 if INTERPRETED else 1024))
    run_kernel(_topk_kernel, (t,), scores.float().contiguous(), out, n, k, BN=bn)
    return out


@cut_launch_jit
def _block_max_kernel(s_ptr, vis_ptr, out_ptr, N, NBLK, first_program, BS: tl.constexpr, BB: tl.constexpr):
    """block_score[t, b] = max of scores over block b; +inf for the block of the newest visible entry."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    e = b[:, None] * BS + tl.arange(0, BS)[None, :]
    s = tl.load(s_ptr + t * N + e, mask=(e < N) & (b[:, None] < NBLK), other=float("-inf"))
    best = tl.max(s, axis=1)
    vis = tl.load(vis_ptr + t).to(tl.int64)
    newest = tl.maximum(vis - 1, 0) // BS
    best = tl.where((vis > 0) & (b == newest), float("inf"), best)
    tl.store(out_ptr + t * NBLK + b, best, mask=b < NBLK)


@cut_launch_jit
def _expand_mask_kernel(ids_ptr, out_ptr, N, TOPB, first_program, BS: tl.constexpr, BB: tl.constexpr):
    """mask[t, n] = (n // BS) is one of the kept block ids (ids >= 0) of row t."""
    t = (tl.program_id(0) + first_program).to(tl.int64)
    n = tl.program_id(1) * BB + tl.arange(0, BB)
    keep = tl.zeros([BB], tl.int32)
    for j in range(0, TOPB):
        blk = tl.load(ids_ptr + t * TOPB + j)
        keep = keep | ((n // BS) == blk).to(tl.int32)
    tl.store(out_ptr + t * N + n, keep.to(tl.int8), mask=n < N)


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int) -> torch.Tensor:
    """Two-level pre-filter: block maxima (newest visible block forced), exact top blocks, expanded to entries."""
    t, n = scores.shape
    n_blocks = -(-n // block_size)
    out = empty((t, n), torch.int8, scores.device)
    if t == 0 or n == 0:
        return out.bool()
    block_scores = empty((t, n_blocks), torch.float32, scores.device)
    bs = next_pow2(block_size)
    if bs != block_size:
        raise ValueError(f"candidate block size {block_size} must be a power of two for the Triton pre-filter")
    bb = max(1, min(next_pow2(n_blocks), 256))
    run_kernel(_block_max_kernel, (t, triton.cdiv(n_blocks, bb)), scores.float().contiguous(), visible.contiguous(),
               block_scores, n, n_blocks, BS=block_size, BB=bb)
    ids = topk_indices(block_scores, top_blocks)  # kept blocks; -inf blocks come back as -1
    bbn = max(16, min(next_pow2(n), 4096 if INTERPRETED else 1024))
    run_kernel(_expand_mask_kernel, (t, triton.cdiv(n, bbn)), ids, out, n, ids.shape[1], BS=block_size, BB=bbn)
    return out.bool()


def _select(scores: torch.Tensor, visible: torch.Tensor, k: int, candidates: torch.Tensor | None) -> torch.Tensor:
    """The visibility / candidate masks, then whichever top-k the registry picks for this device (the Triton one
    is forced-only on CUDA, where sorting is faster)."""
    from ... import topk_indices as selected_topk

    entry = torch.arange(scores.shape[1], device=scores.device)
    hidden = entry[None, :] >= visible[:, None]
    if candidates is not None:
        hidden = hidden | ~candidates
    return selected_topk(scores.masked_fill(hidden, float("-inf")), k)


def indexer_topk(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """The fused selection: the scoring kernel, then the masks and top-k of ``_select``."""
    return _select(indexer_scores(q, head_weights, keys), visible, k, candidates)


def indexer_topk_records(q: torch.Tensor, head_weights: torch.Tensor, key_records: torch.Tensor,
                         key_slots: torch.Tensor, visible: torch.Tensor, k: int,
                         candidates: torch.Tensor | None = None, query_counts: list[int] | None = None) -> torch.Tensor:
    """``indexer_topk`` with the keys decoded from their mxfp4 records inside the scoring kernel."""
    scores = indexer_scores_records(q, head_weights, key_records, key_slots, query_counts)
    return scores if scores is NotImplemented else _select(scores, visible, k, candidates)
