"""FlashInfer backend: ``linear_fp8`` / ``linear_fp4`` as FlashInfer's MXFP8 GEMM ``flashinfer.gemm.mm_mxfp8``.

Registers only on a CUDA device of compute capability 10.x (FlashInfer's block-scaled MXFP8 kernels; SM90 has no
MX tensor-core path) whose Python can import ``flashinfer``; the import happens at discovery, never at package
import. Interface as in flashinfer-python 0.7.2 (``flashinfer/gemm/gemm_base.py``):
``mm_mxfp8(a, b, a_descale, b_descale, out_dtype=...)`` with a E4M3 [m, k] row-major, b E4M3 [k, n] column-major
(the transpose of a row-major [n, k] weight), both scales E8M0 bytes (uint8) with one scale per 32 consecutive
K, each in the 1-D "128x4" swizzled layout (2-D linear scales raise ValueError in 0.7.2), out bf16 or fp16.
The 128x4 layout of an [rows, k/32] grid, padded to 128 rows and 4 columns: element (row, col) sits at
(row // 128, col // 4, row % 32, (row // 32) % 4, col % 4) of a row-major [rows/128, k/128, 32, 4, 4] buffer.

Both weight formats become an MXFP8 operand exactly:
  * FP8: a 32x32 block scale is the per-row 1x32 scale of each of its 32 rows, so repeating each scale row 32
    times gives the same values.
  * FP4: every E2M1 value (0, 0.5, ..., 6 with sign) is exactly an E4M3 value, so the codes are re-encoded to E4M3
    bytes (one byte per weight instead of half: the cost of using the FP8 kernel) and keep their [n, k/32] scales.
Activations: E4M3 with one power-of-two scale per token per 32 columns (the same rule as the reference's
``fp8_block_quant``). A call FlashInfer cannot take exactly is declined (``NotImplemented``, the registry's next
choice runs it): in_features not a multiple of 128, out_features below 128 (``mm_mxfp8``'s minimum), activations
that are not bf16 / fp16, or no tokens.
None of this has run against a real FlashInfer; tests/ops/test_gemm_ops.py checks the calls against a fake.
"""

from __future__ import annotations

import torch

from ..quant import E2M1_GRID, fp8_block_quant
from ..registry import hookimpl

MX_BLOCK = 32
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4
MIN_OUT_FEATURES = 128
OUT_DTYPES = (torch.bfloat16, torch.float16)


def swizzle_128x4(scale_bytes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] uint8 E8M0 grid -> FlashInfer's flat 128x4 layout (rows padded to 128, cols to 4)."""
    rows, cols = scale_bytes.shape
    padded_rows = -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS
    padded_cols = -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS
    padded = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=scale_bytes.device)
    padded[:rows, :cols] = scale_bytes
    tiles = padded.reshape(padded_rows // SWIZZLE_ROWS, 4, 32, padded_cols // SWIZZLE_COLS, SWIZZLE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (E8M0 or float) as the E8M0 bytes FlashInfer reads: 2^(byte - 127)."""
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def e2m1_to_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 packed two per byte [n, k/2] (even column = low nibble) -> the same values as E4M3 [n, k]."""
    magnitudes = torch.tensor(E2M1_GRID, dtype=torch.float32, device=packed.device)
    code_values = torch.cat((magnitudes, -magnitudes))  # code bit 3 is the sign
    code_bytes = code_values.to(torch.float8_e4m3fn).view(torch.uint8)
    byte = packed.view(torch.uint8)
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1).reshape(packed.shape[0], -1)
    return code_bytes[codes.long()].view(torch.float8_e4m3fn)


def _mm_mxfp8(x: torch.Tensor, weight: torch.Tensor, weight_scale_bytes: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ (weight E4M3 [n, k] with E8M0 bytes [n, k/32])^T through ``mm_mxfp8``."""
    import flashinfer.gemm

    out_features, in_features = weight.shape
    values, scale = fp8_block_quant(x.reshape(-1, in_features), MX_BLOCK)
    scale_bytes = _e8m0_bytes(scale)
    out = flashinfer.gemm.mm_mxfp8(values.contiguous(), weight.t(), swizzle_128x4(scale_bytes),
                                   swizzle_128x4(weight_scale_bytes), out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def _declines(x: torch.Tensor, out_features: int, in_features: int) -> bool:
    return (in_features % 128 != 0 or out_features < MIN_OUT_FEATURES or x.dtype not in OUT_DTYPES
            or x.numel() == 0)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if _declines(x, out_features, in_features):
        return NotImplemented
    row_scale = _e8m0_bytes(scale).repeat_interleave(MX_BLOCK, 0)[:out_features]
    return _mm_mxfp8(x, weight.contiguous(), row_scale)


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    if _declines(x, out_features, in_features):
        return NotImplemented
    return _mm_mxfp8(x, e2m1_to_e4m3(weight), _e8m0_bytes(scale))


@hookimpl
def deepinfer_register_ops(registry) -> None:
    arch = registry.cuda_major("flashinfer")
    if arch is None:
        return
    if arch != 10:
        registry.mark_unavailable("flashinfer", f"mm_mxfp8 is wrapped for SM100 only, this device is SM{arch}x")
        return
    try:
        import flashinfer.gemm  # noqa: F401  (lazy: loads cubins / JIT on first use)
    except Exception as exc:  # a broken install must leave the reference in place, not break dispatch
        registry.mark_unavailable("flashinfer", f"cannot import flashinfer ({type(exc).__name__}: {exc})")
        return
    registry.register_backend("linear_fp8", "flashinfer", linear_fp8)
    registry.register_backend("linear_fp4", "flashinfer", linear_fp4)
