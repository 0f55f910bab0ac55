"""GEMMs against the checkpoint's quantised weights: y = x @ W^T with W kept in its stored format.

The references are exactly the path ``Linear`` always took (dequantise W into x's dtype, then matmul), so CPU
outputs do not change. Accelerator backends (DeepGEMM, FlashInfer) feed the stored weight straight into a
block-scaled FP8 GEMM instead; their weight side is exact, but they quantise the activation to FP8 E4M3 with
power-of-two per-token block scales on the way in. That activation rounding is the one difference from the
reference a backend may introduce (``DEEPINFER_OP_BACKEND=linear_fp8=reference`` turns it off).
"""

from __future__ import annotations

import torch

from .quant import dequant_fp4_weight, dequant_fp8_weight
from .registry import registry


@registry.reference("linear_fp8")
def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for W E4M3 [out, in] with E8M0 scales per 32x32 block [ceil(out/32), ceil(in/32)]."""
    return x @ dequant_fp8_weight(weight, scale, x.dtype).t()


@registry.reference("linear_fp4")
def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for W E2M1 packed two per int8 [out, in/2] with E8M0 scales per row per 32 [out, in/32]."""
    return x @ dequant_fp4_weight(weight, scale, x.dtype).t()
