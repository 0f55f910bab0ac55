"""RMSNorm with a learned weight; V4.1 uses eps = 1e-20, so the statistics are always taken in fp32."""

from __future__ import annotations

import torch
from torch import nn

from ... import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def of_streams(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The norm of the mHC streams [T, S, d] collapsed with ``pre`` [T, S]: one op, so a kernel reads the
        streams once and never writes the collapsed rows."""
        return ops.hc_collapse_norm(streams, pre, self.weight, self.eps)
