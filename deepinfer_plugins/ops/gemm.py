"""GEMMs against the checkpoint's weights: y = x @ W^T with W kept in its stored format (FP8 / FP4 codes, or the
bf16 router and head, whose products V4.1 takes in fp32).

The references are exactly the path the model always took (dequantise or up-cast W, then matmul), so CPU
outputs do not change; the kernels read W as stored instead of making that copy on every call. Accelerator
backends (DeepGEMM, FlashInfer) feed the stored weight straight into a block-scaled FP8 GEMM instead; their
weight side is exact, but they quantise the activation to FP8 E4M3 with power-of-two per-token block scales on
the way in. That activation rounding is the one difference from the reference a backend may introduce
(``DEEPINFER_OP_BACKEND=linear_fp8=reference`` turns it off).
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


@registry.reference("linear_fp8_grouped")
def linear_fp8_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A block-diagonal ``linear_fp8``: x [n, G, in] -> [n, G, out / G], group g multiplying its input by rows
    [g * out / G, (g + 1) * out / G) of W E4M3 [out, in] (E8M0 scales per 32x32 block of W). wo_a's grouped
    low-rank projection: one op, so that a kernel reads the FP8 weight instead of a dequantised copy per step."""
    groups = x.shape[1] if x.dim() == 3 else 0
    if groups < 1 or weight.shape[0] % groups:
        raise ValueError(f"grouped x must be [n, G, in] with G >= 1 equal row blocks of the weight "
                         f"{tuple(weight.shape)}; got x {tuple(x.shape)}")
    dense = dequant_fp8_weight(weight, scale, x.dtype).unflatten(0, (groups, -1))  # [G, out / G, in]
    return torch.einsum("ngi,goi->ngo", x, dense)


@registry.reference("linear_to_fp32")
def linear_to_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T in fp32 for float x and W [out, in] (the router and the LM head, which V4.1 computes in
    fp32). One op, so that a kernel reads the bf16 weight as stored: bf16 products are exact in fp32, so only the
    summation order differs, where an fp32 copy of the head would be 2.6 GB written and read again every step."""
    return x.float() @ weight.float().t()
