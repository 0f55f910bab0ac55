"""The one linear dispatch: every projection of the model goes through ``Linear``.

A weight is stored exactly as the checkpoint holds it, so ``load_state_dict(strict=True)`` takes the raw
official tensors and nothing is dequantised at load:
  * float weight (bf16 / fp32): plain matmul;
  * FP8 E4M3 weight + ``scale`` (E8M0, one per 32x32 block): dense checkpoint layers;
  * FP4 E2M1 weight packed two per int8 + ``scale`` (E8M0, one per row and 32 columns): routed experts.
Quantised weights go through the ``linear_fp8`` / ``linear_fp4`` ops: the reference dequantises on the fly, per
call, into the activation dtype. At full scale that keeps the FP4 experts at 0.53 bytes per parameter
(dequantising them at load to bf16 would need ~1.1 TB instead of ~289 GB); the cost is one dequantisation per
use, which the DeepGEMM / FlashInfer backends avoid by feeding the stored weight to a block-scaled GEMM.
On a CPU with memory to spare, ``keep_dense`` trades memory for speed: the dequantised weight is kept.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops

WEIGHT_BLOCK = 32


class Linear(nn.Module):
    """y = x @ W^T for a float, FP8-block or FP4-packed W.  x [..., in] -> [..., out]."""

    def __init__(self, in_features: int, out_features: int, fmt: str = "float", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        if fmt == "float":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        elif fmt == "fp8":
            rows, cols = -(-out_features // WEIGHT_BLOCK), -(-in_features // WEIGHT_BLOCK)
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e8m0fnu), requires_grad=False)
        elif fmt == "fp4":
            if in_features % WEIGHT_BLOCK:
                raise ValueError(f"FP4 linear needs in_features divisible by {WEIGHT_BLOCK}, got {in_features}")
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // WEIGHT_BLOCK,
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            raise ValueError(f"unknown weight format {fmt!r}; expected 'float', 'fp8' or 'fp4'")

    def keep_dense(self, dtype: torch.dtype) -> None:
        """Keep the dequantised weight in ``dtype`` (memory: out * in * itemsize) instead of rebuilding it. A float
        weight stored in ``dtype`` is its own dense form: nothing is kept (nor registered as a second parameter)."""
        dense = self.dense_weight(dtype)
        if dense is not self.weight:
            self.dense = dense

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        dense = getattr(self, "dense", None)
        if dense is not None and dense.dtype == dtype:
            return dense
        if self.fmt == "fp8":
            return ops.dequant_fp8_weight(self.weight, self.scale, dtype)
        if self.fmt == "fp4":
            return ops.dequant_fp4_weight(self.weight, self.scale, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = getattr(self, "dense", None)
        if dense is not None and dense.dtype == x.dtype:
            return x @ dense.t()
        if self.fmt == "fp8":
            return ops.linear_fp8(x, self.weight, self.scale)
        if self.fmt == "fp4":
            return ops.linear_fp4(x, self.weight, self.scale)
        return x @ self.weight.to(x.dtype).t()

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, G, in] -> [n, G, out / G]: group g multiplies its input by the g-th of G equal row blocks of W (a
        block-diagonal product: wo_a's grouped projection)."""
        dense = getattr(self, "dense", None)
        if self.fmt == "fp8" and (dense is None or dense.dtype != x.dtype):
            return ops.linear_fp8_grouped(x, self.weight, self.scale)
        return torch.einsum("ngi,goi->ngo", x, self.dense_weight(x.dtype).unflatten(0, (x.shape[1], -1)))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"
