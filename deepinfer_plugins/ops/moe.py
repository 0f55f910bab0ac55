"""Routed experts of one MoE layer as one op: every token's top-k experts, weighted by the router, summed.

The experts are stacked (expert e's weights at index e of each tensor), the layout a grouped kernel reads with
one pointer and a stride per expert. The reference runs the experts one after another, each on the tokens routed
to it; that needs the per-expert token counts on the host (one read per layer, a GPU stall), which a grouped
kernel avoids by sizing its launch from the shapes alone.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .gemm import linear_fp4
from .reference import swiglu
from .registry import registry


class ExpertWeights(NamedTuple):
    """Stacked SwiGLU expert weights: out = w2(silu(w1 x) * w3 x).

    FP4: w1, w3 [E, I, d/2] and w2 [E, d, I/2] E2M1 packed two per int8, with E8M0 scales [E, I, d/32] and
    [E, d, I/32] (the checkpoint's format per expert). Float: w1, w3 [E, I, d] and w2 [E, d, I], scales None."""

    w1: torch.Tensor
    w1_scale: torch.Tensor | None
    w3: torch.Tensor
    w3_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None

    @property
    def quantised(self) -> bool:
        return self.w1_scale is not None


@registry.reference("moe_experts")
def moe_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertWeights,
                swiglu_limit: float | None) -> torch.Tensor:
    """sum over j of route_weights[t, j] * expert_{expert_ids[t, j]}(x[t]) -> fp32 [T, d].

    x [T, d]; route_weights [T, k] fp32; expert_ids [T, k] int64 (distinct per token). Per expert: the gate and
    up projections in x's dtype, SwiGLU (clamped at ``swiglu_limit``), the router weight applied to the
    activation and rounded to x's dtype (scaling the output instead rounds differently in bf16), the down
    projection in x's dtype. The fp32 sum adds each token's experts in ascending expert id."""
    return experts_one_by_one(x, route_weights, expert_ids, experts, swiglu_limit, linear_fp4.reference)


@registry.reference("grouped_fp4_weight_layout")
def grouped_fp4_weight_layout(weight: torch.Tensor) -> torch.Tensor:
    """A stacked FP4 expert weight [E, out, in/2] in the memory layout this device's grouped GEMM reads, with the
    same shape, dtype and values: the model replaces the stored tensor's data with it once after loading (a device
    whose GEMM wants a tiled layout pays the conversion then, not per step). The reference reads it as stored."""
    return weight


def sort_by_expert(expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) assignments sorted by expert, stably, on the device with no host read, as grouped kernels
    need them: (sorted expert ids [T * k], assignment ids token * k + slot in that order, bounds [E + 1]: expert
    e's assignments are sorted rows bounds[e] to bounds[e + 1])."""
    sorted_experts, order = torch.sort(expert_ids.reshape(-1), stable=True)
    bounds = torch.searchsorted(sorted_experts, torch.arange(n_experts + 1, device=expert_ids.device))
    return sorted_experts, order, bounds


def combine_in_expert_order(rows: torch.Tensor, order: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """A grouped kernel's down-projection rows [T * k, d], in the sorted assignment order ``order`` (from
    ``sort_by_expert``) -> fp32 [T, d]: each token's experts added in ascending expert id, the reference's order."""
    tokens, top_k = expert_ids.shape
    by_assignment = torch.empty_like(rows)
    by_assignment[order] = rows
    by_assignment = by_assignment.view(tokens, top_k, -1)
    ascending = expert_ids.argsort(dim=1, stable=True)
    routed = torch.zeros(tokens, rows.shape[-1], dtype=torch.float32, device=rows.device)
    every_token = torch.arange(tokens, device=rows.device)
    for j in range(top_k):
        routed += by_assignment[every_token, ascending[:, j]].float()
    return routed


def experts_one_by_one(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor,
                       experts: ExpertWeights, swiglu_limit: float | None, fp4_linear: Callable) -> torch.Tensor:
    """The reference's loop with its FP4 projections done by ``fp4_linear`` (the benchmark passes the registry's
    ``linear_fp4``: the per-expert path a model without a grouped kernel runs)."""
    routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = expert_ids.flatten()
    assignment = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending in each
    token_of, slot_of = assignment // expert_ids.shape[1], assignment % expert_ids.shape[1]

    def project(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return rows @ weight.to(rows.dtype).t() if scale is None else fp4_linear(rows, weight, scale)

    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=experts.w1.shape[0]).tolist()):
        if count:
            token, slot = token_of[start: start + count], slot_of[start: start + count]
            rows = x[token]
            gate = project(rows, experts.w1[expert], _at(experts.w1_scale, expert))
            up = project(rows, experts.w3[expert], _at(experts.w3_scale, expert))
            hidden = weighted_activation(gate, up, route_weights[token, slot], swiglu_limit, x.dtype)
            out = project(hidden, experts.w2[expert], _at(experts.w2_scale, expert))
            routed.index_add_(0, token, out.float())
        start += count
    return routed


def weighted_activation(gate: torch.Tensor, up: torch.Tensor, route_weights: torch.Tensor,
                        swiglu_limit: float | None, dtype: torch.dtype) -> torch.Tensor:
    """An expert's SwiGLU of its rows times each row's router weight [rows], rounded to ``dtype``: the rounding
    every implementation of ``moe_experts`` follows (scaling the output instead rounds differently in bf16)."""
    return (swiglu.reference(gate, up, swiglu_limit).float() * route_weights[:, None]).to(dtype)


def _at(scale: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if scale is None else scale[expert]
