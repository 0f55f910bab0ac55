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
``linear_fp8_grouped`` (wo_a: x [n, G, in] against G row blocks of one FP8 weight) is DeepGEMM's
``fp8_einsum("bhr,hdr->bhd", (x, sfx), (W [G, out/G, in], sfw), d, recipe=...)``, a batched FP8 GEMM over the
groups (``csrc/apis/einsum.hpp``), with the same weight scales per architecture as above: the checkpoint's
[G, out/G/32, in/32] at (1, 32, 32) on SM100, the 128x128 fold on SM90. A group's rows must hold whole scale blocks
(out/G a multiple of 32, or 128 on SM90); otherwise the call is declined. It registers only where the installed
DeepGEMM has ``fp8_einsum``.
A shape DeepGEMM cannot take exactly (in_features not a multiple of 128, no tokens) is declined (``NotImplemented``):
the registry's next choice (FlashInfer, Triton's fused kernel, the reference) runs it.

``moe_experts`` (SM100, FP4 experts, bf16 activations) runs a layer's routed experts as three
``m_grouped_fp8_fp4_gemm_nt_contiguous`` calls (gate, up, down) in the contiguous layout with PSUM offsets: the
(token, slot) assignments sorted by expert, each expert's rows starting at the previous expert's end aligned up
to ``get_mk_alignment_for_contiguous_layout()``, ``grouped_layout`` [E] int32 the end of each expert's rows
(the layout DeepGEMM's own tests build). Everything is sized from the shapes (the rows buffer holds the most
rows any routing can need), so no token count is read on the host. The weight scales are handed over in the
library's own packed UE8M0 layout, made by ``transform_sf_into_required_layout`` once per stacked tensor (and
again after an in-place reload): the library would otherwise convert them from fp32 on every call, 0.57 GB for
one layer's w1 scales at V4.1 size. The packed copies cost about as much memory as the checkpoint's scales
(1/16 of the FP4 experts). Activations are E4M3 per token per 32 columns, as for ``linear_fp4``; SwiGLU, the
router weight and the fp32 combine in ascending expert id follow the reference op by op.

None of this has run against a real DeepGEMM; tests/ops/test_gemm_ops.py checks the calls against a fake.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..moe import ExpertWeights, combine_in_expert_order, sort_by_expert, weighted_activation
from ..quant import fp8_block_quant
from ..registry import hookimpl

WEIGHT_BLOCK = 32
SM90_BLOCK = 128
GROUPED_RECIPE = (1, 1, WEIGHT_BLOCK)  # one scale per row per 32 columns for activations and FP4 weights


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


def _fp8_weight_operand(weight: torch.Tensor, scale: torch.Tensor, arch: int):
    """(scale block, (E4M3 weight, FP32 scales)) as DeepGEMM takes them on ``arch``: the checkpoint's 32x32 scales
    on SM100, the exact 128x128 fold on SM90; None where that fold is not exact."""
    if arch == 10:
        return WEIGHT_BLOCK, (weight, scale.float())
    converted = requantize_to_128_blocks(weight, scale)
    return None if converted is None else (SM90_BLOCK, converted)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, arch: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    operand = None if _declines(x, in_features) else _fp8_weight_operand(weight, scale, arch)
    if operand is None:
        return NotImplemented
    block, b = operand
    a = _quantize_activation(x.reshape(-1, in_features), block)
    return _gemm(x, a, b, out_features, (1, block, block))


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, arch: int) -> torch.Tensor:
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    if arch != 10 or _declines(x, in_features):
        return NotImplemented
    a = _quantize_activation(x.reshape(-1, in_features), WEIGHT_BLOCK)
    return _gemm(x, a, (weight.view(torch.int8), scale.float()), out_features, (1, 1, WEIGHT_BLOCK))


