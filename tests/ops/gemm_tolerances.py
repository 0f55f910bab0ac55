"""Tolerances of a GEMM backend that quantises its activation to FP8 on the way in (DeepGEMM, FlashInfer, the
Ascend MX GEMMs), shared by their tests."""

from __future__ import annotations

import torch

# The backends quantise activations to E4M3 (3 mantissa bits, round to nearest: relative error <= 2^-4 per
# element); over a dot product of independent errors the output error is well under this relative norm.
ACTIVATION_FP8_REL_TOL = 0.04
# Against the same quantised activation, the only difference left is the output rounding of bf16 (2^-8) plus
# fp32 summation order.
OUTPUT_ROUNDING_REL_TOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()
