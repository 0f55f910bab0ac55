"""Quantisation boundaries of DeepSeek-V4.1: reference quantise / dequantise ops.

V4.1 was trained quantisation-aware, so these fake-quant steps are part of the model function and a faithful
BF16/FP32 forward must apply them (docs/model.md#cache-records). Each op works on the last dimension in blocks
and computes in float32; the result has the input's dtype. Kernels in every backend must match these bit for bit.

Formats:
  * FP8 E4M3, block 32, UE8M0 (power-of-two) scale: window KV and dense checkpoint weights (32x32 blocks).
  * NVFP4-style, block 16, E4M3 scale, no global scale: the shared compressed KV.
  * MXFP4, block 32, UE8M0 scale: indexer queries and keys, and the routed experts in the checkpoint.
"""

from __future__ import annotations

import torch

from .registry import registry

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # a block's |x| max is raised to this before its scale is taken (an all-zero block too)
FP4_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly: read the float exponent instead of rounding log2."""
    mantissa, exponent = torch.frexp(x)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(x), exponent)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """View x [..., n] as [..., n / block, block] in fp32; a row narrower than one block is one block."""
    block = min(block, x.shape[-1])
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def e2m1_code(magnitude: torch.Tensor) -> torch.Tensor:
    """Round |x| (already clamped to [0, 6]) to the nearest E2M1 code 0..7, ties to the even code."""
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=magnitude.dtype, device=magnitude.device)
    code = torch.bucketize(magnitude, mids)  # ties land on the lower code
    tie = (code < 7) & (magnitude == mids[code.clamp(max=6)]) & (code % 2 == 1)
    return code + tie.to(code.dtype)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=code.device)
    return grid[code.long()]


@registry.reference("fp8_block_quant")
def fp8_block_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 values [..., n], float32 power-of-two scales [..., n // block])."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax / FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1)


@registry.reference("fp8_fake_quant")
def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Window-KV precision: FP8 E4M3 with one UE8M0 scale per ``block`` channels, dequantised back."""
    q, scale = fp8_block_quant.reference(x, block)
    out = _blocks(q, block) * scale.unsqueeze(-1)
    return out.reshape(x.shape).to(x.dtype)


@registry.reference("nvfp4_fake_quant")
def nvfp4_fake_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Compressed-KV precision: E2M1 values with an E4M3 scale per 16 channels (no global scale)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-9)
    # saturate explicitly: torch 2.11 casts an out-of-range value to NaN, torch 2.13 to 448
    scale = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    scaled = (xb / scale).clamp(-FP4_MAX, FP4_MAX)
    out = torch.sign(scaled) * e2m1_value(e2m1_code(scaled.abs())) * scale
    return out.reshape(x.shape).to(x.dtype)


@registry.reference("mxfp4_fake_quant")
def mxfp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer precision: E2M1 values with a UE8M0 (power-of-two) scale per 32 channels."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax / FP4_MAX)
    scaled = (xb / scale).clamp(-FP4_MAX, FP4_MAX)
    out = torch.sign(scaled) * e2m1_value(e2m1_code(scaled.abs())) * scale
    return out.reshape(x.shape).to(x.dtype)


@registry.reference("dequant_fp8_weight")
def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """FP8 weight [out, in] with E8M0 block scales [ceil(out/b), ceil(in/b)] -> dense weight in ``dtype``."""
    out_features, in_features = weight.shape
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_features, :in_features]
    return (weight.float() * s).to(dtype)


@registry.reference("dequant_fp4_weight")
def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """FP4 E2M1 weight packed two per byte [out, in/2] (even column = low nibble) with E8M0 scales [out, in/b]."""
    byte = packed.view(torch.uint8)
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1).reshape(packed.shape[0], -1)  # [out, in]
    magnitude = e2m1_value(codes & 0x7)
    values = torch.where((codes & 0x8).bool(), -magnitude, magnitude)
    return (values * scale.float().repeat_interleave(block, 1)).to(dtype)


def quantize_fp8_weight(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint writer side of ``dequant_fp8_weight``: 2-D blocks of ``block`` x ``block``, E8M0 scales."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax / FP8_MAX)  # [rows, cols]
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_features, :in_features]
    q = (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def quantize_fp4_weight(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint writer side of ``dequant_fp4_weight``: MXFP4 rows, packed two codes per int8 byte."""
    wb = _blocks(weight, block)
    amax = wb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax / FP4_MAX)
    scaled = (wb / scale).clamp(-FP4_MAX, FP4_MAX)
    codes = e2m1_code(scaled.abs()) | ((scaled < 0).to(torch.int64) << 3)
    codes = codes.reshape(weight.shape[0], -1).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.squeeze(-1).to(torch.float8_e8m0fnu)


def quantize_fp8_rows(table: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table rows: E4M3 values with one E8M0 scale per ``block`` columns of each row."""
    q, scale = fp8_block_quant.reference(table, block)
    return q, scale.to(torch.float8_e8m0fnu)


def dequant_fp8_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    expanded = scale.float().repeat_interleave(block, -1)[..., : values.shape[-1]]
    return (values.float() * expanded).to(dtype)
