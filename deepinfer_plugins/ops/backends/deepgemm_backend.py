"""DeepGEMM backend: ``linear_fp8`` / ``linear_fp4`` as DeepGEMM's ``fp8_gemm_nt`` (an alias of ``fp8_fp4_gemm_nt``).

Registers only on a CUDA device of compute capability 9.x or 10.x whose Python can import ``deep_gemm``; the import
happens at discovery (first dispatch), never at package import. Interface as documented in DeepGEMM's README and
``csrc/apis/{gemm,layout}.hpp``: ``fp8_gemm_nt((a, sfa), (b, sfb), d, recipe=(gran_m, gran_n, gran_k))`` computes
``d = (a * sfa) @ (b * sfb)^T`` with a [m, k] and b [n, k] both K-major, FP32 scales in their natural shapes
[ceil(m/gran_m), ceil(k/gran_k)] and [ceil(n/gran_n), ceil(k/gran_k)] (DeepGEMM moves them into its TMA layout
itself, packing them to UE8M0 on SM100), and d bf16 or fp32 [m, n] row-major.

Per architecture:
  * SM100: gran_k 32 is supported and a scale may cover a gran_n x gran_k block, so the checkpoint layouts go in
    unchanged: FP8 weight with recipe (1, 32, 32) and its [ceil(n/32), k/32] scales; FP4 weight (packed int8,
    DeepGEMM's ``kPackedFP4``, low nibble = even column, as stored) with recipe (1, 1, 32) and its [n, k/32]
    scales. Activations: E4M3 with one power-of-two FP32 scale per token per 32 columns.
  * SM90: only gran_k 128 with FP32 scales, i.e. the classic recipe (1, 128, 128); no FP4 operand. The 32x32
    block scales are therefore folded into one scale per 128x128 block: each 32x32 block is shifted down by
    the power of two between its scale and its tile's largest, which is exact exactly when every shifted E4M3
    value stays representable; a weight for which that fails is declined. Activations: E4M3 with one
    power-of-two scale per token per 128 columns. ``linear_fp4`` is not registered on SM90.
A shape DeepGEMM cannot take exactly (in_features not a multiple of 128, no tokens) is declined (``NotImplemented``):
the registry's next choice (FlashInfer, Triton's fused kernel, the reference) runs it.
None of this has run against a real DeepGEMM; tests/ops/test_gemm_ops.py checks the calls against a fake.
"""

from __future__ import annotations

import functools

import torch

from ..quant import fp8_block_quant
from ..registry import hookimpl

WEIGHT_BLOCK = 32
SM90_BLOCK = 128


def _quantize_activation(x2d: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [m, k] and power-of-two FP32 scales [m, k / block] (DeepGEMM's UE8M0 ceil rule)."""
    values, scale = fp8_block_quant(x2d, block)
    return values.contiguous(), scale.float().contiguous()


def requantize_to_128_blocks(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same weight values as E4M3 with one FP32 scale per 128x128 block, or None where that is not exact.

    Every scale is a power of two, so w * s == (w * s / S) * S for the tile's largest scale S; the shifted value
    w * s / S is a smaller power-of-two multiple of an E4M3 value and only rounds once it drops below E4M3's
    subnormal step, which the comparison below detects.
    """
    out_features, in_features = weight.shape
    if in_features % SM90_BLOCK:
        return None
    ratio = SM90_BLOCK // WEIGHT_BLOCK
    block_scale = scale.float()
    padded_rows = -(-block_scale.shape[0] // ratio) * ratio
    padded = torch.zeros(padded_rows, block_scale.shape[1], dtype=torch.float32, device=block_scale.device)
    padded[: block_scale.shape[0]] = block_scale
    tile_scale = padded.unflatten(0, (-1, ratio)).unflatten(2, (-1, ratio)).amax(dim=(1, 3))
    per_element = block_scale.repeat_interleave(WEIGHT_BLOCK, 0).repeat_interleave(WEIGHT_BLOCK, 1)
    per_element = per_element[:out_features, :in_features]
    tile_per_element = tile_scale.repeat_interleave(SM90_BLOCK, 0).repeat_interleave(SM90_BLOCK, 1)
    tile_per_element = tile_per_element[:out_features, :in_features]
    exact = weight.float() * per_element
    shifted = (exact / tile_per_element).to(torch.float8_e4m3fn)
    if not torch.equal(shifted.float() * tile_per_element, exact):
        return None
    return shifted, tile_scale.contiguous()


def _gemm(x: torch.Tensor, a: tuple, b: tuple, out_features: int, recipe: tuple[int, int, int]) -> torch.Tensor:
    import deep_gemm

    out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    d = torch.empty(a[0].shape[0], out_features, dtype=out_dtype, device=x.device)
    deep_gemm.fp8_gemm_nt(a, b, d, recipe=recipe)
    return d.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _declines(x: torch.Tensor, in_features: int) -> bool:
    return in_features % SM90_BLOCK != 0 or x.numel() == 0


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, arch: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    if _declines(x, in_features):
        return NotImplemented
    x2d = x.reshape(-1, in_features)
    if arch == 10:
        a = _quantize_activation(x2d, WEIGHT_BLOCK)
        return _gemm(x, a, (weight, scale.float()), out_features, (1, WEIGHT_BLOCK, WEIGHT_BLOCK))
    converted = requantize_to_128_blocks(weight, scale)
    if converted is None:
        return NotImplemented
    a = _quantize_activation(x2d, SM90_BLOCK)
    return _gemm(x, a, converted, out_features, (1, SM90_BLOCK, SM90_BLOCK))


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, arch: int) -> torch.Tensor:
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    if arch != 10 or _declines(x, in_features):
        return NotImplemented
    a = _quantize_activation(x.reshape(-1, in_features), WEIGHT_BLOCK)
    return _gemm(x, a, (weight.view(torch.int8), scale.float()), out_features, (1, 1, WEIGHT_BLOCK))


@hookimpl
def deepinfer_register_ops(registry) -> None:
    arch = registry.cuda_major("deepgemm")
    if arch is None:
        return
    if arch not in (9, 10):
        registry.mark_unavailable("deepgemm", f"DeepGEMM GEMMs need SM90 or SM100, this device is SM{arch}x")
        return
    try:
        import deep_gemm  # noqa: F401  (lazy: JIT-compiles with nvcc on first use)
    except Exception as exc:  # a broken install must leave the reference in place, not break dispatch
        registry.mark_unavailable("deepgemm", f"cannot import deep_gemm ({type(exc).__name__}: {exc})")
        return
    registry.register_backend("linear_fp8", "deepgemm", functools.partial(linear_fp8, arch=arch))
    if arch == 10:
        registry.register_backend("linear_fp4", "deepgemm", functools.partial(linear_fp4, arch=arch))
