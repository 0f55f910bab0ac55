"""Grouped routed experts: every expert of an MoE layer in three launches, sized without reading the device.

The reference loops over experts with each one's token count read on the host (a GPU stall per layer) and runs
each expert's three projections as separate calls, dequantising its weights first. Here the (token, slot)
assignments are sorted by expert on the device and cut into blocks of BLOCK_M rows that never span two experts;
the launch covers the most blocks the shapes allow (every expert adds at most one partial block) and programs
past the real count return at once, so nothing waits for the routing.

  1. gate/up: each program decodes a [BLOCK_N, BLOCK_K] tile of its expert's w1 and w3 (FP4 read once, decoded
     in registers as in gemm.py) against the block's gathered token rows, then applies SwiGLU and the router
     weight, rounding where the reference rounds (projections, SwiGLU and the weighted activation in x's dtype).
  2. down: the weighted activations times w2, one output row per assignment, in x's dtype.
  3. combine: each token's rows summed in fp32 in ascending expert id, the reference's order, so the sum itself
     matches it exactly; only the dot products' summation order differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...moe import ExpertWeights, sort_by_expert
from .common import INTERPRETED, ONE_WAVE_PROGRAMS, TL_DTYPE, cut_launch_jit, empty, run_kernel
from .gemm import SCALE_BLOCK, accumulate_dot, apply_block_scale, fp4_codes
from .misc import swiglu_values


@dataclass(frozen=True)
class MoeConfig:
    """Rows per block (one expert's), output and reduction tile sizes, launch shape."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


# By rows per touched expert: decode (a few tokens per expert) wants narrow row blocks and many output tiles to
# spread the weight reads; prefill blocks of 64 / 128 rows reuse each decoded weight tile over more tokens.
DECODE_CONFIG = MoeConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=4)
MEDIUM_CONFIG = MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
LARGE_CONFIG = MoeConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
FP32_CONFIG = MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
INTERPRETER_CONFIG = MoeConfig(block_m=16, block_n=64, block_k=64)
CANDIDATE_CONFIGS = (DECODE_CONFIG, MoeConfig(16, 32, 64, 4, 4), MoeConfig(16, 128, 64, 8, 4),
                     MoeConfig(32, 64, 64, 4, 3), MEDIUM_CONFIG, LARGE_CONFIG)
COMBINE_BLOCK = 256


@triton.jit
def _block_rows(order_ptr, block_expert_ptr, block_row0_ptr, block_row_end_ptr, first_program, BM: tl.constexpr):
    """This program's block: (its expert, -1 past the real blocks; its sorted rows; their mask; their
    assignment ids token * TOP_K + slot)."""
    block = tl.program_id(0) + first_program
    expert = tl.load(block_expert_ptr + block)
    rows = tl.load(block_row0_ptr + block) + tl.arange(0, BM)
    row_mask = rows < tl.load(block_row_end_ptr + block)  # an unused block's rows are [0, 0)
    assignment = tl.load(order_ptr + rows, mask=row_mask, other=0)
    return expert, rows, row_mask, assignment


