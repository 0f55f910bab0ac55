"""Fused dequantise-and-multiply GEMMs against checkpoint weights: y = x @ W^T with W read in its stored format.

Decode GEMMs have few rows (M = tokens), so their cost is reading W. The reference dequantises the whole weight
into a bf16 copy and then multiplies (three passes over W's size); these kernels read each quantised weight byte
once, decode the tile in registers with the bit-exact integer decoders of common.py, and feed it to ``tl.dot``
with fp32 accumulation. Each decoded weight (E4M3 or E2M1 times a power of two) is computed in fp32 and rounded
to x's dtype exactly as the reference's dequantiser does, so only the summation order differs from it.

One program computes a [BLOCK_M, BLOCK_N] output tile over a range of K. When the (M, N) tiles alone leave
multiprocessors idle (small M), K is split: every split writes an fp32 partial tile and a second kernel sums
the splits in a fixed order, so results do not depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, cut_launch_jit, e2m1_decode, e4m3_decode, empty, run_kernel, split_count, ue8m0_decode

SCALE_BLOCK = 32  # the checkpoint's scale granularity along K (and along N for FP8's 32x32 blocks)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch shape. ``split_k`` = 0 picks a split count from the grid size, 1 never splits."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    split_k: int = 0


# Defaults by row count: decode batches (M <= 16) want narrow M tiles and K splits to fill the GPU with weight
# reads; up to 64 rows one M tile still covers the batch; beyond that the product becomes compute-bound and wide
# tiles with 8 warps reuse each decoded weight tile over more rows. BLOCK_K = 64 keeps the decoded fp32 tile (and
# FP4's two nibble halves) within registers: at BLOCK_K = 128 the FP4 kernel needs ~250 registers per thread.
# fp32 activations take the ieee dot, which holds its operands in registers, hence the small fp32 tile. None of
# these (nor any candidate) spills on sm_90 (tests/ops/triton_aot.py prints registers and local bytes).
# H200, bf16 x, W 2304 x 5120, CUDA-graph replays: M = 1: 19.6 us FP8 / 29.6 us FP4; M = 64: 27.7 / 34.5 us;
# M = 384: 105 / 133 us. benchmarks/kernels.py --sweep times every candidate.
SMALL_M_CONFIG = GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=8, num_stages=4)
MEDIUM_M_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
LARGE_M_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
FP32_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
MEDIUM_FROM_ROWS = 17
LARGE_FROM_ROWS = 65
CANDIDATE_CONFIGS = tuple(
    GemmConfig(bm, bn, bk, warps, stages, split)
    for bm, bn, bk, warps, stages in ((16, 64, 64, 4, 4), (16, 32, 128, 4, 4), (16, 128, 64, 8, 4),
                                      (32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
                                      (128, 128, 64, 8, 3), (128, 128, 32, 8, 4))
    for split in (0, 1))
MIN_K_BLOCKS_PER_SPLIT = 4  # fewer leaves the software pipeline nothing to overlap


@triton.jit
def fp4_codes(w_rows, k0, n_mask, K, BN: tl.constexpr, BK: tl.constexpr):
    """Unscaled E2M1 values [BN, BK] of columns k0..k0+BK of the rows at ``w_rows`` (codes packed two per byte,
    even k in the low nibble), 0 outside K and ``n_mask``."""
    pair = k0 // 2 + tl.arange(0, BK // 2)
    byte = tl.load(w_rows + pair[None, :], mask=n_mask[:, None] & (2 * pair[None, :] < K), other=0).to(tl.int32)
    return tl.join(e2m1_decode(byte & 15), e2m1_decode((byte >> 4) & 15)).reshape(BN, BK)  # even, odd k


@triton.jit
def apply_block_scale(w, s_rows, k0, n_mask, K, BN: tl.constexpr, BK: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """w [BN, BK] (fp32, columns k0..) times the scale of each 32 columns, read at ``s_rows`` as UE8M0 bytes
    (SCALE_BYTES) or fp32."""
    group = k0 // 32 + tl.arange(0, BK // 32)
    s_mask = n_mask[:, None] & (32 * group[None, :] < K)
    if SCALE_BYTES:
        scale = ue8m0_decode(tl.load(s_rows + group[None, :], mask=s_mask, other=127).to(tl.int32))
    else:
        scale = tl.load(s_rows + group[None, :], mask=s_mask, other=1.0)
    return (w.reshape(BN, BK // 32, 32) * scale[:, :, None]).reshape(BN, BK)


@triton.jit
def accumulate_dot(acc, x, w, DOT_FP32: tl.constexpr):
    """acc + x @ w^T for x [BM, BK], w [BN, BK]: exact fp32 products (ieee) for fp32 activations and in the
    interpreter, tensor cores in x's dtype otherwise."""
    if DOT_FP32:  # an else branch, not an early return: Triton compiles the statements after a return too
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, M, N, K, k_per_split, n_tiles, x_row_stride, w_row_stride,
                   s_row_stride, out_row_stride, first_program: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, FP4: tl.constexpr, FLOAT_W: tl.constexpr, SCALE_ROWS: tl.constexpr,
                   SCALE_BYTES: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr):
    """out[m, g N + n] (or part[split, m, g N + n]) = sum over this split's k of x[m, g K + k] * value(w[g N + n, k])
    * scale(g N + n, k): group g = program_id(1) // n_tiles of a block-diagonal product (one group when not
    grouped), its N columns in n_tiles tiles of BN.

    w is E4M3 bytes [G N, K], E2M1 codes packed two per byte [G N, K / 2] (FP4), even k in the low nibble, or a
    float weight taken as stored (FLOAT_W, no scale); the scale of weight row r and column k is
    s[r // SCALE_ROWS, k // 32], UE8M0 bytes (SCALE_BYTES) or fp32.

    ``first_program`` is a constexpr here, unlike in the other kernels: as an argument, triton-ascend 3.2.0's
    adapter crashed at random on the FP4 specialisations (a segfault in 4 of 10 lowerings of them). It is 0 except
    where an NPU launch's limit cuts the grid (a new specialisation per cut), which V4.1's GEMMs reach from about
    130K rows (wo_a) and the LM head from 8K, more rows than it gets: logits are computed for the rows sampled
    from."""
    m = (tl.program_id(0) + first_program) * BM + tl.arange(0, BM)
    group = tl.program_id(1) // n_tiles
    n = (tl.program_id(1) % n_tiles) * BN + tl.arange(0, BN)
    split = tl.program_id(2)
    m_mask = m < M
    n_mask = n < N
    w_row = group * N + n
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_row_stride + group * K
    w_rows = w_ptr + w_row.to(tl.int64)[:, None] * w_row_stride
    s_rows = s_ptr + (w_row // SCALE_ROWS).to(tl.int64)[:, None] * s_row_stride
    acc = tl.zeros([BM, BN], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        if FLOAT_W:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
        else:
            if FP4:
                w = fp4_codes(w_rows, k0, n_mask, K, BN, BK)
            else:
                byte = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0).to(tl.int32)
                w = e4m3_decode(byte)
            w = apply_block_scale(w, s_rows, k0, n_mask, K, BN, BK, SCALE_BYTES).to(x_ptr.dtype.element_ty)
        acc = accumulate_dot(acc, x, w, DOT_FP32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    offsets = m.to(tl.int64)[:, None] * out_row_stride + w_row[None, :]
    if SPLIT:
        tl.store(part_ptr + split.to(tl.int64) * M * out_row_stride + offsets, acc, mask=out_mask)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@cut_launch_jit
def _sum_splits_kernel(part_ptr, out_ptr, MN, first_program, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over splits s (in order) of part[s, i], rounded once to the output dtype."""
    i = (tl.program_id(0) + first_program).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(part_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(rows: int, dtype: torch.dtype) -> GemmConfig:
    if INTERPRETED:  # the interpreter's cost is per program: wide tiles, no splits unless asked
        return GemmConfig(block_m=64, block_n=128, block_k=256, split_k=1)
    if dtype == torch.float32:
        return FP32_CONFIG
    if rows >= LARGE_FROM_ROWS:
        return LARGE_M_CONFIG
    return MEDIUM_M_CONFIG if rows >= MEDIUM_FROM_ROWS else SMALL_M_CONFIG


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, fmt: str, config: GemmConfig | None,
            groups: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``fmt`` "fp8" / "fp4" (stored codes with ``scale``) or "float" (no scale). x [..., K] -> [..., N]; with
    ``groups``, x [n, groups, K] -> [n, groups, N / groups] (block-diagonal). Output in ``out_dtype`` or x's."""
    fp4, float_w = fmt == "fp4", fmt == "float"
    g = groups or 1
    n = weight.shape[0] // g
    k = weight.shape[1] * (2 if fp4 else 1)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if fp4 and k % SCALE_BLOCK:
        raise ValueError(f"FP4 weights need in_features divisible by {SCALE_BLOCK}; got {k}")
    if groups is not None and (x.dim() != 3 or groups < 1 or n * groups != weight.shape[0]):
        raise ValueError(f"grouped x must be [n, G, {k}] with G >= 1 equal row blocks of the weight "
                         f"{tuple(weight.shape)}; got x {tuple(x.shape)}")
    out = empty((*x.shape[:-1], n), out_dtype or x.dtype, x.device)
    x2 = x.reshape(-1, g * k).contiguous()
    rows = x2.shape[0]
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    if float_w:
        weight, scale, scale_bytes = weight.contiguous(), weight, False
    else:
        scale_bytes = scale.dtype == torch.float8_e8m0fnu
        scale = scale.view(torch.uint8) if scale_bytes else scale.float()
        weight, scale = weight.view(torch.uint8).contiguous(), scale.contiguous()
    config = config or default_config(rows, x.dtype)
    bm = max(16, min(triton.next_power_of_2(rows), config.block_m))
    bn, bk = config.block_n, config.block_k
    n_tiles = triton.cdiv(n, bn)
    tiles = triton.cdiv(rows, bm) * g * n_tiles
    k_blocks = triton.cdiv(k, bk)
    splits = max(1, min(config.split_k or split_count(tiles, k_blocks, MIN_K_BLOCKS_PER_SPLIT), k_blocks))
    k_per_split = triton.cdiv(k_blocks, splits) * bk
    splits = triton.cdiv(k, k_per_split)
    # tensor cores take two operands of one 16-bit dtype; anything else is an exact fp32 (ieee) dot
    dot_fp32 = INTERPRETED or x.dtype == torch.float32 or (float_w and weight.dtype != x.dtype)
    launch = dict(BM=bm, BN=bn, BK=bk, FP4=fp4, FLOAT_W=float_w, SCALE_ROWS=1 if fp4 else SCALE_BLOCK,
                  SCALE_BYTES=scale_bytes, DOT_FP32=dot_fp32, SPLIT=splits > 1)
    if not INTERPRETED:
        launch.update(num_warps=config.num_warps, num_stages=config.num_stages)
    partials = torch.empty(splits, rows, g * n, dtype=torch.float32, device=x.device) if splits > 1 else out
    run_kernel(_linear_kernel, (triton.cdiv(rows, bm), g * n_tiles, splits), x2, weight, scale, out, partials, rows, n,
               k, k_per_split, n_tiles, g * k, weight.shape[1], 0 if float_w else scale.shape[1], g * n, **launch)
    if splits > 1:
        block = 1024
        run_kernel(_sum_splits_kernel, (triton.cdiv(rows * g * n, block),), partials, out, rows * g * n, SPLITS=splits,
                   BLOCK=block)
    return out


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for W E4M3 [out, in] with E8M0 scales per 32x32 block [ceil(out/32), ceil(in/32)]."""
    return _linear(x, weight, scale, "fp8", config)


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for W E2M1 packed two per int8 [out, in/2] with E8M0 scales per row per 32 [out, in/32]."""
    return _linear(x, weight, scale, "fp4", config)


def linear_fp8_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       config: GemmConfig | None = None) -> torch.Tensor:
    """x [n, G, in] -> [n, G, out / G]: group g times rows [g out / G, (g + 1) out / G) of W E4M3 [out, in]."""
    return _linear(x, weight, scale, "fp8", config, groups=x.shape[1] if x.dim() == 3 else 0)


def linear_to_fp32(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., in] @ W^T -> fp32 for float x and W [out, in], W read as stored (bf16 for the router and the head)."""
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point) or weight.dtype.itemsize == 1:
        raise ValueError(f"linear_to_fp32 takes float x and W; got {x.dtype} and {weight.dtype}")
    return _linear(x, weight, None, "float", config, out_dtype=torch.float32)