def linear_fp8_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, arch: int) -> torch.Tensor:
    if x.dim() != 3 or x.shape[1] < 1 or weight.shape[0] % x.shape[1]:
        return NotImplemented
    n, groups, in_features = x.shape
    rows = weight.shape[0] // groups
    block = WEIGHT_BLOCK if arch == 10 else SM90_BLOCK
    if _declines(x, in_features) or weight.shape[1] != in_features or rows % block:
        return NotImplemented  # a scale block straddling two groups has no per-group shape
    operand = _fp8_weight_operand(weight, scale, arch)
    if operand is None:
        return NotImplemented
    _, (b_data, b_scale) = operand
    import deep_gemm

    a = _quantize_activation(x, block)
    b = (b_data.view(groups, rows, in_features), b_scale.view(groups, rows // block, -1))
    d = torch.empty(n, groups, rows, dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32,
                    device=x.device)
    deep_gemm.fp8_einsum("bhr,hdr->bhd", a, b, d, recipe=(1, block, block))
    return d.to(x.dtype)


_packed_scales: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def packed_weight_scales(scale: torch.Tensor, mn: int, k: int) -> torch.Tensor:
    """A stacked weight's E8M0 scales [E, mn, k / 32] in DeepGEMM's packed layout, made by the library (the layout
    is its own) once per tensor and per in-place update (``_version``); the entry goes when the tensor does."""
    import deep_gemm

    key = id(scale)
    cached = _packed_scales.get(key)
    if cached is not None and cached[0]() is scale and cached[1] == scale._version:
        return cached[2]
    packed = deep_gemm.transform_sf_into_required_layout(scale.float(), mn, k, GROUPED_RECIPE,
                                                        num_groups=scale.shape[0], is_sfa=False)
    _packed_scales[key] = (weakref.ref(scale, lambda _: _packed_scales.pop(key, None)), scale._version, packed)
    return packed


def contiguous_layout(expert_ids: torch.Tensor, n_experts: int, alignment: int):
    """(assignment ids token * k + slot sorted by expert, stably; each sorted row's row in the padded buffer;
    grouped_layout [E] int32; the buffer's rows), all on the device. The PSUM layout as DeepGEMM's tests build
    it: expert e's rows start at align(grouped_layout[e - 1], alignment) and end at grouped_layout[e], the
    padding between them skipped by the kernel. The buffer is sized for the worst routing: every non-empty
    expert pads at most ``alignment - 1`` rows."""
    assignments = expert_ids.numel()
    sorted_experts, order, bounds = sort_by_expert(expert_ids, n_experts)
    counts = bounds[1:] - bounds[:-1]
    aligned = (counts + alignment - 1) // alignment * alignment
    start = aligned.cumsum(0) - aligned
    rows = start[sorted_experts] + torch.arange(assignments, device=expert_ids.device) - bounds[sorted_experts]
    capacity = assignments + min(assignments, n_experts) * (alignment - 1)
    return order, rows, (start + counts).to(torch.int32), capacity


def _grouped_gemm(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, capacity: int,
                  weight: torch.Tensor, weight_scale: torch.Tensor, grouped_layout: torch.Tensor,
                  rows_per_expert: int) -> torch.Tensor:
    """E4M3 rows [S, K] with scales [S, K / 32] times their experts' FP4 weight [E, N, K / 2] -> bf16 [S, N]."""
    import deep_gemm

    k, n = values.shape[1], weight.shape[1]
    a = torch.empty(capacity, k, dtype=values.dtype, device=values.device)  # gaps: skipped, as in DeepGEMM's tests
    sfa = torch.empty(capacity, k // WEIGHT_BLOCK, dtype=torch.float32, device=values.device)
    a[rows], sfa[rows] = values, scales
    d = torch.empty(capacity, n, dtype=torch.bfloat16, device=values.device)
    deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous((a, sfa), (weight.view(torch.int8), packed_weight_scales(
        weight_scale, n, k)), d, grouped_layout, recipe=GROUPED_RECIPE, use_psum_layout=True,
        expected_m_for_psum_layout=rows_per_expert)
    return d[rows]


def moe_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertWeights,
                swiglu_limit: float | None, *, arch: int) -> torch.Tensor:
    tokens, dim = x.shape
    if (arch != 10 or not experts.quantised or x.dtype != torch.bfloat16 or tokens == 0
            or _declines(x, dim) or experts.w1.shape[1] % SM90_BLOCK):
        return NotImplemented
    import deep_gemm

    n_experts, top_k = experts.w1.shape[0], expert_ids.shape[1]
    order, rows, grouped_layout, capacity = contiguous_layout(expert_ids, n_experts,
                                                              deep_gemm.get_mk_alignment_for_contiguous_layout())
    token, slot = order // top_k, order % top_k
    layout = (rows, capacity)
    tuning = (grouped_layout, -(-order.numel() // n_experts))  # the kernel's config hint: rows per expert
    values, scales = fp8_block_quant(x, WEIGHT_BLOCK)
    values, scales = values[token], scales[token]
    gate = _grouped_gemm(values, scales, *layout, experts.w1, experts.w1_scale, *tuning)
    up = _grouped_gemm(values, scales, *layout, experts.w3, experts.w3_scale, *tuning)
    hidden = weighted_activation(gate, up, route_weights[token, slot], swiglu_limit, x.dtype)
    hidden_values, hidden_scales = fp8_block_quant(hidden, WEIGHT_BLOCK)
    down = _grouped_gemm(hidden_values, hidden_scales, *layout, experts.w2, experts.w2_scale, *tuning)
    return combine_in_expert_order(down, order, expert_ids)


@hookimpl
def deepinfer_register_ops(registry) -> None:
    arch = registry.cuda_major("deepgemm")
    if arch is None:
        return
    if arch not in (9, 10):
        registry.mark_unavailable("deepgemm", f"DeepGEMM GEMMs need SM90 or SM100, this device is SM{arch}x")
        return
    try:
        import deep_gemm  # lazy: JIT-compiles with nvcc on first use
    except Exception as exc:  # a broken install must leave the reference in place, not break dispatch
        registry.mark_unavailable("deepgemm", f"cannot import deep_gemm ({type(exc).__name__}: {exc})")
        return
    registry.register_backend("linear_fp8", "deepgemm", functools.partial(linear_fp8, arch=arch))
    if hasattr(deep_gemm, "fp8_einsum"):
        registry.register_backend("linear_fp8_grouped", "deepgemm", functools.partial(linear_fp8_grouped, arch=arch))
    if arch == 10:
        registry.register_backend("linear_fp4", "deepgemm", functools.partial(linear_fp4, arch=arch))
        registry.register_backend("moe_experts", "deepgemm", functools.partial(moe_experts, arch=arch))
