"""Mixture of experts: sqrt-softplus router with noaux_tc correction bias, FP4 routed experts, a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from .args import ModelArgs
from .linear import Linear


class Expert(nn.Module):
    """SwiGLU FFN: w2(silu(w1 x) * w3 x), with the activation clamp of ``swiglu_limit`` when given.

    A routed expert's gate weight scales the activation before ``w2`` (as the reference does; scaling the
    output instead rounds differently in bf16)."""

    def __init__(self, dim: int, inter_dim: int, fmt: str, swiglu_limit: float | None):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fmt)
        self.w2 = Linear(inter_dim, dim, fmt)
        self.w3 = Linear(dim, inter_dim, fmt)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, d], weights [n] (routed experts) -> [n, d]."""
        hidden = ops.swiglu(self.w1(x), self.w3(x), self.swiglu_limit)
        if weights is not None:
            hidden = (hidden.float() * weights[:, None]).to(x.dtype)
        return self.w2(hidden)


class Gate(nn.Module):
    """Router: scores sqrt(softplus(x W^T)); ``bias`` (text) or ``bias_vl`` (image tokens) only steers selection."""

    def __init__(self, args: ModelArgs, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.route_scale = top_k, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, args.hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x.float() @ self.weight.float().t()
        return ops.sqrtsoftplus_route(logits, self.bias, self.top_k, self.route_scale)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, n_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        n_experts = n_experts or args.n_routed_experts
        self.gate = Gate(args, n_experts, top_k or args.num_experts_per_tok, dtype)
        self.experts = nn.ModuleList(
            Expert(args.hidden_size, args.moe_intermediate_size, "fp4", args.swiglu_limit) for _ in range(n_experts))
        shared_limit = args.swiglu_limit if args.clamp_shared_expert else None
        self.shared_experts = Expert(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, "fp8",
                                     shared_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, d] -> [n, d]: weighted routed experts (token choice) plus the shared expert."""
        weights, ids = self.gate(x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # (token, slot) pairs grouped by expert, tokens ascending within each; the per-expert counts are the
        # layer's one read on the host (a GPU waits for it), since each expert's GEMM size depends on them
        assignment = ids.flatten().argsort(stable=True)
        token_of, slot_of = assignment // ids.shape[1], assignment % ids.shape[1]
        start = 0
        for expert, count in zip(self.experts, torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()):
            if count:
                token, slot = token_of[start: start + count], slot_of[start: start + count]
                routed.index_add_(0, token, expert(x[token], weights[token, slot]).float())
            start += count
        return (routed + self.shared_experts(x).float()).to(x.dtype)