@cut_launch_jit
def _moe_gate_up_kernel(x_ptr, route_ptr, order_ptr, block_expert_ptr, block_row0_ptr, block_row_end_ptr,
                        w1_ptr, s1_ptr, w3_ptr, s3_ptr, act_ptr, D, I, limit, first_program,
                        TOP_K: tl.constexpr, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """act[row, n] = route_weight * swiglu(x w1_e^T, x w3_e^T)[n] for the block's rows (sorted by expert)."""
    expert, rows, row_mask, assignment = _block_rows(order_ptr, block_expert_ptr, block_row0_ptr,
                                                     block_row_end_ptr, first_program, BM)
    if expert >= 0:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < I
        x_rows = x_ptr + (assignment // TOP_K).to(tl.int64)[:, None] * D
        weight_rows = (expert.to(tl.int64) * I + n.to(tl.int64))[:, None]  # row of w1 / w3 in the stack
        w1_rows, w3_rows = w1_ptr + weight_rows * (D // 2), w3_ptr + weight_rows * (D // 2)
        s1_rows, s3_rows = s1_ptr + weight_rows * (D // 32), s3_ptr + weight_rows * (D // 32)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < D), other=0.0)
            w1 = apply_block_scale(fp4_codes(w1_rows, k0, n_mask, D, BN, BK), s1_rows, k0, n_mask, D, BN, BK, True)
            w3 = apply_block_scale(fp4_codes(w3_rows, k0, n_mask, D, BN, BK), s3_rows, k0, n_mask, D, BN, BK, True)
            gate = accumulate_dot(gate, x, w1.to(x_ptr.dtype.element_ty), DOT_FP32)
            up = accumulate_dot(up, x, w3.to(x_ptr.dtype.element_ty), DOT_FP32)
        dtype = x_ptr.dtype.element_ty
        act = swiglu_values(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), limit, HAS_LIMIT)
        act = act.to(dtype).to(tl.float32)
        act = act * tl.load(route_ptr + assignment, mask=row_mask, other=0.0)[:, None]
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


@cut_launch_jit
def _moe_down_kernel(act_ptr, order_ptr, block_expert_ptr, block_row0_ptr, block_row_end_ptr, w2_ptr, s2_ptr, y_ptr, D,
                     I, first_program, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[assignment, n] = (act[row] w2_e^T)[n] for the block's rows, in the activations' dtype."""
    expert, rows, row_mask, assignment = _block_rows(order_ptr, block_expert_ptr, block_row0_ptr,
                                                     block_row_end_ptr, first_program, BM)
    if expert >= 0:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < D
        act_rows = act_ptr + rows.to(tl.int64)[:, None] * I
        weight_rows = (expert.to(tl.int64) * D + n.to(tl.int64))[:, None]
        w2_rows, s2_rows = w2_ptr + weight_rows * (I // 2), s2_ptr + weight_rows * (I // 32)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, I, BK):
            k = k0 + tl.arange(0, BK)
            act = tl.load(act_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < I), other=0.0)
            w2 = apply_block_scale(fp4_codes(w2_rows, k0, n_mask, I, BN, BK), s2_rows, k0, n_mask, I, BN, BK, True)
            acc = accumulate_dot(acc, act, w2.to(act_ptr.dtype.element_ty), DOT_FP32)
        tl.store(y_ptr + assignment.to(tl.int64)[:, None] * D + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


@cut_launch_jit
def _moe_combine_kernel(y_ptr, slot_order_ptr, out_ptr, D, first_program, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, n] = sum over j of y[t * TOP_K + slot_order[t, j], n] in fp32, j ascending."""
    token = (tl.program_id(0) + first_program).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < D
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slot_order_ptr + token * TOP_K + j)
        total += tl.load(y_ptr + (token * TOP_K + slot) * D + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * D + n, total, mask=mask)


def default_config(assignments: int, n_experts: int, dtype: torch.dtype) -> MoeConfig:
    if INTERPRETED:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return FP32_CONFIG
    rows_per_expert = assignments / min(n_experts, assignments)
    if rows_per_expert > 64:
        return LARGE_CONFIG
    return MEDIUM_CONFIG if rows_per_expert > 16 else DECODE_CONFIG


def block_table(expert_ids: torch.Tensor, n_experts: int, block_m: int):
    """Device-side routing: (assignment ids sorted by expert, stably; per block its expert or -1, first sorted
    row and end row), with as many blocks as the shapes allow, so no count is read on the host."""
    assignments = expert_ids.numel()
    _, order, bounds = sort_by_expert(expert_ids, n_experts)
    blocks = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    most_blocks = min(assignments, triton.cdiv(assignments, block_m) + n_experts)
    block = torch.arange(most_blocks, device=expert_ids.device)
    expert = torch.searchsorted(block_end, block, right=True)
    real = expert < n_experts
    expert = expert.clamp(max=n_experts - 1)
    row0 = bounds[expert] + (block - (block_end[expert] - blocks[expert])) * block_m
    return (order, torch.where(real, expert, -1), torch.where(real, row0, 0), torch.where(real, bounds[expert + 1], 0))


def moe_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertWeights,
                swiglu_limit: float | None, config: MoeConfig | None = None) -> torch.Tensor:
    """``ops.moe_experts`` for FP4 experts: x [T, d] (fp32 / bf16 / fp16) -> fp32 [T, d]."""
    if not experts.quantised or x.dtype not in TL_DTYPE:
        return NotImplemented
    tokens, dim = x.shape
    top_k = expert_ids.shape[1]
    n_experts, inter = experts.w1.shape[:2]
    if dim % SCALE_BLOCK or inter % SCALE_BLOCK:
        raise ValueError(f"FP4 experts need d and I divisible by {SCALE_BLOCK}; got d={dim}, I={inter}")
    if experts.w1.shape[2] * 2 != dim or experts.w2.shape[1:] != (dim, inter // 2):
        raise ValueError(f"expert weights {tuple(experts.w1.shape)} / {tuple(experts.w2.shape)} do not match "
                         f"x [T, {dim}]")
    out = empty((tokens, dim), torch.float32, x.device)
    if tokens == 0:
        return out
    config = config or default_config(tokens * top_k, n_experts, x.dtype)
    bm, bk = config.block_m, config.block_k
    order, block_expert, block_row0, block_row_end = block_table(expert_ids, n_experts, bm)
    blocks = block_expert.numel()
    x = x.contiguous()
    weights = [t.contiguous().view(torch.uint8) for t in experts[:4]]  # w1, s1, w3, s3 as bytes
    w2, s2 = experts.w2.contiguous().view(torch.uint8), experts.w2_scale.contiguous().view(torch.uint8)
    act = empty((tokens * top_k, inter), x.dtype, x.device)
    y = empty((tokens * top_k, dim), x.dtype, x.device)
    launch = dict(BM=bm, BK=bk, DOT_FP32=INTERPRETED or x.dtype == torch.float32)
    if not INTERPRETED:
        launch.update(num_warps=config.num_warps, num_stages=config.num_stages)
    tables = (order, block_expert, block_row0, block_row_end)
    run_kernel(_moe_gate_up_kernel, (blocks, triton.cdiv(inter, config.block_n)), x, route_weights.float().contiguous(),
               *tables, *weights, act, dim, inter, float(swiglu_limit or 0.0), TOP_K=top_k,
               HAS_LIMIT=swiglu_limit is not None, BN=config.block_n, **launch)
    down_n = config.block_n  # narrower output tiles when the blocks alone leave multiprocessors idle
    while down_n > 32 and blocks * triton.cdiv(dim, down_n) < ONE_WAVE_PROGRAMS and not INTERPRETED:
        down_n //= 2
    run_kernel(_moe_down_kernel, (blocks, triton.cdiv(dim, down_n)), act, *tables, w2, s2, y, dim, inter, BN=down_n,
               **launch)
    slot_order = expert_ids.argsort(dim=1, stable=True)
    run_kernel(_moe_combine_kernel, (tokens, triton.cdiv(dim, COMBINE_BLOCK)), y, slot_order, out, dim, TOP_K=top_k,
               BLOCK=COMBINE_BLOCK)
    return out
