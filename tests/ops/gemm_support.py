"""Tolerances and inputs for the GEMM backends that quantise their activation to FP8 on the way in (DeepGEMM,
FlashInfer, the Ascend MX GEMMs), shared by their tests."""

from __future__ import annotations

import torch

from deepinfer_plugins import ops
from deepinfer_plugins.ops.quant import quantize_fp4_weight

# The backends quantise activations to E4M3 (3 mantissa bits, round to nearest: relative error <= 2^-4 per
# element); over a dot product of independent errors the output error is well under this relative norm.
ACTIVATION_FP8_REL_TOL = 0.04
# Against the same quantised activation, the only difference left is the output rounding of bf16 (2^-8) plus
# fp32 summation order.
OUTPUT_ROUNDING_REL_TOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}
# Routed experts round activations to E4M3 twice (before gate / up and before down).
MOE_FP8_REL_TOL = 0.08


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()



def stacked_fp4_experts(n_experts, dim, inter, seed=3):
    g = torch.Generator().manual_seed(seed)

    def stack(out_features, in_features):
        pairs = [quantize_fp4_weight(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
                 for _ in range(n_experts)]
        return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, dim), stack(inter, dim), stack(dim, inter)
    return ops.ExpertWeights(w1, s1, w3, s3, w2, s2)


def routing(tokens, n_experts, top_k, seed=4, only=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    for t in range(tokens):
        ids[t] = torch.randperm(n_experts, generator=g)[:top_k]
    if only is not None:  # every token's first choice is one expert
        ids[:, 0] = only
        for t in range(tokens):
            rest = [e for e in torch.randperm(n_experts, generator=g).tolist() if e != only]
            ids[t, 1:] = torch.tensor(rest[: top_k - 1])
    return torch.rand(tokens, top_k, generator=g), ids


def fp8_activation_linear(rows, weight, scale):
    """A projection as the grouped GEMM computes it: E4M3 activation rows times the FP4 weight, exact, rounded to
    the rows' dtype."""
    activation = ops.fp8_fake_quant.reference(rows.float(), 32).double()
    return (activation @ ops.dequant_fp4_weight(weight, scale, torch.float64).t()).to(rows.dtype)
