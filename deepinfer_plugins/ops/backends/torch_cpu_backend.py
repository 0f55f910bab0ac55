"""PyTorch's own grouped GEMM as a CPU backend: ``moe_experts`` over dense expert stacks in one call per projection.

The reference runs the experts one after another (per expert a gather, three GEMMs, the activation and a scatter,
sized by per-expert counts read on the host), so a step's routed experts cost ~25 small calls per touched expert
and layer. ``torch._grouped_mm`` takes every expert's rows at once with the group bounds as a tensor; on the CPU it
multiplies each group with the GEMM the reference calls, so the result equals the reference's bit for bit
(tests/ops/test_torch_cpu_backend.py) while the call count no longer grows with the experts a step touches.

It reads dense stacks only: the CPU server keeps the experts dequantised (``envs.keep_dense_weights``); FP4 stacks
are declined to the reference. ``torch._grouped_mm`` is a private torch API, so the backend registers only where a
probe on the CPU runs and equals a plain matmul.
"""

from __future__ import annotations

import torch

from ..moe import ExpertWeights, sort_by_expert, weighted_activation
from ..registry import hookimpl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_moe_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor,
                        experts: ExpertWeights, swiglu_limit: float | None) -> torch.Tensor:
    n_experts = experts.w1.shape[0]
    if (experts.quantised or x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2
            or any(w.dtype != x.dtype or w.device.type != "cpu" for w in (experts.w1, experts.w3, experts.w2))
            or expert_ids.numel() and not 0 <= int(expert_ids.min()) <= int(expert_ids.max()) < n_experts):
        return NotImplemented  # the reference takes it (and names an out-of-range expert id)
    top_k = expert_ids.shape[1]
    _, assignment, bounds = sort_by_expert(expert_ids, n_experts)  # tokens ascending within each expert
    group_ends = bounds[1:].to(torch.int32)
    token = assignment // top_k
    rows = x[token]
    gate = torch._grouped_mm(rows, experts.w1.transpose(1, 2), offs=group_ends)
    up = torch._grouped_mm(rows, experts.w3.transpose(1, 2), offs=group_ends)
    hidden = weighted_activation(gate, up, route_weights.reshape(-1)[assignment], swiglu_limit, x.dtype)
    out = torch._grouped_mm(hidden, experts.w2.transpose(1, 2), offs=group_ends)
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, token, out.float())


def _probe() -> str | None:
    """Why ``torch._grouped_mm`` cannot serve as this backend here, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    a, b = torch.randn(3, 8), torch.randn(2, 4, 8)
    try:
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([1, 3], dtype=torch.int32))
    except RuntimeError as exc:
        return f"torch._grouped_mm does not run on the CPU ({exc})"
    if not torch.equal(got, torch.cat([a[:1] @ b[0].t(), a[1:] @ b[1].t()])):
        return "torch._grouped_mm on the CPU differs from a plain matmul"
    return None


@hookimpl
def deepinfer_register_ops(registry) -> None:
    reason = _probe()
    if reason is not None:
        registry.mark_unavailable("torch", reason)
        return
    registry.register_backend("moe_experts", "torch", grouped_moe_experts)
