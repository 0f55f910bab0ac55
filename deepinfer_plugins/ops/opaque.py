"""torch.library custom ops over registry ops whose implementations a compiler cannot trace.

The reference of ``moe_experts`` runs the experts one by one, sized by per-expert token counts read on the host:
a graph break under torch.compile, and data-dependent Python. Behind a custom op with a fake (shape-only)
implementation it is one opaque node instead, so a model that calls it compiles into one graph around it, and
the op itself still dispatches through the registry (grouped kernels on accelerators, the reference elsewhere).
No ``from __future__ import annotations`` here: torch.library reads the op schema from the annotations.
"""

from typing import Optional

import torch

from .moe import ExpertWeights, moe_experts


@torch.library.custom_op("deepinfer::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor, w1: torch.Tensor,
                    w1_scale: Optional[torch.Tensor], w3: torch.Tensor, w3_scale: Optional[torch.Tensor],
                    w2: torch.Tensor, w2_scale: Optional[torch.Tensor], swiglu_limit: Optional[float]) -> torch.Tensor:
    return moe_experts(x, route_weights, expert_ids, ExpertWeights(w1, w1_scale, w3, w3_scale, w2, w2_scale),
                       swiglu_limit)


@_moe_experts_op.register_fake
def _moe_experts_fake(x, route_weights, expert_ids, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit):
    return x.new_empty(x.shape, dtype=torch.float32)


def routed_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertWeights,
                   swiglu_limit: float | None) -> torch.Tensor:
    """``ops.moe_experts`` as the opaque op ``deepinfer::moe_experts`` (same arguments, same result)."""
    return torch.ops.deepinfer.moe_experts(x, route_weights, expert_ids, *experts, swiglu_limit)
